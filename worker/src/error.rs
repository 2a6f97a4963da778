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
    #[error("{field}: {msg}")]
    Invalid { field: &'static str, msg: String },
    #[error("KV cache full: {used} + {asked} positions exceed capacity {capacity}")]
    KvFull { used: usize, asked: usize, capacity: usize },
    #[error("device {device}: {msg}")]
    Device { device: String, msg: String },
    #[error("binding {addr}: {source}")]
    Bind { addr: String, source: std::io::Error },
    #[error(transparent)]
    Transport(#[from] tonic::transport::Error),
    #[error(transparent)]
    Io(#[from] std::io::Error),
    #[error("loader daemon {what}: {msg}")]
    Loader { what: String, msg: String },
}

/// Result alias for the worker crate.
pub type Result<T> = std::result::Result<T, Error>;
