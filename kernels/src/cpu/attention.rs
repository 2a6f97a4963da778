//! CPU grouped-query attention over a per-sequence KV cache: causal prefill and one-token decode.

use crate::backend::{AttnShape, KV_ROLLBACK};
use crate::host::softmax;
use crate::quant::dot;
use rayon::prelude::*;

/// Keys and values of one sequence for one layer, `[len - dropped, n_kv_heads * head_dim]` each:
/// positions `dropped..len` (a sliding-window layer drops what no later row can see).
#[derive(Debug, Clone, Default)]
pub struct CpuKv {
    pub k: Vec<f32>,
    pub v: Vec<f32>,
    pub len: usize,
    pub dropped: usize,
}

/// Appends `m` new rows to the cache and attends `q` (`[m, q_dim]`) causally over the cache (over
/// the last `s.window` positions of each row's context when a window is set), scores scaled by
/// `s.scale`. A windowed cache then drops the positions no later row can see (beyond the
/// `KV_ROLLBACK` it keeps for rejected drafts), once they are as many as the window (so it holds
/// under two windows plus that margin, and the drop costs one copy per window of rows). With a
/// token tree's ancestor masks (`tree`, at most 64 rows, full-context layers only) row i attends to
/// the positions cached before this call and to the new rows whose bit is set in `tree[i]` instead.
pub fn attention(
    q: &[f32],
    k: &[f32],
    v: &[f32],
    m: usize,
    cache: &mut CpuKv,
    s: AttnShape,
    tree: Option<&[u64]>,
) -> Vec<f32> {
    let (hd, kvd, qd) = (s.head_dim, s.n_kv_heads * s.head_dim, s.n_heads * s.head_dim);
    let start = cache.len;
    cache.k.extend_from_slice(&k[..m * kvd]);
    cache.v.extend_from_slice(&v[..m * kvd]);
    cache.len += m;
    let group = s.n_heads / s.n_kv_heads;
    let mut out = vec![0f32; m * qd];
    let (ck, cv, base) = (&cache.k, &cache.v, cache.dropped);
    out.par_chunks_mut(hd).enumerate().for_each(|(idx, o)| {
        let (row, h) = (idx / s.n_heads, idx % s.n_heads);
        let kvh = h / group;
        let qv = &q[row * qd + h * hd..row * qd + (h + 1) * hd];
        let n_ctx = start + row + 1;
        let first = if s.window > 0 { n_ctx.saturating_sub(s.window) } else { 0 };
        // Cache row of position t.
        let at = |t: usize| (t - base) * kvd + kvh * hd;
        // The positions this row sees: causal, or the cached ones and its ancestors in a tree.
        let seen: Vec<usize> = match tree {
            None => (first..n_ctx).collect(),
            Some(a) => (first..start)
                .chain((0..m).filter(|&j| a[row] >> j & 1 == 1).map(|j| start + j))
                .collect(),
        };
        let mut scores: Vec<f32> =
            seen.iter().map(|&t| dot(qv, &ck[at(t)..at(t) + hd]) * s.scale).collect();
        softmax(&mut scores);
        for (&t, p) in seen.iter().zip(&scores) {
            for (oi, vi) in o.iter_mut().zip(&cv[at(t)..at(t) + hd]) {
                *oi += p * vi;
            }
        }
    });
    if s.window > 0 && cache.len - cache.dropped >= 2 * s.window + KV_ROLLBACK {
        // Keep the window - 1 positions the next row can still see, and the rollback margin.
        let drop = cache.len - (s.window - 1) - KV_ROLLBACK - cache.dropped;
        cache.k.drain(..drop * kvd);
        cache.v.drain(..drop * kvd);
        cache.dropped += drop;
    }
    out
}

/// Forgets positions `len..` (a rejected draft); an error names the cut when the cache no longer
/// holds position `len` (a sliding window dropped it, or `len` is past the end).
pub fn truncate(cache: &mut CpuKv, len: usize, kv_dim: usize) -> Result<(), String> {
    if len > cache.len || len < cache.dropped {
        return Err(format!(
            "cannot roll a cache of positions {}..{} back to {len}",
            cache.dropped, cache.len
        ));
    }
    cache.k.truncate((len - cache.dropped) * kv_dim);
    cache.v.truncate((len - cache.dropped) * kv_dim);
    cache.len = len;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Prefilling n tokens at once equals feeding them one at a time (causality + cache reuse).
    #[test]
    fn prefill_equals_incremental_decode() {
        let s = AttnShape::new(4, 2, 8);
        let m = 5;
        let gen = |n: usize, mul: usize| -> Vec<f32> {
            (0..n).map(|i| ((i * mul) % 17) as f32 * 0.1 - 0.8).collect()
        };
        let (q, k, v) = (gen(m * 32, 7), gen(m * 16, 5), gen(m * 16, 3));
        let mut c1 = CpuKv::default();
        let all = attention(&q, &k, &v, m, &mut c1, s, None);
        let mut c2 = CpuKv::default();
        for r in 0..m {
            let one = attention(
                &q[r * 32..(r + 1) * 32],
                &k[r * 16..(r + 1) * 16],
                &v[r * 16..(r + 1) * 16],
                1,
                &mut c2,
                s,
                None,
            );
            for (a, b) in one.iter().zip(&all[r * 32..(r + 1) * 32]) {
                assert!((a - b).abs() < 1e-5);
            }
        }
        assert_eq!(c2.len, m);
        // first row attends only to itself: output = v of kv head
        assert!(
            (all[0] - v[0]).abs() < 1e-6
                && (all[8] - v[0]).abs() < 1e-6
                && (all[16] - v[8]).abs() < 1e-6
        );
    }

    /// A sliding window equals full attention over only the last `window` positions, and the cache
    /// stays under two windows while decoding far past it.
    #[test]
    fn window_attends_to_the_last_positions_and_bounds_the_cache() {
        let w = 3;
        let s = AttnShape { window: w, ..AttnShape::new(2, 1, 4) };
        let gen = |n: usize, mul: usize| -> Vec<f32> {
            (0..n).map(|i| ((i * mul) % 13) as f32 * 0.2 - 1.1).collect()
        };
        let n = 20 + 2 * KV_ROLLBACK;
        let (q, k, v) = (gen(n * 8, 7), gen(n * 4, 5), gen(n * 4, 3));
        let mut c = CpuKv::default();
        for r in 0..n {
            let got = attention(
                &q[r * 8..(r + 1) * 8],
                &k[r * 4..(r + 1) * 4],
                &v[r * 4..(r + 1) * 4],
                1,
                &mut c,
                s,
                None,
            );
            // Reference: full attention over rows max(0, r + 1 - w)..=r only.
            let lo = (r + 1).saturating_sub(w);
            let mut full = CpuKv::default();
            let (kk, vv) = (&k[lo * 4..(r + 1) * 4], &v[lo * 4..(r + 1) * 4]);
            let m = r + 1 - lo;
            let qs: Vec<f32> = (0..m).flat_map(|_| q[r * 8..(r + 1) * 8].iter().copied()).collect();
            let want = attention(&qs, kk, vv, m, &mut full, AttnShape::new(2, 1, 4), None);
            for (a, b) in got.iter().zip(&want[(m - 1) * 8..]) {
                assert!((a - b).abs() < 1e-5, "row {r}");
            }
            assert!(
                c.len - c.dropped < 2 * w + KV_ROLLBACK,
                "row {r}: {} cached",
                c.len - c.dropped
            );
        }
        assert_eq!(c.len, n);
        assert!(c.dropped > 0, "the window dropped positions");
    }

    /// A tree's row attends to the cache and its ancestors only: each root-to-leaf path of a tree
    /// equals that path fed alone (causal), row for row.
    #[test]
    fn tree_rows_see_their_ancestors_only() {
        let s = AttnShape::new(2, 1, 4);
        let gen = |n: usize, mul: usize| -> Vec<f32> {
            (0..n).map(|i| ((i * mul) % 13) as f32 * 0.2 - 1.1).collect()
        };
        let (q, k, v) = (gen(8 * 8, 7), gen(8 * 4, 5), gen(8 * 4, 3));
        // Two cached positions, then a tree of 5 rows: 0 → {1, 2}, 1 → 3, 2 → 4.
        let parents = [usize::MAX, 0, 0, 1, 2];
        let anc: Vec<u64> = (0..5)
            .map(|i| {
                let (mut a, mut n) = (0u64, i);
                loop {
                    a |= 1 << n;
                    if parents[n] == usize::MAX {
                        break a;
                    }
                    n = parents[n];
                }
            })
            .collect();
        let mut c = CpuKv::default();
        attention(&q[..16], &k[..8], &v[..8], 2, &mut c, s, None);
        let got = attention(&q[16..56], &k[8..28], &v[8..28], 5, &mut c, s, Some(&anc));
        for path in [[0usize, 1, 3], [0, 2, 4]] {
            let mut p = CpuKv::default();
            attention(&q[..16], &k[..8], &v[..8], 2, &mut p, s, None);
            let rows = |x: &[f32], w: usize| -> Vec<f32> {
                path.iter().flat_map(|&r| x[(2 + r) * w..(3 + r) * w].to_vec()).collect()
            };
            let want = attention(&rows(&q, 8), &rows(&k, 4), &rows(&v, 4), 3, &mut p, s, None);
            for (i, &r) in path.iter().enumerate() {
                for (a, b) in got[r * 8..(r + 1) * 8].iter().zip(&want[i * 8..(i + 1) * 8]) {
                    assert!((a - b).abs() < 1e-5, "path {path:?} row {r}");
                }
            }
        }
    }

    /// Rolling a cache back and appending again equals never having appended the rejected rows;
    /// a windowed cache can roll back `KV_ROLLBACK` positions, and a cut below what it holds fails.
    #[test]
    fn truncate_forgets_rejected_rows() {
        let s = AttnShape::new(2, 1, 4);
        let gen = |n: usize, mul: usize| -> Vec<f32> {
            (0..n).map(|i| ((i * mul) % 11) as f32 * 0.3 - 1.0).collect()
        };
        let (q, k, v) = (gen(6 * 8, 7), gen(6 * 4, 5), gen(6 * 4, 3));
        let mut plain = CpuKv::default();
        let want = attention(&q, &k, &v, 6, &mut plain, s, None);
        let mut c = CpuKv::default();
        attention(&q[..3 * 8], &k[..3 * 4], &v[..3 * 4], 3, &mut c, s, None);
        // Two rejected rows (other keys), then rolled back.
        attention(&q[..2 * 8], &v[..2 * 4], &k[..2 * 4], 2, &mut c, s, None);
        truncate(&mut c, 3, 4).unwrap();
        let got = attention(&q[3 * 8..], &k[3 * 4..], &v[3 * 4..], 3, &mut c, s, None);
        for (a, b) in got.iter().zip(&want[3 * 8..]) {
            assert!((a - b).abs() < 1e-6);
        }
        assert!(truncate(&mut c, 7, 4).unwrap_err().contains("back to 7"));
        let w = AttnShape { window: 2, ..s };
        let n = 3 * KV_ROLLBACK;
        let mut c = CpuKv::default();
        for _ in 0..n {
            attention(&q[..8], &k[..4], &v[..4], 1, &mut c, w, None);
        }
        assert!(c.dropped > 0);
        truncate(&mut c, n - KV_ROLLBACK, 4).unwrap();
        let below = c.dropped - 1;
        assert!(truncate(&mut c, below, 4).is_err());
    }
}
