//! Faults survived, bad bytes refused, doors locked — on the real processes: a worker or the loader
//! killed mid-job under `up` is restarted and the job completes with the tokens of an uninterrupted
//! `run` (greedy and seeded sampling); a worker restarted by someone else (standalone processes) is
//! assigned again; a stopped worker is reported within the step deadline and the stack serves again
//! after SIGCONT; a flipped byte in a layer file fails the job naming the file and tensor; the API
//! key and the internal token are required when set; the loader's socket is private; a SIGKILLed
//! `up` takes its children with it and the next `up` removes what it left.

use layerstream_rpc::auth::Bearer;
use layerstream_rpc::v1::coordinator_client::CoordinatorClient;
use layerstream_rpc::v1::*;
use layerstream_tests::stack::*;
use layerstream_tests::*;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

/// `layerstream run --json` with these extra arguments: the uninterrupted reference.
fn run_ids(store: &Path, args: &[&str]) -> Vec<u64> {
    let mut a = vec!["run", "--model", store.to_str().unwrap(), "--json"];
    a.extend_from_slice(args);
    output_ids(&last_json(&layerstream(&a)))
}

fn request(seed: u64, temperature: f32, n: u32) -> GenerateRequest {
    GenerateRequest {
        input: Some(generate_request::Input::Prompt("Once upon a time".into())),
        max_new_tokens: n,
        ignore_eos: true,
        sampling: Some(Sampling { temperature, top_p: 0.9, seed, ..Default::default() }),
        ..Default::default()
    }
}

/// Streams `req`; calls `at_token` once after the `k`-th token; returns the final event.
async fn generate_with(
    addr: &str,
    req: GenerateRequest,
    k: usize,
    at_token: impl FnOnce(),
) -> FinalEvent {
    let mut c = CoordinatorClient::connect(addr.to_owned()).await.unwrap();
    let mut s = c.generate(req).await.unwrap().into_inner();
    let (mut seen, mut hook) = (0, Some(at_token));
    while let Some(ev) = s.message().await.unwrap() {
        match ev.event {
            Some(generate_event::Event::Token(_)) => {
                seen += 1;
                if seen == k {
                    (hook.take().unwrap())();
                }
            }
            Some(generate_event::Event::Done(d)) => return d,
            None => {}
        }
    }
    panic!("the stream ended without a final event");
}

/// A process of the stack is SIGKILLed after a few tokens; `up` restarts it, the coordinator
/// re-assigns and replays, and both the greedy and the seeded sampled request end exactly as an
/// uninterrupted `run` does. `flags`: the stack's plan.
fn killed_mid_job_completes(victim: &str, flags: &[&str]) {
    let dir = tempfile::tempdir().unwrap();
    let store = tiny_store(dir.path());
    const N: u32 = 48;
    let greedy_ref = run_ids(
        &store,
        &["--prompt", "Once upon a time", "--max-new-tokens", "48", "--ignore-eos"],
    );
    let sampled_args = ["--temperature", "0.8", "--top-p", "0.9", "--seed", "7"];
    let sampled_ref = run_ids(
        &store,
        &[
            &["--prompt", "Once upon a time", "--max-new-tokens", "48", "--ignore-eos"][..],
            &sampled_args,
        ]
        .concat(),
    );
    let stack = Stack::up(&store, flags);
    let pids = stack.children(victim);
    assert!(!pids.is_empty(), "no {victim} process found");
    let addr = stack.addr().to_owned();
    let victim_pid = *pids.last().unwrap();
    let (greedy, sampled) = tokio::runtime::Runtime::new().unwrap().block_on(async move {
        let other = tokio::spawn({
            let addr = addr.clone();
            async move { generate_with(&addr, request(7, 0.8, N), usize::MAX, || {}).await }
        });
        let greedy =
            generate_with(&addr, request(0, 0.0, N), 5, move || Stack::kill9(victim_pid)).await;
        (greedy, other.await.unwrap())
    });
    for (name, d, want) in [("greedy", &greedy, &greedy_ref), ("sampled", &sampled, &sampled_ref)] {
        assert!(d.error.is_empty(), "{name}: {}", d.error);
        let got: Vec<u64> = d.output_ids.iter().map(|&x| x as u64).collect();
        assert_eq!(&got, want, "{name}: tokens differ from the uninterrupted run");
    }
    let replays = greedy.stats.as_ref().unwrap().replays;
    if flags.contains(&"ngram") {
        let st = greedy.stats.as_ref().unwrap();
        assert!(st.spec_accepted > 0, "nothing was accepted: {st:?}");
    }
    assert!(replays >= 1, "the job was never replayed: was the {victim} really killed mid-job?");
    assert!(stack.children(victim).len() == pids.len(), "the {victim} was not restarted");
    stack.shutdown();
}

#[test]
fn a_worker_killed_mid_job_is_restarted_and_the_job_completes_unchanged() {
    killed_mid_job_completes("worker", &["--workers", "2", "--resident-layers", "0"]);
}

/// The same with every layer resident and the two requests in two micro-batches in flight: the
/// step that fails and the one beside it are both replayed.
#[test]
fn a_worker_killed_with_two_micro_batches_in_flight_leaves_both_jobs_unchanged() {
    killed_mid_job_completes("worker", &["--workers", "2", "--micro-batches", "2"]);
}

/// The same while speculating (prompt lookup): steps verifying drafts fail, the sequences are
/// replayed from their accepted tokens, and both requests end as the uninterrupted `run` does.
#[test]
fn a_worker_killed_while_drafts_are_verified_leaves_the_jobs_unchanged() {
    killed_mid_job_completes(
        "worker",
        &["--workers", "2", "--resident-layers", "0", "--spec", "ngram", "--spec-max", "4"],
    );
}

#[test]
fn the_loader_killed_mid_job_is_restarted_and_the_job_completes_unchanged() {
    killed_mid_job_completes("loader-daemon", &["--workers", "2", "--resident-layers", "0"]);
}

/// A standalone loader daemon serving `store` on `sock` in shm namespace `ns`.
fn loader(store: &str, sock: &str, ns: &str) -> Proc {
    Proc::start(&["loader-daemon", "--model", store, "--socket", sock, "--namespace", ns], &[])
}

/// A standalone coordinator over `workers` (comma-separated) with `extra` flags.
fn coordinator(store: &str, workers: &str, extra: &[&str]) -> Proc {
    let mut a =
        vec!["coordinator", "--model", store, "--listen", "127.0.0.1:0", "--worker", workers];
    a.extend_from_slice(&["--http-listen", "127.0.0.1:0"]);
    a.extend_from_slice(extra);
    Proc::start(&a, &[])
}

/// The `output_ids` of a `submit --json` object.
fn output_ids(v: &serde_json::Value) -> Vec<u64> {
    v["output_ids"].as_array().unwrap().iter().map(|x| x.as_u64().unwrap()).collect()
}

/// A free TCP port on loopback.
fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

/// Standalone processes (no `up`): the worker is killed and started again by hand, as an
/// orchestrator would; the idle coordinator notices it lost its assignment, assigns it again, and
/// the next job gets `run`'s tokens. Killed mid-job and started again, the job completes with the
/// tokens of an uninterrupted run.
#[test]
fn a_restarted_standalone_worker_is_assigned_again() {
    let dir = tempfile::tempdir().unwrap();
    let store = tiny_store(dir.path());
    let s = store.to_str().unwrap();
    let sock = dir.path().join("loader.sock");
    let sock_s = sock.to_str().unwrap();
    let want = run_ids(&store, &["--prompt", "Hi", "--max-new-tokens", "24", "--ignore-eos"]);
    let mut loader = loader(s, sock_s, "restart-test");
    let waddr = format!("127.0.0.1:{}", free_port());
    let worker_args = ["worker", "--model", s, "--listen", &waddr, "--loader-socket", sock_s];
    let mut worker = Proc::start(&worker_args, &[]);
    let mut coord = coordinator(s, &worker.addr, &[]);
    let args = ["--prompt", "Hi", "--max-new-tokens", "24", "--ignore-eos"];
    assert_eq!(output_ids(&submit(&coord.addr, &args)), want);
    Stack::kill9(worker.child.id() as i32);
    let _ = worker.child.wait();
    worker = Proc::start(&worker_args, &[]);
    let addr = coord.addr.clone();
    tokio::runtime::Runtime::new().unwrap().block_on(async move {
        let mut c = CoordinatorClient::connect(addr).await.unwrap();
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let w = c.list_workers(ListWorkersRequest {}).await.unwrap().into_inner().workers;
            if w[0].healthy {
                break;
            }
            assert!(Instant::now() < deadline, "the restarted worker was never assigned again");
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    });
    assert_eq!(output_ids(&submit(&coord.addr, &args)), want);
    // Killed mid-job and started again by hand: the job waits, is replayed, and ends unchanged.
    let want = run_ids(
        &store,
        &["--prompt", "Once upon a time", "--max-new-tokens", "40", "--ignore-eos"],
    );
    let victim = worker.child.id() as i32;
    let restarted = std::sync::Arc::new(std::sync::Mutex::new(None));
    let slot = restarted.clone();
    let worker_args: Vec<String> = worker_args.iter().map(|a| a.to_string()).collect();
    let addr = coord.addr.clone();
    let done = tokio::runtime::Runtime::new().unwrap().block_on(async move {
        generate_with(&addr, request(0, 0.0, 40), 5, move || {
            Stack::kill9(victim);
            std::thread::sleep(Duration::from_millis(300));
            let a: Vec<&str> = worker_args.iter().map(String::as_str).collect();
            *slot.lock().unwrap() = Some(Proc::start(&a, &[]));
        })
        .await
    });
    let _ = worker.child.wait();
    worker = restarted.lock().unwrap().take().expect("the worker was restarted mid-job");
    assert!(done.error.is_empty(), "{}", done.error);
    let got: Vec<u64> = done.output_ids.iter().map(|&x| x as u64).collect();
    assert_eq!(got, want, "tokens differ from the uninterrupted run");
    assert!(done.stats.unwrap().replays >= 1);
    for p in [&mut coord, &mut worker, &mut loader] {
        p.stop();
    }
    assert!(shm_left("layerstream-restart-test-").is_empty());
}

/// SIGSTOP of a worker mid-job: the job fails within the step deadline (+ one probe) with an
/// error naming the worker; after SIGCONT the stack serves again with `run`'s tokens.
#[test]
fn a_stopped_worker_is_reported_within_the_deadline_and_serves_again_after_sigcont() {
    let dir = tempfile::tempdir().unwrap();
    let store = tiny_store(dir.path());
    let stack =
        Stack::up(&store, &["--workers", "2", "--resident-layers", "1", "--step-timeout", "3"]);
    let victim = *stack.children("worker").last().unwrap();
    let addr = stack.addr().to_owned();
    let t = std::sync::Arc::new(std::sync::Mutex::new(None::<Instant>));
    let t2 = t.clone();
    let done = tokio::runtime::Runtime::new().unwrap().block_on(async move {
        generate_with(&addr, request(0, 0.0, 400), 3, move || {
            Stack::signal(victim, 19); // SIGSTOP
            *t2.lock().unwrap() = Some(Instant::now());
        })
        .await
    });
    let took = t.lock().unwrap().unwrap().elapsed();
    Stack::signal(victim, 18); // SIGCONT
    assert_eq!(done.finish_reason(), FinishReason::Error);
    assert!(done.error.contains("worker http://") && done.error.contains("3s"), "{}", done.error);
    assert!(took < Duration::from_secs(12), "reported after {took:?} with a 3 s deadline");
    let want = run_ids(&store, &["--prompt", "Hi", "--max-new-tokens", "8", "--ignore-eos"]);
    let v = submit(stack.addr(), &["--prompt", "Hi", "--max-new-tokens", "8", "--ignore-eos"]);
    let got = output_ids(&v);
    assert_eq!(got, want, "the stack does not serve again after SIGCONT");
    stack.shutdown();
}

/// One flipped byte inside a streamed layer's tensor: the loader refuses the read, the job fails
/// naming the file and the tensor (no garbage text), `run` refuses to load it, and `verify` names it.
#[test]
fn a_flipped_byte_in_a_layer_fails_the_job_naming_the_file() {
    let dir = tempfile::tempdir().unwrap();
    let store = tiny_store(dir.path());
    let path = store.join("layer_001.bin");
    let mut bytes = std::fs::read(&path).unwrap();
    bytes[4096 + 17] ^= 0x40;
    std::fs::write(&path, bytes).unwrap();
    let s = store.to_str().unwrap();
    let err = layerstream_fails(&["run", "--model", s, "--prompt", "Hi", "--max-new-tokens", "2"]);
    assert!(err.contains("layer_001.bin") && err.contains("checksum mismatch in tensor"), "{err}");
    let err = layerstream_fails(&["verify", s]);
    assert!(err.contains("layer_001.bin"), "{err}");
    let stack = Stack::up(&store, &["--workers", "2", "--resident-layers", "0"]);
    let e = layerstream_fails(&[
        "submit",
        "--addr",
        stack.addr(),
        "--prompt",
        "Hi",
        "--max-new-tokens",
        "4",
    ]);
    assert!(e.contains("layer_001.bin") && e.contains("checksum mismatch in tensor"), "{e}");
    // Not replayed over and over: the same bytes would be read again.
    assert!(!e.contains("recoveries"), "{e}");
    stack.shutdown();
}

/// With `--api-key`, the job API refuses calls without it (UNAUTHENTICATED) and serves with it;
/// health stays open; the workers refuse calls without the internal token.
#[test]
fn the_api_key_and_the_internal_token_are_required() {
    let dir = tempfile::tempdir().unwrap();
    let store = tiny_store(dir.path());
    let stack = Stack::up(&store, &["--workers", "1", "--api-key", "k3y"]);
    let err = layerstream_fails(&["submit", "--addr", stack.addr(), "--prompt", "Hi"]);
    assert!(err.contains("missing API key"), "{err}");
    let err = layerstream_fails(&[
        "submit",
        "--addr",
        stack.addr(),
        "--api-key",
        "nope",
        "--prompt",
        "Hi",
    ]);
    assert!(err.contains("wrong API key"), "{err}");
    let v = submit(stack.addr(), &["--api-key", "k3y", "--prompt", "Hi", "--max-new-tokens", "3"]);
    assert_eq!(v["output_ids"].as_array().unwrap().len(), 3);
    assert_eq!(layerstream(&["health", "--addr", stack.addr()]).trim(), "SERVING");
    let addr = stack.addr().to_owned();
    tokio::runtime::Runtime::new().unwrap().block_on(async move {
        let ch = tonic::transport::Endpoint::from_shared(addr).unwrap().connect().await.unwrap();
        let mut c = CoordinatorClient::new(Bearer::new(Some("k3y")).unwrap().wrap(ch));
        let w = c.list_workers(ListWorkersRequest {}).await.unwrap().into_inner().workers;
        let ch = tonic::transport::Endpoint::from_shared(w[0].address.clone())
            .unwrap()
            .connect()
            .await
            .unwrap();
        let mut raw = layerstream_rpc::v1::worker_client::WorkerClient::new(ch);
        let e = raw.info(InfoRequest {}).await.unwrap_err();
        assert_eq!(e.code(), tonic::Code::Unauthenticated, "{}", e.message());
        assert!(worker_client(w[0].address.clone()).await.info(InfoRequest {}).await.is_ok());
    });
    // The loader's socket: private directory, socket only for its owner.
    use std::os::unix::fs::PermissionsExt;
    let sock = stack.loader_socket();
    let mode = |p: &Path| std::fs::metadata(p).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode(&sock), 0o600, "{}", sock.display());
    assert_eq!(mode(sock.parent().unwrap()), 0o700);
    stack.shutdown();
}

/// SIGKILL of `up`: its children get SIGTERM from the kernel (PR_SET_PDEATHSIG) and stop; what a
/// killed stack leaves in /dev/shm is removed by the next `up`.
#[test]
fn children_die_with_a_killed_up_and_the_next_up_cleans_up() {
    let dir = tempfile::tempdir().unwrap();
    let store = tiny_store(dir.path());
    let stack = Stack::up(&store, &["--workers", "2"]);
    let kids: Vec<i32> =
        ["loader-daemon", "worker", "coordinator"].iter().flat_map(|w| stack.children(w)).collect();
    assert_eq!(kids.len(), 4);
    let prefix = stack.shm_prefix();
    Stack::kill9(stack.proc.child.id() as i32);
    let deadline = Instant::now() + Duration::from_secs(20);
    while kids.iter().any(|p| alive(*p)) {
        assert!(Instant::now() < deadline, "children outlived a killed up");
        std::thread::sleep(Duration::from_millis(50));
    }
    // What a loader that could not clean up would leave: a region of the dead stack's namespace.
    let orphan = format!("{prefix}deadbeef-slot-000");
    let region = layerstream_shm::ShmRegion::create(&orphan, 4096).unwrap();
    std::mem::forget(region);
    assert_eq!(shm_left(&prefix).len(), 1);
    let next = Stack::up(&store, &["--workers", "1"]);
    assert!(shm_left(&prefix).is_empty(), "the next up left the dead stack's regions");
    next.shutdown();
}

fn alive(pid: i32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .is_ok_and(|s| !s.rsplit(')').next().unwrap_or("").trim_start().starts_with('Z'))
}

/// A self-signed certificate for 127.0.0.1/localhost (openssl), or None when openssl is missing.
fn self_signed(dir: &Path) -> Option<(PathBuf, PathBuf)> {
    let (cert, key) = (dir.join("cert.pem"), dir.join("key.pem"));
    let ok = std::process::Command::new("openssl")
        .args([
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-days",
            "2",
            "-subj",
            "/CN=localhost",
        ])
        .args(["-addext", "subjectAltName=IP:127.0.0.1,DNS:localhost"])
        .args(["-addext", "basicConstraints=critical,CA:FALSE"])
        .arg("-keyout")
        .arg(&key)
        .arg("-out")
        .arg(&cert)
        .stderr(std::process::Stdio::null())
        .status()
        .is_ok_and(|s| s.success());
    ok.then_some((cert, key))
}

/// TLS on gRPC: the job API of `up --tls-cert/--tls-key` answers `submit --tls-ca` over https and
/// refuses plaintext and clients that do not trust it; a worker started with its own certificate is reached as `https://` by a
/// coordinator given `--tls-ca`, and the job's tokens equal `run`'s.
#[test]
#[cfg_attr(not(have_openssl), ignore = "needs openssl on PATH (to make a test certificate)")]
fn tls_on_the_job_api_and_between_coordinator_and_worker() {
    let dir = tempfile::tempdir().unwrap();
    let (cert, key) = self_signed(dir.path()).expect("openssl makes a test certificate");
    let store = tiny_store(dir.path());
    let s = store.to_str().unwrap();
    let (c, k) = (cert.to_str().unwrap(), key.to_str().unwrap());
    let want = run_ids(&store, &["--prompt", "Hi", "--max-new-tokens", "6", "--ignore-eos"]);
    let args = ["--prompt", "Hi", "--max-new-tokens", "6", "--ignore-eos"];
    let stack = Stack::up(&store, &["--workers", "1", "--tls-cert", c, "--tls-key", k]);
    assert!(stack.addr().starts_with("https://"), "{}", stack.addr());
    assert_eq!(output_ids(&submit(stack.addr(), &[&["--tls-ca", c][..], &args].concat())), want);
    // Plaintext to the TLS port, and TLS without trusting the certificate, both fail.
    let plain = stack.addr().replace("https://", "http://");
    layerstream_fails(&[&["submit", "--addr", &plain][..], &args].concat());
    layerstream_fails(&[&["submit", "--addr", stack.addr()][..], &args].concat());
    stack.shutdown();

    // Coordinator → worker over TLS (standalone processes).
    let sock = dir.path().join("loader.sock");
    let sock_s = sock.to_str().unwrap();
    let mut loader = loader(s, sock_s, "tls-test");
    let mut worker = Proc::start(
        &["worker", "--model", s, "--loader-socket", sock_s, "--tls-cert", c, "--tls-key", k],
        &[],
    );
    assert!(worker.addr.starts_with("https://"), "{}", worker.addr);
    let mut coord = coordinator(s, &worker.addr, &["--tls-ca", c]);
    assert_eq!(output_ids(&submit(&coord.addr, &args)), want);
    for p in [&mut coord, &mut worker, &mut loader] {
        p.stop();
    }
}

/// A worker that dies and does not come back is planned around when the others can hold the
/// model: the job in flight completes with `run`'s tokens on the remaining worker; once the worker
/// answers again, the idle coordinator plans over both again.
#[test]
fn a_worker_that_stays_dead_is_planned_around_and_back_in_when_it_returns() {
    let dir = tempfile::tempdir().unwrap();
    let store = tiny_store(dir.path());
    let s = store.to_str().unwrap();
    let sock = dir.path().join("loader.sock");
    let sock_s = sock.to_str().unwrap();
    let want = run_ids(
        &store,
        &["--prompt", "Once upon a time", "--max-new-tokens", "40", "--ignore-eos"],
    );
    let mut loader = loader(s, sock_s, "replan-test");
    let w1_addr = format!("127.0.0.1:{}", free_port());
    let w1_args = ["worker", "--model", s, "--listen", &w1_addr, "--loader-socket", sock_s];
    let mut w0 = Proc::start(&["worker", "--model", s, "--loader-socket", sock_s], &[]);
    let mut w1 = Proc::start(&w1_args, &[]);
    let workers = format!("{},{}", w0.addr, w1.addr);
    let mut coord = coordinator(s, &workers, &["--step-timeout", "4"]);
    let victim = w1.child.id() as i32;
    let addr = coord.addr.clone();
    let rt = tokio::runtime::Runtime::new().unwrap();
    let plan_len = |addr: String| async move {
        let mut c = CoordinatorClient::connect(addr).await.unwrap();
        c.get_plan(GetPlanRequest {}).await.unwrap().into_inner().assignments.len()
    };
    let done =
        rt.block_on(generate_with(&addr, request(0, 0.0, 40), 5, move || Stack::kill9(victim)));
    let _ = w1.child.wait();
    assert!(done.error.is_empty(), "{}", done.error);
    let got: Vec<u64> = done.output_ids.iter().map(|&x| x as u64).collect();
    assert_eq!(got, want, "tokens differ from the uninterrupted run");
    assert_eq!(rt.block_on(plan_len(addr.clone())), 1, "not planned around the dead worker");
    w1 = Proc::start(&w1_args, &[]);
    let deadline = Instant::now() + Duration::from_secs(30);
    while rt.block_on(plan_len(addr.clone())) != 2 {
        assert!(Instant::now() < deadline, "the returning worker was never planned in again");
        std::thread::sleep(Duration::from_millis(200));
    }
    let v =
        submit(&addr, &["--prompt", "Once upon a time", "--max-new-tokens", "40", "--ignore-eos"]);
    let got = output_ids(&v);
    assert_eq!(got, want);
    for p in [&mut coord, &mut w0, &mut w1, &mut loader] {
        p.stop();
    }
    assert!(shm_left("layerstream-replan-test-").is_empty());
}

/// Past the restart budget (`--max-restarts 0`) `up` does not stop a stack that can serve: it
/// names how the worker died (SIGKILL), says the rest keeps serving, restarts it after a pause,
/// and the stack answers again — the same loader and coordinator throughout.
#[test]
fn up_keeps_serving_and_retries_a_child_past_the_restart_budget() {
    use std::io::{BufRead, Read};
    let dir = tempfile::tempdir().unwrap();
    let store = tiny_store(dir.path());
    let mut up = cmd()
        .args(["up", "--model", store.to_str().unwrap(), "--listen", "127.0.0.1:0"])
        .args(["--workers", "2", "--max-restarts", "0", "--http-listen", "127.0.0.1:0"])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut first = String::new();
    std::io::BufReader::new(up.stdout.take().unwrap()).read_line(&mut first).unwrap();
    assert!(first.starts_with("LISTENING "), "{first}");
    let addr = first.split_whitespace().nth(1).unwrap().to_owned();
    let mut stderr = up.stderr.take().unwrap();
    let log = std::thread::spawn(move || {
        let mut s = String::new();
        let _ = stderr.read_to_string(&mut s);
        s
    });
    let stack = Stack { proc: Proc { child: up, addr, http: None } };
    let others: Vec<i32> =
        ["loader-daemon", "coordinator"].iter().flat_map(|w| stack.children(w)).collect();
    let victim = *stack.children("worker").last().unwrap();
    Stack::kill9(victim);
    let deadline = Instant::now() + Duration::from_secs(30);
    while stack.children("worker").len() < 2 || stack.children("worker").contains(&victim) {
        assert!(Instant::now() < deadline, "the worker was not restarted after its pause");
        std::thread::sleep(Duration::from_millis(100));
    }
    let v = submit(stack.addr(), &["--prompt", "Once upon a time", "--max-new-tokens", "4"]);
    assert_eq!(v["output_ids"].as_array().map(Vec::len), Some(4), "{v}");
    let now: Vec<i32> =
        ["loader-daemon", "coordinator"].iter().flat_map(|w| stack.children(w)).collect();
    assert_eq!(now, others, "the rest of the stack was restarted");
    let up_pid = stack.proc.child.id();
    stack.shutdown();
    let err = log.join().unwrap();
    assert!(err.contains("was killed by SIGKILL (signal 9)"), "{err}");
    assert!(err.contains("keeps serving") && err.contains("next try in 1 s"), "{err}");
    assert!(shm_left(&format!("layerstream-up{up_pid}-")).is_empty());
}

/// The HTTP API when no worker can run a request: `/health` answers 503 naming the worker that is
/// down, and a chat gets OpenAI's 503 error naming it (`--max-recoveries 0`: no replay).
#[test]
fn http_answers_503_when_no_worker_can_run_the_request() {
    let dir = tempfile::tempdir().unwrap();
    let store = tiny_store(dir.path());
    let s = store.to_str().unwrap();
    let sock = dir.path().join("loader.sock");
    let sock_s = sock.to_str().unwrap();
    let mut loader = loader(s, sock_s, "http-503-test");
    let worker_args =
        ["worker", "--model", s, "--listen", "127.0.0.1:0", "--loader-socket", sock_s];
    let mut worker = Proc::start(&worker_args, &[]);
    let mut coord = coordinator(s, &worker.addr, &["--max-recoveries", "0"]);
    let http = coord.http.clone().expect("the coordinator serves HTTP");
    let call = |args: &[&str]| {
        let o = std::process::Command::new("curl")
            .args(["-sS", "-w", "\n%{http_code}"])
            .args(args)
            .output()
            .expect("curl");
        let out = String::from_utf8_lossy(&o.stdout).into_owned();
        let (body, code) = out.rsplit_once('\n').unwrap();
        (
            code.trim().parse::<u16>().unwrap(),
            serde_json::from_str::<serde_json::Value>(body).unwrap(),
        )
    };
    let chat = format!("{http}/v1/chat/completions");
    let body = r#"{"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3}"#;
    let ask =
        [&["-H", "Content-Type: application/json", "-d", body][..], &[chat.as_str()]].concat();
    assert_eq!(call(&ask).0, 200);
    assert_eq!(call(&[&format!("{http}/health")]).0, 200);
    Stack::kill9(worker.child.id() as i32);
    let _ = worker.child.wait();
    let (code, v) = call(&[&format!("{http}/health")]);
    assert_eq!(code, 503, "{v}");
    assert_eq!(v["workers_down"][0], worker.addr.as_str(), "{v}");
    let (code, v) = call(&ask);
    assert_eq!(code, 503, "{v}");
    assert_eq!(v["error"]["type"], "service_unavailable", "{v}");
    let msg = v["error"]["message"].as_str().unwrap();
    assert!(msg.contains(worker.addr.trim_start_matches("http://")), "{msg}");
    for p in [&mut coord, &mut loader] {
        p.stop();
    }
    assert!(shm_left("layerstream-http-503-test-").is_empty());
}

/// The coordinator SIGKILLed mid-job under `up` (which restarts it, with the stack's journal): the
/// job submitted with an idempotency key is resumed under its id from its journaled tokens, a
/// client that reconnects with WatchJob (`seen` = the tokens it has of each request) gets exactly
/// the rest — never a second answer stitched on — and each final event's output equals what the
/// client assembled and, for greedy and seeded sampling, an uninterrupted `run`'s tokens; with
/// speculation (`--spec ngram`: events of several tokens, cut differently in a re-run) too.
/// Resubmitting with the key gives the same job.
#[test]
fn a_killed_coordinators_job_is_resumed_from_the_journal_unchanged() {
    let dir = tempfile::tempdir().unwrap();
    let store = tiny_store(dir.path());
    let base = ["--prompt", "Once upon a time", "--max-new-tokens", "200", "--ignore-eos"];
    let greedy_ref = run_ids(&store, &base);
    let sampled_ref = run_ids(
        &store,
        &[&base[..], &["--temperature", "0.8", "--top-p", "0.9", "--seed", "7"]].concat(),
    );
    for spec in [&["--workers", "1"][..], &["--workers", "1", "--spec", "ngram"]] {
        resumed_job_is_the_answer(&store, spec, &greedy_ref, &sampled_ref);
    }
}

fn resumed_job_is_the_answer(
    store: &Path,
    flags: &[&str],
    greedy_ref: &[u64],
    sampled_ref: &[u64],
) {
    const N: u32 = 200;
    let stack = Stack::up(store, flags);
    let before = stack.children("coordinator");
    let addr = stack.addr().to_owned();
    let job = || {
        let mut r = tonic::Request::new(SubmitJobRequest {
            requests: vec![request(0, 0.0, N), request(7, 0.8, N)],
        });
        r.metadata_mut().insert("idempotency-key", "job-key-1".parse().unwrap());
        r
    };
    let rt = tokio::runtime::Runtime::new().unwrap();
    let (events, job_id, again) = rt.block_on(async {
        let mut c = CoordinatorClient::connect(addr.clone()).await.unwrap();
        let job_id = c.submit_job(job()).await.unwrap().into_inner().job_id;
        // What a reconnecting client says it saw: per request, its tokens so far.
        let from = |events: &[GenerateEvent]| {
            let mut seen = vec![0u32; 2];
            for e in events {
                if let Some(generate_event::Event::Token(t)) = &e.event {
                    seen[e.index as usize] += t.ids.len() as u32;
                }
            }
            JobRef { job_id: job_id.clone(), seen }
        };
        let mut s = c.watch_job(from(&[])).await.unwrap().into_inner();
        let mut events = Vec::new();
        while events.len() < 6 {
            events.push(s.message().await.unwrap().unwrap().event.unwrap());
        }
        Stack::kill9(before[0]);
        // The first stream ends with the process; the rest comes from the restarted coordinator.
        while let Ok(Some(ev)) = s.message().await {
            events.push(ev.event.unwrap());
        }
        let cut = events.len();
        let deadline = Instant::now() + Duration::from_secs(60);
        let mut s = loop {
            assert!(Instant::now() < deadline, "the coordinator did not come back with the job");
            let attempt = async {
                let mut c = CoordinatorClient::connect(addr.clone()).await.ok()?;
                c.watch_job(from(&events)).await.ok()
            };
            match attempt.await {
                Some(s) => break s.into_inner(),
                None => tokio::time::sleep(Duration::from_millis(200)).await,
            }
        };
        while let Some(ev) = s.message().await.unwrap() {
            events.push(ev.event.unwrap());
        }
        assert!(events.len() > cut, "nothing came after the restart");
        let mut c = CoordinatorClient::connect(addr.clone()).await.unwrap();
        let again = c.submit_job(job()).await.unwrap().into_inner().job_id;
        (events, job_id, again)
    });
    assert_ne!(stack.children("coordinator"), before, "the coordinator was not restarted");
    assert_eq!(again, job_id, "the idempotency key gives the same job after the restart");
    for (index, want) in [(0u32, greedy_ref), (1, sampled_ref)] {
        let mine = events.iter().filter(|e| e.index == index);
        let streamed: Vec<u64> = mine
            .clone()
            .filter_map(|e| match &e.event {
                Some(generate_event::Event::Token(t)) => Some(t.ids.iter().map(|&x| x as u64)),
                _ => None,
            })
            .flatten()
            .collect();
        let done = mine
            .filter_map(|e| match &e.event {
                Some(generate_event::Event::Done(d)) => Some(d.clone()),
                _ => None,
            })
            .next_back()
            .expect("a final event");
        let got: Vec<u64> = done.output_ids.iter().map(|&x| x as u64).collect();
        assert!(done.error.is_empty(), "{flags:?}: {}", done.error);
        assert_eq!(streamed, got, "{flags:?} request {index}: the stream is not the final answer");
        assert_eq!(
            got, want,
            "{flags:?} request {index}: tokens differ from the uninterrupted run"
        );
    }
    stack.shutdown();
}

/// One SSE response read to its end: the content of its chunks in order, and the `id:` of the
/// last chunk that had one.
fn sse_read(out: impl std::io::Read, content: &mut String, last_id: &mut Option<String>) -> bool {
    use std::io::BufRead;
    let mut done = false;
    let mut id = None;
    for line in std::io::BufReader::new(out).lines().map_while(Result::ok) {
        if let Some(v) = line.strip_prefix("id:") {
            id = Some(v.trim().to_owned());
        } else if let Some(d) = line.strip_prefix("data:") {
            let d = d.trim();
            if d == "[DONE]" {
                done = true;
            } else if let Ok(v) = serde_json::from_str::<serde_json::Value>(d) {
                if let Some(t) = v["choices"][0]["delta"]["content"].as_str() {
                    content.push_str(t);
                }
            }
        } else if line.is_empty() && id.is_some() {
            *last_id = id.take();
        }
    }
    done
}

/// The same through SSE: a streaming chat with an `Idempotency-Key` whose coordinator is
/// SIGKILLed mid-stream is continued by sending the request again with `Last-Event-ID` (the last
/// `id:` seen): the text assembled from both streams is exactly the job's final answer (asked for
/// again with the key) — and, with exact arithmetic on the tiny model, the uninterrupted answer;
/// on SmolLM2's default 8-bit path too. Without a held job a `Last-Event-ID` is refused (400),
/// never answered with another generation's tail.
#[test]
fn an_sse_stream_continues_after_a_killed_coordinator_with_last_event_id() {
    let dir = tempfile::tempdir().unwrap();
    let store = tiny_store(dir.path());
    sse_resume(&store, &["--workers", "1", "--served-model-name", "m"], true);
    let smol = default_store().expect("fetching the default model (needs PyPI)");
    let flags = ["--workers", "1", "--served-model-name", "m", "--int8-activations"];
    sse_resume(&smol, &flags, false);
}

fn sse_resume(store: &Path, flags: &[&str], exact: bool) {
    let stack = Stack::up(store, flags);
    let body = |stream: bool| {
        serde_json::json!({"model": "m", "max_tokens": 160, "temperature": 0, "stream": stream,
            "ignore_eos": true, "messages": [{"role": "user", "content": "Once upon a time"}]})
        .to_string()
    };
    let curl = |headers: &[String], stream: bool| {
        let mut c = Command::new("curl");
        c.args(["-sN", "-H", "content-type: application/json", "-d", &body(stream)]);
        for h in headers {
            c.args(["-H", h]);
        }
        c.arg(format!("{}/v1/chat/completions", stack.http()));
        c.stdout(std::process::Stdio::piped()).spawn().unwrap()
    };
    let whole_of = |headers: &[String]| {
        let out = curl(headers, false).wait_with_output().unwrap();
        let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        v["choices"][0]["message"]["content"].as_str().unwrap().to_owned()
    };
    let want = whole_of(&[]);
    let key = "idempotency-key: sse-resume-1".to_owned();
    let orphan =
        curl(&[key.replace("sse-resume-1", "never-held"), "last-event-id: 3".into()], true);
    let refused = String::from_utf8(orphan.wait_with_output().unwrap().stdout).unwrap();
    assert!(refused.contains("Last-Event-ID"), "{refused}");
    let mut first = curl(std::slice::from_ref(&key), true);
    let mut out = first.stdout.take().unwrap();
    // Read a few chunks, then kill the coordinator; what curl got before the stream ends counts.
    let mut head = [0u8; 2048];
    let mut got = Vec::new();
    while got.len() < 1500 {
        let n = std::io::Read::read(&mut out, &mut head).unwrap();
        assert!(n > 0, "the stream ended early");
        got.extend_from_slice(&head[..n]);
    }
    Stack::kill9(stack.children("coordinator")[0]);
    let (mut content, mut last_id) = (String::new(), None);
    let done = sse_read(std::io::Read::chain(&got[..], out), &mut content, &mut last_id);
    assert!(!done, "the stream finished before the kill");
    let _ = first.wait();
    let id = last_id.expect("chunks with ids before the kill");
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        assert!(Instant::now() < deadline, "the stream could not be continued");
        let mut again = curl(&[key.clone(), format!("last-event-id: {id}")], true);
        let mut rest = String::new();
        let mut ignored = None;
        if sse_read(again.stdout.take().unwrap(), &mut rest, &mut ignored) {
            content.push_str(&rest);
            break;
        }
        let _ = again.wait();
        std::thread::sleep(Duration::from_millis(300));
    }
    assert_eq!(content, whole_of(std::slice::from_ref(&key)), "{flags:?}: resumed at id {id}");
    if exact {
        assert_eq!(content, want, "resumed at id {id}");
    }
    stack.shutdown();
}
