//! Attention's softmax over a row's scores, eight at a time where the CPU has AVX2 and FMA: a
//! vector exp (Cephes' polynomial, within 2 ulp of the true value), the exps summed in eight lanes
//! added in a fixed order, then divided. Every score is an element-wise function of its own value
//! and the row's maximum, and a row's scores are the same whatever its step holds, so the result is
//! too. Elsewhere `host::softmax` (libm's exp), the same at every row count on such a CPU.

use crate::host;

/// Scores `x[..n]` replaced by their softmax with `sink` (if any) in the denominator only; `x`
/// holds a whole number of eight-value chunks (`padded`), the values past `n` scratch, left 0.
pub(super) fn softmax(x: &mut [f32], n: usize, sink: Option<f32>) {
    assert!(n <= x.len() && x.len().is_multiple_of(8));
    #[cfg(target_arch = "x86_64")]
    if super::attend::vector() && std::is_x86_feature_detected!("avx2") {
        // SAFETY: the CPU has AVX2 and FMA (checked); x holds whole chunks (asserted).
        return unsafe { avx2::softmax(x, n, sink) };
    }
    x[n..].fill(0.0);
    match sink {
        Some(s) => host::softmax_sink(&mut x[..n], s),
        None => host::softmax(&mut x[..n]),
    }
}

/// `n` rounded up to whole chunks of eight: the length `softmax` takes.
pub(super) fn padded(n: usize) -> usize {
    n.next_multiple_of(8)
}

#[cfg(target_arch = "x86_64")]
pub(super) mod avx2 {
    use std::arch::x86_64::*;

    /// `super::softmax`.
    ///
    /// # Safety
    /// The CPU must support AVX2 and FMA; `x.len()` is a multiple of 8 and at least `n`.
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn softmax(x: &mut [f32], n: usize, sink: Option<f32>) {
        let m = x[..n].iter().copied().fold(sink.unwrap_or(f32::NEG_INFINITY), f32::max);
        let mv = _mm256_set1_ps(m);
        let p = x.as_mut_ptr();
        for c in (0..x.len()).step_by(8) {
            let v = _mm256_loadu_ps(p.add(c));
            _mm256_storeu_ps(p.add(c), exp(_mm256_sub_ps(v, mv)));
        }
        x[n..].fill(0.0);
        let mut acc = _mm256_setzero_ps();
        for c in (0..x.len()).step_by(8) {
            acc = _mm256_add_ps(acc, _mm256_loadu_ps(p.add(c)));
        }
        let mut lanes = [0f32; 8];
        _mm256_storeu_ps(lanes.as_mut_ptr(), acc);
        let mut s: f32 = lanes.iter().sum();
        if let Some(k) = sink {
            let mut e = [0f32; 8];
            _mm256_storeu_ps(e.as_mut_ptr(), exp(_mm256_set1_ps(k - m)));
            s += e[0];
        }
        let sv = _mm256_set1_ps(s);
        for c in (0..x.len()).step_by(8) {
            _mm256_storeu_ps(p.add(c), _mm256_div_ps(_mm256_loadu_ps(p.add(c)), sv));
        }
    }

    /// e^x per lane (Cephes `expf`: x = n·ln 2 + r, a degree-5 polynomial in r, times 2^n); lanes
    /// below −87.3 give 0, above 88.7 +inf, NaN stays NaN.
    #[inline(always)]
    pub unsafe fn exp(x: __m256) -> __m256 {
        let (lo, hi) = (_mm256_set1_ps(-87.33655), _mm256_set1_ps(88.72283));
        let under = _mm256_cmp_ps::<_CMP_LT_OQ>(x, lo);
        let xc = _mm256_min_ps(_mm256_max_ps(x, lo), hi);
        let n = _mm256_round_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(
            _mm256_mul_ps(xc, _mm256_set1_ps(std::f32::consts::LOG2_E)),
        );
        let r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693_359_4), xc);
        let r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.121_944_4e-4), r);
        let mut y = _mm256_set1_ps(1.987_569_1e-4);
        for c in [1.398_199_9e-3, 8.333_452e-3, 4.166_579_6e-2, 0.166_666_65, 0.5] {
            y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(c));
        }
        let y = _mm256_add_ps(_mm256_fmadd_ps(y, _mm256_mul_ps(r, r), r), _mm256_set1_ps(1.0));
        // 2^n in two halves (n up to 128 overflows one exponent field).
        let ni = _mm256_cvtps_epi32(n);
        let half = _mm256_srai_epi32::<1>(ni);
        let pow = |k: __m256i| {
            _mm256_castsi256_ps(_mm256_slli_epi32::<23>(_mm256_add_epi32(
                k,
                _mm256_set1_epi32(127),
            )))
        };
        let e = _mm256_mul_ps(_mm256_mul_ps(y, pow(half)), pow(_mm256_sub_epi32(ni, half)));
        let e = _mm256_andnot_ps(under, e);
        // NaN in, NaN out (the clamp turned it into a number).
        let nan = _mm256_cmp_ps::<_CMP_UNORD_Q>(x, x);
        _mm256_blendv_ps(e, x, nan)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The vector exp is within 2 ulp (relative 2.4e-7) of the true value over the range scores
    /// take, 0 far below it, and the softmax sums to 1 and matches libm's within 1e-6, with and
    /// without a sink, at lengths around the eight-value chunks; the padding comes back 0.
    #[test]
    fn softmax_matches_libm_within_its_precision() {
        if !(super::super::attend::vector() && std::is_x86_feature_detected!("avx2")) {
            eprintln!("skipped: the vector path needs AVX2 and FMA, this CPU runs libm's");
            return;
        }
        #[cfg(target_arch = "x86_64")]
        for i in 0..2000 {
            let v = -87.0 + i as f32 * 0.0875;
            let mut out = [0f32; 8];
            // SAFETY: AVX2/FMA checked above.
            unsafe {
                std::arch::x86_64::_mm256_storeu_ps(
                    out.as_mut_ptr(),
                    avx2::exp(std::arch::x86_64::_mm256_set1_ps(v)),
                )
            };
            let want = (v as f64).exp();
            assert!(
                ((out[0] as f64 - want) / want).abs() < 2.4e-7,
                "exp({v}) = {} vs {want}",
                out[0]
            );
        }
        for n in [1usize, 7, 8, 9, 31, 300] {
            for sink in [None, Some(0.7f32)] {
                let scores: Vec<f32> =
                    (0..n).map(|i| ((i * 37 % 23) as f32 - 11.0) * 0.9).collect();
                let mut got = vec![5.0f32; padded(n)];
                got[..n].copy_from_slice(&scores);
                softmax(&mut got, n, sink);
                let mut want = scores.clone();
                match sink {
                    Some(s) => host::softmax_sink(&mut want, s),
                    None => host::softmax(&mut want),
                }
                for (g, w) in got.iter().zip(&want) {
                    assert!((g - w).abs() < 1e-6, "n {n}: {g} vs {w}");
                }
                assert!(got[n..].iter().all(|&v| v == 0.0));
                let total: f32 = got.iter().sum();
                let expect = if sink.is_some() { total < 1.0 } else { (total - 1.0).abs() < 1e-5 };
                assert!(expect, "n {n} sink {sink:?}: total {total}");
            }
        }
    }
}
