//! Valid random blocks of every stored format, zero-mean and small (|w| ≲ 0.1) as trained weights
//! are, so activations stay in the range real models see. `synth` writes stores from them; kernel
//! tests dequantize them.

use crate::dtype::DType;

/// Deterministic random bytes (xorshift64*).
pub struct Rng(u64);

fn f16(x: f32) -> [u8; 2] {
    half::f16::from_f32(x).to_le_bytes()
}

impl Rng {
    /// A generator whose stream `seed` picks.
    pub fn new(seed: u64) -> Self {
        Rng(seed | 1)
    }

    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }

    fn fill(&mut self, buf: &mut [u8]) {
        for c in buf.chunks_mut(8) {
            let v = self.next().to_le_bytes();
            c.copy_from_slice(&v[..c.len()]);
        }
    }

    /// `n` random bytes.
    pub fn bytes(&mut self, n: usize) -> Vec<u8> {
        let mut b = vec![0u8; n];
        self.fill(&mut b);
        b
    }

    /// The bytes of a random `dtype` tensor of `shape`; `None` when the rows are not whole blocks.
    pub fn tensor(&mut self, dtype: DType, shape: &[usize]) -> Option<Vec<u8>> {
        let mut data = vec![0u8; dtype.tensor_bytes(shape)?];
        self.fill(&mut data);
        let centred = |b: u8| (b as f32 - 127.5) / 1275.0;
        match dtype {
            DType::F32 => data
                .chunks_exact_mut(4)
                .for_each(|c| c.copy_from_slice(&centred(c[0]).to_le_bytes())),
            DType::F16 => {
                data.chunks_exact_mut(2).for_each(|c| c.copy_from_slice(&f16(centred(c[0]))))
            }
            DType::Bf16 => data.chunks_exact_mut(2).for_each(|c| {
                c.copy_from_slice(&half::bf16::from_f32(centred(c[0])).to_le_bytes())
            }),
            DType::Q8_0 => {
                data.chunks_exact_mut(34).for_each(|b| b[0..2].copy_from_slice(&f16(4e-4)))
            }
            DType::Q4_0 => {
                data.chunks_exact_mut(18).for_each(|b| b[0..2].copy_from_slice(&f16(6e-3)))
            }
            DType::Q2K | DType::Q3K | DType::Q4K | DType::Q5K | DType::Q6K => {
                centre_kquant(dtype, &mut data)
            }
            DType::Q4_1 => data.chunks_exact_mut(20).for_each(|b| {
                b[0..2].copy_from_slice(&f16(6e-3));
                b[2..4].copy_from_slice(&f16(-4.5e-2));
            }),
            // w = d·(q − 16), q in 0..32.
            DType::Q5_0 => {
                data.chunks_exact_mut(22).for_each(|b| b[0..2].copy_from_slice(&f16(3e-3)))
            }
            // w = d·q + m, q in 0..32: m = −15.5·d centres it.
            DType::Q5_1 => data.chunks_exact_mut(24).for_each(|b| {
                b[0..2].copy_from_slice(&f16(3e-3));
                b[2..4].copy_from_slice(&f16(-4.65e-2));
            }),
            // w = d·table[q], the non-linear table spans −127..113.
            DType::Iq4Nl => {
                data.chunks_exact_mut(18).for_each(|b| b[0..2].copy_from_slice(&f16(4e-4)))
            }
            // w = d·(scale − 32)·table[q], 6-bit scales.
            DType::Iq4Xs => {
                data.chunks_exact_mut(136).for_each(|b| b[0..2].copy_from_slice(&f16(1e-5)))
            }
            // w = d·t, t in {−1, 0, 1} (TQ2_0's fourth code, 3, would be 2: masked to 0..2 → 1).
            DType::Tq1_0 => {
                data.chunks_exact_mut(54).for_each(|b| b[52..54].copy_from_slice(&f16(0.03)))
            }
            DType::Tq2_0 => data.chunks_exact_mut(66).for_each(|b| {
                b[..64].iter_mut().for_each(|v| {
                    // Any 2-bit code of 3 becomes 1 (ternary values only).
                    let hi = (*v >> 1) & 0x55 & *v;
                    *v &= !(hi << 1);
                });
                b[64..66].copy_from_slice(&f16(0.03))
            }),
            // e4m3 bytes with the exponent kept below 8 (|q| < 2, never NaN) and a scale of 0.05.
            DType::Fp8E4m3B128 => data.chunks_exact_mut(132).for_each(|b| {
                b[0..4].copy_from_slice(&0.05f32.to_le_bytes());
                b[4..].iter_mut().for_each(|v| *v &= 0xBF);
            }),
            DType::Int8B128 => data
                .chunks_exact_mut(132)
                .for_each(|b| b[0..4].copy_from_slice(&4e-4f32.to_le_bytes())),
            // w = 2^(e − 128)·k, k the doubled e2m1 value (−12..12): e = 121 keeps |w| ≲ 0.1.
            DType::Mxfp4 => data.chunks_exact_mut(17).for_each(|b| b[0] = 121),
            DType::Int4G128 => data.chunks_exact_mut(69).for_each(|b| {
                b[0..4].copy_from_slice(&6e-3f32.to_le_bytes());
                b[4] = 8;
            }),
        }
        Some(data)
    }
}

/// Sets a K-quant tensor's super-block scales so that its random values are centred and small
/// (other types are left as they are).
fn centre_kquant(dtype: DType, data: &mut [u8]) {
    match dtype {
        // w = d·scale·q − dmin·min with q in 0..16: each sub-block's 6-bit min is set equal to its
        // scale and dmin = 7.5·d, so w = d·scale·(q − 7.5), centred. The 12 packed bytes at 4..16
        // hold scales then mins of sub-blocks 0..4 in bytes 0..4 and 4..8 (high bits of 4..8 in
        // the same bytes' top two bits), sub-blocks 4..8 as the nibbles of bytes 8..12: copy 0..4
        // to 4..8, and repeat each low nibble of 8..12 in its high nibble.
        DType::Q4K => data.chunks_exact_mut(144).for_each(|b| {
            b[0..2].copy_from_slice(&f16(2e-4));
            b[2..4].copy_from_slice(&f16(1.5e-3));
            b.copy_within(4..8, 8);
            b[12..16].iter_mut().for_each(|v| *v = (*v & 0x0f) * 0x11);
        }),
        DType::Q6K => {
            data.chunks_exact_mut(210).for_each(|b| b[208..210].copy_from_slice(&f16(2.5e-5)))
        }
        // w = d·scale·q − dmin·min, q in 0..4: each scale byte's min nibble set to its scale
        // nibble and dmin = 1.5·d, so w = d·scale·(q − 1.5).
        DType::Q2K => data.chunks_exact_mut(84).for_each(|b| {
            b[0..16].iter_mut().for_each(|v| *v = (*v & 0x0f) * 0x11);
            b[80..82].copy_from_slice(&f16(2e-3));
            b[82..84].copy_from_slice(&f16(3e-3));
        }),
        // w = d·(scale − 32)·q, q in −4..4, 6-bit scales: centred already.
        DType::Q3K => {
            data.chunks_exact_mut(110).for_each(|b| b[108..110].copy_from_slice(&f16(3e-4)))
        }
        // As Q4_K (mins equal to scales), q in 0..32: dmin = 15.5·d.
        DType::Q5K => data.chunks_exact_mut(176).for_each(|b| {
            b[0..2].copy_from_slice(&f16(1e-4));
            b[2..4].copy_from_slice(&f16(1.55e-3));
            b.copy_within(4..8, 8);
            b[12..16].iter_mut().for_each(|v| *v = (*v & 0x0f) * 0x11);
        }),
        _ => {}
    }
}
