//! Flag groups shared by every command that plans or schedules (`coordinator`, `up`, `bench`):
//! declared once here with their environment variables, flattened into each command, and passed on
//! to a child coordinator by `to_args` so `up` never re-declares them.

use clap::Args;

/// How the planner lays layers over the workers.
#[derive(Args, Debug, Clone, PartialEq)]
pub struct PlanFlags {
    /// Resident layers per worker (the rest are streamed); default: as many as each worker's memory
    /// budget allows.
    #[arg(long, env = "LAYERSTREAM_RESIDENT_LAYERS")]
    pub resident_layers: Option<usize>,
    /// Streamed layers move in groups of this many (one buffer per layer of a group).
    #[arg(long, env = "LAYERSTREAM_LAYER_GROUP_SIZE", default_value_t = 1)]
    pub layer_group_size: usize,
    /// Streaming buffers per worker (groups in flight: one computing, the rest loading).
    #[arg(long, env = "LAYERSTREAM_STREAMING_BUFFERS", default_value_t = 2)]
    pub streaming_buffers: usize,
    /// Copy layers synchronously instead of overlapping them with compute (for comparison).
    #[arg(long, env = "LAYERSTREAM_NO_PREFETCH")]
    pub no_prefetch: bool,
    /// KV cache positions per worker (on every layer of its range), in blocks of `--kv-block`
    /// shared by all sequences: each takes blocks as it grows; a request longer than this is
    /// refused. Default: the model's context, at most 8192, halved (to 256 at least) until every
    /// worker's memory budget holds a streaming plan with it.
    #[arg(long, env = "LAYERSTREAM_KV_CAPACITY")]
    pub kv_capacity: Option<usize>,
    /// Mixture-of-experts models: experts each worker keeps on its device (an LRU cache fed from
    /// the loader, next layers' experts predicted and copied ahead); default: every expert when the
    /// budget holds them, else what the budget leaves after the resident layers.
    #[arg(long, env = "LAYERSTREAM_EXPERT_CACHE")]
    pub expert_cache: Option<usize>,
    #[command(flatten)]
    pub kv: KvFlags,
    /// Bytes of the host-RAM KV tier on each worker: a preempted sequence's KV blocks go there and
    /// come back when it resumes, instead of being computed again (0 = off: it is replayed);
    /// default: a quarter of this host's available memory at start.
    #[arg(long, env = "LAYERSTREAM_KV_HOST_BYTES", value_parser = layerstream_model::mem::parse_bytes)]
    pub kv_host_bytes: Option<u64>,
    /// Turns prefix caching off (on: a prompt that starts with blocks another sequence computed
    /// reuses them instead of computing them again).
    #[arg(long, env = "LAYERSTREAM_NO_PREFIX_CACHE")]
    pub no_prefix_cache: bool,
}

/// How the paged KV cache stores keys and values (`coordinator`, `up`, `run`).
#[derive(Args, Debug, Clone, PartialEq)]
pub struct KvFlags {
    /// How the KV cache stores keys and values: `auto` (f16 on a GPU, f32 — exact — on the CPU;
    /// f16 on a CPU worker not under `--exact` whose budget cannot keep every layer resident),
    /// `f32`, `f16`, `bf16`, `q8_0` or `q4_0` (8/4-bit blocks of 32, dequantized inside attention).
    #[arg(long, env = "LAYERSTREAM_KV_DTYPE", default_value = "auto", value_parser = kv_dtype_flag)]
    pub kv_dtype: String,
    /// Positions per KV block (a power of two): sequences take blocks as they grow, and prefix
    /// caching shares whole blocks.
    #[arg(long, env = "LAYERSTREAM_KV_BLOCK", default_value_t = 16, value_parser = power_of_two)]
    pub kv_block: usize,
}

impl KvFlags {
    /// The KV dtype a device ("cpu", "cuda:0") stores: `--kv-dtype`, or for `auto` f16 on a GPU
    /// and f32 on the CPU.
    pub fn dtype_for(&self, device: &str) -> String {
        match self.kv_dtype.as_str() {
            "auto" if device.starts_with("cuda") => "f16".into(),
            "auto" => "f32".into(),
            d => d.into(),
        }
    }
}

/// `--kv-dtype`: `auto` or a KV dtype.
fn kv_dtype_flag(s: &str) -> Result<String, String> {
    if s == "auto" {
        return Ok(s.into());
    }
    layerstream_model::dtype::parse_kv_dtype(s).map(|d| d.name().to_string())
}

/// A power of two (`--kv-block`).
fn power_of_two(s: &str) -> Result<usize, String> {
    let n: usize = s.parse().map_err(|e| format!("{s:?}: {e}"))?;
    if n.is_power_of_two() {
        Ok(n)
    } else {
        Err(format!("{n} is not a power of two"))
    }
}

/// The HTTP server: OpenAI API, `/metrics`, the live page.
#[derive(Args, Debug, Clone, PartialEq)]
pub struct HttpFlags {
    /// Address of the HTTP server (OpenAI-compatible API at /v1, Prometheus /metrics, the live page
    /// at /); `off` disables it. Port 0 picks one (printed as `http=` on the `LISTENING` line).
    /// Default: 127.0.0.1:8000 (`up` with a prompt, which stops after answering it: off).
    #[arg(long, env = "LAYERSTREAM_HTTP_LISTEN")]
    pub http_listen: Option<String>,
    /// Model id of the OpenAI API (`/v1/models`; requests naming another get 404); default: the
    /// store directory's name.
    #[arg(long, env = "LAYERSTREAM_SERVED_MODEL_NAME")]
    pub served_model_name: Option<String>,
    /// Browser origins allowed to call the HTTP API (CORS; repeat or comma-separate; `*` = any).
    #[arg(
        long = "cors-allow-origin",
        env = "LAYERSTREAM_CORS_ALLOW_ORIGIN",
        value_delimiter = ','
    )]
    pub cors_allow_origin: Vec<String>,
    /// Most HTTP connections open at once; one more is closed as it is accepted (held below the
    /// process's open-file limit, which is raised to the system's at start).
    #[arg(long, env = "LAYERSTREAM_HTTP_MAX_CONNECTIONS", default_value_t = 1024)]
    pub http_max_connections: usize,
    /// Seconds an HTTP connection may go without sending a whole request header — a fresh one, or
    /// a kept-alive one between requests — before it is closed.
    #[arg(long = "http-idle-timeout", env = "LAYERSTREAM_HTTP_IDLE_TIMEOUT", default_value_t = 30)]
    pub http_idle_timeout_s: u64,
}

/// Where the HTTP server listens when no address is given.
pub const DEFAULT_HTTP_LISTEN: &str = "127.0.0.1:8000";

impl HttpFlags {
    /// The address to serve HTTP on; None when `off`.
    pub fn listen(&self) -> Option<&str> {
        match self.http_listen.as_deref() {
            Some("off") => None,
            Some(a) => Some(a),
            None => Some(DEFAULT_HTTP_LISTEN),
        }
    }

    /// The flags for a child coordinator.
    pub fn to_args(&self) -> Vec<String> {
        let mut a = flag("http-listen", self.listen().unwrap_or("off")).to_vec();
        if let Some(n) = &self.served_model_name {
            a.extend(flag("served-model-name", n));
        }
        if !self.cors_allow_origin.is_empty() {
            a.extend(flag("cors-allow-origin", self.cors_allow_origin.join(",")));
        }
        a.extend(flag("http-max-connections", self.http_max_connections));
        a.extend(flag("http-idle-timeout", self.http_idle_timeout_s));
        a
    }
}

/// Admission and step limits of the scheduler.
#[derive(Args, Debug, Clone, PartialEq)]
pub struct SchedulerFlags {
    /// Most sequences in one step.
    #[arg(long, env = "LAYERSTREAM_MAX_BATCH", default_value_t = 32)]
    pub max_batch: usize,
    /// Most tokens in one step (decodes count one each); longer prompts are split over steps
    /// (chunked prefill), which bounds a step's activation memory and latency.
    #[arg(long, env = "LAYERSTREAM_MAX_STEP_TOKENS", default_value_t = 2048)]
    pub max_step_tokens: usize,
    /// Queued sequences before new requests get RESOURCE_EXHAUSTED.
    #[arg(long, env = "LAYERSTREAM_QUEUE_SIZE", default_value_t = 256)]
    pub queue_size: usize,
    /// Seconds a worker may take for one step before it counts as stalled (and, when it does not
    /// answer within the same time again, is reported in the error of the jobs it held). Default:
    /// derived from measured steps — 10 × the slowest of the last 64 (for a step of more rows, such
    /// as a burst of prompts, up to 10 × the slowest time per row × its rows, at most 300 s), at
    /// least 30 s (300 s before the first step has been measured).
    #[arg(long = "step-timeout", env = "LAYERSTREAM_STEP_TIMEOUT")]
    pub step_timeout_s: Option<u64>,
    /// How many times in a row the coordinator recovers from a failed step (re-assigning restarted
    /// workers and replaying the sequences in flight) before the jobs in flight fail.
    #[arg(long, env = "LAYERSTREAM_MAX_RECOVERIES", default_value_t = 3)]
    pub max_recoveries: u32,
    /// Seconds a finished job stays visible to GetJob/WatchJob before its record is dropped.
    #[arg(long = "job-retention", env = "LAYERSTREAM_JOB_RETENTION", default_value_t = 600)]
    pub job_retention_s: u64,
    /// Most finished job records kept (the oldest are dropped first).
    #[arg(long, env = "LAYERSTREAM_MAX_JOB_RECORDS", default_value_t = 10_000)]
    pub max_job_records: usize,
    /// Micro-batches in flight: the running sequences are split into this many groups that move
    /// through the workers independently, so every worker has one to run (1 = each step through
    /// the workers one after another). `auto`: one per worker when every layer is resident, else 1
    /// (a worker that streams would stream its layers once per micro-batch). GetPlan shows the choice.
    #[arg(long, env = "LAYERSTREAM_MICRO_BATCHES", default_value = "auto")]
    pub micro_batches: crate::lanes::MicroBatches,
    /// Send hidden states between workers as gRPC bytes even when neighbours share a host (by
    /// default they go through a shared-memory region of the sending worker).
    #[arg(long, env = "LAYERSTREAM_HIDDEN_OVER_GRPC")]
    pub hidden_over_grpc: bool,
    /// Which requests share cached prompt blocks: `key` — only those sent with the same API key
    /// (each key a tenant; with no key set, every request alike) — or `global`. A request's
    /// `cache_salt` narrows either further.
    #[arg(long, env = "LAYERSTREAM_PREFIX_CACHE_SCOPE", default_value = "key")]
    pub prefix_cache_scope: CacheScope,
}

/// `--prefix-cache-scope`.
#[derive(clap::ValueEnum, Debug, Clone, Copy, PartialEq, Eq)]
pub enum CacheScope {
    /// Per API key.
    Key,
    /// Every request alike (only `cache_salt` separates).
    Global,
}

impl CacheScope {
    /// The flag's value.
    pub fn name(self) -> &'static str {
        match self {
            CacheScope::Key => "key",
            CacheScope::Global => "global",
        }
    }
}

/// A request's prefix-cache salt: its API key's index under `key` scope (None: no key in use)
/// and its `cache_salt`; 0 (shared by all) when neither applies.
pub fn cache_salt(scope: CacheScope, key: Option<usize>, salt: &str) -> u64 {
    let tenant = match (scope, key) {
        (CacheScope::Key, Some(i)) => format!("key{i}"),
        _ => String::new(),
    };
    if tenant.is_empty() && salt.is_empty() {
        return 0;
    }
    layerstream_serving::kv_blocks::salt_of(&format!("{tenant}\0{salt}"))
}

/// Speculative decoding (`coordinator`, `up`, `run`).
#[derive(Args, Debug, Clone, PartialEq)]
pub struct SpecFlags {
    /// Speculative decoding: `ngram` drafts tokens by prompt lookup (what followed the last earlier
    /// occurrence of the newest tokens in the prompt and output), `draft` by `--draft-model`, `auto`
    /// by the draft model when one is given, else by prompt lookup; one weight pass verifies every
    /// drafted token. Draft sizes follow each sequence's acceptance and the measured cost of a pass.
    /// Greedy and seeded outputs are the same as with `off`.
    #[arg(long, env = "LAYERSTREAM_SPEC", default_value = "off")]
    pub spec: layerstream_serving::spec::SpecMode,
    /// Most tokens drafted per sequence per weight pass (at most 64; a request's
    /// `speculative.max_tokens` overrides it).
    #[arg(long, env = "LAYERSTREAM_SPEC_MAX", default_value_t = 16,
          value_parser = clap::value_parser!(u32).range(1..=layerstream_serving::spec::MAX_DRAFT as i64))]
    pub spec_max: u32,
    /// A smaller store with the target's vocabulary that drafts tokens (`--spec draft` or `auto`).
    #[arg(long, env = "LAYERSTREAM_DRAFT_MODEL")]
    pub draft_model: Option<std::path::PathBuf>,
    /// Token trees: the draft model grows a tree best first — the N most likely continuations of
    /// every node are candidates, scored by the draft's probability of their whole path, and each
    /// draft pass adds the N best — and one pass verifies every branch with a tree attention mask
    /// (1 = a greedy chain; at most 4; full-context models).
    #[arg(long, env = "LAYERSTREAM_SPEC_WIDTH", default_value_t = 1,
          value_parser = clap::value_parser!(u32).range(1..=layerstream_serving::spec::MAX_WIDTH as i64))]
    pub spec_width: u32,
}

impl SpecFlags {
    /// The same settings as command-line arguments (for a child coordinator).
    pub fn to_args(&self) -> Vec<String> {
        let mut a = [
            flag("spec", self.spec.name()),
            flag("spec-max", self.spec_max),
            flag("spec-width", self.spec_width),
        ]
        .concat();
        if let Some(d) = &self.draft_model {
            a.extend(flag("draft-model", d.display()));
        }
        a
    }
}

fn flag(name: &str, v: impl ToString) -> [String; 2] {
    [format!("--{name}"), v.to_string()]
}

impl PlanFlags {
    /// The same settings as command-line arguments (for a child coordinator).
    pub fn to_args(&self) -> Vec<String> {
        let mut a: Vec<String> = [
            flag("layer-group-size", self.layer_group_size),
            flag("streaming-buffers", self.streaming_buffers),
            flag("kv-dtype", &self.kv.kv_dtype),
            flag("kv-block", self.kv.kv_block),
        ]
        .concat();
        if let Some(k) = self.resident_layers {
            a.extend(flag("resident-layers", k));
        }
        if let Some(c) = self.kv_capacity {
            a.extend(flag("kv-capacity", c));
        }
        if let Some(n) = self.expert_cache {
            a.extend(flag("expert-cache", n));
        }
        if self.no_prefetch {
            a.push("--no-prefetch".into());
        }
        if self.no_prefix_cache {
            a.push("--no-prefix-cache".into());
        }
        if let Some(b) = self.kv_host_bytes {
            a.extend(flag("kv-host-bytes", b));
        }
        a
    }
}

impl SchedulerFlags {
    /// The same settings as command-line arguments (for a child coordinator).
    pub fn to_args(&self) -> Vec<String> {
        let mut a = [
            flag("max-batch", self.max_batch),
            flag("max-step-tokens", self.max_step_tokens),
            flag("queue-size", self.queue_size),
            flag("max-recoveries", self.max_recoveries),
            flag("job-retention", self.job_retention_s),
            flag("max-job-records", self.max_job_records),
            flag("micro-batches", self.micro_batches),
            flag("prefix-cache-scope", self.prefix_cache_scope.name()),
        ]
        .concat();
        if let Some(t) = self.step_timeout_s {
            a.extend(flag("step-timeout", t));
        }
        if self.hidden_over_grpc {
            a.push("--hidden-over-grpc".into());
        }
        a
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser, Debug)]
    struct Cli {
        #[command(flatten)]
        plan: PlanFlags,
        #[command(flatten)]
        sched: SchedulerFlags,
        #[command(flatten)]
        http: HttpFlags,
        #[command(flatten)]
        spec: SpecFlags,
    }

    /// What `up` passes on parses back to the same settings in the child.
    #[test]
    fn to_args_round_trips() {
        let given = Cli::parse_from([
            "x",
            "--resident-layers",
            "3",
            "--expert-cache",
            "6",
            "--no-prefetch",
            "--layer-group-size",
            "2",
            "--max-batch",
            "5",
            "--step-timeout",
            "9",
            "--micro-batches",
            "3",
            "--hidden-over-grpc",
            "--http-listen",
            "off",
            "--served-model-name",
            "m",
            "--streaming-buffers",
            "3",
            "--kv-capacity",
            "77",
            "--kv-dtype",
            "q8_0",
            "--kv-block",
            "32",
            "--no-prefix-cache",
            "--kv-host-bytes",
            "1048576",
            "--max-step-tokens",
            "11",
            "--queue-size",
            "12",
            "--max-recoveries",
            "2",
            "--job-retention",
            "13",
            "--max-job-records",
            "14",
            "--cors-allow-origin",
            "http://a,http://b",
            "--http-max-connections",
            "7",
            "--http-idle-timeout",
            "8",
            "--spec",
            "ngram",
            "--spec-max",
            "5",
            "--draft-model",
            "/d",
            "--spec-width",
            "3",
        ]);
        let mut argv = vec!["x".to_owned()];
        argv.extend(given.plan.to_args());
        argv.extend(given.sched.to_args());
        argv.extend(given.http.to_args());
        argv.extend(given.spec.to_args());
        // Every flag of the three groups is passed on when set.
        for a in <Cli as clap::CommandFactory>::command().get_arguments() {
            if let Some(long) = a.get_long() {
                assert!(argv.contains(&format!("--{long}")), "--{long} is not passed on");
            }
        }
        let back = Cli::parse_from(argv);
        assert_eq!(back.http.listen(), None);
        assert_eq!(
            (back.plan, back.sched, back.http, back.spec),
            (given.plan, given.sched, given.http, given.spec)
        );
        assert_eq!(Cli::parse_from(["x"]).http.listen(), Some(DEFAULT_HTTP_LISTEN));
    }

    /// Tenants and salts separate; the same tenant and salt meet; global scope ignores the key.
    #[test]
    fn cache_salts_follow_scope_key_and_salt() {
        use CacheScope::*;
        assert_eq!(cache_salt(Key, None, ""), 0);
        assert_eq!(cache_salt(Global, Some(3), ""), 0);
        assert_ne!(cache_salt(Key, Some(0), ""), cache_salt(Key, Some(1), ""));
        assert_eq!(cache_salt(Key, Some(1), "s"), cache_salt(Key, Some(1), "s"));
        assert_ne!(cache_salt(Key, Some(1), "s"), cache_salt(Key, Some(1), "t"));
        assert_eq!(cache_salt(Global, Some(0), "s"), cache_salt(Global, Some(1), "s"));
        assert_ne!(cache_salt(Global, None, "s"), 0);
    }
}
