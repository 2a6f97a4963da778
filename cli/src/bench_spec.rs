//! `layerstream bench --speculative`: plain decoding, prompt lookup and a draft model (chains and
//! trees) side by side,
//! each on a fresh `layerstream up` stack with the same plan, over three chat workloads; then the
//! cost of verifying — the time of a weight pass as it carries 1, 4, 16 and 64 positions
//! (`--pass-positions`). With `--acceptance`, only the costs are measured and the speed at those
//! acceptance rates projected (`bench_spec_cost`).

use crate::bench::{stack_args, BenchArgs};
use crate::up::{spawn_quiet, Children};
use anyhow::{bail, Context, Result};
use layerstream_rpc::v1::coordinator_client::CoordinatorClient;
use layerstream_rpc::v1::{generate_event, GenerateRequest, Sampling, Stats};
use std::time::Instant;

/// (name, chat message): a chat answer, a code edit (prompt lookup's home ground: the answer
/// copies most of the prompt), a summary of a given text.
const WORKLOADS: [(&str, &str); 3] = [
    ("chat", "Explain why the sky is blue in one paragraph."),
    (
        "code edit",
        "Rename the variable total to result in this function and print the whole function:\n\n\
         def add_all(items):\n    total = 0\n    for item in items:\n        total = total + item\n    \
         if total > 100:\n        total = 100\n    return total",
    ),
    (
        "summary",
        "Summarize this text in two sentences: The loader daemon reads each layer file from disk \
         into shared memory before the workers need it. Each worker copies the layer from shared \
         memory to its device while it computes the previous layer, so the copy hides behind the \
         compute. The coordinator batches every active sequence into one pass over the weights.",
    ),
];

/// One configuration × workload.
#[derive(Debug, Clone, serde::Serialize)]
struct SpecRow {
    config: String,
    workload: String,
    tokens: u64,
    wall_s: f64,
    tokens_per_s: f64,
    drafted: u64,
    accepted: u64,
    passes: u64,
    /// Every request's output equals the plain configuration's.
    same_tokens: bool,
    #[serde(skip)]
    outputs: Vec<Vec<u32>>,
}

fn chat(text: &str, a: &BenchArgs) -> GenerateRequest {
    GenerateRequest {
        input: Some(crate::bench::user_chat(text)),
        max_new_tokens: a.max_new_tokens,
        sampling: Some(Sampling {
            temperature: a.temperature,
            top_k: a.top_k,
            top_p: a.top_p,
            seed: 1,
            ..Default::default()
        }),
        ..Default::default()
    }
}

/// Sends `batch` copies of `req` at once; returns (outputs, stats, wall seconds).
pub(crate) async fn send(
    addr: &str,
    req: GenerateRequest,
    batch: usize,
) -> Result<(Vec<Vec<u32>>, Vec<Stats>, f64)> {
    let client = CoordinatorClient::connect(addr.to_owned()).await?;
    let t0 = Instant::now();
    let tasks: Vec<_> = (0..batch.max(1))
        .map(|_| {
            let (mut c, req) = (client.clone(), req.clone());
            tokio::spawn(async move {
                let mut s = c.generate(req).await?.into_inner();
                while let Some(ev) = s.message().await? {
                    if let Some(generate_event::Event::Done(d)) = ev.event {
                        return Ok::<_, anyhow::Error>((d.output_ids, d.stats.unwrap_or_default()));
                    }
                }
                bail!("stream ended early")
            })
        })
        .collect();
    let (mut outs, mut stats) = (Vec::new(), Vec::new());
    for t in tasks {
        let (o, s) = t.await??;
        outs.push(o);
        stats.push(s);
    }
    Ok((outs, stats, t0.elapsed().as_secs_f64()))
}

/// Runs every workload on a fresh stack with `extra` flags.
fn run_config(
    name: &str,
    model: &str,
    extra: &[String],
    a: &BenchArgs,
    rt: &tokio::runtime::Runtime,
) -> Result<Vec<SpecRow>> {
    let mut children = Children(Vec::new());
    let addr = spawn_quiet(&mut children, name, &stack_args(model, a, extra))?.addr;
    rt.block_on(send(&addr, chat("Hi", &BenchArgs { max_new_tokens: 2, ..a.clone() }), 1))?;
    let mut rows = Vec::new();
    for (w, text) in WORKLOADS {
        let (outputs, stats, wall_s) = rt.block_on(send(&addr, chat(text, a), a.batch))?;
        let tokens: u64 = outputs.iter().map(|o| o.len() as u64).sum();
        let sum = |f: fn(&Stats) -> u64| stats.iter().map(f).sum::<u64>();
        rows.push(SpecRow {
            config: name.into(),
            workload: w.into(),
            tokens,
            wall_s,
            tokens_per_s: tokens as f64 / wall_s,
            drafted: sum(|s| s.spec_drafted),
            accepted: sum(|s| s.spec_accepted),
            passes: sum(|s| s.weight_passes),
            same_tokens: true,
            outputs,
        });
    }
    Ok(rows)
}

/// The link the streamed copies run at, as the headers print it (`--link-gbps`).
fn link(a: &BenchArgs) -> String {
    a.device.link_gbps.map_or("as fast as it goes".to_owned(), |g| format!("paced to {g} GB/s"))
}

/// The plan flags of every stack of this bench.
pub(crate) fn plan_args(a: &BenchArgs) -> Vec<String> {
    let mut v = a.plan.to_args();
    if let Some(b) = a.device.memory_budget {
        v.extend(["--memory-budget".to_owned(), b.to_string()]);
    }
    v
}

/// Runs the comparison and prints it.
pub fn compare(a: &BenchArgs, model: &str) -> Result<()> {
    let store = layerstream_model::Store::open(std::path::Path::new(model))?;
    let vocab = store.manifest.config.vocab_size;
    let rt = tokio::runtime::Builder::new_multi_thread().enable_all().build()?;
    if !a.acceptance.is_empty() {
        return project_only(a, (model, &store), &rt);
    }
    let spec = |mode: &str| {
        let mut v = plan_args(a);
        v.extend(["--spec".to_owned(), mode.into(), "--spec-max".into(), a.spec_max.to_string()]);
        v
    };
    let mut configs = vec![("plain", spec("off")), ("prompt lookup", spec("ngram"))];
    if let Some(d) = &a.draft_model {
        let mut v = spec("draft");
        v.extend(["--draft-model".to_owned(), d.display().to_string()]);
        configs.push(("draft chain", v.clone()));
        v.extend(["--spec-width".to_owned(), a.spec_width.to_string()]);
        configs.push(("draft tree", v));
    }
    let mut rows: Vec<SpecRow> = Vec::new();
    for (name, extra) in &configs {
        rows.extend(run_config(name, model, extra, a, &rt).with_context(|| name.to_string())?);
    }
    let plain: Vec<SpecRow> = rows.iter().filter(|r| r.config == "plain").cloned().collect();
    for r in rows.iter_mut() {
        let p = plain.iter().find(|p| p.workload == r.workload).expect("plain ran every workload");
        r.same_tokens = r.outputs == p.outputs;
    }
    println!(
        "workloads: {} concurrent copies × {} tokens, temperature {}; {} worker(s); plan: {}; link: {}",
        a.batch,
        a.max_new_tokens,
        a.temperature,
        a.workers,
        plan_args(a).join(" "),
        link(a)
    );
    println!("\n| config | workload | tok/s | ÷ plain | drafted | accepted | acceptance | tokens/pass | same tokens |");
    println!("|---|---|---|---|---|---|---|---|---|");
    for r in &rows {
        let p = plain.iter().find(|p| p.workload == r.workload).expect("plain ran every workload");
        println!(
            "| {} | {} | {:.1} | {:.2} | {} | {} | {:.2} | {:.2} | {} |",
            r.config,
            r.workload,
            r.tokens_per_s,
            r.tokens_per_s / p.tokens_per_s,
            r.drafted,
            r.accepted,
            if r.drafted > 0 { r.accepted as f64 / r.drafted as f64 } else { 0.0 },
            r.tokens as f64 / r.passes.max(1) as f64,
            if r.same_tokens { "yes" } else { "NO" }
        );
    }
    crate::bench_spec_cost::pass_curve(model, vocab, a, &rt)?;
    if let Some(p) = &a.json_out {
        std::fs::write(p, serde_json::to_string_pretty(&rows)?)?;
    }
    if rows.iter().any(|r| !r.same_tokens) {
        bail!("a speculative configuration changed the tokens");
    }
    Ok(())
}

/// `--acceptance`: the pass curve and the draft model's time per level measured, then tokens per
/// second projected at each acceptance rate (for a synthetic pair, whose drafts are never accepted).
fn project_only(
    a: &BenchArgs,
    (model, store): (&str, &layerstream_model::Store),
    rt: &tokio::runtime::Runtime,
) -> Result<()> {
    let Some(draft) = &a.draft_model else {
        bail!("--acceptance projects a draft model's speed: give --draft-model");
    };
    if let Some(bad) = a.acceptance.iter().find(|x| !(0.0..1.0).contains(*x)) {
        bail!("--acceptance takes rates in [0, 1), got {bad}");
    }
    layerstream_serving::spec::check_draft(store, &layerstream_model::Store::open(draft)?)?;
    println!(
        "target {model}, draft {} (resident, alone on {}); {} worker(s); plan: {}; link: {}",
        draft.display(),
        a.device.compute.device,
        a.workers,
        plan_args(a).join(" "),
        link(a)
    );
    let vocab = store.manifest.config.vocab_size;
    let curve = crate::bench_spec_cost::pass_curve(model, vocab, a, rt)?;
    let level = crate::bench_spec_cost::draft_level_ms(draft, a)?;
    crate::bench_spec_cost::print_projections(a, &curve, level);
    Ok(())
}
