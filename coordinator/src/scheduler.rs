//! The continuous-batching scheduler: an actor that owns the queue and the running sequences.
//! Between steps, sequences join (their prefill rides the same weight pass as running decodes) and
//! leave (finished, cancelled, or their client gone); one pipeline step serves every active sequence.
//! A step carries at most `max_step_tokens` tokens: every decode brings one, and prompts take what is
//! left, a long prompt split over several steps (chunked prefill), so a step's activations and
//! latency stay bounded however long the prompts are (admission keeps the running sequences, each a
//! decode token per step, within that count). With micro-batches (`--micro-batches`), the running
//! sequences are split into lanes whose steps are in flight at once, each lane refilled and started
//! again as soon as its step comes back (see `lanes`).
//!
//! Every decision lives in `Core` (no I/O, unit-tested in `tests` with made-up step results);
//! `Scheduler` is the shell around it: it receives requests, sends the core's lane steps through
//! the workers (`Pipeline`), hands what comes back to `Core::apply`, recovers the workers after a
//! fault, and delivers the events the core returns.

use crate::pipeline::Pipeline;
use layerstream_rpc::v1::{GenerateEvent, StepSeq};
use layerstream_serving::GenerateParams;
use std::sync::atomic::AtomicBool;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::sync::mpsc;
use tokio::task::JoinSet;
use tracing::Span;

mod active;
mod batching;
mod core;
mod kv;
mod output;
mod speculate;
mod step;
#[cfg(test)]
mod tests;

pub use self::core::{Core, CoreParts, Event, LaneStep, Recovery, SpecConfig};
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
    pub(crate) constraint: Option<Box<layerstream_serving::grammar::Constraint>>,
    /// Its output is parsed for tool calls written this way (a request with tools).
    pub(crate) tools: Option<layerstream_serving::tools::Reading>,
    /// Its prefix-cache scope (`kv_blocks::salt_of` of its `cache_salt` and tenant; 0: global):
    /// it shares cached blocks only with requests of the same salt.
    pub(crate) salt: u64,
    /// A job resumed from the journal: the events (token ids) this request had produced, fed to
    /// its stop criteria and format and shown again before it continues.
    pub(crate) journaled: Vec<Vec<u32>>,
}

/// The actor: the decisions (`Core`) and the I/O around them — the request channel, the workers
/// (`Pipeline`), the steps in flight and the events' delivery.
pub struct Scheduler {
    rx: mpsc::Receiver<SeqRequest>,
    pipeline: Pipeline,
    core: Core,
    /// The lanes' steps in flight.
    flight: JoinSet<Landed>,
    /// A fault left the workers in an unknown state: recover before the next step.
    resync: bool,
}

/// What a scheduler is made of; its own state (failure count, resync) starts fresh in `new`.
pub struct SchedulerParts {
    /// Sequences the service admitted.
    pub(crate) rx: mpsc::Receiver<SeqRequest>,
    /// The workers, planned and assigned.
    pub(crate) pipeline: Pipeline,
    pub(crate) core: CoreParts,
}

/// A lane's step, finished: what was sent, when it started, and what came back.
struct Landed {
    lane: usize,
    seqs: Vec<StepSeq>,
    started: Instant,
    res: crate::Result<crate::pipeline::StepResult>,
}

/// Delivers events to their requests' streams, in order.
async fn deliver(events: Vec<Event>) {
    for e in events {
        if e.try_only {
            let _ = e.to.try_send(e.ev);
        } else {
            let _ = e.to.send(e.ev).await;
        }
    }
}

impl Scheduler {
    /// A scheduler over `p`, with no failures behind it.
    pub fn new(p: SchedulerParts) -> Self {
        Scheduler {
            rx: p.rx,
            pipeline: p.pipeline,
            core: Core::new(p.core),
            flight: JoinSet::new(),
            resync: false,
        }
    }

    /// Runs until every request sender is gone.
    pub async fn run(mut self) {
        let mut closed = false;
        loop {
            self.core.gauges();
            if self.core.idle() && self.flight.is_empty() {
                self.flush_release().await;
                if closed {
                    return;
                }
                match tokio::time::timeout(IDLE_CHECK, self.rx.recv()).await {
                    Ok(Some(r)) => self.core.enqueue(r),
                    Ok(None) => return,
                    Err(_) => {
                        self.idle_check().await;
                        continue;
                    }
                }
            }
            while let Ok(r) = self.rx.try_recv() {
                self.core.enqueue(r);
            }
            while let Some(done) = self.flight.try_join_next() {
                self.landed(done).await;
            }
            if self.core.fault_pending() {
                // Wait for every micro-batch in flight, then recover and replay them all.
                if let Some(done) = self.flight.join_next().await {
                    self.landed(done).await;
                } else if let Some(e) = self.core.take_fault() {
                    self.after_fault(e).await;
                }
                continue;
            }
            deliver(self.core.admit()).await;
            deliver(self.core.drop_cancelled()).await;
            self.core.gauges();
            if self.flight.is_empty() {
                if self.core.running() == 0 {
                    self.flush_release().await;
                    continue;
                }
                if self.resync {
                    if let Err(e) = self.resync_now().await {
                        self.fail_all(&e.to_string()).await;
                        continue;
                    }
                }
            }
            self.core.make_room();
            if let Err(e) = self.flush_swaps().await {
                self.core.failed(e);
                continue;
            }
            for step in self.core.plan(self.pipeline.micro_batches) {
                self.send(step);
            }
            if self.flight.is_empty() {
                self.flush_release().await;
            }
            tokio::select! {
                Some(done) = self.flight.join_next() => self.landed(done).await,
                r = self.rx.recv(), if !closed => match r {
                    Some(r) => self.core.enqueue(r),
                    None => closed = true,
                },
                else => {}
            }
        }
    }

    /// Idle: checks that the workers still hold their assignments, so a worker restarted while
    /// nothing ran is assigned again before a job needs it, and plans over workers that came back.
    async fn idle_check(&mut self) {
        if !self.pipeline.intact().await {
            self.resync = true;
            let _ = self.resync_now().await;
        }
        match self.pipeline.regrow().await {
            // A new plan: the workers' pools are new, nothing cached holds.
            Ok(true) => self.core.forget_workers(),
            Ok(false) => {}
            Err(e) => tracing::warn!(error = %e, "planning over every worker again failed"),
        }
    }

    /// Sends a lane's step through the workers.
    fn send(&mut self, step: LaneStep) {
        let runner = self.pipeline.runner(step.rows());
        let LaneStep { lane, seqs, spans, release } = step;
        self.flight.spawn(async move {
            let started = Instant::now();
            let res = runner.step(seqs.clone(), release, spans[0].clone(), lane).await;
            drop(spans);
            Landed { lane, seqs, started, res }
        });
    }

    /// A lane's step came back: the deadline learns its time, the core its result.
    async fn landed(&mut self, done: Result<Landed, tokio::task::JoinError>) {
        let done = match done {
            Ok(d) => d,
            Err(e) => {
                // Not seen in practice: a step task panicked. Recover like any failed step.
                self.core.failed(crate::Error::Setup(format!("a step task failed: {e}")));
                return;
            }
        };
        let took = done.started.elapsed();
        if done.res.is_ok() {
            let rows = done.seqs.iter().map(|s| s.token_ids.len()).sum();
            self.pipeline.deadline.record(took, rows);
        }
        deliver(self.core.apply(done.lane, &done.seqs, took, done.res)).await;
    }

    /// Makes the KV block moves decided since the last step on every worker.
    async fn flush_swaps(&mut self) -> crate::Result<()> {
        let Some((out, back)) = self.core.take_swaps() else { return Ok(()) };
        let bytes = self.pipeline.swap(&out, &back).await?;
        self.core.swapped((out.len(), back.len()), bytes);
        Ok(())
    }

    /// Frees, directly, what no step in flight will carry.
    async fn flush_release(&mut self) {
        let ids = self.core.take_release();
        self.pipeline.release(ids).await;
    }

    /// Brings the workers back to a known state after a fault (see `Pipeline::recover`).
    async fn resync_now(&mut self) -> crate::Result<()> {
        match self.pipeline.recover(self.pipeline.deadline.current(1), true).await {
            Ok(()) => {
                self.resync = false;
                self.core.forget_workers();
                Ok(())
            }
            Err(e) => {
                tracing::error!(error = %e, "the workers are not back yet");
                Err(e)
            }
        }
    }

    /// Ends every active sequence with `error` and frees what the workers still hold of them.
    async fn fail_all(&mut self, error: &str) {
        let (events, ids) = self.core.fail_all(error);
        deliver(events).await;
        self.pipeline.release(ids).await;
    }

    /// A step failed: recover the pipeline and replay every active sequence from position 0 (the
    /// coordinator holds their prompts and outputs), or, when that cannot help, fail them naming
    /// the worker and what happened.
    async fn after_fault(&mut self, e: crate::Error) {
        let running = self.core.running();
        let failures = self.core.failures + 1;
        let (wait, replan) = match self.core.recovery(&e) {
            Recovery::Fail(msg) => {
                tracing::error!(error = %e, failures, "step failed; ending every active sequence");
                self.resync = true;
                self.fail_all(&msg).await;
                return;
            }
            // A stalled worker may come back (SIGCONT, a long GC): its jobs fail within the
            // deadline, and only a later resync plans around it if it still does not answer.
            Recovery::Replay { probe_only: true } => (Duration::ZERO, false),
            Recovery::Replay { probe_only: false } => (self.pipeline.deadline.current(1), true),
        };
        tracing::warn!(error = %e, attempt = failures, sequences = running, "step failed; recovering the workers and replaying the sequences in flight");
        match self.pipeline.recover(wait, replan).await {
            Ok(()) => self.core.replay_all(),
            Err(e2) => {
                self.resync = true;
                self.fail_all(&format!("{e}; then {e2}")).await;
            }
        }
    }
}
