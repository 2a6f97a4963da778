//! AVX2 + FMA kernels of the 8-bit path for steps of a few activation rows (`int8::dot_rows`:
//! batched decode, drafted rows to verify; the many-row steps `int8_lanes` takes): each weight
//! block is unpacked once and dotted with the blocks of four activation rows at a time, where the
//! one-row kernels (`int8_avx2`) would unpack it once per activation row. Same integer sums and
//! scale products as `int8::dot_scalar`.

use super::int8::{prefetch, Q8Row};
use super::int8_avx2::{dot_u8_i8, h2f};
use layerstream_types::DType;
use std::arch::x86_64::*;

/// Activation rows per pass over a weight row.
const A: usize = 4;

/// Activation block `i` of row `x`: (scale, 32 values, scale·Σ values).
#[inline(always)]
pub(super) unsafe fn xblock(x: &Q8Row, i: usize) -> (f32, __m256i, f32) {
    let (d, q, ds) = x.block(i);
    (d, _mm256_loadu_si256(q.as_ptr() as *const __m256i), ds)
}

/// The eight lanes of `v` summed.
#[inline(always)]
pub(super) unsafe fn hsum(v: __m256) -> f32 {
    let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)))
}

/// A 32-value weight block unpacked for `maddubs`: (unsigned magnitudes, the signs to move onto the
/// activations — signed formats only —, scale d, offset coefficient c as `int8::block_offset`).
pub(super) type Unpacked = (__m256i, __m256i, f32, f32);

#[inline(always)]
pub(super) unsafe fn q8_0(b: *const u8) -> Unpacked {
    let q = _mm256_loadu_si256(b.add(2) as *const __m256i);
    (_mm256_sign_epi8(q, q), q, h2f(b), 0.0)
}

#[inline(always)]
pub(super) unsafe fn q4_0(b: *const u8) -> Unpacked {
    let d = h2f(b);
    (nibbles(b.add(2)), _mm256_setzero_si256(), d, -8.0 * d)
}

#[inline(always)]
pub(super) unsafe fn q4_1(b: *const u8) -> Unpacked {
    (nibbles(b.add(4)), _mm256_setzero_si256(), h2f(b), h2f(b.add(2)))
}

/// Q5_0 as the unsigned five-bit values with the offset −16·d (as Q4_0's −8·d): no signs to move
/// onto the activations, which took three more instructions a block than Q8_0's.
#[inline(always)]
pub(super) unsafe fn q5_0(b: *const u8) -> Unpacked {
    let d = h2f(b);
    (five_bits(b.add(2)), _mm256_setzero_si256(), d, -16.0 * d)
}

#[inline(always)]
pub(super) unsafe fn q5_1(b: *const u8) -> Unpacked {
    (five_bits(b.add(4)), _mm256_setzero_si256(), h2f(b), h2f(b.add(2)))
}

/// Where a 32-value format keeps its scale d and offset coefficient c (`int8::block_offset`), for
/// reading eight blocks' at once (`f16_pairs8`): d the f16 at byte 0 and c = 0 (`D`), c = −8·d
/// (`D_MINUS_8`, Q4_0) or −16·d (`D_MINUS_16`, Q5_0), c the f16 at byte 2 (`D_M`, Q4_1, Q5_1);
/// `EACH`: block by block (MXFP4).
pub(super) const D: u8 = 0;
pub(super) const D_MINUS_8: u8 = 1;
pub(super) const D_M: u8 = 2;
const EACH: u8 = 3;
pub(super) const D_MINUS_16: u8 = 4;

/// The scales d and offset coefficients c of the first `k` (at most 8) of eight blocks `bb` bytes
/// apart from `p`, read as `SC` says (not `EACH`).
#[inline(always)]
pub(super) unsafe fn block_scales8<const SC: u8>(
    p: *const u8,
    bb: usize,
    k: usize,
) -> (__m256, __m256) {
    let (d, m) = f16_pairs8(p, bb, k);
    match SC {
        D => (d, _mm256_setzero_ps()),
        D_MINUS_8 => (d, _mm256_mul_ps(_mm256_set1_ps(-8.0), d)),
        D_MINUS_16 => (d, _mm256_mul_ps(_mm256_set1_ps(-16.0), d)),
        _ => (d, m),
    }
}

/// The f16s at bytes 0..2 and 2..4 of the first `k` (at most 8) of eight blocks `bb` bytes apart
/// from `p`, as f32 vectors (zeros past `k`, whose blocks are not read): one gather and one
/// conversion each, where a scalar conversion and an insert a block kept the shuffle port of a
/// one-row decode busy (the same values `h2f` gives).
#[inline(always)]
pub(super) unsafe fn f16_pairs8(p: *const u8, bb: usize, k: usize) -> (__m256, __m256) {
    let lanes = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    let idx = _mm256_mullo_epi32(lanes, _mm256_set1_epi32(bb as i32));
    let live = _mm256_cmpgt_epi32(_mm256_set1_epi32(k as i32), lanes);
    let zero = _mm256_setzero_si256();
    let words = _mm256_mask_i32gather_epi32::<1>(zero, p as *const i32, idx, live);
    let (lo, hi) =
        (_mm256_and_si256(words, _mm256_set1_epi32(0xFFFF)), _mm256_srli_epi32::<16>(words));
    // Per 128-bit half [lo 0..4, hi 0..4 | lo 4..8, hi 4..8], then the quarters in order.
    let both = _mm256_permute4x64_epi64::<0b11_01_10_00>(_mm256_packus_epi32(lo, hi));
    (
        _mm256_cvtph_ps(_mm256_castsi256_si128(both)),
        _mm256_cvtph_ps(_mm256_extracti128_si256::<1>(both)),
    )
}

/// One weight row of 32-value blocks (`bb` bytes each, `nb` of them) against activation rows `xs`;
/// `blk` unpacks a block (signs moved onto the activations when `SIGNED`), `SC` says where its
/// scales are.
#[inline(always)]
unsafe fn row32<const N: usize, const SIGNED: bool, const SC: u8, F>(
    w: *const u8,
    bb: usize,
    nb: usize,
    xs: [&Q8Row; N],
    blk: &F,
) -> [f32; N]
where
    F: Fn(*const u8) -> Unpacked,
{
    let scales8 =
        |i0: usize, k: usize| (SC != EACH).then(|| block_scales8::<SC>(w.add(i0 * bb), bb, k));
    let unit = |i| {
        prefetch(w.add(i * bb));
        blk(w.add(i * bb))
    };
    units::<N, SIGNED, _, _>(nb, xs, &unit, &scales8)
}

/// One weight row of `n` 32-value units against activation rows `xs`; `unit(i)` unpacks unit `i`.
/// Eight units at a time, as the K-quants' sub-blocks: each unit's integer dot summed whole
/// (`sums8`) and converted once, (d·dx)·P into lane j for unit j of the eight and the offset
/// c·(dx·Σqx) into lane j of its own accumulator, added to the lanes before they are summed. A
/// last part of fewer than eight units leaves the other lanes' sums, scales and offsets zero: an
/// accumulator that starts at +0 never holds −0, so adding +0 keeps its bits (the many-row kernel,
/// `int8_lanes`, adds nothing there).
#[inline(always)]
unsafe fn units<const N: usize, const SIGNED: bool, F, S>(
    n: usize,
    xs: [&Q8Row; N],
    unit: &F,
    scales8: &S,
) -> [f32; N]
where
    F: Fn(usize) -> Unpacked,
    S: Fn(usize, usize) -> Option<(__m256, __m256)>,
{
    let mut acc = [_mm256_setzero_ps(); N];
    let mut off = [_mm256_setzero_ps(); N];
    let whole = n / 8 * 8;
    for i0 in (0..whole).step_by(8) {
        eight::<N, SIGNED, 8, F>(i0, xs, unit, scales8(i0, 8), &mut acc, &mut off);
    }
    // The last part unrolled too, for each count it may have (its scales read only where it is).
    let (i0, k, acc, off) = (whole, n - whole, &mut acc, &mut off);
    let sc = || scales8(i0, k);
    match k {
        0 => {}
        1 => eight::<N, SIGNED, 1, F>(i0, xs, unit, sc(), acc, off),
        2 => eight::<N, SIGNED, 2, F>(i0, xs, unit, sc(), acc, off),
        3 => eight::<N, SIGNED, 3, F>(i0, xs, unit, sc(), acc, off),
        4 => eight::<N, SIGNED, 4, F>(i0, xs, unit, sc(), acc, off),
        5 => eight::<N, SIGNED, 5, F>(i0, xs, unit, sc(), acc, off),
        6 => eight::<N, SIGNED, 6, F>(i0, xs, unit, sc(), acc, off),
        _ => eight::<N, SIGNED, 7, F>(i0, xs, unit, sc(), acc, off),
    }
    for a in 0..N {
        acc[a] = _mm256_add_ps(acc[a], off[a]);
    }
    hsums(acc)
}

/// Units `i0..i0 + K` (K ≤ 8: loops the compiler unrolls) of `units` into the accumulators'
/// lanes 0..K; `scales`: their d and c as vectors, where the format reads them so.
// h indexes the pairs of units and each row's pair sums alike: a loop over it reads clearest.
#[allow(clippy::needless_range_loop)]
#[inline(always)]
unsafe fn eight<const N: usize, const SIGNED: bool, const K: usize, F>(
    i0: usize,
    xs: [&Q8Row; N],
    unit: &F,
    scales: Option<(__m256, __m256)>,
    acc: &mut [__m256; N],
    off: &mut [__m256; N],
) where
    F: Fn(usize) -> Unpacked,
{
    let zero = _mm256_setzero_si256();
    let live = |j: usize| j < K;
    let (mut d, mut c) = ([0f32; 8], [0f32; 8]);
    // Two units at a time, each row's two dots added pairwise at once (`sums8`'s first level,
    // built as it goes): eight units' magnitudes, signs and dots held at once spilled AVX2's
    // sixteen registers in a one-row decode (the same integers either way).
    let mut t = [[zero; 4]; N];
    for h in 0..4 {
        let j = 2 * h;
        if !live(j) {
            continue;
        }
        let (u0, s0, d0, c0) = unit(i0 + j);
        let (u1, s1, d1, c1) = if live(j + 1) { unit(i0 + j + 1) } else { (zero, zero, 0.0, 0.0) };
        (d[j], c[j], d[j + 1], c[j + 1]) = (d0, c0, d1, c1);
        for a in 0..N {
            let p = |j: usize, u: __m256i, sign: __m256i| {
                if !live(j) {
                    return zero;
                }
                let (_, mut qx, _) = xblock(xs[a], i0 + j);
                if SIGNED {
                    qx = _mm256_sign_epi8(qx, sign);
                }
                dot_u8_i8(u, qx)
            };
            t[a][h] = _mm256_hadd_epi32(p(j, u0, s0), p(j + 1, u1, s1));
        }
    }
    let (dw, cw) = scales.unwrap_or_else(|| {
        (
            _mm256_setr_ps(d[0], d[1], d[2], d[3], d[4], d[5], d[6], d[7]),
            _mm256_setr_ps(c[0], c[1], c[2], c[3], c[4], c[5], c[6], c[7]),
        )
    });
    // Lanes below k: the activation rows' scales past the last unit are not read.
    let lanes = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    let mask = _mm256_cmpgt_epi32(_mm256_set1_epi32(K as i32), lanes);
    for a in 0..N {
        let (dp, sp) = (xs[a].d.as_ptr().add(i0), xs[a].ds.as_ptr().add(i0));
        let (dx, ds) = match K {
            8 => (_mm256_loadu_ps(dp), _mm256_loadu_ps(sp)),
            _ => (_mm256_maskload_ps(dp, mask), _mm256_maskload_ps(sp, mask)),
        };
        let sums = _mm256_cvtepi32_ps(sums_of_pairs(&t[a]));
        acc[a] = _mm256_fmadd_ps(_mm256_mul_ps(dw, dx), sums, acc[a]);
        off[a] = _mm256_fmadd_ps(cw, ds, off[a]);
    }
}

/// The little-endian f32 at `p` (any alignment).
#[inline(always)]
unsafe fn f32_at(p: *const u8) -> f32 {
    f32::from_le_bytes(std::ptr::read_unaligned(p as *const [u8; 4]))
}

/// Unit `i` (32 values) of an `int8_b128` row: block i/4's scale, its bytes 32·(i%4)…
#[inline(always)]
pub(super) unsafe fn int8_b128(w: *const u8, i: usize) -> Unpacked {
    let b = w.add(i / 4 * 132);
    prefetch(b);
    let q = _mm256_loadu_si256(b.add(4 + 32 * (i % 4)) as *const __m256i);
    (_mm256_sign_epi8(q, q), q, f32_at(b), 0.0)
}

/// Unit `i` (32 values) of an `int4_g128` row: values 32·(i%4)… of block i/4 are the low (i%4 < 2)
/// or high nibbles of its bytes 32·(i%2)…; w = s·(q − zero), so the offset coefficient is −s·zero.
#[inline(always)]
pub(super) unsafe fn int4_g128(w: *const u8, i: usize) -> Unpacked {
    let b = w.add(i / 4 * 69);
    prefetch(b);
    let raw = _mm256_loadu_si256(b.add(5 + 32 * (i % 2)) as *const __m256i);
    let shifted = if i % 4 < 2 { raw } else { _mm256_srli_epi16(raw, 4) };
    let q = _mm256_and_si256(shifted, _mm256_set1_epi8(0x0F));
    let s = f32_at(b);
    (q, _mm256_setzero_si256(), s, -s * *b.add(4) as f32)
}

/// An MXFP4 block (e8m0 byte, 16 bytes of nibbles): its doubled e2m1 values looked up as signed
/// bytes (low nibbles first), the halved scale.
#[inline(always)]
pub(super) unsafe fn mxfp4(b: *const u8) -> Unpacked {
    let table = _mm256_loadu_si256(
        [crate::quant_ext::MXFP4_VALUES, crate::quant_ext::MXFP4_VALUES].as_ptr() as *const __m256i,
    );
    let q = _mm256_shuffle_epi8(table, nibbles(b.add(1)));
    (_mm256_sign_epi8(q, q), q, crate::quant_ext::e8m0_half(*b), 0.0)
}

/// The 32 nibbles of a Q4_0/Q4_1 block's 16 bytes at `p`, low nibbles first. The bytes are loaded
/// into both halves at once and the halves' shifts blended: no lane insert, which takes the shuffle
/// port a one-row decode's sums and unpacking already keep busy.
#[inline(always)]
pub(super) unsafe fn nibbles(p: *const u8) -> __m256i {
    let raw = _mm256_broadcastsi128_si256(_mm_loadu_si128(p as *const __m128i));
    let both = _mm256_blend_epi32::<0xF0>(raw, _mm256_srli_epi16::<4>(raw));
    _mm256_and_si256(both, _mm256_set1_epi8(0x0F))
}

/// The 32 five-bit values of a Q5_0/Q5_1 block whose 4 bytes of fifth bits start at `p` (the 16
/// bytes of nibbles follow): value i = nibble i | bit i of the fifth bits << 4.
#[inline(always)]
pub(super) unsafe fn five_bits(p: *const u8) -> __m256i {
    // Broadcast straight from memory (a load, where a value built in a register goes through the
    // shuffle port). Byte i holds byte i / 8 of the fifth bits; `select` keeps bit i % 8 of it.
    let qh = std::ptr::read_unaligned(p as *const i32);
    let spread = _mm256_shuffle_epi8(
        _mm256_set1_epi32(qh),
        _mm256_set_epi64x(0x0303030303030303, 0x0202020202020202, 0x0101010101010101, 0),
    );
    let select = _mm256_set1_epi64x(0x8040201008040201u64 as i64);
    let set = _mm256_cmpeq_epi8(_mm256_and_si256(spread, select), select);
    _mm256_or_si256(nibbles(p.add(4)), _mm256_and_si256(set, _mm256_set1_epi8(0x10)))
}

/// Lane j = the sum of the eight lanes of `p[j]`: eight 32-value units' integer dots, each summed
/// whole (exact integers), as one vector — how the K-quant kernels (Q3_K–Q6_K) add a unit's
/// products before its one scale multiply, the same sums `int8_lanes` chains in its registers.
#[inline(always)]
pub(super) unsafe fn sums8(p: &[__m256i; 8]) -> __m256i {
    sums_of_pairs(&[
        _mm256_hadd_epi32(p[0], p[1]),
        _mm256_hadd_epi32(p[2], p[3]),
        _mm256_hadd_epi32(p[4], p[5]),
        _mm256_hadd_epi32(p[6], p[7]),
    ])
}

/// `sums8` from its first level: `t[h]` = `hadd(p[2h], p[2h + 1])`, per 128-bit half [p0 0+1,
/// p0 2+3, p1 0+1, p1 2+3]; then [p0, p1, p2, p3] of each half, and the halves added.
#[inline(always)]
unsafe fn sums_of_pairs(t: &[__m256i; 4]) -> __m256i {
    let (u0, u1) = (_mm256_hadd_epi32(t[0], t[1]), _mm256_hadd_epi32(t[2], t[3]));
    _mm256_add_epi32(
        _mm256_permute2x128_si256(u0, u1, 0x20),
        _mm256_permute2x128_si256(u0, u1, 0x31),
    )
}

/// The eight sub-blocks of a K-quant super-block against `xs`: `p(c, qx)` gives sub-block c's
/// integer dot with activation block qx as lanes of partial sums; each sub-block's sum (`sums8`)
/// converted once and added into lane c with the row's per-lane factor `scale[a]`.
#[inline(always)]
pub(super) unsafe fn subs8<const N: usize>(
    acc: &mut [__m256; N],
    scale: &[__m256; N],
    xs: [&Q8Row; N],
    first: usize,
    p: &impl Fn(usize, __m256i) -> __m256i,
) {
    for a in 0..N {
        let mut v = [_mm256_setzero_si256(); 8];
        for (c, pc) in v.iter_mut().enumerate() {
            *pc = p(c, xblock(xs[a], first + c).1);
        }
        acc[a] = _mm256_fmadd_ps(scale[a], _mm256_cvtepi32_ps(sums8(&v)), acc[a]);
    }
}

/// One Q4_K row (`nsb` super-blocks of 144 bytes) or, `FIFTH`, Q5_K row (176: 32 bytes of fifth
/// bits before the nibbles) against `xs`: per 32-value sub-block d·scale·dx·Σq·qx − dmin·min·dx·Σqx,
/// the sub-block's integer sum whole, lane j of the accumulators taking sub-block j.
#[inline(always)]
pub(super) unsafe fn q45k<const N: usize, const FIFTH: bool>(
    w: *const u8,
    nsb: usize,
    xs: [&Q8Row; N],
) -> [f32; N] {
    let mut acc = [_mm256_setzero_ps(); N];
    let mut off = [_mm256_setzero_ps(); N];
    let bb = if FIFTH { 176 } else { 144 };
    for s in 0..nsb {
        for line in (0..bb).step_by(64) {
            prefetch(w.add(s * bb + line));
        }
        let b = w.add(s * bb);
        let (dsc, dmn) = q45k_scales(b);
        let mut scale = [_mm256_setzero_ps(); N];
        for a in 0..N {
            let (dx, ds) = xs[a].scales8(8 * s);
            off[a] = _mm256_fmadd_ps(dmn, _mm256_loadu_ps(ds.as_ptr()), off[a]);
            scale[a] = _mm256_mul_ps(dsc, _mm256_loadu_ps(dx.as_ptr()));
        }
        let u = q45k_values::<FIFTH>(b);
        subs8(&mut acc, &scale, xs, 8 * s, &|c, qx| dot_u8_i8(u[c], qx));
    }
    for a in 0..N {
        acc[a] = _mm256_add_ps(acc[a], off[a]);
    }
    hsums(&acc)
}

/// The Q4_K (Q5_K) super-block at `b`'s eight sub-blocks' d·scale and −dmin·min as vectors, one
/// lane per sub-block: what every 8-bit Q4_K/Q5_K kernel multiplies each activation row's block
/// scales (and d·Σq, for the offsets) by. (Widened from two words in registers: eight scalars
/// stored and read back as a vector stalled on store forwarding.)
#[inline(always)]
pub(super) unsafe fn q45k_scales(b: *const u8) -> (__m256, __m256) {
    let (d, dmin) = (h2f(b), h2f(b.add(2)));
    let (sc, mn) = crate::quant_ext::scales_mins_k4(std::slice::from_raw_parts(b.add(4), 12));
    let dsc = _mm256_mul_ps(_mm256_set1_ps(d), widen(sc));
    let dmn = _mm256_mul_ps(_mm256_set1_ps(-dmin), widen(mn));
    (dsc, dmn)
}

/// The Q4_K (or, `FIFTH`, Q5_K) super-block at `b`'s eight sub-blocks of unsigned values, 32
/// bytes each: sub-block 2p the low nibbles of bytes 32p.., 2p + 1 the high (Q5_K: bit `sub` of
/// each fifth-bit byte moved to bit 4).
#[inline(always)]
pub(super) unsafe fn q45k_values<const FIFTH: bool>(b: *const u8) -> [__m256i; 8] {
    let (low, one) = (_mm256_set1_epi8(0x0F), _mm256_set1_epi8(1));
    let qs = if FIFTH { 48 } else { 16 };
    let qh = if FIFTH {
        _mm256_loadu_si256(b.add(16) as *const __m256i)
    } else {
        _mm256_setzero_si256()
    };
    let mut u = [_mm256_setzero_si256(); 8];
    for (sub, us) in u.iter_mut().enumerate() {
        let raw = _mm256_loadu_si256(b.add(qs + 32 * (sub / 2)) as *const __m256i);
        let shifted = if sub % 2 == 0 { raw } else { _mm256_srli_epi16(raw, 4) };
        *us = _mm256_and_si256(shifted, low);
        if FIFTH {
            let bit = _mm256_srl_epi16(qh, _mm_cvtsi32_si128(sub as i32));
            *us = _mm256_or_si256(*us, _mm256_slli_epi16(_mm256_and_si256(bit, one), 4));
        }
    }
    u
}

/// Eight bytes as eight f32 lanes (a function, not a closure: a closure does not inherit the
/// caller's target features, and its intrinsics became calls).
#[inline(always)]
unsafe fn widen(v: u64) -> __m256 {
    _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_cvtsi64_si128(v as i64)))
}

/// The four quarters (32 values each) of half `n` of the Q6_K super-block at `b`, as signed
/// values less 32 — the layout `quant::dequant_block` reads.
#[inline(always)]
pub(super) unsafe fn q6k_quarters(b: *const u8, n: usize) -> [__m256i; 4] {
    let (m4, m2, m32) = (_mm256_set1_epi8(0x0F), _mm256_set1_epi8(0x03), _mm256_set1_epi8(32));
    let ql0 = _mm256_loadu_si256(b.add(64 * n) as *const __m256i);
    let ql1 = _mm256_loadu_si256(b.add(64 * n + 32) as *const __m256i);
    let qh = _mm256_loadu_si256(b.add(128 + 32 * n) as *const __m256i);
    let high = |shift: i32| {
        let h = _mm256_and_si256(_mm256_srl_epi16(qh, _mm_cvtsi32_si128(shift)), m2);
        _mm256_slli_epi16(h, 4)
    };
    [
        _mm256_or_si256(_mm256_and_si256(ql0, m4), high(0)),
        _mm256_or_si256(_mm256_and_si256(ql1, m4), high(2)),
        _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(ql0, 4), m4), high(4)),
        _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(ql1, 4), m4), high(6)),
    ]
    .map(|q| _mm256_sub_epi8(q, m32))
}

/// One Q6_K row (`nsb` super-blocks) against `xs`: signed 6-bit values, a scale per 16 values,
/// each 32-value unit's scaled integer sum whole (`subs8`).
#[inline(always)]
unsafe fn q6k<const N: usize>(w: *const u8, nsb: usize, xs: [&Q8Row; N]) -> [f32; N] {
    let mut acc = [_mm256_setzero_ps(); N];
    for s in 0..nsb {
        let b = w.add(s * 210);
        for line in 0..4 {
            prefetch(b.add(64 * line));
        }
        let d = _mm256_set1_ps(h2f(b.add(208)));
        // d times each activation row's eight block scales: one lane per 32-value block.
        let mut scale = [_mm256_setzero_ps(); N];
        for a in 0..N {
            scale[a] = _mm256_mul_ps(d, _mm256_loadu_ps(xs[a].scales8(8 * s).0.as_ptr()));
        }
        let (mut q, mut scales) = ([_mm256_setzero_si256(); 8], [_mm256_setzero_si256(); 8]);
        for n in 0..2 {
            for (quarter, v) in q6k_quarters(b, n).into_iter().enumerate() {
                let is = 192 + 8 * n + 2 * quarter;
                let (sa, sb) = (*b.add(is) as i8 as i16, *b.add(is + 1) as i8 as i16);
                (q[4 * n + quarter], scales[4 * n + quarter]) =
                    (v, _mm256_set_m128i(_mm_set1_epi16(sb), _mm_set1_epi16(sa)));
            }
        }
        scaled_subs8(&mut acc, &scale, xs, 8 * s, &q, &scales);
    }
    hsums(&acc)
}

/// `subs8` for signed values `q` with a scale per 16 of them (`scales`: the `madd` factors, low
/// half the first) — Q3_K and Q6_K.
#[inline(always)]
pub(super) unsafe fn scaled_subs8<const N: usize>(
    acc: &mut [__m256; N],
    scale: &[__m256; N],
    xs: [&Q8Row; N],
    first: usize,
    q: &[__m256i; 8],
    scales: &[__m256i; 8],
) {
    subs8(acc, scale, xs, first, &|c, qx| {
        let pairs = _mm256_maddubs_epi16(_mm256_sign_epi8(q[c], q[c]), _mm256_sign_epi8(qx, q[c]));
        _mm256_madd_epi16(pairs, scales[c])
    });
}

/// Each row's accumulator lanes summed (`hsum`).
#[inline(always)]
pub(super) unsafe fn hsums<const N: usize>(acc: &[__m256; N]) -> [f32; N] {
    let mut r = [0f32; N];
    for a in 0..N {
        r[a] = hsum(acc[a]);
    }
    r
}

/// One weight row of `dtype` (`rb` bytes) against activation rows `xs` (the one-row kernels take
/// the K-quants from here with `N` = 1).
#[inline(always)]
pub(super) unsafe fn row<const N: usize>(
    dtype: DType,
    w: *const u8,
    rb: usize,
    xs: [&Q8Row; N],
) -> [f32; N] {
    match dtype {
        DType::Q8_0 => row32::<N, true, D, _>(w, 34, rb / 34, xs, &|b| q8_0(b)),
        DType::Q4_0 => row32::<N, false, D_MINUS_8, _>(w, 18, rb / 18, xs, &|b| q4_0(b)),
        DType::Q4_1 => row32::<N, false, D_M, _>(w, 20, rb / 20, xs, &|b| q4_1(b)),
        DType::Q5_0 => row32::<N, false, D_MINUS_16, _>(w, 22, rb / 22, xs, &|b| q5_0(b)),
        DType::Q5_1 => row32::<N, false, D_M, _>(w, 24, rb / 24, xs, &|b| q5_1(b)),
        DType::Mxfp4 => row32::<N, true, EACH, _>(w, 17, rb / 17, xs, &|b| mxfp4(b)),
        DType::Q4K => q45k::<N, false>(w, rb / 144, xs),
        DType::Q5K => q45k::<N, true>(w, rb / 176, xs),
        DType::Q2K => super::int8_kq_avx2::q2k::<N>(w, rb / 84, xs),
        DType::Q3K => super::int8_kq_avx2::q3k::<N>(w, rb / 110, xs),
        DType::Int8B128 => {
            units::<N, true, _, _>(rb / 132 * 4, xs, &|i| int8_b128(w, i), &|_, _| None)
        }
        DType::Int4G128 => {
            units::<N, false, _, _>(rb / 69 * 4, xs, &|i| int4_g128(w, i), &|_, _| None)
        }
        _ => q6k::<N>(w, rb / 210, xs),
    }
}

/// `super::int8::dot_rows` for several activation rows, with AVX2, FMA and F16C.
///
/// # Safety
/// The CPU must support AVX2, FMA and F16C; `w` must hold `out.len() / xs.len()` rows of `rb`
/// bytes (whole blocks of `dtype`, one `int8::supports`) and every row of `xs`
/// at least as many values as a weight row.
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn dot_batch(dtype: DType, w: &[u8], rb: usize, xs: &[Q8Row], out: &mut [f32]) {
    if super::int8_lanes::isa() == Some(super::int8_lanes::Isa::Vnni) {
        return dot_batch_vl(dtype, w, rb, xs, out);
    }
    batch(dtype, w, rb, xs, out)
}

/// `dot_batch` where the CPU has AVX-512 VL: the same instructions, with its 32 vector registers
/// (four rows' accumulators, scales and a super-block's eight units spilled from 16).
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512vl")]
unsafe fn dot_batch_vl(dtype: DType, w: &[u8], rb: usize, xs: &[Q8Row], out: &mut [f32]) {
    batch(dtype, w, rb, xs, out)
}

/// The body of `dot_batch`, inlined into each.
#[inline(always)]
unsafe fn batch(dtype: DType, w: &[u8], rb: usize, xs: &[Q8Row], out: &mut [f32]) {
    let m = xs.len();
    for (j, o) in out.chunks_exact_mut(m).enumerate() {
        let p = w.as_ptr().add(j * rb);
        let mut a0 = 0;
        while a0 + A <= m {
            o[a0..a0 + A].copy_from_slice(&row::<A>(
                dtype,
                p,
                rb,
                std::array::from_fn(|i| &xs[a0 + i]),
            ));
            a0 += A;
        }
        // The last 1-3 rows in one pass too: one at a time, m = 2 read each weight row twice and
        // ran slower than m = 4 (benchmarks/matvec-cpu-2core.md).
        match m - a0 {
            3 => o[a0..].copy_from_slice(&row::<3>(
                dtype,
                p,
                rb,
                [&xs[a0], &xs[a0 + 1], &xs[a0 + 2]],
            )),
            2 => o[a0..].copy_from_slice(&row::<2>(dtype, p, rb, [&xs[a0], &xs[a0 + 1]])),
            1 => o[a0] = row::<1>(dtype, p, rb, [&xs[a0]])[0],
            _ => {}
        }
    }
}
