//! Element and block formats of stored weights: plain floats and the GGML quantized blocks.
//!
//! Quantized tensors are kept exactly as their checkpoint stored them, so the bytes streamed to a
//! device are the bytes on disk; this module only knows their geometry.

use serde::{Deserialize, Serialize};

/// A stored tensor's element type.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum DType {
    F32,
    F16,
    Bf16,
    Q8_0,
    Q4_0,
    Q4_1,
    #[serde(rename = "q4_k")]
    Q4K,
    #[serde(rename = "q6_k")]
    Q6K,
    Q5_0,
    Q5_1,
    #[serde(rename = "q2_k")]
    Q2K,
    #[serde(rename = "q3_k")]
    Q3K,
    #[serde(rename = "q5_k")]
    Q5K,
    #[serde(rename = "iq4_nl")]
    Iq4Nl,
    #[serde(rename = "iq4_xs")]
    Iq4Xs,
    /// llama.cpp's ternary types (BitNet b1.58 weights): 256 values in {−1, 0, 1} times an f16 scale,
    /// five per byte in base 3 (TQ1_0, 1.69 bits) or four per byte in two bits (TQ2_0, 2.06 bits).
    #[serde(rename = "tq1_0")]
    Tq1_0,
    #[serde(rename = "tq2_0")]
    Tq2_0,
    /// Pre-quantized checkpoints' FP8 (e4m3) weights as published, 128 values of a row behind the
    /// f32 scale that covers them (block-wise 128×128, per-channel or per-tensor scales): 8.25 bits.
    #[serde(rename = "fp8_e4m3_b128")]
    Fp8E4m3B128,
    /// INT8 weights (compressed-tensors w8a8/w8a16, symmetric): an f32 scale, 128 signed bytes.
    #[serde(rename = "int8_b128")]
    Int8B128,
    /// 4-bit weights in groups of 128 (AWQ, GPTQ, compressed-tensors pack-quantized): an f32 scale,
    /// a u8 zero point, 64 bytes of nibbles (value j low, j + 64 high); w = (q − zero)·scale.
    #[serde(rename = "int4_g128")]
    Int4G128,
    /// OCP microscaling FP4 as GGML stores it (gpt-oss's experts): 32 e2m1 values behind one e8m0
    /// scale byte (4.25 bits).
    #[serde(rename = "mxfp4")]
    Mxfp4,
}

/// The dtypes a KV cache can store keys and values in.
pub const KV_DTYPES: [DType; 5] = [DType::F32, DType::F16, DType::Bf16, DType::Q8_0, DType::Q4_0];

/// Parses a `--kv-dtype` value (`f32|f16|bf16|q8_0|q4_0`).
pub fn parse_kv_dtype(s: &str) -> Result<DType, String> {
    KV_DTYPES.iter().copied().find(|d| d.name() == s).ok_or_else(|| {
        let names: Vec<&str> = KV_DTYPES.iter().map(|d| d.name()).collect();
        format!("unknown KV dtype {s:?}: expected one of {}", names.join(", "))
    })
}

impl DType {
    /// Elements per block (1 for plain floats).
    pub fn block_elems(self) -> usize {
        match self {
            DType::F32 | DType::F16 | DType::Bf16 => 1,
            DType::Q8_0
            | DType::Q4_0
            | DType::Q4_1
            | DType::Q5_0
            | DType::Q5_1
            | DType::Iq4Nl
            | DType::Mxfp4 => 32,
            DType::Q4K
            | DType::Q6K
            | DType::Q2K
            | DType::Q3K
            | DType::Q5K
            | DType::Iq4Xs
            | DType::Tq1_0
            | DType::Tq2_0 => 256,
            DType::Fp8E4m3B128 | DType::Int8B128 | DType::Int4G128 => 128,
        }
    }

    /// Bytes per block.
    pub fn block_bytes(self) -> usize {
        match self {
            DType::F32 => 4,
            DType::F16 | DType::Bf16 => 2,
            DType::Q8_0 => 34,
            DType::Q4_0 => 18,
            DType::Q4_1 => 20,
            DType::Q4K => 144,
            DType::Q6K => 210,
            DType::Q5_0 => 22,
            DType::Q5_1 => 24,
            DType::Q2K => 84,
            DType::Q3K => 110,
            DType::Q5K => 176,
            DType::Iq4Nl => 18,
            DType::Iq4Xs => 136,
            DType::Tq1_0 => 54,
            DType::Tq2_0 => 66,
            DType::Fp8E4m3B128 | DType::Int8B128 => 132,
            DType::Int4G128 => 69,
            DType::Mxfp4 => 17,
        }
    }

    /// Bytes of one row of `cols` elements; `None` when `cols` is not a whole number of blocks (or
    /// the count overflows).
    pub fn row_bytes(self, cols: usize) -> Option<usize> {
        if !cols.is_multiple_of(self.block_elems()) {
            return None;
        }
        (cols / self.block_elems()).checked_mul(self.block_bytes())
    }

    /// Bytes of a tensor of `shape` (row-major, blocks along the last dimension); `None` for an empty
    /// shape, a partial block, or a size that overflows (shapes come from files: never trusted).
    pub fn tensor_bytes(self, shape: &[usize]) -> Option<usize> {
        let cols = *shape.last()?;
        let rows = shape[..shape.len() - 1].iter().try_fold(1usize, |a, &d| a.checked_mul(d))?;
        self.row_bytes(cols)?.checked_mul(rows)
    }

    /// True for the GGML block formats.
    pub fn is_quantized(self) -> bool {
        self.block_elems() > 1
    }

    /// The lowercase name used in manifests and messages.
    pub fn name(self) -> &'static str {
        match self {
            DType::F32 => "f32",
            DType::F16 => "f16",
            DType::Bf16 => "bf16",
            DType::Q8_0 => "q8_0",
            DType::Q4_0 => "q4_0",
            DType::Q4_1 => "q4_1",
            DType::Q4K => "q4_k",
            DType::Q6K => "q6_k",
            DType::Q5_0 => "q5_0",
            DType::Q5_1 => "q5_1",
            DType::Q2K => "q2_k",
            DType::Q3K => "q3_k",
            DType::Q5K => "q5_k",
            DType::Iq4Nl => "iq4_nl",
            DType::Iq4Xs => "iq4_xs",
            DType::Tq1_0 => "tq1_0",
            DType::Tq2_0 => "tq2_0",
            DType::Fp8E4m3B128 => "fp8_e4m3_b128",
            DType::Int8B128 => "int8_b128",
            DType::Int4G128 => "int4_g128",
            DType::Mxfp4 => "mxfp4",
        }
    }

    /// Every stored format.
    pub const ALL: [DType; 21] = [
        DType::F32,
        DType::F16,
        DType::Bf16,
        DType::Q8_0,
        DType::Q4_0,
        DType::Q4_1,
        DType::Q4K,
        DType::Q6K,
        DType::Q5_0,
        DType::Q5_1,
        DType::Q2K,
        DType::Q3K,
        DType::Q5K,
        DType::Iq4Nl,
        DType::Iq4Xs,
        DType::Tq1_0,
        DType::Tq2_0,
        DType::Fp8E4m3B128,
        DType::Int8B128,
        DType::Int4G128,
        DType::Mxfp4,
    ];

    /// The GGML type code GGUF files use for this format; `None` for the pre-quantized
    /// checkpoints' formats, which GGUF has no type for.
    pub fn ggml_type(self) -> Option<u32> {
        Some(match self {
            DType::F32 => 0,
            DType::F16 => 1,
            DType::Q4_0 => 2,
            DType::Q4_1 => 3,
            DType::Q5_0 => 6,
            DType::Q5_1 => 7,
            DType::Q8_0 => 8,
            DType::Q2K => 10,
            DType::Q3K => 11,
            DType::Q4K => 12,
            DType::Q5K => 13,
            DType::Q6K => 14,
            DType::Iq4Nl => 20,
            DType::Iq4Xs => 23,
            DType::Bf16 => 30,
            DType::Tq1_0 => 34,
            DType::Tq2_0 => 35,
            DType::Mxfp4 => 39,
            DType::Fp8E4m3B128 | DType::Int8B128 | DType::Int4G128 => return None,
        })
    }

    /// The format of GGML type `code`, if stored here.
    pub fn from_ggml_type(code: u32) -> Option<DType> {
        DType::ALL.into_iter().find(|d| d.ggml_type() == Some(code))
    }
}

impl std::fmt::Display for DType {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn row_bytes_requires_whole_blocks() {
        assert_eq!(DType::Q4_1.row_bytes(576), Some(18 * 20));
        assert_eq!(DType::Q4K.row_bytes(576), None);
        assert_eq!(DType::Q6K.tensor_bytes(&[2, 512]), Some(2 * 2 * 210));
        assert_eq!(DType::Bf16.tensor_bytes(&[3, 5]), Some(30));
    }

    #[test]
    fn serde_names_match_display() {
        for d in DType::ALL {
            let s = serde_json::to_string(&d).unwrap();
            assert_eq!(s, format!("\"{}\"", d.name()));
        }
    }
}
