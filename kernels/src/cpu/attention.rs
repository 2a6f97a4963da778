//! CPU grouped-query attention over a per-sequence KV cache: causal prefill and one-token decode.

use crate::backend::AttnShape;
use crate::host::softmax;
use crate::quant::dot;
use rayon::prelude::*;

/// Keys and values of one sequence for one layer, `[len, n_kv_heads * head_dim]` each.
#[derive(Debug, Clone, Default)]
pub struct CpuKv {
    pub k: Vec<f32>,
    pub v: Vec<f32>,
    pub len: usize,
}

/// Appends `m` new rows to the cache and attends `q` (`[m, q_dim]`) causally over the cache.
pub fn attention(
    q: &[f32],
    k: &[f32],
    v: &[f32],
    m: usize,
    cache: &mut CpuKv,
    s: AttnShape,
) -> Vec<f32> {
    let (hd, kvd, qd) = (s.head_dim, s.n_kv_heads * s.head_dim, s.n_heads * s.head_dim);
    let start = cache.len;
    cache.k.extend_from_slice(&k[..m * kvd]);
    cache.v.extend_from_slice(&v[..m * kvd]);
    cache.len += m;
    let group = s.n_heads / s.n_kv_heads;
    let scale = 1.0 / (hd as f32).sqrt();
    let mut out = vec![0f32; m * qd];
    let (ck, cv) = (&cache.k, &cache.v);
    out.par_chunks_mut(hd).enumerate().for_each(|(idx, o)| {
        let (row, h) = (idx / s.n_heads, idx % s.n_heads);
        let kvh = h / group;
        let qv = &q[row * qd + h * hd..row * qd + (h + 1) * hd];
        let n_ctx = start + row + 1;
        let mut scores: Vec<f32> = (0..n_ctx)
            .map(|t| dot(qv, &ck[t * kvd + kvh * hd..t * kvd + (kvh + 1) * hd]) * scale)
            .collect();
        softmax(&mut scores);
        for (t, p) in scores.iter().enumerate() {
            let vv = &cv[t * kvd + kvh * hd..t * kvd + (kvh + 1) * hd];
            for (oi, vi) in o.iter_mut().zip(vv) {
                *oi += p * vi;
            }
        }
    });
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Prefilling n tokens at once equals feeding them one at a time (causality + cache reuse).
    #[test]
    fn prefill_equals_incremental_decode() {
        let s = AttnShape { n_heads: 4, n_kv_heads: 2, head_dim: 8 };
        let m = 5;
        let gen = |n: usize, mul: usize| -> Vec<f32> {
            (0..n).map(|i| ((i * mul) % 17) as f32 * 0.1 - 0.8).collect()
        };
        let (q, k, v) = (gen(m * 32, 7), gen(m * 16, 5), gen(m * 16, 3));
        let mut c1 = CpuKv::default();
        let all = attention(&q, &k, &v, m, &mut c1, s);
        let mut c2 = CpuKv::default();
        for r in 0..m {
            let one = attention(
                &q[r * 32..(r + 1) * 32],
                &k[r * 16..(r + 1) * 16],
                &v[r * 16..(r + 1) * 16],
                1,
                &mut c2,
                s,
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
}
