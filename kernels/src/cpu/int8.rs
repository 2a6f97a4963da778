//! 8-bit activations for the CPU matmuls (`Precision::Int8`, passed with each product: the
//! decoder layers' choice, `layerstream_worker::int8_by_default` — on the CPU unless `--exact`, on
//! a GPU only with `--int8-activations`, whose matvec has its own kernel in kernels/cuda/int8.cu —
//! while every vocabulary projection but a draft model's takes f32), as llama.cpp computes:
//! each activation row is quantized once per step to blocks of 32 signed bytes with an f32 scale,
//! and Q8_0 / Q4_0 / Q4_1 / Q5_0 / Q5_1 / Q2_K / Q3_K / Q4_K / Q5_K / Q6_K / int8_b128 / int4_g128 /
//! MXFP4 weight blocks are dotted with them in integer arithmetic, one scale
//! product per block. Faster than dequantizing every weight to f32, at the cost of the exact parity
//! with transformers the f32 path keeps (tokens are checked against llama.cpp's own output instead:
//! benchmarks/vs-llama-cpp-cpu-2core.md). Other formats keep the f32 path.

use super::int8_kq;
use crate::quant::f16_at;
use layerstream_types::DType;
/// Weight formats with an 8-bit-activation dot.
pub fn supports(dtype: DType) -> bool {
    matches!(
        dtype,
        DType::Q8_0
            | DType::Q4_0
            | DType::Q4_1
            | DType::Q5_0
            | DType::Q5_1
            | DType::Q2K
            | DType::Q3K
            | DType::Q4K
            | DType::Q5K
            | DType::Q6K
            | DType::Int8B128
            | DType::Int4G128
            | DType::Mxfp4
    )
}

/// How far ahead of the bytes being computed on the weights are prefetched: on the 2-vCPU Intel VM
/// the kernels waited on their weight loads (perf: the instructions using them), and prefetching
/// 512 / 2048 / 8192 / 16384 bytes ahead took one-thread 8-bit decode of SmolLM2 from 55 to 67 /
/// 81 / 84-100 / 87-93 tok/s (benchmarks/vs-llama-cpp-cpu-2core.md).
pub const PREFETCH: usize = 8192;

/// Asks the CPU for the weight bytes `PREFETCH` past `p`, into L1 (a hint: it never faults, also
/// past the end of the weights); nothing off x86-64. The one prefetch of the CPU kernels.
#[inline(always)]
pub(crate) fn prefetch(p: *const u8) {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: a prefetch is a hint that never faults, whatever the address; SSE is baseline x86-64.
    unsafe {
        use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T0};
        _mm_prefetch::<_MM_HINT_T0>(p.wrapping_add(PREFETCH) as *const i8)
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = p;
}

/// Values per block of the quantized activations.
pub(super) const QK: usize = 32;

/// An activation row in blocks of 32: per block a scale `d`, 32 signed values `q` (x ≈ d·q), and
/// `d·Σq` (for formats with an offset: the offset times it is the block's offset term).
#[derive(Clone)]
pub struct Q8Row {
    pub(super) d: Vec<f32>,
    pub(super) q: Vec<i8>,
    pub(super) ds: Vec<f32>,
}

/// Quantizes `x` (a whole number of blocks): d = max|x| / 127, q = round(x / d) (half away from
/// zero), with AVX2 where the CPU has it (`int8_quant`: the same bits).
pub fn quantize_row(x: &[f32]) -> Q8Row {
    let n = x.len() / QK;
    let mut r = Q8Row { d: vec![0.0; n], q: vec![0; n * QK], ds: vec![0.0; n] };
    #[cfg(target_arch = "x86_64")]
    if simd() {
        // SAFETY: the CPU has AVX2 and FMA (checked); the slices hold n blocks each.
        unsafe { super::int8_quant::blocks(&x[..n * QK], &mut r.d, &mut r.q, &mut r.ds) };
        return r;
    }
    quantize_scalar(x, &mut r);
    r
}

/// `quantize_row` in scalar code: the reference `int8_quant` matches bit for bit.
pub(super) fn quantize_scalar(x: &[f32], r: &mut Q8Row) {
    for (i, (xs, qs)) in x.chunks_exact(QK).zip(r.q.chunks_exact_mut(QK)).enumerate() {
        let amax = xs.iter().fold(0f32, |a, v| a.max(v.abs()));
        let d = amax / 127.0;
        let id = if d > 0.0 { 1.0 / d } else { 0.0 };
        let mut s = 0i32;
        for (q, &v) in qs.iter_mut().zip(xs) {
            *q = (v * id).round().clamp(-127.0, 127.0) as i8;
            s += *q as i32;
        }
        r.d[i] = d;
        r.ds[i] = d * s as f32;
    }
}

/// The integer dot of one weight block's 32 values (as `dtype` stores them, offsets excluded) with
/// the activation block `qx`: Σ w_i·q_i, with w_i the int8 (Q8_0), the 4-bit value (Q4_0, Q4_1) or
/// the 5-bit value (Q5_0, Q5_1).
fn block_isum(dtype: DType, b: &[u8], qx: &[i8]) -> i32 {
    match dtype {
        DType::Mxfp4 => {
            let v = |n: u8| crate::quant_ext::MXFP4_VALUES[n as usize] as i32;
            (0..16)
                .map(|j| v(b[1 + j] & 0xF) * qx[j] as i32 + v(b[1 + j] >> 4) * qx[j + 16] as i32)
                .sum()
        }
        DType::Q8_0 => b[2..34].iter().zip(qx).map(|(&w, &q)| (w as i8) as i32 * q as i32).sum(),
        DType::Q5_0 | DType::Q5_1 => {
            let hb = if dtype == DType::Q5_1 { 4 } else { 2 };
            let qh = u32::from_le_bytes([b[hb], b[hb + 1], b[hb + 2], b[hb + 3]]);
            (0..16)
                .map(|j| {
                    let w = b[hb + 4 + j] as i32;
                    let lo = w & 0xF | (((qh >> j) & 1) << 4) as i32;
                    let hi = w >> 4 | (((qh >> (j + 16)) & 1) << 4) as i32;
                    lo * qx[j] as i32 + hi * qx[j + 16] as i32
                })
                .sum()
        }
        _ => {
            let qs = if dtype == DType::Q4_1 { &b[4..20] } else { &b[2..18] };
            qs.iter()
                .enumerate()
                .map(|(j, &w)| {
                    (w & 0xF) as i32 * qx[j] as i32 + (w >> 4) as i32 * qx[j + 16] as i32
                })
                .sum()
        }
    }
}

/// A 32-value block's scale: its f16 `d`, or MXFP4's e8m0 byte (halved: its values are doubled).
fn block_scale(dtype: DType, b: &[u8]) -> f32 {
    match dtype {
        DType::Mxfp4 => crate::quant_ext::e8m0_half(b[0]),
        _ => f16_at(b, 0),
    }
}

/// The block's offset coefficient `c` (its offset term is `c · d·Σq` of the activation block):
/// Q4_1's and Q5_1's minimum, Q4_0's −8·d and Q5_0's −16·d, none for Q8_0.
fn block_offset(dtype: DType, b: &[u8]) -> f32 {
    match dtype {
        DType::Q4_1 | DType::Q5_1 => f16_at(b, 2),
        DType::Q4_0 => -8.0 * f16_at(b, 0),
        DType::Q5_0 => -16.0 * f16_at(b, 0),
        _ => 0.0,
    }
}

/// Scalar reference: Σ over blocks of the weight row `w` (whole blocks of `dtype`) · `x`.
pub fn dot_scalar(dtype: DType, w: &[u8], x: &Q8Row) -> f32 {
    let super_blocks = |f: &dyn Fn(&[u8], usize) -> f32| -> f32 {
        w.chunks_exact(dtype.block_bytes()).enumerate().map(|(s, b)| f(b, 8 * s)).sum()
    };
    match dtype {
        DType::Q2K => return super_blocks(&|b, first| int8_kq::q2k_scalar(b, x, first)),
        DType::Q3K => return super_blocks(&|b, first| int8_kq::q3k_scalar(b, x, first)),
        DType::Q4K | DType::Q5K => {
            let fifth = dtype == DType::Q5K;
            return super_blocks(&|b, first| int8_kq::q45k_scalar(b, x, first, fifth));
        }
        _ => {}
    }
    if dtype == DType::Q6K {
        return w.chunks_exact(210).enumerate().map(|(s, b)| q6k_scalar(b, x, 8 * s)).sum();
    }
    if matches!(dtype, DType::Int8B128 | DType::Int4G128) {
        let bb = dtype.block_bytes();
        return w.chunks_exact(bb).enumerate().map(|(k, b)| b128_scalar(dtype, b, x, 4 * k)).sum();
    }
    let bb = dtype.block_bytes();
    let mut acc = 0f32;
    for (i, b) in w.chunks_exact(bb).enumerate() {
        let (dx, qx) = (x.d[i], &x.q[i * QK..(i + 1) * QK]);
        let s = block_isum(dtype, b, qx) as f32;
        acc += block_scale(dtype, b) * dx * s + block_offset(dtype, b) * x.ds[i];
    }
    acc
}

/// One `int8_b128` / `int4_g128` block (128 values, one scale; int4: w = s·(q − zero)) against
/// activation blocks `first..first + 4`: s·dx·Σq·qx per 32 values, int4 less s·zero·dx·Σqx.
fn b128_scalar(dtype: DType, b: &[u8], x: &Q8Row, first: usize) -> f32 {
    let s = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
    let mut acc = 0f32;
    for j in 0..4 {
        let (dx, qx, ds) = x.block(first + j);
        if dtype == DType::Int8B128 {
            let w = &b[4 + 32 * j..4 + 32 * j + 32];
            let isum: i32 = w.iter().zip(qx).map(|(&w, &q)| (w as i8) as i32 * q as i32).sum();
            acc += s * dx * isum as f32;
        } else {
            let (bytes, shift) = (&b[5 + 32 * (j % 2)..5 + 32 * (j % 2) + 32], 4 * (j / 2));
            let isum: i32 =
                bytes.iter().zip(qx).map(|(&w, &q)| ((w >> shift) & 0xF) as i32 * q as i32).sum();
            acc += s * dx * isum as f32 - s * b[4] as f32 * ds;
        }
    }
    acc
}

/// The 6-bit value `l` (0..128) of half `n` of a Q6_K super-block, offset removed (−32..31), and
/// the index of its 16-value scale — the layout `quant::dequant_block` reads.
pub(super) fn q6k_value(b: &[u8], n: usize, l: usize) -> (i32, usize) {
    let (ql, qh) = (&b[64 * n..64 * n + 64], &b[128 + 32 * n..128 + 32 * n + 32]);
    let (quarter, i) = (l / 32, l % 32);
    let low = if quarter % 2 == 0 { ql[i] } else { ql[i + 32] };
    let low = if quarter < 2 { low & 0xF } else { low >> 4 };
    let high = (qh[i] >> (2 * quarter)) & 3;
    ((low | (high << 4)) as i32 - 32, 8 * n + 2 * quarter + i / 16)
}

/// One Q6_K super-block (256 values: value = d·scale·q, a signed 8-bit scale per 16) against
/// activation blocks `first..first + 8`.
fn q6k_scalar(b: &[u8], x: &Q8Row, first: usize) -> f32 {
    let d = f16_at(b, 208);
    let mut acc = 0f32;
    for c in 0..8 {
        let (dx, qx, _) = x.block(first + c);
        let isum: i32 = (0..32)
            .map(|i| {
                let (q, is) = q6k_value(b, c / 4, 32 * (c % 4) + i);
                (b[192 + is] as i8) as i32 * q * qx[i] as i32
            })
            .sum();
        acc += d * dx * isum as f32;
    }
    acc
}

/// Asserts what every 8-bit product needs of its weights — a format with an 8-bit dot, rows of
/// whole blocks, as many rows in `w` as `out` (`m` outputs a row) takes — and returns the values
/// of a weight row.
fn check_rows(dtype: DType, w: &[u8], row_bytes: usize, m: usize, out: &[f32]) -> usize {
    assert!(supports(dtype) && out.len().is_multiple_of(m));
    assert!(w.len() >= out.len() / m * row_bytes);
    let bb = dtype.block_bytes();
    assert!(row_bytes.is_multiple_of(bb));
    row_bytes / bb * dtype.block_elems()
}

/// `out[j·m + a]` = the dot of weight row `j` of `w` (rows of `row_bytes`, whole blocks of
/// `dtype`) with activation row `a` of `xs` (`m` rows): `dot_scalar` per pair, with AVX2 + FMA where
/// the CPU has them — one activation row: four weight rows at a time sharing each activation block;
/// several: each weight block unpacked once for four activation rows. The integer sums are
/// `dot_scalar`'s, its f32 sums of the blocks added in another order; the SIMD kernels give an
/// output the same bits for one activation row or several (and `int8_lanes` for many).
pub fn dot_rows(dtype: DType, w: &[u8], row_bytes: usize, xs: &[Q8Row], out: &mut [f32]) {
    let m = xs.len().max(1);
    let values = check_rows(dtype, w, row_bytes, m, out);
    assert!(xs.iter().all(|x| x.d.len() * QK >= values));
    #[cfg(target_arch = "x86_64")]
    if simd() {
        // SAFETY: the CPU supports AVX2, FMA and F16C (checked at run time); the asserts above
        // bound every weight row and activation block the kernels read.
        return unsafe {
            match xs {
                [x] => super::int8_avx2::dot_rows(dtype, w, row_bytes, x, out),
                _ if super::int8_few::takes(dtype, m) => {
                    super::int8_few::dot(dtype, w, row_bytes, xs, out)
                }
                _ => super::int8_batch::dot_batch(dtype, w, row_bytes, xs, out),
            }
        };
    }
    for (j, o) in out.chunks_exact_mut(m).enumerate() {
        for (v, x) in o.iter_mut().zip(xs) {
            *v = dot_scalar(dtype, &w[j * row_bytes..(j + 1) * row_bytes], x);
        }
    }
}

/// Activation rows of a step, quantized for the kernels: row by row, or sixteen rows to a
/// register or eight (`int8_lanes`, from `LANES_FROM` rows on: AVX-512 VNNI or AVX2).
pub enum Acts {
    Rows(Vec<Q8Row>),
    #[cfg(target_arch = "x86_64")]
    Lanes(super::int8_lanes::Q8Lanes),
}

/// From this many activation rows on, `int8_lanes` takes every format where the CPU has it: from 9
/// the lanes kernel (sixteen rows at once) beat the few-row kernels on every format measured, at
/// 8 (eight lanes) on some and not others (kernels/benches/many_rows.rs,
/// benchmarks/prefill-int8-cpu-2core.md). Both give the same bits, so this moves only speed.
pub const LANES_FROM: usize = 9;

/// From this many rows `quantize` lays them out in lanes too, for the formats at which eight rows
/// in one eight-lane group beat the few-row kernels (`int8_lanes::lanes_pay`); the others take the
/// rows as they were.
pub const NARROW_FROM: usize = 8;

static LANES: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(true);

/// Turns the many-row kernel (`int8_lanes`) on or off for this process (on by default; off, every
/// step takes the few-row kernels: the same bits, so not a precision — a switch for benchmarks
/// side by side, which no command sets).
pub fn set_lanes(on: bool) {
    LANES.store(on, std::sync::atomic::Ordering::Relaxed);
}

/// The rows `x` (`m` of `k` values, `k` a multiple of 32) quantized for `dot`.
pub fn quantize(x: &[f32], k: usize, m: usize) -> Acts {
    use rayon::prelude::*;
    // Every thread quantizes rows (each row's bits are its own): one thread took 1.4% of a
    // 64-row step of a 4096 × 4096 weight.
    let rows: Vec<Q8Row> = x[..m * k].par_chunks_exact(k).map(quantize_row).collect();
    #[cfg(target_arch = "x86_64")]
    if m >= NARROW_FROM
        && LANES.load(std::sync::atomic::Ordering::Relaxed)
        && super::int8_lanes::available()
    {
        return Acts::Lanes(super::int8_lanes::Q8Lanes::new(rows, k / QK));
    }
    Acts::Rows(rows)
}

/// `dot_rows` for activations as `quantize` left them: the same bits either way.
pub fn dot(dtype: DType, w: &[u8], row_bytes: usize, xs: &Acts, out: &mut [f32]) {
    match xs {
        Acts::Rows(rows) => dot_rows(dtype, w, row_bytes, rows, out),
        #[cfg(target_arch = "x86_64")]
        Acts::Lanes(lanes) => {
            if let Some(rows) = lanes.few_rows(dtype) {
                return dot_rows(dtype, w, row_bytes, rows, out);
            }
            let values = check_rows(dtype, w, row_bytes, lanes.rows(), out);
            assert_eq!(values, lanes.units() * QK, "weight rows and activations differ in width");
            // SAFETY: `Lanes` is only built where `int8_lanes::available()`; the asserts bound
            // every weight row read, and each spans exactly the activations' units.
            unsafe { super::int8_lanes::dot_lanes(dtype, w, row_bytes, lanes, out) }
        }
    }
}

/// Whether this CPU runs the AVX2 kernels (AVX2, FMA and F16C; detected once).
#[cfg(target_arch = "x86_64")]
pub(super) fn simd() -> bool {
    static DETECTED: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *DETECTED.get_or_init(|| {
        super::rows::avx2()
            && std::is_x86_feature_detected!("fma")
            && std::is_x86_feature_detected!("f16c")
    })
}

/// What the SIMD kernels read of a row: its blocks' scales, values and offset sums.
impl Q8Row {
    /// Scales and d·Σq of blocks `first..first + 8` (a K-quant super-block's span).
    #[inline(always)]
    pub(super) fn scales8(&self, first: usize) -> (&[f32], &[f32]) {
        (&self.d[first..first + 8], &self.ds[first..first + 8])
    }

    /// Scale, 32 values and d·Σq of block `i`.
    #[inline(always)]
    pub(super) fn block(&self, i: usize) -> (f32, &[i8], f32) {
        (self.d[i], &self.q[i * QK..(i + 1) * QK], self.ds[i])
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::quant::{dequant_row, dot as f32_dot};

    /// Every format with an 8-bit dot.
    const TYPES: [DType; 13] = [
        DType::Q8_0,
        DType::Q4_0,
        DType::Q4_1,
        DType::Q5_0,
        DType::Q5_1,
        DType::Q2K,
        DType::Q3K,
        DType::Q4K,
        DType::Q5K,
        DType::Q6K,
        DType::Int8B128,
        DType::Int4G128,
        DType::Mxfp4,
    ];

    #[test]
    fn the_8_bit_dot_matches_its_reference_and_the_f32_dot_closely() {
        assert!(TYPES.iter().all(|&t| supports(t)));
        let k = 576;
        let x: Vec<f32> = (0..k).map(|i| ((i * 37 % 101) as f32 - 50.0) * 0.021).collect();
        for dtype in TYPES {
            let k = if dtype.block_elems() > 32 { 512 } else { k };
            let x = &x[..k];
            let xq = quantize_row(x);
            let w = layerstream_types::random::Rng::new(3).tensor(dtype, &[1, k]).unwrap();
            let reference = dot_scalar(dtype, &w, &xq);
            let mut fast = [0f32];
            dot_rows(dtype, &w, w.len(), std::slice::from_ref(&xq), &mut fast);
            let fast = fast[0];
            assert!(
                (fast - reference).abs() <= 1e-5 * reference.abs().max(1.0),
                "{dtype}: {fast} vs {reference}"
            );
            let mut wf = vec![0f32; k];
            dequant_row(dtype, &w, &mut wf);
            let exact = f32_dot(&wf, x);
            let scale: f32 = wf.iter().zip(x).map(|(a, b)| (a * b).abs()).sum();
            assert!(
                (fast - exact).abs() <= 0.01 * scale,
                "{dtype}: {fast} vs f32 {exact} (Σ|w·x| {scale})"
            );
        }
        // Many rows at once (groups of four and a remainder) equal the reference row by row.
        for dtype in TYPES {
            let (k, rows) = (if dtype.block_elems() > 32 { 512 } else { k }, 7);
            let xq = quantize_row(&x[..k]);
            let w = layerstream_types::random::Rng::new(5).tensor(dtype, &[rows, k]).unwrap();
            let rb = w.len() / rows;
            let mut got = vec![0f32; rows];
            dot_rows(dtype, &w, rb, std::slice::from_ref(&xq), &mut got);
            for (j, g) in got.iter().enumerate() {
                let want = dot_scalar(dtype, &w[j * rb..(j + 1) * rb], &xq);
                assert!((g - want).abs() <= 1e-5 * want.abs().max(1.0), "{dtype} row {j}");
            }
        }
        // Several activation rows at once (four at a time and a remainder of 1-3 in one pass)
        // equal the reference pair by pair.
        for (dtype, m) in TYPES.into_iter().flat_map(|d| [(d, 2), (d, 5), (d, 7)]) {
            let (k, rows) = (if dtype.block_elems() > 32 { 512 } else { k }, 3);
            let xs: Vec<Q8Row> = (0..m)
                .map(|a| {
                    quantize_row(&x[..k].iter().map(|v| v * (a as f32 - 2.5)).collect::<Vec<_>>())
                })
                .collect();
            let w = layerstream_types::random::Rng::new(11).tensor(dtype, &[rows, k]).unwrap();
            let rb = w.len() / rows;
            let mut got = vec![0f32; rows * m];
            dot_rows(dtype, &w, rb, &xs, &mut got);
            for j in 0..rows {
                for (a, xa) in xs.iter().enumerate() {
                    let want = dot_scalar(dtype, &w[j * rb..(j + 1) * rb], xa);
                    let g = got[j * m + a];
                    assert!((g - want).abs() <= 1e-5 * want.abs().max(1.0), "{dtype} {j},{a}");
                }
            }
        }
        // Q6_K's value unpacking is the dequantizer's, value for value.
        let b = layerstream_types::random::Rng::new(7).tensor(DType::Q6K, &[1, 256]).unwrap();
        let mut deq = vec![0f32; 256];
        dequant_row(DType::Q6K, &b, &mut deq);
        for (l, want) in deq.iter().enumerate() {
            let (q, is) = q6k_value(&b, l / 128, l % 128);
            let got = f16_at(&b, 208) * (b[192 + is] as i8) as f32 * q as f32;
            assert_eq!(got.to_bits(), want.to_bits(), "value {l}");
        }
        // A zero block quantizes to zeros, not NaN.
        let z = quantize_row(&[0.0; 32]);
        assert_eq!((z.d[0], z.ds[0]), (0.0, 0.0));
    }
}
