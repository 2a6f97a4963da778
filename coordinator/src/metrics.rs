//! Prometheus metrics of the whole stack, served at `/metrics` on the HTTP port: requests and tokens
//! (the scheduler), latencies, queue and batch, each worker's streaming (from its step answers), and
//! the loader's cache counters and worker liveness (from the workers' Info, read at scrape time), so
//! one scrape of the coordinator sees every process. Also keeps the last steps for the live page.

use layerstream_model::sync::lock;
use layerstream_rpc::v1::{FinishReason, InfoResponse, LoaderStats};
use prometheus_client::encoding::text::encode;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use prometheus_client::registry::Registry;
use std::collections::{HashMap, VecDeque};
use std::sync::atomic::AtomicU64;
use std::sync::Mutex;

type Labels = Vec<(&'static str, String)>;
type FCounter = Counter<f64, AtomicU64>;
type FGauge = Gauge<f64, AtomicU64>;

mod views;
pub use views::{LayerView, StepView, WorkerStepView, RECENT_STEPS};

/// Every metric of the stack.
pub struct Metrics {
    registry: Registry,
    finished: Family<Labels, Counter>,
    rejected: Family<Labels, Counter>,
    http: Family<Labels, Counter>,
    prompt_tokens: Counter,
    generation_tokens: Counter,
    spec_drafted: Counter,
    spec_accepted: Counter,
    /// Prefix caching: lookups, the prompt tokens they asked about, and those found cached.
    prefix_queries: Counter,
    prefix_queried_tokens: Counter,
    prefix_hit_tokens: Counter,
    /// KV blocks in use (held by sequences or cached), cached (keyed) blocks, preemptions.
    pub(crate) kv_blocks: Gauge,
    pub(crate) kv_cached_blocks: Gauge,
    pub(crate) preempted: Counter,
    /// Tokens computed again after a preemption without the host tier.
    pub(crate) replayed_tokens: Counter,
    /// KV blocks and bytes moved to and from the workers' host tier, by direction.
    swap_blocks: Family<Labels, Counter>,
    swap_bytes: Family<Labels, Counter>,
    ttft: Histogram,
    tpot: Histogram,
    /// Time to compute one sequence's output-format mask for one step.
    mask: Histogram,
    e2e: Histogram,
    pub(crate) waiting: Gauge,
    pub(crate) running: Gauge,
    batch: Histogram,
    steps: Counter,
    overlapped: Counter,
    pub(crate) micro_batches: Gauge,
    busy: Family<Labels, FCounter>,
    bytes: Family<Labels, Counter>,
    transfer: Family<Labels, FCounter>,
    compute: Family<Labels, FCounter>,
    stall: Family<Labels, FCounter>,
    /// Experts a worker's steps needed, by where they were: hit, prefetched, missed.
    experts: Family<Labels, Counter>,
    hidden: Family<Labels, FGauge>,
    worker_up: Family<Labels, Gauge>,
    device_bytes: Family<Labels, Gauge>,
    loader_hits: Family<Labels, Counter>,
    loader_misses: Family<Labels, Counter>,
    loader_disk_bytes: Family<Labels, Counter>,
    loader_disk_seconds: Family<Labels, FCounter>,
    loader_disk_busy: Family<Labels, FCounter>,
    /// Per loader namespace: the counters last seen, to add only what is new.
    loaders: Mutex<HashMap<String, LoaderStats>>,
    recent: Mutex<VecDeque<StepView>>,
    /// The cost model's decode pass time by batch (`--predicted-pass`), and the decode steps' wall
    /// seconds beside their predicted seconds.
    predicted: Option<crate::cost::Curve>,
    decode_wall: FCounter,
    decode_predicted: FCounter,
}

fn worker(addr: &str) -> Labels {
    vec![("worker", addr.to_owned())]
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

impl Metrics {
    /// Registers every metric under the `layerstream_` prefix.
    pub fn new() -> Self {
        Self::predicting(None)
    }

    /// `new`, with the cost model's decode pass times set beside each decode step.
    pub fn predicting(predicted: Option<crate::cost::Curve>) -> Self {
        let mut r = Registry::with_prefix("layerstream");
        let latency = || Histogram::new(exponential_buckets(0.001, 2.0, 18));
        let m = Metrics {
            finished: Family::default(),
            rejected: Family::default(),
            http: Family::default(),
            prompt_tokens: Counter::default(),
            generation_tokens: Counter::default(),
            spec_drafted: Counter::default(),
            spec_accepted: Counter::default(),
            prefix_queries: Counter::default(),
            prefix_queried_tokens: Counter::default(),
            prefix_hit_tokens: Counter::default(),
            kv_blocks: Gauge::default(),
            kv_cached_blocks: Gauge::default(),
            preempted: Counter::default(),
            replayed_tokens: Counter::default(),
            swap_blocks: Family::default(),
            swap_bytes: Family::default(),
            ttft: latency(),
            mask: Histogram::new(exponential_buckets(1e-5, 2.0, 16)),
            tpot: latency(),
            e2e: latency(),
            waiting: Gauge::default(),
            running: Gauge::default(),
            batch: Histogram::new(exponential_buckets(1.0, 2.0, 10)),
            steps: Counter::default(),
            overlapped: Counter::default(),
            micro_batches: Gauge::default(),
            busy: Family::default(),
            bytes: Family::default(),
            transfer: Family::default(),
            compute: Family::default(),
            stall: Family::default(),
            experts: Family::default(),
            hidden: Family::default(),
            worker_up: Family::default(),
            device_bytes: Family::default(),
            loader_hits: Family::default(),
            loader_misses: Family::default(),
            loader_disk_bytes: Family::default(),
            loader_disk_seconds: Family::default(),
            loader_disk_busy: Family::default(),
            loaders: Mutex::default(),
            recent: Mutex::default(),
            predicted,
            decode_wall: FCounter::default(),
            decode_predicted: FCounter::default(),
            registry: Registry::default(),
        };
        m.register_requests(&mut r);
        m.register_steps(&mut r);
        m.register_workers(&mut r);
        Metrics { registry: r, ..m }
    }

    /// Requests: finished, refused, HTTP responses, tokens and latencies.
    fn register_requests(&self, r: &mut Registry) {
        r.register(
            "requests",
            "Requests that finished, by finish reason (stop, length, cancelled, error)",
            self.finished.clone(),
        );
        r.register("requests_rejected", "Requests refused before they were queued, by reason (invalid_argument, resource_exhausted, unavailable)", self.rejected.clone());
        r.register("http_responses", "HTTP responses, by path and status code", self.http.clone());
        r.register(
            "prompt_tokens",
            "Prompt tokens of finished requests",
            self.prompt_tokens.clone(),
        );
        r.register("generation_tokens", "Tokens generated", self.generation_tokens.clone());
        r.register(
            "spec_drafted_tokens",
            "Tokens drafted for speculative decoding",
            self.spec_drafted.clone(),
        );
        r.register(
            "spec_accepted_tokens",
            "Drafted tokens the target accepted",
            self.spec_accepted.clone(),
        );
        r.register(
            "prefix_cache_queries",
            "Prompts looked up in the prefix cache",
            self.prefix_queries.clone(),
        );
        r.register(
            "prefix_cache_queried_tokens",
            "Prompt tokens looked up in the prefix cache",
            self.prefix_queried_tokens.clone(),
        );
        r.register(
            "prefix_cache_hit_tokens",
            "Prompt tokens found in the prefix cache (not computed again)",
            self.prefix_hit_tokens.clone(),
        );
        r.register(
            "kv_blocks_used",
            "KV blocks held by sequences or kept for the prefix cache (no sequence using them)",
            self.kv_blocks.clone(),
        );
        r.register(
            "kv_cached_blocks",
            "KV blocks keyed for the prefix cache",
            self.kv_cached_blocks.clone(),
        );
        r.register(
            "preemptions",
            "Sequences preempted (KV blocks given back when the pool ran dry) and replayed later",
            self.preempted.clone(),
        );
        r.register(
            "preemption_replayed_tokens",
            "Tokens computed again after a preemption (no room in the host tier)",
            self.replayed_tokens.clone(),
        );
        r.register(
            "kv_swapped_blocks",
            "KV blocks moved between the workers' pools and their host-RAM tier, by direction (to_host, to_device)",
            self.swap_blocks.clone(),
        );
        r.register(
            "kv_swapped_bytes",
            "Bytes of KV blocks moved to and from the host tier, summed over the workers, by direction",
            self.swap_bytes.clone(),
        );
        r.register(
            "time_to_first_token_seconds",
            "From a request's arrival to its first token",
            self.ttft.clone(),
        );
        r.register(
            "grammar_mask_seconds",
            "Time to compute one constrained sequence's token mask for one step (coordinator)",
            self.mask.clone(),
        );
        r.register(
            "time_per_output_token_seconds",
            "Time per output token after the first, per request",
            self.tpot.clone(),
        );
        r.register(
            "e2e_request_latency_seconds",
            "From a request's arrival to its end",
            self.e2e.clone(),
        );
    }

    /// The scheduler: queue, batch, steps and micro-batches.
    fn register_steps(&self, r: &mut Registry) {
        r.register(
            "num_requests_waiting",
            "Sequences queued, not yet running",
            self.waiting.clone(),
        );
        r.register("num_requests_running", "Sequences in the running batch", self.running.clone());
        r.register(
            "step_batch_size",
            "Sequences per forward step (one weight pass)",
            self.batch.clone(),
        );
        r.register("steps", "Forward steps (weight passes) run", self.steps.clone());
        r.register(
            "decode_step_seconds",
            "Wall seconds of the decode steps (one row a sequence) the cost model predicted",
            self.decode_wall.clone(),
        );
        r.register(
            "decode_step_predicted_seconds",
            "Seconds the cost model (layerstream plan) predicted for those steps: rate(measured) / \
             rate(predicted) is how far off it is",
            self.decode_predicted.clone(),
        );
        r.register(
            "overlapped_steps",
            "Steps started while another micro-batch's step was in flight",
            self.overlapped.clone(),
        );
        r.register(
            "micro_batches",
            "Micro-batches in flight under the plan in force",
            self.micro_batches.clone(),
        );
    }

    /// Per worker and per loader: time, bytes, experts, health.
    fn register_workers(&self, r: &mut Registry) {
        r.register(
            "worker_busy_seconds",
            "Wall time a worker spent in steps (its rate is the worker's busy share)",
            self.busy.clone(),
        );
        r.register(
            "worker_bytes_streamed",
            "Weight bytes a worker copied from the loader's shared memory",
            self.bytes.clone(),
        );
        r.register(
            "worker_transfer_seconds",
            "Time a worker spent copying streamed weights",
            self.transfer.clone(),
        );
        r.register(
            "worker_compute_seconds",
            "Time a worker spent computing layers",
            self.compute.clone(),
        );
        r.register(
            "worker_stall_seconds",
            "Compute time a worker waited for weights",
            self.stall.clone(),
        );
        r.register(
            "worker_experts",
            "Experts a worker's steps needed (mixture-of-experts models), by where they were: on \
             the device (hit), copied ahead on a prediction (prefetched), fetched on demand (missed)",
            self.experts.clone(),
        );
        r.register(
            "worker_hidden_transfer_ratio",
            "Share of a worker's transfer time hidden behind compute (1 = fully overlapped)",
            self.hidden.clone(),
        );
        r.register(
            "worker_up",
            "1 when the worker answers and holds its assignment",
            self.worker_up.clone(),
        );
        r.register(
            "worker_device_bytes_used",
            "Device memory a worker has taken since it started",
            self.device_bytes.clone(),
        );
        r.register(
            "loader_cache_hits",
            "Acquires the loader served from a slot that held the layer",
            self.loader_hits.clone(),
        );
        r.register(
            "loader_cache_misses",
            "Layer files the loader read from disk",
            self.loader_misses.clone(),
        );
        r.register(
            "loader_disk_read_bytes",
            "Bytes the loader read from disk (the disk tier; ÷ the seconds: its GB/s)",
            self.loader_disk_bytes.clone(),
        );
        r.register(
            "loader_disk_read_seconds",
            "Seconds the loader's disk reads took, each read's own (÷ into the bytes: GB/s per read)",
            self.loader_disk_seconds.clone(),
        );
        r.register(
            "loader_disk_busy_seconds",
            "Wall seconds with at least one of the loader's disk reads in flight (÷ into the bytes: \
             the disk's GB/s with the reads overlapped, the cost model's disk figure)",
            self.loader_disk_busy.clone(),
        );
    }

    /// A request refused before it was queued.
    pub fn rejected(&self, reason: &str) {
        self.rejected.get_or_create(&vec![("reason", reason.to_owned())]).inc();
    }

    /// An HTTP response.
    pub fn http_response(&self, path: &str, status: u16) {
        let l = vec![("path", path.to_owned()), ("status", status.to_string())];
        self.http.get_or_create(&l).inc();
    }

    /// A request that ended: its token counts and latencies (seconds).
    pub fn finished(
        &self,
        reason: FinishReason,
        prompt: usize,
        generated: usize,
        ttft: Option<f64>,
        e2e: f64,
    ) {
        let name = match reason {
            FinishReason::Stop => "stop",
            FinishReason::Length => "length",
            FinishReason::Cancelled => "cancelled",
            FinishReason::ToolCalls => "tool_calls",
            FinishReason::Error | FinishReason::Unspecified => "error",
        };
        self.finished.get_or_create(&vec![("finish_reason", name.to_owned())]).inc();
        self.prompt_tokens.inc_by(prompt as u64);
        self.e2e.observe(e2e);
        if let Some(t) = ttft {
            self.ttft.observe(t);
            if generated >= 2 {
                self.tpot.observe((e2e - t).max(0.0) / (generated - 1) as f64);
            }
        }
    }

    /// Tokens generated by a step.
    pub fn generated(&self, n: usize) {
        self.generation_tokens.inc_by(n as u64);
    }

    /// A sequence's step verified `drafted` tokens and accepted `accepted` of them.
    pub fn speculated(&self, drafted: usize, accepted: usize) {
        self.spec_drafted.inc_by(drafted as u64);
        self.spec_accepted.inc_by(accepted as u64);
    }

    /// One output-format mask computed, in seconds.
    pub fn mask(&self, s: f64) {
        self.mask.observe(s);
    }

    /// KV blocks (and their bytes over every worker) moved to the host tier and back.
    pub fn swapped(&self, out: usize, bytes_out: u64, back: usize, bytes_in: u64) {
        for (dir, n, b) in [("to_host", out, bytes_out), ("to_device", back, bytes_in)] {
            let l = vec![("direction", dir.to_owned())];
            self.swap_blocks.get_or_create(&l).inc_by(n as u64);
            self.swap_bytes.get_or_create(&l).inc_by(b);
        }
    }

    /// The block manager's prefix counters now (counters only go up: adds what is new).
    pub fn prefix(&self, c: layerstream_serving::kv_blocks::PrefixCounts) {
        for (m, v) in [
            (&self.prefix_queries, c.queries),
            (&self.prefix_queried_tokens, c.queried_tokens),
            (&self.prefix_hit_tokens, c.hit_tokens),
        ] {
            m.inc_by(v.saturating_sub(m.get()));
        }
    }

    /// Since start: tokens drafted, drafted tokens accepted, tokens generated, steps run.
    pub fn spec_totals(&self) -> (u64, u64, u64, u64) {
        (
            self.spec_drafted.get(),
            self.spec_accepted.get(),
            self.generation_tokens.get(),
            self.steps.get(),
        )
    }

    /// A step started with `others` micro-batches' steps in flight.
    pub fn launched(&self, others: usize) {
        if others > 0 {
            self.overlapped.inc();
        }
    }

    /// A step: its batch and each worker's layer timings (`workers`: address, timings, wall ms).
    pub fn step(
        &self,
        batch: usize,
        rows: usize,
        wall_ms: f64,
        workers: &[crate::pipeline::WorkerStep],
    ) {
        self.steps.inc();
        self.batch.observe(batch as f64);
        for w in workers {
            let (addr, layers, wall) = (&w.address, &w.layers, w.wall_ms);
            let l = worker(addr);
            self.busy.get_or_create(&l).inc_by(wall / 1e3);
            let (mut t, mut c, mut st, mut b) = (0.0, 0.0, 0.0, 0u64);
            for x in layers {
                t += x.transfer_ms;
                c += x.compute_ms;
                st += x.stall_ms;
                b += x.bytes;
                for (outcome, n) in [
                    ("hit", x.experts_hit),
                    ("prefetched", x.experts_prefetched),
                    ("missed", x.experts_missed),
                ] {
                    if n > 0 {
                        let labels =
                            vec![("worker", addr.clone()), ("outcome", outcome.to_owned())];
                        self.experts.get_or_create(&labels).inc_by(n as u64);
                    }
                }
            }
            self.bytes.get_or_create(&l).inc_by(b);
            self.transfer.get_or_create(&l).inc_by(t / 1e3);
            self.compute.get_or_create(&l).inc_by(c / 1e3);
            self.stall.get_or_create(&l).inc_by(st / 1e3);
            // From the worker's totals so far: the share of its transfer time not spent stalled.
            let (t, st) =
                (self.transfer.get_or_create(&l).get(), self.stall.get_or_create(&l).get());
            let hidden = if t > 0.0 { ((t - st) / t).clamp(0.0, 1.0) } else { 1.0 };
            self.hidden.get_or_create(&l).set(hidden);
        }
        let at_ms = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_millis() as u64);
        let decode = rows == batch && batch > 0;
        let predicted_ms = self.predicted.as_ref().filter(|_| decode).map(|c| c.at(batch) * 1e3);
        if let Some(p) = predicted_ms {
            self.decode_wall.inc_by(wall_ms / 1e3);
            self.decode_predicted.inc_by(p / 1e3);
        }
        let view = StepView {
            at_ms,
            batch,
            rows,
            wall_ms,
            predicted_ms,
            workers: workers
                .iter()
                .map(|w| WorkerStepView {
                    worker: w.address.clone(),
                    wall_ms: w.wall_ms,
                    layers: w.layers.iter().map(LayerView::from).collect(),
                })
                .collect(),
        };
        let mut recent = lock(&self.recent);
        if recent.len() == RECENT_STEPS {
            recent.pop_front();
        }
        recent.push_back(view);
    }

    /// The last steps, oldest first.
    pub fn recent(&self) -> Vec<StepView> {
        lock(&self.recent).iter().cloned().collect()
    }

    /// A worker's answer to Info at scrape time (None: it did not answer); `holds` whether it holds
    /// the assignment the plan gave it.
    pub fn worker_info(&self, addr: &str, info: Option<&InfoResponse>, holds: bool) {
        let l = worker(addr);
        self.worker_up.get_or_create(&l).set(i64::from(info.is_some() && holds));
        let Some(info) = info else { return };
        self.device_bytes.get_or_create(&l).set(info.device_bytes_used as i64);
        let Some(ld) = &info.loader else { return };
        let mut seen = lock(&self.loaders);
        let last = seen.entry(ld.namespace.clone()).or_default();
        let ll = vec![("loader", ld.namespace.clone())];
        self.loader_hits.get_or_create(&ll).inc_by(since(ld.hits, last.hits));
        self.loader_misses.get_or_create(&ll).inc_by(since(ld.misses, last.misses));
        self.loader_disk_bytes.get_or_create(&ll).inc_by(since(ld.disk_bytes, last.disk_bytes));
        let secs = since(ld.disk_seconds, last.disk_seconds);
        self.loader_disk_seconds.get_or_create(&ll).inc_by(secs);
        let busy = since(ld.disk_busy_seconds, last.disk_busy_seconds);
        self.loader_disk_busy.get_or_create(&ll).inc_by(busy);
        *last = ld.clone();
    }

    /// The exposition text (OpenMetrics, which Prometheus reads).
    pub fn encode(&self) -> String {
        let mut out = String::new();
        // Writing to a String cannot fail.
        let _ = encode(&mut out, &self.registry);
        out
    }
}

/// The content type of `encode`'s text.
pub const CONTENT_TYPE: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

/// What a loader's counter added since it read `before`: a restarted loader counts from 0 again,
/// so a count below `before` is all new.
fn since<T: PartialOrd + std::ops::Sub<Output = T>>(now: T, before: T) -> T {
    if now >= before {
        now - before
    } else {
        now
    }
}

#[cfg(test)]
mod tests;
