//! Cancellation, client loss, traces and crashes on the real stack: cancelled jobs free their KV
//! caches and slots; an OTLP receiver gets the job → step → layer → h2d/compute → read spans with
//! correct parents; malformed internal calls and a full queue are refused; no shm remains after
//! shutdown. (Killed and stopped processes: `recovery.rs`.)

use layerstream_rpc::v1::coordinator_client::CoordinatorClient;
use layerstream_rpc::v1::*;
use layerstream_tests::stack::*;
use layerstream_tests::*;
use std::io::Read;
use std::process::Stdio;
use std::time::{Duration, Instant};
use tonic_types::StatusExt;

/// A `layerstream submit` process generating a long answer, returned once its first text arrived.
fn long_submit(addr: &str) -> std::process::Child {
    let mut child = cmd()
        .args([
            "submit",
            "--addr",
            addr,
            "--prompt",
            "Hello",
            "--max-new-tokens",
            "1900",
            "--ignore-eos",
        ])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut buf = [0u8; 16];
    child.stdout.as_mut().unwrap().read_exact(&mut buf).unwrap();
    child
}

fn long_request() -> GenerateRequest {
    GenerateRequest {
        input: Some(generate_request::Input::Prompt("Hello".into())),
        max_new_tokens: 1900,
        ignore_eos: true,
        ..Default::default()
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn cancel_mid_job_frees_kv_caches_and_slots() {
    let dir = tempfile::tempdir().unwrap();
    let stack = Stack::up(&tiny_store(dir.path()), &["--workers", "2", "--resident-layers", "0"]);
    let mut c = CoordinatorClient::connect(stack.addr().to_owned()).await.unwrap();
    let job = c
        .submit_job(SubmitJobRequest { requests: vec![long_request(), long_request()] })
        .await
        .unwrap()
        .into_inner();
    let mut watch = c
        .watch_job(JobRef { job_id: job.job_id.clone(), ..Default::default() })
        .await
        .unwrap()
        .into_inner();
    let mut tokens = 0;
    while tokens < 6 {
        let ev = watch.message().await.unwrap().expect("job still running");
        if matches!(ev.event.and_then(|e| e.event), Some(generate_event::Event::Token(_))) {
            tokens += 1;
        }
    }
    assert!(live_sequences(stack.addr()).await > 0);
    c.cancel_job(JobRef { job_id: job.job_id.clone(), ..Default::default() }).await.unwrap();
    let mut reasons = Vec::new();
    while let Some(ev) = watch.message().await.unwrap() {
        if let Some(generate_event::Event::Done(d)) = ev.event.and_then(|e| e.event) {
            assert!(d.output_ids.len() < 1900);
            reasons.push(d.finish_reason());
        }
    }
    assert_eq!(reasons, vec![FinishReason::Cancelled, FinishReason::Cancelled]);
    assert_eq!(
        c.get_job(JobRef { job_id: job.job_id, ..Default::default() })
            .await
            .unwrap()
            .into_inner()
            .state(),
        JobState::Cancelled
    );
    wait_until_zero_sequences(stack.addr()).await;
    assert_eq!(
        stack.loader_client().await.describe(DescribeRequest {}).await.unwrap().into_inner().pinned,
        0,
        "slots still pinned"
    );
    // The stack still serves after the cancellation.
    let v = submit(stack.addr(), &["--prompt", "Hi", "--max-new-tokens", "3"]);
    assert_eq!(v["output_ids"].as_array().unwrap().len(), 3);
    stack.shutdown();
}

#[tokio::test(flavor = "multi_thread")]
async fn a_client_that_goes_away_cancels_its_request() {
    let dir = tempfile::tempdir().unwrap();
    let stack = Stack::up(&tiny_store(dir.path()), &["--workers", "1", "--resident-layers", "1"]);
    let mut child = long_submit(stack.addr());
    assert!(live_sequences(stack.addr()).await > 0);
    child.kill().unwrap();
    child.wait().unwrap();
    wait_until_zero_sequences(stack.addr()).await;
    stack.shutdown();
}

#[test]
fn spans_reach_an_otlp_receiver_with_correct_parents() {
    let dir = tempfile::tempdir().unwrap();
    let spans_file = dir.path().join("spans.jsonl");
    let (mut sink, stack) =
        traced_stack(dir.path(), &spans_file, &["--workers", "2", "--resident-layers", "1"]);
    let v = submit(
        stack.addr(),
        &[
            "--prompt",
            "The quick brown fox",
            "--max-new-tokens",
            "3",
            "--temperature",
            "0.8",
            "--seed",
            "5",
        ],
    );
    let trace = v["trace_id"].as_str().unwrap().to_owned();
    stack.shutdown(); // flushes every process's exporter
    let spans: Vec<serde_json::Value> = whole_traces(&spans_file, &[trace.as_str()])
        .into_iter()
        .filter(|s| s["trace_id"] == trace.as_str())
        .collect();
    sink.stop();
    let by_id = |id: &str| spans.iter().find(|s| s["span_id"] == id);
    let parent_name = |s: &serde_json::Value| {
        by_id(s["parent_span_id"].as_str().unwrap()).map(|p| p["name"].as_str().unwrap().to_owned())
    };
    let named = |prefix: &str| {
        spans
            .iter()
            .filter(move |s| s["name"].as_str().unwrap().starts_with(prefix))
            .collect::<Vec<_>>()
    };
    assert_eq!(named("job").len(), 1, "one job span in {} spans", spans.len());
    assert_eq!(named("job")[0]["service"], "coordinator");
    assert!(named("step").len() >= 3);
    for s in named("step") {
        assert_eq!(parent_name(s).as_deref(), Some("job"));
        assert_eq!(s["attributes"]["batch"].as_i64(), Some(1), "{s}");
    }
    // One `stage` span per worker call (its worker and micro-batch named), the worker's own under it.
    for s in named("stage") {
        assert_eq!(parent_name(s).as_deref(), Some("step"));
        assert_eq!(s["service"], "coordinator");
        assert!(s["attributes"]["worker"].is_string() && s["attributes"]["micro_batch"].is_i64());
    }
    assert_eq!(named("stage").len(), 2 * named("step").len(), "a stage span per worker call");
    for s in named("worker step") {
        assert_eq!(parent_name(s).as_deref(), Some("stage"));
        assert_eq!(s["service"], "worker");
    }
    assert_eq!(
        named("worker step").len(),
        2 * named("step").len(),
        "both workers traced every step"
    );
    let layers = named("layer ");
    assert!(!layers.is_empty());
    for s in &layers {
        assert_eq!(parent_name(s).as_deref(), Some("worker step"));
    }
    for s in named("compute") {
        assert!(parent_name(s).unwrap().starts_with("layer "));
        // Counts are numbers in the trace, not strings (unsigned fields would export as strings).
        assert!(
            s["attributes"]["layer"].is_i64() && s["attributes"]["rows"].as_i64() > Some(0),
            "{s}"
        );
    }
    let h2d = named("h2d");
    assert!(!h2d.is_empty(), "streamed layers have h2d spans");
    for s in &h2d {
        assert!(parent_name(s).unwrap().starts_with("layer "));
        // A prefetch for the next step cut short by the shutdown (the loader already gone) says
        // why instead of counting bytes.
        if s["attributes"].get("error").is_some() {
            continue;
        }
        assert!(s["attributes"]["bytes"].as_i64().unwrap() > 0, "{s}");
        assert!(s["attributes"]["gbps"].as_f64().unwrap() > 0.0);
    }
    assert!(h2d.iter().any(|s| s["attributes"].get("error").is_none()), "every copy failed");
    let reads = named("read layer");
    assert!(!reads.is_empty());
    for s in &reads {
        assert_eq!(s["service"], "loader-daemon");
        assert_eq!(parent_name(s).as_deref(), Some("acquire"));
        assert!(s["attributes"]["cache"] == "hit" || s["attributes"]["cache"] == "miss");
        assert!(s["attributes"]["layer"].is_i64(), "{s}");
    }
    for s in named("acquire") {
        assert_eq!(parent_name(s).as_deref(), Some("h2d"));
    }
    // The last worker's head (final norm, lm_head, token choice) once a step; sampling inside it.
    assert_eq!(named("head").len(), named("step").len(), "a head span per step");
    for s in named("head") {
        assert_eq!(parent_name(s).as_deref(), Some("worker step"));
        assert_eq!(s["attributes"]["greedy"], false);
    }
    assert_eq!(named("sample").len(), named("step").len(), "a sample span per step");
    for s in named("sample") {
        assert_eq!(parent_name(s).as_deref(), Some("head"));
        assert_eq!(s["attributes"]["rows"].as_i64(), Some(1), "{s}");
    }
}

/// With continuous batching one step serves several jobs, yet each job's trace reaches the workers'
/// `h2d` and `compute` spans of every step it rode: through its own `step` span's children, or
/// through the link to the step span that carries them. One request is one trace, from its RPC span.
#[test]
fn every_concurrent_job_trace_reaches_the_transfers_of_its_steps() {
    let dir = tempfile::tempdir().unwrap();
    let spans_file = dir.path().join("spans.jsonl");
    let (mut sink, stack) =
        traced_stack(dir.path(), &spans_file, &["--workers", "2", "--resident-layers", "1"]);
    let addr = stack.addr().to_owned();
    let jobs: Vec<(String, usize)> = std::thread::scope(|s| {
        let hs: Vec<_> = [6usize, 9, 12]
            .into_iter()
            .map(|n| {
                let addr = addr.clone();
                s.spawn(move || {
                    let v = submit(
                        &addr,
                        &[
                            "--prompt",
                            "The quick brown fox",
                            "--max-new-tokens",
                            &n.to_string(),
                            "--ignore-eos",
                        ],
                    );
                    (v["trace_id"].as_str().unwrap().to_owned(), n)
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    stack.shutdown();
    let traces: Vec<&str> = jobs.iter().map(|(t, _)| t.as_str()).collect();
    let all = whole_traces(&spans_file, &traces);
    sink.stop();
    let by_id: std::collections::HashMap<&str, &serde_json::Value> =
        all.iter().map(|s| (s["span_id"].as_str().unwrap(), s)).collect();
    let mut children: std::collections::HashMap<&str, Vec<&serde_json::Value>> = Default::default();
    for s in &all {
        children.entry(s["parent_span_id"].as_str().unwrap_or("")).or_default().push(s);
    }
    // Names of every span under `id`.
    let below = |id: &str| {
        let mut names = std::collections::HashSet::new();
        let mut todo = vec![id.to_owned()];
        while let Some(p) = todo.pop() {
            for c in children.get(p.as_str()).into_iter().flatten() {
                names.insert(c["name"].as_str().unwrap().split(' ').next().unwrap().to_owned());
                todo.push(c["span_id"].as_str().unwrap().to_owned());
            }
        }
        names
    };
    let mut linked = 0;
    for (trace, n) in &jobs {
        let mine: Vec<&serde_json::Value> =
            all.iter().filter(|s| s["trace_id"] == trace.as_str()).collect();
        let job = mine.iter().find(|s| s["name"] == "job").expect("a job span");
        let rpc = by_id
            .get(job["parent_span_id"].as_str().unwrap())
            .expect("the job has its RPC span as parent");
        assert_eq!(rpc["name"], "generate");
        let steps: Vec<&&serde_json::Value> = mine.iter().filter(|s| s["name"] == "step").collect();
        // The prefill step, then a step per token after the first.
        assert!(steps.len() >= *n, "{} steps for {n} tokens", steps.len());
        for st in steps {
            let own = st["span_id"].as_str().unwrap();
            let target = if below(own).contains("worker") {
                own.to_owned()
            } else {
                let links = st["links"].as_array().unwrap();
                assert_eq!(
                    links.len(),
                    1,
                    "a step without workers' spans links to the one with them: {st}"
                );
                linked += 1;
                links[0]["span_id"].as_str().unwrap().to_owned()
            };
            let names = below(&target);
            for want in ["worker", "layer", "compute", "h2d", "head"] {
                assert!(names.contains(want), "step {st} reaches no `{want}` span ({names:?})");
            }
        }
    }
    assert!(linked > 0, "the three jobs never shared a step");
}

#[test]
fn a_budget_that_cannot_fit_is_refused_before_anything_loads() {
    let dir = tempfile::tempdir().unwrap();
    let store = tiny_store(dir.path());
    let s = store.to_str().unwrap();
    let up = ["up", "--model", s, "--listen", "127.0.0.1:0", "--workers", "1"];
    // 1 MiB cannot hold tiny-llama's 12.6 MB embedding: the planner refuses, naming the budget.
    let err = layerstream_fails(&[&up[..], &["--memory-budget", "1M"]].concat());
    assert!(
        err.contains("memory budget 1048576 bytes cannot hold") && err.contains("embedding/head"),
        "{err}"
    );
    // Residency is given one way: a budget (the planner picks) or a count, not both (the planner's
    // unit tests cover a count that overflows a worker's own budget).
    let err = layerstream_fails(
        &[&up[..], &["--memory-budget", "14M", "--resident-layers", "4"]].concat(),
    );
    assert!(err.contains("cannot be used with"), "{err}");
}

/// Malformed `Worker/Step` calls from a client of the internal API (duplicate sequence ids, tokens
/// outside the vocabulary, unknown positions, KV blocks that do not cover the positions, hidden states of the wrong size or not finite) are
/// refused with INVALID_ARGUMENT naming the field, change nothing, and a normal job still gets
/// `run`'s tokens afterwards.
#[test]
fn malformed_step_calls_are_refused_and_the_stack_keeps_serving() {
    let dir = tempfile::tempdir().unwrap();
    let store = tiny_store(dir.path());
    let s = store.to_str().unwrap();
    let args = ["--prompt", "Hello there", "--max-new-tokens", "6", "--ignore-eos"];
    let want = last_json(&layerstream(&[&["run", "--model", s, "--json"], &args[..]].concat()))
        ["output_ids"]
        .clone();
    let stack = Stack::up(&store, &["--workers", "2", "--resident-layers", "1"]);
    let refusals = tokio::runtime::Runtime::new().unwrap().block_on(async {
        let mut c = CoordinatorClient::connect(stack.addr().to_owned()).await.unwrap();
        let ws = c.list_workers(ListWorkersRequest {}).await.unwrap().into_inner().workers;
        let mut clients = Vec::new();
        for w in &ws {
            clients.push(worker_client(w.address.clone()).await);
        }
        let seq = |id: u64, pos: u32, ids: &[u32]| StepSeq {
            seq_id: id,
            start_pos: pos,
            token_ids: ids.to_vec(),
            blocks: vec![3],
            ..Default::default()
        };
        let hidden = |vals: &[f32]| vals.iter().flat_map(|v| v.to_le_bytes()).collect::<Vec<u8>>();
        let calls = vec![
            (0, vec![seq(900, 0, &[1]), seq(900, 0, &[2])], vec![], "seqs.seq_id"),
            (0, vec![seq(901, 0, &[u32::MAX])], vec![], "seqs.token_ids"),
            (0, vec![seq(902, 7, &[1])], vec![], "seqs.start_pos"),
            (1, vec![seq(903, 0, &[1])], hidden(&[0.5; 3]), "hidden"),
            (1, vec![seq(904, 0, &[1])], vec![0u8; 5], "hidden"),
            // KV blocks that do not cover the step's positions, or outside the pool.
            (0, vec![StepSeq { blocks: vec![], ..seq(905, 0, &[1]) }], vec![], "seqs.blocks"),
            (
                0,
                vec![StepSeq { blocks: vec![1 << 30], ..seq(906, 0, &[1]) }],
                vec![],
                "seqs.blocks",
            ),
        ];
        let mut out = Vec::new();
        for (w, seqs, hidden, field) in calls {
            let st = clients[w]
                .step(StepRequest { seqs, hidden, ..Default::default() })
                .await
                .unwrap_err();
            // The field travels as a google.rpc.BadRequest violation too, not only in the text.
            let violation =
                st.get_details_bad_request().map(|b| b.field_violations[0].field.clone());
            out.push((st.code(), st.message().to_owned(), field, violation));
        }
        let h = ws[1].address.clone();
        let mut second = worker_client(h).await;
        let info = second.info(InfoRequest {}).await.unwrap().into_inner();
        (out, info.sequences)
    });
    let (out, live) = refusals;
    for (code, msg, field, violation) in &out {
        assert_eq!(*code, tonic::Code::InvalidArgument, "{msg}");
        assert!(msg.starts_with(field), "{msg} should name {field}");
        assert_eq!(violation.as_deref(), Some(*field), "{msg}");
    }
    assert_eq!(live, 0, "a refused step leaves no sequence behind");
    let v = submit(stack.addr(), &args);
    stack.shutdown();
    assert_eq!(v["output_ids"], want, "the stack serves normally after malformed calls");
}

/// `--queue-size` counts waiting sequences: with one running and the queue full, the next request
/// gets RESOURCE_EXHAUSTED at once; cancelled waiting jobs leave the count, so the queue takes new
/// work again. A prompt too long for any context is refused before it is tokenized.
#[test]
fn a_full_queue_refuses_at_once_and_frees_on_cancel() {
    let dir = tempfile::tempdir().unwrap();
    let store = tiny_store(dir.path());
    let stack = Stack::up(&store, &["--workers", "1", "--max-batch", "1", "--queue-size", "2"]);
    let addr = stack.addr().to_owned();
    tokio::runtime::Runtime::new().unwrap().block_on(async move {
        let mut c = CoordinatorClient::connect(addr).await.unwrap();
        let req = |n: u32| GenerateRequest {
            input: Some(generate_request::Input::Prompt("Hello".into())),
            max_new_tokens: n,
            ignore_eos: true,
            ..Default::default()
        };
        let job = |n| SubmitJobRequest { requests: vec![req(n)] };
        let running = c.submit_job(job(1900)).await.unwrap().into_inner().job_id;
        let deadline = Instant::now() + Duration::from_secs(30);
        while c
            .get_job(JobRef { job_id: running.clone(), ..Default::default() })
            .await
            .unwrap()
            .into_inner()
            .state()
            != JobState::Running
        {
            assert!(Instant::now() < deadline, "the first job never started");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let b = c.submit_job(job(4)).await.unwrap().into_inner().job_id;
        let d = c.submit_job(job(4)).await.unwrap().into_inner().job_id;
        let full = c.submit_job(job(4)).await.unwrap_err();
        assert_eq!(full.code(), tonic::Code::ResourceExhausted, "{}", full.message());
        assert!(full.message().contains("--queue-size"), "{}", full.message());
        // A two-request job that does not fit as a whole is refused whole.
        let two = SubmitJobRequest { requests: vec![req(4), req(4)] };
        assert_eq!(c.submit_job(two).await.unwrap_err().code(), tonic::Code::ResourceExhausted);
        for id in [&b, &d] {
            c.cancel_job(JobRef { job_id: id.clone(), ..Default::default() }).await.unwrap();
        }
        let deadline = Instant::now() + Duration::from_secs(30);
        let e = loop {
            match c.submit_job(job(4)).await {
                Ok(r) => break r.into_inner().job_id,
                Err(s)
                    if s.code() == tonic::Code::ResourceExhausted && Instant::now() < deadline =>
                {
                    tokio::time::sleep(Duration::from_millis(20)).await
                }
                Err(s) => panic!("the queue never emptied after cancelling: {}", s.message()),
            }
        };
        c.cancel_job(JobRef { job_id: e, ..Default::default() }).await.unwrap();
        c.cancel_job(JobRef { job_id: running, ..Default::default() }).await.unwrap();
        // Far more text than any context holds: refused naming the bound, without tokenizing it.
        let huge = GenerateRequest {
            input: Some(generate_request::Input::Prompt("word ".repeat(40_000))),
            ..Default::default()
        };
        let err = c.submit_job(SubmitJobRequest { requests: vec![huge] }).await.unwrap_err();
        assert_eq!(err.code(), tonic::Code::InvalidArgument);
        assert!(err.message().contains("bytes exceed"), "{}", err.message());
        let field = |s: &tonic::Status| {
            s.get_details_bad_request().unwrap().field_violations[0].field.clone()
        };
        assert_eq!(field(&err), "requests[0].prompt");
        // Generate takes one request: its fields are named without a job index.
        let bad = GenerateRequest {
            input: Some(generate_request::Input::Prompt("hi".into())),
            sampling: Some(Sampling { top_p: -1.0, ..Default::default() }),
            ..Default::default()
        };
        let err = c.generate(bad).await.unwrap_err();
        assert_eq!(err.code(), tonic::Code::InvalidArgument);
        assert_eq!(field(&err), "sampling.top_p", "{}", err.message());
        assert!(err.message().starts_with("top_p: "), "{}", err.message());
    });
    stack.shutdown();
}

/// The coordinator's memory stays flat over many jobs: finished records expire by count
/// (`--max-job-records`), nothing else accumulates per job. RSS after 1,000 more jobs is compared
/// with RSS after a warm-up of 100.
#[test]
fn coordinator_memory_stays_flat_over_a_thousand_jobs() {
    let dir = tempfile::tempdir().unwrap();
    let store = tiny_store(dir.path());
    let stack =
        Stack::up(&store, &["--workers", "1", "--max-batch", "16", "--max-job-records", "50"]);
    let coord = stack.children("coordinator")[0];
    let rss_kb = || -> u64 {
        let s = std::fs::read_to_string(format!("/proc/{coord}/status")).unwrap();
        let line = s.lines().find(|l| l.starts_with("VmRSS:")).unwrap();
        line.split_whitespace().nth(1).unwrap().parse().unwrap()
    };
    let addr = stack.addr().to_owned();
    let rt = tokio::runtime::Runtime::new().unwrap();
    let jobs = |n: usize| {
        let addr = addr.clone();
        rt.block_on(async move {
            let c = CoordinatorClient::connect(addr).await.unwrap();
            let mut tasks = Vec::new();
            for t in 0..16 {
                let mut c = c.clone();
                tasks.push(tokio::spawn(async move {
                    for i in (t..n).step_by(16) {
                        let req = GenerateRequest {
                            input: Some(generate_request::Input::Prompt(format!("job {i}"))),
                            max_new_tokens: 1,
                            ..Default::default()
                        };
                        let mut s = c.generate(req).await.unwrap().into_inner();
                        while s.message().await.unwrap().is_some() {}
                    }
                }));
            }
            for t in tasks {
                t.await.unwrap();
            }
        })
    };
    jobs(100);
    let before = rss_kb();
    jobs(1000);
    let after = rss_kb();
    eprintln!("coordinator RSS: {before} kB after 100 jobs, {after} kB after 1,100");
    assert!(
        after < before + 4096,
        "RSS grew by {} kB over 1,000 jobs",
        after.saturating_sub(before)
    );
    stack.shutdown();
}

/// 64 clients × 4 jobs against a small queue: every job either completes with the tokens of its
/// solo `run` or is refused at once with RESOURCE_EXHAUSTED; none hangs.
#[test]
fn sixty_four_clients_get_their_solo_tokens_or_resource_exhausted() {
    let dir = tempfile::tempdir().unwrap();
    let store = tiny_store(dir.path());
    let prompts = ["Once upon a time", "Hello there", "The capital of", "1 2 3"];
    let solo: Vec<Vec<u32>> = prompts
        .iter()
        .map(|p| {
            let s = store.to_str().unwrap();
            let v = last_json(&layerstream(&[
                "run",
                "--model",
                s,
                "--json",
                "--prompt",
                p,
                "--max-new-tokens",
                "6",
                "--ignore-eos",
            ]));
            v["output_ids"].as_array().unwrap().iter().map(|x| x.as_u64().unwrap() as u32).collect()
        })
        .collect();
    let stack = Stack::up(&store, &["--workers", "2", "--max-batch", "8", "--queue-size", "8"]);
    let addr = stack.addr().to_owned();
    let (done, refused) = tokio::runtime::Runtime::new().unwrap().block_on(async move {
        let c = CoordinatorClient::connect(addr).await.unwrap();
        let mut tasks = Vec::new();
        for client in 0..64usize {
            let (mut c, solo) = (c.clone(), solo.clone());
            tasks.push(tokio::spawn(async move {
                let (mut done, mut refused) = (0, 0);
                for j in 0..4 {
                    let k = (client + j) % prompts.len();
                    let req = GenerateRequest {
                        input: Some(generate_request::Input::Prompt(prompts[k].into())),
                        max_new_tokens: 6,
                        ignore_eos: true,
                        ..Default::default()
                    };
                    let mut s = match c.generate(req).await {
                        Ok(s) => s.into_inner(),
                        Err(e) if e.code() == tonic::Code::ResourceExhausted => {
                            refused += 1;
                            continue;
                        }
                        Err(e) => panic!("client {client} job {j}: {e}"),
                    };
                    loop {
                        match s.message().await.unwrap().and_then(|e| e.event) {
                            Some(generate_event::Event::Done(d)) => {
                                assert_eq!(
                                    d.output_ids, solo[k],
                                    "client {client} job {j}: {}",
                                    d.error
                                );
                                done += 1;
                                break;
                            }
                            Some(_) => {}
                            None => panic!("client {client} job {j}: stream ended early"),
                        }
                    }
                }
                (done, refused)
            }));
        }
        let all = async {
            let mut sum = (0, 0);
            for t in tasks {
                let (d, r) = t.await.unwrap();
                sum = (sum.0 + d, sum.1 + r);
            }
            sum
        };
        tokio::time::timeout(Duration::from_secs(300), all).await.expect("a job hung")
    });
    eprintln!("{done} jobs completed, {refused} refused with RESOURCE_EXHAUSTED");
    assert_eq!(done + refused, 256);
    assert!(
        done > 0 && refused > 0,
        "{done} completed, {refused} refused: the queue was never full"
    );
    stack.shutdown();
}

/// A template that passes the import check but amplifies what a request sends (each message
/// written 100 times) costs that request a 400 at once: the rendering stops at the prompt bound
/// the context implies, and the coordinator's peak memory barely moves.
#[test]
fn an_amplifying_chat_template_costs_a_400_not_the_service() {
    let dir = tempfile::tempdir().unwrap();
    let hf = copy_hf_with_config(dir.path(), |_| {});
    let amplifier = "{% for m in messages %}{% for i in range(100) %}{{ m['content'] }}{% endfor %}{% endfor %}";
    std::fs::write(hf.join("chat_template.jinja"), amplifier).unwrap();
    let store = dir.path().join("store");
    layerstream(&["import", hf.to_str().unwrap(), store.to_str().unwrap()]);
    let stack = Stack::up(&store, &["--workers", "1"]);
    let coordinator = stack.children("coordinator")[0];
    let peak_kb = || {
        let status = std::fs::read_to_string(format!("/proc/{coordinator}/status")).unwrap();
        let line = status.lines().find(|l| l.starts_with("VmHWM:")).unwrap().to_owned();
        line.split_whitespace().nth(1).unwrap().parse::<u64>().unwrap()
    };
    tokio::runtime::Runtime::new().unwrap().block_on(async {
        let mut c = CoordinatorClient::connect(stack.addr().to_owned()).await.unwrap();
        let chat = |content: String| GenerateRequest {
            input: Some(generate_request::Input::Chat(ChatMessages {
                messages: vec![ChatMessage { role: "user".into(), content, ..Default::default() }],
            })),
            max_new_tokens: 2,
            ..Default::default()
        };
        // Warm-up: a small chat renders (100 copies of a word) and runs.
        c.generate(chat("Hi".into())).await.unwrap().into_inner().message().await.unwrap();
        let before = peak_kb();
        // 100 KB of text, under the 128 KB prompt bound of a 2,048-token context: 10 MB rendered.
        let started = std::time::Instant::now();
        let err = c.generate(chat("word ".repeat(20_000))).await.unwrap_err();
        assert_eq!(err.code(), tonic::Code::InvalidArgument, "{}", err.message());
        assert!(err.message().contains("exceeds 131072 bytes"), "{}", err.message());
        let grew = peak_kb().saturating_sub(before);
        eprintln!("refused in {:?}; coordinator peak memory +{grew} KB", started.elapsed());
        assert!(grew < 16 * 1024, "the coordinator's peak grew by {grew} KB");
        // The service still answers.
        c.generate(chat("Hi".into())).await.unwrap().into_inner().message().await.unwrap();
    });
    stack.shutdown();
}
