//! Checkpoint formats and the layer store.
//!
//! Readers for HF directories (safetensors, config, tokenizer, chat template) and GGUF files feed one
//! importer that writes the per-layer store every other layerstream process reads.

mod config;
pub mod config_mla;
mod error;
pub mod generation;
pub mod gguf;
mod gguf_deepseek;
pub mod gguf_export;
mod gguf_spm;
mod gguf_tokenizer;
pub mod grammar;
pub mod grammar_limits;
mod hf;
mod hf_stacked;
pub mod import;
pub mod kv_blocks;
pub mod layout;
pub mod mla_import;
pub mod plan;
pub mod prequant;
mod request_error;
mod source;
pub mod spec;
pub mod stop;
pub mod store;
pub mod synth;
mod synth_arch;
pub mod template_ext;
pub mod tokenizer;
pub mod tools;

pub use config::{Arch, GroupRouting, ModelConfig, MoeConfig, RopeConfig, RopeScaling};
pub use error::{Error, Result};
pub use generation::{check_chat, check_request, GenerateParams, SamplingParams};
pub use layerstream_types::{dtype, mem, sync, DType};
pub use request_error::{Field, RequestError};
pub use stop::{FinishReason, Stopper};
pub use store::{FileEntry, LoadedFile, Manifest, Store};
pub use tokenizer::{Message, Tokenizer};
