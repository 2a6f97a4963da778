//! `layerstream bench`: one workload run three ways side by side — layers streamed with prefetch,
//! fully resident, and streamed with prefetch off — each on a fresh `layerstream up` stack; prints
//! tokens/s (overall, prefill, decode), bytes streamed, transfer GB/s and overlap %, and the ratios
//! between them.

use crate::bench_report::{disk_rate, predict_rows, tables};
use crate::up::{spawn_quiet, Children};
use anyhow::{bail, Context, Result};
use clap::Args;
use layerstream_coordinator::PlanFlags;
use layerstream_loader::SlotFlags;
use layerstream_rpc::v1::coordinator_client::CoordinatorClient;
use layerstream_rpc::v1::{
    generate_event, generate_request, GenerateRequest, Sampling, Stats, TokenIds,
};
use layerstream_worker::DeviceFlags;
use std::path::PathBuf;
use std::time::Instant;

/// Flags of `layerstream bench`.
#[derive(Args, Debug, Clone)]
#[command(group(clap::ArgGroup::new("residency").args(["resident_layers", "memory_budget", "fit"])))]
pub struct BenchArgs {
    /// Layer store; default: the embedded SmolLM2-135M-Instruct.
    #[arg(long, env = "LAYERSTREAM_MODEL")]
    pub model: Option<PathBuf>,
    /// Workers in each stack.
    #[arg(long, env = "LAYERSTREAM_BENCH_WORKERS", default_value_t = 1)]
    pub workers: usize,
    /// Device of the workers; `--memory-budget` sizes the streamed runs (the planner picks their
    /// resident layers), the resident run takes what the device has.
    #[command(flatten)]
    pub device: DeviceFlags,
    /// The streamed runs' plan (`--resident-layers` defaults to 0 here: everything streams).
    #[command(flatten)]
    pub plan: PlanFlags,
    /// The loader's slot pool; as many slots as layers keeps the whole model in host RAM, so the
    /// streamed runs measure the host→device link rather than the disk.
    #[command(flatten)]
    pub pool: SlotFlags,
    /// Concurrent requests (batched together).
    #[arg(long, env = "LAYERSTREAM_BENCH_BATCH", default_value_t = 4)]
    pub batch: usize,
    /// Tokens generated per request (EOS ignored).
    #[arg(long, env = "LAYERSTREAM_BENCH_MAX_NEW_TOKENS", default_value_t = 32)]
    pub max_new_tokens: u32,
    /// Prompt of every request.
    #[arg(
        long,
        env = "LAYERSTREAM_BENCH_PROMPT",
        default_value = "Explain why the sky is blue in one paragraph."
    )]
    pub prompt: String,
    /// Instead of --prompt, a prompt of this many token ids (for prefill throughput).
    #[arg(long, env = "LAYERSTREAM_BENCH_PROMPT_TOKENS")]
    pub prompt_tokens: Option<usize>,
    /// Sampling temperature of every request (0 = greedy: the head picks the token on the device).
    #[arg(long, env = "LAYERSTREAM_BENCH_TEMPERATURE", default_value_t = 0.0)]
    pub temperature: f32,
    /// Top-k of every request (0 = off).
    #[arg(long, env = "LAYERSTREAM_BENCH_TOP_K", default_value_t = 0)]
    pub top_k: u32,
    /// Top-p of every request (1 = off).
    #[arg(long, env = "LAYERSTREAM_BENCH_TOP_P", default_value_t = 1.0)]
    pub top_p: f32,
    /// Also write the results as JSON here.
    #[arg(long, env = "LAYERSTREAM_BENCH_JSON_OUT")]
    pub json_out: Option<PathBuf>,
    /// Also run the streamed configuration with `--no-verify` and print what the checksum checks
    /// cost (verified / unverified tokens/s): each layer file's first read from disk, or every
    /// read with `--verify-every-read`.
    #[arg(long, env = "LAYERSTREAM_BENCH_VERIFY_COST")]
    pub verify_cost: bool,
    /// Instead of the configurations: one fully resident stack, the workload sent alternately
    /// through gRPC and the OpenAI HTTP API (streamed) for this many rounds; prints both APIs'
    /// tokens/s and time to first token and their ratios.
    #[arg(long, env = "LAYERSTREAM_BENCH_API_COMPARE")]
    pub api_compare: Option<usize>,
    /// Instead of the configurations: micro-batches in flight (`auto` or a count) against one
    /// micro-batch (each step through the workers in turn), on fresh stacks, fully resident and
    /// streamed as the plan flags say, and pipelined with `--hidden-over-grpc`; prints `pipelined /
    /// sequential tokens/s` and the workers' busy share. Use with `--workers 2` or more.
    #[arg(long, env = "LAYERSTREAM_BENCH_MICRO_BATCHES")]
    pub micro_batches: Option<layerstream_coordinator::MicroBatches>,
    /// Instead of the configurations (mixture-of-experts stores): expert caches of these sizes per
    /// worker (`all` = every expert kept) with the attention resident, at each `--expert-batches`
    /// batch, on fresh stacks; prints bytes streamed per token against streaming whole layers
    /// (every expert), the expert-cache and prediction hit rates and tokens/s.
    #[arg(long, env = "LAYERSTREAM_BENCH_EXPERT_CACHES", value_delimiter = ',')]
    pub expert_caches: Vec<String>,
    /// Batches of the `--expert-caches` runs.
    #[arg(long, env = "LAYERSTREAM_BENCH_EXPERT_BATCHES", value_delimiter = ',', default_values_t = [1usize, 8, 32])]
    pub expert_batches: Vec<usize>,
    /// Instead of the configurations: speculative decoding — no speculation, prompt lookup and (with
    /// `--draft-model`) a draft model, each on a fresh stack with the plan flags given, over three
    /// chat workloads (an answer, a code edit, a summary) at `--batch` concurrent copies (the draft
    /// model as a chain and as trees of `--spec-width`); prints
    /// acceptance, tokens per weight pass, tok/s and speculative ÷ plain, checks every output equals
    /// the plain one, then the time of a weight pass of 1, 4, 16 and 64 positions.
    #[arg(long, env = "LAYERSTREAM_BENCH_SPECULATIVE")]
    pub speculative: bool,
    /// The draft model of `--speculative`.
    #[arg(long, env = "LAYERSTREAM_DRAFT_MODEL")]
    pub draft_model: Option<PathBuf>,
    /// Most drafted tokens per pass in `--speculative`.
    #[arg(long, env = "LAYERSTREAM_SPEC_MAX", default_value_t = 16)]
    pub spec_max: u32,
    /// Instead of the configurations: the paged KV cache — a 4-turn chat over a ~1.5k-token history
    /// with the prefix cache on and off (time to first token of each turn, same answers), then for
    /// every KV dtype the most 2k-token sequences (two more sent at once than the pool holds) that
    /// share a step in the bytes `--kv-capacity` f32 positions take.
    #[arg(long, env = "LAYERSTREAM_BENCH_KV_CACHE")]
    pub kv_cache: bool,
    /// Constrained decoding's cost: the same chat requests with a JSON schema and without, at
    /// batch 1 and `--batch`, this many alternating rounds each; and one token mask's time, p50
    /// and p99.
    #[arg(long, env = "LAYERSTREAM_BENCH_CONSTRAINED")]
    pub constrained: Option<usize>,
    /// The width of the draft model's token trees in `--speculative` (its tree configuration).
    #[arg(long, env = "LAYERSTREAM_SPEC_WIDTH", default_value_t = 2)]
    pub spec_width: u32,
    /// Positions of the weight passes `--speculative` times (the cost of verifying).
    #[arg(long, env = "LAYERSTREAM_BENCH_PASS_POSITIONS", value_delimiter = ',', default_values_t = [1usize, 4, 16, 64])]
    pub pass_positions: Vec<usize>,
    /// With `--speculative` and `--draft-model`: instead of the workloads, measure the pass times
    /// and the draft model's time per drafted token, and project tokens/s at these per-token
    /// acceptance rates (for a synthetic pair — random weights accept nothing — with the rates a
    /// real pair measured).
    #[arg(long, env = "LAYERSTREAM_BENCH_ACCEPTANCE", value_delimiter = ',')]
    pub acceptance: Vec<f64>,
    /// Only the streamed (prefetch on) configuration: one stack instead of three (for comparing
    /// placements, e.g. `--device cuda:0,cpu --workers 2` against `--device cuda:0`).
    #[arg(long, env = "LAYERSTREAM_BENCH_STREAMED_ONLY")]
    pub streamed_only: bool,
    /// The streamed runs with no size flags, as a user runs `up`: the memory ledger (in a
    /// container, its memory limit) sizes the slots, the worker's budget and the KV cache, and the
    /// planner places the layers (with `--streamed-only`: what `up --model BIG` delivers).
    #[arg(long, env = "LAYERSTREAM_BENCH_FIT")]
    pub fit: bool,
}

/// One configuration's result.
#[derive(Debug, Clone, serde::Serialize)]
pub(crate) struct Row {
    pub(crate) config: String,
    pub(crate) tokens: u64,
    pub(crate) wall_s: f64,
    pub(crate) tokens_per_s: f64,
    /// Micro-batches in flight under the stack's plan (GetPlan).
    pub(crate) micro_batches: u32,
    /// The workers' busy share over the first request (Σ busy ÷ (workers × wall)), %.
    pub(crate) workers_busy_pct: f64,
    /// Prompt tokens of every request over the time until the last request's first token: the batch's
    /// prefill throughput (queueing included, as a client sees it).
    pub(crate) prefill_tok_s: f64,
    /// The slowest time to first token.
    pub(crate) first_token_ms: f64,
    /// Tokens after each request's first over the wall time after the last first token.
    pub(crate) decode_tok_s: f64,
    /// Steps the first request rode.
    pub(crate) steps: u64,
    pub(crate) bytes_streamed_per_step: f64,
    pub(crate) transfer_gbps: f64,
    /// Bytes streamed by the first request over the workload's wall time: the link speed achieved.
    pub(crate) stream_gbps_wall: f64,
    /// The workers' layer-pass wall time over Σ max(transfer, compute) per layer, over the first
    /// request's steps: 1.0 is perfect copy/compute overlap (the "step ≤ 1.10 × ideal").
    pub(crate) step_over_ideal: f64,
    /// Share of the workload's wall time spent outside the workers' layer passes (embedding, head,
    /// sampling, gRPC, scheduling) for the first request (the workers of a pipeline run one after another).
    pub(crate) outside_layers_pct: f64,
    pub(crate) overlap_pct: f64,
    pub(crate) transfer_ms: f64,
    pub(crate) compute_ms: f64,
    pub(crate) stall_ms: f64,
    /// The loader's acquires over the whole run (warm-up included): served from a slot / read from
    /// disk.
    pub(crate) loader_hits: u64,
    pub(crate) loader_misses: u64,
    /// The first request's experts: needed, hit, prefetched, missed (mixture-of-experts stores).
    pub(crate) experts: [u64; 4],
    /// Decode tokens/s `layerstream plan`'s cost model predicts for this stack at this batch (CPU
    /// workers; `predict_rows`).
    pub(crate) predicted_decode_tok_s: Option<f64>,
    /// The loader's disk rate over the measured workload: bytes read ÷ the wall time a read was in
    /// flight (None where it read under 64 MB: too little to time).
    pub(crate) disk_gbps_run: Option<f64>,
    /// Whether the loader read through the page cache and `disk_gbps_run`, where the disk bounded
    /// the run (`served::disk_bound_rate`): what the next predictions take as the disk's rate.
    #[serde(skip)]
    pub(crate) disk_bound_run: Option<(bool, f64)>,
    /// The prediction again with the disk at `disk_gbps_run` (`plan --disk-gbps`): the cost
    /// model's error with the disk's drift since calibration taken out.
    pub(crate) predicted_at_run_disk_tok_s: Option<f64>,
    /// The share of the first request's expert needs its worker's cache did not hold (fetched
    /// ahead or when needed): None for a dense store.
    pub(crate) expert_misses_run: Option<f64>,
    /// The prediction again with the expert caches missing `expert_misses_run` of the needs (`plan
    /// --expert-misses`) and the disk at `disk_gbps_run` where measured: the cost model's error
    /// with the prompt's own routing (experts the usage history did not foresee) taken out.
    pub(crate) predicted_at_run_experts_tok_s: Option<f64>,
}

/// What one workload measured: tokens generated, wall seconds, and every request's stats.
struct Measured {
    tokens: u64,
    wall_s: f64,
    stats: Vec<Stats>,
}

impl Measured {
    /// (prefill tok/s, slowest first token ms, decode tok/s) over the batch.
    fn phases(&self) -> (f64, f64, f64) {
        let first_ms = self.stats.iter().map(|s| s.first_token_ms).fold(0.0, f64::max);
        let prompt: u64 = self.stats.iter().map(|s| s.prompt_tokens).sum();
        let after_first: u64 =
            self.stats.iter().map(|s| s.completion_tokens.saturating_sub(1)).sum();
        let decode_s = self.wall_s - first_ms / 1e3;
        let prefill = if first_ms > 0.0 { prompt as f64 / (first_ms / 1e3) } else { 0.0 };
        (prefill, first_ms, if decode_s > 0.0 { after_first as f64 / decode_s } else { 0.0 })
    }
}

/// The request every client of the workload sends.
/// The input of a chat holding one user message, `text`.
pub(crate) fn user_chat(text: &str) -> generate_request::Input {
    generate_request::Input::Chat(layerstream_rpc::v1::ChatMessages {
        messages: vec![layerstream_rpc::v1::ChatMessage {
            role: "user".into(),
            content: text.into(),
            ..Default::default()
        }],
    })
}

pub(crate) fn request(a: &BenchArgs, vocab: usize, seed: u64) -> GenerateRequest {
    let input = match a.prompt_tokens {
        // Ids spread over the vocabulary, skipping 0 (often a special token); each request (seed) its
        // own, so a mixture-of-experts batch routes as different prompts do.
        Some(n) => generate_request::Input::TokenIds(TokenIds {
            ids: (0..n)
                .map(|i| (1 + (i * 7919 + seed as usize * 104729) % (vocab - 1).max(1)) as u32)
                .collect(),
        }),
        None => generate_request::Input::Prompt(a.prompt.clone()),
    };
    let sampling = Sampling {
        temperature: a.temperature,
        top_k: a.top_k,
        top_p: a.top_p,
        seed,
        ..Default::default()
    };
    GenerateRequest {
        input: Some(input),
        max_new_tokens: a.max_new_tokens,
        ignore_eos: true,
        sampling: Some(sampling),
        ..Default::default()
    }
}

async fn workload(addr: &str, a: &BenchArgs, vocab: usize) -> Result<Measured> {
    let client = CoordinatorClient::connect(addr.to_owned()).await?;
    let t0 = Instant::now();
    let mut tasks = Vec::new();
    for i in 0..a.batch {
        let mut c = client.clone();
        let req = request(a, vocab, i as u64);
        tasks.push(tokio::spawn(async move {
            let mut s = c.generate(req).await?.into_inner();
            while let Some(ev) = s.message().await? {
                if let Some(generate_event::Event::Done(d)) = ev.event {
                    return Ok::<_, anyhow::Error>((
                        d.output_ids.len() as u64,
                        d.stats.unwrap_or_default(),
                    ));
                }
            }
            Err(anyhow::anyhow!("stream ended early"))
        }));
    }
    let mut m = Measured { tokens: 0, wall_s: 0.0, stats: Vec::new() };
    for t in tasks {
        let (n, st) = t.await?.map_err(|e| anyhow::anyhow!("request failed: {e}"))?;
        m.tokens += n;
        m.stats.push(st);
    }
    m.wall_s = t0.elapsed().as_secs_f64();
    Ok(m)
}

pub(crate) fn run_config(
    name: &str,
    model: &str,
    vocab: usize,
    extra: &[String],
    a: &BenchArgs,
    rt: &tokio::runtime::Runtime,
) -> Result<Row> {
    let mut children = Children(Vec::new());
    let args = stack_args(model, a, extra);
    let addr = spawn_quiet(&mut children, name, &args)?.addr;
    // Warm-up request (page cache, first-touch allocations), then the measured workload.
    let warm = BenchArgs { batch: 1, max_new_tokens: 2, ..a.clone() };
    rt.block_on(workload(&addr, &warm, vocab))?;
    let up_pid = children.0[0].1.id();
    let before = rt.block_on(loader_counts(up_pid)).ok();
    let m = rt.block_on(workload(&addr, a, vocab))?;
    let micro_batches = rt.block_on(async {
        let mut c = CoordinatorClient::connect(addr.clone()).await?;
        let plan = c.get_plan(layerstream_rpc::v1::GetPlanRequest {}).await?.into_inner();
        Ok::<_, anyhow::Error>(plan.micro_batches)
    })?;
    let after = rt.block_on(loader_counts(up_pid)).ok();
    let (loader_hits, loader_misses) = after.as_ref().map_or((0, 0), |d| (d.hits, d.misses));
    let disk_gbps_run = before.as_ref().zip(after.as_ref()).and_then(|(b, a)| disk_rate(b, a));
    drop(children);
    let (prefill_tok_s, first_token_ms, decode_tok_s) = m.phases();
    let (tokens, wall_s) = (m.tokens, m.wall_s);
    // The disk's rate where the disk bounded the run (for `served`), and how the loader read.
    let disk_bound_run = before.zip(after).and_then(|(b, x)| {
        let busy = x.disk_busy_seconds - b.disk_busy_seconds;
        let rate =
            crate::served::disk_bound_rate(x.disk_bytes.checked_sub(b.disk_bytes)?, busy, wall_s);
        rate.map(|g| (!x.direct_io, g))
    });
    let st = m.stats.into_iter().next().unwrap_or_default();
    let steps = st.steps.max(1) as f64;
    Ok(Row {
        config: name.into(),
        tokens,
        wall_s,
        tokens_per_s: tokens as f64 / wall_s,
        micro_batches,
        workers_busy_pct: st.workers_busy_pct,
        prefill_tok_s,
        first_token_ms,
        decode_tok_s,
        bytes_streamed_per_step: st.bytes_streamed as f64 / steps,
        steps: st.steps,
        transfer_gbps: if st.transfer_ms > 0.0 {
            st.bytes_streamed as f64 / (st.transfer_ms / 1e3) / 1e9
        } else {
            0.0
        },
        stream_gbps_wall: st.bytes_streamed as f64 / wall_s / 1e9,
        step_over_ideal: if st.ideal_ms > 0.0 { st.layers_ms / st.ideal_ms } else { 0.0 },
        outside_layers_pct: if st.wall_ms > 0.0 {
            (1.0 - st.layers_ms / st.wall_ms).max(0.0) * 100.0
        } else {
            0.0
        },
        overlap_pct: st.overlap_pct,
        transfer_ms: st.transfer_ms,
        compute_ms: st.compute_ms,
        stall_ms: st.stall_ms,
        loader_hits,
        loader_misses,
        experts: [st.experts_needed, st.experts_hit, st.experts_prefetched, st.experts_missed],
        predicted_decode_tok_s: None,
        disk_gbps_run,
        disk_bound_run,
        predicted_at_run_disk_tok_s: None,
        expert_misses_run: None,
        predicted_at_run_experts_tok_s: None,
    })
}

/// The `up` command line of a bench stack: the bench's workers, batch, device flags and slot pool,
/// then `extra` (the configuration), on free ports.
pub(crate) fn stack_args(model: &str, a: &BenchArgs, extra: &[String]) -> Vec<String> {
    let mut args = vec![
        "up".to_owned(),
        "--model".into(),
        model.into(),
        "--listen".into(),
        "127.0.0.1:0".into(),
        "--workers".into(),
        a.workers.to_string(),
        "--max-batch".into(),
        a.batch.max(1).to_string(),
    ];
    args.extend(a.device.compute.to_args());
    if let Some(g) = a.device.link_gbps {
        args.extend(["--link-gbps".into(), g.to_string()]);
    }
    args.extend_from_slice(extra);
    args.extend(a.pool.to_args());
    // Never the default port, which a stack the user runs may hold.
    args.extend(["--http-listen".into(), "127.0.0.1:0".into()]);
    args
}

/// The loader's description (its counters) of the stack `up` (pid `up_pid`) runs: its socket is
/// its namespace's (`transport::namespace_socket`), its internal token the one `run` put in the
/// environment.
async fn loader_counts(up_pid: u32) -> Result<layerstream_rpc::v1::DescribeResponse> {
    use layerstream_rpc::v1::{loader_client::LoaderClient, DescribeRequest};
    let sock =
        layerstream_rpc::transport::namespace_socket(&layerstream_shm::up_namespace(up_pid))?;
    let token = std::env::var(layerstream_rpc::auth::INTERNAL_TOKEN_ENV).ok();
    let bearer =
        layerstream_rpc::auth::Bearer::new(token.as_deref()).map_err(anyhow::Error::msg)?;
    let ch = layerstream_rpc::transport::connect_uds(&sock).await?;
    Ok(LoaderClient::new(bearer.wrap(ch)).describe(DescribeRequest {}).await?.into_inner())
}

/// The flags of a streamed configuration: the plan flags with `--resident-layers` 0 unless given
/// (everything streams), or the worker budget when one is given (the planner picks), or neither
/// with `--fit` (the ledger sizes, the planner picks).
pub(crate) fn streamed_args(a: &BenchArgs) -> Vec<String> {
    let plan = PlanFlags {
        resident_layers: (a.device.memory_budget.is_none() && !a.fit)
            .then_some(a.plan.resident_layers.unwrap_or(0)),
        ..a.plan.clone()
    };
    let mut streamed = plan.to_args();
    if let Some(b) = a.device.memory_budget {
        streamed.extend(["--memory-budget".to_owned(), b.to_string()]);
    }
    streamed
}

/// The resident configuration's flags: as much memory as the machine offers (a GPU worker caps it
/// at what is free).
pub(crate) fn resident_args() -> Vec<String> {
    vec!["--memory-budget".into(), (1u64 << 40).to_string()]
}

/// Runs the three configurations and prints the comparison.
pub fn run(a: BenchArgs) -> Result<()> {
    if a.batch == 0 || a.max_new_tokens == 0 {
        bail!("--batch and --max-new-tokens must be > 0");
    }
    crate::run::check_devices(&a.device.compute.device)?;
    let model_dir = crate::run::model_dir(&a.model)?;
    let vocab = layerstream_model::Store::open(&model_dir)?.manifest.config.vocab_size;
    let model = model_dir.display().to_string();
    // One internal token for the stacks this bench starts (they inherit it), so it can ask their
    // loaders for cache hits and misses. Set before any thread exists.
    if std::env::var(layerstream_rpc::auth::INTERNAL_TOKEN_ENV).is_err() {
        std::env::set_var(
            layerstream_rpc::auth::INTERNAL_TOKEN_ENV,
            layerstream_rpc::auth::random_hex(),
        );
    }
    if let Some(rounds) = a.api_compare {
        return crate::bench_api::compare(&a, &model, vocab, rounds.max(1));
    }
    if let Some(m) = a.micro_batches {
        return crate::bench_pipeline::compare(&a, &model, vocab, m);
    }
    if !a.expert_caches.is_empty() {
        return crate::bench_experts::compare(&a, &model_dir, vocab);
    }
    if a.kv_cache {
        return crate::bench_kv::compare(&a, &model);
    }
    if let Some(rounds) = a.constrained {
        return crate::bench_grammar::compare(&a, &model, rounds.max(1));
    }
    if a.speculative {
        return crate::bench_spec::compare(&a, &model);
    }
    streaming(&a, &model, vocab)
}

/// The default comparison: streamed (prefetch on) against fully resident and prefetch off (and
/// unverified with `--verify-cost`), or the streamed run alone (`--streamed-only`), each with the
/// cost model's prediction beside it where it has one.
fn streaming(a: &BenchArgs, model: &str, vocab: usize) -> Result<()> {
    let rt = tokio::runtime::Builder::new_multi_thread().enable_all().build()?;
    if a.plan.no_prefetch {
        bail!("bench runs the prefetch-off configuration itself; drop --no-prefetch");
    }
    let resident = a.plan.resident_layers.unwrap_or(0);
    let streamed = streamed_args(a);
    let mut off = streamed.clone();
    off.push("--no-prefetch".into());
    let first = run_config("streamed (prefetch on)", model, vocab, &streamed, a, &rt)
        .context("streamed run")?;
    if a.streamed_only {
        let mut rows = [first];
        predict_rows(&mut rows, model, a, [&streamed, &[]]);
        crate::bench_report::record_served(model, a, &rows[0]);
        print!("{}", tables(&rows));
        if let Some(p) = &a.json_out {
            std::fs::write(p, serde_json::to_string_pretty(&rows)?)?;
        }
        return Ok(());
    }
    let mut rows = vec![
        first,
        run_config("fully resident", model, vocab, &resident_args(), a, &rt)
            .context("resident run")?,
        run_config("streamed (prefetch off)", model, vocab, &off, a, &rt)
            .context("prefetch-off run")?,
    ];
    if a.verify_cost {
        let mut unverified = streamed.clone();
        unverified.push("--no-verify".into());
        rows.push(
            run_config("streamed, no verify", model, vocab, &unverified, a, &rt)
                .context("unverified run")?,
        );
    }
    let streamed_as = match a.device.memory_budget {
        Some(b) => format!("a {b}-byte budget/worker (the planner picks resident layers)"),
        None if a.fit => "no size flags (the memory ledger sizes, the planner places)".to_owned(),
        None => format!("{resident} resident layers/worker"),
    };
    println!(
        "workload: {} concurrent requests × {} tokens after a {} prompt, {} worker(s)",
        a.batch,
        a.max_new_tokens,
        a.prompt_tokens.map_or("text".to_owned(), |n| format!("{n}-token")),
        a.workers
    );
    println!(
        "streamed runs: {streamed_as}, group {}, streaming buffers {}",
        a.plan.layer_group_size, a.plan.streaming_buffers
    );
    predict_rows(&mut rows[..2], model, a, [&streamed, &resident_args()]);
    crate::bench_report::record_served(model, a, &rows[0]);
    print!("{}", tables(&rows));
    if rows[0].bytes_streamed_per_step == 0.0 {
        println!("note: the streamed run streamed nothing (every layer fit); lower --memory-budget or --resident-layers to measure streaming");
    }
    let ratio = |a: &Row, b: &Row| {
        format!(
            "{:.2} (prefill {:.2}, decode {:.2})",
            a.tokens_per_s / b.tokens_per_s,
            a.prefill_tok_s / b.prefill_tok_s,
            a.decode_tok_s / b.decode_tok_s
        )
    };
    let cache: Vec<String> = rows
        .iter()
        .map(|r| format!("{} {} / {}", r.config, r.loader_hits, r.loader_misses))
        .collect();
    println!(
        "loader, acquires served from a slot / layer files read from disk: {}",
        cache.join("; ")
    );
    println!("streamed / resident tokens/s: {}", ratio(&rows[0], &rows[1]));
    println!("prefetch on / off tokens/s:   {}", ratio(&rows[0], &rows[2]));
    if let Some(u) = rows.get(3) {
        println!("verified / unverified tokens/s: {}", ratio(&rows[0], u));
    }
    if let Some(p) = &a.json_out {
        std::fs::write(p, serde_json::to_string_pretty(&rows)?)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        a: BenchArgs,
    }

    #[test]
    fn prefill_runs_to_the_last_first_token_and_decode_counts_the_rest() {
        let st = |prompt, first, done| Stats {
            prompt_tokens: prompt,
            first_token_ms: first,
            completion_tokens: done,
            ..Default::default()
        };
        let m =
            Measured { tokens: 10, wall_s: 1.2, stats: vec![st(10, 100.0, 5), st(20, 200.0, 5)] };
        // 30 prompt tokens by 0.2 s; 8 later tokens over the 1.0 s after it.
        assert_eq!(m.phases(), (150.0, 200.0, 8.0));
        let ids =
            |n| match request(&Cli::parse_from(["bench", "--prompt-tokens", n]).a, 50, 0).input {
                Some(generate_request::Input::TokenIds(t)) => t.ids,
                other => panic!("{other:?}"),
            };
        let v = ids("300");
        assert_eq!(v.len(), 300);
        assert!(
            v.iter().all(|&i| (1..50).contains(&i)),
            "ids stay inside the vocabulary and skip 0"
        );
        // Sampling flags reach every request, each with its own seed.
        let r = request(
            &Cli::parse_from(["bench", "--temperature", "0.7", "--top-k", "40", "--top-p", "0.9"])
                .a,
            50,
            3,
        );
        assert_eq!(
            r.sampling,
            Some(Sampling {
                temperature: 0.7,
                top_k: 40,
                top_p: 0.9,
                seed: 3,
                ..Default::default()
            })
        );
    }

    /// The streamed runs stream everything by default, take a budget when given, and with
    /// `--fit` pass no size flag at all (what `up` with no flags does); `--fit` with a size flag
    /// is refused.
    #[test]
    fn the_streamed_runs_size_flags_follow_the_residency_choice() {
        let args = |v: &[&str]| {
            streamed_args(&Cli::parse_from([&["bench"], v].concat()).a)
                .into_iter()
                .filter(|f| f == "--resident-layers" || f == "--memory-budget")
                .collect::<Vec<_>>()
        };
        assert_eq!(args(&[]), ["--resident-layers"]);
        assert_eq!(args(&["--memory-budget", "4G"]), ["--memory-budget"]);
        assert!(args(&["--fit"]).is_empty());
        for clash in [["--fit", "--resident-layers", "3"], ["--fit", "--memory-budget", "4G"]] {
            let err = Cli::try_parse_from([&["bench"], &clash[..]].concat()).err().unwrap();
            assert_eq!(err.kind(), clap::error::ErrorKind::ArgumentConflict, "{clash:?}");
        }
    }
}
