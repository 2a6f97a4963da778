//! The head stage's share of a step: final norm and lm_head on each sequence's last rows, the
//! token choice (or the verification of a speculative draft), and the draft model's proposals for
//! the next step.

use super::{in_batch_order, StepOut, StepSeq};
use crate::error::Result;
use crate::forward::{head_argmax, head_tensor, SeqRows};
use crate::token_choice::{HeadRow, TokenChoice};
use crate::verify::{verify, DraftRows};
use layerstream_kernels::Backend;
use std::time::Instant;
use tracing::{info_span, Span};

impl<B: Backend + 'static> super::Stage<B> {
    /// Chooses every sequence's tokens from the layers' output `x` (verifying drafts where a
    /// sequence carries one), then drafts the next ones where asked.
    pub(super) fn head_tokens(
        &mut self,
        batch: &[StepSeq],
        x: &B::Tensor,
        seq_rows: &[SeqRows],
        step_span: &Span,
        out: &mut StepOut,
    ) -> Result<()> {
        let Some((norm, lm)) = &self.head else { return Ok(()) };
        let lm = lm.as_ref().or(self.embed.as_ref()).expect("tied head keeps the embedding");
        let b = &self.backend;
        let tails: Vec<usize> = batch.iter().map(|s| s.draft_len + 1).collect();
        let drafted: usize = batch.iter().map(|s| s.draft_len).sum();
        let ordered = in_batch_order(&mut self.seqs, batch);
        if drafted > 0 {
            let head_span = info_span!(parent: step_span, "head", rows = seq_rows.len() as i64, vocab = self.cfg.vocab_size as i64, spec = drafted as i64);
            let _in_head = head_span.enter();
            let logits = head_tensor(b, &self.ctx, x, seq_rows, &tails, norm, lm)?;
            let mut first_row = 0;
            let rows: Vec<DraftRows<'_>> = batch
                .iter()
                .zip(ordered)
                .map(|(s, seq)| {
                    let r = DraftRows {
                        sampler: seq.sampler.as_mut().expect("head stage samples"),
                        history: &seq.history,
                        draft: &s.tokens[s.tokens.len() - s.draft_len..],
                        parents: &s.tree_parents,
                        prompt_continues: s.prompt_continues,
                        first_row,
                    };
                    first_row += s.draft_len + 1;
                    r
                })
                .collect();
            out.results = results(batch, verify(b, &logits, rows)?);
            self.draft_next(batch, out)?;
            return Ok(());
        }
        let rows: Vec<HeadRow<'_>> = batch
            .iter()
            .zip(ordered)
            .map(|(s, seq)| HeadRow {
                sampler: seq.sampler.as_mut().expect("head stage samples"),
                history: &seq.history,
                prompt_continues: s.prompt_continues,
                allowed: &s.allowed,
            })
            .collect();
        let choice = TokenChoice::for_rows(b, &rows);
        // Final norm, lm_head and the token choice: the step's time outside the layers.
        let greedy = choice == TokenChoice::DeviceArgmax;
        let head_span = info_span!(parent: step_span, "head", rows = seq_rows.len() as i64, vocab = self.cfg.vocab_size as i64, greedy);
        let _in_head = head_span.enter();
        let mut scores = Vec::new();
        let scoring = batch.iter().any(|s| !s.score_ids.is_empty());
        let (tokens, logprobs) = if greedy && !scoring {
            // Only the argmax is wanted: the backend may find it without every f32 logit.
            (head_argmax(b, &self.ctx, x, seq_rows, norm, lm)?, Vec::new())
        } else if scoring {
            // Prompt log-probabilities: every row of the scoring sequences goes through the head;
            // each scores its next token, and the last rows are chosen from as usual.
            let tails: Vec<usize> = batch
                .iter()
                .zip(seq_rows)
                .map(|(s, r)| if s.score_ids.is_empty() { 1 } else { r.rows })
                .collect();
            let all = head_tensor(b, &self.ctx, x, seq_rows, &tails, norm, lm)?;
            let (host, vocab) = (b.to_host(&all)?, b.dims(&all).1);
            let (mut first, mut last) = (0, Vec::with_capacity(batch.len()));
            for (s, &t) in batch.iter().zip(&tails) {
                let mut seq_scores = Vec::with_capacity(s.score_ids.len().min(t));
                for (i, &id) in s.score_ids.iter().enumerate().take(t) {
                    let row = &host[(first + i) * vocab..(first + i + 1) * vocab];
                    layerstream_kernels::host::check_logits(row, first + i)?;
                    seq_scores.push(crate::sampling::logprobs(row, id, s.score_top));
                }
                scores.push(seq_scores);
                first += t;
                last.push(first - 1);
            }
            choice.choose(b, &mut b.gather_rows(&all, &last)?, rows)?
        } else {
            choice.choose(b, &mut head_tensor(b, &self.ctx, x, seq_rows, &[], norm, lm)?, rows)?
        };
        let mut logprobs = logprobs.into_iter();
        let one_each = tokens.into_iter().map(|t| vec![(t, logprobs.next().flatten())]).collect();
        out.results = results(batch, one_each);
        for (r, sc) in out.results.iter_mut().zip(scores) {
            r.scores = sc;
        }
        drop(_in_head);
        self.draft_next(batch, out)?;
        Ok(())
    }

    /// The head's draft model proposes each sequence's next tokens (`draft_next`), from its history
    /// as this step's tokens left it (the accepted drafts and the new token).
    fn draft_next(&mut self, batch: &[StepSeq], out: &mut StepOut) -> Result<()> {
        let Some(model) = &self.draft else { return Ok(()) };
        if batch.iter().all(|s| s.draft_next == 0) {
            return Ok(());
        }
        let t0 = Instant::now();
        let _span = info_span!("draft", sequences = batch.len() as i64).entered();
        for (s, r) in batch.iter().zip(out.results.iter_mut()) {
            let emitted = &r.tokens;
            let seq = self.seqs.get_mut(&s.seq_id).expect("prepared");
            let (Some(d), false, true) = (seq.draft.as_mut(), s.prompt_continues, s.draft_next > 0)
            else {
                continue;
            };
            // The history the next step starts from: everything before this step's draft, the
            // drafts it accepted (the first emitted tokens), and the new token.
            let base = seq.history.len() - s.draft_len;
            let mut history = seq.history[..base].to_vec();
            history.extend_from_slice(emitted);
            let probe = self.draft_level_ms == 0.0;
            let (next, tree) =
                d.propose_tree(model, &history, s.draft_next, s.draft_width, probe)?;
            if d.ms_per_level() > 0.0 {
                self.draft_level_ms = d.ms_per_level();
            }
            (r.drafts, r.draft_parents) = (next, tree);
        }
        out.draft_ms = t0.elapsed().as_secs_f64() * 1e3;
        out.draft_level_ms = self.draft_level_ms;
        Ok(())
    }
}

/// Each sequence's result from its tokens (with their log-probabilities where asked for: a
/// sequence whose tokens have none carries none).
fn results(
    batch: &[StepSeq],
    tokens: Vec<Vec<(u32, Option<layerstream_rpc::v1::TokenLogprobs>)>>,
) -> Vec<layerstream_rpc::v1::SeqResult> {
    batch
        .iter()
        .zip(tokens)
        .map(|(s, toks)| {
            let asked = toks.iter().any(|t| t.1.is_some());
            let (tokens, lps): (Vec<u32>, Vec<_>) = toks.into_iter().unzip();
            let logprobs = if asked {
                lps.into_iter().map(Option::unwrap_or_default).collect()
            } else {
                vec![]
            };
            layerstream_rpc::v1::SeqResult {
                seq_id: s.seq_id,
                tokens,
                logprobs,
                ..Default::default()
            }
        })
        .collect()
}
