//! The continuous-batching scheduler: an actor that owns the queue and the running sequences.
//! Between steps, sequences join (their prefill rides the same weight pass as running decodes) and
//! leave (finished, cancelled, or their client gone); one pipeline step serves every active sequence.

use crate::pipeline::Pipeline;
use crate::stats::Acc;
use layerstream_model::Tokenizer;
use layerstream_proto::v1::{generate_event, FinalEvent, GenerateEvent, Sampling, StepSeq, TokenEvent};
use layerstream_worker::generate::TextTracker;
use layerstream_worker::GenerateParams;
use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Instant;
use tokio::sync::mpsc;
use tracing::{info_span, Span};

/// One sequence to generate.
pub struct SeqRequest {
    pub seq_id: u64,
    pub index: u32,
    pub input_ids: Vec<u32>,
    pub params: GenerateParams,
    pub events: mpsc::Sender<GenerateEvent>,
    /// The request's `job` span: the root of its trace.
    pub span: Span,
    pub trace_id: String,
    pub cancel: Arc<AtomicBool>,
    /// When the coordinator accepted it (time to first token counts from here).
    pub queued: Instant,
}

impl SeqRequest {
    /// KV positions this sequence may need.
    pub fn reserve(&self) -> usize {
        self.input_ids.len() + self.params.max_new_tokens
    }
}

struct Active {
    req: SeqRequest,
    output: Vec<u32>,
    pos: usize,
    tracker: TextTracker,
    acc: Acc,
    started: Instant,
}

/// Admission limits.
#[derive(Debug, Clone, Copy)]
pub struct Limits {
    pub max_batch: usize,
    pub kv_capacity: usize,
}

/// The actor.
pub struct Scheduler {
    pub rx: mpsc::Receiver<SeqRequest>,
    pub pipeline: Pipeline,
    pub tokenizer: Arc<Tokenizer>,
    pub eos: Vec<u32>,
    pub limits: Limits,
}

/// Which of the waiting requests may join now (FIFO, within batch and KV limits): pure, unit-tested.
pub fn admit(active: usize, kv_used: usize, waiting: &[usize], l: Limits) -> usize {
    let (mut n, mut used) = (0, kv_used);
    for &need in waiting {
        if active + n >= l.max_batch || used + need > l.kv_capacity {
            break;
        }
        used += need;
        n += 1;
    }
    n
}

fn final_event(req: &SeqRequest, output: &[u32], text: &str, stats: layerstream_proto::v1::Stats, reason: &str, error: String) -> GenerateEvent {
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
        })),
    }
}

fn finish(a: &Active, reason: &str, error: String) -> GenerateEvent {
    let stats = a.acc.stats(a.req.input_ids.len(), a.output.len(), a.started.elapsed(), a.req.queued.elapsed());
    final_event(&a.req, &a.output, &a.tracker.text, stats, reason, error)
}

impl Scheduler {
    /// Runs until every request sender is gone.
    pub async fn run(mut self) {
        let mut active: Vec<Active> = Vec::new();
        let mut waiting: VecDeque<SeqRequest> = VecDeque::new();
        loop {
            if active.is_empty() && waiting.is_empty() {
                match self.rx.recv().await {
                    Some(r) => waiting.push_back(r),
                    None => return,
                }
            }
            while let Ok(r) = self.rx.try_recv() {
                waiting.push_back(r);
            }
            let kv_used: usize = active.iter().map(|a| a.req.reserve()).sum();
            let needs: Vec<usize> = waiting.iter().map(SeqRequest::reserve).collect();
            for _ in 0..admit(active.len(), kv_used, &needs, self.limits) {
                let req = waiting.pop_front().expect("admitted from the queue");
                let tracker = TextTracker::new(req.params.stop.clone());
                active.push(Active { req, output: Vec::new(), pos: 0, tracker, acc: Acc::default(), started: Instant::now() });
            }
            self.drop_cancelled(&mut active, &mut waiting).await;
            if active.is_empty() {
                continue;
            }
            self.step(&mut active).await;
        }
    }

    async fn drop_cancelled(&self, active: &mut Vec<Active>, waiting: &mut VecDeque<SeqRequest>) {
        waiting.retain(|r| {
            let gone = r.cancel.load(Ordering::Relaxed) || r.events.is_closed();
            if gone {
                let _ = r.events.try_send(final_event(r, &[], "", Acc::default().stats(r.input_ids.len(), 0, Default::default(), r.queued.elapsed()), "cancelled", String::new()));
            }
            !gone
        });
        let mut gone = Vec::new();
        let mut i = 0;
        while i < active.len() {
            let a = &active[i];
            if a.req.cancel.load(Ordering::Relaxed) || a.req.events.is_closed() {
                let a = active.swap_remove(i);
                let _ = a.req.events.try_send(finish(&a, "cancelled", String::new()));
                tracing::info!(seq = a.req.seq_id, "sequence cancelled; freeing its KV cache");
                gone.push(a.req.seq_id);
            } else {
                i += 1;
            }
        }
        self.pipeline.release(gone).await;
    }

    async fn step(&self, active: &mut Vec<Active>) {
        let seqs: Vec<StepSeq> = active
            .iter()
            .map(|a| StepSeq {
                seq_id: a.req.seq_id,
                start_pos: a.pos as u32,
                token_ids: if a.pos == 0 { a.req.input_ids.clone() } else { vec![*a.output.last().expect("decoding after prefill")] },
                sampling: (a.pos == 0).then(|| {
                    let s = &a.req.params.sampling;
                    Sampling { temperature: s.temperature, top_k: s.top_k as u32, top_p: s.top_p, repetition_penalty: s.repetition_penalty, seed: s.seed }
                }),
            })
            .collect();
        let rows: usize = seqs.iter().map(|s| s.token_ids.len()).sum();
        // One `step` span per request in the batch, so each request's trace shows every step it rode;
        // the first carries the workers' spans.
        let spans: Vec<Span> = active.iter().map(|a| info_span!(parent: &a.req.span, "step", batch = seqs.len(), rows)).collect();
        let res = self.pipeline.step(seqs.clone(), &spans[0]).await;
        drop(spans);
        let out = match res {
            Ok(out) => out,
            Err(e) => {
                tracing::error!(error = %e, "step failed; ending every active sequence");
                let ids: Vec<u64> = active.iter().map(|a| a.req.seq_id).collect();
                for a in active.drain(..) {
                    let _ = a.req.events.send(finish(&a, "error", e.clone())).await;
                }
                self.pipeline.release(ids).await;
                return;
            }
        };
        let mut done = Vec::new();
        let mut i = 0;
        for (s, &tok) in seqs.iter().zip(&out.tokens) {
            let a = &mut active[i];
            a.pos += s.token_ids.len();
            a.acc.add(&out.layers, out.layers_ms, seqs.len());
            a.output.push(tok);
            if a.output.len() == 1 {
                a.acc.first_token = Some(a.req.queued.elapsed());
            }
            let p = &a.req.params;
            let mut reason: Option<(&str, String)> = None;
            let mut delta = String::new();
            if !p.ignore_eos && self.eos.contains(&tok) {
                reason = Some(("eos", String::new()));
            } else {
                match a.tracker.update(&self.tokenizer, &a.output) {
                    Ok((d, stopped)) => {
                        delta = d;
                        if stopped {
                            reason = Some(("stop", String::new()));
                        }
                    }
                    Err(e) => reason = Some(("error", format!("decoding output: {e}"))),
                }
            }
            if reason.is_none() && a.output.len() >= p.max_new_tokens {
                reason = Some(("length", String::new()));
            }
            if reason.is_some() {
                delta.push_str(&a.tracker.flush());
            }
            let ev = GenerateEvent { index: a.req.index, event: Some(generate_event::Event::Token(TokenEvent { ids: vec![tok], text: delta })) };
            let _ = a.req.events.send(ev).await;
            if let Some((r, err)) = reason {
                let ev = finish(a, r, err);
                let _ = a.req.events.send(ev).await;
                done.push(i);
            }
            i += 1;
        }
        let mut ids = Vec::new();
        for &j in done.iter().rev() {
            ids.push(active.remove(j).req.seq_id);
        }
        self.pipeline.release(ids).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn admission_respects_batch_and_kv_limits_in_order() {
        let l = Limits { max_batch: 3, kv_capacity: 100 };
        assert_eq!(admit(0, 0, &[10, 10, 10, 10], l), 3);
        assert_eq!(admit(2, 0, &[10, 10], l), 1);
        assert_eq!(admit(0, 80, &[30, 10], l), 0, "FIFO: a big request is not overtaken");
        assert_eq!(admit(0, 0, &[], l), 0);
    }
}
