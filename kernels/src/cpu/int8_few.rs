//! Weights of the formats summed a 32-value unit whole (Q4_K, Q5_K, Q4_0, Q4_1, Q5_0, Q5_1,
//! Q8_0; Q6_K and Q3_K a 16-value half-unit whole, each half times its scale in integers) against
//! a few activation rows (2 to `MAX_ROWS`: a batched decode step, drafted rows to verify) with
//! AVX-512 VNNI: one `vpdpbusd` multiplies four unsigned weights by four signed 8-bit activations
//! and adds them into an i32 lane, so a unit's 32 products take eight of them — where the few-row
//! kernel (`int8_batch`) takes a `vpmaddubsw`, a `vpmaddwd` and its share of a horizontal sum
//! (`sums8`) per activation row.
//!
//! For that eight units (a K-quant's super-block, or eight blocks of a 32-value format) are laid
//! out with lane c holding unit c (`transpose8`: instruction t takes values 4t..4t+4 of each): the
//! weights once a group for every activation row, the activations once a call for every weight
//! row. Each lane then ends with its unit's integer sum, the one `sums8` gives — Q8_0's signed
//! weights offset by 128 to be unsigned, and 128 times the unit's activation sum taken off after;
//! Q6_K's by 32 and Q3_K's by 4, their halves summed apart (instructions 0-3 and 4-7), each less
//! the offset times its activation sum and times its scale: the same integer — and it is scaled,
//! added and summed with `int8_batch`'s f32 operations in its order: every output has the bits of
//! the one-row, few-row and many-row kernels (a sequence's logits do not depend on what its step
//! holds).

use super::int8::{prefetch, Q8Row, QK};
use super::int8_avx2::h2f;
use super::int8_batch::q6k_quarters;
use super::int8_batch::{block_scales8, five_bits, hsum, nibbles, q45k_scales, q45k_values};
use super::int8_batch::{D, D_M, D_MINUS_16, D_MINUS_8};
use super::int8_kq_avx2::q3k_values;
use layerstream_types::DType;
use std::arch::x86_64::*;

/// The most activation rows a call takes.
pub const MAX_ROWS: usize = 8;

/// The formats, as a const parameter (each kernel built for one).
const Q4K: u8 = 0;
const Q5K: u8 = 1;
const Q4_0: u8 = 2;
const Q4_1: u8 = 3;
const Q5_0: u8 = 4;
const Q5_1: u8 = 5;
const Q8_0: u8 = 6;
const Q6K: u8 = 7;
const Q3K: u8 = 8;

/// The formats in the order of their const parameters.
const FORMATS: [DType; 9] = [
    DType::Q4K,
    DType::Q5K,
    DType::Q4_0,
    DType::Q4_1,
    DType::Q5_0,
    DType::Q5_1,
    DType::Q8_0,
    DType::Q6K,
    DType::Q3K,
];

/// The format `F` stands for.
fn format(f: u8) -> DType {
    FORMATS[f as usize]
}

/// Whether `f` is a K-quant, whose 256-value super-block is a group of eight units.
const fn super_block(f: u8) -> bool {
    matches!(f, Q4K | Q5K | Q6K | Q3K)
}

/// `F`'s bytes per group of eight units: a K-quant's super-block, eight blocks of the others.
fn group_bytes(f: u8) -> usize {
    match super_block(f) {
        true => format(f).block_bytes(),
        false => 8 * format(f).block_bytes(),
    }
}

/// Whether this CPU runs it (AVX-512 VL and VNNI, as `int8_lanes` detects them, within
/// `isa::cap`).
pub fn available() -> bool {
    super::int8_lanes::isa() == Some(super::int8_lanes::Isa::Vnni)
}

/// Whether a step of `m` activation rows of `dtype` is this kernel's.
pub fn takes(dtype: DType, m: usize) -> bool {
    form(dtype).is_some_and(|f| (2..=most_rows(f)).contains(&m)) && available()
}

/// The most activation rows `takes` gives format `f`: `MAX_ROWS`, but seven for Q6_K and Q3_K,
/// whose eight rows (two passes of four) ran 1.1-1.5x slower than the lanes kernel's one pass of
/// eight where their two to seven ran even to 1.7x faster than `int8_batch`'s (matvec-bench on an
/// Intel VM with AVX-512 VNNI, benchmarks/matvec-cpu-2core.md).
fn most_rows(f: u8) -> usize {
    if halved(f) {
        7
    } else {
        MAX_ROWS
    }
}

/// The const parameter of `dtype`, where this kernel takes it.
fn form(dtype: DType) -> Option<u8> {
    FORMATS.iter().position(|&f| f == dtype).map(|i| i as u8)
}

/// The 8 × 8 transpose of `v`'s i32 lanes: lane c of `out[t]` is lane t of `v[c]`.
#[inline(always)]
unsafe fn transpose8(v: [__m256i; 8]) -> [__m256i; 8] {
    // Per 128-bit half: pairs of rows, then quadruples, then the halves swapped into place.
    let lo32 = |a, b| _mm256_unpacklo_epi32(a, b);
    let hi32 = |a, b| _mm256_unpackhi_epi32(a, b);
    let (a0, a1, a2, a3) = (lo32(v[0], v[1]), hi32(v[0], v[1]), lo32(v[2], v[3]), hi32(v[2], v[3]));
    let (a4, a5, a6, a7) = (lo32(v[4], v[5]), hi32(v[4], v[5]), lo32(v[6], v[7]), hi32(v[6], v[7]));
    let lo64 = |a, b| _mm256_unpacklo_epi64(a, b);
    let hi64 = |a, b| _mm256_unpackhi_epi64(a, b);
    let b = [lo64(a0, a2), hi64(a0, a2), lo64(a1, a3), hi64(a1, a3)];
    let c = [lo64(a4, a6), hi64(a4, a6), lo64(a5, a7), hi64(a5, a7)];
    let mut out = [_mm256_setzero_si256(); 8];
    for t in 0..4 {
        out[t] = _mm256_permute2x128_si256(b[t], c[t], 0x20);
        out[t + 4] = _mm256_permute2x128_si256(b[t], c[t], 0x31);
    }
    out
}

/// Vectors a group of transposed activations takes: eight, then what the weights' offset to
/// unsigned values adds — Q8_0's 128 a unit (one vector), Q6_K's 32 and Q3_K's 4 a half-unit
/// (two: `halved`).
const fn stride(f: u8) -> usize {
    match f {
        Q8_0 => 9,
        Q6K | Q3K => 10,
        _ => 8,
    }
}

/// Each row's activations, eight units a group, transposed as the weights are (units past the
/// row's `units` zero): row a's group g at `[(a · groups + g) · stride(F) ..][..8]`, then
/// (Q8_0) 128 times each unit's sum of values in lane c of a ninth, (Q6_K, Q3_K) 32 (4) times the
/// sums of each unit's first and second 16 values in a ninth and a tenth.
#[inline(always)]
unsafe fn activations<const F: u8>(xs: &[Q8Row], units: usize) -> Vec<__m256i> {
    let groups = units.div_ceil(8);
    let mut t = Vec::with_capacity(xs.len() * groups * stride(F));
    let bias = _mm256_set1_epi8(match F {
        Q8_0 => -128,
        Q6K => 32,
        Q3K => 4,
        _ => 0,
    });
    let offset = |v: &[__m256i]| {
        let mut off = _mm256_setzero_si256();
        v.iter().for_each(|&q| off = _mm256_dpbusd_epi32(off, bias, q));
        off
    };
    for x in xs {
        for g in 0..groups {
            let v: [__m256i; 8] = std::array::from_fn(|c| match 8 * g + c < units {
                true => _mm256_loadu_si256(x.q[(8 * g + c) * QK..].as_ptr() as *const __m256i),
                false => _mm256_setzero_si256(),
            });
            let v = transpose8(v);
            t.extend_from_slice(&v);
            match F {
                Q8_0 => t.push(offset(&v)),
                _ if halved(F) => t.extend_from_slice(&[offset(&v[..4]), offset(&v[4..])]),
                _ => {}
            }
        }
    }
    t
}

/// A group of one weight row: each unit's 32 unsigned values, the units' scales d and offset
/// coefficients c as `int8_batch` reads them (zero past the row's units), and (Q6_K, Q3_K) each
/// unit's two 16-value scales.
struct Group {
    v: [__m256i; 8],
    d: __m256,
    c: __m256,
    halves: [__m256i; 2],
}

/// Group `g` of the row at `row` (`units` in all).
#[inline(always)]
unsafe fn group<const F: u8>(row: *const u8, g: usize, units: usize) -> Group {
    let b = row.add(g * group_bytes(F));
    for line in (0..group_bytes(F)).step_by(64) {
        prefetch(b.add(line));
    }
    let halves = [_mm256_setzero_si256(); 2];
    if F == Q4K || F == Q5K {
        let (d, c) = q45k_scales(b);
        let v = if F == Q5K { q45k_values::<true>(b) } else { q45k_values::<false>(b) };
        return Group { v, d, c, halves };
    }
    if F == Q6K {
        return q6k_group(b);
    }
    if F == Q3K {
        return q3k_group(b);
    }
    let (bb, k) = (format(F).block_bytes(), (units - 8 * g).min(8));
    let (d, c) = match F {
        Q4_0 => block_scales8::<D_MINUS_8>(b, bb, k),
        Q5_0 => block_scales8::<D_MINUS_16>(b, bb, k),
        Q8_0 => block_scales8::<D>(b, bb, k),
        _ => block_scales8::<D_M>(b, bb, k),
    };
    let v = std::array::from_fn(|j| {
        let p = b.add(j * bb);
        match (j < k, F) {
            (false, _) => _mm256_setzero_si256(),
            (_, Q4_0) => nibbles(p.add(2)),
            (_, Q4_1) => nibbles(p.add(4)),
            (_, Q5_0) => five_bits(p.add(2)),
            (_, Q5_1) => five_bits(p.add(4)),
            // Signed bytes offset by 128: unsigned, `activations` takes the offset's products off.
            _ => _mm256_xor_si256(_mm256_loadu_si256(p.add(2).cast()), _mm256_set1_epi8(-128)),
        }
    });
    Group { v, d, c, halves }
}

/// The Q6_K super-block at `b`: unit 4n + q quarter q of half n (`q6k_quarters`' order, the
/// values plus 32: 0..64), d on every lane, and unit c's scales of its first and second 16 values
/// (bytes 192 + 2c and 193 + 2c) in lane c of `halves`.
#[inline(always)]
unsafe fn q6k_group(b: *const u8) -> Group {
    let m32 = _mm256_set1_epi8(32);
    let [a, b_] = [0, 1].map(|n| q6k_quarters(b, n).map(|q| _mm256_add_epi8(q, m32)));
    let v = [a[0], a[1], a[2], a[3], b_[0], b_[1], b_[2], b_[3]];
    let pairs = _mm256_cvtepi8_epi16(_mm_loadu_si128(b.add(192).cast()));
    let halves =
        [_mm256_srai_epi32::<16>(_mm256_slli_epi32::<16>(pairs)), _mm256_srai_epi32::<16>(pairs)];
    Group { v, d: _mm256_set1_ps(h2f(b.add(208))), c: _mm256_setzero_ps(), halves }
}

/// `out[j·m + a]` = weight row `j` of `w` (rows of `rb` bytes of `dtype`, one `takes`) ·
/// activation row `a` of `xs` (`m` = `xs.len()`, 2 to `MAX_ROWS`), with the bits of
/// `int8_batch`'s kernels.
///
/// # Safety
/// `available()` must hold; `w` must hold `out.len() / m` rows of `rb` bytes (whole blocks) and
/// every row of `xs` at least a weight row's values.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
pub unsafe fn dot(dtype: DType, w: &[u8], rb: usize, xs: &[Q8Row], out: &mut [f32]) {
    match form(dtype) {
        Some(Q4K) => dot_f::<Q4K>(w, rb, xs, out),
        Some(Q5K) => dot_f::<Q5K>(w, rb, xs, out),
        Some(Q4_0) => dot_f::<Q4_0>(w, rb, xs, out),
        Some(Q4_1) => dot_f::<Q4_1>(w, rb, xs, out),
        Some(Q5_0) => dot_f::<Q5_0>(w, rb, xs, out),
        Some(Q5_1) => dot_f::<Q5_1>(w, rb, xs, out),
        Some(Q8_0) => dot_f::<Q8_0>(w, rb, xs, out),
        Some(Q6K) => dot_f::<Q6K>(w, rb, xs, out),
        Some(_) => dot_f::<Q3K>(w, rb, xs, out),
        None => panic!("int8_few::dot does not take {dtype:?}"),
    }
}

/// `dot` for format `F`.
#[inline(always)]
unsafe fn dot_f<const F: u8>(w: &[u8], rb: usize, xs: &[Q8Row], out: &mut [f32]) {
    let m = xs.len();
    let units = match super_block(F) {
        true => rb / group_bytes(F) * 8,
        false => rb / format(F).block_bytes(),
    };
    assert!(
        (2..=MAX_ROWS).contains(&m),
        "int8_few::dot takes 2 to {MAX_ROWS} activation rows, not {m}"
    );
    let xt = activations::<F>(xs, units);
    let per_row = units.div_ceil(8) * stride(F);
    // Four rows a pass at most: eight rows' sums, accumulators and offsets beside the weights'
    // eight vectors overflow the 32 registers, and the row's second pass reads it from L1.
    let mut a0 = 0;
    while a0 < m {
        let n = (m - a0).min(4);
        let (x, t) = (&xs[a0..a0 + n], &xt[a0 * per_row..]);
        match n {
            1 => rows::<1, F>(w, rb, units, x, t, out, m, a0),
            2 => rows::<2, F>(w, rb, units, x, t, out, m, a0),
            3 => rows::<3, F>(w, rb, units, x, t, out, m, a0),
            _ => rows::<4, F>(w, rb, units, x, t, out, m, a0),
        }
        a0 += n;
    }
}

/// Activation row `x`'s scales and d·Σq of units `first..` of group-sized spans (zeros past
/// `units`, as `int8_batch`'s masked loads read them).
#[inline(always)]
unsafe fn scales(x: &Q8Row, first: usize, units: usize) -> (__m256, __m256) {
    if first + 8 <= units {
        let (dx, ds) = x.scales8(first);
        return (_mm256_loadu_ps(dx.as_ptr()), _mm256_loadu_ps(ds.as_ptr()));
    }
    let (mut dx, mut ds) = ([0f32; 8], [0f32; 8]);
    for (i, u) in (first..units).enumerate() {
        (dx[i], ds[i]) = (x.d[u], x.ds[u]);
    }
    (_mm256_loadu_ps(dx.as_ptr()), _mm256_loadu_ps(ds.as_ptr()))
}

/// `dot` for the `N` rows `xs` (their chains of `vpdpbusd` side by side; `xt` their transposed
/// activations), rows `a0..a0 + N` of each weight row's `m` outputs.
// Rows index the activations, the accumulators and the outputs alike.
#[allow(clippy::needless_range_loop, clippy::too_many_arguments)]
#[inline(always)]
unsafe fn rows<const N: usize, const F: u8>(
    w: &[u8],
    rb: usize,
    units: usize,
    xs: &[Q8Row],
    xt: &[__m256i],
    out: &mut [f32],
    m: usize,
    a0: usize,
) {
    let groups = units.div_ceil(8);
    for (j, o) in out.chunks_exact_mut(m).enumerate() {
        let o = &mut o[a0..a0 + N];
        let row = w.as_ptr().add(j * rb);
        let mut acc = [_mm256_setzero_ps(); N];
        let mut off = [_mm256_setzero_ps(); N];
        for g in 0..groups {
            let gw = group::<F>(row, g, units);
            let isum = isums::<N, F>(&gw, xt, groups, g);
            for a in 0..N {
                let (dx, ds) = scales(&xs[a], 8 * g, units);
                off[a] = _mm256_fmadd_ps(gw.c, ds, off[a]);
                acc[a] =
                    _mm256_fmadd_ps(_mm256_mul_ps(gw.d, dx), _mm256_cvtepi32_ps(isum[a]), acc[a]);
            }
        }
        for a in 0..N {
            o[a] = hsum(_mm256_add_ps(acc[a], off[a]));
        }
    }
}

/// The Q3_K super-block at `b`: its eight blocks' values plus 4 (`q3k_values`), d on every lane,
/// block c's scales of its first and second 16 values (`q3k_scales` 2c and 2c + 1) in lane c of
/// `halves` (the even and odd of the sixteen i32s).
#[inline(always)]
unsafe fn q3k_group(b: *const u8) -> Group {
    let sc = crate::quant_ext::q3k_scales(std::slice::from_raw_parts(b.add(96), 12));
    let all = _mm512_loadu_si512(sc.as_ptr().cast());
    let halves = [_mm512_cvtepi64_epi32(all), _mm512_cvtepi64_epi32(_mm512_srai_epi64::<32>(all))];
    Group { v: q3k_values(b), d: _mm256_set1_ps(h2f(b.add(108))), c: _mm256_setzero_ps(), halves }
}

/// Whether `F` has a scale per 16 values (Q6_K, Q3_K): its units' two halves summed apart.
const fn halved(f: u8) -> bool {
    matches!(f, Q6K | Q3K)
}

/// Each of `N` activation rows' integer sums of group `g`'s units against weight group `gw`
/// (their chains of `vpdpbusd` side by side), less what the weights' offset added: Q8_0's
/// 128 · Σx; Q6_K's and Q3_K's two 16-value halves apart, each less 32 (4) · its Σx and times
/// its scale.
// Rows index the activations and the sums alike, instructions the weights and activations.
#[allow(clippy::needless_range_loop)]
#[inline(always)]
unsafe fn isums<const N: usize, const F: u8>(
    gw: &Group,
    xt: &[__m256i],
    groups: usize,
    g: usize,
) -> [__m256i; N] {
    let wt = transpose8(gw.v);
    let at = |a: usize, t: usize| xt[(a * groups + g) * stride(F) + t];
    let mut isum = [_mm256_setzero_si256(); N];
    if halved(F) {
        let mut high = [_mm256_setzero_si256(); N];
        for t in 0..4 {
            for a in 0..N {
                isum[a] = _mm256_dpbusd_epi32(isum[a], wt[t], at(a, t));
                high[a] = _mm256_dpbusd_epi32(high[a], wt[t + 4], at(a, t + 4));
            }
        }
        for a in 0..N {
            let low = _mm256_mullo_epi32(_mm256_sub_epi32(isum[a], at(a, 8)), gw.halves[0]);
            let high = _mm256_mullo_epi32(_mm256_sub_epi32(high[a], at(a, 9)), gw.halves[1]);
            isum[a] = _mm256_add_epi32(low, high);
        }
        return isum;
    }
    for t in 0..8 {
        for a in 0..N {
            isum[a] = _mm256_dpbusd_epi32(isum[a], wt[t], at(a, t));
        }
    }
    if F == Q8_0 {
        for a in 0..N {
            isum[a] = _mm256_sub_epi32(isum[a], at(a, 8));
        }
    }
    isum
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cpu::int8::quantize_row;
    use layerstream_types::DType;

    /// Activation rows of different magnitudes and signs, the extremes ±127 included.
    fn rows(m: usize, k: usize) -> Vec<Q8Row> {
        (0..m)
            .map(|a| {
                let x: Vec<f32> = (0..k)
                    .map(|i| ((i * 37 + a * 11) % 101) as f32 * 0.02 * (a + 1) as f32 - 1.0)
                    .collect();
                quantize_row(&x)
            })
            .collect()
    }

    #[test]
    fn the_transpose_moves_lane_t_of_row_c_to_lane_c_of_row_t() {
        if !available() {
            eprintln!("skipped: this CPU has no AVX-512 VNNI (or isa::cap turned it off)");
            return;
        }
        #[target_feature(enable = "avx2")]
        unsafe fn check() {
            let v: [__m256i; 8] = std::array::from_fn(|c| {
                _mm256_setr_epi32(
                    (c * 8) as i32,
                    (c * 8 + 1) as i32,
                    (c * 8 + 2) as i32,
                    (c * 8 + 3) as i32,
                    (c * 8 + 4) as i32,
                    (c * 8 + 5) as i32,
                    (c * 8 + 6) as i32,
                    (c * 8 + 7) as i32,
                )
            });
            for (t, r) in transpose8(v).iter().enumerate() {
                let lanes: [i32; 8] = std::mem::transmute(*r);
                assert_eq!(lanes, std::array::from_fn(|c| (c * 8 + t) as i32), "row {t}");
            }
        }
        // SAFETY: `available()` implies AVX2.
        unsafe { check() }
    }

    #[test]
    fn every_output_has_the_bits_of_the_one_row_kernel() {
        if !available() {
            eprintln!("skipped: this CPU has no AVX-512 VNNI (or isa::cap turned it off)");
            return;
        }
        let k_quants = [(256, 5), (512, 3), (4096, 4)];
        // Widths of whole groups of eight blocks and of a last part of 3, 2 and 1.
        let blocks = [(96, 5), (256, 3), (576, 4), (4096, 3), (4128, 2)];
        let cases = [DType::Q4K, DType::Q5K, DType::Q6K, DType::Q3K]
            .into_iter()
            .flat_map(|d| k_quants.map(|s| (d, s)))
            .chain(
                [DType::Q4_0, DType::Q4_1, DType::Q5_0, DType::Q5_1, DType::Q8_0]
                    .into_iter()
                    .flat_map(|d| blocks.map(|s| (d, s))),
            );
        for (dtype, (k, n)) in cases {
            assert!(takes(dtype, 2));
            let w = layerstream_types::random::Rng::new(k as u64).tensor(dtype, &[n, k]).unwrap();
            let rb = w.len() / n;
            for m in 2..=MAX_ROWS {
                let xs = rows(m, k);
                let mut got = vec![0f32; n * m];
                // SAFETY: checked `available()`; `w` holds n rows of rb bytes, each x k values.
                unsafe { dot(dtype, &w, rb, &xs, &mut got) };
                for j in 0..n {
                    for a in 0..m {
                        let mut one = [0f32];
                        let row = &w[j * rb..(j + 1) * rb];
                        crate::cpu::int8::dot_rows(dtype, row, rb, &xs[a..a + 1], &mut one);
                        assert_eq!(
                            got[j * m + a].to_bits(),
                            one[0].to_bits(),
                            "{dtype:?} k {k} m {m} row {j} act {a}"
                        );
                    }
                }
                assert!(got.iter().any(|v| *v != 0.0), "the products are not all zero");
            }
        }
    }
}
