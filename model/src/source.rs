//! What an importer needs from a checkpoint, whatever its format.

use crate::config::ModelConfig;
use crate::dtype::DType;
use crate::error::Result;

impl SourceTensor {
    /// A float tensor (f32, f16, bf16) with `offset` added to every value, as f32.
    pub fn offset(&self, name: &str, offset: f32) -> Result<SourceTensor> {
        use crate::dtype::DType;
        let two = |c: &[u8]| [c[0], c[1]];
        let vals: Vec<f32> = match self.dtype {
            DType::F32 => self
                .data
                .chunks_exact(4)
                .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                .collect(),
            DType::F16 => self
                .data
                .chunks_exact(2)
                .map(|c| half::f16::from_le_bytes(two(c)).to_f32())
                .collect(),
            DType::Bf16 => self
                .data
                .chunks_exact(2)
                .map(|c| half::bf16::from_le_bytes(two(c)).to_f32())
                .collect(),
            other => {
                return Err(crate::Error::tensor(
                    name,
                    format!("a norm stored as {other} (float expected)"),
                ))
            }
        };
        Ok(SourceTensor {
            dtype: DType::F32,
            shape: self.shape.clone(),
            data: vals.iter().flat_map(|v| (v + offset).to_le_bytes()).collect(),
        })
    }
}

/// A tensor read from a checkpoint, row-major, in its stored element type.
#[derive(Debug, Clone)]
pub struct SourceTensor {
    pub dtype: DType,
    pub shape: Vec<usize>,
    pub data: Vec<u8>,
}

/// A checkpoint the importer can read (HF directory or GGUF file).
pub trait Checkpoint {
    /// The model's architecture description.
    fn config(&self) -> &ModelConfig;
    /// A tensor by its name in this format, or `None` if absent.
    fn tensor(&self, name: &str) -> Result<Option<SourceTensor>>;
    /// `tokenizer.json` text.
    fn tokenizer_json(&self) -> Result<String>;
    /// The Jinja chat template, if any.
    fn chat_template(&self) -> Result<Option<String>>;
    /// Picks this format's spelling from an (HF, GGUF) pair of names.
    fn pick_name(&self, hf: &str, gguf: &str) -> String;
    /// Name prefix of layer `i`'s tensors.
    fn layer_prefix(&self, i: usize) -> String;
    /// What to add to every norm weight so a plain RMSNorm computes the model's (Gemma's HF
    /// checkpoints store w for a norm by 1 + w; its GGUFs already hold 1 + w).
    fn norm_offset(&self) -> f32 {
        0.0
    }
    /// A mixture-of-experts layer's router (`[experts, hidden]`), or `None` if absent.
    fn router(&self, layer: usize) -> Result<Option<SourceTensor>>;
    /// A mixture-of-experts layer's router bias (`[experts]`; gpt-oss), or `None` if absent.
    fn router_bias(&self, layer: usize) -> Result<Option<SourceTensor>>;
    /// Expert `expert`'s `gate`, `up` or `down` matrix of layer `layer` (or one of their biases,
    /// `gate_bias` …), or `None` if absent.
    fn expert(&self, layer: usize, expert: usize, which: &str) -> Result<Option<SourceTensor>>;
}
