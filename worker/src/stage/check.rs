//! A step's request checked whole against the stage before anything changes (`check_step`), so a
//! malformed call cannot leave a half-prepared stage behind.

use super::StepSeq;
use crate::error::{Error, Result};

/// What a step is checked against.
#[derive(Debug, Clone, Copy)]
pub struct StepLimits {
    pub(crate) vocab: usize,
    pub(crate) context: usize,
    pub(crate) hidden_size: usize,
    /// The model has sliding-window layers (no token trees).
    pub(crate) windowed: bool,
    /// Positions per KV block and blocks in the pool.
    pub(crate) kv_block: usize,
    pub(crate) kv_blocks: usize,
}

/// Checks a step's request before any state changes, naming the field at fault: every sequence once,
/// with tokens inside the vocabulary, at the position its cache holds (`known`: a live sequence's
/// length, or up to its last step's draft before it: `known` gives both; a new one starts at 0, or
/// after its cached tokens) and within the context, KV blocks of the pool covering its positions,
/// a draft shorter than its tokens and within `MAX_DRAFT`; `hidden` (stages after
/// the first) of the step's rows × hidden size, every value finite. Pure, so a malformed call cannot
/// leave a half-prepared stage behind.
pub fn check_step(
    batch: &[StepSeq],
    hidden: Option<&[f32]>,
    l: StepLimits,
    known: impl Fn(u64) -> Option<(usize, usize)>,
) -> Result<()> {
    let invalid = |(field, msg): Bad| Error::Invalid { field, msg };
    let mut seen = std::collections::HashSet::with_capacity(batch.len());
    for s in batch {
        if !seen.insert(s.seq_id) {
            let msg = format!("sequence {} appears twice in one step", s.seq_id);
            return Err(invalid(("seqs.seq_id", msg)));
        }
        check_contents(s, &l).map_err(invalid)?;
        check_place(s, &l, known(s.seq_id)).map_err(invalid)?;
    }
    if let Some(h) = hidden {
        check_hidden(batch, h, &l).map_err(invalid)?;
    }
    Ok(())
}

/// A field that is wrong, and why.
type Bad = (&'static str, String);

/// A sequence's tokens, draft, ids to score, token mask and tree within the limits.
fn check_contents(s: &StepSeq, l: &StepLimits) -> std::result::Result<(), Bad> {
    let bad = |field: &'static str, msg: String| Err((field, msg));
    if s.tokens.is_empty() {
        return bad("seqs.token_ids", format!("sequence {} has no tokens in this step", s.seq_id));
    }
    if let Some(t) = s.tokens.iter().find(|&&t| t as usize >= l.vocab) {
        return bad(
            "seqs.token_ids",
            format!(
                "token id {t} of sequence {} is outside the vocabulary of {}",
                s.seq_id, l.vocab
            ),
        );
    }
    if s.draft_len >= s.tokens.len() || s.draft_len > layerstream_serving::spec::MAX_DRAFT {
        return bad(
            "seqs.draft_len",
            format!(
                "sequence {} drafts {} of its {} tokens (at most {}, and one must not be drafted)",
                s.seq_id,
                s.draft_len,
                s.tokens.len(),
                layerstream_serving::spec::MAX_DRAFT
            ),
        );
    }
    if s.score_ids.len() > s.tokens.len() || (!s.score_ids.is_empty() && s.draft_len > 0) {
        return bad(
            "seqs.score_ids",
            format!(
                "sequence {}: {} ids to score for {} tokens (at most one per token, and not with a draft)",
                s.seq_id,
                s.score_ids.len(),
                s.tokens.len()
            ),
        );
    }
    if let Some(t) = s.score_ids.iter().find(|&&t| t as usize >= l.vocab) {
        return bad(
            "seqs.score_ids",
            format!("id {t} to score is outside the vocabulary of {}", l.vocab),
        );
    }
    if !s.allowed.is_empty() && (s.draft_len > 0 || s.allowed.iter().all(|&w| w == 0)) {
        return bad(
            "seqs.allowed",
            format!("sequence {}: a token mask allows no token, or comes with a draft", s.seq_id),
        );
    }
    let tree_ok = s.tree_parents.is_empty()
        || (s.tree_parents.len() == s.draft_len
            && s.tokens.len() <= 64
            && !l.windowed
            && s.tree_parents.iter().enumerate().all(|(i, &p)| p as usize <= i));
    if !tree_ok {
        return bad(
            "seqs.tree_parents",
            format!(
                "sequence {}: {} parents for a draft of {} in {} tokens (one per drafted token, each an earlier one, at most 64 tokens; not on a sliding-window model)",
                s.seq_id,
                s.tree_parents.len(),
                s.draft_len,
                s.tokens.len()
            ),
        );
    }
    Ok(())
}

/// A sequence's position against what this worker holds of it (`known`: its length and the
/// drafted positions its last step may cut), its KV blocks and the context.
fn check_place(
    s: &StepSeq,
    l: &StepLimits,
    known: Option<(usize, usize)>,
) -> std::result::Result<(), Bad> {
    let bad = |field: &'static str, msg: String| Err((field, msg));
    match known {
        None if s.start_pos != s.cached.len() => {
            return bad(
                "seqs.start_pos",
                format!(
                    "unknown sequence {} at position {} after {} cached tokens",
                    s.seq_id,
                    s.start_pos,
                    s.cached.len()
                ),
            );
        }
        Some((len, rollback)) if s.start_pos > len || s.start_pos + rollback < len => {
            return bad(
                "seqs.start_pos",
                format!(
                    "sequence {} is at position {len} (rejected drafts: {rollback}), step says {}",
                    s.seq_id, s.start_pos
                ),
            );
        }
        _ => {}
    }
    let end = s.start_pos.saturating_add(s.tokens.len());
    let need = end.div_ceil(l.kv_block.max(1));
    if s.blocks.len() < need || s.blocks[..need].iter().any(|&b| b as usize >= l.kv_blocks) {
        return bad(
            "seqs.blocks",
            format!(
                "sequence {}: {} KV blocks {:?} for positions up to {end} (blocks of {} in a pool of {})",
                s.seq_id,
                s.blocks.len(),
                &s.blocks[..s.blocks.len().min(8)],
                l.kv_block,
                l.kv_blocks
            ),
        );
    }
    if s.start_pos.saturating_add(s.tokens.len()) > l.context {
        return bad(
            "seqs.start_pos",
            format!(
                "sequence {} would reach position {} past the context of {}",
                s.seq_id,
                s.start_pos.saturating_add(s.tokens.len()),
                l.context
            ),
        );
    }
    Ok(())
}

/// The hidden states a step brings: one row of `hidden_size` finite values per token.
fn check_hidden(batch: &[StepSeq], h: &[f32], l: &StepLimits) -> std::result::Result<(), Bad> {
    let bad = |field: &'static str, msg: String| Err((field, msg));
    let rows: usize = batch.iter().map(|s| s.tokens.len()).sum();
    if h.len() != rows * l.hidden_size {
        return bad(
            "hidden",
            format!(
                "hidden states hold {} values, {rows} rows × {} expected",
                h.len(),
                l.hidden_size
            ),
        );
    }
    if let Some(i) = h.iter().position(|v| !v.is_finite()) {
        return bad("hidden", format!("value {i} of the hidden states is {}", h[i]));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn seq(id: u64, pos: usize, tokens: &[u32]) -> StepSeq {
        StepSeq {
            seq_id: id,
            start_pos: pos,
            tokens: tokens.to_vec(),
            sampling: None,
            prompt_continues: false,
            draws_before: 0,
            draft_len: 0,
            draft_next: 0,
            tree_parents: Vec::new(),
            draft_width: 1,
            blocks: vec![5, 0, 7],
            cached: Vec::new(),
            allowed: Vec::new(),
            score_ids: Vec::new(),
            score_top: 0,
        }
    }

    const L: StepLimits = StepLimits {
        vocab: 10,
        context: 8,
        hidden_size: 2,
        windowed: false,
        kv_block: 4,
        kv_blocks: 8,
    };

    fn field(r: Result<()>) -> &'static str {
        match r {
            Err(Error::Invalid { field, .. }) => field,
            other => panic!("{other:?}"),
        }
    }

    /// Each malformed step is refused naming its field; a well-formed one passes.
    #[test]
    fn malformed_steps_name_the_field() {
        let live = |id: u64| (id == 7).then_some((3, 0));
        assert!(
            check_step(&[seq(1, 0, &[1, 2]), seq(7, 3, &[4])], Some(&[0.5; 6]), L, live).is_ok()
        );
        assert_eq!(
            field(check_step(&[seq(1, 0, &[1]), seq(1, 0, &[2])], None, L, live)),
            "seqs.seq_id"
        );
        assert_eq!(field(check_step(&[seq(1, 0, &[])], None, L, live)), "seqs.token_ids");
        assert_eq!(field(check_step(&[seq(1, 0, &[10])], None, L, live)), "seqs.token_ids");
        assert_eq!(field(check_step(&[seq(2, 5, &[1])], None, L, live)), "seqs.start_pos");
        assert_eq!(field(check_step(&[seq(7, 4, &[1])], None, L, live)), "seqs.start_pos");
        assert_eq!(
            field(check_step(&[seq(7, 3, &[1; 6])], None, L, live)),
            "seqs.start_pos",
            "past the context"
        );
        // KV blocks that do not cover the positions, or lie outside the pool.
        let short = StepSeq { blocks: vec![1], ..seq(1, 0, &[1; 5]) };
        assert_eq!(field(check_step(&[short], None, L, live)), "seqs.blocks");
        let outside = StepSeq { blocks: vec![1, 8], ..seq(1, 0, &[1; 5]) };
        assert_eq!(field(check_step(&[outside], None, L, live)), "seqs.blocks");
        // A new sequence on cached blocks starts after its cached tokens, and only there.
        let cached = StepSeq { cached: vec![3, 4, 5, 6], ..seq(2, 4, &[1]) };
        assert!(check_step(std::slice::from_ref(&cached), None, L, live).is_ok());
        let off = StepSeq { start_pos: 3, ..cached };
        assert_eq!(field(check_step(&[off], None, L, live)), "seqs.start_pos");
        assert_eq!(field(check_step(&[seq(1, 0, &[1])], Some(&[0.0; 3]), L, live)), "hidden");
        assert_eq!(
            field(check_step(&[seq(1, 0, &[1])], Some(&[0.0, f32::NAN]), L, live)),
            "hidden"
        );
    }
}
