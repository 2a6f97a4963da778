//! Speculative decoding in the scheduler: which draft each decoding sequence of a step carries and
//! how long it is (see `layerstream_serving::spec::choose_draft`).

use super::active::Active;
use super::core::Core;
use layerstream_rpc::v1::StepSeq;
use layerstream_serving::spec::{choose_draft, ngram_propose, tree_or_chain, DraftCost, SpecMode};

impl Core {
    /// Speculative decoding: appends a draft to each decoding sequence of a step — prompt lookup,
    /// or what the head's draft model proposed after its last step — each as long as maximises its
    /// expected tokens per millisecond (its acceptance so far, the measured step time by positions,
    /// the draft model's time per token), within its request's limits, its remaining tokens and what
    /// is left of the step's token budget; with a draft model, asks the head for that many more.
    pub(super) fn draft(
        &self,
        active: &mut [Active],
        members: &[(usize, usize)],
        seqs: &mut [StepSeq],
    ) {
        let mode = self.spec.mode;
        if mode == SpecMode::Off {
            return;
        }
        let mut rows: usize = seqs.iter().map(|s| s.token_ids.len()).sum();
        let others = seqs.len().saturating_sub(1) as f64;
        let seqs_len = seqs.len();
        for (&(i, _), s) in members.iter().zip(seqs.iter_mut()) {
            let a = &mut active[i];
            let proposed = std::mem::take(&mut a.next_draft);
            if s.prompt_continues {
                continue;
            }
            let p = &a.req.params;
            // Tokens still to come after this step's first.
            let remaining = p.max_new_tokens.saturating_sub(a.stopper.output().len() + 1);
            let budget = self.limits.max_step_tokens.saturating_sub(rows);
            let max = p.speculative.max(self.spec.max).min(remaining);
            let min = p.speculative.n_min;
            if max == 0 || min > max {
                continue;
            }
            let (draft_cost, width) = match mode {
                SpecMode::Draft => (DraftCost::of_model(self.draft_ms), self.spec.width),
                _ => (DraftCost::Free, 1),
            };
            // A token tree's rows fit a 64-bit ancestor mask.
            let max =
                if width > 1 { max.min(64usize.saturating_sub(s.token_ids.len())) } else { max };
            let rate = a.acceptance.rate();
            let choose = |rows_others| {
                choose_draft(rate, &self.cost, rows_others, draft_cost, (min, max), width)
            };
            let k = choose((rows - 1, others));
            if mode == SpecMode::Draft {
                // What to draft for the next step, a decode beside the other sequences' (not this
                // step's rows: after a prompt chunk they would make any draft look cheap).
                s.draft_next = choose((seqs_len.saturating_sub(1), others)) as u32;
                s.draft_width = width as u32;
            }
            // A draft follows the step's last token when that is the last known one.
            if a.pos + s.token_ids.len() != a.known() || k == 0 {
                continue;
            }
            let (mut draft, mut parents) = match mode {
                SpecMode::Draft => (proposed.tokens, proposed.parents),
                _ => (ngram_propose(&a.history(), k), Vec::new()),
            };
            let n = k.min(budget).min(draft.len());
            draft.truncate(n);
            parents.truncate(n);
            if draft.is_empty() || draft.len() < min {
                continue;
            }
            rows += draft.len();
            s.draft_len = draft.len() as u32;
            s.tree_parents = tree_or_chain(parents);
            s.token_ids.extend(draft);
        }
    }
}
