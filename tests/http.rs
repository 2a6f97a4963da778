//! The HTTP server as its users' tools see it: the official `openai` Python client, `curl -N` for raw
//! Server-Sent Events, a real Prometheus server scraping `/metrics`, and the page in headless
//! Chromium. Each tool-driven test is ignored, naming the tool to install, where the build did not
//! find it (tests/build.rs); `.ci/run` installs them.

use layerstream_kernels::CpuBackend;
use layerstream_tests::stack::*;
use layerstream_tests::*;
use std::process::Command;
use std::time::{Duration, Instant};

fn have(cmd: &str, args: &[&str]) -> bool {
    Command::new(cmd).args(args).output().is_ok_and(|o| o.status.success())
}

fn curl(args: &[&str]) -> String {
    let o = Command::new("curl").args(["-sS"]).args(args).output().expect("curl");
    String::from_utf8_lossy(&o.stdout).into_owned()
}

fn json_of(s: &str) -> serde_json::Value {
    serde_json::from_str(s).unwrap_or_else(|e| panic!("{e}: {s}"))
}

/// The HTTP status of a call, with the body.
fn status(args: &[&str]) -> (u16, String) {
    let out = curl(&[args, &["-w", "\n%{http_code}"]].concat());
    let (body, code) = out.rsplit_once('\n').unwrap();
    (code.trim().parse().unwrap(), body.to_owned())
}

fn log_softmax(l: &[f32]) -> Vec<f64> {
    let max = l.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
    let lse = max + l.iter().map(|&x| (x as f64 - max).exp()).sum::<f64>().ln();
    l.iter().map(|&x| x as f64 - lse).collect()
}

const PROMPT: &str = "What is the capital of France?";

#[test]
#[cfg_attr(not(have_clients), ignore = "needs the openai and jsonschema Python packages")]
fn the_openai_client_gets_what_run_answers_with_logprobs_of_the_cpu_backend() {
    let dir = tempfile::tempdir().unwrap();
    let store = tiny_store(dir.path());
    let s = store.to_str().unwrap();
    let stack = Stack::up_env(
        &store,
        &["--workers", "2", "--resident-layers", "1", "--api-key", "sk-test-123"],
        &[],
    );
    let ids: Vec<u32> = goldens("tiny-llama")[0].input_ids.clone();
    let ids_s: Vec<String> = ids.iter().map(u32::to_string).collect();
    let script = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("clients/openai_client.py");
    let o = Command::new("python3")
        .arg(&script)
        .args([stack.http(), "sk-test-123", PROMPT, &ids_s.join(",")])
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let v = json_of(String::from_utf8_lossy(&o.stdout).trim());
    stack.shutdown();

    // Models: the store's directory name.
    assert_eq!(v["models"], serde_json::json!([store.file_name().unwrap().to_str().unwrap()]));
    // Greedy chat equals `layerstream run --chat`, token for token (same text, same count).
    let run = last_json(&layerstream(&[
        "run",
        "--model",
        s,
        "--chat",
        PROMPT,
        "--max-new-tokens",
        "8",
        "--json",
    ]));
    let chat = &v["chat"];
    assert_eq!(chat["text"], run["text"], "{v}");
    assert_eq!(chat["role"], "assistant");
    assert_eq!(chat["object"], "chat.completion");
    let n_out = run["output_ids"].as_array().unwrap().len();
    assert_eq!(chat["usage"]["completion_tokens"], n_out);
    assert_eq!(chat["usage"]["prompt_tokens"], run["input_ids"].as_array().unwrap().len());
    assert_eq!(chat["finish_reason"], if n_out == 8 { "length" } else { "stop" });
    // Streaming: the chunks concatenate to the same text; the usage chunk comes last.
    let st = &v["stream"];
    assert_eq!(st["text"], chat["text"]);
    // The same prompt again: its full blocks come from the prefix cache, the rest of usage is equal.
    let strip = |u: &serde_json::Value| {
        let mut u = u.clone();
        u.as_object_mut().unwrap().remove("prompt_tokens_details");
        u
    };
    assert_eq!(strip(&st["usage"]), strip(&chat["usage"]));
    let cached = st["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64().unwrap();
    assert!(cached >= 16 && cached.is_multiple_of(16), "{st}");
    assert_eq!(st["finish_reason"], chat["finish_reason"]);
    assert!(st["chunks"].as_u64().unwrap() >= 3, "{st}");
    // Log-probabilities: log-softmax of the CPU backend's logits for the same ids.
    let st = layerstream_model::Store::open(&store).unwrap();
    let model = layerstream_worker::Model::load(CpuBackend::default(), &st).unwrap();
    let want = log_softmax(&prefill_logits(&model, &ids));
    let mut order: Vec<usize> = (0..want.len()).collect();
    order.sort_by(|&a, &b| want[b].total_cmp(&want[a]));
    let c = &v["completion"];
    let chosen = c["token_logprobs"][0].as_f64().unwrap();
    assert!(
        (chosen - want[order[0]]).abs() < 1e-4,
        "greedy's logprob {chosen} vs {}",
        want[order[0]]
    );
    let mut top: Vec<f64> =
        c["top_logprobs"][0].as_object().unwrap().values().map(|x| x.as_f64().unwrap()).collect();
    top.sort_by(|a, b| b.total_cmp(a));
    assert_eq!(top.len(), 3, "{c}");
    for (got, &i) in top.iter().zip(&order) {
        assert!((got - want[i]).abs() < 1e-4, "top logprob {got} vs {}", want[i]);
    }
    assert_eq!(c["tokens"].as_array().unwrap().len(), 4);
    assert_eq!(c["usage"]["prompt_tokens"], ids.len());
    // Chat logprobs: the chosen token is the top-1 of its own alternatives (greedy).
    for e in v["chat_logprobs"].as_array().unwrap() {
        assert_eq!(e["top"][0][0], e["token"], "{e}");
        assert!((e["top"][0][1].as_f64().unwrap() - e["logprob"].as_f64().unwrap()).abs() < 1e-6);
        assert_eq!(e["top"].as_array().unwrap().len(), 2);
    }
    // A stop string ends the text before it.
    if let Some(stop) = v.get("stop") {
        let text = stop["text"].as_str().unwrap();
        assert!(!text.contains(stop["stop"].as_str().unwrap()), "{stop}");
        assert!(chat["text"].as_str().unwrap().starts_with(text), "{stop}");
        assert_eq!(stop["finish_reason"], "stop");
    }
    assert_eq!(v["seeded_equal"], true);
    let e = &v["errors"];
    assert_eq!(e["wrong_key"], 401);
    assert_eq!(e["unknown_model"], 404);
    assert_eq!(e["too_long"], 400);
    assert_eq!(e["n17"], 400, "n is at most 16");
    assert_eq!(e["top_logprobs_21"], 400);
}

#[test]
fn curl_sees_raw_sse_and_a_client_that_hangs_up_cancels_its_job() {
    let dir = tempfile::tempdir().unwrap();
    let store = tiny_store(dir.path());
    let stack = Stack::up(&store, &["--workers", "1", "--cors-allow-origin", "http://app.test"]);
    let url = format!("{}/v1/chat/completions", stack.http());
    // CORS: the configured origin may call from a browser (preflight included); another may not.
    let pre = curl(&[
        "-i",
        "-X",
        "OPTIONS",
        "-H",
        "Origin: http://app.test",
        "-H",
        "Access-Control-Request-Method: POST",
        &url,
    ]);
    assert!(pre.starts_with("HTTP/1.1 204"), "{pre}");
    assert!(pre.to_lowercase().contains("access-control-allow-origin: http://app.test"), "{pre}");
    assert!(
        pre.to_lowercase().contains("access-control-allow-headers: authorization, content-type"),
        "{pre}"
    );
    let other = curl(&[
        "-i",
        "-H",
        "Origin: http://elsewhere.test",
        &format!("{}/v1/models", stack.http()),
    ]);
    assert!(!other.to_lowercase().contains("access-control-allow-origin"), "{other}");
    let body = format!(
        r#"{{"messages": [{{"role": "user", "content": "{PROMPT}"}}], "max_tokens": 5, "temperature": 0, "stream": true, "stream_options": {{"include_usage": true}}}}"#
    );
    let out = curl(&["-N", "-H", "Content-Type: application/json", "-d", &body, &url]);
    let data: Vec<&str> = out.lines().filter_map(|l| l.strip_prefix("data: ")).collect();
    assert_eq!(data.last(), Some(&"[DONE]"), "{out}");
    let chunks: Vec<serde_json::Value> =
        data[..data.len() - 1].iter().map(|d| json_of(d)).collect();
    assert_eq!(chunks[0]["choices"][0]["delta"]["role"], "assistant");
    assert!(chunks.iter().all(|c| c["object"] == "chat.completion.chunk"));
    let usage = &chunks.last().unwrap()["usage"];
    assert_eq!(usage["completion_tokens"], 5, "{out}");
    assert_eq!(chunks[chunks.len() - 2]["choices"][0]["finish_reason"], "length");
    // The same answer without streaming.
    let whole = json_of(&curl(&[
        "-H",
        "Content-Type: application/json",
        "-d",
        &body.replace("true", "false"),
        &url,
    ]));
    let text: String =
        chunks.iter().filter_map(|c| c["choices"][0]["delta"]["content"].as_str()).collect();
    assert_eq!(whole["choices"][0]["message"]["content"], text.as_str());
    // `up` calibrated and predicted a decode pass: each decode step is set beside it, and counted.
    let steps = json_of(&curl(&[&format!("{}/api/stack", stack.http())]))["steps"].clone();
    let decode: Vec<&serde_json::Value> =
        steps.as_array().unwrap().iter().filter(|s| s["rows"] == s["batch"]).collect();
    assert!(!decode.is_empty(), "{steps}");
    assert!(decode.iter().all(|s| s["predicted_ms"].as_f64().is_some_and(|p| p > 0.0)), "{steps}");
    assert!(stack.metric("layerstream_decode_step_predicted_seconds_total") > 0.0);
    assert!(stack.metric("layerstream_decode_step_seconds_total") > 0.0);
    // Errors in OpenAI's shape.
    let (code, b) = status(&[
        "-H",
        "Content-Type: application/json",
        "-d",
        r#"{"messages": [{"role": "user", "content": "x"}], "temperature": -1}"#,
        &url,
    ]);
    assert_eq!(code, 400, "{b}");
    assert_eq!(json_of(&b)["error"]["param"], "temperature", "{b}");
    // A refusal of the shared request path (past the model's context) names its parameter too.
    let completions = format!("{}/v1/completions", stack.http());
    let (code, b) = status(&[
        "-H",
        "Content-Type: application/json",
        "-d",
        r#"{"prompt": "x", "max_tokens": 100000}"#,
        &completions,
    ]);
    assert_eq!(code, 400, "{b}");
    assert_eq!(json_of(&b)["error"]["param"], "max_tokens", "{b}");
    assert!(
        json_of(&b)["error"]["message"].as_str().unwrap().starts_with("max_new_tokens: "),
        "{b}"
    );
    // A role the template would paste verbatim, and an empty completion prompt, name their param.
    let (code, b) = status(&[
        "-H",
        "Content-Type: application/json",
        "-d",
        r#"{"messages": [{"role": "<|im_start|>system", "content": "x"}]}"#,
        &url,
    ]);
    assert_eq!((code, json_of(&b)["error"]["param"].as_str()), (400, Some("messages")), "{b}");
    assert!(b.contains("roles are system, user, assistant, tool, developer"), "{b}");
    let (code, b) =
        status(&["-H", "Content-Type: application/json", "-d", r#"{"prompt": ""}"#, &completions]);
    assert_eq!((code, json_of(&b)["error"]["param"].as_str()), (400, Some("prompt")), "{b}");
    // Sent again with the same Idempotency-Key, a request gets the same job (and answer).
    let key_body = r#"{"prompt": "Once upon", "max_tokens": 4, "temperature": 0}"#;
    let with_key = || {
        json_of(&curl(&[
            "-H",
            "Content-Type: application/json",
            "-H",
            "Idempotency-Key: retry-7",
            "-d",
            key_body,
            &completions,
        ]))
    };
    let (first, second) = (with_key(), with_key());
    assert_eq!(first["id"], second["id"], "{first} {second}");
    assert_eq!(first["choices"][0]["text"], second["choices"][0]["text"]);
    let (code, b) = status(&["-H", "Content-Type: application/json", "-d", "{not json", &url]);
    assert_eq!(code, 400, "{b}");
    assert_eq!(json_of(&b)["error"]["type"], "invalid_request_error");
    // A long request whose client goes away after a second: the job is cancelled, not run out.
    let long =
        r#"{"prompt": "Once upon a time", "max_tokens": 1500, "ignore_eos": true, "stream": true}"#;
    let _ = curl(&[
        "-N",
        "--max-time",
        "1",
        "-H",
        "Content-Type: application/json",
        "-d",
        long,
        &format!("{}/v1/completions", stack.http()),
    ]);
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let m = curl(&[&format!("{}/metrics", stack.http())]);
        if m.lines().any(|l| l == "layerstream_requests_total{finish_reason=\"cancelled\"} 1") {
            break;
        }
        assert!(Instant::now() < deadline, "the abandoned request was not cancelled:\n{m}");
        std::thread::sleep(Duration::from_millis(200));
    }
    let (code, b) = status(&[&format!("{}/health", stack.http())]);
    assert_eq!((code, json_of(&b)["status"].clone()), (200, "ok".into()));
    stack.shutdown();
}

/// A free loopback port (bound, then released for the tool that needs one).
fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

#[test]
#[cfg_attr(not(have_prometheus), ignore = "needs prometheus on PATH (apt-get install prometheus)")]
fn prometheus_scrapes_the_whole_stack() {
    let prom = ["prometheus", "/usr/bin/prometheus"].into_iter().find(|p| have(p, &["--version"]));
    let prom = prom.expect("prometheus was on PATH when the tests were built");
    let dir = tempfile::tempdir().unwrap();
    let store = tiny_store(dir.path());
    let stack = Stack::up(&store, &["--workers", "2", "--resident-layers", "1"]);
    let target = stack.http().trim_start_matches("http://").to_owned();
    let cfg = dir.path().join("prometheus.yml");
    std::fs::write(
        &cfg,
        format!("global:\n  scrape_interval: 1s\nscrape_configs:\n  - job_name: layerstream\n    static_configs:\n      - targets: ['{target}']\n"),
    )
    .unwrap();
    let port = free_port();
    let mut p = Command::new(prom)
        .arg(format!("--config.file={}", cfg.display()))
        .arg(format!("--storage.tsdb.path={}", dir.path().join("tsdb").display()))
        .arg(format!("--web.listen-address=127.0.0.1:{port}"))
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let body = r#"{"prompt": "The quick brown fox", "max_tokens": 7, "ignore_eos": true, "temperature": 0}"#;
    let r = json_of(&curl(&[
        "-H",
        "Content-Type: application/json",
        "-d",
        body,
        &format!("{}/v1/completions", stack.http()),
    ]));
    assert_eq!(r["usage"]["completion_tokens"], 7, "{r}");
    let query = |expr: &str| {
        curl(&[
            "-G",
            &format!("http://127.0.0.1:{port}/api/v1/query"),
            "--data-urlencode",
            &format!("query={expr}"),
        ])
    };
    let q = |expr: &str| json_of(&query(expr));
    let deadline = Instant::now() + Duration::from_secs(60);
    let value = loop {
        // While Prometheus starts it answers "Service Unavailable" (not JSON): keep asking.
        let raw = query("sum(layerstream_generation_tokens_total)");
        let v: serde_json::Value =
            serde_json::from_str(&raw).unwrap_or(serde_json::Value::String(raw));
        if let Some(x) = v["data"]["result"][0]["value"][1].as_str() {
            if x == "7" {
                break x.to_owned();
            }
        }
        assert!(Instant::now() < deadline, "Prometheus never saw the tokens: {v}");
        std::thread::sleep(Duration::from_millis(500));
    };
    assert_eq!(value, "7");
    // Both workers up, their streaming counted, the loader's cache seen through them.
    let up = q("sum(layerstream_worker_up)");
    assert_eq!(up["data"]["result"][0]["value"][1], "2", "{up}");
    let bytes = q("sum(layerstream_worker_bytes_streamed_total)");
    assert!(bytes["data"]["result"][0]["value"][1].as_str().unwrap().parse::<f64>().unwrap() > 0.0);
    let misses = q("sum(layerstream_loader_cache_misses_total)");
    assert!(
        misses["data"]["result"][0]["value"][1].as_str().unwrap().parse::<f64>().unwrap() > 0.0
    );
    let _ = p.kill();
    let _ = p.wait();
    stack.shutdown();
}

#[test]
#[cfg_attr(not(have_chromium), ignore = "needs Chromium on PATH (apt-get install chromium)")]
fn the_page_chats_in_a_real_browser() {
    let browser = ["chromium", "chromium-browser", "google-chrome"]
        .into_iter()
        .find(|b| have(b, &["--version"]));
    let browser = browser.expect("Chromium was on PATH when the tests were built");
    let dir = tempfile::tempdir().unwrap();
    let store = tiny_store(dir.path());
    let stack = Stack::up(&store, &["--workers", "2", "--resident-layers", "1"]);
    let body = format!(
        r#"{{"messages": [{{"role": "user", "content": "{PROMPT}"}}], "max_tokens": 6, "temperature": 0}}"#
    );
    let want = json_of(&curl(&[
        "-H",
        "Content-Type: application/json",
        "-d",
        &body,
        &format!("{}/v1/chat/completions", stack.http()),
    ]));
    let want = want["choices"][0]["message"]["content"].as_str().unwrap().to_owned();
    // `?prompt=` sends the prompt as if typed; the DOM after the answer holds its text.
    let url = format!(
        "{}/?prompt={}&max=6",
        stack.http(),
        PROMPT.replace(' ', "%20").replace('?', "%3F")
    );
    let shot = dir.path().join("page.png");
    let run = |extra: &[&str]| {
        let o = Command::new(browser)
            .args([
                "--headless",
                "--no-sandbox",
                "--disable-gpu",
                "--disable-dev-shm-usage",
                "--virtual-time-budget=15000",
                "--window-size=1280,800",
            ])
            .arg(format!("--user-data-dir={}", dir.path().join("profile").display()))
            .args(extra)
            .arg(&url)
            .output()
            .unwrap();
        String::from_utf8_lossy(&o.stdout).into_owned()
    };
    let dom = run(&["--dump-dom"]);
    assert!(dom.contains("data-done=\"1\""), "the answer did not finish in the page:\n{dom}");
    let html_text = want.replace('&', "&amp;").replace('<', "&lt;").replace('>', "&gt;");
    assert!(dom.contains(&html_text), "the page's answer is not the API's `{want}`:\n{dom}");
    assert!(dom.contains("class=\"layer res\""), "the plan view shows resident layers");
    run(&[&format!("--screenshot={}", shot.display())]);
    let png = std::fs::read(&shot).unwrap();
    assert!(png.starts_with(b"\x89PNG") && png.len() > 10_000, "screenshot of {} bytes", png.len());
    stack.shutdown();
}

/// `up` with a prompt answers and stops: it serves no HTTP, so a port 8000 another program holds
/// does not matter; a serving `up` names the address it cannot take.
#[test]
fn a_one_shot_up_leaves_port_8000_alone_and_a_taken_port_is_named() {
    let _hold = std::net::TcpListener::bind("127.0.0.1:8000")
        .expect("this test holds port 8000 itself: stop what listens on it");
    let dir = tempfile::tempdir().unwrap();
    let store = tiny_store(dir.path());
    let s = store.to_str().unwrap();
    let base = ["up", "--model", s, "--listen", "127.0.0.1:0"];
    let v = last_json(&layerstream(
        &[&base[..], &["--chat", PROMPT, "--max-new-tokens", "2", "--json"]].concat(),
    ));
    assert_eq!(v["output_ids"].as_array().unwrap().len(), 2, "{v}");
    let err = layerstream_fails(&base);
    assert!(err.contains("127.0.0.1:8000 (--http-listen)"), "{err}");
}

/// A flood of connections that never send a request: the server closes them after
/// `--http-idle-timeout`, and while they are open a real client's chat and the health check are
/// answered at once. Past `--http-max-connections` a new connection is closed as it is accepted,
/// and once the idle ones are gone the server accepts again.
#[test]
fn idle_connections_are_closed_and_never_block_a_request() {
    use std::io::Read;
    use std::net::TcpStream;
    let dir = tempfile::tempdir().unwrap();
    let store = tiny_store(dir.path());
    let stack = Stack::up(&store, &["--workers", "1", "--http-idle-timeout", "2"]);
    let hostport = stack.http().trim_start_matches("http://").to_owned();
    let flood: Vec<TcpStream> = (0..400).map(|_| TcpStream::connect(&hostport).unwrap()).collect();
    let started = Instant::now();
    let body =
        r#"{"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3, "temperature": 0}"#;
    let url = format!("{}/v1/chat/completions", stack.http());
    let (code, b) = status(&["-H", "Content-Type: application/json", "-d", body, &url]);
    assert_eq!(code, 200, "{b}");
    let (code, _) = status(&[&format!("{}/health", stack.http())]);
    assert_eq!(code, 200);
    eprintln!("chat and health answered in {:?} beside 400 idle connections", started.elapsed());
    // Every idle one is closed by the server (EOF) within the timeout and a margin.
    for mut s in flood {
        s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        let mut buf = [0u8; 1];
        assert!(closed(s.read(&mut buf)), "an idle connection stayed open");
    }
    let closed_after = started.elapsed();
    eprintln!("400 idle connections closed by the server after {closed_after:?}");
    assert!(closed_after < Duration::from_secs(10), "{closed_after:?}");
    stack.shutdown();

    // The cap: 8 connections held, the 9th closed at once; when they time out, a request passes.
    let stack = Stack::up(
        &store,
        &["--workers", "1", "--http-idle-timeout", "2", "--http-max-connections", "8"],
    );
    let hostport = stack.http().trim_start_matches("http://").to_owned();
    let held: Vec<TcpStream> = (0..8).map(|_| TcpStream::connect(&hostport).unwrap()).collect();
    std::thread::sleep(Duration::from_millis(200));
    let mut ninth = TcpStream::connect(&hostport).unwrap();
    ninth.set_read_timeout(Some(Duration::from_secs(1))).unwrap();
    let mut buf = [0u8; 1];
    assert!(closed(ninth.read(&mut buf)), "the 9th connection was kept");
    std::thread::sleep(Duration::from_secs(3));
    let url = format!("{}/v1/chat/completions", stack.http());
    let (code, b) = status(&["-H", "Content-Type: application/json", "-d", body, &url]);
    drop(held);
    assert_eq!(code, 200, "{b}");
    stack.shutdown();
}

/// Whether a read shows the peer closed the connection (EOF or reset), not a read timeout.
fn closed(r: std::io::Result<usize>) -> bool {
    match r {
        Ok(n) => n == 0,
        Err(e) => {
            !matches!(e.kind(), std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut)
        }
    }
}
