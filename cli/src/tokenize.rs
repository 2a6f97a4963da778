//! `layerstream tokenize`: a text's token ids under a store's tokenizer or a GGUF file's (vocab-only
//! files included), printed as a JSON list — to check a tokenizer against a peer's test vectors.

use anyhow::{bail, Context, Result};
use clap::Args;
use layerstream_model::{Store, Tokenizer};
use std::path::PathBuf;

/// Flags of `tokenize`.
#[derive(Args, Debug)]
pub struct TokenizeArgs {
    /// A layer store directory, or a GGUF file (a vocab-only one will do).
    #[arg(long, env = "LAYERSTREAM_MODEL")]
    pub model: PathBuf,
    /// Add what the tokenizer adds around a text (a BOS token, …), as HF's `add_special_tokens`.
    #[arg(long, env = "LAYERSTREAM_ADD_SPECIAL")]
    pub add_special: bool,
    /// Read the text from this file instead of the argument.
    #[arg(long, env = "LAYERSTREAM_TOKENIZE_FILE", conflicts_with = "text")]
    pub file: Option<PathBuf>,
    /// The text.
    pub text: Option<String>,
}

/// The tokenizer of a store directory or a GGUF file.
pub fn load(model: &std::path::Path) -> Result<Tokenizer> {
    if model.is_dir() {
        return Ok(Store::open(model)?.tokenizer()?);
    }
    Tokenizer::from_gguf(model)
        .with_context(|| format!("reading the tokenizer of {}", model.display()))
}

/// Runs the command.
pub fn run(a: TokenizeArgs) -> Result<()> {
    let text = match (&a.file, &a.text) {
        (Some(f), _) => {
            std::fs::read_to_string(f).with_context(|| format!("reading {}", f.display()))?
        }
        (None, Some(t)) => t.clone(),
        (None, None) => bail!("give the text as an argument or with --file"),
    };
    let ids = load(&a.model)?.encode_with(&text, a.add_special)?;
    println!("{}", serde_json::to_string(&ids)?);
    Ok(())
}
