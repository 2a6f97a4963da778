//! Opt-in 8-bit activations for the CPU matvec path (`--int8-activations`; steps of up to `MAX_ROWS`
//! activation rows), as llama.cpp computes:
//! each activation row is quantized once per step to blocks of 32 signed bytes with an f32 scale,
//! and Q8_0 / Q4_0 / Q4_1 weight blocks are dotted with them in integer arithmetic, one scale
//! product per block. Faster than dequantizing every weight to f32, at the cost of the exact parity
//! with transformers the f32 path keeps (tokens are checked against llama.cpp's own output instead:
//! benchmarks/vs-llama-cpp-cpu-2core.md). Off by default; other formats keep the f32 path.

use crate::quant::f16_at;
use layerstream_types::DType;
use std::sync::atomic::{AtomicBool, Ordering};

static ENABLED: AtomicBool = AtomicBool::new(false);

/// Turns 8-bit activations on or off for this process.
pub fn set_int8_activations(on: bool) {
    ENABLED.store(on, Ordering::Relaxed);
}

/// Whether 8-bit activations are on.
pub fn int8_activations() -> bool {
    ENABLED.load(Ordering::Relaxed)
}

/// Weight formats with an 8-bit-activation dot.
pub fn supports(dtype: DType) -> bool {
    matches!(dtype, DType::Q8_0 | DType::Q4_0 | DType::Q4_1)
}

/// Most activation rows a step may have for the 8-bit path (decode of a few sequences): with more,
/// the f32 path's blocked kernels (`rows`, GEMM) are faster.
pub const MAX_ROWS: usize = 8;

/// Values per block of the quantized activations.
const QK: usize = 32;

/// An activation row in blocks of 32: per block a scale `d`, 32 signed values `q` (x ≈ d·q), and
/// Σq (for formats with an offset).
pub struct Q8Row {
    d: Vec<f32>,
    q: Vec<i8>,
    sum: Vec<i32>,
}

/// Quantizes `x` (a whole number of blocks): d = max|x| / 127, q = round(x / d).
pub fn quantize_row(x: &[f32]) -> Q8Row {
    let n = x.len() / QK;
    let mut r = Q8Row { d: Vec::with_capacity(n), q: vec![0; n * QK], sum: Vec::with_capacity(n) };
    for (xs, qs) in x.chunks_exact(QK).zip(r.q.chunks_exact_mut(QK)) {
        let amax = xs.iter().fold(0f32, |a, v| a.max(v.abs()));
        let d = amax / 127.0;
        let id = if d > 0.0 { 1.0 / d } else { 0.0 };
        let mut s = 0i32;
        for (q, &v) in qs.iter_mut().zip(xs) {
            *q = (v * id).round().clamp(-127.0, 127.0) as i8;
            s += *q as i32;
        }
        r.d.push(d);
        r.sum.push(s);
    }
    r
}

/// The integer dot of one weight block's 32 values (as `dtype` stores them, offsets excluded) with
/// the activation block `qx`: Σ w_i·q_i, with w_i the int8 (Q8_0) or the 4-bit value (Q4_0, Q4_1).
fn block_isum(dtype: DType, b: &[u8], qx: &[i8]) -> i32 {
    match dtype {
        DType::Q8_0 => b[2..34].iter().zip(qx).map(|(&w, &q)| (w as i8) as i32 * q as i32).sum(),
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

/// Scalar reference: Σ over blocks of the weight row `w` (whole blocks of `dtype`) · `x`.
pub fn dot_scalar(dtype: DType, w: &[u8], x: &Q8Row) -> f32 {
    let bb = dtype.block_bytes();
    let mut acc = 0f32;
    for (i, b) in w.chunks_exact(bb).enumerate() {
        let (dx, qx) = (x.d[i], &x.q[i * QK..(i + 1) * QK]);
        let s = block_isum(dtype, b, qx) as f32;
        acc += match dtype {
            DType::Q8_0 => f16_at(b, 0) * dx * s,
            DType::Q4_0 => f16_at(b, 0) * dx * (s - 8.0 * x.sum[i] as f32),
            _ => f16_at(b, 0) * dx * s + f16_at(b, 2) * dx * x.sum[i] as f32,
        };
    }
    acc
}

/// `dot_scalar`, with AVX2 where the CPU has it (the integer sums are the same; the f32 sums of
/// the blocks are added in another order).
pub fn dot(dtype: DType, w: &[u8], x: &Q8Row) -> f32 {
    #[cfg(target_arch = "x86_64")]
    if super::rows::avx2() && std::is_x86_feature_detected!("f16c") {
        // SAFETY: the CPU supports AVX2 and F16C (checked at run time); `dot_avx2` reads whole
        // blocks of `w` and the matching blocks of `x`, which the caller sized for the same row.
        return unsafe { avx2::dot(dtype, w, x) };
    }
    dot_scalar(dtype, w, x)
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use super::{Q8Row, QK};
    use layerstream_types::DType;
    use std::arch::x86_64::*;

    /// Σ of u8 × i8 products of 32 pairs, as 8 i32 lanes.
    #[inline(always)]
    unsafe fn dot_u8_i8(u: __m256i, s: __m256i) -> __m256i {
        _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1))
    }

    /// The little-endian f16 at `b[i..i + 2]`, converted by the CPU (F16C).
    #[inline(always)]
    unsafe fn h2f(b: &[u8], i: usize) -> f32 {
        let bits = u16::from_le_bytes([b[i], b[i + 1]]);
        _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(bits as i32)))
    }

    /// `super::dot_scalar` with AVX2 (and F16C for the block scales).
    ///
    /// # Safety
    /// The CPU must support AVX2 and F16C; `x` must hold at least as many blocks as `w`.
    #[target_feature(enable = "avx2,f16c")]
    pub unsafe fn dot(dtype: DType, w: &[u8], x: &Q8Row) -> f32 {
        let bb = dtype.block_bytes();
        let nb = w.len() / bb;
        assert!(x.d.len() >= nb && x.q.len() >= nb * QK);
        let mut acc = _mm256_setzero_ps();
        let mut offset = 0f32;
        let low = _mm_set1_epi8(0x0F);
        for i in 0..nb {
            let b = &w[i * bb..(i + 1) * bb];
            let qx = _mm256_loadu_si256(x.q.as_ptr().add(i * QK) as *const __m256i);
            let dx = x.d[i];
            let (isum, scale) = match dtype {
                DType::Q8_0 => {
                    let qw = _mm256_loadu_si256(b.as_ptr().add(2) as *const __m256i);
                    // |w| · (x with w's sign): u8 × i8 for maddubs.
                    let s = dot_u8_i8(_mm256_sign_epi8(qw, qw), _mm256_sign_epi8(qx, qw));
                    (s, h2f(b, 0) * dx)
                }
                _ => {
                    let q1 = dtype == DType::Q4_1;
                    let raw =
                        _mm_loadu_si128(b.as_ptr().add(if q1 { 4 } else { 2 }) as *const __m128i);
                    let lo = _mm_and_si128(raw, low);
                    let hi = _mm_and_si128(_mm_srli_epi16(raw, 4), low);
                    let s = dot_u8_i8(_mm256_set_m128i(hi, lo), qx);
                    let d = h2f(b, 0);
                    offset += if q1 {
                        h2f(b, 2) * dx * x.sum[i] as f32
                    } else {
                        -8.0 * d * dx * x.sum[i] as f32
                    };
                    (s, d * dx)
                }
            };
            acc =
                _mm256_add_ps(acc, _mm256_mul_ps(_mm256_set1_ps(scale), _mm256_cvtepi32_ps(isum)));
        }
        let mut lanes = [0f32; 8];
        _mm256_storeu_ps(lanes.as_mut_ptr(), acc);
        lanes.iter().sum::<f32>() + offset
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::quant::{dequant_row, dot as f32_dot};

    #[test]
    fn the_8_bit_dot_matches_its_reference_and_the_f32_dot_closely() {
        let k = 576;
        let x: Vec<f32> = (0..k).map(|i| ((i * 37 % 101) as f32 - 50.0) * 0.021).collect();
        let xq = quantize_row(&x);
        for dtype in [DType::Q8_0, DType::Q4_0, DType::Q4_1] {
            let w = layerstream_types::random::Rng::new(3).tensor(dtype, &[1, k]).unwrap();
            let (fast, reference) = (dot(dtype, &w, &xq), dot_scalar(dtype, &w, &xq));
            assert!(
                (fast - reference).abs() <= 1e-5 * reference.abs().max(1.0),
                "{dtype}: {fast} vs {reference}"
            );
            let mut wf = vec![0f32; k];
            dequant_row(dtype, &w, &mut wf);
            let exact = f32_dot(&wf, &x);
            let scale: f32 = wf.iter().zip(&x).map(|(a, b)| (a * b).abs()).sum();
            assert!(
                (fast - exact).abs() <= 0.01 * scale,
                "{dtype}: {fast} vs f32 {exact} (Σ|w·x| {scale})"
            );
        }
        // A zero block quantizes to zeros, not NaN.
        let z = quantize_row(&[0.0; 32]);
        assert_eq!((z.d[0], z.sum[0]), (0.0, 0));
    }
}
