//! Dequantization of the GGML block formats that llama.cpp's other file types use (Q2_K…Q5_K_M,
//! IQ4_XS, MXFP4_MOE, and the fallbacks it picks for rows that are not a multiple of 256): Q5_0,
//! Q5_1, Q2_K, Q3_K, Q5_K, IQ4_NL, IQ4_XS, MXFP4. Written from the formats' definitions (ggml-quants.c's block
//! layouts); `tests/quant_formats.rs` checks every one against gguf-py's reference dequantization
//! of blocks llama.cpp wrote.

use crate::quant::f16_at;

/// MXFP4: the e2m1 values, doubled (ggml's `kvalues_mxfp4`), a 4-bit index selects.
pub const MXFP4_VALUES: [i8; 16] = [0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12];

/// Half the value of an e8m0 scale byte, as ggml's `ggml_e8m0_to_fp32_half`: 2^(e − 128) (the
/// doubling of `MXFP4_VALUES` undone), the two smallest as subnormals.
pub fn e8m0_half(e: u8) -> f32 {
    if e < 2 {
        f32::from_bits(0x0020_0000 << e)
    } else {
        f32::from_bits(((e as u32) - 1) << 23)
    }
}

/// MXFP4 (32 values): the e8m0 scale byte, 16 bytes whose low nibbles are values 0..16 and high
/// nibbles values 16..32; value = e8m0_half(e) · MXFP4_VALUES[nibble].
pub fn mxfp4(b: &[u8], out: &mut [f32]) {
    let d = e8m0_half(b[0]);
    for j in 0..16 {
        out[j] = d * MXFP4_VALUES[(b[1 + j] & 0xF) as usize] as f32;
        out[j + 16] = d * MXFP4_VALUES[(b[1 + j] >> 4) as usize] as f32;
    }
}

/// IQ4_NL / IQ4_XS: the 16 non-linear levels a 4-bit index selects.
pub const IQ4_LEVELS: [i8; 16] =
    [-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113];

/// Q5_0 / Q5_1 (32 values): `d`, [`m`,] 4 bytes of fifth bits, 16 bytes of nibbles; value j is
/// `d·q + m` (Q5_1) or `d·(q − 16)` (Q5_0).
pub fn q5(b: &[u8], with_min: bool, out: &mut [f32]) {
    let d = f16_at(b, 0);
    let (m, hb) = if with_min { (f16_at(b, 2), 4) } else { (0.0, 2) };
    let qh = u32::from_le_bytes([b[hb], b[hb + 1], b[hb + 2], b[hb + 3]]);
    // Fixed-size views: no bounds checks in the loops, so they vectorise.
    let qs: &[u8; 16] = b[hb + 4..hb + 20].try_into().expect("16 quant bytes");
    let (lo, hi) = out[..32].split_at_mut(16);
    let (lo, hi): (&mut [f32; 16], &mut [f32; 16]) =
        (lo.try_into().expect("16"), hi.try_into().expect("16"));
    let mut x = [[0u32; 16]; 2];
    for j in 0..16 {
        x[0][j] = (qs[j] as u32 & 0x0F) | (((qh >> j) & 1) << 4);
        x[1][j] = (qs[j] as u32 >> 4) | (((qh >> (j + 16)) & 1) << 4);
    }
    if with_min {
        for j in 0..16 {
            lo[j] = d * x[0][j] as f32 + m;
            hi[j] = d * x[1][j] as f32 + m;
        }
    } else {
        for j in 0..16 {
            lo[j] = d * (x[0][j] as i32 - 16) as f32;
            hi[j] = d * (x[1][j] as i32 - 16) as f32;
        }
    }
}

/// Q2_K (256 values): 16 scale bytes (scale nibble, min nibble), 64 bytes of 2-bit values, `d`,
/// `dmin`; value = `d·scale·q − dmin·min` per 16-value sub-block.
pub fn q2_k(b: &[u8], out: &mut [f32]) {
    let (scales, qs) = (&b[0..16], &b[16..80]);
    let (d, dmin) = (f16_at(b, 80), f16_at(b, 82));
    let mut is = 0;
    let mut y = 0;
    for half in 0..2 {
        let q = &qs[32 * half..32 * half + 32];
        for shift in [0, 2, 4, 6] {
            for part in 0..2 {
                let sc = scales[is];
                is += 1;
                let (dl, ml) = (d * (sc & 0xF) as f32, dmin * (sc >> 4) as f32);
                for &v in &q[16 * part..16 * part + 16] {
                    out[y] = dl * ((v >> shift) & 3) as f32 - ml;
                    y += 1;
                }
            }
        }
    }
}

/// Q3_K (256 values): 32 bytes of high bits, 64 bytes of 2-bit values, 12 bytes of packed 6-bit
/// scales, `d`; value = `d·(scale − 32)·(q − (high bit ? 0 : 4))` per 16-value sub-block.
pub fn q3_k(b: &[u8], out: &mut [f32]) {
    let (hm, qs) = (&b[0..32], &b[32..96]);
    let d = f16_at(b, 108);
    let scales = q3k_scales(&b[96..108]);
    let mut is = 0;
    let mut y = 0;
    let mut m = 1u8;
    for half in 0..2 {
        let q = &qs[32 * half..32 * half + 32];
        for shift in [0, 2, 4, 6] {
            for part in 0..2 {
                let dl = d * scales[is] as f32;
                is += 1;
                for l in 16 * part..16 * part + 16 {
                    let v = ((q[l] >> shift) & 3) as i32 - if hm[l] & m != 0 { 0 } else { 4 };
                    out[y] = dl * v as f32;
                    y += 1;
                }
            }
            m <<= 1;
        }
    }
}

/// Q3_K's 16 six-bit scales, offset removed (−32..31), from its 12 packed bytes: low nibbles in
/// bytes 0..8, high two bits in 8..12.
pub fn q3k_scales(packed: &[u8]) -> [i32; 16] {
    let mut scales = [0i32; 16];
    for (i, s) in scales.iter_mut().enumerate() {
        let low = if i < 8 { packed[i] & 0xF } else { packed[i - 8] >> 4 };
        let high = (packed[8 + i % 4] >> (2 * (i / 4))) & 3;
        *s = (low | (high << 4)) as i32 - 32;
    }
    scales
}

/// The 6-bit scale and min of sub-block `j` of the K formats' 12 packed bytes.
pub fn scale_min_k4(j: usize, s: &[u8]) -> (f32, f32) {
    if j < 4 {
        ((s[j] & 63) as f32, (s[j + 4] & 63) as f32)
    } else {
        (
            ((s[j + 4] & 0xF) | ((s[j - 4] >> 6) << 4)) as f32,
            ((s[j + 4] >> 4) | ((s[j] >> 6) << 4)) as f32,
        )
    }
}

/// All eight sub-blocks' 6-bit scales and mins of the K formats' 12 packed bytes at once: byte j
/// of the first word is `scale_min_k4(j)`'s scale, of the second its min (four sub-blocks a
/// 32-bit word, so a kernel widens them into a vector with no store and reload of eight values).
#[inline(always)]
pub fn scales_mins_k4(s: &[u8]) -> (u64, u64) {
    let word = |i: usize| u32::from_le_bytes([s[i], s[i + 1], s[i + 2], s[i + 3]]);
    let (a, b, c) = (word(0), word(4), word(8));
    let (six, four, two) = (0x3f3f_3f3f, 0x0f0f_0f0f, 0x0303_0303);
    // Sub-blocks 0-3 keep their byte's low six bits; 4-7 take four bits from bytes 8-11 and the
    // two top bits of bytes 0-3 (scales) or 4-7 (mins) above them.
    let (sc_lo, mn_lo) = (a & six, b & six);
    let sc_hi = (c & four) | ((a >> 6) & two) << 4;
    let mn_hi = ((c >> 4) & four) | ((b >> 6) & two) << 4;
    (sc_lo as u64 | (sc_hi as u64) << 32, mn_lo as u64 | (mn_hi as u64) << 32)
}

/// Q4_K (144 bytes) and Q5_K (176) of 256 values: `d`, `dmin`, 12 bytes of packed scales and
/// mins, [Q5_K: 32 bytes of fifth bits,] 128 bytes of nibbles; value = `d·scale·q − dmin·min` per
/// 32-value sub-block.
pub fn q4_q5_k(b: &[u8], fifth_bits: bool, out: &mut [f32]) {
    let (d, dmin) = (f16_at(b, 0), f16_at(b, 2));
    let scales = &b[4..16];
    let (qh, qs) = if fifth_bits { (&b[16..48], &b[48..176]) } else { (&b[0..0], &b[16..144]) };
    for j in 0..4 {
        let (sc1, m1) = scale_min_k4(2 * j, scales);
        let (sc2, m2) = scale_min_k4(2 * j + 1, scales);
        let (d1, m1, d2, m2) = (d * sc1, dmin * m1, d * sc2, dmin * m2);
        // Fixed-size views: no bounds checks in the loops, so they vectorise.
        let ql: &[u8; 32] = qs[32 * j..32 * j + 32].try_into().expect("32 quant bytes");
        let o: &mut [f32; 64] = (&mut out[64 * j..64 * j + 64]).try_into().expect("64 values");
        let (mut lo, mut hi) = ([0u8; 32], [0u8; 32]);
        for l in 0..32 {
            lo[l] = ql[l] & 0xF;
            hi[l] = ql[l] >> 4;
        }
        if fifth_bits {
            let qh: &[u8; 32] = qh.try_into().expect("32 fifth-bit bytes");
            for l in 0..32 {
                lo[l] += ((qh[l] >> (2 * j)) & 1) << 4;
                hi[l] += ((qh[l] >> (2 * j + 1)) & 1) << 4;
            }
        }
        for l in 0..32 {
            o[l] = d1 * lo[l] as f32 - m1;
            o[l + 32] = d2 * hi[l] as f32 - m2;
        }
    }
}

/// IQ4_NL (32 values): `d`, 16 bytes of 4-bit level indices; value = `d·level`.
pub fn iq4_nl(b: &[u8], out: &mut [f32]) {
    let d = f16_at(b, 0);
    let qs: &[u8; 16] = b[2..18].try_into().expect("16 index bytes");
    iq4_32(d, qs, (&mut out[..32]).try_into().expect("32 values"));
}

/// 32 values `d·level` from 16 bytes of level indices (low nibbles first, then high).
fn iq4_32(d: f32, qs: &[u8; 16], out: &mut [f32; 32]) {
    let levels = IQ4_LEVELS.map(|v| v as f32);
    for j in 0..16 {
        out[j] = d * levels[(qs[j] & 0xF) as usize];
        out[j + 16] = d * levels[(qs[j] >> 4) as usize];
    }
}

/// IQ4_XS (256 values): `d`, 2 bytes of scales' high bits, 4 bytes of their low nibbles, 128 bytes
/// of level indices; value = `d·(scale − 32)·level` per 32-value sub-block.
pub fn iq4_xs(b: &[u8], out: &mut [f32]) {
    let d = f16_at(b, 0);
    let sh = u16::from_le_bytes([b[2], b[3]]);
    let (sl, qs) = (&b[4..8], &b[8..136]);
    for ib in 0..8 {
        let ls =
            ((sl[ib / 2] >> (4 * (ib % 2))) & 0xF) as i32 | ((((sh >> (2 * ib)) & 3) as i32) << 4);
        let dl = d * (ls - 32) as f32;
        let q: &[u8; 16] = qs[16 * ib..16 * ib + 16].try_into().expect("16 index bytes");
        iq4_32(dl, q, (&mut out[32 * ib..32 * ib + 32]).try_into().expect("32 values"));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The eight scales and mins at once are `scale_min_k4`'s, byte for byte, for every bit of
    /// the packed bytes (random bytes, each bit set and cleared in turn).
    #[test]
    fn scales_and_mins_at_once_match_one_by_one() {
        let mut rng = layerstream_types::random::Rng::new(5);
        for case in 0..2000 {
            let mut s: [u8; 12] = rng.bytes(12).try_into().unwrap();
            if case < 96 {
                s = [0; 12];
                s[case / 8] = 1 << (case % 8);
            }
            let (sc, mn) = scales_mins_k4(&s);
            for j in 0..8 {
                let (a, b) = scale_min_k4(j, &s);
                assert_eq!(((sc >> (8 * j)) & 0xFF) as f32, a, "scale {j} of {s:?}");
                assert_eq!(((mn >> (8 * j)) & 0xFF) as f32, b, "min {j} of {s:?}");
            }
        }
    }
}
