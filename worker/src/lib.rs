//! The worker: weights on a backend, the decoder-layer forward pass with per-sequence KV caches,
//! sampling and generation (used by `layerstream run`), and the pipeline stage served over gRPC
//! that streams layer groups from the loader daemon while it computes.

pub mod device;
pub mod error;
pub mod experts;
pub mod forward;
pub mod generate;
pub mod handoff;
pub mod model;
pub mod moe;
pub use layerstream_kernels::nucleus;
pub mod prefetch;
pub mod sampling;
pub mod server;
pub mod service;
pub mod stage;
pub mod stream;
mod token_choice;
pub mod weights;
mod wire;

pub use error::{Error, Result};
pub use generate::{generate, Generation, Timings};
pub use layerstream_model::GenerateParams;
pub use model::{Model, SeqState};
pub use sampling::{Sampler, SamplingParams};
