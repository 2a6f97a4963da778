//! Verifying speculative drafts at the head: every drafted position is sampled from the target
//! exactly as it would be without a draft (same sampler, same draw, the repetition penalty over the
//! tokens before it), in rounds — round r samples, for every sequence whose drafts so far were all
//! accepted, the row its accepted path has reached — and a draft token is accepted while it equals
//! the sample (in a token tree: while one of the current node's children does). A sequence emits its
//! accepted drafts and the sample after them; each emitted token draws once, as without a draft.

use crate::error::Result;
use crate::sampling::Sampler;
use crate::token_choice::{HeadRow, TokenChoice};
use layerstream_kernels::Backend;
use layerstream_rpc::v1::TokenLogprobs;
use layerstream_serving::spec::drafted_child;
use std::borrow::Cow;

/// One sequence's rows of the head's logits.
pub struct DraftRows<'a> {
    pub(crate) sampler: &'a mut Sampler,
    /// Every token fed so far, this step's draft included.
    pub(crate) history: &'a [u32],
    /// This step's drafted tokens (the last of `history`).
    pub(crate) draft: &'a [u32],
    /// A token tree's parents (node i's parent: 0 = the row before the draft, j = node j - 1);
    /// empty for a chain.
    pub(crate) parents: &'a [u32],
    pub(crate) prompt_continues: bool,
    /// Index of its first row in the logits (it has `draft.len() + 1`).
    pub(crate) first_row: usize,
}

/// What verification emitted, per sequence: each token with its log-probabilities where asked for.
pub type Verified = Vec<Vec<(u32, Option<TokenLogprobs>)>>;

/// Verifies every sequence's draft against `logits` (`[Σ (draft + 1), vocab]`).
pub fn verify<B: Backend>(
    b: &B,
    logits: &B::Tensor,
    mut seqs: Vec<DraftRows<'_>>,
) -> Result<Verified> {
    let n = seqs.len();
    let mut out: Vec<Vec<(u32, Option<TokenLogprobs>)>> = vec![Vec::new(); n];
    // Sequences still accepting, by index into `seqs`, and the node each has reached (0: the row
    // before the draft; i: draft node i - 1).
    let mut alive: Vec<usize> = (0..n).collect();
    let mut at = vec![0usize; n];
    while !alive.is_empty() {
        let idx: Vec<usize> = alive.iter().map(|&i| seqs[i].first_row + at[i]).collect();
        let mut rows_logits = b.gather_rows(logits, &idx)?;
        // What each row's repetition penalty sees: the tokens before the draft, then the path —
        // in a chain, the history itself up to there; in a tree, the branch taken, copied.
        let seen: Vec<Cow<'_, [u32]>> = alive
            .iter()
            .map(|&i| {
                let s = &seqs[i];
                let base = s.history.len() - s.draft.len();
                if s.parents.is_empty() {
                    Cow::Borrowed(&s.history[..base + out[i].len()])
                } else {
                    let path = out[i].iter().map(|t| t.0);
                    Cow::Owned(s.history[..base].iter().copied().chain(path).collect())
                }
            })
            .collect();
        let rows: Vec<HeadRow<'_>> = seqs
            .iter_mut()
            .enumerate()
            .filter(|(i, _)| alive.contains(i))
            .zip(&seen)
            .map(|((_, s), seen)| HeadRow {
                sampler: &mut *s.sampler,
                history: seen,
                prompt_continues: s.prompt_continues,
                // Constrained sequences are not drafted for.
                allowed: &[],
            })
            .collect();
        let choice = TokenChoice::for_rows(b, &rows);
        let (tokens, logprobs) = choice.choose(b, &mut rows_logits, rows)?;
        let mut next = Vec::with_capacity(alive.len());
        for (j, &i) in alive.iter().enumerate() {
            let t = tokens[j];
            out[i].push((t, logprobs.get(j).cloned().flatten()));
            let s = &seqs[i];
            if s.prompt_continues {
                continue;
            }
            if let Some(c) = drafted_child(s.draft, s.parents, at[i], t) {
                at[i] = c + 1;
                next.push(i);
            }
        }
        alive = next;
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use layerstream_kernels::CpuBackend;
    use layerstream_serving::SamplingParams;

    /// Each sequence's tokens, without their log-probabilities.
    fn tokens(v: Verified) -> Vec<Vec<u32>> {
        v.into_iter().map(|s| s.into_iter().map(|t| t.0).collect()).collect()
    }

    /// A sequence's rows from `first_row`: its history ending in a draft of `n` tokens with these
    /// tree `parents` (empty: a chain).
    fn drafted<'a>(
        sampler: &'a mut Sampler,
        history: &'a [u32],
        n: usize,
        parents: &'a [u32],
        first_row: usize,
    ) -> DraftRows<'a> {
        let draft = &history[history.len() - n..];
        DraftRows { sampler, history, draft, parents, prompt_continues: false, first_row }
    }

    /// Logits whose argmax is `t`, and that sample `t` most of the time at temperature 1.
    fn peaked(vocab: usize, t: u32) -> Vec<f32> {
        (0..vocab).map(|i| if i as u32 == t { 6.0 } else { 0.0 }).collect()
    }

    /// Greedy: the drafts the target agrees with are accepted, the first disagreement is replaced
    /// by the target's token and ends the sequence's tokens; a sequence without a draft gets one.
    #[test]
    fn greedy_accepts_the_agreeing_prefix() {
        let b = CpuBackend::default();
        let vocab = 8;
        // Sequence 0 drafts [3, 4, 5]; the target says 3, 4, 6, (7): accepts 3, 4, emits 6.
        // Sequence 1 drafts nothing; the target says 2.
        let rows = [
            peaked(vocab, 3),
            peaked(vocab, 4),
            peaked(vocab, 6),
            peaked(vocab, 7),
            peaked(vocab, 2),
        ];
        let logits = b.from_host(&rows.concat(), 5, vocab).unwrap();
        let (mut s0, mut s1) =
            (Sampler::new(SamplingParams::default()), Sampler::new(SamplingParams::default()));
        let h0 = [1, 2, 3, 4, 5];
        let h1 = [1];
        let seqs =
            vec![drafted(&mut s0, &h0, h0.len() - 2, &[], 0), drafted(&mut s1, &h1, 0, &[], 4)];
        assert_eq!(tokens(verify(&b, &logits, seqs).unwrap()), vec![vec![3, 4, 6], vec![2]]);
        // Every draft accepted: the bonus token from the last row follows.
        let mut s0 = Sampler::new(SamplingParams::default());
        let h0 = [1, 2, 3, 4, 6];
        let seqs = vec![drafted(&mut s0, &h0, h0.len() - 2, &[], 0)];
        assert_eq!(tokens(verify(&b, &logits, seqs).unwrap()), vec![vec![3, 4, 6, 7]]);
    }

    /// A tree: the target's tokens follow the branch that agrees, whichever child it is; a leaf
    /// accepted ends the draft with the token after it.
    #[test]
    fn a_tree_follows_the_agreeing_branch() {
        let b = CpuBackend::default();
        let vocab = 8;
        // Root row, then nodes: 0 = 3 (root), 1 = 5 (root), 2 = 4 (node 0), 3 = 6 (node 1).
        // The target says: at root 5, at node 1 → 6, at node 3 → 7.
        let rows = [
            peaked(vocab, 5),
            peaked(vocab, 0),
            peaked(vocab, 6),
            peaked(vocab, 0),
            peaked(vocab, 7),
        ];
        let logits = b.from_host(&rows.concat(), 5, vocab).unwrap();
        let mut s = Sampler::new(SamplingParams::default());
        let h = [1, 2, 3, 5, 4, 6];
        let parents = [0, 0, 1, 2];
        let seqs = vec![drafted(&mut s, &h, h.len() - 2, &parents, 0)];
        // Root row says 5: node 1 (row 2), whose row says 6: node 3 (row 4), whose row says 7,
        // which no child drafted.
        assert_eq!(tokens(verify(&b, &logits, seqs).unwrap()), vec![vec![5, 6, 7]]);
    }

    /// Sampled: the tokens equal sampling the rows one by one with the same seed, stopping at the
    /// first sample that differs from the draft (draw for draw the output without speculation).
    #[test]
    fn sampling_equals_the_plain_sampler_draw_for_draw() {
        let b = CpuBackend::default();
        let vocab = 6;
        let rows: Vec<Vec<f32>> = (0..5)
            .map(|r| (0..vocab).map(|i| ((i * 7 + r * 3) % 5) as f32 * 0.4).collect())
            .collect();
        let logits = b.from_host(&rows.concat(), 5, vocab).unwrap();
        let params = SamplingParams {
            temperature: 1.0,
            seed: 11,
            repetition_penalty: 1.3,
            ..Default::default()
        };
        for draft in [vec![0u32, 1, 2, 3], vec![5, 5, 5, 5], vec![]] {
            // The plain sampler's tokens at rows 0.., history growing with each accepted token.
            let mut plain = Sampler::new(params.clone());
            let mut hist = vec![9u32 % vocab as u32];
            let mut want = Vec::new();
            for r in 0..=draft.len() {
                let t = plain.sample(&mut rows[r].clone(), &hist);
                want.push(t);
                hist.push(t);
                if r == draft.len() || draft[r] != t {
                    break;
                }
            }
            let mut s = Sampler::new(params.clone());
            let history: Vec<u32> = [vec![9 % vocab as u32], draft.clone()].concat();
            let seqs = vec![drafted(&mut s, &history, draft.len(), &[], 0)];
            assert_eq!(tokens(verify(&b, &logits, seqs).unwrap()), vec![want], "draft {draft:?}");
        }
    }
}
