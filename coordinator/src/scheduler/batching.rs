//! How a step is filled, pure and unit-tested: which waiting requests join (`admit`, within the
//! batch and KV limits) and how many tokens each running sequence brings (`step_tokens`, chunked
//! prefill).

/// Admission limits.
#[derive(Debug, Clone, Copy)]
pub struct Limits {
    pub(crate) max_batch: usize,
    /// KV positions of the pool (every worker's), in blocks of `kv_block`.
    pub(crate) kv_capacity: usize,
    pub(crate) max_step_tokens: usize,
    pub(crate) kv_block: usize,
    /// Slots of every worker's host-RAM KV tier (0: preempted sequences are replayed).
    pub(crate) host_blocks: usize,
    /// Full blocks are kept and shared by later prompts with the same prefix.
    pub(crate) prefix_cache: bool,
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

/// Which of the waiting requests may join now (FIFO, within the batch limit and the `free` KV
/// blocks, each needing `waiting[i]`): pure, unit-tested. Every running sequence decodes a token a
/// step, so no more run than a step carries.
pub fn admit(active: usize, free: usize, waiting: &[usize], l: Limits) -> usize {
    let (mut n, mut used) = (0, 0);
    let most = l.max_batch.min(l.max_step_tokens);
    for &need in waiting {
        if active + n >= most || used + need > free {
            break;
        }
        used += need;
        n += 1;
    }
    n
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn admission_respects_batch_and_kv_limits_in_order() {
        let l = Limits {
            max_batch: 3,
            kv_capacity: 100,
            max_step_tokens: 64,
            kv_block: 16,
            host_blocks: 0,
            prefix_cache: true,
        };
        // Needs and free space in KV blocks.
        assert_eq!(admit(0, 100, &[10, 10, 10, 10], l), 3);
        assert_eq!(admit(2, 100, &[10, 10], l), 1);
        assert_eq!(admit(0, 20, &[30, 10], l), 0, "FIFO: a big request is not overtaken");
        assert_eq!(admit(0, 25, &[10, 10, 10], l), 2, "the free blocks bound it");
        assert_eq!(admit(0, 100, &[], l), 0);
        assert_eq!(
            admit(1, 100, &[10, 10, 10], Limits { max_step_tokens: 2, ..l }),
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
