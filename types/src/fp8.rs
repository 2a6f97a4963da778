//! The FP8 e4m3 byte's value, shared by the kernels' decoders and the importer (which dequantizes
//! DeepSeek-V3's FP8 `kv_b_proj` to transpose its key blocks).

/// The f32 value of an FP8 e4m3 (`float8_e4m3fn`) byte: 1 sign, 4 exponent (bias 7), 3 mantissa
/// bits, no infinities, 0x7F/0xFF NaN. Exact, by construction of the f32 bits.
#[inline(always)]
pub const fn e4m3(b: u8) -> f32 {
    let sign = ((b as u32) & 0x80) << 24;
    let (e, m) = (((b >> 3) & 0xF) as u32, (b & 7) as u32);
    let mag = if e == 0 {
        // Subnormal: m · 2^−9 (exact: m < 8).
        m as f32 * (1.0 / 512.0)
    } else if e == 15 && m == 7 {
        f32::NAN
    } else {
        f32::from_bits(((e + 120) << 23) | (m << 20))
    };
    f32::from_bits(mag.to_bits() | sign)
}
