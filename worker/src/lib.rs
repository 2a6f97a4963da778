//! The worker's compute: weights on a backend, the decoder-layer forward pass with per-sequence KV
//! caches, sampling and generation.

pub mod error;
pub mod forward;
pub mod generate;
pub mod model;
pub mod sampling;
pub mod weights;

pub use error::{Error, Result};
pub use generate::{generate, GenerateParams, Generation, Timings};
pub use model::{Model, SeqState};
pub use sampling::{Sampler, SamplingParams};
