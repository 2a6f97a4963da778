//! `layerstream bench --kv-cache`: the paged KV cache side by side in one run. (1) Prefix caching:
//! a 4-turn chat over a ~1.5k-token history on fresh stacks with the cache on and off; the time to
//! first token of every turn and whether the answers are the same. (2) Capacity: one fixed KV budget
//! (what `--kv-capacity` f32 positions take), and for every KV dtype the most 2k-token sequences
//! that held KV blocks at once when more are sent than fit, against the f32 pool.

use crate::bench::{stack_args, BenchArgs};
use crate::up::{spawn_quiet, Children};
use anyhow::{bail, Context, Result};
use layerstream_rpc::v1::coordinator_client::CoordinatorClient;
use layerstream_rpc::v1::{
    generate_event, generate_request, ChatMessage, ChatMessages, GenerateRequest, Stats, TokenIds,
};
use layerstream_types::DType;

/// The questions of the chat's four turns.
const TURNS: [&str; 4] = [
    "Summarize the text above in one sentence.",
    "Which process reads the layer files?",
    "What does a worker do while it computes?",
    "Name one metric the coordinator exports.",
];

/// Sends one request; returns its output and stats.
async fn one(addr: &str, req: GenerateRequest) -> Result<(Vec<u32>, String, Stats)> {
    let mut c = CoordinatorClient::connect(addr.to_owned()).await?;
    let mut s = c.generate(req).await?.into_inner();
    while let Some(ev) = s.message().await? {
        if let Some(generate_event::Event::Done(d)) = ev.event {
            return Ok((d.output_ids, d.text, d.stats.unwrap_or_default()));
        }
    }
    bail!("stream ended early")
}

/// A ~1.5k-token document: the project's own docs, repeated to length.
fn document() -> String {
    let base = include_str!("../../docs/architecture.md");
    base.chars().take(6000).collect()
}

/// One turn of the chat: time to first token (ms), prompt tokens, cached tokens.
type Turn = (f64, u64, u32);

/// The chat on a fresh stack with `extra` flags: per turn (time to first token ms, prompt tokens,
/// cached tokens), and the answers.
fn chat(
    model: &str,
    a: &BenchArgs,
    extra: &[String],
    rt: &tokio::runtime::Runtime,
) -> Result<(Vec<Turn>, Vec<Vec<u32>>)> {
    let mut children = Children(Vec::new());
    let one_seq = BenchArgs { batch: 1, ..a.clone() };
    let addr = spawn_quiet(&mut children, "kv-chat", &stack_args(model, &one_seq, extra))?.addr;
    let mut messages = Vec::new();
    let (mut turns, mut answers) = (Vec::new(), Vec::new());
    for (i, q) in TURNS.iter().enumerate() {
        let content = if i == 0 { format!("{}\n\n{q}", document()) } else { q.to_string() };
        messages.push(ChatMessage { role: "user".into(), content, ..Default::default() });
        let req = GenerateRequest {
            input: Some(generate_request::Input::Chat(ChatMessages { messages: messages.clone() })),
            max_new_tokens: a.max_new_tokens,
            ..Default::default()
        };
        let (ids, text, st) = rt.block_on(one(&addr, req))?;
        turns.push((st.first_token_ms, st.prompt_tokens, st.cached_tokens));
        answers.push(ids);
        messages.push(ChatMessage {
            role: "assistant".into(),
            content: text,
            ..Default::default()
        });
    }
    Ok((turns, answers))
}

/// A gauge of the coordinator's Prometheus `/metrics` at `base` (`http://host:port`), over plain
/// HTTP/1.0.
async fn gauge(base: &str, name: &str) -> Result<f64> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let host = base.trim_start_matches("http://");
    let mut s = tokio::net::TcpStream::connect(host).await?;
    s.write_all(format!("GET /metrics HTTP/1.0\r\nHost: {host}\r\n\r\n").as_bytes()).await?;
    let mut body = String::new();
    s.read_to_string(&mut body).await?;
    body.lines()
        .find_map(|l| l.strip_prefix(name).and_then(|v| v.trim().parse().ok()))
        .with_context(|| format!("no {name} in /metrics"))
}

/// `count` requests of `len` distinct prompt tokens (and 8 new ones) sent at once to a fresh stack
/// with `extra` flags: the most that held KV blocks at once (the running-requests gauge, sampled
/// every 50 ms), the most that shared a step, and the preemptions.
fn concurrency(
    model: &str,
    a: &BenchArgs,
    extra: &[String],
    len: usize,
    count: usize,
    rt: &tokio::runtime::Runtime,
) -> Result<(u32, u32, u32)> {
    let vocab =
        layerstream_model::Store::open(std::path::Path::new(model))?.manifest.config.vocab_size;
    let mut children = Children(Vec::new());
    let many = BenchArgs { batch: count, ..a.clone() };
    let up = spawn_quiet(&mut children, "kv-capacity", &stack_args(model, &many, extra))?;
    let (addr, http) = (up.addr, up.http.context("the stack serves HTTP")?);
    let reqs: Vec<GenerateRequest> = (0..count)
        .map(|r| GenerateRequest {
            input: Some(generate_request::Input::TokenIds(TokenIds {
                ids: (0..len).map(|i| (1 + (i * 7919 + r * 104729) % (vocab - 1)) as u32).collect(),
            })),
            max_new_tokens: 8,
            ..Default::default()
        })
        .collect();
    let (stats, running) = rt.block_on(async {
        let tasks: Vec<_> = reqs
            .into_iter()
            .map(|q| {
                let addr = addr.clone();
                tokio::spawn(async move { one(&addr, q).await })
            })
            .collect();
        let mut most = 0f64;
        while !tasks.iter().all(|t| t.is_finished()) {
            most = most.max(gauge(&http, "layerstream_num_requests_running").await?);
            tokio::time::sleep(std::time::Duration::from_millis(50)).await;
        }
        let mut out = Vec::new();
        for t in tasks {
            out.push(t.await??.2);
        }
        Ok::<_, anyhow::Error>((out, most as u32))
    })?;
    let in_step = stats.iter().map(|s| s.max_batch).max().unwrap_or(0);
    Ok((running, in_step, stats.iter().map(|s| s.preemptions).sum()))
}

/// Runs both comparisons and prints them.
pub fn compare(a: &BenchArgs, model: &str) -> Result<()> {
    let rt = tokio::runtime::Builder::new_multi_thread().enable_all().build()?;
    let mut plan = a.plan.clone();
    let base = |p: &layerstream_coordinator::PlanFlags| {
        let mut v = p.to_args();
        if let Some(b) = a.device.memory_budget {
            v.extend(["--memory-budget".to_owned(), b.to_string()]);
        }
        v
    };
    println!(
        "## Prefix caching: a 4-turn chat, {} tokens per answer; plan: {}\n",
        a.max_new_tokens,
        base(&plan).join(" ")
    );
    plan.no_prefix_cache = false;
    let (on, on_ids) = chat(model, a, &base(&plan), &rt)?;
    plan.no_prefix_cache = true;
    let (off, off_ids) = chat(model, a, &base(&plan), &rt)?;
    println!("| turn | prompt tokens | cached | TTFT cache on ms | TTFT cache off ms | off ÷ on |\n|---|---|---|---|---|---|");
    for (i, (n, f)) in on.iter().zip(&off).enumerate() {
        println!(
            "| {} | {} | {} | {:.0} | {:.0} | {:.2} |",
            i + 1,
            n.1,
            n.2,
            n.0,
            f.0,
            f.0 / n.0.max(1e-9)
        );
    }
    let later = |t: &[Turn]| t[1..].iter().map(|x| x.0).sum::<f64>();
    println!(
        "\nturns 2–4: TTFT {:.2}× lower with the cache; answers identical: {}",
        later(&off) / later(&on).max(1e-9),
        if on_ids == off_ids { "yes" } else { "NO" }
    );
    if !a.device.compute.exact {
        println!("(without --exact, cached blocks of earlier answers hold keys the decode path computed with 8-bit activations, where the uncached run prefills them in f32: answers may differ slightly)");
    }

    // Capacity: the f32 pool's bytes, held in each dtype.
    let f32_positions = a.plan.kv_capacity.unwrap_or(8192);
    let kv_dim_bytes = 4.0;
    println!("\n## Capacity: a KV budget of {f32_positions} f32 positions per worker, 2048-token sequences (2040 prompt + 8), two more sent at once than the pool holds, prefix cache off\n");
    println!("| KV dtype | positions in the budget | sent | most holding KV at once | ÷ f32 | most in one step | preemptions |\n|---|---|---|---|---|---|---|");
    let mut first = 0.0;
    for d in layerstream_types::dtype::KV_DTYPES {
        let per = d.row_bytes(64).map_or(4.0, |b| b as f64 / 64.0);
        let positions = (f32_positions as f64 * kv_dim_bytes / per) as usize;
        let mut p = a.plan.clone();
        p.no_prefix_cache = true;
        p.kv_capacity = Some(positions);
        p.kv.kv_dtype = d.name().into();
        // Two more than fit, so the pool, not the count sent, is the limit.
        let count = positions / 2048 + 2;
        let (peak, in_step, pre) = concurrency(model, a, &base(&p), 2040, count, &rt)?;
        if d == DType::F32 {
            first = peak as f64;
        }
        println!(
            "| {} | {positions} | {count} | {peak} | {:.2} | {in_step} | {pre} |",
            d.name(),
            peak as f64 / first.max(1.0)
        );
    }
    if on_ids != off_ids && a.device.compute.exact {
        bail!("the prefix cache changed the answers under --exact");
    }
    Ok(())
}
