//! The coordinator: registers workers, plans layer ranges and residency, runs continuous batching
//! over the worker pipeline, and serves the public job API with per-job stats and traces.

pub mod error;
pub mod flags;
pub mod jobs;
pub mod pipeline;
pub mod planner;
pub mod scheduler;
pub mod service;
pub mod stats;

use clap::Args;
pub use error::{Error, Result};
pub use flags::{PlanFlags, SchedulerFlags};
use layerstream_model::Store;
use layerstream_proto::v1::coordinator_server::CoordinatorServer;
use layerstream_proto::v1::worker_client::WorkerClient;
use layerstream_proto::v1::{InfoRequest, Plan};
use std::path::PathBuf;
use std::sync::atomic::AtomicU64;
use std::sync::Arc;
use std::time::Duration;

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
    /// Seconds to wait for workers to come up.
    #[arg(long, env = "LAYERSTREAM_WORKER_WAIT", default_value_t = 60)]
    pub worker_wait_s: u64,
    /// OTLP gRPC endpoint for traces (off when unset).
    #[arg(long, env = "OTEL_EXPORTER_OTLP_ENDPOINT")]
    pub otlp_endpoint: Option<String>,
}

async fn info_with_retry(
    c: &mut WorkerClient<tonic::transport::Channel>,
    addr: &str,
    wait: Duration,
) -> Result<layerstream_proto::v1::InfoResponse> {
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

/// Registers the workers, plans, assigns, and serves until SIGINT/SIGTERM.
pub async fn run(args: CoordinatorArgs) -> Result<()> {
    let tracing_guard =
        layerstream_proto::telemetry::init_tracing(args.otlp_endpoint.as_deref(), "coordinator");
    let store = Store::open(&args.model)?;
    let tokenizer = Arc::new(store.tokenizer()?);
    let addrs = resolve_workers(
        &args.workers,
        args.expect_workers,
        Duration::from_secs(args.worker_wait_s),
    )
    .await?;
    let mut workers = Vec::new();
    for addr in &addrs {
        let mut c = WorkerClient::new(layerstream_proto::transport::channel(addr)?)
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
        workers.push((addr.clone(), info.device, info.memory_budget, c));
    }
    let specs: Vec<planner::WorkerSpec> =
        workers.iter().map(|w| planner::WorkerSpec { address: w.0.clone(), budget: w.2 }).collect();
    let opts = planner::PlanOptions {
        resident_layers: args.plan.resident_layers,
        group_size: args.plan.layer_group_size,
        buffers: args.plan.streaming_buffers,
        kv_capacity: args.plan.kv_capacity,
        prefetch: !args.plan.no_prefetch,
    };
    let plans = planner::plan(&store.manifest, &specs, &opts)?;
    let mut assignments = Vec::new();
    let mut step_tokens = args.sched.max_step_tokens.max(1);
    for ((addr, _, _, c), p) in workers.iter_mut().zip(&plans) {
        let a = p.clone();
        tracing::info!(worker = %addr, layers = ?(p.layer_start..p.layer_end), resident = ?p.resident, group = p.group_size, buffers = p.streaming_buffers, bytes = a.bytes_needed, prefetch = p.prefetch, "plan");
        let r = c
            .assign(a.clone())
            .await
            .map_err(|s| Error::Worker {
                worker: addr.clone(),
                msg: format!("refused its assignment: {}", s.message()),
            })?
            .into_inner();
        if r.max_step_tokens > 0 && (r.max_step_tokens as usize) < step_tokens {
            step_tokens = r.max_step_tokens as usize;
            tracing::info!(worker = %addr, max_step_tokens = step_tokens, "tokens per step limited by the worker's activation memory");
        }
        assignments.push(a);
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
    let pipeline = pipeline::Pipeline {
        workers: workers.iter().map(|w| (w.0.clone(), w.3.clone())).collect(),
        step_timeout: Duration::from_secs(args.sched.step_timeout_s),
    };
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
    };
    tokio::spawn(sched.run());
    let svc = service::CoordinatorService {
        jobs: jobs.clone(),
        queue,
        waiting,
        queue_size,
        tokenizer,
        vocab: store.manifest.config.vocab_size,
        context: store.manifest.config.max_position_embeddings,
        kv_capacity: args.plan.kv_capacity,
        plan: Plan { assignments, num_layers: store.manifest.config.num_layers as u32 },
        workers,
        next_seq: AtomicU64::new(1),
    };
    let listener = tokio::net::TcpListener::bind(&args.listen)
        .await
        .map_err(|source| Error::Bind { addr: args.listen.clone(), source })?;
    println!("LISTENING http://{}", listener.local_addr()?);
    tonic::transport::Server::builder()
        .add_service(
            layerstream_proto::transport::health::<CoordinatorServer<service::CoordinatorService>>(
            )
            .await,
        )
        .add_service(layerstream_proto::transport::reflection())
        .add_service(layerstream_proto::transport::reflection_v1alpha())
        .add_service(CoordinatorServer::new(svc))
        .serve_with_incoming_shutdown(
            layerstream_proto::transport::tcp_incoming(listener),
            layerstream_proto::transport::shutdown_signal(),
        )
        .await?;
    tracing_guard.flush();
    Ok(())
}
