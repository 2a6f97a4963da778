//! The coordinator: registers workers, plans layer ranges and residency, runs continuous batching
//! over the worker pipeline, and serves the public job API with per-job stats and traces.

pub mod error;
pub mod flags;
pub mod http;
pub mod jobs;
pub mod lanes;
pub mod metrics;
pub mod pipeline;
pub mod planner;
pub mod scheduler;
pub mod service;
pub mod stats;

use clap::Args;
pub use error::{Error, Result};
pub use flags::{HttpFlags, PlanFlags, SchedulerFlags};
use layerstream_model::Store;
use layerstream_rpc::auth::{Bearer, RequireBearer};
use layerstream_rpc::v1::coordinator_server::CoordinatorServer;
use layerstream_rpc::v1::worker_client::WorkerClient;
use layerstream_rpc::v1::{InfoRequest, Plan};
use std::path::PathBuf;
use std::sync::atomic::AtomicU64;
use std::sync::Arc;
use std::time::Duration;
use tonic::service::interceptor::InterceptedService;

/// Flags of the coordinator.
#[derive(Args, Debug, Clone)]
pub struct CoordinatorArgs {
    /// Layer store directory (tokenizer, chat template, layer sizes for planning).
    #[arg(long, env = "LAYERSTREAM_MODEL")]
    pub model: PathBuf,
    /// Address to serve the public gRPC API on (port 0 picks one; printed as `LISTENING http://…`).
    #[arg(long, env = "LAYERSTREAM_LISTEN", default_value = "127.0.0.1:50051")]
    pub listen: String,
    /// Worker addresses in pipeline order (repeat, or comma-separate). `dns://name:port` expands to
    /// every address the name resolves to (e.g. the replicas of a compose service), sorted.
    #[arg(long = "worker", env = "LAYERSTREAM_WORKERS", value_delimiter = ',', required = true)]
    pub workers: Vec<String>,
    /// With `dns://` workers: wait until at least this many addresses resolve.
    #[arg(long, env = "LAYERSTREAM_EXPECT_WORKERS", default_value_t = 1)]
    pub expect_workers: usize,
    #[command(flatten)]
    pub plan: PlanFlags,
    #[command(flatten)]
    pub sched: SchedulerFlags,
    #[command(flatten)]
    pub http: HttpFlags,
    /// Seconds to wait for workers to come up.
    #[arg(long, env = "LAYERSTREAM_WORKER_WAIT", default_value_t = 60)]
    pub worker_wait_s: u64,
    /// OTLP gRPC endpoint for traces (off when unset).
    #[arg(long, env = "OTEL_EXPORTER_OTLP_ENDPOINT")]
    pub otlp_endpoint: Option<String>,
    /// API key of the public job API: clients send `authorization: Bearer <key>` (gRPC metadata);
    /// calls without it get UNAUTHENTICATED. Unset: no key (health and reflection are always open).
    #[arg(long, env = "LAYERSTREAM_API_KEY", hide_env_values = true)]
    pub api_key: Option<String>,
    /// Shared secret sent to the workers' internal API (`up` generates one).
    #[arg(long, env = "LAYERSTREAM_INTERNAL_TOKEN", hide_env_values = true)]
    pub internal_token: Option<String>,
    /// Serve the job API over TLS with this PEM certificate chain (with `--tls-key`).
    #[arg(long, env = "LAYERSTREAM_TLS_CERT", requires = "tls_key")]
    pub tls_cert: Option<PathBuf>,
    /// The PEM private key of `--tls-cert`.
    #[arg(long, env = "LAYERSTREAM_TLS_KEY", requires = "tls_cert")]
    pub tls_key: Option<PathBuf>,
    /// PEM CA certificate to trust for `https://` workers (workers started with `--tls-cert`).
    #[arg(long, env = "LAYERSTREAM_TLS_CA")]
    pub tls_ca: Option<PathBuf>,
}

async fn info_with_retry(
    c: &mut pipeline::WorkerConn,
    addr: &str,
    wait: Duration,
) -> Result<layerstream_rpc::v1::InfoResponse> {
    let deadline = tokio::time::Instant::now() + wait;
    loop {
        match c.info(InfoRequest {}).await {
            Ok(r) => return Ok(r.into_inner()),
            Err(e) if tokio::time::Instant::now() < deadline => {
                tracing::debug!(worker = addr, error = %e, "worker not ready yet");
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
            Err(e) => {
                return Err(Error::Worker {
                    worker: addr.into(),
                    msg: format!("unreachable: {}", e.message()),
                })
            }
        }
    }
}

/// Expands `dns://host:port` entries into `http://ip:port` for every resolved address.
async fn resolve_workers(list: &[String], expect: usize, wait: Duration) -> Result<Vec<String>> {
    let deadline = tokio::time::Instant::now() + wait;
    loop {
        let mut out = Vec::new();
        for w in list {
            match w.strip_prefix("dns://") {
                Some(hostport) => {
                    let mut ips: Vec<std::net::SocketAddr> = tokio::net::lookup_host(hostport)
                        .await
                        .map(|i| i.collect())
                        .unwrap_or_default();
                    ips.sort();
                    ips.dedup();
                    out.extend(ips.into_iter().map(|a| format!("http://{a}")));
                }
                None => out.push(w.clone()),
            }
        }
        if out.len() >= expect.max(1) {
            return Ok(out);
        }
        if tokio::time::Instant::now() >= deadline {
            return Err(Error::Setup(format!(
                "found {} worker address(es) from {list:?}, expected {expect}",
                out.len()
            )));
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}

/// The model id the HTTP API serves by default: the store directory's name.
fn store_name(dir: &std::path::Path) -> String {
    let dir = dir.canonicalize().unwrap_or_else(|_| dir.to_path_buf());
    dir.file_name().map_or_else(|| "layerstream".into(), |n| n.to_string_lossy().into_owned())
}

/// Registers the workers, plans, assigns, and serves until SIGINT/SIGTERM.
pub async fn run(args: CoordinatorArgs) -> Result<()> {
    let tracing_guard =
        layerstream_telemetry::init_tracing(args.otlp_endpoint.as_deref(), "coordinator");
    let store = Store::open(&args.model)?;
    let tokenizer = Arc::new(store.tokenizer()?);
    let addrs = resolve_workers(
        &args.workers,
        args.expect_workers,
        Duration::from_secs(args.worker_wait_s),
    )
    .await?;
    let bearer = Bearer::new(args.internal_token.as_deref())
        .map_err(|m| Error::Setup(format!("--internal-token: {m}")))?;
    let api_guard = RequireBearer::new(args.api_key.as_deref(), "API key")
        .map_err(|m| Error::Setup(format!("--api-key: {m}")))?;
    let tls =
        layerstream_rpc::transport::server_tls(args.tls_cert.as_deref(), args.tls_key.as_deref())
            .map_err(Error::Setup)?;
    let worker_tls = layerstream_rpc::transport::client_tls(args.tls_ca.as_deref())
        .map_err(|m| Error::Setup(format!("--tls-ca: {m}")))?;
    let mut workers = Vec::new();
    for addr in &addrs {
        let channel =
            bearer.clone().wrap(layerstream_rpc::transport::channel(addr, worker_tls.as_ref())?);
        let mut c = WorkerClient::new(channel)
            .max_decoding_message_size(1 << 30)
            .max_encoding_message_size(1 << 30);
        let info = info_with_retry(&mut c, addr, Duration::from_secs(args.worker_wait_s)).await?;
        if info.num_layers as usize != store.manifest.config.num_layers {
            return Err(Error::Worker {
                worker: addr.clone(),
                msg: format!(
                    "serves a model with {} layers, the coordinator's store has {}",
                    info.num_layers, store.manifest.config.num_layers
                ),
            });
        }
        tracing::info!(worker = %addr, device = %info.device, budget = info.memory_budget, "worker registered");
        workers.push((addr.clone(), info.device, info.memory_budget, c, info.host_id));
    }
    let opts = planner::PlanOptions {
        resident_layers: args.plan.resident_layers,
        group_size: args.plan.layer_group_size,
        buffers: args.plan.streaming_buffers,
        kv_capacity: args.plan.kv_capacity,
        prefetch: !args.plan.no_prefetch,
        expert_cache: args.plan.expert_cache,
    };
    let num_layers = store.manifest.config.num_layers as u32;
    let current = Arc::new(std::sync::RwLock::new(Plan {
        assignments: vec![],
        num_layers,
        ..Default::default()
    }));
    let roster = pipeline::Roster {
        workers: workers
            .iter()
            .map(|w| (planner::WorkerSpec { address: w.0.clone(), budget: w.2 }, w.3.clone()))
            .collect(),
        hosts: workers.iter().map(|w| w.4.clone()).collect(),
        manifest: store.manifest.clone(),
        opts,
        current: current.clone(),
        micro_batches: args.sched.micro_batches,
    };
    let mut pipeline = pipeline::Pipeline {
        stages: Vec::new(),
        deadline: pipeline::Deadline::new(args.sched.step_timeout_s.map(Duration::from_secs)),
        roster,
        locks: Arc::new([]),
        micro_batches: 1,
        shm_handoff: !args.sched.hidden_over_grpc,
    };
    let all: Vec<usize> = (0..workers.len()).collect();
    let mut step_tokens = args.sched.max_step_tokens.max(1);
    let limit = pipeline.plan_over(&all).await?;
    if limit > 0 && limit < step_tokens {
        step_tokens = limit;
        tracing::info!(
            max_step_tokens = step_tokens,
            "tokens per step limited by a worker's activation memory"
        );
    }
    let jobs = jobs::Jobs::new(
        Duration::from_secs(args.sched.job_retention_s),
        args.sched.max_job_records,
    );
    // Expired records also go when no new job arrives to sweep them.
    let sweeper = jobs.clone();
    tokio::spawn(async move {
        loop {
            tokio::time::sleep(Duration::from_secs(10)).await;
            sweeper.sweep();
        }
    });
    let queue_size = args.sched.queue_size.max(1);
    let (queue, rx) = tokio::sync::mpsc::channel(queue_size);
    let waiting = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let metrics = Arc::new(metrics::Metrics::new());
    let sched = scheduler::Scheduler {
        rx,
        pipeline,
        waiting_count: waiting.clone(),
        tokenizer: tokenizer.clone(),
        eos: store.manifest.config.eos_token_ids.clone(),
        limits: scheduler::Limits {
            max_batch: args.sched.max_batch.max(1),
            kv_capacity: args.plan.kv_capacity,
            max_step_tokens: step_tokens,
        },
        max_recoveries: args.sched.max_recoveries,
        failures: 0,
        resync: false,
        metrics: metrics.clone(),
    };
    tokio::spawn(sched.run());
    let svc = Arc::new(service::CoordinatorService {
        jobs: jobs.clone(),
        queue,
        waiting,
        queue_size,
        tokenizer,
        vocab: store.manifest.config.vocab_size,
        context: store.manifest.config.max_position_embeddings,
        kv_capacity: args.plan.kv_capacity,
        plan: current,
        workers: workers.into_iter().map(|w| (w.0, w.1, w.2, w.3)).collect(),
        next_seq: AtomicU64::new(1),
        metrics,
    });
    let listener = tokio::net::TcpListener::bind(&args.listen)
        .await
        .map_err(|source| Error::Bind { addr: args.listen.clone(), source })?;
    let local = listener.local_addr()?;
    let http =
        match args.http.listen() {
            Some(addr) => Some(tokio::net::TcpListener::bind(addr).await.map_err(|source| {
                Error::Bind { addr: format!("{addr} (--http-listen)"), source }
            })?),
            None => None,
        };
    let http_local = http.as_ref().map(|l| l.local_addr()).transpose()?;
    for addr in std::iter::once(local).chain(http_local) {
        if !api_guard.enabled() && !addr.ip().is_loopback() {
            tracing::warn!(addr = %addr, "serving the job API on a non-loopback address without an API key");
            eprintln!("warning: the job API listens on {addr} without an API key: anyone who reaches it can submit, watch and cancel jobs (set --api-key or LAYERSTREAM_API_KEY)");
        }
    }
    let http_note = http_local.map_or(String::new(), |a| format!(" http=http://{a}"));
    println!("LISTENING {}://{local}{http_note}", if tls.is_some() { "https" } else { "http" });
    if let Some(l) = http {
        let model = args.http.served_model_name.clone().unwrap_or_else(|| store_name(&args.model));
        let h = Arc::new(http::Http {
            svc: svc.clone(),
            model,
            api_key: api_guard.clone(),
            cors: args.http.cors_allow_origin.clone(),
        });
        tracing::info!(addr = %l.local_addr()?, "OpenAI API, /metrics and the live page served over HTTP");
        tokio::spawn(async move {
            if let Err(e) = http::serve(l, h, layerstream_rpc::transport::shutdown_signal()).await {
                tracing::error!(error = %e, "the HTTP server stopped");
            }
        });
    }
    let (_health, health_svc) =
        layerstream_rpc::transport::health::<CoordinatorServer<service::CoordinatorService>>()
            .await;
    let mut server = tonic::transport::Server::builder();
    if let Some(t) = tls {
        server = server.tls_config(t)?;
    }
    server
        .add_service(health_svc)
        .add_service(layerstream_rpc::transport::reflection())
        .add_service(layerstream_rpc::transport::reflection_v1alpha())
        .add_service(InterceptedService::new(CoordinatorServer::from_arc(svc), api_guard))
        .serve_with_incoming_shutdown(
            layerstream_rpc::transport::tcp_incoming(listener),
            layerstream_rpc::transport::shutdown_signal(),
        )
        .await?;
    tracing_guard.flush();
    Ok(())
}
