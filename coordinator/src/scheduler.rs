//! The continuous-batching scheduler: an actor that owns the queue and the running sequences.
//! Between steps, sequences join (their prefill rides the same weight pass as running decodes) and
//! leave (finished, cancelled, or their client gone); one pipeline step serves every active sequence.
//! A step carries at most `max_step_tokens` tokens: every decode brings one, and prompts take what is
//! left, a long prompt split over several steps (chunked prefill), so a step's activations and
//! latency stay bounded however long the prompts are (admission keeps the running sequences, each a
//! decode token per step, within that count). With micro-batches (`--micro-batches`), the running
//! sequences are split into lanes whose steps are in flight at once, each lane refilled and started
//! again as soon as its step comes back (see `lanes`).

use crate::pipeline::Pipeline;
use crate::stats::Acc;
use layerstream_model::kv_blocks::{BlockPool, SeqBlocks};
use layerstream_model::spec::{levels, Acceptance, PassCost, SpecMode};
use layerstream_model::{FinishReason, GenerateParams, Stopper, Tokenizer};
use layerstream_rpc::v1::{generate_event, FinalEvent, GenerateEvent, StepSeq, TokenEvent};
use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::sync::mpsc;
use tokio::task::JoinSet;
use tracing::{info_span, Span};

mod batching;
mod kv;
mod output;
mod speculate;
mod step;

pub use batching::{admit, step_tokens, Limits};

/// How often an idle scheduler checks that the workers still hold their assignments.
const IDLE_CHECK: Duration = Duration::from_secs(2);

/// One sequence to generate.
pub struct SeqRequest {
    pub(crate) seq_id: u64,
    pub(crate) index: u32,
    pub(crate) input_ids: Vec<u32>,
    pub(crate) params: GenerateParams,
    pub(crate) events: mpsc::Sender<GenerateEvent>,
    /// The request's `job` span: the root of its trace.
    pub(crate) span: Span,
    pub(crate) trace_id: String,
    pub(crate) cancel: Arc<AtomicBool>,
    /// When the coordinator accepted it (time to first token counts from here).
    pub(crate) queued: Instant,
    /// Its output format (constrained decoding), followed token by token.
    pub(crate) constraint: Option<Box<layerstream_model::grammar::Constraint>>,
    /// Its output is parsed for tool calls written this way (a request with tools).
    pub(crate) tools: Option<layerstream_model::tools::Reading>,
    /// Its prefix-cache scope (`kv_blocks::salt_of` of its `cache_salt` and tenant; 0: global):
    /// it shares cached blocks only with requests of the same salt.
    pub(crate) salt: u64,
    /// A job resumed from the journal: the events (token ids) this request had produced, fed to
    /// its stop criteria and format and shown again before it continues.
    pub(crate) journaled: Vec<Vec<u32>>,
}

struct Active {
    req: SeqRequest,
    /// Tokens the workers' KV caches hold for it (0 again after a fault: it is replayed).
    pos: usize,
    /// Output tokens, their text, and the stop criteria.
    stopper: Stopper,
    acc: Acc,
    started: Instant,
    /// The micro-batch it rides (None: not placed yet, or waiting for a lane to come back).
    lane: Option<usize>,
    /// How often its drafted tokens were accepted (speculative decoding).
    acceptance: Acceptance,
    /// The head's draft model's proposal to follow its known tokens (for its next step), with its
    /// tree parents.
    next_draft: (Vec<u32>, Vec<u32>),
    /// Its last step verified a token tree: the caches hold its tokens up to the one before the
    /// tree, and the accepted branch goes in again with the next token.
    refeed: bool,
    /// Its KV blocks, and the position its first step on the workers starts at (the prompt tokens
    /// found in the prefix cache; 0 without).
    blocks: SeqBlocks,
    base: usize,
    /// Preempted to the host tier: the host slots holding its blocks, in table order (empty: not
    /// swapped out).
    swapped: Vec<u32>,
    /// Output tokens its format forced (emitted without sampling: no draw).
    forced: usize,
    /// Its prompt's log-probabilities so far (a request with `prompt_logprobs`), and whether they
    /// were sent.
    scores: Vec<layerstream_rpc::v1::TokenLogprobs>,
    scores_sent: bool,
}

impl Active {
    /// Tokens known so far: the prompt, then every output token.
    fn known(&self) -> usize {
        self.req.input_ids.len() + self.stopper.output().len()
    }

    /// Where prefilling ends and decoding starts: the prompt's end, or — for a sequence replayed
    /// after a fault — the last output token, which then goes in as a normal decode.
    fn prefill_end(&self) -> usize {
        if self.stopper.output().is_empty() {
            self.req.input_ids.len()
        } else if self.refeed {
            // After a tree: the accepted branch and the new token go in as one chunk that samples.
            self.known()
        } else {
            self.known() - 1
        }
    }

    /// Every known token: the prompt, then the output.
    fn history(&self) -> Vec<u32> {
        [self.req.input_ids.as_slice(), self.stopper.output()].concat()
    }

    /// The `n` known tokens from `pos` on.
    fn tokens(&self, n: usize) -> Vec<u32> {
        let input = &self.req.input_ids;
        (self.pos..self.pos + n)
            .map(|i| {
                input.get(i).copied().unwrap_or_else(|| self.stopper.output()[i - input.len()])
            })
            .collect()
    }
}

/// KV block moves: (from, to) pairs of a device block and a host slot.
type Moves = Vec<(u32, u32)>;

/// The actor.
pub struct Scheduler {
    rx: mpsc::Receiver<SeqRequest>,
    pipeline: Pipeline,
    tokenizer: Arc<Tokenizer>,
    /// Waiting sequences, shared with the service that admits requests against `--queue-size`.
    waiting_count: Arc<std::sync::atomic::AtomicUsize>,
    /// The model's end-of-sequence ids.
    eos: Vec<u32>,
    limits: Limits,
    /// Recoveries in a row allowed before the sequences in flight fail (`--max-recoveries`).
    max_recoveries: u32,
    /// Failed steps since the last good one.
    failures: u32,
    /// A fault left the workers in an unknown state: recover before the next step.
    resync: bool,
    /// Counters, latencies and the last steps (Prometheus `/metrics`, the live page).
    metrics: Arc<crate::metrics::Metrics>,
    /// The drafter (`Off`, `Ngram` or `Draft`), the most it drafts per sequence per step, and the
    /// draft model's tree width.
    spec: (SpecMode, usize, usize),
    /// Measured step time by positions (what a longer draft costs), drafting excluded.
    cost: PassCost,
    /// The head's draft model's milliseconds per level of drafting (its own running estimate).
    draft_ms: f64,
    /// The paged KV cache's block manager (see `kv`).
    blocks: BlockPool,
    /// Sequences preempted for KV blocks, oldest first: admitted again before anything waiting.
    preempted: VecDeque<Active>,
    /// The host tier's free slots, the block moves to make before the next step (to host, to
    /// device), and the slots those moves empty.
    host_free: Vec<u32>,
    swaps: (Moves, Moves),
    host_emptied: Vec<u32>,
    /// Prefix blocks evicted from the device into the host tier: key → slot, oldest first.
    host_prefixes: std::collections::HashMap<u64, u32>,
    host_prefix_order: VecDeque<u64>,
}

/// What a scheduler is made of; its own state (failure count, resync) starts fresh in `new`.
pub struct SchedulerParts {
    /// Sequences the service admitted.
    pub(crate) rx: mpsc::Receiver<SeqRequest>,
    /// The workers, planned and assigned.
    pub(crate) pipeline: Pipeline,
    pub(crate) tokenizer: Arc<Tokenizer>,
    /// Waiting sequences, shared with the service that admits requests against `--queue-size`.
    pub(crate) waiting_count: Arc<std::sync::atomic::AtomicUsize>,
    /// The model's end-of-sequence ids.
    pub(crate) eos: Vec<u32>,
    pub(crate) limits: Limits,
    /// Recoveries in a row allowed before the sequences in flight fail (`--max-recoveries`).
    pub(crate) max_recoveries: u32,
    pub(crate) metrics: Arc<crate::metrics::Metrics>,
    /// The drafter (`Off`, `Ngram` or `Draft`), `--spec-max` and `--spec-width`.
    pub(crate) spec: (SpecMode, usize, usize),
}

fn final_event(
    req: &SeqRequest,
    output: &[u32],
    text: &str,
    stats: layerstream_rpc::v1::Stats,
    reason: FinishReason,
    error: String,
) -> GenerateEvent {
    GenerateEvent {
        index: req.index,
        event: Some(generate_event::Event::Done(FinalEvent {
            finish_reason: reason.into(),
            input_ids: req.input_ids.clone(),
            output_ids: output.to_vec(),
            text: text.into(),
            stats: Some(stats),
            trace_id: req.trace_id.clone(),
            error,
            tool_calls: Vec::new(),
        })),
    }
}

fn finish(
    m: &crate::metrics::Metrics,
    a: &Active,
    reason: FinishReason,
    error: String,
) -> GenerateEvent {
    let output = a.stopper.output();
    m.finished(
        reason,
        a.req.input_ids.len(),
        output.len(),
        a.acc.first_token.map(|d| d.as_secs_f64()),
        a.req.queued.elapsed().as_secs_f64(),
    );
    let stats = a.acc.stats(
        a.req.input_ids.len(),
        output.len(),
        a.started.elapsed(),
        a.req.queued.elapsed(),
    );
    final_event(&a.req, output, &a.stopper.text, stats, reason, error)
}

/// A micro-batch's step, finished: its lane, what was sent (who rode it, with the tokens each
/// brought), when it started, and what came back.
struct Landed {
    lane: usize,
    seqs: Vec<StepSeq>,
    started: Instant,
    res: crate::Result<crate::pipeline::StepResult>,
}

/// The micro-batches in flight.
#[derive(Default)]
struct Flight {
    set: JoinSet<Landed>,
    /// Per lane: a step in flight.
    busy: Vec<bool>,
    /// A step failed: no new step starts until the others are back, then the pipeline recovers.
    fault: Option<crate::Error>,
    /// Sequences to free on the workers, carried by the next step (or freed directly when none).
    release: Vec<u64>,
}

impl Scheduler {
    /// A scheduler over `p`, with no failures behind it.
    pub fn new(p: SchedulerParts) -> Self {
        let mut s = Scheduler {
            rx: p.rx,
            pipeline: p.pipeline,
            tokenizer: p.tokenizer,
            waiting_count: p.waiting_count,
            eos: p.eos,
            limits: p.limits,
            max_recoveries: p.max_recoveries,
            failures: 0,
            resync: false,
            metrics: p.metrics,
            spec: p.spec,
            cost: PassCost::default(),
            draft_ms: 0.0,
            blocks: BlockPool::new(0, 1, false),
            preempted: VecDeque::new(),
            host_free: Vec::new(),
            swaps: Default::default(),
            host_emptied: Vec::new(),
            host_prefixes: Default::default(),
            host_prefix_order: VecDeque::new(),
        };
        s.reset_blocks(&mut []);
        s
    }

    /// Runs until every request sender is gone.
    pub async fn run(mut self) {
        let mut active: Vec<Active> = Vec::new();
        let mut waiting: VecDeque<SeqRequest> = VecDeque::new();
        let mut fl = Flight::default();
        let mut closed = false;
        loop {
            self.gauges(&active);
            if active.is_empty()
                && waiting.is_empty()
                && self.preempted.is_empty()
                && fl.set.is_empty()
            {
                self.flush_release(&mut fl).await;
                if closed {
                    return;
                }
                // Idle: every few seconds check that the workers still hold their assignments, so
                // a worker restarted while nothing ran is assigned again before a job needs it.
                match tokio::time::timeout(IDLE_CHECK, self.rx.recv()).await {
                    Ok(Some(r)) => waiting.push_back(r),
                    Ok(None) => return,
                    Err(_) => {
                        if !self.pipeline.intact().await {
                            self.resync = true;
                            let _ = self.resync_now().await;
                        }
                        match self.pipeline.regrow().await {
                            // A new plan: the workers' pools are new, nothing cached holds.
                            Ok(true) => self.reset_blocks(&mut []),
                            Ok(false) => {}
                            Err(e) => {
                                tracing::warn!(error = %e, "planning over every worker again failed")
                            }
                        }
                        continue;
                    }
                }
            }
            while let Ok(r) = self.rx.try_recv() {
                waiting.push_back(r);
            }
            while let Some(done) = fl.set.try_join_next() {
                self.landed(done, &mut active, &mut fl).await;
            }
            if fl.fault.is_some() {
                // Wait for every micro-batch in flight, then recover and replay them all.
                if let Some(done) = fl.set.join_next().await {
                    self.landed(done, &mut active, &mut fl).await;
                    continue;
                }
                let e = fl.fault.take().expect("checked");
                fl.busy.iter_mut().for_each(|b| *b = false);
                fl.release.clear();
                self.after_fault(&mut active, e).await;
                continue;
            }
            // Preempted sequences first (their prompt and output so far), then the queue.
            let mut needs: Vec<usize> =
                self.preempted.iter().map(|a| self.blocks_to_admit(a.known())).collect();
            // `n` > 1: a choice waits while its sibling prefills the same prompt, then finds the
            // prompt's blocks in the prefix cache (computed once).
            if !waiting.front().is_some_and(|r| self.sibling_prefilling(r, &active)) {
                needs.extend(waiting.iter().map(|r| {
                    let resumed: usize = r.journaled.iter().map(Vec::len).sum();
                    self.blocks_to_admit(r.input_ids.len() + resumed)
                }));
            }
            // What the running sequences' next steps take is not free for newcomers (else a
            // newcomer would be preempted as soon as it is admitted).
            let growth: usize = active.iter().map(|a| self.next_growth(a)).sum();
            let free = self.blocks.available().saturating_sub(growth);
            for _ in 0..admit(active.len(), free, &needs, self.limits) {
                let mut a = match self.preempted.pop_front() {
                    Some(a) => a,
                    None => {
                        let req = waiting.pop_front().expect("admitted from the queue");
                        self.waiting_count.fetch_sub(1, Ordering::SeqCst);
                        let stopper = Stopper::new(&req.params, &self.eos);
                        let mut a = Active {
                            req,
                            pos: 0,
                            stopper,
                            acc: Acc::default(),
                            started: Instant::now(),
                            lane: None,
                            acceptance: Acceptance::default(),
                            next_draft: Default::default(),
                            refeed: false,
                            blocks: SeqBlocks::default(),
                            base: 0,
                            swapped: Vec::new(),
                            forced: 0,
                            scores: Vec::new(),
                            scores_sent: false,
                        };
                        if let Some((r, err)) = output::replay(&self.tokenizer, &mut a).await {
                            let mut ev = finish(&self.metrics, &a, r, err);
                            output::tool_calls(&self.tokenizer, &a, &mut ev);
                            let _ = a.req.events.send(ev).await;
                            continue;
                        }
                        a
                    }
                };
                self.resume(&mut a);
                self.start_sequence(&mut a);
                active.push(a);
            }
            self.drop_cancelled(&mut active, &mut waiting, &mut fl);
            self.gauges(&active);
            if fl.set.is_empty() {
                if active.is_empty() {
                    self.flush_release(&mut fl).await;
                    continue;
                }
                if self.resync {
                    if let Err(e) = self.resync_now().await {
                        self.fail_all(&mut active, &e.to_string()).await;
                        continue;
                    }
                }
            }
            let in_flight: Vec<bool> = active
                .iter()
                .map(|a| a.lane.is_some_and(|l| fl.busy.get(l).copied().unwrap_or(false)))
                .collect();
            for a in self.make_room(&mut active, &in_flight) {
                if a.swapped.is_empty() {
                    // Replayed from its prompt: the workers forget it.
                    fl.release.push(a.req.seq_id);
                }
                self.preempted.push_front(a);
            }
            self.preempted.make_contiguous().sort_by_key(|a| a.req.seq_id);
            if let Err(e) = self.flush_swaps().await {
                fl.fault.get_or_insert(e);
                continue;
            }
            self.launch(&mut active, &mut fl);
            if fl.set.is_empty() {
                self.flush_release(&mut fl).await;
            }
            tokio::select! {
                Some(done) = fl.set.join_next() => self.landed(done, &mut active, &mut fl).await,
                r = self.rx.recv(), if !closed => match r {
                    Some(r) => waiting.push_back(r),
                    None => closed = true,
                },
                else => {}
            }
        }
    }

    /// Frees, directly, what no step in flight will carry.
    async fn flush_release(&self, fl: &mut Flight) {
        let ids = std::mem::take(&mut fl.release);
        self.pipeline.release(ids).await;
    }

    fn gauges(&self, active: &[Active]) {
        self.metrics.running.set(active.len() as i64);
        self.metrics.waiting.set(self.waiting_count.load(Ordering::SeqCst) as i64);
    }

    /// Ends the waiting and running requests that were cancelled or whose client went away (a
    /// running one only between its steps); their caches are freed by the next step.
    fn drop_cancelled(
        &mut self,
        active: &mut Vec<Active>,
        waiting: &mut VecDeque<SeqRequest>,
        fl: &mut Flight,
    ) {
        waiting.retain(|r| {
            let gone = r.cancel.load(Ordering::Relaxed) || r.events.is_closed();
            if gone {
                self.waiting_count.fetch_sub(1, Ordering::SeqCst);
                let e2e = r.queued.elapsed().as_secs_f64();
                self.metrics.finished(FinishReason::Cancelled, r.input_ids.len(), 0, None, e2e);
                let _ = r.events.try_send(final_event(
                    r,
                    &[],
                    "",
                    Acc::default().stats(
                        r.input_ids.len(),
                        0,
                        Default::default(),
                        r.queued.elapsed(),
                    ),
                    FinishReason::Cancelled,
                    String::new(),
                ));
            }
            !gone
        });
        let mut i = 0;
        while i < active.len() {
            let a = &active[i];
            let in_flight = a.lane.is_some_and(|l| fl.busy.get(l).copied().unwrap_or(false));
            if !in_flight && (a.req.cancel.load(Ordering::Relaxed) || a.req.events.is_closed()) {
                let mut a = active.remove(i);
                self.free_blocks(&mut a);
                let _ = a.req.events.try_send(finish(
                    &self.metrics,
                    &a,
                    FinishReason::Cancelled,
                    String::new(),
                ));
                tracing::info!(seq = a.req.seq_id, "sequence cancelled; freeing its KV cache");
                fl.release.push(a.req.seq_id);
            } else {
                i += 1;
            }
        }
    }

    /// Brings the workers back to a known state after a fault (see `Pipeline::recover`).
    async fn resync_now(&mut self) -> crate::Result<()> {
        match self.pipeline.recover(self.pipeline.deadline.current(1), true).await {
            Ok(()) => {
                self.resync = false;
                self.reset_blocks(&mut []);
                Ok(())
            }
            Err(e) => {
                tracing::error!(error = %e, "the workers are not back yet");
                Err(e)
            }
        }
    }

    /// Ends every active sequence with `error` and frees what the workers still hold of them.
    async fn fail_all(&mut self, active: &mut Vec<Active>, error: &str) {
        let ids: Vec<u64> = active.iter().map(|a| a.req.seq_id).collect();
        self.reset_blocks(active);
        for a in active.drain(..) {
            let _ = a
                .req
                .events
                .send(finish(&self.metrics, &a, FinishReason::Error, error.to_owned()))
                .await;
        }
        self.pipeline.release(ids).await;
    }

    /// A step failed: recover the pipeline and replay every active sequence from position 0 (the
    /// coordinator holds their prompts and outputs), or, when that cannot help, fail them naming
    /// the worker and what happened.
    async fn after_fault(&mut self, active: &mut Vec<Active>, e: crate::Error) {
        self.failures += 1;
        if e.is_permanent() || self.failures > self.max_recoveries {
            tracing::error!(error = %e, failures = self.failures, "step failed; ending every active sequence");
            let msg = if e.is_permanent() {
                e.to_string()
            } else {
                format!("{e} (after {} recoveries in a row)", self.failures - 1)
            };
            self.failures = 0;
            self.resync = true;
            self.fail_all(active, &msg).await;
            return;
        }
        tracing::warn!(error = %e, attempt = self.failures, sequences = active.len(), "step failed; recovering the workers and replaying the sequences in flight");
        // A worker that missed a whole step deadline had its chance: one probe decides. Otherwise
        // a dead worker gets one step deadline to be restarted (by `up`, or an orchestrator).
        // A stalled worker may come back (SIGCONT, a long GC): its jobs fail within the deadline,
        // and only a later resync plans around it if it still does not answer.
        let (wait, replan) = match e {
            crate::Error::StepTimeout { .. } => (Duration::ZERO, false),
            _ => (self.pipeline.deadline.current(1), true),
        };
        match self.pipeline.recover(wait, replan).await {
            Ok(()) => {
                self.reset_blocks(active);
                for a in active.iter_mut() {
                    a.pos = 0;
                    a.acc.replays += 1;
                    a.next_draft = Default::default();
                    a.refeed = false;
                }
            }
            Err(e2) => {
                self.resync = true;
                self.fail_all(active, &format!("{e}; then {e2}")).await;
            }
        }
    }
}
