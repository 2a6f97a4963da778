//! The `layerstream` command: import checkpoints into layer stores, verify them, and run models.

mod prompt;
mod run;

use anyhow::Result;
use clap::{Parser, Subcommand};
use std::path::PathBuf;

/// Run LLMs bigger than your GPU by streaming layer weights.
#[derive(Parser, Debug)]
#[command(name = "layerstream", version)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand, Debug)]
enum Cmd {
    /// Import an HF checkpoint directory or a GGUF file into a layer store.
    Import {
        /// HF directory (config.json + safetensors) or .gguf file.
        src: PathBuf,
        /// New store directory.
        dst: PathBuf,
    },
    /// Check every checksum of a layer store.
    Verify {
        /// Store directory.
        store: PathBuf,
    },
    /// Fetch and import the embedded default model (SmolLM2-135M-Instruct) and print its store path.
    Fetch,
    /// Generate text on the CPU from a store, fully resident.
    Run(run::RunArgs),
}

fn main() -> Result<()> {
    match Cli::parse().cmd {
        Cmd::Import { src, dst } => {
            let m = layerstream_model::import::import(&src, &dst, true)?;
            let bytes: u64 = m.files.iter().map(|f| f.size).sum();
            println!(
                "imported {:?}: {} layers, {} files, {:.1} MB -> {}",
                m.config.arch, m.config.num_layers, m.files.len(), bytes as f64 / 1e6, dst.display()
            );
        }
        Cmd::Verify { store } => {
            let s = layerstream_model::Store::open(&store)?;
            s.verify()?;
            println!("ok: {} files verified in {}", s.manifest.files.len(), store.display());
        }
        Cmd::Fetch => println!("{}", layerstream_model::fetch::default_store()?.display()),
        Cmd::Run(args) => run::run(args)?,
    }
    Ok(())
}
