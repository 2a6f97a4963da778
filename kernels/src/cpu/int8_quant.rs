//! Activation rows quantized to 8 bits with AVX2 (`int8::quantize_row`): per block of 32 values
//! the largest magnitude, d = amax / 127, q = round(x · (1/d)) half away from zero (as Rust's
//! `f32::round`), clamped to ±127 — the scalar reference's bits (`int8::quantize_scalar`), NaN
//! included (it quantizes to 0 and never raises a block's amax). Every step quantizes its rows
//! once per matmul: on a 512-token prefill of a 576-wide model the scalar loop was 9% of the time.

use std::arch::x86_64::*;

/// `x` (whole blocks of 32) into `d`, `q` and `ds` (d·Σq), one entry (32 in `q`) per block.
///
/// # Safety
/// The CPU must support AVX2 and FMA; `d` and `ds` hold `x.len() / 32` values and `q` `x.len()`.
#[target_feature(enable = "avx2,fma")]
pub(super) unsafe fn blocks(x: &[f32], d: &mut [f32], q: &mut [i8], ds: &mut [f32]) {
    let sign = _mm256_set1_ps(-0.0);
    let (half, one, lim) = (_mm256_set1_ps(0.5), _mm256_set1_ps(1.0), _mm256_set1_ps(127.0));
    for (b, xs) in x.chunks_exact(32).enumerate() {
        let v: [__m256; 4] = [0, 1, 2, 3].map(|j| _mm256_loadu_ps(xs.as_ptr().add(8 * j)));
        // |v| first: a NaN there leaves the running maximum as it was (`f32::max` ignores NaN).
        let mut m = _mm256_setzero_ps();
        for vj in v {
            m = _mm256_max_ps(_mm256_andnot_ps(sign, vj), m);
        }
        let m = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
        let m = _mm_max_ps(m, _mm_movehl_ps(m, m));
        let amax = _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
        let db = amax / 127.0;
        let id = _mm256_set1_ps(if db > 0.0 { 1.0 / db } else { 0.0 });
        let mut ints = [_mm256_setzero_si256(); 4];
        for (j, vj) in v.into_iter().enumerate() {
            let y = _mm256_mul_ps(vj, id);
            // Half away from zero: the truncation, plus ±1 where the dropped part is ≥ 0.5 (exact:
            // y − trunc(y) has no rounding).
            let t = _mm256_round_ps::<{ _MM_FROUND_TO_ZERO | _MM_FROUND_NO_EXC }>(y);
            let frac = _mm256_andnot_ps(sign, _mm256_sub_ps(y, t));
            let away = _mm256_or_ps(_mm256_and_ps(y, sign), one);
            let up = _mm256_and_ps(_mm256_cmp_ps::<_CMP_GE_OQ>(frac, half), away);
            let r =
                _mm256_min_ps(_mm256_max_ps(_mm256_add_ps(t, up), _mm256_sub_ps(sign, lim)), lim);
            // NaN → 0, as `NaN as i8`.
            let r = _mm256_and_ps(r, _mm256_cmp_ps::<_CMP_ORD_Q>(y, y));
            ints[j] = _mm256_cvtps_epi32(r);
        }
        let total = _mm256_add_epi32(
            _mm256_add_epi32(ints[0], ints[1]),
            _mm256_add_epi32(ints[2], ints[3]),
        );
        let t = _mm_add_epi32(_mm256_castsi256_si128(total), _mm256_extracti128_si256(total, 1));
        let t = _mm_add_epi32(t, _mm_shuffle_epi32::<0b01_00_11_10>(t));
        let sum = _mm_cvtsi128_si32(_mm_add_epi32(t, _mm_shuffle_epi32::<0b10_11_00_01>(t)));
        // i32 → i8 in order: the packs interleave 128-bit halves, the permute restores them.
        let p = _mm256_packs_epi16(
            _mm256_packs_epi32(ints[0], ints[1]),
            _mm256_packs_epi32(ints[2], ints[3]),
        );
        let p = _mm256_permutevar8x32_epi32(p, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
        _mm256_storeu_si256(q.as_mut_ptr().add(32 * b) as *mut __m256i, p);
        d[b] = db;
        ds[b] = db * sum as f32;
    }
}

#[cfg(test)]
mod tests {
    use crate::cpu::int8::{quantize_row, quantize_scalar, Q8Row};

    /// Blocks of every kind — ties at ±k.5 after scaling, zeros, NaN, infinities' neighbours,
    /// tiny and huge magnitudes, random values — quantize to the scalar reference's bits.
    #[test]
    fn avx2_quantization_gives_the_scalar_bits() {
        if !crate::cpu::int8::simd() {
            eprintln!("skipped: this CPU lacks AVX2/FMA/F16C");
            return;
        }
        let mut state = 5u64;
        let mut next = move || {
            state = state.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            (state >> 40) as f32 / (1u64 << 24) as f32
        };
        let mut x: Vec<f32> = Vec::new();
        // Ties: amax 127 makes d = 1 and 1/d = 1, so k + 0.5 stays a tie.
        x.extend((0..32).map(|i| if i == 0 { 127.0 } else { (i as f32 - 16.0) + 0.5 }));
        x.extend([0.0f32; 32]);
        x.extend((0..32).map(|i| if i == 3 { f32::NAN } else { i as f32 * 0.1 - 1.0 }));
        x.extend((0..32).map(|i| (i as f32 - 16.0) * 1e-30));
        x.extend((0..32).map(|i| (i as f32 - 16.0) * 1e30));
        x.extend((0..32 * 60).map(|_| (next() - 0.5) * 8.0));
        let fast = quantize_row(&x);
        let n = x.len() / 32;
        let mut slow = Q8Row { d: vec![0.0; n], q: vec![0; n * 32], ds: vec![0.0; n] };
        quantize_scalar(&x, &mut slow);
        assert_eq!(fast.q, slow.q);
        let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(&fast.d), bits(&slow.d));
        assert_eq!(bits(&fast.ds), bits(&slow.ds));
        // The ties went away from zero: 0.5 → 1, −0.5 → −1, 2.5 → 3.
        assert_eq!(&slow.q[16..19], &[1, 2, 3]);
        assert_eq!(slow.q[15], -1);
    }
}
