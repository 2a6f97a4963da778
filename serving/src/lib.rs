//! Serving policy: what the coordinator and the workers decide about requests, apart from the
//! checkpoints, store, tokenizer and templates that `layerstream_model` holds.
//!
//! Generation parameters and their validation (`generation`, `RequestError`), stop criteria
//! (`stop`), constrained decoding (`grammar`, `grammar_limits`), tool calls (`tools`), speculative
//! drafting (`spec`), the paged KV cache's block manager (`kv_blocks`) and the planner (`plan`).

pub mod generation;
pub mod grammar;
pub mod grammar_limits;
pub mod kv_blocks;
pub mod plan;
mod request_error;
pub mod spec;
pub mod stop;
pub mod tools;

pub use generation::{check_chat, check_request, GenerateParams, SamplingParams};
pub use request_error::{Field, RequestError};
pub use stop::{FinishReason, Stopper};
