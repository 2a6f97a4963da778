//! The scheduler's decisions, without I/O: the queue, the running and preempted sequences, the KV
//! block manager and host tier, the drafter's settings and what failed. The shell (`Scheduler`)
//! feeds it requests, asks it for lane steps (`plan`), hands it what came back (`apply`) and
//! delivers the events it returns; it never awaits anything, so unit tests drive it with made-up
//! step results and no worker.

use super::active::Active;
use super::{admit, output, Limits, SeqRequest};
use crate::stats::Acc;
use layerstream_model::Tokenizer;
use layerstream_rpc::v1::{generate_event, FinalEvent, GenerateEvent, StepSeq};
use layerstream_serving::kv_blocks::BlockPool;
use layerstream_serving::spec::{PassCost, SpecMode};
use layerstream_serving::FinishReason;
use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use tokio::sync::mpsc;
use tracing::Span;

/// KV block moves: (from, to) pairs of a device block and a host slot.
pub(crate) type Moves = Vec<(u32, u32)>;

/// The drafter (`--spec`), the most it drafts per sequence per step (`--spec-max`) and the draft
/// model's tree width (`--spec-width`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SpecConfig {
    pub mode: SpecMode,
    pub max: usize,
    pub width: usize,
}

/// The workers' host-RAM tier for KV blocks, as the scheduler tracks it.
#[derive(Debug, Default)]
pub(crate) struct HostTier {
    /// Free slots (never used, or emptied by a finished copy back).
    free: Vec<u32>,
    /// Moves to make before the next step: device block → host slot, host slot → device block.
    pub(crate) out: Moves,
    pub(crate) back: Moves,
    /// Slots the pending moves back will empty (free once the moves are made).
    pub(crate) emptied: Vec<u32>,
    /// Prefix blocks evicted from the device into the tier: key → slot, and the keys oldest first.
    pub(crate) prefixes: HashMap<u64, u32>,
    pub(crate) prefix_order: VecDeque<u64>,
}

impl HostTier {
    /// An empty tier of `slots` slots.
    pub(crate) fn new(slots: usize) -> Self {
        HostTier { free: (0..slots as u32).rev().collect(), ..Default::default() }
    }

    /// Slots a preemption may take: free ones and those holding cached prefixes.
    pub(crate) fn available(&self) -> usize {
        self.free.len() + self.prefixes.len()
    }

    /// A free slot: a never-used or emptied one, else the oldest cached prefix block's.
    pub(crate) fn slot(&mut self) -> Option<u32> {
        if let Some(s) = self.free.pop() {
            return Some(s);
        }
        while let Some(key) = self.prefix_order.pop_front() {
            if let Some(s) = self.prefixes.remove(&key) {
                return Some(s);
            }
        }
        None
    }

    /// The pending moves, taken to be made; the slots they empty become free once they are.
    pub(crate) fn take_moves(&mut self) -> Option<(Moves, Moves)> {
        if self.out.is_empty() && self.back.is_empty() {
            return None;
        }
        Some((std::mem::take(&mut self.out), std::mem::take(&mut self.back)))
    }

    /// The moves taken were made.
    pub(crate) fn moved(&mut self) {
        self.free.append(&mut self.emptied);
    }
}

/// An event for a request's stream. `try_only`: delivered only if the stream has room now (a
/// cancelled request's end, which nobody may be reading).
pub struct Event {
    pub(crate) to: mpsc::Sender<GenerateEvent>,
    pub(crate) ev: GenerateEvent,
    pub(crate) try_only: bool,
}

/// A step for one lane (micro-batch): who rides it with which tokens, one `step` span per
/// request (the first carries the workers' spans), and the sequences the workers free first.
pub struct LaneStep {
    pub(crate) lane: usize,
    pub(crate) seqs: Vec<StepSeq>,
    pub(crate) spans: Vec<Span>,
    pub(crate) release: Vec<u64>,
}

impl LaneStep {
    /// Rows (positions) the step computes.
    pub(crate) fn rows(&self) -> usize {
        self.seqs.iter().map(|s| s.token_ids.len()).sum()
    }
}

/// What to do after a failed step.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Recovery {
    /// End every active sequence with this message.
    Fail(String),
    /// Recover the workers and replay the active sequences. `probe_only`: a worker that missed a
    /// whole step deadline had its chance (one probe decides, no replanning); otherwise a dead
    /// worker gets a step deadline to come back and the plan may change.
    Replay { probe_only: bool },
}

/// What a core is made of.
pub struct CoreParts {
    pub(crate) tokenizer: Arc<Tokenizer>,
    /// Waiting sequences, shared with the service that admits requests against `--queue-size`.
    pub(crate) waiting_count: Arc<AtomicUsize>,
    /// The model's end-of-sequence ids.
    pub(crate) eos: Vec<u32>,
    pub(crate) limits: Limits,
    /// Recoveries in a row allowed before the sequences in flight fail (`--max-recoveries`).
    pub(crate) max_recoveries: u32,
    pub(crate) metrics: Arc<crate::metrics::Metrics>,
    pub(crate) spec: SpecConfig,
}

/// The decisions' state.
pub struct Core {
    pub(crate) tokenizer: Arc<Tokenizer>,
    waiting_count: Arc<AtomicUsize>,
    eos: Vec<u32>,
    pub(crate) limits: Limits,
    max_recoveries: u32,
    /// Failed steps since the last good one.
    pub(crate) failures: u32,
    /// Counters, latencies and the last steps (Prometheus `/metrics`, the live page).
    pub(crate) metrics: Arc<crate::metrics::Metrics>,
    pub(crate) spec: SpecConfig,
    /// Measured step time by positions (what a longer draft costs), drafting excluded.
    pub(crate) cost: PassCost,
    /// The head's draft model's milliseconds per level of drafting (its own running estimate).
    pub(crate) draft_ms: f64,
    /// The paged KV cache's block manager (see `kv`), and the host tier.
    pub(crate) blocks: BlockPool,
    pub(crate) host: HostTier,
    pub(crate) active: Vec<Active>,
    pub(crate) waiting: VecDeque<SeqRequest>,
    /// Sequences preempted for KV blocks, oldest first: admitted again before anything waiting.
    pub(crate) preempted: VecDeque<Active>,
    /// Per lane: a step in flight.
    pub(crate) busy: Vec<bool>,
    /// Sequences to free on the workers, carried by the next step (or freed directly when none).
    pub(crate) release: Vec<u64>,
    /// A step failed: no new step starts until the others are back, then the workers recover.
    pub(crate) fault: Option<crate::Error>,
}

impl Core {
    /// A core with nothing queued, running or failed.
    pub fn new(p: CoreParts) -> Self {
        let mut c = Core {
            tokenizer: p.tokenizer,
            waiting_count: p.waiting_count,
            eos: p.eos,
            limits: p.limits,
            max_recoveries: p.max_recoveries,
            failures: 0,
            metrics: p.metrics,
            spec: p.spec,
            cost: PassCost::default(),
            draft_ms: 0.0,
            blocks: BlockPool::new(0, 1, false),
            host: HostTier::default(),
            active: Vec::new(),
            waiting: VecDeque::new(),
            preempted: VecDeque::new(),
            busy: Vec::new(),
            release: Vec::new(),
            fault: None,
        };
        c.forget_workers();
        c
    }

    /// A request joins the queue.
    pub fn enqueue(&mut self, r: SeqRequest) {
        self.waiting.push_back(r);
    }

    /// Nothing queued, running, preempted or in flight.
    pub fn idle(&self) -> bool {
        self.active.is_empty() && self.waiting.is_empty() && self.preempted.is_empty()
    }

    /// Sequences running (admitted, not preempted).
    pub fn running(&self) -> usize {
        self.active.len()
    }

    /// The sequences to free on the workers, taken to be freed now.
    pub fn take_release(&mut self) -> Vec<u64> {
        std::mem::take(&mut self.release)
    }

    /// Updates the running and waiting gauges.
    pub fn gauges(&self) {
        self.metrics.running.set(self.active.len() as i64);
        self.metrics.waiting.set(self.waiting_count.load(Ordering::SeqCst) as i64);
    }

    /// Admits what fits — preempted sequences first (their prompt and output so far), then the
    /// queue — within the batch limit and the KV blocks the running sequences' next steps leave.
    /// Returns the events of requests resumed from the journal (one that had ended there ends).
    pub fn admit(&mut self) -> Vec<Event> {
        let mut events = Vec::new();
        let mut needs: Vec<usize> =
            self.preempted.iter().map(|a| self.blocks_to_admit(a.known())).collect();
        // `n` > 1: a choice waits while its sibling prefills the same prompt, then finds the
        // prompt's blocks in the prefix cache (computed once).
        if !self.waiting.front().is_some_and(|r| self.sibling_prefilling(r)) {
            needs.extend(self.waiting.iter().map(|r| {
                let resumed: usize = r.journaled.iter().map(Vec::len).sum();
                self.blocks_to_admit(r.input_ids.len() + resumed)
            }));
        }
        // What the running sequences' next steps take is not free for newcomers (else a
        // newcomer would be preempted as soon as it is admitted).
        let growth: usize = self.active.iter().map(|a| self.next_growth(a)).sum();
        let free = self.blocks.available().saturating_sub(growth);
        for _ in 0..admit(self.active.len(), free, &needs, self.limits) {
            let mut a = match self.preempted.pop_front() {
                Some(a) => a,
                None => {
                    let req = self.waiting.pop_front().expect("admitted from the queue");
                    self.waiting_count.fetch_sub(1, Ordering::SeqCst);
                    let mut a = Active::new(req, &self.eos);
                    if let Some((r, err)) = output::replay(&self.tokenizer, &mut a, &mut events) {
                        events.push(self.ended(&a, r, err));
                        continue;
                    }
                    a
                }
            };
            self.resume(&mut a);
            self.start_sequence(&mut a);
            self.active.push(a);
        }
        events
    }

    /// Ends the waiting and running requests that were cancelled or whose client went away (a
    /// running one only between its steps); their caches are freed by the next step.
    pub fn drop_cancelled(&mut self) -> Vec<Event> {
        let mut events = Vec::new();
        let (waiting_count, metrics) = (&self.waiting_count, &self.metrics);
        self.waiting.retain(|r| {
            if !r.gone() {
                return true;
            }
            waiting_count.fetch_sub(1, Ordering::SeqCst);
            let e2e = r.queued.elapsed();
            metrics.finished(
                FinishReason::Cancelled,
                r.input_ids.len(),
                0,
                None,
                e2e.as_secs_f64(),
            );
            let stats = Acc::default().stats(r.input_ids.len(), 0, Default::default(), e2e);
            let ev = final_event(r, &[], "", stats, FinishReason::Cancelled, String::new());
            events.push(Event { to: r.events.clone(), ev, try_only: true });
            false
        });
        let mut i = 0;
        while i < self.active.len() {
            let a = &self.active[i];
            if !self.in_flight(a) && a.req.gone() {
                let mut a = self.active.remove(i);
                self.free_blocks(&mut a);
                let mut e = self.ended(&a, FinishReason::Cancelled, String::new());
                e.try_only = true;
                events.push(e);
                tracing::info!(seq = a.req.seq_id, "sequence cancelled; freeing its KV cache");
                self.release.push(a.req.seq_id);
            } else {
                i += 1;
            }
        }
        events
    }

    /// Whether `a` rides a step in flight.
    pub(crate) fn in_flight(&self, a: &Active) -> bool {
        a.lane.is_some_and(|l| self.busy.get(l).copied().unwrap_or(false))
    }

    /// A step failed, or its task was lost: the fault is kept until every step in flight is back.
    pub fn failed(&mut self, e: crate::Error) {
        self.fault.get_or_insert(e);
    }

    /// Whether a fault waits for recovery.
    pub fn fault_pending(&self) -> bool {
        self.fault.is_some()
    }

    /// The fault to recover from, once nothing is in flight any more (the shell knows when its
    /// step tasks are all back): no lane is busy, nothing waits to be freed (recovery frees all).
    pub fn take_fault(&mut self) -> Option<crate::Error> {
        let e = self.fault.take()?;
        self.busy.iter_mut().for_each(|b| *b = false);
        self.release.clear();
        Some(e)
    }

    /// Decides what a failed step leads to: replay the active sequences after recovering the
    /// workers, or — a permanent fault, or too many recoveries in a row — end them.
    pub fn recovery(&mut self, e: &crate::Error) -> Recovery {
        self.failures += 1;
        if e.is_permanent() || self.failures > self.max_recoveries {
            let msg = if e.is_permanent() {
                e.to_string()
            } else {
                format!("{e} (after {} recoveries in a row)", self.failures - 1)
            };
            self.failures = 0;
            return Recovery::Fail(msg);
        }
        Recovery::Replay { probe_only: matches!(e, crate::Error::StepTimeout { .. }) }
    }

    /// The workers recovered with their caches empty: every active sequence is replayed from
    /// position 0 (the coordinator holds its prompt and output).
    pub fn replay_all(&mut self) {
        self.forget_workers();
        for a in &mut self.active {
            a.acc.replays += 1;
        }
    }

    /// The workers' pools were replaced (a new plan, a resync): forgets every block and the host
    /// tier; active sequences and swapped-out preempted ones are replayed from position 0.
    pub fn forget_workers(&mut self) {
        let counts = self.blocks.counts;
        self.blocks = self.fresh_blocks();
        self.blocks.counts = counts;
        self.host = HostTier::new(self.limits.host_blocks);
        for a in &mut self.active {
            a.rewind();
        }
        for a in self.preempted.iter_mut().filter(|a| !a.swapped.is_empty()) {
            a.rewind();
        }
        self.kv_gauges();
    }

    /// Ends every active sequence with `error`; returns their events and the ids the workers may
    /// still hold.
    pub fn fail_all(&mut self, error: &str) -> (Vec<Event>, Vec<u64>) {
        let ids: Vec<u64> = self.active.iter().map(|a| a.req.seq_id).collect();
        let active = std::mem::take(&mut self.active);
        let events =
            active.iter().map(|a| self.ended(a, FinishReason::Error, error.to_owned())).collect();
        self.forget_workers();
        (events, ids)
    }

    /// A sequence's final event (with its tool calls, when its request has tools), its end
    /// counted in the metrics.
    pub(crate) fn ended(&self, a: &Active, reason: FinishReason, error: String) -> Event {
        let output = a.stopper.output();
        let (queued, prompt) = (a.req.queued.elapsed(), a.req.input_ids.len());
        let first = a.acc.first_token.map(|d| d.as_secs_f64());
        self.metrics.finished(reason, prompt, output.len(), first, queued.as_secs_f64());
        let stats = a.acc.stats(prompt, output.len(), a.started.elapsed(), queued);
        let mut ev = final_event(&a.req, output, &a.stopper.text, stats, reason, error);
        output::tool_calls(&self.tokenizer, a, &mut ev);
        Event { to: a.req.events.clone(), ev, try_only: false }
    }
}

/// A request's final event.
pub(crate) fn final_event(
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
