//! `layerstream bench --micro-batches M|auto`: micro-batches in flight against one micro-batch
//! (every step through the workers in turn), each on a fresh `layerstream up` stack with the same
//! workload, fully resident and streamed, and the pipelined resident stack once more with hidden
//! states sent as gRPC bytes instead of through shared memory; prints tokens/s, the workers' busy
//! share, `pipelined / sequential tokens/s` and the hand-off ratio.

use crate::bench::{resident_args, run_config, streamed_args, BenchArgs, Row};
use crate::bench_report::tables;
use anyhow::{bail, Context, Result};
use layerstream_coordinator::MicroBatches;

/// Runs the five configurations (resident and streamed, each pipelined and sequential; resident
/// pipelined with gRPC hand-off) and prints the comparison.
pub fn compare(a: &BenchArgs, model: &str, vocab: usize, m: MicroBatches) -> Result<()> {
    if a.workers < 2 {
        bail!("--micro-batches compares micro-batches in flight across workers with one: give --workers 2 or more");
    }
    let rt = tokio::runtime::Builder::new_multi_thread().enable_all().build()?;
    let with = |base: Vec<String>, n: String| {
        let mut v = base;
        v.extend(["--micro-batches".to_owned(), n]);
        v
    };
    let configs = [
        ("resident, pipelined", with(resident_args(), m.to_string())),
        ("resident, sequential", with(resident_args(), "1".into())),
        ("streamed, pipelined", with(streamed_args(a), m.to_string())),
        ("streamed, sequential", with(streamed_args(a), "1".into())),
        ("resident, pipelined, hidden over gRPC", {
            let mut v = with(resident_args(), m.to_string());
            v.push("--hidden-over-grpc".into());
            v
        }),
    ];
    let mut rows: Vec<Row> = Vec::new();
    for (name, extra) in &configs {
        rows.push(run_config(name, model, vocab, extra, a, &rt).with_context(|| name.to_string())?);
    }
    println!(
        "workload: {} concurrent requests × {} tokens after a {} prompt, {} workers, {} thread(s) each",
        a.batch,
        a.max_new_tokens,
        a.prompt_tokens.map_or("text".to_owned(), |n| format!("{n}-token")),
        a.workers,
        a.device.compute.threads.map_or(
            "default (every core; cores ÷ workers while micro-batches run them at once)".to_owned(),
            |t| t.to_string()
        ),
    );
    print!("{}", tables(&rows));
    println!("\n| config | micro-batches | workers busy % |\n|---|---|---|");
    for r in &rows {
        println!("| {} | {} | {:.1} |", r.config, r.micro_batches, r.workers_busy_pct);
    }
    let ratio = |p: &Row, s: &Row| p.tokens_per_s / s.tokens_per_s;
    println!("pipelined / sequential tokens/s: {:.2}", ratio(&rows[0], &rows[1]));
    println!(
        "pipelined / sequential tokens/s, streamed: {:.2} (bytes streamed per step {:.2} vs {:.2} MB)",
        ratio(&rows[2], &rows[3]),
        rows[2].bytes_streamed_per_step / 1e6,
        rows[3].bytes_streamed_per_step / 1e6
    );
    println!(
        "hidden states through shared memory / as gRPC bytes, pipelined tokens/s: {:.2}",
        ratio(&rows[0], &rows[4])
    );
    if let Some(p) = &a.json_out {
        std::fs::write(p, serde_json::to_string_pretty(&rows)?)?;
    }
    Ok(())
}
