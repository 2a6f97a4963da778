//! Starting the real stack (`layerstream up`) and the OTLP sink as child processes in tests; they
//! are stopped with SIGTERM when the guard drops, and /dev/shm is checked clean afterwards.

use layerstream_rpc::auth::{Authed, Bearer};
use layerstream_rpc::handshake::Listening;
use layerstream_rpc::v1::loader_client::LoaderClient;
use layerstream_rpc::v1::worker_client::WorkerClient;
use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Child, Stdio};
use std::time::{Duration, Instant};

/// The internal token the test stacks run with.
pub const INTERNAL_TOKEN: &str = "test-internal-token";

/// A client of a worker (its address as `ListWorkers` gives it), with the internal token.
pub async fn worker_client(addr: String) -> WorkerClient<Authed> {
    let ch = tonic::transport::Endpoint::from_shared(addr).unwrap().connect().await.unwrap();
    WorkerClient::new(Bearer::new(Some(INTERNAL_TOKEN)).unwrap().wrap(ch))
}

/// A running child that printed `LISTENING <addr>` (a coordinator or `up` serving HTTP adds
/// ` http=<url>`).
pub struct Proc {
    pub child: Child,
    pub addr: String,
    /// The HTTP server's base URL (OpenAI API, /metrics, the page), when it serves one.
    pub http: Option<String>,
}

impl Proc {
    /// Starts `layerstream <args>` and waits for its address.
    pub fn start(args: &[&str], envs: &[(&str, &str)]) -> Proc {
        let mut cmd = crate::cmd();
        cmd.args(args).envs(envs.iter().copied());
        Self::spawn(cmd)
    }

    /// Starts `cmd` (which runs `layerstream`, perhaps through a wrapper such as `unshare`) and
    /// waits for its address.
    pub fn spawn(mut cmd: std::process::Command) -> Proc {
        let args = format!("{cmd:?}");
        let mut child = cmd
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .unwrap();
        let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
        let first = lines.next();
        let Some(l) = first.as_ref().and_then(|l| l.as_deref().ok()).and_then(Listening::parse)
        else {
            let _ = child.kill();
            panic!("{args} did not start: {first:?}");
        };
        std::thread::spawn(move || for _ in lines {});
        Proc { child, addr: l.addr, http: l.http }
    }

    /// Sends SIGTERM and waits (10 s at most) for the exit.
    pub fn stop(&mut self) -> Option<std::process::ExitStatus> {
        // SAFETY: signalling our own child process.
        unsafe { libc_kill(self.child.id() as i32, 15) };
        let deadline = Instant::now() + Duration::from_secs(10);
        while Instant::now() < deadline {
            if let Ok(Some(s)) = self.child.try_wait() {
                return Some(s);
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
        None
    }
}

extern "C" {
    #[link_name = "kill"]
    fn libc_kill(pid: i32, sig: i32) -> i32;
}

/// `layerstream up` on a free port; on drop: stopped, and no shm of its namespace left.
pub struct Stack {
    pub proc: Proc,
}

impl Stack {
    pub fn up(store: &Path, extra: &[&str]) -> Stack {
        Self::up_env(store, extra, &[])
    }

    /// With the internal token fixed to `INTERNAL_TOKEN` (instead of one `up` generates), so tests
    /// can call the workers and the loader directly.
    pub fn up_env(store: &Path, extra: &[&str], envs: &[(&str, &str)]) -> Stack {
        let mut args = vec!["up", "--model", store.to_str().unwrap(), "--listen", "127.0.0.1:0"];
        // Tests run side by side: never the default HTTP port.
        args.extend_from_slice(&["--http-listen", "127.0.0.1:0"]);
        args.extend_from_slice(extra);
        let mut envs = envs.to_vec();
        envs.push((layerstream_rpc::auth::INTERNAL_TOKEN_ENV, INTERNAL_TOKEN));
        Stack { proc: Proc::start(&args, &envs) }
    }

    pub fn addr(&self) -> &str {
        &self.proc.addr
    }

    /// The HTTP base URL (`http://127.0.0.1:port`).
    pub fn http(&self) -> &str {
        self.proc.http.as_deref().expect("the stack serves HTTP")
    }

    /// POSTs `body` as JSON to `path` of the stack's HTTP API (see `post_json`).
    pub fn post(&self, path: &str, body: &serde_json::Value, headers: &[&str]) -> (u16, String) {
        post_json(self.http(), path, body, headers)
    }

    /// A value of the stack's Prometheus `/metrics` (`name` with its labels, as exposed; 0 when
    /// absent), read with curl.
    pub fn metric(&self, name: &str) -> f64 {
        let out = std::process::Command::new("curl")
            .args(["-sf", &format!("{}/metrics", self.http())])
            .output()
            .expect("curl runs");
        String::from_utf8_lossy(&out.stdout)
            .lines()
            .find_map(|l| l.strip_prefix(name).and_then(|r| r.trim().parse().ok()))
            .unwrap_or(0.0)
    }

    /// The shm namespace prefix of this stack.
    pub fn shm_prefix(&self) -> String {
        format!(
            "{}{}-",
            layerstream_shm::PREFIX,
            layerstream_shm::up_namespace(self.proc.child.id())
        )
    }

    /// The loader's control socket (in the user's private runtime directory).
    pub fn loader_socket(&self) -> std::path::PathBuf {
        let ns = layerstream_shm::up_namespace(self.proc.child.id());
        layerstream_rpc::transport::namespace_socket(&ns).unwrap()
    }

    /// A client of this stack's loader daemon, with the internal token.
    pub async fn loader_client(&self) -> LoaderClient<Authed> {
        let ch = layerstream_rpc::transport::connect_uds(&self.loader_socket()).await.unwrap();
        LoaderClient::new(Bearer::new(Some(INTERNAL_TOKEN)).unwrap().wrap(ch))
    }

    /// Pids of the children of `up` whose command line contains `word`.
    pub fn children(&self, word: &str) -> Vec<i32> {
        let up = self.proc.child.id().to_string();
        let mut out = Vec::new();
        for e in std::fs::read_dir("/proc").unwrap().flatten() {
            let Ok(pid) = e.file_name().to_string_lossy().parse::<i32>() else { continue };
            let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
            let ppid =
                stat.rsplit(')').next().and_then(|r| r.split_whitespace().nth(1)).unwrap_or("");
            let cmd = std::fs::read_to_string(format!("/proc/{pid}/cmdline")).unwrap_or_default();
            if ppid == up && cmd.split('\0').nth(1) == Some(word) {
                out.push(pid);
            }
        }
        out
    }

    /// Kills a process with SIGKILL.
    pub fn kill9(pid: i32) {
        Self::signal(pid, 9);
    }

    /// Sends signal `sig` to a test-owned process (SIGSTOP 19, SIGCONT 18, …).
    pub fn signal(pid: i32, sig: i32) {
        // SAFETY: sending a signal to a test-owned process.
        unsafe { libc_kill(pid, sig) };
    }

    /// Stops the stack and asserts it left no shared memory behind.
    pub fn shutdown(mut self) {
        let prefix = self.shm_prefix();
        self.proc.stop();
        let left = shm_left(&prefix);
        assert!(left.is_empty(), "shared memory left behind: {left:?}");
        std::mem::forget(self);
    }
}

impl Drop for Stack {
    fn drop(&mut self) {
        self.proc.stop();
    }
}

/// Regions in /dev/shm whose names start with `prefix` (what a stopped stack must not leave).
pub fn shm_left(prefix: &str) -> Vec<String> {
    std::fs::read_dir("/dev/shm")
        .unwrap()
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with(prefix))
        .collect()
}

/// `layerstream submit --json` against `addr`; returns the final JSON object.
pub fn submit(addr: &str, args: &[&str]) -> serde_json::Value {
    let mut a = vec!["submit", "--addr", addr, "--json"];
    a.extend_from_slice(args);
    crate::last_json(&crate::layerstream(&a))
}

/// `submit` args reproducing a golden (token ids, greedy, EOS ignored) with `n` new tokens.
pub fn golden_args(g: &crate::Golden, n: usize) -> Vec<String> {
    let ids: Vec<String> = g.input_ids.iter().map(u32::to_string).collect();
    vec![
        "--token-ids".into(),
        ids.join(","),
        "--max-new-tokens".into(),
        n.to_string(),
        "--ignore-eos".into(),
    ]
}

/// Submits every golden of model `name` to `stack` for its comparable steps and asserts
/// transformers' greedy tokens; returns each job's stats.
pub fn greedy_goldens_through(stack: &Stack, name: &str) -> Vec<serde_json::Value> {
    crate::goldens(name)
        .iter()
        .map(|g| {
            let n = crate::comparable_steps(g).min(g.greedy_ids.len());
            let args = golden_args(g, n);
            let out = submit(stack.addr(), &args.iter().map(String::as_str).collect::<Vec<_>>());
            let got: Vec<u32> = serde_json::from_value(out["output_ids"].clone()).unwrap();
            crate::assert_greedy(name, g, &got);
            out["stats"].clone()
        })
        .collect()
}

/// The spans of `traces` a receiver wrote to `file`, once they are whole: processes flush at
/// shutdown, each in its own time, so this waits until every parent and link target they name has
/// arrived and the loader's reads are there (or 30 s pass).
pub fn whole_traces(file: &std::path::Path, traces: &[&str]) -> Vec<serde_json::Value> {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        std::thread::sleep(Duration::from_millis(300));
        let text = std::fs::read_to_string(file).unwrap_or_default();
        let all: Vec<serde_json::Value> =
            text.lines().filter_map(|l| serde_json::from_str(l).ok()).collect();
        let ids: std::collections::HashSet<&str> =
            all.iter().filter_map(|s| s["span_id"].as_str()).collect();
        let known = |p: Option<&str>| p.is_none_or(|p| p.is_empty() || ids.contains(p));
        let mine: Vec<&serde_json::Value> =
            all.iter().filter(|s| traces.contains(&s["trace_id"].as_str().unwrap_or(""))).collect();
        let whole = mine.iter().all(|s| {
            known(s["parent_span_id"].as_str())
                && s["links"].as_array().into_iter().flatten().all(|l| known(l["span_id"].as_str()))
        });
        let named =
            |n: &str| all.iter().any(|s| s["name"].as_str().is_some_and(|x| x.starts_with(n)));
        let jobs = mine.iter().filter(|s| s["name"] == "job").count();
        if (whole && named("read layer") && jobs == traces.len()) || Instant::now() > deadline {
            return all;
        }
    }
}

/// An OTLP receiver writing to `spans_file` and a stack of the tiny model (`up` with `extra`)
/// exporting to it.
pub fn traced_stack(
    dir: &std::path::Path,
    spans_file: &std::path::Path,
    extra: &[&str],
) -> (Proc, Stack) {
    traced_stack_of(&crate::tiny_store(dir), spans_file, extra)
}

/// An OTLP receiver writing to `spans_file` and a stack of `store` (`up` with `extra`) exporting to
/// it.
pub fn traced_stack_of(
    store: &std::path::Path,
    spans_file: &std::path::Path,
    extra: &[&str],
) -> (Proc, Stack) {
    let sink = Proc::start(
        &["otlp-sink", "--listen", "127.0.0.1:0", "--out", spans_file.to_str().unwrap()],
        &[],
    );
    let stack = Stack::up_env(store, extra, &[("OTEL_EXPORTER_OTLP_ENDPOINT", sink.addr.as_str())]);
    (sink, stack)
}

/// Sequences holding KV caches on the workers of the stack at `addr`, summed.
pub async fn live_sequences(addr: &str) -> u32 {
    let mut c =
        layerstream_rpc::v1::coordinator_client::CoordinatorClient::connect(addr.to_owned())
            .await
            .unwrap();
    let mut total = 0;
    for w in c
        .list_workers(layerstream_rpc::v1::ListWorkersRequest {})
        .await
        .unwrap()
        .into_inner()
        .workers
    {
        let mut wc = worker_client(w.address).await;
        total += wc.info(layerstream_rpc::v1::InfoRequest {}).await.unwrap().into_inner().sequences;
    }
    total
}

/// Waits (up to 15 s) until no worker of the stack at `addr` holds a sequence.
pub async fn wait_until_zero_sequences(addr: &str) {
    let deadline = Instant::now() + Duration::from_secs(15);
    loop {
        let n = live_sequences(addr).await;
        if n == 0 {
            return;
        }
        assert!(Instant::now() < deadline, "{n} sequences still hold KV caches");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Eight prompts of different lengths for concurrent-job tests.
pub const PROMPTS: [&str; 8] = [
    "The quick brown fox",
    "Hello",
    "What is the capital of France?",
    "1 2 3 4",
    "Once upon a time there was",
    "a",
    "Rust is",
    "Streaming layers",
];

/// Tokens job `i` of `PROMPTS` generates: every job a different length.
pub fn prompt_tokens(i: usize) -> String {
    (5 + 5 * i).to_string()
}

/// Each of `PROMPTS`' `layerstream run` tokens (EOS ignored): the reference of concurrent jobs.
pub fn solo_runs(store: &Path) -> Vec<Vec<u32>> {
    let s = store.to_str().unwrap();
    (0..PROMPTS.len())
        .map(|i| {
            let n = prompt_tokens(i);
            let a = ["run", "--model", s, "--prompt", PROMPTS[i], "--max-new-tokens", &n];
            let mut a = a.to_vec();
            a.extend(["--ignore-eos", "--json"]);
            serde_json::from_value(crate::last_json(&crate::layerstream(&a))["output_ids"].clone())
                .unwrap()
        })
        .collect()
}

/// Every one of `PROMPTS` submitted at once to the stack at `addr`; the final JSON of each.
pub fn concurrent_jobs(addr: &str) -> Vec<serde_json::Value> {
    std::thread::scope(|s| {
        let hs: Vec<_> = (0..PROMPTS.len())
            .map(|i| {
                s.spawn(move || {
                    let n = prompt_tokens(i);
                    submit(addr, &["--prompt", PROMPTS[i], "--max-new-tokens", &n, "--ignore-eos"])
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

/// POSTs `body` as JSON to `base` + `path` with curl, with extra `headers` (`name: value`); the
/// HTTP status (0 when none came) and the body. The body goes on stdin: a 600 KB grammar is past
/// what a command line may hold.
pub fn post_json(
    base: &str,
    path: &str,
    body: &serde_json::Value,
    headers: &[&str],
) -> (u16, String) {
    let mut c = std::process::Command::new("curl");
    c.args(["-sS", "-w", "\n%{http_code}", "-H", "content-type: application/json"]);
    for h in headers {
        c.args(["-H", h]);
    }
    c.args(["--data-binary", "@-"]).arg(format!("{base}{path}"));
    c.stdin(Stdio::piped()).stdout(Stdio::piped());
    let mut child = c.spawn().expect("curl runs");
    use std::io::Write;
    child.stdin.take().unwrap().write_all(body.to_string().as_bytes()).unwrap();
    let out = child.wait_with_output().unwrap();
    let out = String::from_utf8_lossy(&out.stdout).into_owned();
    let (body, code) = out.rsplit_once('\n').unwrap_or(("", "0"));
    (code.trim().parse().unwrap_or(0), body.to_owned())
}

/// `post_json` that must be answered 200 with JSON: the answer.
pub fn post_ok(base: &str, path: &str, body: &serde_json::Value) -> serde_json::Value {
    let (code, text) = post_json(base, path, body, &[]);
    assert_eq!(code, 200, "POST {path}: {text}");
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("POST {path}: {e}: {text}"))
}
