//! `layerstream bench --constrained`: what constrained decoding costs, side by side in one run on
//! one stack — generated tokens per second of the same chat requests with a JSON schema and
//! without, at batch 1 and at `--batch`, alternating rounds; and the time of one token mask (the
//! coordinator's share per sequence per step), p50 and p99, measured by replaying the constrained
//! outputs through the same compiler over the store's tokenizer.

use crate::bench::{stack_args, BenchArgs};
use crate::up::{spawn_quiet, Children};
use anyhow::{bail, Context, Result};
use layerstream_rpc::v1::coordinator_client::CoordinatorClient;
use layerstream_rpc::v1::{generate_event, output_format, GenerateRequest, OutputFormat, Sampling};
use layerstream_serving::grammar::{Format, Grammars};
use std::sync::Arc;
use std::time::Instant;

/// A schema whose answers run long (a list of records), so both sides generate alike.
fn schema() -> serde_json::Value {
    serde_json::json!({"type": "object", "properties": {"cities": {"type": "array", "items": {
        "type": "object", "properties": {
            "name": {"type": "string", "maxLength": 16},
            "country": {"type": "string", "maxLength": 16},
            "population": {"type": "integer", "minimum": 0}},
        "required": ["name", "country", "population"], "additionalProperties": false}}},
        "required": ["cities"], "additionalProperties": false})
}

fn request(a: &BenchArgs, seed: u64, constrained: bool) -> GenerateRequest {
    let text = "List large cities of Europe as JSON with their country and population.";
    GenerateRequest {
        input: Some(crate::bench::user_chat(text)),
        max_new_tokens: a.max_new_tokens,
        sampling: Some(Sampling { temperature: 0.7, seed, ..Default::default() }),
        format: constrained.then(|| OutputFormat {
            kind: Some(output_format::Kind::JsonSchema(schema().to_string())),
        }),
        ..Default::default()
    }
}

/// One round of `batch` concurrent requests: generated tokens, wall seconds, the outputs.
async fn round(
    addr: &str,
    a: &BenchArgs,
    batch: usize,
    constrained: bool,
) -> Result<(u64, f64, Vec<Vec<u32>>)> {
    let t0 = Instant::now();
    let mut tasks = Vec::new();
    for i in 0..batch {
        let (addr, req) = (addr.to_owned(), request(a, i as u64, constrained));
        tasks.push(tokio::spawn(async move {
            let mut c = CoordinatorClient::connect(addr).await?;
            let mut s = c.generate(req).await?.into_inner();
            while let Some(ev) = s.message().await? {
                if let Some(generate_event::Event::Done(d)) = ev.event {
                    return Ok::<_, anyhow::Error>(d.output_ids);
                }
            }
            bail!("the stream ended early")
        }));
    }
    let mut outs = Vec::new();
    for t in tasks {
        outs.push(t.await??);
    }
    let tokens = outs.iter().map(|o| o.len() as u64).sum();
    Ok((tokens, t0.elapsed().as_secs_f64(), outs))
}

/// Mask times (ms) of replaying `outputs` through the schema, one mask per token as the
/// coordinator computes them.
fn mask_times(g: &Grammars, outputs: &[Vec<u32>]) -> Result<Vec<f64>> {
    let mut ms = Vec::new();
    for out in outputs {
        let mut c = g.compile(&Format::JsonSchema(schema())).map_err(anyhow::Error::msg)?;
        // The coordinator masks before each sampled token; forced tokens take no mask.
        let mut i = c.forced().len();
        while i < out.len() {
            let t0 = Instant::now();
            c.mask().map_err(anyhow::Error::msg)?;
            ms.push(t0.elapsed().as_secs_f64() * 1e3);
            if c.advance(out[i]).is_err() || c.finished() {
                break;
            }
            i += 1 + c.forced().len();
        }
    }
    Ok(ms)
}

fn pct(v: &mut [f64], p: f64) -> f64 {
    v.sort_by(f64::total_cmp);
    v[((v.len() - 1) as f64 * p).round() as usize]
}

/// Runs the comparison and prints it (a markdown table).
pub fn compare(a: &BenchArgs, model: &str, rounds: usize) -> Result<()> {
    let rt = tokio::runtime::Builder::new_multi_thread().enable_all().build()?;
    let mut children = Children(Vec::new());
    let l = spawn_quiet(&mut children, "constrained", &stack_args(model, a, &[]))?;
    let store = layerstream_model::Store::open(std::path::Path::new(model))?;
    let tok = Arc::new(store.tokenizer()?);
    let grammars = Grammars::new(tok, &store.manifest.config.eos_token_ids)
        .context("building the grammar compiler")?;
    println!(
        "| batch | free tok/s | JSON-schema tok/s | ratio | free tokens | constrained tokens |"
    );
    println!("|---|---|---|---|---|---|");
    let mut replayed = Vec::new();
    for batch in [1, a.batch.max(1)] {
        rt.block_on(round(&l.addr, a, batch, false))?; // warm-up
        let (mut free, mut cons) = ((0, 0.0), (0, 0.0));
        for r in 0..rounds {
            // Alternate which goes first, so drift favours neither.
            for constrained in if r % 2 == 0 { [false, true] } else { [true, false] } {
                let (n, s, outs) = rt.block_on(round(&l.addr, a, batch, constrained))?;
                let side = if constrained { &mut cons } else { &mut free };
                side.0 += n;
                side.1 += s;
                if constrained {
                    replayed.extend(outs);
                }
            }
        }
        let (f, c) = (free.0 as f64 / free.1, cons.0 as f64 / cons.1);
        println!("| {batch} | {f:.1} | {c:.1} | {:.3} | {} | {} |", c / f, free.0, cons.0);
    }
    let mut ms = mask_times(&grammars, &replayed)?;
    if ms.is_empty() {
        bail!("no constrained token to replay");
    }
    let n = ms.len();
    println!(
        "\nmask per sequence per step ({} vocabulary, {n} masks): p50 {:.3} ms, p99 {:.3} ms, max {:.3} ms",
        grammars.vocab(),
        pct(&mut ms, 0.5),
        pct(&mut ms, 0.99),
        pct(&mut ms, 1.0)
    );
    Ok(())
}
