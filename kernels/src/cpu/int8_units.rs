//! A weight row of any 8-bit-path format unpacked once into 32-value units for the many-row
//! kernel (`int8_lanes`): each unit's 32 signed values as bytes, −128 × the sum of each 4 of them
//! (the correction for activations stored as unsigned bytes), and the scalars its format's
//! arithmetic needs. The values, scales and their products are the ones the one-row and few-row
//! kernels (`int8_avx2`, `int8_batch`, `int8_kq_avx2`) compute, so the many-row kernel can give
//! their bits.
//!
//! Safety, for every function here: the CPU has AVX2, FMA and F16C, `w` holds a whole row of
//! `dtype` of `n` units, and the `Out` view was made for `n` (the caller, `int8_lanes::dot_lanes`,
//! asserts the row's size; `Out::new` the view's bounds).

use super::int8_avx2::h2f;
use super::int8_batch::{
    int4_g128, int8_b128, mxfp4, q4_0, q4_1, q5_0, q5_1, q6k_quarters, q8_0, Unpacked,
};
use layerstream_types::DType;
use std::arch::x86_64::*;

/// How a format's units combine into a dot (the arithmetic of its few-row kernel).
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(super) enum Form {
    /// Each unit's products summed whole (an exact integer P), (d·dx)·P and the offset c·(dx·Σqx)
    /// added into lane `unit mod 8` of the accumulators, offsets added before the lanes are summed
    /// (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, MXFP4, int8_b128, int4_g128; Q4_K and Q5_K with d·scale
    /// and −dmin·min as d and c).
    Plain,
    /// P already multiplied by a signed integer scale per 16 values (Q3_K, Q6_K).
    Scaled16,
    /// Q2_K: a scale and a min per 16 values, dx multiplied last.
    Q2k,
}

/// The form of `dtype` (one `int8::supports`).
pub(super) fn form(dtype: DType) -> Form {
    match dtype {
        DType::Q3K | DType::Q6K => Form::Scaled16,
        DType::Q2K => Form::Q2k,
        _ => Form::Plain,
    }
}

/// One 32-value unit of a weight row.
#[derive(Clone, Copy, Default)]
#[repr(C, align(32))]
pub(super) struct Unit {
    /// The values as signed bytes (unsigned formats' values are below 128).
    pub v: [i8; 32],
    /// For activations stored biased (`int8_lanes::Isa::Vnni`): −128 × the sum of values
    /// 4t..4t+4, per t. For signed activations (AVX2) the bytes of |v| instead (`mag`): the
    /// unsigned operand of `vpmaddubsw`, taken once a step rather than per activation group.
    pub bias: [i32; 8],
    /// Σ of `bias` over t in 0..4 and 4..8: where a kernel chains a unit's (or a half's) products
    /// into one integer (`int8_lanes::tile` for Q3_K–Q6_K); biased activations only.
    pub bsum: [i32; 2],
    /// The unit's scale (d, d·scale for Q4_K/Q5_K, the super-block's d for Q2_K/Q3_K/Q6_K).
    pub d: f32,
    /// The offset coefficient (`Plain`) or −dmin (`Q2k`).
    pub c: f32,
    /// Integer scales of values 0..16 and 16..32 (`Scaled16`, `Q2k`).
    pub sa: i32,
    pub sb: i32,
    /// Q2_K's mins of values 0..16 and 16..32.
    pub ma: i32,
    pub mb: i32,
}

impl Unit {
    /// |v|'s bytes 4t..4t+4 as one i32 (units unpacked for signed activations).
    #[inline(always)]
    pub(super) fn mag(&self, t: usize) -> i32 {
        self.bias[t]
    }
}

/// Writes `v` and, for `biased` activations, its sums (else its magnitudes) into `u`.
#[inline(always)]
unsafe fn put(u: &mut Unit, v: __m256i, biased: bool) {
    _mm256_storeu_si256(u.v.as_mut_ptr() as *mut __m256i, v);
    if !biased {
        // |−128| is 0x80: 128 as the unsigned byte `maddubs` reads, as `sign(v, v)` gave it.
        _mm256_storeu_si256(u.bias.as_mut_ptr() as *mut __m256i, _mm256_abs_epi8(v));
        return;
    }
    // Σ of each 4 values (ones as the unsigned side: |v| ≤ 128, no saturation), times −128.
    let pairs = _mm256_maddubs_epi16(_mm256_set1_epi8(1), v);
    let sums = _mm256_madd_epi16(pairs, _mm256_set1_epi16(1));
    let bias = _mm256_sub_epi32(_mm256_setzero_si256(), _mm256_slli_epi32(sums, 7));
    _mm256_storeu_si256(u.bias.as_mut_ptr() as *mut __m256i, bias);
    let b = &u.bias;
    u.bsum = [b[0] + b[1] + b[2] + b[3], b[4] + b[5] + b[6] + b[7]];
}

/// A `Plain` unit from its few-row unpacking: the signed values are the sign vector of a signed
/// format (`signed`), the magnitudes of an unsigned one.
#[inline(always)]
unsafe fn plain(u: &mut Unit, (mag, sign, d, c): Unpacked, signed: bool, biased: bool) {
    put(u, if signed { sign } else { mag }, biased);
    (u.d, u.c) = (d, c);
}

/// Whether `dtype`'s unpacked values may be negative: signed formats keep their signs, unsigned
/// ones (Q4_0, Q4_1, Q5_0, Q5_1, int4_g128, Q2_K, Q4_K, Q5_K) their magnitudes, below 128.
pub(super) fn signed(dtype: DType) -> bool {
    matches!(dtype, DType::Q8_0 | DType::Mxfp4 | DType::Int8B128 | DType::Q3K | DType::Q6K)
}

/// Where `unpack` writes a row's units: unit i at `p + i·stride` — 1 for a row's units side by
/// side, `int8_lanes`' tile height to interleave them with the tile's other rows (unit i of every
/// row at one address), written in place rather than copied there afterwards (the copy was ~40%
/// of the lanes kernel's samples at 8 rows).
#[derive(Clone, Copy)]
pub(super) struct Out {
    p: *mut Unit,
    stride: usize,
}

impl Out {
    /// `n` units of `units`, from `first`, `stride` apart: panics unless the last is inside.
    pub(super) fn new(units: &mut [Unit], first: usize, stride: usize, n: usize) -> Out {
        assert!(stride > 0 && (n == 0 || first + (n - 1) * stride < units.len()));
        Out { p: units[first..].as_mut_ptr(), stride }
    }

    /// Unit `i`. Safety: `i` below the `n` the view was made for, no other reference to it live.
    #[inline(always)]
    unsafe fn at<'a>(self, i: usize) -> &'a mut Unit {
        &mut *self.p.add(i * self.stride)
    }

    /// The view from unit `i` on.
    #[inline(always)]
    unsafe fn from(self, i: usize) -> Out {
        Out { p: self.p.add(i * self.stride), stride: self.stride }
    }
}

/// Unpacks the row `w` of `dtype` into `n` units (one per 32 values) of `out`, for activations
/// stored `biased` (q + 128: `int8_lanes::Isa::Vnni`) or signed.
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn unpack(dtype: DType, w: *const u8, out: Out, n: usize, biased: bool) {
    let s = signed(dtype);
    let each = |bb: usize, f: &dyn Fn(*const u8) -> Unpacked| {
        for i in 0..n {
            plain(out.at(i), f(w.add(i * bb)), s, biased);
        }
    };
    match dtype {
        DType::Q8_0 => each(34, &|b| q8_0(b)),
        DType::Q4_0 => each(18, &|b| q4_0(b)),
        DType::Q4_1 => each(20, &|b| q4_1(b)),
        DType::Q5_0 => each(22, &|b| q5_0(b)),
        DType::Q5_1 => each(24, &|b| q5_1(b)),
        DType::Mxfp4 => each(17, &|b| mxfp4(b)),
        DType::Int8B128 => {
            for i in 0..n {
                plain(out.at(i), int8_b128(w, i), s, biased);
            }
        }
        DType::Int4G128 => {
            for i in 0..n {
                plain(out.at(i), int4_g128(w, i), s, biased);
            }
        }
        DType::Q4K | DType::Q5K => {
            let bb = if dtype == DType::Q5K { 176 } else { 144 };
            for sb in 0..n / 8 {
                q45k(w.add(sb * bb), dtype == DType::Q5K, out.from(8 * sb), biased);
            }
        }
        DType::Q6K => {
            for sb in 0..n / 8 {
                q6k(w.add(sb * 210), out.from(8 * sb), biased);
            }
        }
        DType::Q3K => {
            for sb in 0..n / 8 {
                q3k(w.add(sb * 110), out.from(8 * sb), biased);
            }
        }
        _ => {
            for sb in 0..n / 8 {
                q2k(w.add(sb * 84), out.from(8 * sb), biased);
            }
        }
    }
}

/// A Q4_K (or, `fifth`, Q5_K) super-block's eight units: d·scale and −dmin·min as
/// `int8_batch::q45k` multiplies them (f32 products of the f16 and the 6-bit integers).
#[inline(always)]
unsafe fn q45k(b: *const u8, fifth: bool, units: Out, biased: bool) {
    let (d, dmin) = (h2f(b), h2f(b.add(2)));
    let scales = std::slice::from_raw_parts(b.add(4), 12);
    let qs = if fifth { 48 } else { 16 };
    let qh = _mm256_loadu_si256(b.add(16) as *const __m256i);
    let (low, one) = (_mm256_set1_epi8(0x0F), _mm256_set1_epi8(1));
    for sub in 0..8 {
        let u = units.at(sub);
        let (sc, mn) = crate::quant_ext::scale_min_k4(sub, scales);
        let raw = _mm256_loadu_si256(b.add(qs + 32 * (sub / 2)) as *const __m256i);
        let shifted = if sub % 2 == 0 { raw } else { _mm256_srli_epi16(raw, 4) };
        let mut v = _mm256_and_si256(shifted, low);
        if fifth {
            let bit = _mm256_srl_epi16(qh, _mm_cvtsi32_si128(sub as i32));
            v = _mm256_or_si256(v, _mm256_slli_epi16(_mm256_and_si256(bit, one), 4));
        }
        put(u, v, biased);
        (u.d, u.c) = (d * sc, -dmin * mn);
    }
}

/// A Q6_K super-block's eight units (half n, quarter q → unit 4n + q), values less 32, the two
/// signed 8-bit scales of each as integers.
#[inline(always)]
unsafe fn q6k(b: *const u8, units: Out, biased: bool) {
    let d = h2f(b.add(208));
    for n in 0..2 {
        for (quarter, q) in q6k_quarters(b, n).into_iter().enumerate() {
            let u = units.at(4 * n + quarter);
            put(u, q, biased);
            let is = 192 + 8 * n + 2 * quarter;
            (u.sa, u.sb, u.d) = (*b.add(is) as i8 as i32, *b.add(is + 1) as i8 as i32, d);
        }
    }
}

/// The 2-bit values at bit `2k` of the 32 bytes `raw`.
#[inline(always)]
unsafe fn two_bits(raw: __m256i, k: usize) -> __m256i {
    _mm256_and_si256(_mm256_srl_epi16(raw, _mm_cvtsi32_si128(2 * k as i32)), _mm256_set1_epi8(3))
}

/// A Q3_K super-block's eight units: 2 low bits less 4 where the high bit is clear, the signed
/// scale of each 16 values.
#[inline(always)]
unsafe fn q3k(b: *const u8, units: Out, biased: bool) {
    let d = h2f(b.add(108));
    let sc = crate::quant_ext::q3k_scales(std::slice::from_raw_parts(b.add(96), 12));
    let hm = _mm256_loadu_si256(b as *const __m256i);
    let four = _mm256_set1_epi8(4);
    for c in 0..8 {
        let u = units.at(c);
        let raw = _mm256_loadu_si256(b.add(32 + 32 * (c / 4)) as *const __m256i);
        let bit = _mm256_set1_epi8((1u8 << c) as i8);
        let high = _mm256_cmpeq_epi8(_mm256_and_si256(hm, bit), bit);
        let v = _mm256_sub_epi8(two_bits(raw, c % 4), _mm256_andnot_si256(high, four));
        put(u, v, biased);
        (u.sa, u.sb, u.d) = (sc[2 * c], sc[2 * c + 1], d);
    }
}

/// A Q2_K super-block's eight units: 2-bit values, a 4-bit scale and min per 16 values.
#[inline(always)]
unsafe fn q2k(b: *const u8, units: Out, biased: bool) {
    let (d, mdmin) = (h2f(b.add(80)), -h2f(b.add(82)));
    for c in 0..8 {
        let u = units.at(c);
        let raw = _mm256_loadu_si256(b.add(16 + 32 * (c / 4)) as *const __m256i);
        put(u, two_bits(raw, c % 4), biased);
        let (a, z) = (*b.add(2 * c), *b.add(2 * c + 1));
        (u.sa, u.sb, u.ma, u.mb) =
            ((a & 0xF) as i32, (z & 0xF) as i32, (a >> 4) as i32, (z >> 4) as i32);
        (u.d, u.c) = (d, mdmin);
    }
}
