//! The worker process: flags, startup, and the gRPC server.

use crate::device::Device;
use crate::service::{WorkerService, WorkerState};
use clap::Args;
use layerstream_model::Store;
use layerstream_rpc::auth::{Bearer, RequireBearer};
use layerstream_rpc::limits::Gate;
use layerstream_rpc::v1::worker_server::WorkerServer;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use tonic::service::interceptor::InterceptedService;

/// Connections a worker serves at once (its clients are coordinators and probes).
const MAX_CONNECTIONS: usize = 1024;
/// A connection that sends nothing for this long is closed.
const FIRST_BYTE: std::time::Duration = std::time::Duration::from_secs(30);

/// Where a process computes and at what precision: shared by a worker's `DeviceFlags`, `run` and
/// `perplexity`.
#[derive(Args, Debug, Clone, PartialEq)]
pub struct ComputeFlags {
    /// Compute device: `cpu` (or `cuda:N` in a CUDA build). `up` and `bench` also take a
    /// comma-separated list, given to their workers in turn (`cuda:0,cpu`: a GPU and a CPU worker).
    #[arg(long, env = "LAYERSTREAM_DEVICE", default_value = "cpu")]
    pub device: String,
    /// Compute threads on the CPU (default: every core; `up --threads N` passes it to every
    /// worker).
    #[arg(long, env = "LAYERSTREAM_THREADS")]
    pub threads: Option<usize>,
    /// 8-bit activations in decode and short steps, as llama.cpp computes — the CPU's default (see
    /// `--exact`); on a GPU only with this flag: CPU for Q8_0/Q4_0/Q4_1/Q5_0/Q5_1/Q4_K/Q6_K/MXFP4
    /// and int8_b128/int4_g128 weights, CUDA for Q8_0/Q4_0/Q4_1/Q4_K/Q6_K. Takes precedence over
    /// `--exact`.
    #[arg(long, env = "LAYERSTREAM_INT8_ACTIVATIONS")]
    pub int8_activations: bool,
    /// f32 activations everywhere: tokens reproduce transformers. Without it the CPU multiplies
    /// quantized weights by 8-bit activations in every step, the vocabulary projection excepted
    /// (faster, and as independent of what a sequence is batched with; measured +0.21% perplexity
    /// on SmolLM2 Q4_1, +0.26% on Gemma 3 270M Q4_K_M).
    #[arg(long, env = "LAYERSTREAM_EXACT")]
    pub exact: bool,
}

impl ComputeFlags {
    /// Whether this process uses 8-bit activations (`int8_by_default`).
    pub fn int8(&self) -> bool {
        int8_by_default(&self.device, self.int8_activations, self.exact)
    }

    /// The decoder layers' activations these flags ask for (`int8`), handed to every model and
    /// stage this process loads.
    pub fn precision(&self) -> layerstream_kernels::Precision {
        match self.int8() {
            true => layerstream_kernels::Precision::Int8,
            false => layerstream_kernels::Precision::F32,
        }
    }

    /// Sizes this process's CPU compute pool from `--threads`, before any kernel runs, and keeps
    /// its steps' buffers in the heap (`cpu::heap`).
    pub fn apply_threads(&self) -> crate::Result<()> {
        layerstream_kernels::cpu::heap::keep_step_buffers();
        match self.threads {
            Some(n) => Ok(layerstream_kernels::cpu::threads::set_cpu_threads(n)?),
            None => Ok(()),
        }
    }

    /// The same settings as command-line arguments (for a child process).
    pub fn to_args(&self) -> Vec<String> {
        let mut a = vec!["--device".to_owned(), self.device.clone()];
        if let Some(t) = self.threads {
            a.extend(["--threads".to_owned(), t.to_string()]);
        }
        if self.int8_activations {
            a.push("--int8-activations".into());
        }
        if self.exact {
            a.push("--exact".into());
        }
        a
    }
}

/// Where a worker computes and how much memory it may use (shared by `worker`, `up` and `bench`,
/// which pass it on with `to_args`).
#[derive(Args, Debug, Clone, PartialEq)]
pub struct DeviceFlags {
    #[command(flatten)]
    pub compute: ComputeFlags,
    /// Bytes a worker may use for weights, streaming buffers and KV cache (suffixes K, M, G);
    /// default: what the device has available — on the CPU what the memory ledger allows (the
    /// least of MemAvailable and the memory cgroup's limit less its usage; `up` gives each worker
    /// its share), on a GPU its free memory less the runtime reserve.
    #[arg(long, env = "LAYERSTREAM_MEMORY_BUDGET", value_parser = parse_bytes)]
    pub memory_budget: Option<u64>,
    /// Compute threads of a CPU worker while micro-batches keep every worker of its pipeline
    /// computing at once (default: as --threads); `up` sets cores ÷ workers for its CPU workers.
    #[arg(long, env = "LAYERSTREAM_CONCURRENT_THREADS")]
    pub concurrent_threads: Option<usize>,
    /// Simulates a slower link: every streamed layer copy takes at least its bytes ÷ this many GB/s
    /// (the copy thread waits out the rest). For measuring the link-bound regime on a machine whose
    /// own copies are faster (speculative decoding's benchmark); off by default.
    #[arg(long, env = "LAYERSTREAM_LINK_GBPS")]
    pub link_gbps: Option<f64>,
}

impl DeviceFlags {
    /// The same settings as command-line arguments (for a child worker).
    pub fn to_args(&self) -> Vec<String> {
        let mut a = self.compute.to_args();
        if let Some(b) = self.memory_budget {
            a.extend(["--memory-budget".to_owned(), b.to_string()]);
        }
        if let Some(t) = self.concurrent_threads {
            a.extend(["--concurrent-threads".to_owned(), t.to_string()]);
        }
        if let Some(g) = self.link_gbps {
            a.extend(["--link-gbps".to_owned(), g.to_string()]);
        }
        a
    }

    /// `ComputeFlags::apply_threads`, and the simulated link's speed.
    pub fn apply_threads(&self) -> crate::Result<()> {
        if let Some(g) = self.link_gbps {
            crate::prefetch::set_link_gbps(g).map_err(|m| crate::Error::invalid("link_gbps", m))?;
        }
        self.compute.apply_threads()
    }
}

/// Whether a process on `device` uses 8-bit activations: asked for (`--int8-activations`), or on
/// the CPU unless `--exact` — its default, as llama.cpp's, where the measured perplexity cost is at
/// most 0.5% (docs/kv-cache.md, benchmarks/kv-cache-cpu-2core.md).
pub fn int8_by_default(device: &str, int8_activations: bool, exact: bool) -> bool {
    int8_activations || (device == "cpu" && !exact)
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
    /// Skip the checksum check of resident weights and of embedding/head files (for measuring its
    /// cost only).
    #[arg(long, env = "LAYERSTREAM_NO_VERIFY")]
    pub no_verify: bool,
    /// The loader daemon's control socket (default: `loader.sock` in this user's private runtime
    /// directory, as the loader's own default).
    #[arg(long, env = "LAYERSTREAM_LOADER_SOCKET")]
    pub loader_socket: Option<PathBuf>,
    /// Shared secret of the internal APIs: required from callers of this worker and sent to the
    /// loader (`up` generates one; compose and k8s take it from a variable or Secret). Unset: none.
    #[arg(long, env = "LAYERSTREAM_INTERNAL_TOKEN", hide_env_values = true)]
    pub internal_token: Option<String>,
    /// Serve over TLS with this PEM certificate chain (with `--tls-key`; the coordinator then
    /// reaches it as `https://…` and trusts its CA with `--tls-ca`).
    #[arg(long, env = "LAYERSTREAM_WORKER_TLS_CERT", requires = "tls_key")]
    pub tls_cert: Option<PathBuf>,
    /// The PEM private key of `--tls-cert`.
    #[arg(long, env = "LAYERSTREAM_WORKER_TLS_KEY", requires = "tls_cert")]
    pub tls_key: Option<PathBuf>,
    /// OTLP gRPC endpoint for traces (off when unset).
    #[arg(long, env = "OTEL_EXPORTER_OTLP_ENDPOINT")]
    pub otlp_endpoint: Option<String>,
}

pub use layerstream_model::mem::parse_bytes;

/// Runs a worker until SIGINT/SIGTERM.
pub async fn run(args: WorkerArgs) -> crate::Result<()> {
    let _tracing = layerstream_telemetry::init_tracing(args.otlp_endpoint.as_deref(), "worker");
    args.device.apply_threads()?;
    layerstream_kernels::cpu::isa::cap().map_err(crate::Error::Config)?;
    let backend = Device::open(&args.device.compute.device)?;
    let budget = backend.budget(args.device.memory_budget)?;
    let free_at_start = match &backend {
        Device::Cuda(b) => Some(b.mem_info()?.0 as u64),
        Device::Cpu(_) => None,
    };
    let mut store = Store::open(&args.model)?;
    store.verify = !args.no_verify;
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
    let tls =
        layerstream_rpc::transport::server_tls(args.tls_cert.as_deref(), args.tls_key.as_deref())
            .map_err(|m| crate::Error::Config(format!("TLS: {m}")))?;
    let scheme = if tls.is_some() { "https" } else { "http" };
    let id = args.advertise.clone().unwrap_or_else(|| format!("{scheme}://{host}:{}", addr.port()));
    let loader_socket = match &args.loader_socket {
        Some(p) => p.clone(),
        None => layerstream_rpc::transport::default_loader_socket()?,
    };
    let token = args.internal_token.as_deref();
    let guard = RequireBearer::new(token, "internal token")
        .map_err(|m| crate::Error::Config(format!("--internal-token: {m}")))?;
    let bearer =
        Bearer::new(token).map_err(|m| crate::Error::Config(format!("--internal-token: {m}")))?;
    if !guard.enabled() && !addr.ip().is_loopback() {
        tracing::warn!(%addr, "serving the worker API on a non-loopback address without --internal-token: anyone who reaches it can run steps");
        eprintln!("warning: worker listening on {addr} without an internal token (LAYERSTREAM_INTERNAL_TOKEN)");
    }
    let (health, health_svc) =
        layerstream_rpc::transport::health::<WorkerServer<WorkerService>>().await;
    let concurrent = match args.device.concurrent_threads {
        Some(n) if n != layerstream_kernels::cpu::threads::cpu_threads() => {
            Some(layerstream_kernels::cpu::threads::ComputePool::new(n)?)
        }
        _ => None,
    };
    let state = Arc::new(WorkerState {
        id: id.clone(),
        device: args.device.compute.device.clone(),
        precision: args.device.compute.precision(),
        backend,
        budget,
        max_step_tokens,
        free_at_start,
        store,
        loader_socket,
        loader_bearer: bearer,
        health,
        stage: Arc::new(Mutex::new(None)),
        live: Default::default(),
        assignment_id: Default::default(),
        concurrent,
        handoff: crate::handoff::Handoff::new(),
        host_id: crate::handoff::host_id(),
    });
    layerstream_rpc::handshake::Listening::new(id.clone()).announce();
    let threads = layerstream_kernels::cpu::threads::cpu_threads();
    let concurrent_threads = args.device.concurrent_threads.unwrap_or(threads);
    tracing::info!(%id, device = %args.device.compute.device, budget, max_step_tokens = ?max_step_tokens, threads, concurrent_threads, "worker ready");
    let mut server = layerstream_rpc::transport::server();
    if let Some(t) = tls {
        server = server.tls_config(t)?;
    }
    server
        .add_service(health_svc)
        .add_service(layerstream_rpc::transport::reflection())
        .add_service(layerstream_rpc::transport::reflection_v1alpha())
        .add_service(InterceptedService::new(
            WorkerServer::new(WorkerService(state.clone()))
                .max_decoding_message_size(1 << 30)
                .max_encoding_message_size(1 << 30),
            guard,
        ))
        .serve_with_incoming_shutdown(
            Gate::new("gRPC", MAX_CONNECTIONS, FIRST_BYTE).incoming(listener),
            layerstream_rpc::transport::shutdown_signal(),
        )
        .await?;
    // Whatever still holds the state, the hand-off regions go now, and the stage (an expert cache
    // saves its usage history as it goes).
    state.handoff.clear();
    let stage = state.stage.lock().map(|mut s| s.take());
    drop(stage);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::{CommandFactory, Parser};

    #[derive(Parser, Debug)]
    struct Cli {
        #[command(flatten)]
        device: DeviceFlags,
    }

    /// What `up` and `bench` pass on to a child worker parses back to the same settings, and every
    /// flag of the group is passed on when set.
    #[test]
    fn device_flags_round_trip() {
        let given = Cli::parse_from([
            "x",
            "--device",
            "cuda:1",
            "--memory-budget",
            "5G",
            "--threads",
            "3",
            "--concurrent-threads",
            "2",
            "--int8-activations",
            "--exact",
            "--link-gbps",
            "1.5",
        ]);
        let args = given.device.to_args();
        for a in Cli::command().get_arguments() {
            if let Some(long) = a.get_long() {
                assert!(args.contains(&format!("--{long}")), "--{long} is not passed on");
            }
        }
        let back = Cli::parse_from(std::iter::once("x".to_owned()).chain(args));
        assert_eq!(back.device, given.device);
        assert_eq!(Cli::parse_from(["x"]).device.to_args(), ["--device", "cpu"]);
    }
}
