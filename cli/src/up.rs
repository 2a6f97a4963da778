//! `layerstream up`: the whole stack on this host as child processes — the loader daemon, N workers
//! and the coordinator — in the foreground until SIGINT/SIGTERM, then all stopped, no shm left behind.

use anyhow::{bail, Context, Result};
use clap::Args;
use layerstream_coordinator::{PlanFlags, SchedulerFlags};
use layerstream_loader::SlotFlags;
use layerstream_worker::server::DeviceFlags;
use std::io::{BufRead, BufReader};
use std::os::unix::process::CommandExt;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

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
}

/// Child processes, stopped (SIGTERM, then SIGKILL after 5 s) when dropped.
pub(crate) struct Children(pub(crate) Vec<(String, Child)>);

impl Drop for Children {
    fn drop(&mut self) {
        // Coordinator first, then workers, then the loader (which unlinks the shm).
        for (_, c) in self.0.iter().rev() {
            // SAFETY: signalling a child process we spawned and have not reaped.
            unsafe { libc::kill(c.id() as i32, libc::SIGTERM) };
        }
        let deadline = Instant::now() + Duration::from_secs(5);
        for (name, c) in self.0.iter_mut().rev() {
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

/// Spawns `layerstream <args>` and waits for its `LISTENING <addr>` line; its log goes to stderr.
pub(crate) fn spawn(children: &mut Children, name: &str, args: &[String]) -> Result<String> {
    spawn_logged(children, name, args, Stdio::inherit(), None)
}

/// As `spawn`, with the child's log in a file under the temp dir instead of on stderr (`bench`, whose
/// output is a table); a child that fails to start is reported with the file's last lines.
pub(crate) fn spawn_quiet(children: &mut Children, name: &str, args: &[String]) -> Result<String> {
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
) -> Result<String> {
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
    let mut child = cmd.spawn().with_context(|| format!("starting {name}"))?;
    let stdout = child.stdout.take().expect("piped");
    children.0.push((name.to_owned(), child));
    let mut lines = BufReader::new(stdout).lines();
    let addr = match lines.next() {
        Some(Ok(l)) if l.starts_with("LISTENING ") => l["LISTENING ".len()..].to_owned(),
        other => match log {
            Some(p) => {
                let text = std::fs::read_to_string(p).unwrap_or_default();
                let tail: Vec<&str> =
                    text.lines().rev().take(20).collect::<Vec<_>>().into_iter().rev().collect();
                bail!(
                    "{name} exited before it was ready ({other:?}); its log ({}) ends:\n{}",
                    p.display(),
                    tail.join("\n")
                )
            }
            None => bail!("{name} exited before it was ready ({other:?}); see its log above"),
        },
    };
    std::thread::spawn(move || for _ in lines {});
    Ok(addr)
}

fn opt(flag: &str, v: &Option<impl ToString>) -> Vec<String> {
    v.as_ref().map(|v| vec![flag.to_owned(), v.to_string()]).unwrap_or_default()
}

/// Runs the stack until SIGINT/SIGTERM or until a process dies.
pub fn run(a: UpArgs) -> Result<()> {
    if a.workers == 0 {
        bail!("--workers must be at least 1");
    }
    crate::run::check_device(&a.device.device)?;
    let model = crate::run::model_dir(&a.model)?;
    let store = layerstream_model::Store::open(&model)?;
    let model_s = model.display().to_string();
    let ns = format!("up{}", std::process::id());
    let socket = std::env::temp_dir().join(format!("layerstream-{ns}.sock")).display().to_string();
    let per_worker = a.plan.streaming_buffers * a.plan.layer_group_size + a.pool.prefetch_depth + 1;
    let slots = a
        .pool
        .slots
        .unwrap_or((a.workers * per_worker).max(4))
        .min(store.manifest.config.num_layers.max(4));
    // Block SIGINT/SIGTERM here so they can be waited for; children get the default disposition back.
    let mut set = unsafe_sigset();
    let mut children = Children(Vec::new());
    let otlp = opt("--otlp-endpoint", &a.otlp_endpoint);
    let pool = SlotFlags { slots: Some(slots), ..a.pool.clone() };
    let mut largs = vec![
        "loader-daemon".into(),
        "--model".into(),
        model_s.clone(),
        "--socket".into(),
        socket.clone(),
        "--namespace".into(),
        ns.clone(),
    ];
    largs.extend(pool.to_args());
    largs.extend(otlp.clone());
    spawn(&mut children, "loader-daemon", &largs)?;
    let mut addrs = Vec::new();
    for i in 0..a.workers {
        let mut wargs = vec![
            "worker".into(),
            "--model".into(),
            model_s.clone(),
            "--listen".into(),
            "127.0.0.1:0".into(),
            "--loader-socket".into(),
            socket.clone(),
        ];
        wargs.extend(a.device.to_args());
        wargs.extend(otlp.clone());
        addrs.push(spawn(&mut children, &format!("worker {i}"), &wargs)?);
    }
    let mut cargs = vec![
        "coordinator".into(),
        "--model".into(),
        model_s,
        "--listen".into(),
        a.listen.clone(),
        "--worker".into(),
        addrs.join(","),
    ];
    cargs.extend(a.plan.to_args());
    cargs.extend(a.sched.to_args());
    cargs.extend(otlp);
    let addr = spawn(&mut children, "coordinator", &cargs)?;
    if a.prompt.is_given() {
        let sub = crate::submit::SubmitArgs {
            addr,
            prompt: a.prompt.clone(),
            sampling: a.sampling.clone(),
            json: a.json,
        };
        let res = tokio::runtime::Builder::new_multi_thread()
            .enable_all()
            .build()?
            .block_on(crate::submit::run(sub));
        drop(children);
        clean_shm(&ns);
        return res;
    }
    println!("LISTENING {addr}");
    eprintln!("layerstream up: {} worker(s), loader with {slots} slots; coordinator at {addr}; Ctrl-C stops everything", a.workers);
    loop {
        if let Some(sig) = wait_signal(&mut set, Duration::from_millis(200)) {
            eprintln!("layerstream up: signal {sig}, stopping");
            break;
        }
        if let Some((name, status)) = children
            .0
            .iter_mut()
            .find_map(|(n, c)| c.try_wait().ok().flatten().map(|s| (n.clone(), s)))
        {
            drop(children);
            clean_shm(&ns);
            bail!("{name} exited ({status}); stopped the rest");
        }
    }
    drop(children);
    clean_shm(&ns);
    Ok(())
}

/// Removes what a loader that died without cleaning up left in /dev/shm.
fn clean_shm(ns: &str) {
    let n = layerstream_proto::shm::remove_stale(ns);
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
