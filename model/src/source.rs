//! What an importer needs from a checkpoint, whatever its format.

use crate::config::ModelConfig;
use crate::dtype::DType;
use crate::error::Result;

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
}
