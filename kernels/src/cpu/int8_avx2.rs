//! AVX2 + FMA kernels of the 8-bit-activation dot (`int8::dot_rows`) for one activation row: the
//! few-row kernels (`int8_batch::row`) with one row, each weight row in turn — every unit's integer
//! dot summed whole and eight units' sums converted and scaled at once (lane j taking unit j of
//! the eight), so a chain of fused adds waits on itself once per eight units, not once per unit —
//! and the helpers they share (`dot_u8_i8`, `h2f`).

use super::int8::Q8Row;
use layerstream_types::DType;
use std::arch::x86_64::*;

/// Σ of u8 × i8 products of 32 pairs, as 8 i32 lanes.
#[inline(always)]
pub(super) unsafe fn dot_u8_i8(u: __m256i, s: __m256i) -> __m256i {
    _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1))
}

/// The little-endian f16 at `p`, converted by the CPU (F16C).
#[inline(always)]
pub(super) unsafe fn h2f(p: *const u8) -> f32 {
    let bits = u16::from_le_bytes([*p, *p.add(1)]);
    _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(bits as i32)))
}

/// `super::int8::dot_rows` with AVX2, FMA and F16C.
///
/// # Safety
/// The CPU must support AVX2, FMA and F16C; `w` must hold `out.len()` rows of `rb` bytes (whole
/// blocks of `dtype`, one `int8::supports`) and `x` at least as many values as a row.
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn dot_rows(dtype: DType, w: &[u8], rb: usize, x: &Q8Row, out: &mut [f32]) {
    for (j, o) in out.iter_mut().enumerate() {
        *o = super::int8_batch::row::<1>(dtype, w.as_ptr().add(j * rb), rb, [x])[0];
    }
}
