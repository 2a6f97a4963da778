//! Scalar references of the 8-bit-activation dot for the K-quant formats beside Q4_K and Q6_K:
//! Q2_K, Q3_K (a scale per 16 values) and Q5_K (Q4_K's layout with a fifth bit). Each takes one
//! 256-value super-block against the eight 32-value activation blocks it spans; the AVX2 kernels
//! (`int8_kq_avx2`) compute the same integer sums.

use super::int8::Q8Row;
use crate::quant::f16_at;
use crate::quant_ext::{q3k_scales, scale_min_k4};

/// One Q2_K super-block (84 bytes: 16 scale bytes — scale in the low nibble, min in the high —,
/// 64 bytes of 2-bit values, `d`, `dmin`; value = d·scale·q − dmin·min per 16 values) against
/// activation blocks `first..first + 8`: per block dx·(d·Σ scale·q·qx − dmin·Σ min·qx).
pub(super) fn q2k_scalar(b: &[u8], x: &Q8Row, first: usize) -> f32 {
    let (scales, qs) = (&b[0..16], &b[16..80]);
    let (d, dmin) = (f16_at(b, 80), f16_at(b, 82));
    let mut acc = 0f32;
    for c in 0..8 {
        let (dx, qx, _) = x.block(first + c);
        let (q, shift) = (&qs[32 * (c / 4)..32 * (c / 4) + 32], 2 * (c % 4));
        let (mut isum, mut msum) = (0i32, 0i32);
        for l in 0..32 {
            let sc = scales[2 * c + l / 16];
            isum += (sc & 0xF) as i32 * ((q[l] >> shift) & 3) as i32 * qx[l] as i32;
            msum += (sc >> 4) as i32 * qx[l] as i32;
        }
        acc += dx * (d * isum as f32 - dmin * msum as f32);
    }
    acc
}

/// The signed 3-bit value (−4..3) of value `l` (0..32) of 32-value block `c` (0..8) of a Q3_K
/// super-block: the 2 bits at `2·(c % 4)` of byte `32·(c / 4) + l` of its values, less 4 unless
/// bit `c` of its high-bit byte `l` is set — the layout `quant_ext::q3_k` reads.
pub(super) fn q3k_value(b: &[u8], c: usize, l: usize) -> i32 {
    let q = (b[32 + 32 * (c / 4) + l] >> (2 * (c % 4))) & 3;
    q as i32 - if b[l] >> c & 1 != 0 { 0 } else { 4 }
}

/// One Q3_K super-block (110 bytes; value = d·(scale − 32)·q per 16 values) against activation
/// blocks `first..first + 8`: per block d·dx·Σ scale·q·qx.
pub(super) fn q3k_scalar(b: &[u8], x: &Q8Row, first: usize) -> f32 {
    let d = f16_at(b, 108);
    let sc = q3k_scales(&b[96..108]);
    let mut acc = 0f32;
    for c in 0..8 {
        let (dx, qx, _) = x.block(first + c);
        let isum: i32 =
            (0..32).map(|l| sc[2 * c + l / 16] * q3k_value(b, c, l) * qx[l] as i32).sum();
        acc += d * dx * isum as f32;
    }
    acc
}

/// One Q4_K (144 bytes) or, `fifth`, Q5_K (176: 32 bytes of fifth bits before the nibbles)
/// super-block (value = d·scale·q − dmin·min per 32 values) against activation blocks
/// `first..first + 8`: per block d·scale·dx·Σq·qx − dmin·min·(dx·Σqx).
pub(super) fn q45k_scalar(b: &[u8], x: &Q8Row, first: usize, fifth: bool) -> f32 {
    let (d, dmin) = (f16_at(b, 0), f16_at(b, 2));
    let (qh, qs) = if fifth { (&b[16..48], &b[48..176]) } else { (&b[0..0], &b[16..144]) };
    let mut acc = 0f32;
    for j in 0..8 {
        let (sc, m) = scale_min_k4(j, &b[4..16]);
        let (bytes, shift) = (&qs[32 * (j / 2)..32 * (j / 2) + 32], 4 * (j % 2));
        let (dx, qx, ds) = x.block(first + j);
        let isum: i32 = (0..32)
            .map(|l| {
                let high = if fifth { ((qh[l] >> j) & 1) << 4 } else { 0 };
                (((bytes[l] >> shift) & 0xF) | high) as i32 * qx[l] as i32
            })
            .sum();
        acc += d * sc * dx * isum as f32 - dmin * m * ds;
    }
    acc
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::quant::dequant_row;
    use layerstream_types::DType;

    /// The references read the same values the dequantizers write: with an activation of one 1.0
    /// (quantized exactly: d = 1/127, q = 127), each reference returns that weight.
    #[test]
    fn each_reference_reads_the_dequantizers_values() {
        for dtype in [DType::Q2K, DType::Q3K, DType::Q4K, DType::Q5K] {
            let b = layerstream_types::random::Rng::new(9).tensor(dtype, &[1, 256]).unwrap();
            let mut deq = vec![0f32; 256];
            dequant_row(dtype, &b, &mut deq);
            for l in (0..256).step_by(7) {
                let mut x = vec![0f32; 256];
                x[l] = 1.0;
                let xq = super::super::int8::quantize_row(&x);
                let got = match dtype {
                    DType::Q2K => q2k_scalar(&b, &xq, 0),
                    DType::Q3K => q3k_scalar(&b, &xq, 0),
                    _ => q45k_scalar(&b, &xq, 0, dtype == DType::Q5K),
                };
                let want = deq[l];
                assert!(
                    (got - want).abs() <= 1e-5 * want.abs().max(1e-3),
                    "{dtype} {l}: {got} vs {want}"
                );
            }
        }
    }
}
