//! The continuous-batching scheduler: an actor that owns the queue and the running sequences.
//! Between steps, sequences join (their prefill rides the same weight pass as running decodes) and
//! leave (finished, cancelled, or their client gone); one pipeline step serves every active sequence.
//! A step carries at most `max_step_tokens` tokens: every decode brings one, and prompts take what is
//! left, a long prompt split over several steps (chunked prefill), so a step's activations and
//! latency stay bounded however long the prompts are (admission keeps the running sequences, each a
//! decode token per step, within that count).

use crate::pipeline::Pipeline;
use crate::stats::Acc;
use layerstream_model::{FinishReason, GenerateParams, Stopper, Tokenizer};
use layerstream_proto::v1::{generate_event, FinalEvent, GenerateEvent, StepSeq, TokenEvent};
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
    pos: usize,
    /// Output tokens, their text, and the stop criteria.
    stopper: Stopper,
    acc: Acc,
    started: Instant,
}

/// Admission limits.
#[derive(Debug, Clone, Copy)]
pub struct Limits {
    pub max_batch: usize,
    pub kv_capacity: usize,
    pub max_step_tokens: usize,
}

/// The actor.
pub struct Scheduler {
    pub rx: mpsc::Receiver<SeqRequest>,
    pub pipeline: Pipeline,
    pub tokenizer: Arc<Tokenizer>,
    /// Waiting sequences, shared with the service that admits requests against `--queue-size`.
    pub waiting_count: Arc<std::sync::atomic::AtomicUsize>,
    /// The model's end-of-sequence ids.
    pub eos: Vec<u32>,
    pub limits: Limits,
}

/// Tokens each active sequence brings to the next step, given (position, prompt length) per sequence
/// in admission order: 1 per decode (never held back), then prompt chunks in order from what is left
/// of `max_tokens` (at least one token when nothing decodes); 0 = sits this step out. Pure, unit-tested.
pub fn step_tokens(seqs: &[(usize, usize)], max_tokens: usize) -> Vec<usize> {
    let decodes = seqs.iter().filter(|(pos, len)| pos >= len).count();
    let mut left = max_tokens.max(1).saturating_sub(decodes);
    seqs.iter()
        .map(|&(pos, len)| {
            if pos >= len {
                return 1;
            }
            let n = (len - pos).min(left);
            left -= n;
            n
        })
        .collect()
}

/// Which of the waiting requests may join now (FIFO, within batch and KV limits): pure, unit-tested.
/// Every running sequence decodes a token a step, so no more run than a step carries.
pub fn admit(active: usize, kv_used: usize, waiting: &[usize], l: Limits) -> usize {
    let (mut n, mut used) = (0, kv_used);
    let most = l.max_batch.min(l.max_step_tokens);
    for &need in waiting {
        if active + n >= most || used + need > l.kv_capacity {
            break;
        }
        used += need;
        n += 1;
    }
    n
}

fn final_event(
    req: &SeqRequest,
    output: &[u32],
    text: &str,
    stats: layerstream_proto::v1::Stats,
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
        })),
    }
}

fn finish(a: &Active, reason: FinishReason, error: String) -> GenerateEvent {
    let output = a.stopper.output();
    let stats = a.acc.stats(
        a.req.input_ids.len(),
        output.len(),
        a.started.elapsed(),
        a.req.queued.elapsed(),
    );
    final_event(&a.req, output, &a.stopper.text, stats, reason, error)
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
                self.waiting_count.fetch_sub(1, Ordering::SeqCst);
                let stopper = Stopper::new(&req.params, &self.eos);
                active.push(Active {
                    req,
                    pos: 0,
                    stopper,
                    acc: Acc::default(),
                    started: Instant::now(),
                });
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
                self.waiting_count.fetch_sub(1, Ordering::SeqCst);
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
        let mut gone = Vec::new();
        let mut i = 0;
        while i < active.len() {
            let a = &active[i];
            if a.req.cancel.load(Ordering::Relaxed) || a.req.events.is_closed() {
                let a = active.swap_remove(i);
                let _ = a.req.events.try_send(finish(&a, FinishReason::Cancelled, String::new()));
                tracing::info!(seq = a.req.seq_id, "sequence cancelled; freeing its KV cache");
                gone.push(a.req.seq_id);
            } else {
                i += 1;
            }
        }
        self.pipeline.release(gone).await;
    }

    async fn step(&self, active: &mut Vec<Active>) {
        let shares = step_tokens(
            &active.iter().map(|a| (a.pos, a.req.input_ids.len())).collect::<Vec<_>>(),
            self.limits.max_step_tokens,
        );
        // (index into `active`, tokens it brings) for the sequences that ride this step.
        let members: Vec<(usize, usize)> =
            shares.into_iter().enumerate().filter(|&(_, n)| n > 0).collect();
        let seqs: Vec<StepSeq> = members
            .iter()
            .map(|&(i, n)| {
                let a = &active[i];
                let prompt = a.req.input_ids.len();
                StepSeq {
                    seq_id: a.req.seq_id,
                    start_pos: a.pos as u32,
                    token_ids: if a.pos < prompt {
                        a.req.input_ids[a.pos..a.pos + n].to_vec()
                    } else {
                        vec![*a.stopper.output().last().expect("decoding after prefill")]
                    },
                    sampling: (a.pos == 0).then(|| a.req.params.sampling.to_wire()),
                    prompt_continues: a.pos + n < prompt,
                }
            })
            .collect();
        let rows: usize = seqs.iter().map(|s| s.token_ids.len()).sum();
        // One `step` span per request in the step, so each request's trace shows every step it rode;
        // the first carries the workers' spans.
        let spans: Vec<Span> = members.iter().map(|&(i, _)| info_span!(parent: &active[i].req.span, "step", batch = seqs.len() as i64, rows = rows as i64)).collect();
        let res = self.pipeline.step(seqs.clone(), &spans[0]).await;
        drop(spans);
        let out = match res {
            Ok(out) => out,
            Err(e) => {
                tracing::error!(error = %e, "step failed; ending every active sequence");
                let ids: Vec<u64> = active.iter().map(|a| a.req.seq_id).collect();
                for a in active.drain(..) {
                    let _ = a.req.events.send(finish(&a, FinishReason::Error, e.to_string())).await;
                }
                self.pipeline.release(ids).await;
                return;
            }
        };
        let mut done = Vec::new();
        for ((&(i, n), s), &tok) in members.iter().zip(&seqs).zip(&out.tokens) {
            let a = &mut active[i];
            a.pos += n;
            a.acc.add(&out.layers, out.layers_ms, seqs.len());
            if s.prompt_continues {
                continue;
            }
            if a.stopper.output().is_empty() {
                a.acc.first_token = Some(a.req.queued.elapsed());
            }
            let (delta, reason) = match a.stopper.push(&self.tokenizer, tok) {
                Ok(p) => (p.delta, p.finish.map(|r| (r, String::new()))),
                Err(e) => {
                    (String::new(), Some((FinishReason::Error, format!("decoding output: {e}"))))
                }
            };
            let ev = GenerateEvent {
                index: a.req.index,
                event: Some(generate_event::Event::Token(TokenEvent {
                    ids: vec![tok],
                    text: delta,
                })),
            };
            let _ = a.req.events.send(ev).await;
            if let Some((r, err)) = reason {
                let ev = finish(a, r, err);
                let _ = a.req.events.send(ev).await;
                done.push(i);
            }
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
        let l = Limits { max_batch: 3, kv_capacity: 100, max_step_tokens: 64 };
        assert_eq!(admit(0, 0, &[10, 10, 10, 10], l), 3);
        assert_eq!(admit(2, 0, &[10, 10], l), 1);
        assert_eq!(admit(0, 80, &[30, 10], l), 0, "FIFO: a big request is not overtaken");
        assert_eq!(admit(0, 0, &[], l), 0);
        assert_eq!(
            admit(1, 0, &[10, 10, 10], Limits { max_step_tokens: 2, ..l }),
            1,
            "no more running than a step carries"
        );
    }

    #[test]
    fn decodes_always_ride_and_prompts_are_chunked_in_order_within_the_step_budget() {
        // (position, prompt length): a decode, a fresh 10-token prompt, a prompt 4 tokens from its end.
        let seqs = [(12, 5), (0, 10), (6, 10)];
        assert_eq!(
            step_tokens(&seqs, 8),
            vec![1, 7, 0],
            "the first prompt takes what the decode left"
        );
        assert_eq!(step_tokens(&seqs, 64), vec![1, 10, 4], "everything fits: no chunking");
        assert_eq!(step_tokens(&seqs, 1), vec![1, 0, 0], "decodes are never held back");
        assert_eq!(step_tokens(&[(0, 10)], 0), vec![1], "a lone prompt always moves");
        assert_eq!(step_tokens(&[(3, 10), (9, 10)], 8), vec![7, 1]);
    }
}
