//! The coordinator: registers workers, plans layer ranges and residency, runs continuous batching
//! over the worker pipeline, and serves the public job API with per-job stats and traces.

mod admit;
pub mod cost;
mod error;
mod flags;
mod formats;
mod http;
mod jobs;
mod journal;
mod lanes;
mod metrics;
mod pipeline;
mod planner;
mod scheduler;
mod seen;
mod service;
mod start;
mod stats;

use clap::Args;
pub use error::{Error, Result};
pub use flags::{HttpFlags, KvFlags, PlanFlags, SchedulerFlags, SpecFlags};
pub use lanes::MicroBatches;
pub use planner::plan_for;
pub use start::run;
use std::path::PathBuf;

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
    /// The cost model's decode pass seconds by batch (`rows:seconds,…`, as `layerstream plan`
    /// predicts them; `up` passes its own): each decode step's wall time is set beside it on the
    /// page and in `/api/stack`, and both are counted (`layerstream_decode_step_seconds_total`,
    /// `layerstream_decode_step_predicted_seconds_total`).
    #[arg(long, env = "LAYERSTREAM_PREDICTED_PASS")]
    pub predicted_pass: Option<cost::Curve>,
    /// With `dns://` workers: wait until at least this many addresses resolve.
    #[arg(long, env = "LAYERSTREAM_EXPECT_WORKERS", default_value_t = 1)]
    pub expect_workers: usize,
    #[command(flatten)]
    pub plan: PlanFlags,
    #[command(flatten)]
    pub sched: SchedulerFlags,
    #[command(flatten)]
    pub http: HttpFlags,
    #[command(flatten)]
    pub spec: SpecFlags,
    /// Most gRPC connections open at once on `--listen`; one more is closed as it is accepted. A
    /// connection that sends nothing for 30 s is closed.
    #[arg(long, env = "LAYERSTREAM_GRPC_MAX_CONNECTIONS", default_value_t = 1024)]
    pub grpc_max_connections: usize,
    /// Most connections one client address may hold open on each of the gRPC and HTTP ports
    /// (default: half of that port's cap), so one client cannot lock out the others.
    #[arg(long, env = "LAYERSTREAM_MAX_CONNECTIONS_PER_PEER")]
    pub max_connections_per_peer: Option<usize>,
    /// Journal every accepted job in this file (a redb database, created if absent): after a crash
    /// the coordinator resumes the jobs that did not finish, under their ids, and a client that
    /// resubmits with the same `idempotency-key` gets the same job. `up` keeps one per stack.
    #[arg(long, env = "LAYERSTREAM_JOURNAL")]
    pub journal: Option<PathBuf>,
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
    /// Read the API key from this file (its first line) instead: a key on the command line is
    /// readable by every local user in `/proc/<pid>/cmdline`.
    #[arg(long, env = "LAYERSTREAM_API_KEY_FILE")]
    pub api_key_file: Option<PathBuf>,
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

/// The tiny test models' tokenizer (SmolLM2's), for unit tests of what reads text.
#[cfg(test)]
pub(crate) fn test_tokenizer() -> std::sync::Arc<layerstream_model::Tokenizer> {
    let json = std::fs::read(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../tests/fixtures/models/tiny-llama/tokenizer.json"
    ))
    .unwrap();
    std::sync::Arc::new(layerstream_model::Tokenizer::from_json(&json, None, None, None).unwrap())
}
