//! Dequantization of the formats pre-quantized checkpoints publish, kept as stored: FP8 e4m3 and
//! INT8 in 128-value runs behind their f32 scale, 4-bit groups of 128 with a zero point (AWQ, GPTQ,
//! compressed-tensors), and llama.cpp's ternary TQ1_0/TQ2_0 (BitNet b1.58). The block layouts are
//! `DType`'s; the importers (`model::prequant`) build them from the published tensors without
//! changing a value, and `tests/prequant.rs` checks these decoders against each format's own
//! library.

use crate::quant::f16_at;

/// Every e4m3 byte's value (`e4m3`), for row decoding by lookup.
pub static E4M3: [f32; 256] = {
    let mut t = [0f32; 256];
    let mut b = 0;
    while b < 256 {
        t[b] = e4m3(b as u8);
        b += 1;
    }
    t
};

pub use layerstream_types::fp8::e4m3;

/// The little-endian f32 at `b[i..i + 4]`.
#[inline(always)]
fn f32_at(b: &[u8], i: usize) -> f32 {
    f32::from_le_bytes([b[i], b[i + 1], b[i + 2], b[i + 3]])
}

/// FP8 e4m3 block (132 bytes → 128 values): f32 scale, then the e4m3 bytes.
#[inline(always)]
pub fn fp8_e4m3(b: &[u8], out: &mut [f32]) {
    let s = f32_at(b, 0);
    for (o, &q) in out[..128].iter_mut().zip(&b[4..132]) {
        *o = E4M3[q as usize] * s;
    }
}

/// INT8 block (132 bytes → 128 values): f32 scale, then signed bytes.
#[inline(always)]
pub fn int8(b: &[u8], out: &mut [f32]) {
    let s = f32_at(b, 0);
    for (o, &q) in out[..128].iter_mut().zip(&b[4..132]) {
        *o = (q as i8) as f32 * s;
    }
}

/// 4-bit group (69 bytes → 128 values): f32 scale, u8 zero point, 64 bytes whose low nibbles are
/// values 0..64 and high nibbles values 64..128; w = (q − zero)·scale.
#[inline(always)]
pub fn int4(b: &[u8], out: &mut [f32]) {
    let (s, z) = (f32_at(b, 0), b[4] as i32);
    let qs: &[u8; 64] = b[5..69].try_into().expect("64 quant bytes");
    let (lo, hi) = out[..128].split_at_mut(64);
    for j in 0..64 {
        lo[j] = ((qs[j] & 0xF) as i32 - z) as f32 * s;
        hi[j] = ((qs[j] >> 4) as i32 - z) as f32 * s;
    }
}

/// One base-3 digit of a TQ1_0 byte: ggml's `((q·3^n mod 256)·3) >> 8`, minus one.
#[inline(always)]
fn trit(q: u8, n: usize) -> f32 {
    const POW3: [u8; 5] = [1, 3, 9, 27, 81];
    let q = q.wrapping_mul(POW3[n]);
    (((q as u16 * 3) >> 8) as i32 - 1) as f32
}

/// TQ1_0 (54 bytes → 256 values): 48 bytes of five trits each (bytes 0..32 then 32..48, digit by
/// digit), 4 bytes of four trits, f16 `d`; in ggml-quants.c's order.
pub fn tq1_0(b: &[u8], out: &mut [f32]) {
    let d = f16_at(b, 52);
    let mut y = 0;
    for (start, len) in [(0, 32), (32, 16)] {
        for n in 0..5 {
            for &q in &b[start..start + len] {
                out[y] = trit(q, n) * d;
                y += 1;
            }
        }
    }
    for n in 0..4 {
        for &q in &b[48..52] {
            out[y] = trit(q, n) * d;
            y += 1;
        }
    }
}

/// TQ2_0 (66 bytes → 256 values): 64 bytes of 2-bit codes (value 128·h + 32·l + m is bits 2l of
/// byte 32·h + m), f16 `d`; w = (code − 1)·d.
pub fn tq2_0(b: &[u8], out: &mut [f32]) {
    let d = f16_at(b, 64);
    for h in 0..2 {
        for l in 0..4 {
            for m in 0..32 {
                let q = (b[32 * h + m] >> (2 * l)) & 3;
                out[128 * h + 32 * l + m] = (q as i32 - 1) as f32 * d;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn e4m3_decodes_every_byte_as_its_definition() {
        assert_eq!(e4m3(0x00), 0.0);
        assert_eq!(e4m3(0x38), 1.0); // exponent 7, mantissa 0
        assert_eq!(e4m3(0x7E), 448.0); // the largest finite value
        assert_eq!(e4m3(0xFE), -448.0);
        assert_eq!(e4m3(0x01), 2f32.powi(-9)); // the smallest subnormal
        assert_eq!(e4m3(0x08), 2f32.powi(-6)); // the smallest normal
        assert!(e4m3(0x7F).is_nan() && e4m3(0xFF).is_nan());
        assert!((0..=255u8).all(|b| E4M3[b as usize].to_bits() == e4m3(b).to_bits()));
        for b in 0..=255u8 {
            let (e, m) = ((b >> 3) & 0xF, b & 7);
            let want = if e == 0 {
                m as f64 / 8.0 * 2f64.powi(-6)
            } else {
                (1.0 + m as f64 / 8.0) * 2f64.powi(e as i32 - 7)
            };
            let want = if b & 0x80 != 0 { -want } else { want };
            if b & 0x7F != 0x7F {
                assert_eq!(e4m3(b) as f64, want, "byte {b:#x}");
            }
        }
    }

    #[test]
    fn ternary_codes_are_minus_one_zero_one() {
        let mut b = [0u8; 66];
        b[0] = 0b10_01_00_10; // codes 2, 0, 1, 2 at l = 0..4 of value m = 0
        b[64..66].copy_from_slice(&half::f16::from_f32(0.5).to_le_bytes());
        let mut out = [9f32; 256];
        tq2_0(&b, &mut out);
        assert_eq!([out[0], out[32], out[64], out[96]], [0.5, -0.5, 0.0, 0.5]);
        // TQ1_0: 3^4·2 + 3^3·1 + 0 + 3·2 + 1 = 196; ggml stores ceil(q·256/243).
        let mut t = [0u8; 54];
        t[0] = ((196u32 * 256).div_ceil(243)) as u8;
        t[52..54].copy_from_slice(&half::f16::from_f32(1.0).to_le_bytes());
        let mut out = [9f32; 256];
        tq1_0(&t, &mut out);
        let digits: Vec<f32> = (0..5).map(|n| out[32 * n]).collect();
        assert_eq!(digits, [1.0, 0.0, -1.0, 1.0, 0.0]);
    }
}
