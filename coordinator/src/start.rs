//! The coordinator's start, in its three steps: register the workers (resolve, connect, ask
//! each for its Info), plan over them and start the scheduler, then serve the job API (gRPC, and
//! HTTP when asked) until SIGINT/SIGTERM.

use crate::pipeline::{self, RegisteredWorker};
use crate::{http, jobs, metrics, planner, scheduler, service};
use crate::{CoordinatorArgs, Error, Result};
use layerstream_model::Store;
use layerstream_rpc::auth::{Bearer, RequireBearer};
use layerstream_rpc::handshake::Listening;
use layerstream_rpc::limits::Gate;
use layerstream_rpc::transport;
use layerstream_rpc::v1::coordinator_server::CoordinatorServer;
use layerstream_rpc::v1::worker_client::WorkerClient;
use layerstream_rpc::v1::{InfoRequest, Plan};
use std::sync::atomic::AtomicU64;
use std::sync::Arc;
use std::time::Duration;
use tonic::service::interceptor::InterceptedService;
use tonic::transport::{ClientTlsConfig, ServerTlsConfig};

/// A gRPC connection that sends nothing for this long is closed.
const GRPC_FIRST_BYTE: Duration = Duration::from_secs(30);

/// Registers the workers, plans, assigns, and serves until SIGINT/SIGTERM.
pub async fn run(args: CoordinatorArgs) -> Result<()> {
    let tracing_guard =
        layerstream_telemetry::init_tracing(args.otlp_endpoint.as_deref(), "coordinator");
    let store = Store::open(&args.model)?;
    let security = Security::from_args(&args)?;
    let workers = register(&args, &store, &security).await?;
    let svc = plan_and_schedule(&args, &store, workers).await?;
    if let Some(j) = &svc.journal {
        match j.unfinished() {
            Ok(jobs) => svc.resume(jobs).await,
            Err(e) => {
                tracing::error!(error = %e, "the journal cannot be read now; nothing resumed")
            }
        }
    }
    serve(&args, svc, security).await?;
    tracing_guard.flush();
    Ok(())
}

/// `--draft-model` checked against the target (vocabulary, size) and sized for the planner, when
/// `--spec` drafts with it (the head worker loads it beside its layers).
fn draft_model(args: &CoordinatorArgs, store: &Store) -> Result<Option<(String, u64)>> {
    let mode = args.spec.spec.resolve(args.spec.draft_model.is_some()).map_err(Error::Setup)?;
    match (&args.spec.draft_model, mode) {
        (Some(d), layerstream_serving::spec::SpecMode::Draft) => {
            let draft = Store::open(d)?;
            layerstream_serving::spec::check_draft(store, &draft)?;
            let positions = args.plan.kv_capacity.unwrap_or(planner::DEFAULT_KV_CAPACITY);
            let bytes = planner::draft_bytes(&draft.manifest, positions);
            let dir = std::fs::canonicalize(d).unwrap_or_else(|_| d.clone());
            Ok(Some((dir.display().to_string(), bytes)))
        }
        _ => Ok(None),
    }
}

/// Tokens and TLS, checked before anything connects.
struct Security {
    /// The internal token sent to workers.
    bearer: Bearer,
    /// The API key the job API requires (or not).
    api_guard: RequireBearer,
    tls: Option<ServerTlsConfig>,
    worker_tls: Option<ClientTlsConfig>,
}

impl Security {
    fn from_args(args: &CoordinatorArgs) -> Result<Self> {
        let argv: Vec<String> = std::env::args().collect();
        let api_keys = layerstream_rpc::auth::api_keys(
            args.api_key.as_deref(),
            args.api_key_file.as_deref(),
            &argv,
        )
        .map_err(Error::Setup)?;
        Ok(Security {
            bearer: Bearer::new(args.internal_token.as_deref())
                .map_err(|m| Error::Setup(format!("--internal-token: {m}")))?,
            api_guard: RequireBearer::keys(&api_keys, "API key")
                .map_err(|m| Error::Setup(format!("--api-key: {m}")))?,
            tls: transport::server_tls(args.tls_cert.as_deref(), args.tls_key.as_deref())
                .map_err(Error::Setup)?,
            worker_tls: transport::client_tls(args.tls_ca.as_deref())
                .map_err(|m| Error::Setup(format!("--tls-ca: {m}")))?,
        })
    }
}

/// Resolves `--worker`, connects to each and asks for its Info (retrying until `--worker-wait-s`);
/// a worker serving another model is refused.
async fn register(
    args: &CoordinatorArgs,
    store: &Store,
    security: &Security,
) -> Result<Vec<RegisteredWorker>> {
    let wait = Duration::from_secs(args.worker_wait_s);
    let addrs = resolve_workers(&args.workers, args.expect_workers, wait).await?;
    let mut workers = Vec::new();
    for addr in &addrs {
        let channel =
            security.bearer.clone().wrap(transport::channel(addr, security.worker_tls.as_ref())?);
        let mut c = WorkerClient::new(channel)
            .max_decoding_message_size(1 << 30)
            .max_encoding_message_size(1 << 30);
        let info = info_with_retry(&mut c, addr, wait).await?;
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
        workers.push(RegisteredWorker {
            spec: planner::WorkerSpec::new(
                addr.clone(),
                info.memory_budget,
                &info.device,
                info.exact,
                &args.plan.kv,
            ),
            device: info.device,
            host_id: info.host_id,
            conn: c,
        });
    }
    Ok(workers)
}

/// Slots of each worker's host-RAM KV tier: `--kv-host-bytes` (default a quarter of this host's
/// available memory) over what one KV block of every layer takes (f32 for `--kv-dtype auto`: the
/// most any worker stores); more than the host's memory is an error.
fn kv_host_blocks(args: &CoordinatorArgs, store: &Store) -> Result<u32> {
    let bytes =
        args.plan.kv_host_bytes.unwrap_or(layerstream_model::mem::host_available_bytes() / 4);
    if let Some(total) = layerstream_model::mem::host_total_bytes().filter(|&t| bytes > t) {
        return Err(Error::Setup(format!(
            "--kv-host-bytes {bytes} is more than this host's memory ({total} bytes)"
        )));
    }
    let m = &store.manifest;
    let dtype = layerstream_model::dtype::parse_kv_dtype(&args.plan.kv.dtype_for("cpu"))
        .map_err(Error::Setup)?;
    let per = layerstream_serving::plan::kv_bytes_per_token_layer(m, dtype)
        .saturating_mul(args.plan.kv.kv_block as u64)
        .saturating_mul(m.config.num_layers as u64);
    Ok((bytes / per.max(1)).min(u32::MAX as u64) as u32)
}

/// A pipeline planned over every registered worker and assigned, with what the plan settled.
struct Planned {
    pipeline: pipeline::Pipeline,
    /// The plan in force (shared with the job API).
    current: Arc<std::sync::RwLock<Plan>>,
    kv_capacity: usize,
    /// Tokens one step may carry: `--max-step-tokens`, or less where a worker's activation memory
    /// holds less.
    step_tokens: usize,
}

/// Sizes the KV cache to the workers' budgets (halving its dtype where `--kv-dtype auto` must),
/// plans over every worker and assigns them.
async fn plan_pipeline(
    args: &CoordinatorArgs,
    store: &Store,
    workers: &mut [RegisteredWorker],
) -> Result<Planned> {
    let mut opts = planner::PlanOptions {
        resident_layers: args.plan.resident_layers,
        group_size: args.plan.layer_group_size,
        buffers: args.plan.streaming_buffers,
        kv_capacity: planner::DEFAULT_KV_CAPACITY,
        prefetch: !args.plan.no_prefetch,
        expert_cache: args.plan.expert_cache,
        draft: draft_model(args, store)?,
        kv_block: args.plan.kv.kv_block,
        kv_host_blocks: kv_host_blocks(args, store)?,
    };
    let mut specs: Vec<_> = workers.iter().map(|w| w.spec.clone()).collect();
    planner::auto_kv_dtypes(&store.manifest, &mut specs, &opts);
    for (w, s) in workers.iter_mut().zip(&specs) {
        if w.spec.kv_dtype != s.kv_dtype {
            tracing::info!(worker = %s.address, kv_dtype = %s.kv_dtype, "KV dtype: its budget cannot keep every layer resident, so --kv-dtype auto halves the cache (--kv-dtype f32 keeps it)");
        }
        w.spec = s.clone();
    }
    let kv_capacity =
        planner::kv_capacity_that_fits(&store.manifest, &specs, &opts, args.plan.kv_capacity);
    if args.plan.kv_capacity.is_none() {
        tracing::info!(
            kv_capacity,
            "KV capacity: what the workers' budgets hold (--kv-capacity sets it)"
        );
    }
    opts.kv_capacity = kv_capacity;
    let num_layers = store.manifest.config.num_layers as u32;
    let current = Arc::new(std::sync::RwLock::new(Plan {
        assignments: vec![],
        num_layers,
        ..Default::default()
    }));
    let roster = pipeline::Roster {
        workers: workers.to_vec(),
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
    Ok(Planned { pipeline, current, kv_capacity, step_tokens })
}

/// Plans over every registered worker and assigns them, starts the scheduler on that pipeline,
/// and returns the job API's state.
async fn plan_and_schedule(
    args: &CoordinatorArgs,
    store: &Store,
    mut workers: Vec<RegisteredWorker>,
) -> Result<Arc<service::CoordinatorService>> {
    let planned = plan_pipeline(args, store, &mut workers).await?;
    let Planned { pipeline, current, kv_capacity, step_tokens } = planned;
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
    let metrics = Arc::new(metrics::Metrics::predicting(args.predicted_pass.clone()));
    let tokenizer = Arc::new(store.tokenizer()?);
    let journal =
        args.journal.as_deref().map(crate::journal::Journal::open).transpose()?.map(Arc::new);
    let limits = scheduler::Limits {
        max_batch: args.sched.max_batch.max(1),
        kv_capacity,
        max_step_tokens: step_tokens,
        kv_block: args.plan.kv.kv_block,
        host_blocks: kv_host_blocks(args, store)? as usize,
        prefix_cache: !args.plan.no_prefix_cache,
    };
    let core = scheduler::CoreParts {
        waiting_count: waiting.clone(),
        tokenizer: tokenizer.clone(),
        eos: store.manifest.config.eos_token_ids.clone(),
        limits,
        max_recoveries: args.sched.max_recoveries,
        metrics: metrics.clone(),
        spec: scheduler::SpecConfig {
            mode: args.spec.spec.resolve(args.spec.draft_model.is_some()).map_err(Error::Setup)?,
            max: args.spec.spec_max as usize,
            width: args.spec.spec_width as usize,
        },
    };
    let sched = scheduler::Scheduler::new(scheduler::SchedulerParts { rx, pipeline, core });
    tokio::spawn(sched.run());
    Ok(Arc::new(service::CoordinatorService {
        jobs,
        queue,
        waiting,
        queue_size,
        tokenizer,
        vocab: store.manifest.config.vocab_size,
        context: store.manifest.config.max_position_embeddings,
        kv_capacity,
        plan: current,
        workers,
        next_seq: AtomicU64::new(1),
        metrics,
        journal,
        keyed: std::sync::Mutex::new(()),
        eos: store.manifest.config.eos_token_ids.clone(),
        grammars: std::sync::OnceLock::new(),
        formats: crate::formats::FormatPool::for_host()
            .map_err(|e| Error::Setup(format!("starting the format compile threads: {e}")))?,
        cache_scope: args.sched.prefix_cache_scope,
    }))
}

/// Binds the gRPC (and `--http-listen`) ports, prints the start-up line, and serves the job API
/// until SIGINT/SIGTERM.
async fn serve(
    args: &CoordinatorArgs,
    svc: Arc<service::CoordinatorService>,
    security: Security,
) -> Result<()> {
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
        if !security.api_guard.enabled() && !addr.ip().is_loopback() {
            tracing::warn!(addr = %addr, "serving the job API on a non-loopback address without an API key");
            eprintln!("warning: the job API listens on {addr} without an API key: anyone who reaches it can submit, watch and cancel jobs (set --api-key or LAYERSTREAM_API_KEY)");
        }
    }
    let scheme = if security.tls.is_some() { "https" } else { "http" };
    let http_url = http_local.map(|a| format!("http://{a}"));
    Listening { addr: format!("{scheme}://{local}"), http: http_url }.announce();
    if let Some(l) = http {
        let model = args.http.served_model_name.clone().unwrap_or_else(|| store_name(&args.model));
        let h = Arc::new(http::Http {
            svc: svc.clone(),
            model,
            api_key: security.api_guard.clone(),
            cors: args.http.cors_allow_origin.clone(),
        });
        tracing::info!(addr = %l.local_addr()?, "OpenAI API, /metrics and the live page served over HTTP");
        let idle = Duration::from_secs(args.http.http_idle_timeout_s.max(1));
        let mut gate = Gate::new("HTTP", args.http.http_max_connections, idle);
        if let Some(n) = args.max_connections_per_peer {
            gate = gate.per_peer(n);
        }
        tokio::spawn(async move {
            if let Err(e) = http::serve(l, h, gate, idle, transport::shutdown_signal()).await {
                tracing::error!(error = %e, "the HTTP server stopped");
            }
        });
    }
    let mut grpc_gate = Gate::new("gRPC", args.grpc_max_connections, GRPC_FIRST_BYTE);
    if let Some(n) = args.max_connections_per_peer {
        grpc_gate = grpc_gate.per_peer(n);
    }
    let (_health, health_svc) =
        transport::health::<CoordinatorServer<service::CoordinatorService>>().await;
    let mut server = transport::server();
    if let Some(t) = security.tls {
        server = server.tls_config(t)?;
    }
    server
        .add_service(health_svc)
        .add_service(transport::reflection())
        .add_service(transport::reflection_v1alpha())
        .add_service(InterceptedService::new(CoordinatorServer::from_arc(svc), security.api_guard))
        .serve_with_incoming_shutdown(grpc_gate.incoming(listener), transport::shutdown_signal())
        .await?;
    Ok(())
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
