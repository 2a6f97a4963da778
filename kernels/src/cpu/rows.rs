//! One weight row against many activation rows — the matvec path of batched decode and short
//! prefills. Four activation rows go at a time, so each weight value is loaded once for four and
//! the four rows' running sums hide each other's addition latency. Every result is bit-identical to
//! `quant::dot` of that pair (the same eight lane sums, the same multiply then add, the same final
//! order), so a sequence's logits do not depend on what it is batched with. With AVX2 (detected once
//! at run time) the eight lanes are one register: a multiply then an add, as `dot` does (no FMA,
//! which would round differently); without it, `dot` row by row.

use crate::quant::dot;

/// Lanes of `quant::dot`'s accumulator.
const LANES: usize = 8;
/// Activation rows per pass over the weight row.
const BLOCK: usize = 4;

/// `out[i] = dot(w, x[i*k .. (i+1)*k])` for every `i < out.len()`.
pub fn dot_rows(w: &[f32], x: &[f32], k: usize, out: &mut [f32]) {
    assert!(w.len() >= k && x.len() >= out.len() * k);
    #[cfg(target_arch = "x86_64")]
    if avx2() {
        // SAFETY: the CPU supports AVX2 (checked at run time by `avx2`); the assert above bounds
        // every row read.
        return unsafe { avx2_rows::dot_rows(w, x, k, out) };
    }
    for (i, o) in out.iter_mut().enumerate() {
        *o = dot(&w[..k], &x[i * k..(i + 1) * k]);
    }
}

/// `dot_rows` for two weight rows at once (each activation row loaded once for both):
/// `out0[i] = dot(w0, x_i)`, `out1[i] = dot(w1, x_i)`.
pub fn dot_rows2(w0: &[f32], w1: &[f32], x: &[f32], k: usize, out0: &mut [f32], out1: &mut [f32]) {
    assert!(w0.len() >= k && w1.len() >= k && out0.len() == out1.len());
    assert!(x.len() >= out0.len() * k);
    #[cfg(target_arch = "x86_64")]
    if avx2() {
        // SAFETY: the CPU supports AVX2 (checked at run time by `avx2`); the asserts above bound
        // every row read.
        return unsafe { avx2_rows::dot_rows2(w0, w1, x, k, out0, out1) };
    }
    dot_rows(w0, x, k, out0);
    dot_rows(w1, x, k, out1);
}

/// Whether this CPU runs the AVX2 kernel (detected once).
#[cfg(target_arch = "x86_64")]
pub fn avx2() -> bool {
    static DETECTED: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *DETECTED.get_or_init(|| std::is_x86_feature_detected!("avx2"))
}

#[cfg(target_arch = "x86_64")]
mod avx2_rows {
    use super::{BLOCK, LANES};
    use std::arch::x86_64::*;

    /// The eight lanes of `acc` summed in order, then the tail `w[full..] · x[full..]`: `dot`'s end.
    #[inline(always)]
    unsafe fn finish(acc: __m256, w: &[f32], x: &[f32], full: usize) -> f32 {
        let mut lanes = [0f32; LANES];
        _mm256_storeu_ps(lanes.as_mut_ptr(), acc);
        let mut s: f32 = lanes.iter().sum();
        for (wv, xv) in w[full..].iter().zip(&x[full..]) {
            s += wv * xv;
        }
        s
    }

    /// `super::dot_rows2` with AVX2.
    ///
    /// # Safety
    /// The CPU must support AVX2, and `x` must hold `out0.len()` rows of `k` (`w0`, `w1`: `k`).
    #[target_feature(enable = "avx2")]
    pub unsafe fn dot_rows2(
        w0: &[f32],
        w1: &[f32],
        x: &[f32],
        k: usize,
        out0: &mut [f32],
        out1: &mut [f32],
    ) {
        let full = k / LANES * LANES;
        let (p0, p1) = (w0.as_ptr(), w1.as_ptr());
        let m = out0.len();
        let mut i = 0;
        while i + BLOCK <= m {
            let xp = x.as_ptr().add(i * k);
            let mut acc0 = [_mm256_setzero_ps(); BLOCK];
            let mut acc1 = [_mm256_setzero_ps(); BLOCK];
            let mut c = 0;
            while c < full {
                let (v0, v1) = (_mm256_loadu_ps(p0.add(c)), _mm256_loadu_ps(p1.add(c)));
                for r in 0..BLOCK {
                    let xv = _mm256_loadu_ps(xp.add(r * k + c));
                    acc0[r] = _mm256_add_ps(acc0[r], _mm256_mul_ps(v0, xv));
                    acc1[r] = _mm256_add_ps(acc1[r], _mm256_mul_ps(v1, xv));
                }
                c += LANES;
            }
            for r in 0..BLOCK {
                let xr = &x[(i + r) * k..(i + r + 1) * k];
                out0[i + r] = finish(acc0[r], &w0[..k], xr, full);
                out1[i + r] = finish(acc1[r], &w1[..k], xr, full);
            }
            i += BLOCK;
        }
        // The rows left: both weight rows against each (two running sums, not one long chain).
        while i < m {
            let xp = x.as_ptr().add(i * k);
            let (mut a0, mut a1) = (_mm256_setzero_ps(), _mm256_setzero_ps());
            let mut c = 0;
            while c < full {
                let xv = _mm256_loadu_ps(xp.add(c));
                a0 = _mm256_add_ps(a0, _mm256_mul_ps(_mm256_loadu_ps(p0.add(c)), xv));
                a1 = _mm256_add_ps(a1, _mm256_mul_ps(_mm256_loadu_ps(p1.add(c)), xv));
                c += LANES;
            }
            let xr = &x[i * k..(i + 1) * k];
            out0[i] = finish(a0, &w0[..k], xr, full);
            out1[i] = finish(a1, &w1[..k], xr, full);
            i += 1;
        }
    }

    /// `super::dot_rows` with AVX2: a multiply then an add per lane, as `dot` does (no FMA).
    ///
    /// # Safety
    /// The CPU must support AVX2, and `x` must hold `out.len()` rows of `k` (`w`: `k`).
    #[target_feature(enable = "avx2")]
    pub unsafe fn dot_rows(w: &[f32], x: &[f32], k: usize, out: &mut [f32]) {
        let full = k / LANES * LANES;
        let wp = w.as_ptr();
        let mut i = 0;
        while i + BLOCK <= out.len() {
            let xp = x.as_ptr().add(i * k);
            let mut acc = [_mm256_setzero_ps(); BLOCK];
            let mut c = 0;
            while c < full {
                let wc = _mm256_loadu_ps(wp.add(c));
                for (r, a) in acc.iter_mut().enumerate() {
                    *a = _mm256_add_ps(*a, _mm256_mul_ps(wc, _mm256_loadu_ps(xp.add(r * k + c))));
                }
                c += LANES;
            }
            for (r, a) in acc.into_iter().enumerate() {
                out[i + r] = finish(a, &w[..k], &x[(i + r) * k..(i + r + 1) * k], full);
            }
            i += BLOCK;
        }
        while i < out.len() {
            let xp = x.as_ptr().add(i * k);
            let mut a = _mm256_setzero_ps();
            let mut c = 0;
            while c < full {
                a = _mm256_add_ps(
                    a,
                    _mm256_mul_ps(_mm256_loadu_ps(wp.add(c)), _mm256_loadu_ps(xp.add(c))),
                );
                c += LANES;
            }
            out[i] = finish(a, &w[..k], &x[i * k..(i + 1) * k], full);
            i += 1;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every block size and remainder, lengths with and without a tail: the same bits as `dot`.
    #[test]
    fn every_result_is_the_bits_of_dot() {
        for k in [1usize, 7, 8, 9, 64, 576, 1000] {
            let w: Vec<f32> = (0..k).map(|i| ((i * 37 % 101) as f32 - 50.0) * 0.013).collect();
            for m in [1usize, 3, 4, 5, 9, 16] {
                let x: Vec<f32> =
                    (0..m * k).map(|i| ((i * 53 % 97) as f32 - 48.0) * 0.021).collect();
                let mut out = vec![0f32; m];
                dot_rows(&w, &x, k, &mut out);
                let w1: Vec<f32> = w.iter().map(|v| v * -1.7 + 0.01).collect();
                let (mut o0, mut o1) = (vec![0f32; m], vec![0f32; m]);
                dot_rows2(&w, &w1, &x, k, &mut o0, &mut o1);
                for i in 0..m {
                    let xi = &x[i * k..(i + 1) * k];
                    let want = dot(&w, xi);
                    assert_eq!(out[i].to_bits(), want.to_bits(), "k {k} m {m} row {i}");
                    assert_eq!(o0[i].to_bits(), want.to_bits(), "pair, k {k} m {m} row {i}");
                    assert_eq!(o1[i].to_bits(), dot(&w1, xi).to_bits(), "pair, second row {i}");
                }
            }
        }
    }
}
