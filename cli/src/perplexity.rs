//! `layerstream perplexity`: a model's perplexity on a text, by llama.cpp's `llama-perplexity`
//! method, so the two can be compared on the same file: the text is tokenized whole, cut into
//! non-overlapping windows of `--ctx` tokens (the first token of each replaced by BOS when the
//! tokenizer adds one), each window run from an empty cache, and the second half of each scored —
//! every position from `ctx/2` to the second-to-last predicting the next token. Prints the running
//! estimate per window, then `PPL ± its standard error` and tokens/s.

use anyhow::{bail, Context, Result};
use clap::Args;
use layerstream_kernels::Backend;
use layerstream_model::Store;
use layerstream_worker::{Device, KvOptions, Model};
use std::io::Write;
use std::path::PathBuf;
use std::time::Instant;

/// Flags of `layerstream perplexity`.
#[derive(Args, Debug)]
pub struct PerplexityArgs {
    /// Layer store directory; default: the embedded SmolLM2-135M-Instruct.
    #[arg(long, env = "LAYERSTREAM_MODEL")]
    pub model: Option<PathBuf>,
    /// The text to score (UTF-8).
    #[arg(long, env = "LAYERSTREAM_PPL_FILE")]
    pub file: PathBuf,
    /// Tokens per window (llama-perplexity's `-c`).
    #[arg(long, env = "LAYERSTREAM_PPL_CTX", default_value_t = 512)]
    pub ctx: usize,
    /// Score at most this many windows (llama-perplexity's `--chunks`); default: every whole one.
    #[arg(long, env = "LAYERSTREAM_PPL_CHUNKS")]
    pub chunks: Option<usize>,
    #[command(flatten)]
    pub compute: layerstream_worker::ComputeFlags,
    /// Score the second half of each window token by token, as generation decodes (one-row steps)
    /// instead of in one pass over its rows: the same number up to rounding, through the decode path.
    #[arg(long, env = "LAYERSTREAM_PPL_DECODE")]
    pub decode: bool,
    /// Print one JSON object (ppl, stderr, tokens, windows, tokens_per_s) as the last line.
    #[arg(long, env = "LAYERSTREAM_JSON")]
    pub json: bool,
    /// How keys and values are stored (to measure what a KV dtype costs in quality).
    #[command(flatten)]
    pub kv: layerstream_coordinator::KvFlags,
}

/// The result.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Perplexity {
    pub ppl: f64,
    /// Standard error of `ppl` (llama-perplexity's `+/-`).
    pub stderr: f64,
    /// Tokens scored.
    pub scored: usize,
}

/// Perplexity from per-token negative log-likelihoods (natural log), with llama-perplexity's
/// standard error: ppl × sqrt(var(nll) / (n - 1)).
pub fn from_nlls(nlls: &[f64]) -> Perplexity {
    let n = nlls.len() as f64;
    let mean = nlls.iter().sum::<f64>() / n;
    let mean2 = nlls.iter().map(|x| x * x).sum::<f64>() / n;
    let ppl = mean.exp();
    let stderr = if nlls.len() > 1 {
        ppl * ((mean2 - mean * mean) / (n - 1.0)).max(0.0).sqrt()
    } else {
        0.0
    };
    Perplexity { ppl, stderr, scored: nlls.len() }
}

/// Runs the command.
pub fn run(args: PerplexityArgs) -> Result<()> {
    if args.ctx < 4 {
        bail!("--ctx must be at least 4 (half of each window is context, half is scored)");
    }
    args.compute.apply_threads()?;
    let store = Store::open(&crate::run::model_dir(&args.model)?)?;
    let context = store.manifest.config.max_position_embeddings;
    if args.ctx > context {
        bail!("--ctx {} exceeds the model's context of {context} positions", args.ctx);
    }
    let tok = store.tokenizer()?;
    let text = std::fs::read_to_string(&args.file)
        .with_context(|| format!("reading {}", args.file.display()))?;
    let tokens = tok.encode(&text)?;
    // llama.cpp puts BOS first in every window when its tokenizer adds one.
    let bos = store.manifest.config.bos_token_id.filter(|&b| tokens.first() == Some(&b));
    let whole = tokens.len() / args.ctx;
    let windows = args.chunks.map_or(whole, |c| c.min(whole));
    if windows == 0 {
        bail!(
            "{} has {} tokens: fewer than one window of --ctx {}",
            args.file.display(),
            tokens.len(),
            args.ctx
        );
    }
    crate::run::check_device(&args.compute.device)?;
    let windows: Vec<Vec<u32>> = (0..windows)
        .map(|i| {
            let mut w = tokens[i * args.ctx..(i + 1) * args.ctx].to_vec();
            if let Some(b) = bos {
                w[0] = b;
            }
            w
        })
        .collect();
    match Device::open(&args.compute.device)? {
        Device::Cpu(b) => score_on(b, &store, &windows, &args),
        Device::Cuda(b) => score_on(b, &store, &windows, &args),
    }
}

fn score_on<B: Backend>(
    backend: B,
    store: &Store,
    windows: &[Vec<u32>],
    args: &PerplexityArgs,
) -> Result<()> {
    let kv = KvOptions {
        dtype: layerstream_model::dtype::parse_kv_dtype(&args.kv.dtype_for(&args.compute.device))
            .map_err(anyhow::Error::msg)?,
        block: args.kv.kv_block,
        positions: args.ctx,
    };
    let model = Model::load_kv(backend, store, kv)?.with_precision(args.compute.precision());
    let first = args.ctx / 2;
    let started = Instant::now();
    let mut nlls = Vec::new();
    let mut err = std::io::stderr().lock();
    for (i, w) in windows.iter().enumerate() {
        let mut seq = model.new_sequence();
        if args.decode {
            nlls.extend(decode_scores(&model, w, &mut seq, first)?);
        } else {
            nlls.extend(model.score(w, &mut seq, first)?);
        }
        // The running estimate, as llama-perplexity prints it.
        let _ = write!(err, "[{}]{:.4},", i + 1, from_nlls(&nlls).ppl);
        let _ = err.flush();
    }
    let _ = writeln!(err);
    let secs = started.elapsed().as_secs_f64();
    let p = from_nlls(&nlls);
    let tokens_per_s = (windows.len() * args.ctx) as f64 / secs.max(1e-9);
    if args.json {
        println!(
            "{}",
            serde_json::json!({
                "ppl": p.ppl, "stderr": p.stderr, "scored": p.scored, "windows": windows.len(),
                "ctx": args.ctx, "tokens_per_s": tokens_per_s,
            })
        );
    } else {
        println!(
            "Final estimate: PPL = {:.4} +/- {:.5} ({} tokens scored in {} windows of {}; {:.1} tokens/s)",
            p.ppl,
            p.stderr,
            p.scored,
            windows.len(),
            args.ctx,
            tokens_per_s
        );
    }
    Ok(())
}

/// `Model::score` through the decode path: the first half as one prefill, then one token a step,
/// each next token's NLL from that step's logits.
fn decode_scores<B: Backend>(
    model: &Model<B>,
    w: &[u32],
    seq: &mut layerstream_worker::SeqState,
    first: usize,
) -> Result<Vec<f64>> {
    use layerstream_kernels::host::nll;
    let mut logits = model.forward(&mut [(&w[..=first], &mut *seq)])?.remove(0);
    let mut out = Vec::with_capacity(w.len() - first);
    for i in first..w.len() - 1 {
        out.push(nll(&logits, w[i + 1]));
        if i + 2 < w.len() {
            logits = model.forward(&mut [(&w[i + 1..i + 2], &mut *seq)])?.remove(0);
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Perplexity is exp of the mean NLL; its error llama-perplexity's formula.
    #[test]
    fn perplexity_and_its_error() {
        let p = from_nlls(&[1.0, 2.0, 3.0]);
        assert!((p.ppl - 2f64.exp()).abs() < 1e-12);
        // var = (1+4+9)/3 - 4 = 2/3; sqrt(var / 2) = sqrt(1/3).
        assert!((p.stderr - 2f64.exp() * (1.0f64 / 3.0).sqrt()).abs() < 1e-12);
        assert_eq!(from_nlls(&[0.5]).stderr, 0.0);
    }
}
