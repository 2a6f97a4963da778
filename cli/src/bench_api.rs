//! `bench --api-compare`: one stack, the same workload sent alternately through gRPC `Generate` and
//! the OpenAI HTTP API (`/v1/completions`, streamed as Server-Sent Events), several rounds, tokens/s
//! and client-side time to the first visible text side by side: what HTTP costs over gRPC.

use crate::bench::{request, BenchArgs};
use crate::up::{spawn_quiet, Children};
use anyhow::{bail, Context, Result};
use layerstream_rpc::v1::coordinator_client::CoordinatorClient;
use layerstream_rpc::v1::{generate_event, generate_request, GenerateRequest};
use std::time::Instant;
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};

/// One round through one API: tokens generated, wall seconds, mean client-side first-token ms.
struct Round {
    tokens: u64,
    wall_s: f64,
    first_ms: f64,
}

impl Round {
    fn tok_s(&self) -> f64 {
        self.tokens as f64 / self.wall_s
    }
}

/// (tokens, first token seconds) of one gRPC request.
async fn grpc_one(addr: String, req: GenerateRequest) -> Result<(u64, f64)> {
    let t0 = Instant::now();
    let mut c = CoordinatorClient::connect(addr).await?;
    let mut s = c.generate(req).await?.into_inner();
    let mut first = None;
    while let Some(ev) = s.message().await? {
        match ev.event {
            // First visible text, as the HTTP side measures it (a special token shows none).
            Some(generate_event::Event::Token(t)) if !t.text.is_empty() => {
                first.get_or_insert(t0.elapsed().as_secs_f64());
            }
            Some(generate_event::Event::Done(d)) => {
                return Ok((d.output_ids.len() as u64, first.unwrap_or_default()))
            }
            _ => {}
        }
    }
    bail!("the gRPC stream ended early")
}

/// The same request as an OpenAI `/v1/completions` body, streamed, with usage.
fn http_body(req: &GenerateRequest) -> String {
    let s = req.sampling.clone().unwrap_or_default();
    let prompt = match &req.input {
        Some(generate_request::Input::TokenIds(t)) => serde_json::json!(t.ids),
        Some(generate_request::Input::Prompt(p)) => serde_json::json!(p),
        _ => serde_json::json!(""),
    };
    serde_json::json!({
        "prompt": prompt, "max_tokens": req.max_new_tokens, "ignore_eos": req.ignore_eos,
        "temperature": s.temperature, "top_k": s.top_k, "top_p": s.top_p, "seed": s.seed,
        "stream": true, "stream_options": {"include_usage": true},
    })
    .to_string()
}

/// (tokens, first token seconds) of one HTTP request: HTTP/1.1 by hand (chunked SSE), so the
/// measurement carries no client library of its own.
async fn http_one(base: String, body: String) -> Result<(u64, f64)> {
    let t0 = Instant::now();
    let host = base.trim_start_matches("http://").to_owned();
    let mut s = tokio::net::TcpStream::connect(&host).await?;
    s.set_nodelay(true)?;
    // One write: a second small one would wait for the server's delayed ACK (Nagle).
    let req = format!(
        "POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    );
    s.write_all(req.as_bytes()).await?;
    let mut r = BufReader::new(s);
    let mut line = String::new();
    r.read_line(&mut line).await?;
    if !line.contains(" 200 ") {
        bail!("HTTP answered {}", line.trim());
    }
    loop {
        line.clear();
        r.read_line(&mut line).await?;
        if line == "\r\n" || line.is_empty() {
            break;
        }
    }
    let (mut text, mut first, mut tokens) = (String::new(), None, None);
    loop {
        line.clear();
        r.read_line(&mut line).await?;
        let size = usize::from_str_radix(line.trim(), 16).context("chunk size")?;
        if size == 0 {
            break;
        }
        let mut chunk = vec![0u8; size + 2];
        r.read_exact(&mut chunk).await?;
        text.push_str(&String::from_utf8_lossy(&chunk[..size]));
        while let Some(i) = text.find("\n\n") {
            let event: String = text.drain(..i + 2).collect();
            let Some(data) = event.trim().strip_prefix("data: ") else { continue };
            if data == "[DONE]" {
                return Ok((tokens.unwrap_or(0), first.unwrap_or_default()));
            }
            let v: serde_json::Value = serde_json::from_str(data)?;
            if let Some(n) = v["usage"]["completion_tokens"].as_u64() {
                tokens = Some(n);
            } else if v["choices"][0]["text"].as_str().is_some_and(|t| !t.is_empty()) {
                first.get_or_insert(t0.elapsed().as_secs_f64());
            }
        }
    }
    bail!("the HTTP stream ended before [DONE]")
}

/// The workload (`a.batch` concurrent requests) through gRPC or HTTP.
async fn round(grpc: &str, http: Option<&str>, a: &BenchArgs, vocab: usize) -> Result<Round> {
    let t0 = Instant::now();
    let mut tasks = Vec::new();
    for i in 0..a.batch {
        let req = request(a, vocab, i as u64);
        tasks.push(match http {
            Some(h) => tokio::spawn(http_one(h.to_owned(), http_body(&req))),
            None => tokio::spawn(grpc_one(grpc.to_owned(), req)),
        });
    }
    let (mut tokens, mut first) = (0, 0.0);
    for t in tasks {
        let (n, f) = t.await??;
        tokens += n;
        first += f;
    }
    Ok(Round { tokens, wall_s: t0.elapsed().as_secs_f64(), first_ms: first / a.batch as f64 * 1e3 })
}

fn median(mut v: Vec<f64>) -> f64 {
    layerstream_types::stats::median(&mut v)
}

/// Runs the comparison on a fully resident stack (where the API's own cost shows most) and prints
/// per-round figures, medians and the HTTP / gRPC ratios.
pub fn compare(a: &BenchArgs, model: &str, vocab: usize, rounds: usize) -> Result<()> {
    let rt = tokio::runtime::Builder::new_multi_thread().enable_all().build()?;
    let mut children = Children(Vec::new());
    let mut args: Vec<String> =
        ["up", "--model", model, "--listen", "127.0.0.1:0", "--http-listen", "127.0.0.1:0"]
            .map(String::from)
            .to_vec();
    args.extend([
        "--workers".into(),
        a.workers.to_string(),
        "--max-batch".into(),
        a.batch.max(1).to_string(),
    ]);
    args.extend([
        "--device".into(),
        a.device.compute.device.clone(),
        "--memory-budget".into(),
        (1u64 << 40).to_string(),
    ]);
    let l = spawn_quiet(&mut children, "api-compare", &args)?;
    let (grpc, http) = (l.addr, l.http);
    let http = http.context("the stack serves no HTTP")?;
    let grpc_url = grpc.clone();
    rt.block_on(async {
        // Warm-up through both doors.
        round(&grpc_url, None, a, vocab).await?;
        round(&grpc_url, Some(&http), a, vocab).await?;
        println!("| round | gRPC tok/s | HTTP tok/s | gRPC first token ms | HTTP first token ms |");
        println!("|---|---|---|---|---|");
        let (mut g, mut h) = (Vec::new(), Vec::new());
        for i in 0..rounds {
            // Alternate which goes first, so drift favours neither.
            let (x, y) = if i % 2 == 0 {
                let x = round(&grpc_url, None, a, vocab).await?;
                (x, round(&grpc_url, Some(&http), a, vocab).await?)
            } else {
                let y = round(&grpc_url, Some(&http), a, vocab).await?;
                (round(&grpc_url, None, a, vocab).await?, y)
            };
            println!(
                "| {} | {:.1} | {:.1} | {:.1} | {:.1} |",
                i + 1,
                x.tok_s(),
                y.tok_s(),
                x.first_ms,
                y.first_ms
            );
            g.push(x);
            h.push(y);
        }
        let (gt, ht) = (
            median(g.iter().map(Round::tok_s).collect()),
            median(h.iter().map(Round::tok_s).collect()),
        );
        let (gf, hf) = (
            median(g.iter().map(|r| r.first_ms).collect()),
            median(h.iter().map(|r| r.first_ms).collect()),
        );
        println!("| median | {gt:.1} | {ht:.1} | {gf:.1} | {hf:.1} |");
        println!(
            "HTTP / gRPC tokens/s (median of {rounds}): {:.3}; first token: {:.3}",
            ht / gt,
            hf / gf
        );
        anyhow::Ok(())
    })
}
