//! Checkpoint formats and the layer store; the tokenizer and chat templates. Serving policy
//! (generation parameters, stop criteria, grammars, tools, drafting, KV blocks, the planner) is in
//! `layerstream_serving`.
//!
//! Readers for HF directories (safetensors, config, tokenizer, chat template) and GGUF files feed one
//! importer that writes the per-layer store every other layerstream process reads.

mod config;
pub mod config_mla;
mod error;
pub mod gguf;
mod gguf_deepseek;
pub mod gguf_export;
mod gguf_spm;
mod gguf_tokenizer;
mod hf;
mod hf_stacked;
pub mod import;
pub mod layout;
pub mod mla_import;
pub mod prequant;
mod source;
pub mod store;
pub mod synth;
mod synth_arch;
pub mod template_ext;
pub mod tokenizer;

pub use config::{Arch, GroupRouting, ModelConfig, MoeConfig, RopeConfig, RopeScaling};
pub use error::{Error, Result};
pub use layerstream_types::{dtype, mem, sync, DType};
pub use store::{FileEntry, LoadedFile, Manifest, Store};
pub use tokenizer::{Message, Tokenizer};
