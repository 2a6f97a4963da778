//! One step's round trip, as decisions: `plan` fills each free lane's step from its sequences
//! (prefill chunks, decodes, drafts, masks, KV blocks); `apply` takes what the workers answered —
//! tokens, drafts accepted, scores, stops, grammar — and returns the events, freeing what finished.

use super::active::{Active, Draft};
use super::core::{Core, Event, LaneStep};
use super::{output, step_tokens};
use crate::pipeline::StepResult;
use layerstream_rpc::v1::{generate_event, GenerateEvent, SeqResult, StepSeq, TokenEvent};
use layerstream_serving::spec::levels;
use std::time::Duration;
use tracing::{info_span, Span};

impl Core {
    /// Steps for every lane with no step in flight and sequences to run (the lanes refilled
    /// first, see `lanes::place`), each lane marked busy; `micro_batches` is the plan's count.
    pub fn plan(&mut self, micro_batches: usize) -> Vec<LaneStep> {
        let m = micro_batches.max(1);
        if self.busy.len() != m {
            // The plan changed the count (only ever with nothing in flight).
            self.busy = vec![false; m];
            self.metrics.micro_batches.set(m as i64);
        }
        let lanes: Vec<Option<usize>> = self.active.iter().map(|a| a.lane).collect();
        let placed = crate::lanes::place(&lanes, &self.busy);
        for (a, l) in self.active.iter_mut().zip(placed) {
            a.lane = l;
        }
        let mut active = std::mem::take(&mut self.active);
        let steps = (0..m).filter_map(|lane| self.lane_step(&mut active, lane)).collect();
        self.active = active;
        steps
    }

    /// Lane `lane`'s step, unless it is busy or has nothing to run.
    fn lane_step(&mut self, active: &mut [Active], lane: usize) -> Option<LaneStep> {
        if self.busy[lane] {
            return None;
        }
        let idx: Vec<usize> = (0..active.len()).filter(|&i| active[i].lane == Some(lane)).collect();
        let ends: Vec<(usize, usize)> =
            idx.iter().map(|&i| (active[i].pos, active[i].prefill_end())).collect();
        let shares = step_tokens(&ends, self.limits.max_step_tokens);
        // (sequence, tokens it brings) for the sequences that ride this step.
        let members: Vec<(usize, usize)> =
            idx.into_iter().zip(shares).filter(|&(_, n)| n > 0).collect();
        let mut seqs: Vec<StepSeq> =
            members.iter().map(|&(i, n)| step_seq(&active[i], n)).collect();
        self.outputs(active, &members, &mut seqs);
        self.draft(active, &members, &mut seqs);
        let members = self.take_blocks(active, members, &mut seqs);
        if seqs.is_empty() {
            return None;
        }
        let rows: usize = seqs.iter().map(|s| s.token_ids.len()).sum();
        // One `step` span per request in the step, so each request's trace shows every step it
        // rode; the first carries the workers' spans, the others link to it.
        let drafted: u32 = seqs.iter().map(|s| s.draft_len).sum();
        let spans: Vec<Span> = members.iter().map(|&(i, _)| info_span!(parent: &active[i].req.span, "step", batch = seqs.len() as i64, rows = rows as i64, micro_batch = lane as i64, spec = drafted as i64)).collect();
        for s in &spans[1..] {
            layerstream_telemetry::link(s, &spans[0]);
        }
        self.metrics.launched(self.busy.iter().filter(|&&b| b).count());
        self.busy[lane] = true;
        Some(LaneStep { lane, seqs, spans, release: self.take_release() })
    }

    /// KV blocks for every position of the step: a draft the pool cannot hold is dropped, a
    /// sequence it cannot hold at all sits this step out. Returns the members that ride.
    fn take_blocks(
        &mut self,
        active: &mut [Active],
        members: Vec<(usize, usize)>,
        seqs: &mut Vec<StepSeq>,
    ) -> Vec<(usize, usize)> {
        let mut keep = vec![true; seqs.len()];
        for (k, (&(i, _), s)) in members.iter().zip(seqs.iter_mut()).enumerate() {
            let a = &mut active[i];
            if !self.grow(a, a.pos + s.token_ids.len()) {
                let drafted = s.draft_len as usize;
                s.token_ids.truncate(s.token_ids.len() - drafted);
                (s.draft_len, s.tree_parents) = (0, Vec::new());
                keep[k] = self.grow(a, a.pos + s.token_ids.len());
            }
            s.blocks = a.blocks.table.clone();
        }
        let mut it = keep.iter();
        seqs.retain(|_| *it.next().expect("one each"));
        members.into_iter().zip(keep).filter(|&(_, k)| k).map(|(m, _)| m).collect()
    }

    /// Takes lane `lane`'s step back: `seqs` as it was sent, `took` its wall time, `res` what the
    /// workers answered. Its tokens go to their requests (finished ones end, and are freed by the
    /// next step); a failure is kept for recovery once every step in flight is back.
    pub fn apply(
        &mut self,
        lane: usize,
        seqs: &[StepSeq],
        took: Duration,
        res: crate::Result<StepResult>,
    ) -> Vec<Event> {
        if let Some(b) = self.busy.get_mut(lane) {
            *b = false;
        }
        let out = match res {
            Ok(out) => out,
            Err(e) => {
                self.failed(e);
                return Vec::new();
            }
        };
        if self.fault.is_none() {
            self.failures = 0;
        }
        self.account(seqs, took, &out);
        let StepResult { seqs: results, layers, layers_ms, .. } = out;
        let mut events = Vec::new();
        let mut active = std::mem::take(&mut self.active);
        let mut done_ids = Vec::new();
        for (s, r) in seqs.iter().zip(results) {
            let Some(a) = active.iter_mut().find(|a| a.req.seq_id == s.seq_id) else { continue };
            a.acc.add(&layers, layers_ms, seqs.len());
            if self.take_result(a, s, r, &mut events) {
                done_ids.push(s.seq_id);
            }
        }
        active.retain(|a| !done_ids.contains(&a.req.seq_id));
        self.active = active;
        self.release.extend(done_ids);
        events
    }

    /// A step's figures: metrics, every running request's busy time, the pass-cost model and the
    /// draft model's estimate.
    fn account(&mut self, seqs: &[StepSeq], took: Duration, out: &StepResult) {
        let rows: usize = seqs.iter().map(|s| s.token_ids.len()).sum();
        self.metrics.step(seqs.len(), rows, took.as_secs_f64() * 1e3, &out.workers);
        // Each worker's wall time in this step counts as busy time for every running request: with
        // micro-batches, the workers are busy with the others' steps too.
        let walls: Vec<f64> = out.workers.iter().map(|w| w.wall_ms).collect();
        for a in self.active.iter_mut() {
            a.acc.add_busy(&walls);
        }
        if seqs.iter().all(|s| s.token_ids.len() == 1 + s.draft_len as usize) {
            // Decode steps only (a prefill's time says little about a draft's), drafting excluded.
            self.cost.record(rows, (took.as_secs_f64() * 1e3 - out.draft_ms).max(0.0));
        }
        if out.draft_level_ms > 0.0 {
            self.draft_ms = out.draft_level_ms;
        }
    }

    /// One sequence's share of a step: positions, KV blocks, scores, drafts, tokens through the
    /// stop criteria and the format, its token event and, when it ended, its final event.
    /// Returns whether it ended.
    fn take_result(
        &mut self,
        a: &mut Active,
        s: &StepSeq,
        r: SeqResult,
        events: &mut Vec<Event>,
    ) -> bool {
        let drafted = s.draft_len as usize;
        let accepted = r.tokens.len() - 1;
        // Rejected drafts are not in the caches any more (cut by the next step); after a tree,
        // neither is the accepted branch (it goes in again, in order, with the next token).
        a.refeed = !s.tree_parents.is_empty();
        a.pos += if a.refeed {
            s.token_ids.len() - drafted
        } else {
            s.token_ids.len() - (drafted - accepted.min(drafted))
        };
        self.settle(a);
        output::take_scores(a, s.start_pos as usize, &r.scores);
        if s.prompt_continues {
            return false;
        }
        a.next_draft = Draft { tokens: r.drafts, parents: r.draft_parents };
        if drafted > 0 {
            a.acceptance.record(levels(&s.tree_parents, drafted), accepted);
            self.metrics.speculated(drafted, accepted);
        }
        a.acc.spec(drafted, accepted);
        let first = a.stopper.output().is_empty();
        if first {
            a.acc.first_token = Some(a.req.queued.elapsed());
        }
        let mut ids = Vec::with_capacity(r.tokens.len());
        let (mut text, mut reason) = (String::new(), None);
        for &tok in &r.tokens {
            ids.push(tok);
            reason = output::push(&self.tokenizer, a, tok, &mut text);
            if reason.is_some() {
                break;
            }
        }
        if reason.is_none() {
            reason = output::follow_format(&self.tokenizer, a, &mut ids, &mut text);
        }
        self.metrics.generated(ids.len());
        let mut logprobs = Vec::new();
        if a.req.params.sampling.logprobs.is_some() {
            logprobs = r.logprobs;
            logprobs.truncate(ids.len());
        }
        let prompt_logprobs = if first && !a.scores_sent && a.req.params.prompt_logprobs.is_some() {
            a.scores_sent = true;
            a.scores.clone()
        } else {
            Vec::new()
        };
        let token = TokenEvent { ids, text, logprobs, prompt_logprobs };
        let ev =
            GenerateEvent { index: a.req.index, event: Some(generate_event::Event::Token(token)) };
        events.push(Event { to: a.req.events.clone(), ev, try_only: false });
        let Some((r, err)) = reason else {
            self.settle(a);
            return false;
        };
        events.push(self.ended(a, r, err));
        self.free_blocks(a);
        true
    }
}

/// The step entry of sequence `a` bringing its next `n` known tokens (drafts, masks, scores and
/// blocks are added after).
fn step_seq(a: &Active, n: usize) -> StepSeq {
    let first = a.pos == a.base;
    StepSeq {
        seq_id: a.req.seq_id,
        start_pos: a.pos as u32,
        token_ids: a.tokens(n),
        sampling: first.then(|| a.req.params.sampling.to_wire()),
        // Only the chunk that reaches the last known token samples; a replay's chunks (prompt and
        // earlier outputs) sample nothing.
        prompt_continues: a.pos + n < a.known(),
        // Each output token drew once from a sampling sequence's generator.
        draws_before: if first { (a.stopper.output().len() - a.forced) as u32 } else { 0 },
        draft_len: 0,
        draft_next: 0,
        tree_parents: Vec::new(),
        draft_width: 0,
        blocks: Vec::new(),
        cached_ids: if first && a.base > 0 {
            a.req.input_ids[..a.base].to_vec()
        } else {
            Vec::new()
        },
        allowed: Vec::new(),
        score_ids: Vec::new(),
        score_top: 0,
    }
}
