//! The worker: weights on a backend, the decoder-layer forward pass with per-sequence KV caches,
//! sampling and generation (used by `layerstream run`), and the pipeline stage served over gRPC
//! that streams layer groups from the loader daemon while it computes.

mod calibrate;
mod device;
mod draft;
mod error;
pub mod expert_history;
mod experts;
mod forward;
mod generate;
mod handoff;
mod mla;
mod model;
mod moe;
pub use layerstream_kernels::nucleus;
mod prefetch;
mod sampling;
mod server;
mod service;
mod stage;
mod stream;
mod token_choice;
mod verify;
mod weights;
mod wire;

pub use calibrate::{measure as measure_compute, measure_link, ComputeFigures, Probe};
pub use device::Device;
pub use error::{Error, Result};
pub use generate::{generate, Generation, Speculation, Timings};
pub use layerstream_serving::GenerateParams;
pub use model::{KvOptions, Model, SeqState};
pub use sampling::{sample_batch, Sampler, SamplingParams};
pub use server::{int8_by_default, run, ComputeFlags, DeviceFlags, WorkerArgs};
