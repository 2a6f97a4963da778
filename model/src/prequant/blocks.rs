//! The stored blocks the pre-quantized layouts are rewritten into (see `DType`): 128 values of one
//! row behind their f32 scale (FP8 e4m3 or int8 bytes copied as they are), or a 4-bit group of 128
//! with its zero point.

/// Values per stored block (every pre-quantized format).
pub const BLOCK: usize = 128;

/// Appends an FP8/INT8 block: the scale, then the 128 stored bytes unchanged.
pub fn push_scaled(out: &mut Vec<u8>, scale: f32, bytes: &[u8]) {
    debug_assert_eq!(bytes.len(), BLOCK);
    out.extend(scale.to_le_bytes());
    out.extend_from_slice(bytes);
}

/// Appends an `int4_g128` block from 128 unsigned 4-bit codes (`q[j] < 16`): w = (q − zero)·scale.
pub fn push_int4(out: &mut Vec<u8>, scale: f32, zero: u8, q: &[u8; BLOCK]) {
    out.extend(scale.to_le_bytes());
    out.push(zero);
    out.extend((0..BLOCK / 2).map(|j| (q[j] & 0xF) | (q[j + BLOCK / 2] << 4)));
}

/// Code `e` (of `bits` ∈ {4, 8}) of a run of 32-bit little-endian words packed densely from the
/// low bits up (compressed-tensors, GPTQ's input packing, GPTQ's zeros).
pub fn code(words: &[u8], e: usize, bits: usize) -> u8 {
    let bit = e * bits;
    let w = bit / 32;
    let word =
        u32::from_le_bytes([words[4 * w], words[4 * w + 1], words[4 * w + 2], words[4 * w + 3]]);
    ((word >> (bit % 32)) & ((1u32 << bits) - 1)) as u8
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn int4_blocks_hold_low_then_high_halves() {
        let mut q = [0u8; BLOCK];
        q.iter_mut().enumerate().for_each(|(j, v)| *v = (j % 16) as u8);
        let mut out = Vec::new();
        push_int4(&mut out, 0.5, 8, &q);
        assert_eq!(out.len(), 69);
        let mut vals = [0f32; BLOCK];
        for j in 0..64 {
            vals[j] = ((out[5 + j] & 0xF) as f32 - 8.0) * 0.5;
            vals[j + 64] = ((out[5 + j] >> 4) as f32 - 8.0) * 0.5;
        }
        for (j, v) in vals.iter().enumerate() {
            assert_eq!(*v, ((j % 16) as f32 - 8.0) * 0.5);
        }
    }

    #[test]
    fn codes_are_read_from_the_low_bits_up() {
        let words = [0x7654_3210u32.to_le_bytes(), 0xFEDC_BA98u32.to_le_bytes()].concat();
        let got: Vec<u8> = (0..16).map(|e| code(&words, e, 4)).collect();
        assert_eq!(got, (0..16).collect::<Vec<u8>>());
        assert_eq!(code(&words, 1, 8), 0x32);
    }
}
