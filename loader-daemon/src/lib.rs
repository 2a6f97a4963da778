//! The loader daemon: a fixed pool of POSIX shared-memory slots that layer files are read into
//! (O_DIRECT where possible), prefetched ahead of each worker's cyclic layer order, cached LRU while
//! slots allow, pinned while a worker copies, and unlinked at exit. Control is gRPC over a Unix socket;
//! data never goes over gRPC.

pub mod daemon;
pub mod error;
pub mod pool;
pub mod read;

use clap::Args;
pub use error::{Error, Result};
use layerstream_model::Store;
use layerstream_proto::v1::loader_server::LoaderServer;
use std::path::PathBuf;
use std::sync::Arc;

/// The slot pool's size and read-ahead (shared by `loader-daemon`, `up` and `bench`).
#[derive(Args, Debug, Clone, PartialEq)]
pub struct SlotFlags {
    /// Number of shm slots, each holding one layer file (default: 8 for a standalone loader; `up`
    /// sizes it for its workers' buffers and read-ahead).
    #[arg(long, alias = "loader-slots", env = "LAYERSTREAM_SLOTS")]
    pub slots: Option<usize>,
    /// Layers to read ahead of each worker's position.
    #[arg(long, env = "LAYERSTREAM_PREFETCH_DEPTH", default_value_t = 2)]
    pub prefetch_depth: usize,
}

impl SlotFlags {
    /// The same settings as command-line arguments (for a child loader).
    pub fn to_args(&self) -> Vec<String> {
        let mut a = vec!["--prefetch-depth".to_owned(), self.prefetch_depth.to_string()];
        if let Some(n) = self.slots {
            a.extend(["--slots".to_owned(), n.to_string()]);
        }
        a
    }
}

/// Flags of the loader daemon.
#[derive(Args, Debug, Clone)]
pub struct LoaderArgs {
    /// Layer store directory.
    #[arg(long, env = "LAYERSTREAM_MODEL")]
    pub model: PathBuf,
    /// Unix socket for the control gRPC service.
    #[arg(long, env = "LAYERSTREAM_LOADER_SOCKET", default_value = "/tmp/layerstream-loader.sock")]
    pub socket: PathBuf,
    /// Namespace of this instance's shm names (`/dev/shm/layerstream-<ns>-slot-NNN`); stale regions of
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
        layerstream_proto::telemetry::init_tracing(args.otlp_endpoint.as_deref(), "loader-daemon");
    let store = Store::open(&args.model)?;
    let slot_size = args.slot_size.unwrap_or(store.manifest.max_layer_bytes() as usize);
    let slots = args.pool.slots.unwrap_or(8);
    if slots == 0 || slot_size == 0 {
        return Err(Error::Config("--slots and --slot-size must be > 0".into()));
    }
    let daemon = Arc::new(daemon::Daemon::new(
        store,
        &args.namespace,
        slots,
        slot_size,
        args.pool.prefetch_depth,
    )?);
    tracing::info!(slots, slot_size = daemon.slot_size, ns = %args.namespace, direct_io = daemon.direct, "slot pool ready");
    let _ = std::fs::remove_file(&args.socket);
    let listener = tokio::net::UnixListener::bind(&args.socket)
        .map_err(|source| Error::Bind { path: args.socket.clone(), source })?;
    println!("LISTENING unix:{}", args.socket.display());
    let server = tonic::transport::Server::builder()
        .add_service(
            layerstream_proto::transport::health::<LoaderServer<daemon::LoaderService>>().await,
        )
        .add_service(layerstream_proto::transport::reflection())
        .add_service(layerstream_proto::transport::reflection_v1alpha())
        .add_service(LoaderServer::new(daemon::LoaderService(daemon.clone())))
        .serve_with_incoming_shutdown(
            tokio_stream::wrappers::UnixListenerStream::new(listener),
            layerstream_proto::transport::shutdown_signal(),
        );
    let res = server.await;
    let _ = std::fs::remove_file(&args.socket);
    drop(daemon);
    tracing::info!("loader stopped; shared memory unlinked");
    res.map_err(Into::into)
}
