//! Which tokens top-k and top-p keep, without sorting the whole vocabulary: a selection for top-k, a
//! probability histogram for top-p alone, and for untruncated sampling a draw in id order. The full
//! sort they must equal is here too, as their test's reference and the benchmark's baseline.

use crate::host::softmax;
use crate::sampling::Pick;

/// Token order for truncation: higher logit first, the lower id first among equal logits.
fn descending(logits: &[f32]) -> impl Fn(&u32, &u32) -> std::cmp::Ordering + '_ {
    move |a, b| logits[*b as usize].total_cmp(&logits[*a as usize]).then(a.cmp(b))
}

/// The `k` most likely ids, sorted: a selection over the vocabulary (linear), then a sort of `k`.
fn top_k_sorted(logits: &[f32], k: usize) -> Vec<u32> {
    let mut all: Vec<u32> = (0..logits.len() as u32).collect();
    if k < all.len() {
        all.select_nth_unstable_by(k.max(1) - 1, descending(logits));
        all.truncate(k);
    }
    all.sort_unstable_by(descending(logits));
    all
}

/// The histogram of `nucleus_candidates`: buckets of an eighth of a nat below the most likely token's
/// tempered logit (the last bucket takes everything further down).
const BUCKETS: usize = 512;
const BUCKETS_PER_NAT: f32 = 8.0;

/// The ids whose probability is at least that of the lowest bucket where the buckets' mass, most
/// likely first, reaches `top_p`: a prefix of the descending order that holds the nucleus, found in
/// linear time, sorted. Everything when the mass never reaches `top_p`.
fn nucleus_candidates(logits: &[f32], d: &Tempered, top_p: f32) -> Vec<u32> {
    let bucket = |l: f32| (((d.m - l / d.t) * BUCKETS_PER_NAT) as usize).min(BUCKETS - 1);
    let mut mass = [0f32; BUCKETS];
    for &l in logits {
        mass[bucket(l)] += d.prob(l);
    }
    let mut cum = 0.0;
    let last = mass.iter().position(|&x| {
        cum += x;
        cum >= top_p
    });
    let last = last.unwrap_or(BUCKETS - 1);
    let mut idx: Vec<u32> =
        (0..logits.len() as u32).filter(|&i| bucket(logits[i as usize]) <= last).collect();
    idx.sort_unstable_by(descending(logits));
    idx
}

/// The whole vocabulary's distribution at temperature `t`: `exp(l/t − m) / s`, `m` the largest
/// tempered logit and `s` the sum of the exponentials in id order. One definition, so the selection
/// and its full-sort reference compute bit-identical probabilities.
struct Tempered {
    t: f32,
    m: f32,
    s: f32,
}

impl Tempered {
    fn new(logits: &[f32], t: f32) -> Tempered {
        let m = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max) / t;
        Tempered { t, m, s: logits.iter().map(|&l| (l / t - m).exp()).sum() }
    }

    fn prob(&self, l: f32) -> f32 {
        (l / self.t - self.m).exp() / self.s
    }
}

/// Softmax over the tempered logits of `idx` only (top-k renormalises over its k).
fn softmax_of(logits: &[f32], idx: &[u32], t: f32) -> Vec<f32> {
    let mut probs: Vec<f32> = idx.iter().map(|&i| logits[i as usize] / t).collect();
    softmax(&mut probs);
    probs
}

/// Samples from the whole tempered distribution, walking ids in order (no sort).
pub fn draw_unordered(logits: &[f32], t: f32, r: f32) -> u32 {
    let d = Tempered::new(logits, t);
    let (mut cum, mut last) = (0.0, 0);
    for (i, &l) in logits.iter().enumerate() {
        let p = d.prob(l);
        if p > 0.0 {
            last = i;
        }
        cum += p;
        if r < cum {
            return i as u32;
        }
    }
    last as u32
}

/// The candidates top-k and top-p keep, most likely first, with their renormalised probabilities
/// (`pub` for the worker's `benches/sampling.rs`). Only as many ids are sorted as the cut needs: top-k's k, or for
/// top-p alone the prefix that a histogram of the probabilities (1/8-nat buckets) says holds the
/// nucleus (for a chat model's 128k-token distribution usually tens to hundreds of ids).
pub fn nucleus(logits: &[f32], p: &Pick) -> (Vec<u32>, Vec<f32>) {
    let t = p.temperature;
    let (mut idx, mut probs);
    if p.top_k > 0 {
        idx = top_k_sorted(logits, p.top_k);
        probs = softmax_of(logits, &idx, t);
    } else {
        let d = Tempered::new(logits, t);
        let prob = |i: &u32| d.prob(logits[*i as usize]);
        idx = nucleus_candidates(logits, &d, p.top_p);
        probs = idx.iter().map(prob).collect();
        if idx.len() < logits.len() && nucleus_len(&probs, p.top_p).is_none() {
            // Summed in another order, the candidates fell a rounding short of top-p: take all.
            idx = top_k_sorted(logits, logits.len());
            probs = idx.iter().map(prob).collect();
        }
    }
    cut_top_p(&mut idx, &mut probs, p.top_p);
    (idx, probs)
}

/// How many of `probs` (most likely first) it takes for their sum to reach `top_p`; `None` if all
/// of them fall short.
fn nucleus_len(probs: &[f32], top_p: f32) -> Option<usize> {
    let mut cum = 0.0;
    probs
        .iter()
        .position(|&x| {
            cum += x;
            cum >= top_p
        })
        .map(|k| k + 1)
}

/// Keeps the nucleus of sorted candidates (all of them when `top_p` ≥ 1) and renormalises.
fn cut_top_p(idx: &mut Vec<u32>, probs: &mut Vec<f32>, top_p: f32) {
    if top_p < 1.0 {
        let n = nucleus_len(probs, top_p).unwrap_or(probs.len());
        idx.truncate(n);
        probs.truncate(n);
        let s: f32 = probs.iter().sum();
        probs.iter_mut().for_each(|x| *x /= s);
    }
}

/// What `nucleus` must equal, by definition: sort every id (same order), then cut. The reference of
/// its test and the baseline of `benches/sampling.rs`; not used to sample.
#[doc(hidden)]
pub fn full_sort_nucleus(logits: &[f32], p: &Pick) -> (Vec<u32>, Vec<f32>) {
    let mut idx: Vec<u32> = (0..logits.len() as u32).collect();
    idx.sort_by(descending(logits));
    let mut probs: Vec<f32> = if p.top_k > 0 {
        idx.truncate(p.top_k);
        softmax_of(logits, &idx, p.temperature)
    } else {
        let d = Tempered::new(logits, p.temperature);
        idx.iter().map(|&i| d.prob(logits[i as usize])).collect()
    };
    cut_top_p(&mut idx, &mut probs, p.top_p);
    (idx, probs)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn selected_candidates_equal_a_full_sort() {
        // Logits with many ties (a few hundred distinct values over 5000 ids), flat and peaked.
        let mut state = 7u64;
        for peak in [0.5f32, 4.0, 12.0] {
            let logits: Vec<f32> = (0..5000)
                .map(|_| {
                    state =
                        state.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                    ((state >> 40) % 300) as f32 / 300.0 * peak
                })
                .collect();
            for (temperature, top_k, top_p) in [
                (0.7, 0, 0.9),
                (1.0, 0, 0.5),
                (1.3, 0, 0.999),
                (1.0, 0, 0.999_999_9),
                (0.7, 50, 1.0),
                (0.7, 50, 0.8),
                (1.0, 6000, 0.95),
                (0.2, 1, 1.0),
            ] {
                let p = Pick { temperature, top_k, top_p, repetition_penalty: 1.0 };
                let (got, want) = (nucleus(&logits, &p), full_sort_nucleus(&logits, &p));
                assert_eq!(got, want, "peak {peak}, {p:?}");
                assert!(
                    got.0.len() > 1 || top_k == 1,
                    "peak {peak}, {p:?}: a trivial nucleus tests nothing"
                );
            }
        }
    }
}
