//! Compute kernels behind one `Backend` trait.
//!
//! `cpu` is always built; quantized GGML blocks are dequantized on the fly (`quant`), RoPE tables are
//! computed as transformers does (`rope`), and small host helpers serve sampling (`host`).

mod backend;
pub mod cpu;
pub mod cuda;
pub mod cuda_h2d;
mod error;
pub mod host;
pub mod kv;
pub mod nucleus;
pub mod quant;
pub mod quant_checkpoint;
mod quant_ext;
mod rope;
pub mod sampling;

pub use backend::{AttnShape, Backend, MappedBytes, Precision, RowPick};
pub use cpu::{CpuBackend, CpuTensor, CpuWeight};
pub use error::{Error, Result};
pub use kv::{KvLayout, KvSeq};
pub use rope::RopeTable;
