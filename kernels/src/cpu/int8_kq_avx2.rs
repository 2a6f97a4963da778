//! AVX2 kernels of the 8-bit-activation dot for Q2_K and Q3_K, whose scales cover 16 values: each
//! 32-value block's integer products are summed in 16-bit pairs (`maddubs`) and multiplied by its
//! two scales in one `madd` (low half of the vector: the first scale, high half: the second).
//! The same integer sums as the scalar references in `int8_kq`.
//!
//! Safety, for every function here: the CPU has AVX2, FMA and F16C, `w` points at `nsb` whole
//! super-blocks and every activation row holds `8 · nsb` blocks of 32 — what `int8::dot_rows`
//! asserts before it calls `int8_batch::row`, the only caller.

use super::int8::{prefetch, Q8Row};
use super::int8_avx2::h2f;
use super::int8_batch::{hsums, scaled_subs8, xblock};
use std::arch::x86_64::*;

/// Two 16-value scales as the `madd` factors of a 32-value block: `a` for values 0..16, `b` after.
#[inline(always)]
unsafe fn pair(a: i16, b: i16) -> __m256i {
    _mm256_set_m128i(_mm_set1_epi16(b), _mm_set1_epi16(a))
}

/// The 2-bit values at bit `2k` of the 32 bytes `raw`.
#[inline(always)]
unsafe fn two_bits(raw: __m256i, k: usize) -> __m256i {
    _mm256_and_si256(_mm256_srl_epi16(raw, _mm_cvtsi32_si128(2 * k as i32)), _mm256_set1_epi8(3))
}

/// One Q2_K row (`nsb` super-blocks of 84 bytes) against `xs`: per 32-value block
/// dx·(d·Σ scale·q·qx − dmin·Σ min·qx).
#[inline(always)]
pub(super) unsafe fn q2k<const N: usize>(w: *const u8, nsb: usize, xs: [&Q8Row; N]) -> [f32; N] {
    let mut acc = [_mm256_setzero_ps(); N];
    let ones = _mm256_set1_epi8(1);
    for s in 0..nsb {
        let b = w.add(s * 84);
        prefetch(b);
        prefetch(b.add(64));
        let (d, mdmin) = (_mm256_set1_ps(h2f(b.add(80))), _mm256_set1_ps(-h2f(b.add(82))));
        for half in 0..2 {
            let raw = _mm256_loadu_si256(b.add(16 + 32 * half) as *const __m256i);
            for k in 0..4 {
                let c = 4 * half + k;
                let q = two_bits(raw, k);
                let (sa, sb) = (*b.add(2 * c), *b.add(2 * c + 1));
                let scales = pair((sa & 0xF) as i16, (sb & 0xF) as i16);
                let mins = pair((sa >> 4) as i16, (sb >> 4) as i16);
                for a in 0..N {
                    let (dx, qx, _) = xblock(xs[a], 8 * s + c);
                    let iq = _mm256_madd_epi16(_mm256_maddubs_epi16(q, qx), scales);
                    let im = _mm256_madd_epi16(_mm256_maddubs_epi16(ones, qx), mins);
                    let t = _mm256_fmadd_ps(
                        mdmin,
                        _mm256_cvtepi32_ps(im),
                        _mm256_mul_ps(d, _mm256_cvtepi32_ps(iq)),
                    );
                    acc[a] = _mm256_fmadd_ps(_mm256_set1_ps(dx), t, acc[a]);
                }
            }
        }
    }
    hsums(&acc)
}

/// One Q3_K row (`nsb` super-blocks of 110 bytes) against `xs`: signed 3-bit values (the 2 low
/// bits less 4 where the high bit is clear), a signed scale per 16; per block d·dx·Σ scale·q·qx,
/// each block's scaled integer sum whole (`int8_batch::subs8`).
#[inline(always)]
pub(super) unsafe fn q3k<const N: usize>(w: *const u8, nsb: usize, xs: [&Q8Row; N]) -> [f32; N] {
    let mut acc = [_mm256_setzero_ps(); N];
    let four = _mm256_set1_epi8(4);
    for s in 0..nsb {
        let b = w.add(s * 110);
        prefetch(b);
        prefetch(b.add(64));
        let d = _mm256_set1_ps(h2f(b.add(108)));
        // SAFETY: bytes 96..108 of the 110-byte super-block at `b` (see the module's safety note).
        let sc = crate::quant_ext::q3k_scales(std::slice::from_raw_parts(b.add(96), 12));
        // d times each activation row's eight block scales: one lane per 32-value block.
        let mut scale = [_mm256_setzero_ps(); N];
        for a in 0..N {
            scale[a] = _mm256_mul_ps(d, _mm256_loadu_ps(xs[a].scales8(8 * s).0.as_ptr()));
        }
        let q = q3k_values(b).map(|u| _mm256_sub_epi8(u, four));
        let scales: [_; 8] = std::array::from_fn(|c| pair(sc[2 * c] as i16, sc[2 * c + 1] as i16));
        scaled_subs8(&mut acc, &scale, xs, 8 * s, &q, &scales);
    }
    hsums(&acc)
}

/// The Q3_K super-block at `b`'s eight 32-value blocks as unsigned values, each its signed value
/// plus 4 (0..8): the 2 low bits, and 4 where the high bit (`hmask`) is set.
#[inline(always)]
pub(super) unsafe fn q3k_values(b: *const u8) -> [__m256i; 8] {
    let (hm, four) = (_mm256_loadu_si256(b as *const __m256i), _mm256_set1_epi8(4));
    std::array::from_fn(|c| {
        let raw = _mm256_loadu_si256(b.add(32 + 32 * (c / 4)) as *const __m256i);
        let bit = _mm256_set1_epi8((1u8 << c) as i8);
        let high = _mm256_cmpeq_epi8(_mm256_and_si256(hm, bit), bit);
        _mm256_or_si256(two_bits(raw, c % 4), _mm256_and_si256(high, four))
    })
}
