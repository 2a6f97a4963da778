//! Micro-batches in flight on the real stack: concurrent jobs of different lengths through 2 and 3
//! workers with several micro-batches each get exactly their solo `layerstream run` tokens (resident,
//! chunked prefill, and a plan with streamed layers, which runs one micro-batch); the steps really
//! overlap (the coordinator's counter, and the workers' spans in the trace); a job cancelled in the
//! middle leaves the others unchanged and frees its caches.

use layerstream_rpc::v1::coordinator_client::CoordinatorClient;
use layerstream_rpc::v1::*;
use layerstream_tests::stack::*;
use layerstream_tests::*;

fn plan(addr: &str) -> Plan {
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        let mut c = CoordinatorClient::connect(addr.to_owned()).await.unwrap();
        c.get_plan(GetPlanRequest {}).await.unwrap().into_inner()
    })
}

/// A counter of the stack's Prometheus `/metrics` (0 when absent).
fn metric(stack: &Stack, name: &str) -> f64 {
    let out = std::process::Command::new("curl")
        .args(["-sf", &format!("{}/metrics", stack.http())])
        .output()
        .expect("curl runs");
    let text = String::from_utf8_lossy(&out.stdout);
    text.lines()
        .find_map(|l| l.strip_prefix(name).and_then(|r| r.trim().parse().ok()))
        .unwrap_or(0.0)
}

#[test]
fn concurrent_jobs_through_micro_batches_equal_their_solo_runs() {
    let dir = tempfile::tempdir().unwrap();
    let store = tiny_store(dir.path());
    let want = solo_runs(&store);
    // (flags, micro-batches the plan must choose, whether steps must overlap)
    let configs: [(&[&str], u32, bool); 5] = [
        (&["--workers", "2"], 2, true),
        (&["--workers", "3", "--micro-batches", "3", "--max-step-tokens", "4"], 3, true),
        (&["--workers", "2", "--micro-batches", "4", "--max-batch", "6"], 4, true),
        // A worker streams: one micro-batch whatever was asked, so no layer is read twice a step.
        (&["--workers", "2", "--resident-layers", "1", "--micro-batches", "2"], 1, false),
        (&["--workers", "3", "--micro-batches", "1"], 1, false),
    ];
    for (flags, micro, overlap) in configs {
        let stack = Stack::up(&store, flags);
        let p = plan(stack.addr());
        assert_eq!(p.micro_batches, micro, "{flags:?}: {}", p.micro_batches_reason);
        if flags.contains(&"--resident-layers") {
            assert!(
                p.micro_batches_reason.contains("streams layers"),
                "{}",
                p.micro_batches_reason
            );
        }
        let results = concurrent_jobs(stack.addr());
        for (i, v) in results.iter().enumerate() {
            let got: Vec<u32> = serde_json::from_value(v["output_ids"].clone()).unwrap();
            assert_eq!(got, want[i], "job {i} differs from its solo run ({flags:?})");
        }
        let overlapped = metric(&stack, "layerstream_overlapped_steps_total");
        assert_eq!(overlapped > 0.0, overlap, "{flags:?}: {overlapped} overlapped steps");
        assert_eq!(metric(&stack, "layerstream_micro_batches"), micro as f64);
        stack.shutdown();
    }
}

/// The trace shows micro-batches overlapping: each worker call is a `stage` span naming its worker
/// and micro-batch, and calls on different workers for different micro-batches run at the same time.
#[test]
fn the_trace_shows_micro_batches_overlapping_across_workers() {
    let dir = tempfile::tempdir().unwrap();
    let spans_file = dir.path().join("spans.jsonl");
    let (mut sink, stack) = traced_stack(dir.path(), &spans_file, &["--workers", "2"]);
    let jobs = concurrent_jobs(stack.addr());
    stack.shutdown();
    let traces: Vec<&str> = jobs.iter().map(|v| v["trace_id"].as_str().unwrap()).collect();
    let spans = whole_traces(&spans_file, &traces);
    sink.stop();
    let stages: Vec<(String, i64, u64, u64)> = spans
        .iter()
        .filter(|s| s["name"] == "stage")
        .map(|s| {
            let a = &s["attributes"];
            (
                a["worker"].as_str().unwrap().to_owned(),
                a["micro_batch"].as_i64().unwrap(),
                s["start_ns"].as_u64().unwrap(),
                s["end_ns"].as_u64().unwrap(),
            )
        })
        .collect();
    assert!(!stages.is_empty(), "no stage spans");
    let overlapping = stages
        .iter()
        .any(|a| stages.iter().any(|b| a.0 != b.0 && a.1 != b.1 && a.2 < b.3 && b.2 < a.3));
    assert!(overlapping, "no two micro-batches ran on different workers at once: {stages:?}");
}

/// A long job whose client goes away in the middle is cancelled between its micro-batch's steps;
/// the jobs beside it finish with their solo tokens and every cache is freed.
#[tokio::test(flavor = "multi_thread")]
async fn a_job_cancelled_mid_way_leaves_the_other_micro_batches_unchanged() {
    let dir = tempfile::tempdir().unwrap();
    let store = tiny_store(dir.path());
    let want = tokio::task::block_in_place(|| solo_runs(&store));
    let stack = Stack::up(&store, &["--workers", "2", "--micro-batches", "2"]);
    let mut c = CoordinatorClient::connect(stack.addr().to_owned()).await.unwrap();
    let long = GenerateRequest {
        input: Some(generate_request::Input::Prompt("Hello".into())),
        max_new_tokens: 1900,
        ignore_eos: true,
        ..Default::default()
    };
    let mut stream = c.generate(long).await.unwrap().into_inner();
    let mut tokens = 0;
    while tokens < 3 {
        let ev = stream.message().await.unwrap().expect("still running");
        tokens += matches!(ev.event, Some(generate_event::Event::Token(_))) as usize;
    }
    let addr = stack.addr().to_owned();
    let others = tokio::task::spawn_blocking(move || concurrent_jobs(&addr));
    // Let the others join, then go away mid-job.
    tokio::time::sleep(std::time::Duration::from_millis(300)).await;
    drop(stream);
    for (i, v) in others.await.unwrap().iter().enumerate() {
        let got: Vec<u32> = serde_json::from_value(v["output_ids"].clone()).unwrap();
        assert_eq!(got, want[i], "job {i} differs from its solo run");
    }
    wait_until_zero_sequences(stack.addr()).await;
    tokio::task::block_in_place(|| {
        assert_eq!(metric(&stack, "layerstream_requests_total{finish_reason=\"cancelled\"}"), 1.0);
        stack.shutdown();
    });
}

/// Neighbouring workers on one host hand hidden states over in shared memory: every worker but the
/// last leaves its output in a region of its own (one per micro-batch) while the stack runs, the
/// tokens are the same as through gRPC bytes (`--hidden-over-grpc`, which makes none), and no region
/// outlives the stack.
#[test]
fn hidden_states_cross_in_shared_memory_between_workers_on_one_host() {
    let dir = tempfile::tempdir().unwrap();
    let store = tiny_store(dir.path());
    let want = solo_runs(&store);
    for over_grpc in [false, true] {
        let mut flags = vec!["--workers", "3"];
        if over_grpc {
            flags.push("--hidden-over-grpc");
        }
        let stack = Stack::up(&store, &flags);
        for (i, v) in concurrent_jobs(stack.addr()).iter().enumerate() {
            let got: Vec<u32> = serde_json::from_value(v["output_ids"].clone()).unwrap();
            assert_eq!(got, want[i], "job {i} differs from its solo run ({flags:?})");
        }
        let workers = stack.children("worker");
        assert_eq!(workers.len(), 3);
        let regions = |pid: i32| shm_left(&format!("layerstream-hidden-{pid}-"));
        let made: Vec<usize> = workers.iter().map(|&p| regions(p).len()).collect();
        if over_grpc {
            assert_eq!(made, [0, 0, 0], "--hidden-over-grpc made hand-off regions");
        } else {
            // Pipeline order is start order; the last worker samples and hands nothing on.
            assert!(made[0] >= 1 && made[1] >= 1 && made[2] == 0, "regions per worker: {made:?}");
            assert!(made[0] <= 3, "one region per micro-batch at most: {made:?}");
        }
        stack.shutdown();
        for p in workers {
            assert!(regions(p).is_empty(), "worker {p} left {:?}", regions(p));
        }
    }
}
