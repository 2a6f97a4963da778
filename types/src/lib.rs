//! The small vocabulary both sides of the compute boundary speak: the stored tensor formats (`DType`),
//! RoPE parameters, the cache directory and valid random blocks of every format. It exists so the
//! kernels need not depend on the model crate (tokenizers, templates, checkpoint readers) and the
//! model crate need not depend on the kernels (gemm, rayon, CUDA).

pub mod cache;
pub mod dtype;
pub mod fp8;
pub mod mem;
pub mod random;
pub mod rope;
pub mod stats;
pub mod sync;

pub use cache::cache_dir;
pub use dtype::DType;
pub use rope::{RopeConfig, RopeScaling};
