//! AVX2 + FMA kernels of the 8-bit-activation dot (`int8::dot_rows`) for one activation row: four
//! weight rows at a time against it, so each activation block is loaded once for four rows and
//! the four rows' memory streams and accumulators overlap; one integer dot per block (u8 × i8 pairs
//! through `maddubs`), one fused scale-multiply-add per block, the offset term in a scalar sum.

use super::int8::{prefetch, Q8Row};
use super::int8_batch::{hsum, mxfp4, q4_0, q4_1, q5_0, q5_1, q8_0, Unpacked};
use layerstream_types::DType;
use std::arch::x86_64::*;

/// Q8_0 rows go one at a time: two or four interleaved 612-byte rows ran at a third of the speed
/// from memory (benches/decode_dot.rs; in cache they were faster), the prefetcher losing them.
const Q8G: usize = 1;

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

/// Rows `0..R` at `w` (rows of `rb` bytes) against `x`, each the sum over `nb` blocks of `bb` bytes;
/// `blk` unpacks a block as `int8_batch::Unpacked` (signs applied to the activations when `SIGNED`).
#[inline(always)]
unsafe fn group<const R: usize, const SIGNED: bool, F: Fn(*const u8) -> Unpacked>(
    w: *const u8,
    rb: usize,
    bb: usize,
    nb: usize,
    x: &Q8Row,
    blk: &F,
) -> [f32; R] {
    let mut acc = [_mm256_setzero_ps(); R];
    let mut off = [0f32; R];
    for i in 0..nb {
        let (dx, q, ds) = x.block(i);
        let qx = _mm256_loadu_si256(q.as_ptr() as *const __m256i);
        for r in 0..R {
            let b = w.add(r * rb + i * bb);
            prefetch(b);
            let (u, sign, d, c) = blk(b);
            let s = dot_u8_i8(u, if SIGNED { _mm256_sign_epi8(qx, sign) } else { qx });
            acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(d * dx), _mm256_cvtepi32_ps(s), acc[r]);
            off[r] = c.mul_add(ds, off[r]);
        }
    }
    // Each row summed as the batched kernels sum it (`int8_batch::hsum`), so a row's result is
    // the same bits whether its step had one activation row or several (a decode step alone or
    // with drafted rows to verify: speculation must not change the tokens).
    std::array::from_fn(|r| hsum(acc[r]) + off[r])
}

/// Every row of `w` (rows of `rb` bytes) against `x` into `out`, `G` (1, 2 or 4) at a time.
#[inline(always)]
unsafe fn rows<const G: usize, const SIGNED: bool, F: Fn(*const u8) -> Unpacked>(
    w: &[u8],
    rb: usize,
    bb: usize,
    x: &Q8Row,
    out: &mut [f32],
    blk: F,
) {
    let nb = rb / bb;
    let p = w.as_ptr();
    let mut j = 0;
    let mut groups = out.chunks_exact_mut(G);
    for o in groups.by_ref() {
        o.copy_from_slice(&group::<G, SIGNED, F>(p.add(j * rb), rb, bb, nb, x, &blk));
        j += G;
    }
    for o in groups.into_remainder() {
        *o = group::<1, SIGNED, F>(p.add(j * rb), rb, bb, nb, x, &blk)[0];
        j += 1;
    }
}

/// `super::int8::dot_rows` with AVX2, FMA and F16C.
///
/// # Safety
/// The CPU must support AVX2, FMA and F16C; `w` must hold `out.len()` rows of `rb` bytes (whole
/// blocks of `dtype`, one `int8::supports`) and `x` at least as many values as a row.
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn dot_rows(dtype: DType, w: &[u8], rb: usize, x: &Q8Row, out: &mut [f32]) {
    match dtype {
        DType::Q2K
        | DType::Q3K
        | DType::Q4K
        | DType::Q5K
        | DType::Q6K
        | DType::Int8B128
        | DType::Int4G128 => {
            for (j, o) in out.iter_mut().enumerate() {
                *o = super::int8_batch::row::<1>(dtype, w.as_ptr().add(j * rb), rb, [x])[0];
            }
        }
        DType::Q8_0 => rows::<Q8G, true, _>(w, rb, 34, x, out, |b| q8_0(b)),
        DType::Q4_0 => rows::<4, false, _>(w, rb, 18, x, out, |b| q4_0(b)),
        // Four rows' accumulators in flight: one row's chain of fused adds waited on itself
        // (SmolLM2 Q4_K_M's layers are Q5_0 where 576 values are not whole super-blocks).
        DType::Q5_0 => rows::<4, true, _>(w, rb, 22, x, out, |b| q5_0(b)),
        DType::Q5_1 => rows::<4, false, _>(w, rb, 24, x, out, |b| q5_1(b)),
        DType::Mxfp4 => rows::<4, true, _>(w, rb, 17, x, out, |b| mxfp4(b)),
        _ => rows::<4, false, _>(w, rb, 20, x, out, |b| q4_1(b)),
    }
}
