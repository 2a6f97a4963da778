//! The loader daemon: a fixed pool of POSIX shared-memory slots that layer files are read into
//! (O_DIRECT where possible), prefetched ahead of each worker's cyclic layer order, cached LRU while
//! slots allow, pinned while a worker copies, and unlinked at exit. Control is gRPC over a Unix socket;
//! data never goes over gRPC.

mod daemon;
mod error;
mod pool;
mod read;

use clap::Args;
pub use daemon::{Daemon, LoaderService};
pub use error::{Error, Result};
use layerstream_model::Store;
use layerstream_rpc::v1::loader_server::LoaderServer;
pub use pool::{check_shm_room, disk_reads_per_pass};
pub use read::{measure_disk, DiskFigures};
use std::path::PathBuf;
use std::sync::Arc;

/// The slot pool's size and read-ahead (shared by `loader-daemon`, `up` and `bench`).
#[derive(Args, Debug, Clone, PartialEq)]
pub struct SlotFlags {
    /// Number of shm slots, each holding one layer file. Default: the RAM tier holds what RAM can
    /// hold — every layer when half of the host's available memory (and of /dev/shm's free space)
    /// holds them, else as many as that half holds, and never fewer than 8 (`up`: its share of the
    /// memory ledger, never fewer than its workers pin at once and one to read ahead into). Setting
    /// it caps the pool.
    #[arg(long, alias = "loader-slots", env = "LAYERSTREAM_SLOTS")]
    pub slots: Option<usize>,
    /// Layers to read ahead of each worker's position. Default: `up` (and `plan`) choose it with
    /// the cost model — the disk's GB/s measured at 1 to 8 reads in flight against the RAM-tier
    /// layers each slot read into ahead takes — a loader started alone reads 2 ahead.
    #[arg(long, env = "LAYERSTREAM_PREFETCH_DEPTH")]
    pub prefetch_depth: Option<usize>,
    /// Read layer files through the page cache (dropping each file's pages once read) instead of
    /// O_DIRECT. Default: `up` (and `plan`) choose with the cost model, from both ways measured on
    /// this store's disk — GB/s and the CPU each read's copy costs the compute (a VM's virtual
    /// disk may serve the kernel's read-ahead faster than direct reads); a loader started alone
    /// reads O_DIRECT where the filesystem allows it.
    #[arg(long, env = "LAYERSTREAM_BUFFERED_READS", conflicts_with = "direct_reads")]
    pub buffered_reads: bool,
    /// Read layer files O_DIRECT even where the calibration measured the page cache faster on
    /// this disk (`up` and `plan` otherwise choose with the cost model, which also weighs the CPU
    /// a buffered read's copy takes from the compute). A loader started alone reads O_DIRECT
    /// anyway, where the filesystem allows it.
    #[arg(long, env = "LAYERSTREAM_DIRECT_READS")]
    pub direct_reads: bool,
    /// Skip the xxh3 check of weights where they enter memory (the loader's reads from disk, a
    /// worker's resident loads): for measuring the check's cost only, corrupt bytes then reach the
    /// compute.
    #[arg(long, env = "LAYERSTREAM_NO_VERIFY")]
    pub no_verify: bool,
    /// Check every read of a layer file from disk against the manifest's xxh3, not only the
    /// first read of each file and the first after it changes (its size, modification time or
    /// inode): a file corrupt at rest fails its first read either way; this also catches bytes a
    /// disk returns wrong without an error, at 0.1-0.2 s of CPU per GB streamed each pass.
    #[arg(long, env = "LAYERSTREAM_VERIFY_EVERY_READ", conflicts_with = "no_verify")]
    pub verify_every_read: bool,
}

impl SlotFlags {
    /// The same settings as command-line arguments (for a child loader).
    pub fn to_args(&self) -> Vec<String> {
        let mut a = Vec::new();
        if let Some(d) = self.prefetch_depth {
            a.extend(["--prefetch-depth".to_owned(), d.to_string()]);
        }
        if let Some(n) = self.slots {
            a.extend(["--slots".to_owned(), n.to_string()]);
        }
        if self.no_verify {
            a.push("--no-verify".to_owned());
        }
        if self.verify_every_read {
            a.push("--verify-every-read".to_owned());
        }
        if self.buffered_reads {
            a.push("--buffered-reads".to_owned());
        }
        if self.direct_reads {
            a.push("--direct-reads".to_owned());
        }
        a
    }
}

/// Layers a loader started alone reads ahead (`up` chooses with the cost model).
pub const DEFAULT_PREFETCH_DEPTH: usize = 2;

/// The default pool size: every one of `layers` files of `slot_size` bytes when half of what the
/// memory ledger allows (`mem::Ledger`: MemAvailable, the memory cgroup's room, /dev/shm's free
/// space) holds them (the other half is the stated margin left to workers and the rest of the
/// host), else as many as fit there, at least `floor`.
pub fn default_slots(layers: usize, slot_size: u64, floor: usize) -> usize {
    let room = layerstream_model::mem::Ledger::read().shm_usable() / 2;
    let fit = (room / slot_size.max(1)) as usize;
    fit.min(layers).max(floor)
}

/// Flags of the loader daemon.
#[derive(Args, Debug, Clone)]
pub struct LoaderArgs {
    /// Layer store directory.
    #[arg(long, env = "LAYERSTREAM_MODEL")]
    pub model: PathBuf,
    /// Unix socket for the control gRPC service (created mode 0600). Default: `loader.sock` in this
    /// user's private runtime directory (`$XDG_RUNTIME_DIR/layerstream`, else
    /// `<tmp>/layerstream-<uid>`, mode 0700).
    #[arg(long, env = "LAYERSTREAM_LOADER_SOCKET")]
    pub socket: Option<PathBuf>,
    /// Shared secret of the internal APIs, required from the workers that call this daemon (`up`
    /// generates one). Unset: none (the socket's 0600 mode still keeps other users out).
    #[arg(long, env = "LAYERSTREAM_INTERNAL_TOKEN", hide_env_values = true)]
    pub internal_token: Option<String>,
    /// Namespace of this instance's shm names (`/dev/shm/layerstream-<ns>-<instance>-slot-NNN`, a new instance id per start); stale regions of
    /// the same namespace are removed at start.
    #[arg(long, env = "LAYERSTREAM_SHM_NAMESPACE", default_value = "default")]
    pub namespace: String,
    #[command(flatten)]
    pub pool: SlotFlags,
    /// Bytes per slot; default: the store's largest layer file.
    #[arg(long, env = "LAYERSTREAM_SLOT_SIZE")]
    pub slot_size: Option<usize>,
    /// OTLP gRPC endpoint for traces (off when unset).
    #[arg(long, env = "OTEL_EXPORTER_OTLP_ENDPOINT")]
    pub otlp_endpoint: Option<String>,
}

/// Runs the daemon until SIGINT/SIGTERM; prints `LISTENING unix:<socket>` when ready.
pub async fn run(args: LoaderArgs) -> Result<()> {
    let _tracing =
        layerstream_telemetry::init_tracing(args.otlp_endpoint.as_deref(), "loader-daemon");
    let mut store = Store::open(&args.model)?;
    store.verify = !args.pool.no_verify;
    let slot_size = args.slot_size.unwrap_or(store.manifest.max_unit_bytes() as usize);
    let slots = args
        .pool
        .slots
        .unwrap_or_else(|| default_slots(store.manifest.config.num_layers, slot_size as u64, 8));
    if slots == 0 || slot_size == 0 {
        return Err(Error::Config("--slots and --slot-size must be > 0".into()));
    }
    let mut daemon = daemon::Daemon::new(
        store,
        &args.namespace,
        slots,
        slot_size,
        args.pool.prefetch_depth.unwrap_or(DEFAULT_PREFETCH_DEPTH),
    )?;
    daemon.direct &= !args.pool.buffered_reads;
    daemon.verify_every_read = args.pool.verify_every_read;
    let daemon = Arc::new(daemon);
    tracing::info!(slots, slot_size = daemon.slot_size, ns = %args.namespace, direct_io = daemon.direct, "slot pool ready");
    let socket = match &args.socket {
        Some(p) => p.clone(),
        None => layerstream_rpc::transport::default_loader_socket()
            .map_err(|source| Error::Bind { path: "the runtime directory".into(), source })?,
    };
    let guard =
        layerstream_rpc::auth::RequireBearer::new(args.internal_token.as_deref(), "internal token")
            .map_err(|m| Error::Config(format!("--internal-token: {m}")))?;
    let _ = std::fs::remove_file(&socket);
    // SAFETY: umask has no preconditions; the socket is created 0600 whatever the caller's umask
    // (the mode is set again below, for filesystems that ignore it at bind).
    let old_mask = unsafe { libc::umask(0o177) };
    let bound = tokio::net::UnixListener::bind(&socket);
    // SAFETY: as above, restoring the previous mask.
    unsafe { libc::umask(old_mask) };
    let listener = bound.map_err(|source| Error::Bind { path: socket.clone(), source })?;
    {
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&socket, std::fs::Permissions::from_mode(0o600))
            .map_err(|source| Error::Bind { path: socket.clone(), source })?;
    }
    layerstream_rpc::handshake::Listening::new(format!("unix:{}", socket.display())).announce();
    let (health, health_svc) =
        layerstream_rpc::transport::health::<LoaderServer<daemon::LoaderService>>().await;
    let server = layerstream_rpc::transport::server()
        .add_service(health_svc)
        .add_service(layerstream_rpc::transport::reflection())
        .add_service(layerstream_rpc::transport::reflection_v1alpha())
        .add_service(tonic::service::interceptor::InterceptedService::new(
            LoaderServer::new(daemon::LoaderService::new(daemon.clone(), health)),
            guard,
        ))
        .serve_with_incoming_shutdown(
            tokio_stream::wrappers::UnixListenerStream::new(listener),
            layerstream_rpc::transport::shutdown_signal(),
        );
    let res = server.await;
    let _ = std::fs::remove_file(&socket);
    drop(daemon);
    tracing::info!("loader stopped; shared memory unlinked");
    res.map_err(Into::into)
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::{CommandFactory, Parser};

    #[derive(Parser, Debug)]
    struct Cli {
        #[command(flatten)]
        pool: SlotFlags,
    }

    /// What `up` and `bench` pass on to a child loader parses back to the same settings, and every
    /// flag of the group is passed on when set (the two read modes exclude each other, as the two
    /// ways of checking do: one each run).
    #[test]
    fn slot_flags_round_trip() {
        let mut passed = Vec::new();
        for (mode, check) in
            [("--buffered-reads", "--no-verify"), ("--direct-reads", "--verify-every-read")]
        {
            let given =
                Cli::parse_from(["x", "--slots", "9", "--prefetch-depth", "4", check, mode]);
            let args = given.pool.to_args();
            let back = Cli::parse_from(std::iter::once("x".to_owned()).chain(args.clone()));
            assert_eq!(back.pool, given.pool);
            passed.extend(args);
        }
        for a in Cli::command().get_arguments() {
            if let Some(long) = a.get_long() {
                assert!(passed.contains(&format!("--{long}")), "--{long} is not passed on");
            }
        }
        let both = Cli::try_parse_from(["x", "--buffered-reads", "--direct-reads"]);
        assert!(both.is_err(), "one way of reading at a time");
        let both = Cli::try_parse_from(["x", "--no-verify", "--verify-every-read"]);
        assert!(both.is_err(), "no check and every read checked");
    }
}
