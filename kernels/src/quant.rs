//! GGML block formats on the CPU: dequantize a row, and a fused dequantize-dot for matvec.
//!
//! Layouts follow ggml-quants.c: each block's scale(s) first, then packed quants. Rows are whole
//! blocks; `DType::row_bytes` gives their size.

use half::{bf16, f16};
use layerstream_types::DType;

/// The little-endian f16 at `b[i..i + 2]` as f32. Normal numbers (every block scale in practice)
/// are converted inline with integer operations — exact, as any f16 → f32 conversion is; zeros,
/// subnormals, infinities and NaNs go through the library. (The library's own conversion checks
/// for F16C at run time on every call, which cost a noticeable share of decode.)
/// The little-endian f16 at `b[i..i + 2]` as f32.
pub(crate) fn f16_at(b: &[u8], i: usize) -> f32 {
    f16::from_le_bytes([b[i], b[i + 1]]).to_f32()
}

/// Dequantizes one block of `dtype` into `out` (`dtype.block_elems()` values).
pub fn dequant_block(dtype: DType, b: &[u8], out: &mut [f32]) {
    match dtype {
        DType::F32 => out[0] = f32::from_le_bytes([b[0], b[1], b[2], b[3]]),
        DType::F16 => out[0] = f16_at(b, 0),
        DType::Bf16 => out[0] = bf16::from_le_bytes([b[0], b[1]]).to_f32(),
        DType::Q8_0 => {
            let d = f16_at(b, 0);
            for (o, &q) in out[..32].iter_mut().zip(&b[2..34]) {
                *o = d * (q as i8) as f32;
            }
        }
        DType::Q4_0 | DType::Q4_1 => {
            let d = f16_at(b, 0);
            let (m, qs, off) = if dtype == DType::Q4_1 {
                (f16_at(b, 2), &b[4..20], 0.0)
            } else {
                (0.0, &b[2..18], 8.0)
            };
            for (l, &q) in qs.iter().enumerate() {
                out[l] = d * ((q & 0xF) as f32 - off) + m;
                out[l + 16] = d * ((q >> 4) as f32 - off) + m;
            }
        }
        DType::Q4K => crate::quant_ext::q4_q5_k(b, false, out),
        DType::Q5_0 => crate::quant_ext::q5(b, false, out),
        DType::Q5_1 => crate::quant_ext::q5(b, true, out),
        DType::Q2K => crate::quant_ext::q2_k(b, out),
        DType::Q3K => crate::quant_ext::q3_k(b, out),
        DType::Q5K => crate::quant_ext::q4_q5_k(b, true, out),
        DType::Iq4Nl => crate::quant_ext::iq4_nl(b, out),
        DType::Iq4Xs => crate::quant_ext::iq4_xs(b, out),
        DType::Mxfp4 => crate::quant_ext::mxfp4(b, out),
        DType::Tq1_0 => crate::quant_checkpoint::tq1_0(b, out),
        DType::Tq2_0 => crate::quant_checkpoint::tq2_0(b, out),
        DType::Fp8E4m3B128 => crate::quant_checkpoint::fp8_e4m3(b, out),
        DType::Int8B128 => crate::quant_checkpoint::int8(b, out),
        DType::Int4G128 => crate::quant_checkpoint::int4(b, out),
        DType::Q6K => {
            let d = f16_at(b, 208);
            for n in 0..2 {
                let ql = &b[64 * n..64 * n + 64];
                let qh = &b[128 + 32 * n..128 + 32 * n + 32];
                let sc = &b[192 + 8 * n..192 + 8 * n + 8];
                let o = &mut out[128 * n..128 * n + 128];
                for l in 0..32 {
                    let is = l / 16;
                    let q1 = ((ql[l] & 0xF) | ((qh[l] & 3) << 4)) as i32 - 32;
                    let q2 = ((ql[l + 32] & 0xF) | (((qh[l] >> 2) & 3) << 4)) as i32 - 32;
                    let q3 = ((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) as i32 - 32;
                    let q4 = ((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) as i32 - 32;
                    o[l] = d * (sc[is] as i8) as f32 * q1 as f32;
                    o[l + 32] = d * (sc[is + 2] as i8) as f32 * q2 as f32;
                    o[l + 64] = d * (sc[is + 4] as i8) as f32 * q3 as f32;
                    o[l + 96] = d * (sc[is + 6] as i8) as f32 * q4 as f32;
                }
            }
        }
    }
}

/// Dequantizes a row of whole blocks into `out`.
pub fn dequant_row(dtype: DType, row: &[u8], out: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    if crate::cpu::rows::avx2() {
        // SAFETY: the CPU supports AVX2 (checked at run time by `avx2`).
        return unsafe { dequant_row_avx2(dtype, row, out) };
    }
    dequant_row_body(dtype, row, out)
}

/// `dequant_row` compiled with AVX2: the same operations, so the same values, in wider registers.
///
/// # Safety
/// The CPU must support AVX2.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn dequant_row_avx2(dtype: DType, row: &[u8], out: &mut [f32]) {
    dequant_row_body(dtype, row, out)
}

#[inline(always)]
fn dequant_row_body(dtype: DType, row: &[u8], out: &mut [f32]) {
    match dtype {
        DType::F32 => {
            for (o, c) in out.iter_mut().zip(row.chunks_exact(4)) {
                *o = f32::from_le_bytes([c[0], c[1], c[2], c[3]]);
            }
        }
        DType::F16 => {
            for (o, c) in out.iter_mut().zip(row.chunks_exact(2)) {
                *o = f16::from_le_bytes([c[0], c[1]]).to_f32();
            }
        }
        DType::Bf16 => {
            for (o, c) in out.iter_mut().zip(row.chunks_exact(2)) {
                *o = bf16::from_le_bytes([c[0], c[1]]).to_f32();
            }
        }
        // Hot formats: fixed-size arrays, no per-block dispatch, so the loops vectorise.
        DType::Q8_0 => {
            for (o, b) in out.chunks_exact_mut(32).zip(row.chunks_exact(34)) {
                let d = f16_at(b, 0);
                let qs: &[u8; 32] = b[2..34].try_into().expect("34-byte block");
                let o: &mut [f32; 32] = o.try_into().expect("32 values");
                for l in 0..32 {
                    o[l] = d * (qs[l] as i8) as f32;
                }
            }
        }
        DType::Q4_0 | DType::Q4_1 => {
            let bb = dtype.block_bytes();
            for (o, b) in out.chunks_exact_mut(32).zip(row.chunks_exact(bb)) {
                let d = f16_at(b, 0);
                let (m, qs) = if dtype == DType::Q4_1 {
                    (f16_at(b, 2), &b[4..20])
                } else {
                    (-8.0 * d, &b[2..18])
                };
                let qs: &[u8; 16] = qs.try_into().expect("16 quant bytes");
                let (lo, hi) = o.split_at_mut(16);
                let (lo, hi): (&mut [f32; 16], &mut [f32; 16]) =
                    (lo.try_into().expect("16"), hi.try_into().expect("16"));
                for l in 0..16 {
                    lo[l] = d * (qs[l] & 0xF) as f32 + m;
                    hi[l] = d * (qs[l] >> 4) as f32 + m;
                }
            }
        }
        // The pre-quantized checkpoints' formats: their block decoders, inlined here.
        DType::Fp8E4m3B128 | DType::Int8B128 | DType::Int4G128 => {
            for (o, b) in out.chunks_exact_mut(128).zip(row.chunks_exact(dtype.block_bytes())) {
                match dtype {
                    DType::Fp8E4m3B128 => crate::quant_checkpoint::fp8_e4m3(b, o),
                    DType::Int8B128 => crate::quant_checkpoint::int8(b, o),
                    _ => crate::quant_checkpoint::int4(b, o),
                }
            }
        }
        _ => {
            let (be, bb) = (dtype.block_elems(), dtype.block_bytes());
            for (o, b) in out.chunks_exact_mut(be).zip(row.chunks_exact(bb)) {
                dequant_block(dtype, b, o);
            }
        }
    }
}

/// Plain f32 dot product (auto-vectorised: 8 independent accumulators). `cpu::rows::dot_rows`
/// computes the same sums, operation for operation, for many `b`s at once.
#[inline(always)]
pub fn dot(a: &[f32], b: &[f32]) -> f32 {
    #[cfg(target_arch = "x86_64")]
    if std::is_x86_feature_detected!("avx") {
        // SAFETY: the CPU has AVX (checked).
        return unsafe { dot_avx(a, b) };
    }
    dot_lanes(a, b)
}

/// `dot` compiled for AVX: its eight accumulators one 256-bit register instead of two SSE ones
/// (the same multiplies and adds, so the same bits; attention's scores are these dots).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx")]
unsafe fn dot_avx(a: &[f32], b: &[f32]) -> f32 {
    dot_lanes(a, b)
}

/// `dot`'s arithmetic: eight running sums of products, summed in order, then the tail.
#[inline(always)]
fn dot_lanes(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0f32; 8];
    let (ca, cb) = (a.chunks_exact(8), b.chunks_exact(8));
    let (ra, rb) = (ca.remainder(), cb.remainder());
    for (x, y) in ca.zip(cb) {
        for i in 0..8 {
            acc[i] += x[i] * y[i];
        }
    }
    let mut s: f32 = acc.iter().sum();
    for (x, y) in ra.iter().zip(rb) {
        s += x * y;
    }
    s
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    fn h(x: f32) -> [u8; 2] {
        f16::from_f32(x).to_le_bytes()
    }

    /// `synth`'s random weights are centred and small in every format, as trained weights are (biased
    /// Q4_K weights once pushed a synthetic 70B model's activations past f16's range).
    #[test]
    fn synthetic_weights_are_zero_mean_and_small() {
        for dtype in DType::ALL {
            let (rows, k) = (64, 512);
            let t = layerstream_types::random::Rng::new(7).tensor(dtype, &[rows, k]).unwrap();
            let mut w = vec![0f32; rows * k];
            for (row, out) in t.chunks_exact(dtype.row_bytes(k).unwrap()).zip(w.chunks_exact_mut(k))
            {
                dequant_row(dtype, row, out);
            }
            let mean = w.iter().map(|&v| v as f64).sum::<f64>() / w.len() as f64;
            let rms = (w.iter().map(|&v| (v as f64).powi(2)).sum::<f64>() / w.len() as f64).sqrt();
            assert!(mean.abs() < 0.15 * rms, "{dtype}: mean {mean} against rms {rms}");
            assert!((0.005..0.06).contains(&rms), "{dtype}: rms {rms}");
            assert!(w.iter().all(|v| v.abs() <= 0.2), "{dtype}: a weight beyond ±0.2");
        }
    }

    #[test]
    fn q4_0_and_q4_1_known_values() {
        let mut b = vec![];
        b.extend(h(0.5));
        b.extend([0x21u8; 16]); // low nibble 1, high nibble 2
        let mut out = [0f32; 32];
        dequant_block(DType::Q4_0, &b, &mut out);
        assert_eq!(out[0], 0.5 * (1.0 - 8.0));
        assert_eq!(out[16], 0.5 * (2.0 - 8.0));
        let mut b1 = vec![];
        b1.extend(h(0.5));
        b1.extend(h(-1.0));
        b1.extend([0x21u8; 16]);
        dequant_block(DType::Q4_1, &b1, &mut out);
        assert_eq!(out[3], 0.5 * 1.0 - 1.0);
        assert_eq!(out[20], 0.5 * 2.0 - 1.0);
    }

    #[test]
    fn q8_0_known_values() {
        let mut b = vec![];
        b.extend(h(0.25));
        b.extend((0..32).map(|i| (i as i8 - 16) as u8));
        let mut out = [0f32; 32];
        dequant_block(DType::Q8_0, &b, &mut out);
        for (i, v) in out.iter().enumerate() {
            assert_eq!(*v, 0.25 * (i as f32 - 16.0));
        }
    }

    #[test]
    fn q4_k_known_values() {
        // d = 1, dmin = 0.5; sub-block 0: scale 3, min 2; sub-block 5 uses the packed high bits.
        let mut b = vec![0u8; 144];
        b[0..2].copy_from_slice(&h(1.0));
        b[2..4].copy_from_slice(&h(0.5));
        let sc = &mut b[4..16];
        sc[0] = 3; // scale j=0
        sc[4] = 2; // min j=0
        sc[9] = 0x75; // j=5: scale low 5, min low 7
        sc[1] = 1 << 6; // j=5 scale high bits 1 -> scale 5 | 16 = 21
        sc[5] = 2 << 6; // j=5 min high bits 2 -> min 7 | 32 = 39
        b[16] = 0x9; // q[0] low nibble 9 (sub-block 0, element 0)
        b[16 + 64 + 1] = 0x40; // j=2 block: high nibble 4 -> sub-block 5, element 1
        let mut out = [0f32; 256];
        dequant_block(DType::Q4K, &b, &mut out);
        assert_eq!(out[0], 3.0 * 9.0 - 0.5 * 2.0);
        assert_eq!(out[1], -0.5 * 2.0);
        assert_eq!(out[160 + 1], 21.0 * 4.0 - 0.5 * 39.0);
    }

    #[test]
    fn q6_k_known_values() {
        let mut b = vec![0u8; 210];
        b[208..210].copy_from_slice(&h(0.5));
        b[192] = 2; // scale for elements 0..16
        b[192 + 4] = (-3i8) as u8; // scale for elements 64..80
        b[0] = 0x5A; // ql[0]: low 0xA -> element 0, high 0x5 -> element 64
        b[128] = 0b0001_0011; // qh[0]: bits 0-1 = 3 -> element 0, bits 4-5 = 1 -> element 64
        let mut out = [0f32; 256];
        dequant_block(DType::Q6K, &b, &mut out);
        assert_eq!(out[0], 0.5 * 2.0 * ((0xA | (3 << 4)) as f32 - 32.0));
        assert_eq!(out[64], 0.5 * -3.0 * ((0x5 | (1 << 4)) as f32 - 32.0));
        assert_eq!(out[1], 0.5 * 2.0 * -32.0);
    }

    #[test]
    fn random_rows_of_every_type_dequantize_finite() {
        let mut seed = 7u64;
        let mut rnd = || {
            seed = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            (seed >> 33) as u32
        };
        for dtype in DType::ALL {
            let cols = 512;
            let mut row: Vec<u8> =
                (0..dtype.row_bytes(cols).unwrap()).map(|_| rnd() as u8).collect();
            sanitize(dtype, &mut row, &mut rnd);
            let mut deq = vec![0f32; cols];
            dequant_row(dtype, &row, &mut deq);
            assert!(deq.iter().all(|v| v.is_finite()), "{dtype}");
            // block-wise dequantization equals whole-row dequantization
            let (be, bb) = (dtype.block_elems(), dtype.block_bytes());
            let mut one = vec![0f32; be];
            dequant_block(dtype, &row[bb..2 * bb], &mut one);
            assert_eq!(&one[..], &deq[be..2 * be], "{dtype}");
        }
    }

    pub(crate) fn sanitize(dtype: DType, row: &mut [u8], rnd: &mut impl FnMut() -> u32) {
        let mut val = || f16::from_f32((*rnd)() as f32 / u32::MAX as f32 * 0.1).to_le_bytes();
        match dtype {
            DType::F32 => row
                .chunks_exact_mut(4)
                .for_each(|c| c.copy_from_slice(&((val()[1] as f32) / 100.0).to_le_bytes())),
            DType::F16 | DType::Bf16 => row.chunks_exact_mut(2).for_each(|c| c[1] &= 0x3F),
            DType::Q8_0 | DType::Q4_0 | DType::Q5_0 | DType::Iq4Nl | DType::Iq4Xs => row
                .chunks_exact_mut(dtype.block_bytes())
                .for_each(|b| b[0..2].copy_from_slice(&val())),
            DType::Q4_1 | DType::Q4K | DType::Q5_1 | DType::Q5K => {
                row.chunks_exact_mut(dtype.block_bytes()).for_each(|b| {
                    b[0..2].copy_from_slice(&val());
                    b[2..4].copy_from_slice(&val());
                })
            }
            DType::Q2K => row.chunks_exact_mut(84).for_each(|b| {
                b[80..82].copy_from_slice(&val());
                b[82..84].copy_from_slice(&val());
            }),
            DType::Q3K => {
                row.chunks_exact_mut(110).for_each(|b| b[108..110].copy_from_slice(&val()))
            }
            DType::Q6K => {
                row.chunks_exact_mut(210).for_each(|b| b[208..210].copy_from_slice(&val()))
            }
            // A finite scale (0xFF is NaN): 2^(e − 128) for e in 100..132.
            DType::Mxfp4 => row.chunks_exact_mut(17).for_each(|b| b[0] = 100 + (b[0] & 31)),
            DType::Tq1_0 => {
                row.chunks_exact_mut(54).for_each(|b| b[52..54].copy_from_slice(&val()))
            }
            DType::Tq2_0 => {
                row.chunks_exact_mut(66).for_each(|b| b[64..66].copy_from_slice(&val()))
            }
            DType::Fp8E4m3B128 | DType::Int8B128 | DType::Int4G128 => {
                row.chunks_exact_mut(dtype.block_bytes()).for_each(|b| {
                    let s = f16::from_le_bytes(val()).to_f32();
                    b[0..4].copy_from_slice(&s.to_le_bytes());
                    if dtype == DType::Fp8E4m3B128 {
                        // No NaN codes (0x7F, 0xFF).
                        b[4..].iter_mut().filter(|v| **v & 0x7F == 0x7F).for_each(|v| *v &= 0xFE);
                    }
                })
            }
        }
    }
}
