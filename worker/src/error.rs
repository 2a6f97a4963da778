//! The worker crate's error type.

/// Errors of the forward pass and generation.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error(transparent)]
    Model(#[from] layerstream_model::Error),
    #[error(transparent)]
    Kernel(#[from] layerstream_kernels::Error),
    #[error("store: {0}")]
    Shape(String),
    #[error("request: {0}")]
    Request(String),
}

/// Result alias for the worker crate.
pub type Result<T> = std::result::Result<T, Error>;
