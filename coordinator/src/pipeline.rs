//! One forward step through the worker pipeline — StepRequest to each worker in order, hidden states
//! passed along, sampled tokens from the last, trace context in metadata — and what keeps the
//! pipeline whole (several steps — micro-batches — may be in flight, see `Runner`): a step deadline derived from measured steps, and `recover`, which after a failed
//! step brings every worker back to a known state (a worker that lost its assignment, e.g. because
//! it was restarted, is assigned again; the others free every sequence) so the scheduler can replay
//! the sequences in flight; a worker that does not come back is planned around when the others can
//! hold the model (and planned in again once it answers). Errors name the worker and what happened.

use crate::error::{Error, Result};
use crate::planner::{PlanOptions, WorkerSpec};
use layerstream_model::Manifest;
use layerstream_rpc::auth::Authed;
use layerstream_rpc::v1::worker_client::WorkerClient;
use layerstream_rpc::v1::{
    AssignResponse, Assignment, InfoRequest, InfoResponse, LayerTiming, Plan, ReleaseRequest,
    SeqResult, StepRequest, StepSeq,
};
use layerstream_telemetry::traced_request;
use std::collections::VecDeque;
use std::sync::{Arc, RwLock};
use std::time::{Duration, Instant};
use tracing::Span;

/// A client of one worker (with the internal token attached when one is set).
pub type WorkerConn = WorkerClient<Authed>;

/// One worker of the pipeline: its address, client and the assignment it should hold.
#[derive(Clone)]
pub struct WorkerLink {
    pub(crate) addr: String,
    pub(crate) client: WorkerConn,
    pub(crate) assignment: Assignment,
    /// Its host id (see `RegisteredWorker::host_id`).
    pub(crate) host: String,
}

/// The step deadline: fixed by `--step-timeout`, or derived from measured steps (each with the
/// rows it carried).
#[derive(Debug, Clone)]
pub struct Deadline {
    fixed: Option<Duration>,
    recent: VecDeque<(Duration, usize)>,
}

impl Deadline {
    /// Steps remembered for the derived deadline.
    const WINDOW: usize = 64;
    /// The derived deadline never goes below this.
    pub const FLOOR: Duration = Duration::from_secs(30);
    /// Before any step was measured (the first steps read cold weights).
    pub const UNMEASURED: Duration = Duration::from_secs(300);

    /// A deadline fixed at `fixed`, or derived when `None`.
    pub fn new(fixed: Option<Duration>) -> Self {
        Deadline { fixed, recent: VecDeque::new() }
    }

    /// The deadline of a step of `rows` rows: the fixed one, or 10 × the slowest recent step —
    /// or, for a step carrying more rows than those did (a burst of prompts after single-token
    /// steps: on a CPU, a large model's batched prefill takes many decode steps' time), up to
    /// 10 × the slowest recent time per row × `rows`, capped at `UNMEASURED` — at least `FLOOR`.
    pub fn current(&self, rows: usize) -> Duration {
        if let Some(f) = self.fixed {
            return f;
        }
        let Some(&(slowest, _)) = self.recent.iter().max_by_key(|r| r.0) else {
            return Self::UNMEASURED;
        };
        let per_row =
            self.recent.iter().map(|&(t, n)| t / n.max(1) as u32).max().unwrap_or_default();
        let scaled = per_row
            .saturating_mul(rows.min(u32::MAX as usize) as u32)
            .saturating_mul(10)
            .min(Self::UNMEASURED);
        slowest.saturating_mul(10).max(scaled).max(Self::FLOOR)
    }

    /// Remembers a completed step's duration and rows.
    pub fn record(&mut self, took: Duration, rows: usize) {
        if self.recent.len() == Self::WINDOW {
            self.recent.pop_front();
        }
        self.recent.push_back((took, rows));
    }
}

/// Every registered worker, and what the planner needs to plan over any subset of them.
pub struct Roster {
    pub(crate) workers: Vec<RegisteredWorker>,
    pub(crate) manifest: Manifest,
    pub(crate) opts: PlanOptions,
    /// The plan in force, shared with GetPlan and ListWorkers.
    pub(crate) current: Arc<RwLock<Plan>>,
    /// `--micro-batches`.
    pub(crate) micro_batches: crate::lanes::MicroBatches,
}

/// A worker the coordinator registered at start: where it is, what it said about itself, a client.
#[derive(Clone)]
pub struct RegisteredWorker {
    /// Address and memory budget, as the planner sees them.
    pub(crate) spec: WorkerSpec,
    /// Its device, as it describes it (`cpu`, `cuda:0`).
    pub(crate) device: String,
    /// Its host id (`InfoResponse.host_id`): neighbours with the same one hand hidden states over
    /// in shared memory.
    pub(crate) host_id: String,
    pub(crate) conn: WorkerConn,
}

/// The workers in layer order.
pub struct Pipeline {
    pub(crate) stages: Vec<WorkerLink>,
    pub(crate) deadline: Deadline,
    pub(crate) roster: Roster,
    /// One lock per stage: a worker runs one step at a time, micro-batches in the order they came.
    pub(crate) locks: Arc<[tokio::sync::Mutex<()>]>,
    /// Micro-batches in flight under the plan in force (see `lanes::choose`).
    pub(crate) micro_batches: usize,
    /// Hand hidden states between neighbours on one host through shared memory (else gRPC bytes).
    pub(crate) shm_handoff: bool,
}

/// One step's way through the workers, detached from the pipeline so that several micro-batches
/// can be in flight at once: worker k runs one while worker k-1 runs the next. Each worker takes
/// one step at a time (its lock, FIFO), and each hidden state goes on to the next worker as soon
/// as it arrives, not when the whole batch is through.
#[derive(Clone)]
pub struct Runner {
    stages: Arc<[WorkerLink]>,
    locks: Arc<[tokio::sync::Mutex<()>]>,
    timeout: Duration,
    shm_handoff: bool,
}

/// The result of a step.
#[derive(Debug, Default)]
pub struct StepResult {
    /// Per sequence, in the step's order: its tokens (one, or after a draft the accepted drafts
    /// and the token after them), log-probabilities, scores and the head's next draft.
    pub(crate) seqs: Vec<SeqResult>,
    /// The time the head spent drafting.
    pub(crate) draft_ms: f64,
    /// The head's estimate of one level of drafting (0: not measured yet).
    pub(crate) draft_level_ms: f64,
    pub(crate) layers: Vec<LayerTiming>,
    /// Wall time of the workers' layer passes, summed over workers.
    pub(crate) layers_ms: f64,
    /// Each worker's share, in pipeline order.
    pub(crate) workers: Vec<WorkerStep>,
}

/// One worker's share of a step.
#[derive(Debug, Clone)]
pub struct WorkerStep {
    pub(crate) address: String,
    /// Its layers' timings.
    pub(crate) layers: Vec<LayerTiming>,
    /// Its wall time for the step, in ms.
    pub(crate) wall_ms: f64,
}

/// How long one probe of a worker (Info, Release) may take.
const PROBE: Duration = Duration::from_secs(2);
/// How long loading an assignment may take (resident layers of a large model read from disk).
const ASSIGN: Duration = Duration::from_secs(600);

fn worker_err(addr: &str, s: &tonic::Status) -> Error {
    let msg = format!("failed: {} ({:?})", s.message(), s.code());
    if s.code() == tonic::Code::DataLoss {
        // Corrupt weights: replaying would read the same bytes again.
        return Error::Corrupt { worker: addr.into(), msg };
    }
    Error::Worker { worker: addr.into(), msg }
}

/// Loads `stage.assignment` on its worker (traced under `span`, the plan's); the answer carries the
/// worker's step-token limit.
pub async fn assign(stage: &WorkerLink, span: &Span) -> Result<AssignResponse> {
    let mut c = stage.client.clone();
    let refused = |msg: String| Error::Worker {
        worker: stage.addr.clone(),
        msg: format!("refused its assignment: {msg}"),
    };
    Ok(tokio::time::timeout(ASSIGN, c.assign(traced_request(span, stage.assignment.clone())))
        .await
        .map_err(|_| refused(format!("no answer within {ASSIGN:?}")))?
        .map_err(|s| refused(s.message().to_owned()))?
        .into_inner())
}

/// Asks a worker what it holds, within `PROBE`.
pub async fn probe(client: &WorkerConn) -> std::result::Result<InfoResponse, String> {
    let mut c = client.clone();
    match tokio::time::timeout(PROBE, c.info(InfoRequest {})).await {
        Ok(Ok(r)) => Ok(r.into_inner()),
        Ok(Err(s)) => Err(format!("{} ({:?})", s.message(), s.code())),
        Err(_) => Err(format!("no answer within {PROBE:?} (stalled?)")),
    }
}

impl Runner {
    /// Runs `seqs` (micro-batch `lane`) through every worker under `span`, each worker first freeing
    /// the sequences in `release`, each worker's call within the step deadline (waiting for a worker busy with another micro-batch does not count).
    pub async fn step(
        self,
        seqs: Vec<StepSeq>,
        release: Vec<u64>,
        span: Span,
        lane: usize,
    ) -> Result<StepResult> {
        let (mut hidden, mut hidden_ref) = (Vec::new(), None);
        let mut out = StepResult::default();
        let last = self.stages.len() - 1;
        for (i, st) in self.stages.iter().enumerate() {
            // The next worker on the same host reads this one's output from shared memory.
            let to_shm = self.shm_handoff
                && i < last
                && !st.host.is_empty()
                && self.stages[i + 1].host == st.host;
            let _turn = self.locks[i].lock().await;
            // One span per worker call: micro-batches on different workers overlap in the trace.
            let call = tracing::info_span!(parent: &span, "stage", worker = %st.addr, micro_batch = lane as i64, seqs = seqs.len() as i64);
            let req = traced_request(
                &call,
                StepRequest {
                    seqs: seqs.clone(),
                    hidden: std::mem::take(&mut hidden),
                    release: release.clone(),
                    micro_batch: lane as u32,
                    hidden_out_shm: to_shm,
                    hidden_ref: hidden_ref.take(),
                },
            );
            let mut c = st.client.clone();
            let timeout = self.timeout;
            let resp = tokio::time::timeout(timeout, c.step(req))
                .await
                .map_err(|_| Error::StepTimeout { worker: st.addr.clone(), timeout })?
                .map_err(|s| worker_err(&st.addr, &s))?
                .into_inner();
            drop(call);
            out.layers.extend(resp.layers.iter().cloned());
            out.layers_ms += resp.layers_ms;
            out.workers.push(WorkerStep {
                address: st.addr.clone(),
                layers: resp.layers,
                wall_ms: resp.wall_ms,
            });
            if i == last {
                out.seqs = check_results(&seqs, resp.results)
                    .map_err(|msg| Error::Worker { worker: st.addr.clone(), msg })?;
                out.draft_ms = resp.draft_ms;
                out.draft_level_ms = resp.draft_level_ms;
            } else {
                hidden = resp.hidden;
                hidden_ref = resp.hidden_ref;
            }
        }
        Ok(out)
    }
}

/// The last worker's per-sequence results, checked against what the step sent: one per
/// sequence in order, 1 ..= draft + 1 tokens, log-probabilities none or one per token, a draft
/// within what was asked with a parent before each child, one score per id to score.
pub(crate) fn check_results(
    seqs: &[StepSeq],
    results: Vec<SeqResult>,
) -> std::result::Result<Vec<SeqResult>, String> {
    if results.len() != seqs.len() {
        return Err(format!("returned {} results for {} sequences", results.len(), seqs.len()));
    }
    for (s, r) in seqs.iter().zip(&results) {
        let n = r.tokens.len();
        let bad = if r.seq_id != s.seq_id {
            format!("a result for sequence {} in place of {}", r.seq_id, s.seq_id)
        } else if n == 0 || n > s.draft_len as usize + 1 {
            format!("{n} tokens after a draft of {}", s.draft_len)
        } else if !r.logprobs.is_empty() && r.logprobs.len() != n {
            format!("{} log-probabilities for {n} tokens", r.logprobs.len())
        } else if r.drafts.len() > s.draft_next as usize || r.draft_parents.len() != r.drafts.len()
        {
            let (d, p) = (r.drafts.len(), r.draft_parents.len());
            format!("{d} drafted tokens with {p} parents where {} were asked", s.draft_next)
        } else if r.draft_parents.iter().enumerate().any(|(i, &x)| x as usize > i) {
            "a draft tree whose parent follows its child".into()
        } else if r.scores.len() != s.score_ids.len() {
            format!("{} scores for {} ids", r.scores.len(), s.score_ids.len())
        } else {
            continue;
        };
        return Err(format!("returned {bad} (sequence {})", s.seq_id));
    }
    Ok(results)
}

impl Pipeline {
    /// Plans over the registered workers at `members` (indices into the roster), assigns every one
    /// of them, and makes that the pipeline; returns the smallest step-token limit they report
    /// (0 = none).
    pub async fn plan_over(&mut self, members: &[usize]) -> Result<usize> {
        let r = &self.roster;
        let specs: Vec<WorkerSpec> = members.iter().map(|&i| r.workers[i].spec.clone()).collect();
        let mut plans = crate::planner::plan(&r.manifest, &specs, &r.opts)?;
        // One id for this plan: a worker that reports another (or none) lost it.
        let id = layerstream_rpc::auth::random_hex();
        let (micro_batches, why) = crate::lanes::choose(r.micro_batches, &plans);
        tracing::info!(micro_batches, reason = %why, "micro-batches");
        // One trace per plan: every worker's `assign` (and the loads under it) inside it.
        let span = tracing::info_span!(parent: None, "plan", workers = members.len() as i64, plan_id = %id);
        let mut stages = Vec::new();
        let mut limit = 0usize;
        for (p, &i) in plans.iter_mut().zip(members) {
            p.assignment_id = id.clone();
            p.micro_batches = micro_batches as u32;
            tracing::info!(worker = %p.worker, layers = ?(p.layer_start..p.layer_end), resident = ?p.resident, group = p.group_size, buffers = p.streaming_buffers, bytes = p.bytes_needed, prefetch = p.prefetch, "plan");
            let w = &r.workers[i];
            let stage = WorkerLink {
                addr: w.spec.address.clone(),
                client: w.conn.clone(),
                assignment: p.clone(),
                host: w.host_id.clone(),
            };
            let n = assign(&stage, &span).await?.max_step_tokens as usize;
            if n > 0 && (limit == 0 || n < limit) {
                limit = n;
            }
            stages.push(stage);
        }
        self.locks = stages.iter().map(|_| tokio::sync::Mutex::new(())).collect();
        self.stages = stages;
        self.micro_batches = micro_batches;
        let plan = Plan {
            assignments: plans,
            num_layers: r.manifest.config.num_layers as u32,
            micro_batches: micro_batches as u32,
            micro_batches_reason: why,
        };
        *r.current.write().unwrap_or_else(std::sync::PoisonError::into_inner) = plan;
        Ok(limit)
    }

    /// Indices of the registered workers that answer a probe now.
    async fn answering(&self) -> Vec<usize> {
        let mut out = Vec::new();
        for (i, w) in self.roster.workers.iter().enumerate() {
            if probe(&w.conn).await.is_ok() {
                out.push(i);
            }
        }
        out
    }

    /// With workers planned around: when every registered worker answers again, the plan over all
    /// of them is restored (returns whether it was). For the idle check.
    pub async fn regrow(&mut self) -> Result<bool> {
        if self.stages.len() == self.roster.workers.len() {
            return Ok(false);
        }
        let all = self.answering().await;
        if all.len() == self.roster.workers.len() {
            self.plan_over(&all).await?;
            tracing::warn!(workers = all.len(), "every worker answers again: planned over all");
            return Ok(true);
        }
        Ok(false)
    }

    /// What a step of `rows` rows needs to run detached from the pipeline (several can be in
    /// flight): the stages, one FIFO lock per worker, and its deadline as it is now.
    pub fn runner(&self, rows: usize) -> Runner {
        Runner {
            stages: self.stages.clone().into(),
            locks: self.locks.clone(),
            timeout: self.deadline.current(rows),
            shm_handoff: self.shm_handoff,
        }
    }
    /// Brings every worker back to a known, empty state after a failed step: waits up to `wait`
    /// for each to answer, assigns again a worker whose assignment is gone (restarted, or dropped
    /// after a fault), and frees every sequence on the others, logging what it did; fails naming
    /// the worker that did not come back or refused. With `replan`, a worker that does not come
    /// back is planned around when the others can hold the model.
    pub async fn recover(&mut self, wait: Duration, replan: bool) -> Result<()> {
        match self.recover_stages(wait).await {
            Ok(()) => Ok(()),
            Err(gone) if !replan => Err(gone),
            Err(gone) => {
                // Plan around the workers that do not answer, if the others can hold the model.
                let alive = self.answering().await;
                if alive.is_empty() {
                    return Err(gone);
                }
                let names: Vec<&str> =
                    alive.iter().map(|&i| self.roster.workers[i].spec.address.as_str()).collect();
                let msg =
                    format!("re-planned over {} worker(s) ({})", alive.len(), names.join(", "));
                match self.plan_over(&alive).await {
                    Ok(_) => {
                        tracing::warn!("recovery: {gone}; {msg}");
                        Ok(())
                    }
                    Err(e) => Err(Error::Plan(format!(
                        "{gone}; the workers that remain cannot take its layers: {e}"
                    ))),
                }
            }
        }
    }

    async fn recover_stages(&self, wait: Duration) -> Result<()> {
        for st in &self.stages {
            let deadline = Instant::now() + wait;
            // Until the deadline: a worker still starting (or whose loader is) gets another try.
            let mut last_err = String::new();
            let acted = loop {
                if !last_err.is_empty() && Instant::now() >= deadline {
                    return Err(Error::Worker {
                        worker: st.addr.clone(),
                        msg: format!("did not come back within {wait:?}: {last_err}"),
                    });
                }
                if !last_err.is_empty() {
                    tokio::time::sleep(Duration::from_millis(200)).await;
                }
                let info = match probe(&st.client).await {
                    Ok(info) => info,
                    Err(e) => {
                        last_err = e;
                        continue;
                    }
                };
                if info.assignment_id != st.assignment.assignment_id {
                    let span = tracing::info_span!(parent: None, "reassign", worker = %st.addr);
                    match assign(st, &span).await {
                        Ok(_) => break true,
                        Err(e) => last_err = e.to_string(),
                    }
                    continue;
                }
                let mut c = st.client.clone();
                let req = ReleaseRequest { seq_ids: vec![], all: true };
                match tokio::time::timeout(PROBE, c.release(req)).await {
                    Ok(Ok(_)) => break false,
                    Ok(Err(s)) => last_err = format!("freeing its sequences: {}", s.message()),
                    Err(_) => last_err = "freeing its sequences: no answer".into(),
                }
            };
            if acted {
                tracing::warn!("recovery: assigned {} again (it held no assignment)", st.addr);
            }
        }
        Ok(())
    }

    /// Whether every worker holds its assignment (one probe each): for the idle check.
    pub async fn intact(&self) -> bool {
        for st in &self.stages {
            match probe(&st.client).await {
                Ok(i) if i.assignment_id == st.assignment.assignment_id => {}
                _ => return false,
            }
        }
        true
    }

    /// Moves KV blocks on every worker (`Worker/Swap`): `to_host` as (device block, host slot),
    /// then `to_device` as (host slot, device block). Returns the bytes moved each way, summed over
    /// the workers; fails naming the worker that refused or did not answer within the step
    /// deadline.
    pub async fn swap(
        &self,
        to_host: &[(u32, u32)],
        to_device: &[(u32, u32)],
    ) -> Result<(u64, u64)> {
        let mv = |v: &[(u32, u32)], out: bool| -> Vec<layerstream_rpc::v1::BlockMove> {
            v.iter()
                .map(|&(a, b)| {
                    let (device, host) = if out { (a, b) } else { (b, a) };
                    layerstream_rpc::v1::BlockMove { device, host }
                })
                .collect()
        };
        let req = layerstream_rpc::v1::SwapRequest {
            to_host: mv(to_host, true),
            to_device: mv(to_device, false),
        };
        let mut total = (0, 0);
        for st in &self.stages {
            let mut c = st.client.clone();
            let fail = |msg: String| Error::Worker { worker: st.addr.clone(), msg };
            let r = tokio::time::timeout(self.deadline.current(1), c.swap(req.clone()))
                .await
                .map_err(|_| fail("swapping KV blocks timed out".into()))?
                .map_err(|e| fail(format!("swapping KV blocks: {}", e.message())))?
                .into_inner();
            total = (total.0 + r.bytes_to_host, total.1 + r.bytes_to_device);
        }
        Ok(total)
    }

    /// Frees sequences on every worker (best effort: a dead worker has nothing left to free).
    pub async fn release(&self, ids: Vec<u64>) {
        if ids.is_empty() {
            return;
        }
        for st in &self.stages {
            let mut c = st.client.clone();
            let req = ReleaseRequest { seq_ids: ids.clone(), all: false };
            if let Err(e) = tokio::time::timeout(Duration::from_secs(5), c.release(req)).await {
                tracing::warn!(worker = %st.addr, error = %e, "release timed out");
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_derived_deadline_follows_the_slowest_recent_step_with_a_floor() {
        let fixed = Deadline::new(Some(Duration::from_secs(3)));
        assert_eq!(fixed.current(512), Duration::from_secs(3));
        let mut d = Deadline::new(None);
        assert_eq!(d.current(1), Deadline::UNMEASURED);
        d.record(Duration::from_millis(20), 1);
        assert_eq!(d.current(1), Deadline::FLOOR, "fast steps: the floor");
        d.record(Duration::from_secs(7), 1);
        assert_eq!(d.current(1), Duration::from_secs(70));
        for _ in 0..Deadline::WINDOW {
            d.record(Duration::from_secs(1), 1);
        }
        assert_eq!(d.current(1), Deadline::FLOOR, "the slow step left the window");
        // A burst of 20 prompt rows after one-row steps of 1 s each: 10 × 1 s × 20; of 512: the cap.
        assert_eq!(d.current(20), Duration::from_secs(200));
        assert_eq!(d.current(512), Deadline::UNMEASURED);
        d.record(Duration::from_secs(40), 512);
        assert_eq!(d.current(1), Duration::from_secs(400), "the slowest step");
    }
}
