//! `layerstream up`: the whole stack on this host as child processes — the loader daemon, N workers
//! and the coordinator — in the foreground until SIGINT/SIGTERM, then all stopped, no shm left behind.

use anyhow::{bail, Context, Result};
use clap::Args;
use layerstream_coordinator::{HttpFlags, PlanFlags, SchedulerFlags};
use layerstream_loader::SlotFlags;
use layerstream_rpc::handshake::Listening;
use layerstream_worker::DeviceFlags;
use std::io::{BufRead, BufReader};
use std::os::unix::process::CommandExt;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

mod stack;
use stack::StackSpec;

/// Flags of `layerstream up`. The device, plan, scheduler and slot-pool flags are the worker's,
/// coordinator's and loader's own flag groups, passed on to them unchanged.
#[derive(Args, Debug)]
#[command(group(clap::ArgGroup::new("residency").args(["resident_layers", "memory_budget"])))]
pub struct UpArgs {
    /// Layer store; default: the embedded SmolLM2-135M-Instruct (fetched and imported on first use).
    #[arg(long, env = "LAYERSTREAM_MODEL")]
    pub model: Option<PathBuf>,
    /// Number of workers (the layers are split between them in proportion to their budgets).
    #[arg(long, env = "LAYERSTREAM_UP_WORKERS", default_value_t = 1)]
    pub workers: usize,
    #[command(flatten)]
    pub device: DeviceFlags,
    #[command(flatten)]
    pub plan: PlanFlags,
    #[command(flatten)]
    pub sched: SchedulerFlags,
    #[command(flatten)]
    pub http: HttpFlags,
    #[command(flatten)]
    pub spec: layerstream_coordinator::SpecFlags,
    #[command(flatten)]
    pub pool: SlotFlags,
    /// Coordinator address.
    #[arg(long, env = "LAYERSTREAM_LISTEN", default_value = "127.0.0.1:50051")]
    pub listen: String,
    /// OTLP gRPC endpoint passed to every process (off when unset).
    #[arg(long, env = "OTEL_EXPORTER_OTLP_ENDPOINT")]
    pub otlp_endpoint: Option<String>,
    /// With an input (--prompt, --chat, --messages, --token-ids): submit it once the stack is up,
    /// print the answer and its stats, then stop the stack.
    #[command(flatten)]
    pub prompt: crate::prompt::PromptArgs,
    #[command(flatten)]
    pub sampling: crate::prompt::SamplingArgs,
    /// With an input: print the result as one JSON object (as `submit --json`).
    #[arg(long, env = "LAYERSTREAM_JSON")]
    pub json: bool,
    /// API key of the job API (clients send `authorization: Bearer <key>`); unset: none.
    #[arg(long, env = "LAYERSTREAM_API_KEY", hide_env_values = true)]
    pub api_key: Option<String>,
    /// Read the API key from this file (its first line) instead: a key on the command line is
    /// readable by every local user in `/proc/<pid>/cmdline`.
    #[arg(long, env = "LAYERSTREAM_API_KEY_FILE")]
    pub api_key_file: Option<PathBuf>,
    /// Serve the job API over TLS with this PEM certificate chain (with `--tls-key`).
    #[arg(long, env = "LAYERSTREAM_TLS_CERT", requires = "tls_key")]
    pub tls_cert: Option<PathBuf>,
    /// The PEM private key of `--tls-cert`.
    #[arg(long, env = "LAYERSTREAM_TLS_KEY", requires = "tls_cert")]
    pub tls_key: Option<PathBuf>,
    /// Times each child (loader, worker, coordinator) is restarted at once after it dies; past
    /// that it is retried after pauses doubling from 1 s to 60 s while the rest of the stack keeps
    /// serving (a one-shot `up` with an input gives up and stops instead). A child that ran a
    /// minute before dying starts a fresh count.
    #[arg(long, env = "LAYERSTREAM_MAX_RESTARTS", default_value_t = 5)]
    pub max_restarts: u32,
    /// Measure the calibration again (disk, link, a layer's compute) instead of reading this host's
    /// and store's cached figures.
    #[arg(long, env = "LAYERSTREAM_RECALIBRATE")]
    pub recalibrate: bool,
}

/// Child processes, stopped one by one, last started first (SIGTERM, then SIGKILL after 5 s),
/// when dropped.
pub(crate) struct Children(pub(crate) Vec<(String, Child)>);

impl Drop for Children {
    fn drop(&mut self) {
        // Coordinator first, then workers, then the loader (which unlinks the shm), each stopped
        // before the next is signalled: a worker still running when the loader had gone logged a
        // failed release of every slot it held.
        for (name, c) in self.0.iter_mut().rev() {
            // SAFETY: signalling a child process we spawned and have not reaped.
            unsafe { libc::kill(c.id() as i32, libc::SIGTERM) };
            let deadline = Instant::now() + Duration::from_secs(5);
            loop {
                match c.try_wait() {
                    Ok(Some(_)) => break,
                    Ok(None) if Instant::now() < deadline => {
                        std::thread::sleep(Duration::from_millis(20))
                    }
                    _ => {
                        eprintln!("layerstream up: {name} did not stop; killing it");
                        let _ = c.kill();
                        let _ = c.wait();
                        break;
                    }
                }
            }
        }
    }
}

/// The children of `children` that have already ended, each as "NAME STATUS" (`exits::describe`).
fn ended(children: &mut [(String, Child)]) -> Vec<String> {
    children
        .iter_mut()
        .filter_map(|(n, c)| {
            c.try_wait().ok().flatten().map(|s| format!("{n} {}", crate::exits::describe(s)))
        })
        .collect()
}

/// Spawns `layerstream <args>` and waits for its handshake line (`handshake::Listening`); its log
/// goes to stderr.
pub(crate) fn spawn(children: &mut Children, name: &str, args: &[String]) -> Result<Listening> {
    spawn_logged(children, name, args, Stdio::inherit(), None)
}

/// As `spawn`, with the child's log in a file under the temp dir instead of on stderr (`bench`, whose
/// output is a table); a child that fails to start is reported with the file's last lines.
pub(crate) fn spawn_quiet(
    children: &mut Children,
    name: &str,
    args: &[String],
) -> Result<Listening> {
    let path = std::env::temp_dir().join(format!(
        "layerstream-{}-{}.log",
        std::process::id(),
        name.replace(|c: char| !c.is_ascii_alphanumeric(), "-")
    ));
    let file =
        std::fs::File::create(&path).with_context(|| format!("creating {}", path.display()))?;
    let res = spawn_logged(children, name, args, Stdio::from(file), Some(&path));
    if res.is_ok() {
        let _ = std::fs::remove_file(&path);
    }
    res
}

fn spawn_logged(
    children: &mut Children,
    name: &str,
    args: &[String],
    stderr: Stdio,
    log: Option<&std::path::Path>,
) -> Result<Listening> {
    let exe = std::env::current_exe().context("locating the layerstream binary")?;
    let mut cmd = Command::new(exe);
    cmd.args(args).stdin(Stdio::null()).stdout(Stdio::piped()).stderr(stderr);
    // SAFETY: the closure runs between fork and exec and only calls async-signal-safe functions
    // (sigemptyset/sigaddset/pthread_sigmask) on a local set: the child gets SIGINT/SIGTERM unblocked.
    unsafe {
        cmd.pre_exec(|| {
            let mut set: libc::sigset_t = std::mem::zeroed();
            libc::sigemptyset(&mut set);
            libc::sigaddset(&mut set, libc::SIGINT);
            libc::sigaddset(&mut set, libc::SIGTERM);
            libc::pthread_sigmask(libc::SIG_UNBLOCK, &set, std::ptr::null_mut());
            Ok(())
        });
    }
    // SAFETY: between fork and exec only async-signal-safe calls (prctl, getppid, kill): the child
    // gets SIGTERM when `up` (this thread) dies, even by SIGKILL, so no stack outlives it; if `up`
    // died before the prctl, the child stops itself at once.
    let parent = std::process::id() as libc::pid_t;
    unsafe {
        cmd.pre_exec(move || {
            libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGTERM);
            if libc::getppid() != parent {
                libc::kill(libc::getpid(), libc::SIGTERM);
            }
            Ok(())
        });
    }
    let mut child = cmd.spawn().with_context(|| format!("starting {name}"))?;
    let stdout = child.stdout.take().expect("piped");
    children.0.push((name.to_owned(), child));
    let mut lines = BufReader::new(stdout).lines();
    let first = lines.next();
    let Some(listening) = first.as_ref().and_then(|l| l.as_deref().ok()).and_then(Listening::parse)
    else {
        // How it ended (waited for briefly: its stdout closed as it exited).
        let child = &mut children.0.last_mut().expect("pushed above").1;
        let deadline = Instant::now() + Duration::from_secs(2);
        let mut status = None;
        while status.is_none() && Instant::now() < deadline {
            status = child.try_wait().ok().flatten();
            std::thread::sleep(Duration::from_millis(20));
        }
        let how = match (status, &first) {
            (Some(s), _) => crate::exits::describe(s),
            (None, Some(Ok(line))) => format!("printed {line:?} instead of its address"),
            (None, _) => "closed its output without an address".to_owned(),
        };
        // A part that died first is usually the cause (a worker killed under the memory limit
        // leaves the coordinator a bare "transport error"): say so.
        let (_, others) = children.0.split_last_mut().expect("pushed above");
        let fallen = ended(others);
        let how = match fallen.is_empty() {
            true => format!("{how} before it was ready"),
            false => format!("{how} before it was ready, and before it {}", fallen.join("; ")),
        };
        match log {
            Some(p) => {
                let text = std::fs::read_to_string(p).unwrap_or_default();
                let tail: Vec<&str> =
                    text.lines().rev().take(20).collect::<Vec<_>>().into_iter().rev().collect();
                bail!("{name} {how}; its log ({}) ends:\n{}", p.display(), tail.join("\n"))
            }
            None => bail!("{name} {how}; see its log above"),
        }
    };
    std::thread::spawn(move || for _ in lines {});
    Ok(listening)
}

fn opt(flag: &str, v: &Option<impl ToString>) -> Vec<String> {
    v.as_ref().map(|v| vec![flag.to_owned(), v.to_string()]).unwrap_or_default()
}

/// A child `up` keeps running: how to start it again, how often it was (since it last ran for
/// `HEALTHY_FOR`), when it last started, and when it is due to start again (after a pause).
struct Supervised {
    args: Vec<String>,
    restarts: u32,
    started: Instant,
    due: Option<Instant>,
}

impl Supervised {
    fn new(args: Vec<String>) -> Self {
        Supervised { args, restarts: 0, started: Instant::now(), due: None }
    }
}

/// A child that ran this long before it died starts again with a clean count.
const HEALTHY_FOR: Duration = Duration::from_secs(60);

/// The pause before the `restarts`-th restart of a child: none for the first `max` (as before),
/// then 1 s doubling to at most 60 s — a part that keeps failing is retried without end while the
/// rest of the stack goes on serving.
fn restart_delay(restarts: u32, max: u32) -> Duration {
    match restarts.checked_sub(max + 1) {
        None => Duration::ZERO,
        Some(over) => Duration::from_secs(1u64 << over.min(6)).min(Duration::from_secs(60)),
    }
}

/// Replaces the dead child `i` by a new one started with the same arguments (same address, same
/// socket), keeping the stop order.
fn respawn(children: &mut Children, i: usize, args: &[String]) -> Result<()> {
    let name = children.0[i].0.clone();
    let mut fresh = Children(Vec::new());
    let started = spawn(&mut fresh, &name, args);
    if let Some(entry) = fresh.0.pop() {
        children.0[i] = entry;
    }
    started.map(|_| ())
}

/// The device of each of `workers` workers: `--device` is one device for all (`cuda:0`) or a
/// comma-separated list given out in turn (`cuda:0,cpu`: worker 0 on the GPU, worker 1 on the CPU,
/// a third on the GPU again).
pub(crate) fn worker_devices(device: &str, workers: usize) -> Vec<String> {
    let list: Vec<&str> = device.split(',').map(str::trim).collect();
    (0..workers).map(|i| list[i % list.len()].to_owned()).collect()
}

/// The device flags worker `i` gets. CPU workers run one after another unless the plan keeps
/// micro-batches in flight (which the plan decides), and then all at once: each gets every core
/// (or `--threads`) for the first, and its share, cores ÷ CPU workers (at least one), as
/// `--concurrent-threads` for the second (sharing the cores out while workers run one after
/// another only slows each one: benchmarks/cpu-threads-2core.md, 0.55-0.71×). A CPU worker's
/// budget defaults to its share of the ledger; a GPU worker's to what its device has free.
fn worker_device(
    a: &UpArgs,
    shares: &crate::fit::Shares,
    i: usize,
) -> layerstream_worker::DeviceFlags {
    let devices = worker_devices(&a.device.compute.device, a.workers);
    let cpus = devices.iter().filter(|d| *d == "cpu").count();
    let mut d = a.device.clone();
    d.compute.device = devices[i].clone();
    if d.compute.device == "cpu" {
        d.memory_budget = d.memory_budget.or(shares.worker_budget);
        if d.concurrent_threads.is_none() && cpus > 1 {
            let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
            let threads = d.compute.threads.unwrap_or(cores);
            d.concurrent_threads = Some((cores / cpus).max(1).min(threads));
        }
    }
    d
}

/// The argument list with the value after `flag` replaced (a restarted child keeps its address).
fn with_flag(mut args: Vec<String>, flag: &str, value: &str) -> Vec<String> {
    if let Some(i) = args.iter().position(|a| a == flag) {
        args[i + 1] = value.to_owned();
    }
    args
}

/// Runs the stack until SIGINT/SIGTERM, restarting a child that dies (up to `--max-restarts`
/// times each); with an input, until its answer is printed.
pub fn run(a: UpArgs) -> Result<()> {
    if a.workers == 0 {
        bail!("--workers must be at least 1");
    }
    crate::run::check_devices(&a.device.compute.device)?;
    let model = crate::run::model_dir(&a.model)?;
    let store = layerstream_model::Store::open(&model)?;
    remove_orphans();
    let ns = layerstream_shm::up_namespace(std::process::id());
    let socket = layerstream_rpc::transport::namespace_socket(&ns)
        .context("the private runtime directory for the loader's socket")?
        .display()
        .to_string();
    let api_key = share_secrets(&a)?;
    let (_, shares) = memory_shares(&a, &store)?;
    let (predicted, reading) = crate::plan::for_up(&a, &store, &shares);
    // Block SIGINT/SIGTERM here so they can be waited for; children get the default disposition back.
    let mut set = unsafe_sigset();
    let mut children = Children(Vec::new());
    let journal = layerstream_rpc::transport::namespace_journal(&ns)?;
    let stack = StackSpec {
        a: &a,
        model: model.display().to_string(),
        socket,
        journal: journal.clone(),
        ns: ns.clone(),
        shares: shares.clone(),
        predicted,
        reading,
    };
    let mut specs = vec![stack.start_loader(&mut children)?];
    let mut addrs = Vec::new();
    for i in 0..a.workers {
        let (spec, addr) = stack.start_worker(&mut children, i)?;
        specs.push(spec);
        addrs.push(addr);
    }
    let (spec, listening) = stack.start_coordinator(&mut children, &addrs)?;
    specs.push(spec);
    // With an input: the request runs on its own thread while this one supervises the children.
    let job = a.prompt.is_given().then(|| submit_in_thread(&a, &listening.addr, &api_key));
    if job.is_none() {
        listening.announce();
        let web = listening.http.as_ref().map_or(String::new(), |h| {
            format!("; OpenAI API at {h}/v1 (OPENAI_BASE_URL), live page at {h}/, metrics at {h}/metrics")
        });
        eprintln!("layerstream up: {} worker(s), loader with {} slots; coordinator at {}{web}; Ctrl-C stops everything", a.workers, shares.slots, listening.addr);
    }
    let outcome = supervise(&mut children, &mut specs, &mut set, a.max_restarts, job.as_ref());
    drop(children);
    clean_shm(&ns);
    let _ = std::fs::remove_file(&journal);
    outcome?;
    match job {
        Some(j) => j.join().map_err(|_| anyhow::anyhow!("the request thread panicked"))?,
        None => Ok(()),
    }
}

/// The internal APIs' secret: given, or generated for this stack. Children inherit it from the
/// environment (a command line would show it in `ps`). The API key travels the same way.
fn share_secrets(a: &UpArgs) -> Result<Option<String>> {
    let token = std::env::var(layerstream_rpc::auth::INTERNAL_TOKEN_ENV)
        .ok()
        .filter(|t| !t.trim().is_empty())
        .unwrap_or_else(layerstream_rpc::auth::random_hex);
    std::env::set_var(layerstream_rpc::auth::INTERNAL_TOKEN_ENV, &token);
    // The keys reach the children (and `up`'s own submit) through the environment only: the
    // key itself, or the file's path (several keys).
    let argv: Vec<String> = std::env::args().collect();
    let keys =
        layerstream_rpc::auth::api_keys(a.api_key.as_deref(), a.api_key_file.as_deref(), &argv)
            .map_err(anyhow::Error::msg)?;
    match (&a.api_key_file, keys.first()) {
        (Some(f), _) => std::env::set_var(
            "LAYERSTREAM_API_KEY_FILE",
            std::fs::canonicalize(f).unwrap_or_else(|_| f.clone()),
        ),
        (None, Some(k)) => std::env::set_var("LAYERSTREAM_API_KEY", k),
        (None, None) => std::env::remove_var("LAYERSTREAM_API_KEY"),
    }
    let key = keys.into_iter().next();
    Ok(key)
}

/// The memory ledger read once and shared out (`fit::shares`): the loader's slots (never fewer
/// than `fit::slot_floor`), each CPU worker's budget (its embedding and head at least) and each
/// worker's host KV tier; flags the user gave are kept. Logged with what each part got.
pub(crate) fn memory_shares(
    a: &UpArgs,
    store: &layerstream_model::Store,
) -> Result<(layerstream_model::mem::Ledger, crate::fit::Shares)> {
    let m = &store.manifest;
    // Every streamable unit: layer files and, in a mixture-of-experts store, each expert file.
    let units =
        m.config.num_layers + m.files.iter().filter(|f| f.name.contains("_expert_")).count();
    let devices = worker_devices(&a.device.compute.device, a.workers);
    let cpu = devices.iter().filter(|d| *d == "cpu").count();
    let (group, buffers) = (a.plan.layer_group_size, a.plan.streaming_buffers);
    // What a CPU worker keeps whatever it streams: the head, and the embedding where it is the
    // head (one worker holds both; of several, the first one and the last one each).
    let keeps = |embed, head| layerstream_serving::plan::embed_head_bytes(m, embed, head, true);
    let worker_min = match a.workers {
        1 => keeps(true, true),
        _ => keeps(true, false).max(keeps(false, true)),
    };
    let shape = crate::fit::Shape {
        layers: units,
        slot_size: m.max_unit_bytes(),
        floor: crate::fit::slot_floor(a.workers - cpu, cpu, group, buffers, units),
        workers: a.workers,
        cpu: cpu > 0,
        worker_min,
    };
    let fixed = crate::fit::Fixed {
        slots: a.pool.slots,
        worker_budget: a.device.memory_budget,
        kv_host_bytes: a.plan.kv_host_bytes,
    };
    let ledger = layerstream_model::mem::Ledger::read();
    let shares = crate::fit::shares(ledger.usable(), ledger.shm_free, shape, fixed)
        .map_err(|e| anyhow::anyhow!("{e} ({})", ledger.describe()))?;
    eprintln!("layerstream up: {}", crate::fit::describe(&ledger, &shares, a.workers));
    if let Some(w) = crate::fit::overcommitted(ledger.usable(), &shares, a.workers) {
        eprintln!("layerstream up: warning: {w}");
    }
    Ok((ledger, shares))
}

/// Submits `up`'s input to the coordinator at `addr` on its own thread.
fn submit_in_thread(
    a: &UpArgs,
    addr: &str,
    api_key: &Option<String>,
) -> std::thread::JoinHandle<Result<()>> {
    let sub = crate::submit::SubmitArgs {
        addr: addr.to_owned(),
        prompt: a.prompt.clone(),
        sampling: a.sampling.clone(),
        json: a.json,
        api_key: api_key.clone(),
        api_key_file: None,
        // A self-signed certificate is its own CA.
        tls_ca: a.tls_cert.clone(),
        json_schema: None,
        json_object: false,
        regex: None,
        grammar: None,
    };
    std::thread::spawn(move || {
        tokio::runtime::Builder::new_multi_thread()
            .enable_all()
            .build()?
            .block_on(crate::submit::run(sub))
    })
}

/// Waits for a signal (or the end of `job`), restarting children that die: at once `max_restarts`
/// times, then after growing pauses (`restart_delay`) while the rest keeps serving. Only a
/// one-shot `up` (with `job`, which nothing else serves) gives up after `max_restarts`.
fn supervise(
    children: &mut Children,
    specs: &mut [Supervised],
    set: &mut libc::sigset_t,
    max_restarts: u32,
    job: Option<&std::thread::JoinHandle<Result<()>>>,
) -> Result<()> {
    loop {
        if let Some(sig) = wait_signal(set, Duration::from_millis(200)) {
            eprintln!("layerstream up: signal {sig}, stopping");
            return Ok(());
        }
        if job.is_some_and(|j| j.is_finished()) {
            return Ok(());
        }
        for (i, spec) in specs.iter_mut().enumerate() {
            if spec.due.is_some_and(|d| Instant::now() >= d) {
                spec.due = None;
                spec.started = Instant::now();
                let name = children.0[i].0.clone();
                if let Err(e) = respawn(children, i, &spec.args) {
                    eprintln!("layerstream up: restarting {name} failed: {e:#}");
                }
            }
        }
        let dead = children.0.iter_mut().enumerate().find_map(|(i, (_, c))| {
            if specs[i].due.is_some() {
                return None;
            }
            c.try_wait().ok().flatten().map(|s| (i, s))
        });
        let Some((i, status)) = dead else { continue };
        let name = children.0[i].0.clone();
        let how = crate::exits::describe(status);
        let spec = &mut specs[i];
        if spec.started.elapsed() >= HEALTHY_FOR {
            spec.restarts = 0;
        }
        spec.restarts += 1;
        if job.is_some() && spec.restarts > max_restarts {
            bail!("{name} {how} after {max_restarts} restarts (--max-restarts); stopped the rest");
        }
        let delay = restart_delay(spec.restarts, max_restarts);
        if delay.is_zero() {
            eprintln!(
                "layerstream up: {name} {how}; restarting it ({} of {max_restarts})",
                spec.restarts
            );
        } else {
            eprintln!(
                "layerstream up: {name} {how} again ({} restarts); the rest of the stack keeps \
                 serving without it; next try in {} s",
                spec.restarts,
                delay.as_secs()
            );
        }
        spec.due = Some(Instant::now() + delay);
    }
}

/// Removes what stacks whose `up` died (SIGKILL, a crash) left behind: their shm regions and
/// loader sockets and job journals (named after the dead `up`'s pid).
fn remove_orphans() {
    use layerstream_shm::{process_alive, up_namespace_owner, up_region_owner};
    let mut removed = 0;
    for name in layerstream_shm::list(layerstream_shm::PREFIX) {
        let dead = up_region_owner(&name).is_some_and(|pid| !process_alive(pid));
        if dead && layerstream_shm::unlink(&name).is_ok() {
            removed += 1;
        }
    }
    if let Ok(dir) = layerstream_rpc::transport::runtime_dir() {
        for e in std::fs::read_dir(dir).into_iter().flatten().flatten() {
            let n = e.file_name().to_string_lossy().into_owned();
            let ns = layerstream_rpc::transport::file_namespace(&n);
            let pid = ns.and_then(up_namespace_owner);
            if pid.is_some_and(|pid| !process_alive(pid)) && std::fs::remove_file(e.path()).is_ok()
            {
                removed += 1;
            }
        }
    }
    if removed > 0 {
        eprintln!("layerstream up: removed {removed} shared-memory regions, sockets and journals left by stacks that were killed");
    }
}

/// Removes what a loader that died without cleaning up left in /dev/shm.
fn clean_shm(ns: &str) {
    let n = layerstream_shm::remove_stale(ns);
    if n > 0 {
        eprintln!("layerstream up: removed {n} shared-memory regions left by a stopped loader");
    }
}

fn unsafe_sigset() -> libc::sigset_t {
    // SAFETY: sigset manipulation on a local, zero-initialised set; pthread_sigmask on this thread
    // only (before any other thread exists in this command).
    unsafe {
        let mut set: libc::sigset_t = std::mem::zeroed();
        libc::sigemptyset(&mut set);
        libc::sigaddset(&mut set, libc::SIGINT);
        libc::sigaddset(&mut set, libc::SIGTERM);
        libc::pthread_sigmask(libc::SIG_BLOCK, &set, std::ptr::null_mut());
        set
    }
}

fn wait_signal(set: &mut libc::sigset_t, timeout: Duration) -> Option<i32> {
    let ts =
        libc::timespec { tv_sec: timeout.as_secs() as i64, tv_nsec: timeout.subsec_nanos() as i64 };
    // SAFETY: set is a valid signal set; a null info pointer is allowed; ts is a valid timeout.
    let r = unsafe { libc::sigtimedwait(set, std::ptr::null_mut(), &ts) };
    (r > 0).then_some(r)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A part that already died is named with how it died (a worker the OOM killer took shows
    /// SIGKILL), one still running is not.
    #[test]
    fn ended_children_are_named_with_how_they_died() {
        let sh = |script: &str| Command::new("sh").args(["-c", script]).spawn().unwrap();
        let mut kids =
            vec![("worker 0".to_owned(), sh("kill -9 $$")), ("loader".into(), sh("sleep 5"))];
        kids[0].1.wait().unwrap();
        let said = ended(&mut kids);
        assert_eq!(said.len(), 1, "{said:?}");
        assert!(said[0].starts_with("worker 0 was killed by SIGKILL (signal 9)"), "{said:?}");
        let _ = kids[1].1.kill();
        let _ = kids[1].1.wait();
    }

    /// The first restarts are immediate; then pauses double from 1 s to at most 60 s.
    #[test]
    fn restarts_back_off_without_end() {
        assert_eq!(restart_delay(1, 5), Duration::ZERO);
        assert_eq!(restart_delay(5, 5), Duration::ZERO);
        assert_eq!(restart_delay(6, 5), Duration::from_secs(1));
        assert_eq!(restart_delay(7, 5), Duration::from_secs(2));
        assert_eq!(restart_delay(12, 5), Duration::from_secs(60));
        assert_eq!(restart_delay(1000, 5), Duration::from_secs(60));
        assert_eq!(restart_delay(1, 0), Duration::from_secs(1));
    }

    /// One device serves every worker; a list is given out in turn.
    #[test]
    fn devices_are_given_out_in_turn() {
        assert_eq!(worker_devices("cpu", 2), ["cpu", "cpu"]);
        assert_eq!(worker_devices("cuda:0, cpu", 3), ["cuda:0", "cpu", "cuda:0"]);
        assert_eq!(worker_devices("cuda:0,cuda:1,cpu", 2), ["cuda:0", "cuda:1"]);
    }
}
