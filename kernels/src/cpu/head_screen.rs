//! Greedy heads at the 8-bit kernels' speed with the f32 path's tokens. The vocabulary projection
//! keeps f32 activations because 8-bit ones flipped near-tied first tokens; but a greedy step
//! needs only the argmax. So: every logit at 8 bits (`Precision::Int8`, ~2× the f32 kernel on a
//! Q8_0 head), a bound on how far each can be from the f32 path's — per group of `GROUP` values,
//! the activations' rounding there (half the group's largest block scale) times the row's Σ|w|
//! over the group, plus both paths' float rounding — and the f32 path's
//! exact logit (`quant::dot` of the dequantized row: the bits `matmul` gives) for every token whose
//! interval reaches the best lower bound. Any other token is provably below that one, so the argmax
//! over the rescored candidates (first index on ties, as `host::argmax`) is the f32 path's token.

use super::matmul::matmul;
use super::CpuWeight;
use crate::quant::{dequant_row, dot};
use crate::Precision;
use half::f16;
use rayon::prelude::*;

/// Values per group of the bound: one activation block. A model whose final hidden state has a
/// few huge channels (SmolLM2) has a few huge block scales; with one bound a row (the largest
/// half-scale times the row's Σ|w|) 48,000 of SmolLM2's 49,152 tokens were candidates, so every
/// step fell back to the f32 head. Per block, an outlier's scale weighs only its block's weights:
/// 2-31 candidates a step (median 3; per 128 values: median 38, and a crowd now and then).
const GROUP: usize = 32;

/// A head's Σ|w| per row and per `GROUP` values of each row (the last group may be shorter), f32
/// sums of the dequantized values; the groups' kept as f16 rounded up (a bound stays a bound; 2
/// bytes per 32 weights — 33 MB beside a 128k-vocabulary 8B head's 537 MB).
#[derive(Debug, Clone)]
pub struct Norms {
    /// `k.div_ceil(GROUP)` a row, row after row.
    groups: Vec<f16>,
    rows: Vec<f32>,
}

impl Norms {
    /// From each row's group norms (`g` a row); the rows' as their sums.
    fn new(groups: Vec<f16>, g: usize) -> Norms {
        let rows = groups.chunks_exact(g).map(|r| r.iter().map(|v| v.to_f32()).sum()).collect();
        Norms { groups, rows }
    }
}

/// `w`'s norms, computed once per weight.
pub(super) fn norms(w: &CpuWeight) -> Norms {
    let raw = w.raw();
    let rb = raw.len() / w.rows.max(1);
    let groups = raw
        .par_chunks(rb.max(1))
        .map_init(
            || vec![0f32; w.cols],
            |buf, r| {
                dequant_row(w.dtype, r, buf);
                buf.chunks(GROUP).map(|g| up(g.iter().map(|v| v.abs()).sum())).collect::<Vec<_>>()
            },
        )
        .flatten_iter()
        .collect();
    Norms::new(groups, w.cols.div_ceil(GROUP))
}

/// Whether greedy steps on `w` can be screened: a quantized weight with an 8-bit dot, rows of
/// whole 32-value blocks.
fn screens(w: &CpuWeight) -> bool {
    w.f32.is_none() && super::int8::supports(w.dtype) && w.cols.is_multiple_of(32)
}

/// Computes `w`'s row norms now where the screen would use them (a head loaded for greedy steps).
pub(super) fn prepare(w: &CpuWeight) {
    if screens(w) {
        w.norms.get_or_init(|| norms(w));
    }
}

/// The least f16 at or above `v` (infinity past f16's range).
fn up(v: f32) -> f16 {
    let h = f16::from_f32(v);
    if h.to_f32() >= v || h.is_nan() {
        h
    } else {
        f16::from_bits(h.to_bits() + 1)
    }
}

/// How far an 8-bit logit of activation row `x` can be from the f32 path's, per unit of the weight
/// row's Σ|w| over each `GROUP` values: half the group's largest block scale (`int8::quantize_row`
/// rounds each value to the nearest multiple of its block's amax/127), and each path's rounding —
/// γ_k = k·u/(1 − k·u) of Σ|w|·|x| per path over the whole row, u = 2⁻²⁴ — with a margin for the
/// norms themselves being rounded sums.
pub(super) fn bound(x: &[f32]) -> Vec<f64> {
    let amax: Vec<f64> =
        x.chunks(GROUP).map(|g| g.iter().fold(0f32, |a, v| a.max(v.abs())) as f64).collect();
    let x_max = amax.iter().fold(0f64, |a, &v| a.max(v));
    let d_max = x_max / 127.0;
    let ku = x.len() as f64 * f64::from(f32::EPSILON) / 2.0;
    let gamma = ku / (1.0 - ku).max(0.5);
    amax.iter().map(|a| (a / 127.0 / 2.0 + 3.0 * gamma * (x_max + d_max)) * 1.001 + 1e-30).collect()
}

/// Tokens `j` whose interval (`approx[j]` ± Σ_g `e[g]`·(row j's norm over group g), `e.len()`
/// groups a row) reaches the largest lower bound. The lower bound of the largest `approx` is a
/// floor; a row whose interval, widened to its whole Σ|w| times the largest `e`, stays below it is
/// out without its groups being read (a 262k-token head's groups are 5M values a step).
pub(super) fn candidates(approx: &[f32], norms: &Norms, e: &[f64]) -> Vec<usize> {
    let g = e.len();
    let err = |j: usize| -> f64 {
        norms.groups[j * g..(j + 1) * g].iter().zip(e).map(|(&s, &eg)| s.to_f64() * eg).sum()
    };
    let top = crate::host::argmax(approx);
    let floor = approx[top] as f64 - err(top);
    let e_max = e.iter().fold(0f64, |a, &v| a.max(v));
    let reach: Vec<(usize, f64)> = (0..approx.len())
        .into_par_iter()
        .filter(|&j| approx[j] as f64 + e_max * norms.rows[j] as f64 * 1.001 >= floor)
        .map(|j| (j, err(j)))
        .filter(|&(j, d)| approx[j] as f64 + d >= floor)
        .collect();
    // The largest lower bound is one of these rows' (any other's lies below the floor).
    let lower = reach.iter().map(|&(j, d)| approx[j] as f64 - d).fold(floor, f64::max);
    reach.into_iter().filter(|&(j, d)| approx[j] as f64 + d >= lower).map(|(j, _)| j).collect()
}

/// Candidates past this share of the vocabulary (1/`CROWD`) make rescoring cost more than the
/// f32 path saves: that step falls back, and the next `CROWD` steps skip the screen (a model whose
/// logits are flat — random weights — pays at most a 1/`CROWD` share of screens in vain).
const CROWD: usize = 16;

/// The f32 path's argmax token for the one row `x` against `w` (the head), found as the module doc
/// says; None where this way does not apply — f32 weights, a format without an 8-bit dot, several
/// rows (whose f32 kernel shares each weight row's load among them: the screen saved nothing
/// measured), a crowd of candidates (`CROWD`), a logit that is not finite (the caller's f32 path
/// reports it).
pub(super) fn argmax(w: &CpuWeight, x: &[f32], m: usize) -> Option<Vec<u32>> {
    use std::sync::atomic::Ordering::Relaxed;
    let (n, k) = (w.rows, w.cols);
    if !screens(w) || m != 1 || x.len() != k {
        return None;
    }
    if w.screen_skip.load(Relaxed) > 0 {
        w.screen_skip.fetch_sub(1, Relaxed);
        return None;
    }
    let raw = w.raw();
    let rb = raw.len() / n.max(1);
    let approx = matmul(w.dtype, raw, None, (n, k), x, 1, Precision::Int8);
    if approx.iter().any(|v| !v.is_finite()) {
        return None;
    }
    let norms = w.norms.get_or_init(|| norms(w));
    let cands = candidates(&approx, norms, &bound(x));
    if cands.len() > n / CROWD {
        w.screen_skip.store(CROWD as u32, Relaxed);
        return None;
    }
    // The f32 path's logit of each candidate (its bits: `matmul` F32 dots dequantized rows so).
    let exact: Vec<(usize, f32)> = cands
        .par_iter()
        .map_init(
            || vec![0f32; k],
            |deq, &j| {
                dequant_row(w.dtype, &raw[j * rb..(j + 1) * rb], deq);
                (j, dot(deq, x))
            },
        )
        .collect();
    let mut best: Option<(usize, f32)> = None;
    for (j, v) in exact {
        if !v.is_finite() {
            return None;
        }
        if best.is_none_or(|(_, b)| v > b) {
            best = Some((j, v));
        }
    }
    Some(vec![best?.0 as u32])
}

#[cfg(test)]
mod tests {
    use super::*;
    use layerstream_types::DType;

    /// The screened argmax is the f32 path's for one row of each head format, also where the top
    /// two logits are a near-tie far closer than the 8-bit error (two weight rows that differ in
    /// one value); the candidates are few where one token stands out.
    #[test]
    fn the_screened_argmax_is_the_f32_paths() {
        let (n, k) = (301, 512);
        for dtype in [DType::Q8_0, DType::Q4K, DType::Q6K, DType::Q4_0] {
            let mut w = layerstream_types::random::Rng::new(5).tensor(dtype, &[n, k]).unwrap();
            let rb = w.len() / n;
            // Row 7 a copy of row 200 but for its last block's bytes: a near-tie.
            let (a, b) = w.split_at_mut(200 * rb);
            a[7 * rb..7 * rb + rb - 2].copy_from_slice(&b[..rb - 2]);
            let weight = CpuWeight::build("head", dtype, &[n, k], &w, None).unwrap();
            for seed in 0..6 {
                let m = 1;
                let x: Vec<f32> = (0..m * k)
                    .map(|i| (((i + 131 * seed) * 37 % 101) as f32 - 50.0) * 0.013)
                    .collect();
                let f32_logits = matmul(dtype, &w, None, (n, k), &x, m, Precision::F32);
                let want: Vec<u32> =
                    f32_logits.chunks_exact(n).map(|r| crate::host::argmax(r) as u32).collect();
                assert_eq!(argmax(&weight, &x, m), Some(want), "{dtype} seed {seed}");
            }
            let two = vec![0.5f32; 2 * k];
            assert_eq!(argmax(&weight, &two, 2), None, "several rows take the f32 path");
        }
        // One token far above the rest: it alone is a candidate.
        let mut approx = vec![0f32; 1000];
        approx[3] = 50.0;
        let ones = Norms::new(vec![f16::ONE; 1000], 1);
        assert_eq!(candidates(&approx, &ones, &[0.1]), vec![3]);
        // Within the error of each other: both.
        approx[9] = 49.9;
        assert_eq!(candidates(&approx, &ones, &[0.1]), vec![3, 9]);
        // Two groups a row: token 9's error lies where its weights are large.
        let mut groups = vec![f16::ONE; 2000];
        groups[2 * 9 + 1] = f16::from_f32(100.0);
        let norms = Norms::new(groups, 2);
        assert_eq!(candidates(&approx, &norms, &[0.001, 0.0]), vec![3]);
        assert_eq!(candidates(&approx, &norms, &[0.0, 0.001]), vec![3, 9]);
    }

    /// The bound covers the activations' rounding: half each block's scale, an outlier's only in
    /// its own block; the stored norms never round down.
    #[test]
    fn the_bound_is_half_each_blocks_scale_and_a_little_more() {
        let mut x = vec![0.5f32; 64];
        x[40] = 12.7;
        let e = bound(&x);
        assert_eq!(e.len(), 2);
        // Block 0: its half-scale and the row's float rounding (3γ·(12.7 + 0.1), γ ≈ 64·2⁻²⁴).
        assert!((0.5 / 254.0 + 1.4e-4..0.5 / 254.0 + 1.6e-4).contains(&e[0]), "{e:?}");
        assert!((0.05..0.0502).contains(&e[1]), "{e:?}");
        assert!(bound(&[0.0; 32])[0] > 0.0);
        for v in [0.1f32, 1.0 / 3.0, 1234.567, 65504.0] {
            assert!(up(v).to_f32() >= v && up(v).to_f32() <= v * 1.001, "{v}");
        }
        assert!(up(1e6).is_infinite());
    }
}
