//! The `layerstream` command: import checkpoints into layer stores, verify them, run models locally,
//! start the streaming stack (`up`) and submit jobs to it; also runs each of the stack's processes.

mod bench;
mod bench_api;
mod bench_experts;
mod bench_grammar;
mod bench_kv;
mod bench_matvec;
mod bench_pipeline;
mod bench_report;
mod bench_spec;
mod bench_spec_cost;
mod calibration;
mod exits;
mod fetch;
mod fit;
mod flags_doc;
mod health;
mod hf_export;
mod otlp_sink;
mod perplexity;
mod plan;
mod plan_experts;
mod prompt;
mod run;
mod served;
mod submit;
mod tokenize;
mod up;

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
    /// Write a store with random weights of a real model's shapes (for speed measurements).
    Synth {
        /// Shape: tiny, smollm2-135m, llama-3-8b, llama-3-70b, llama-3.2-1b (the 70B's draft);
        /// mixtures of experts (every expert in its own file): tiny-moe, qwen3-30b-a3b,
        /// qwen3-235b-a22b, mixtral-8x7b; deepseek-v3, gpt-oss-120b, gpt-oss-20b.
        #[arg(long, env = "LAYERSTREAM_SYNTH_SHAPE")]
        shape: String,
        /// Weight type of the layers: any stored format (f32, f16, bf16, q8_0, q4_0, q4_1, q5_0,
        /// q5_1, q2_k, q3_k, q4_k, q5_k, q6_k, iq4_nl, iq4_xs, tq1_0, tq2_0, mxfp4, and the
        /// pre-quantized checkpoints' fp8_e4m3_b128, int8_b128, int4_g128).
        #[arg(long, env = "LAYERSTREAM_SYNTH_DTYPE", default_value = "q4_k")]
        dtype: String,
        /// Number of layers (default: the real model's).
        #[arg(long, env = "LAYERSTREAM_SYNTH_LAYERS")]
        layers: Option<usize>,
        /// Random seed.
        #[arg(long, env = "LAYERSTREAM_SYNTH_SEED", default_value_t = 1)]
        seed: u64,
        /// Also write the same weights as a GGUF file here (dense shapes), for llama.cpp to run.
        #[arg(long, env = "LAYERSTREAM_SYNTH_GGUF")]
        gguf: Option<PathBuf>,
        /// Also write the same weights as a Hugging Face checkpoint in this directory (dense
        /// shapes; quantized weights as the f32 values they dequantize to), for transformers.
        #[arg(long, env = "LAYERSTREAM_SYNTH_HF")]
        hf: Option<PathBuf>,
        /// New store directory.
        dst: PathBuf,
    },
    /// Host→device copy speed: pinned vs pageable vs registered host memory (CUDA builds).
    H2dBench {
        /// Device.
        #[arg(long, env = "LAYERSTREAM_H2D_DEVICE", default_value = "cuda:0")]
        device: String,
        /// Copy sizes in MiB.
        #[arg(
            long,
            env = "LAYERSTREAM_H2D_MIB",
            value_delimiter = ',',
            default_value = "64,256,512"
        )]
        mib: Vec<usize>,
        /// Copies per size.
        #[arg(long, env = "LAYERSTREAM_H2D_ITERS", default_value_t = 10)]
        iters: usize,
    },
    /// Decode matvec bandwidth per weight type, shape and activation rows vs the device's peak,
    /// kernels side by side.
    MatvecBench(bench_matvec::MatvecBenchArgs),
    /// Fetch and import the embedded default model (SmolLM2-135M-Instruct) and print its store path.
    Fetch,
    /// Generate text on the CPU from a store, fully resident.
    Run(run::RunArgs),
    /// A model's perplexity on a text, by llama.cpp's llama-perplexity method.
    Perplexity(perplexity::PerplexityArgs),
    /// Start the loader daemon, N workers and the coordinator; stop them all on Ctrl-C.
    Up(up::UpArgs),
    /// What `up` would place where on this machine (memory shares, resident and streamed layers,
    /// KV capacity, the tiers a pass reads, the disk measured, predicted tokens/s), before
    /// anything starts.
    Plan(plan::PlanArgs),
    /// Send one request to a running coordinator and stream the answer.
    Submit(submit::SubmitArgs),
    /// Run the loader daemon (as the `loader-daemon` binary does).
    LoaderDaemon(layerstream_loader::LoaderArgs),
    /// Run a worker (as the `worker` binary does).
    Worker(layerstream_worker::WorkerArgs),
    /// Run the coordinator (as the `coordinator` binary does).
    Coordinator(layerstream_coordinator::CoordinatorArgs),
    /// Benchmark one workload streamed vs fully resident vs prefetch off.
    Bench(bench::BenchArgs),
    /// Check a server's gRPC health (exit 0 when serving).
    Health(health::HealthArgs),
    /// Receive OTLP traces and append each span to a JSON-lines file (a stand-in for Jaeger).
    OtlpSink(otlp_sink::SinkArgs),
    /// Print a text's token ids (JSON) under a store's or a GGUF file's tokenizer.
    Tokenize(tokenize::TokenizeArgs),
    /// Print the flag reference of every command as Markdown (docs/flags.md).
    #[command(hide = true)]
    FlagsDoc,
}

/// A stored weight type by name (any case): f32, f16, q4_k, ….
pub(crate) fn parse_dtype(name: &str) -> Result<layerstream_model::DType> {
    serde_json::from_value(serde_json::Value::String(name.to_lowercase())).map_err(|_| {
        let all: Vec<&str> = layerstream_model::DType::ALL.iter().map(|d| d.name()).collect();
        anyhow::anyhow!("unknown --dtype {name:?}; use one of {}", all.join(", "))
    })
}

fn block_on<F: std::future::Future<Output = Result<()>>>(f: F) -> Result<()> {
    tokio::runtime::Builder::new_multi_thread().enable_all().build()?.block_on(f)
}

fn main() -> Result<()> {
    let cli = Cli::parse();
    layerstream_kernels::cpu::isa::cap().map_err(anyhow::Error::msg)?;
    match cli.cmd {
        Cmd::Import { src, dst } => {
            let m = layerstream_model::import::import(&src, &dst, true)?;
            let bytes: u64 = m.files.iter().map(|f| f.size).sum();
            println!(
                "imported {:?}: {} layers, {} files, {:.1} MB -> {}",
                m.config.arch,
                m.config.num_layers,
                m.files.len(),
                bytes as f64 / 1e6,
                dst.display()
            );
            if let Some(n) = m.config.mla.as_ref().map(|x| x.mtp_layers_skipped).filter(|&n| n > 0)
            {
                println!(
                    "note: {n} multi-token-prediction layer(s) (num_nextn_predict_layers) not \
                     imported: transformers does not run them either (for drafting, see --spec)"
                );
            }
        }
        Cmd::Verify { store } => {
            let s = layerstream_model::Store::open(&store)?;
            s.verify()?;
            println!("ok: {} files verified in {}", s.manifest.files.len(), store.display());
        }
        Cmd::Synth { shape, dtype, layers, seed, gguf, hf, dst } => {
            let dt = parse_dtype(&dtype)?;
            let m = layerstream_model::synth::synth(&shape, dt, layers, seed, &dst)?;
            let bytes: u64 = m.files.iter().map(|f| f.size).sum();
            println!(
                "synthesized {shape} ({dt}, {} layers, {:.1} MB per layer, {:.2} GB in all) -> {}",
                m.config.num_layers,
                m.max_unit_bytes() as f64 / 1e6,
                bytes as f64 / 1e9,
                dst.display()
            );
            if let Some(g) = gguf {
                let store = layerstream_model::Store::open(&dst)?;
                layerstream_model::gguf_export::export(&store, &g)?;
                println!("the same weights as GGUF -> {}", g.display());
            }
            if let Some(h) = hf {
                hf_export::export(&layerstream_model::Store::open(&dst)?, &h)?;
                println!("the same weights as a Hugging Face checkpoint -> {}", h.display());
            }
        }
        Cmd::H2dBench { device, mib, iters } => {
            let ordinal = layerstream_kernels::cuda::parse_cuda_device(&device)
                .ok_or_else(|| anyhow::anyhow!("--device must be cuda:N"))??;
            let info = layerstream_kernels::cuda::open_device(ordinal)?;
            println!("{device}: {} ({} MiB)", info.name, info.total_bytes >> 20);
            println!("| MiB | pinned GB/s | pageable GB/s | registered GB/s | pageable/pinned |");
            println!("|---|---|---|---|---|");
            for m in mib {
                let r = layerstream_kernels::cuda_h2d::h2d_bench(ordinal, m << 20, iters.max(1))?;
                println!(
                    "| {m} | {:.1} | {:.1} | {:.1} | {:.2} |",
                    r.pinned_gbps,
                    r.pageable_gbps,
                    r.registered_gbps,
                    r.pageable_gbps / r.pinned_gbps
                );
            }
        }
        Cmd::MatvecBench(args) => bench_matvec::run(args)?,
        Cmd::Fetch => println!("{}", crate::fetch::default_store()?.display()),
        Cmd::Run(args) => run::run(args)?,
        Cmd::Perplexity(args) => perplexity::run(args)?,
        Cmd::Up(args) => up::run(args)?,
        Cmd::Plan(args) => plan::run(args)?,
        Cmd::Submit(args) => block_on(submit::run(args))?,
        Cmd::LoaderDaemon(args) => block_on(async { Ok(layerstream_loader::run(args).await?) })?,
        Cmd::Worker(args) => block_on(async { Ok(layerstream_worker::run(args).await?) })?,
        Cmd::Coordinator(args) => {
            block_on(async { Ok(layerstream_coordinator::run(args).await?) })?
        }
        Cmd::Bench(args) => bench::run(args)?,
        Cmd::Health(args) => block_on(health::run(args))?,
        Cmd::OtlpSink(args) => block_on(otlp_sink::run(args))?,
        Cmd::Tokenize(args) => tokenize::run(args)?,
        Cmd::FlagsDoc => {
            use clap::CommandFactory;
            print!("{}", flags_doc::markdown(&Cli::command()))
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::CommandFactory;

    /// Every flag group is declared once and every command's flags are consistent (clap's own check),
    /// and `up`/`bench` refuse a residency given two ways.
    #[test]
    fn flags_are_consistent_and_conflicts_are_refused() {
        Cli::command().debug_assert();
        for cmd in ["up", "bench"] {
            let e = Cli::try_parse_from([
                "layerstream",
                cmd,
                "--resident-layers",
                "2",
                "--memory-budget",
                "1G",
            ])
            .unwrap_err();
            assert_eq!(e.kind(), clap::error::ErrorKind::ArgumentConflict, "{cmd}: {e}");
        }
        let up = match Cli::try_parse_from([
            "layerstream",
            "up",
            "--max-batch",
            "3",
            "--slots",
            "7",
            "--device",
            "cpu",
        ])
        .unwrap()
        .cmd
        {
            Cmd::Up(a) => a,
            other => panic!("{other:?}"),
        };
        assert_eq!(
            (up.sched.max_batch, up.pool.slots, up.device.compute.device.as_str()),
            (3, Some(7), "cpu")
        );
    }

    /// docs/flags.md is what the commands' definitions give (regenerate it with
    /// `layerstream flags-doc > docs/flags.md`).
    #[test]
    fn the_flag_reference_is_current() {
        let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../docs/flags.md");
        let committed = std::fs::read_to_string(&path).unwrap_or_default();
        let generated = flags_doc::markdown(&Cli::command());
        assert!(
            committed == generated,
            "{} is out of date: run `cargo run -p layerstream -- flags-doc > docs/flags.md`",
            path.display()
        );
        assert!(
            generated.contains("| `--max-batch <MAX_BATCH>` | `LAYERSTREAM_MAX_BATCH` | `32` |")
        );
    }

    /// Every flag of every command reads an environment variable too (positional arguments aside).
    #[test]
    fn every_flag_has_an_environment_variable() {
        let mut missing = Vec::new();
        for sub in Cli::command().get_subcommands() {
            for arg in sub.get_arguments() {
                let builtin = matches!(arg.get_id().as_str(), "help" | "version");
                if !arg.is_positional() && !builtin && arg.get_env().is_none() {
                    missing.push(format!(
                        "{} --{}",
                        sub.get_name(),
                        arg.get_long().unwrap_or(arg.get_id().as_str())
                    ));
                }
            }
        }
        assert!(missing.is_empty(), "flags without an env var: {missing:?}");
    }
}
