//! The worker process: flags, startup, and the gRPC server.

use crate::device::Device;
use crate::service::{WorkerService, WorkerState};
use clap::Args;
use layerstream_model::Store;
use layerstream_proto::v1::worker_server::WorkerServer;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};

/// Where a worker computes and how much memory it may use (shared by `worker`, `run`'s device, `up`
/// and `bench`, which pass it on with `to_args`).
#[derive(Args, Debug, Clone, PartialEq)]
pub struct DeviceFlags {
    /// Compute device: `cpu` (or `cuda:N` in a CUDA build).
    #[arg(long, env = "LAYERSTREAM_DEVICE", default_value = "cpu")]
    pub device: String,
    /// Bytes a worker may use for weights, streaming buffers and KV cache (suffixes K, M, G);
    /// default: what the device has available (host MemAvailable on the CPU, free memory on a GPU),
    /// less the GPU runtime reserve.
    #[arg(long, env = "LAYERSTREAM_MEMORY_BUDGET", value_parser = parse_bytes)]
    pub memory_budget: Option<u64>,
}

impl DeviceFlags {
    /// The same settings as command-line arguments (for a child worker).
    pub fn to_args(&self) -> Vec<String> {
        let mut a = vec!["--device".to_owned(), self.device.clone()];
        if let Some(b) = self.memory_budget {
            a.extend(["--memory-budget".to_owned(), b.to_string()]);
        }
        a
    }
}

/// Flags of a worker.
#[derive(Args, Debug, Clone)]
pub struct WorkerArgs {
    /// Layer store directory (the same one the loader daemon serves).
    #[arg(long, env = "LAYERSTREAM_MODEL")]
    pub model: PathBuf,
    /// Address to serve gRPC on (port 0 picks a free port; printed as `LISTENING http://…`).
    #[arg(long, env = "LAYERSTREAM_WORKER_LISTEN", default_value = "127.0.0.1:0")]
    pub listen: String,
    /// Address other processes use to reach this worker (default: the bound address).
    #[arg(long, env = "LAYERSTREAM_WORKER_ADVERTISE")]
    pub advertise: Option<String>,
    #[command(flatten)]
    pub device: DeviceFlags,
    /// Most tokens one step may carry (default: on a GPU, what the activation reserve holds for the
    /// model; no limit on the CPU). Reported to the coordinator, which splits prompts to stay under it.
    #[arg(long, env = "LAYERSTREAM_WORKER_MAX_STEP_TOKENS")]
    pub max_step_tokens: Option<usize>,
    /// The loader daemon's control socket.
    #[arg(long, env = "LAYERSTREAM_LOADER_SOCKET", default_value = "/tmp/layerstream-loader.sock")]
    pub loader_socket: PathBuf,
    /// OTLP gRPC endpoint for traces (off when unset).
    #[arg(long, env = "OTEL_EXPORTER_OTLP_ENDPOINT")]
    pub otlp_endpoint: Option<String>,
}

/// Parses "123", "64K", "512M", "8G" (powers of 1024).
pub fn parse_bytes(s: &str) -> Result<u64, String> {
    let s = s.trim();
    let (num, mul) = match s.chars().last() {
        Some('K' | 'k') => (&s[..s.len() - 1], 1u64 << 10),
        Some('M' | 'm') => (&s[..s.len() - 1], 1 << 20),
        Some('G' | 'g') => (&s[..s.len() - 1], 1 << 30),
        _ => (s, 1),
    };
    num.trim()
        .parse::<f64>()
        .map(|v| (v * mul as f64) as u64)
        .map_err(|_| format!("{s:?} is not a byte size (e.g. 512M, 8G)"))
}

/// Runs a worker until SIGINT/SIGTERM.
pub async fn run(args: WorkerArgs) -> crate::Result<()> {
    let _tracing =
        layerstream_proto::telemetry::init_tracing(args.otlp_endpoint.as_deref(), "worker");
    let backend = Device::open(&args.device.device)?;
    let budget = backend.budget(args.device.memory_budget)?;
    let free_at_start = match &backend {
        Device::Cuda(b) => Some(b.mem_info()?.0 as u64),
        Device::Cpu(_) => None,
    };
    let store = Store::open(&args.model)?;
    let device_limit = backend.step_token_limit(&store.manifest.config);
    // The smaller of the flag and what the device holds; None when neither limits it.
    let max_step_tokens =
        [args.max_step_tokens.map(|f| f.max(1)), device_limit].into_iter().flatten().min();
    let listener = tokio::net::TcpListener::bind(&args.listen)
        .await
        .map_err(|source| crate::Error::Bind { addr: args.listen.clone(), source })?;
    let addr = listener.local_addr()?;
    // Bound to every interface (containers): name ourselves by host name, which peers can resolve.
    let host = match std::env::var("HOSTNAME") {
        Ok(h) if addr.ip().is_unspecified() && !h.is_empty() => h,
        _ => addr.ip().to_string(),
    };
    let id = args.advertise.clone().unwrap_or_else(|| format!("http://{host}:{}", addr.port()));
    let state = Arc::new(WorkerState {
        id: id.clone(),
        device: args.device.device.clone(),
        backend,
        budget,
        max_step_tokens,
        free_at_start,
        store,
        loader_socket: args.loader_socket.clone(),
        stage: Arc::new(Mutex::new(None)),
        live: Default::default(),
    });
    println!("LISTENING {id}");
    tracing::info!(%id, device = %args.device.device, budget, max_step_tokens = ?max_step_tokens, "worker ready");
    tonic::transport::Server::builder()
        .add_service(layerstream_proto::transport::health::<WorkerServer<WorkerService>>().await)
        .add_service(layerstream_proto::transport::reflection())
        .add_service(layerstream_proto::transport::reflection_v1alpha())
        .add_service(
            WorkerServer::new(WorkerService(state))
                .max_decoding_message_size(1 << 30)
                .max_encoding_message_size(1 << 30),
        )
        .serve_with_incoming_shutdown(
            layerstream_proto::transport::tcp_incoming(listener),
            layerstream_proto::transport::shutdown_signal(),
        )
        .await?;
    Ok(())
}
