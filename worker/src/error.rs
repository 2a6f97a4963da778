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
    /// The loaded stage can no longer be trusted (its copy thread died, a group never arrived, a
    /// slot could not be mapped): the worker drops it and waits to be assigned again.
    #[error("stage: {0}")]
    Stage(String),
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
    /// Weights whose checksum does not match the manifest (the loader's or our own check).
    #[error("corrupt weights: {0}")]
    Corrupt(String),
}

impl Error {
    /// Whether the error is the request's fault (refused before anything changed), so the loaded
    /// stage stays usable; anything else leaves a stage the worker drops.
    pub fn is_request_error(&self) -> bool {
        matches!(
            self,
            Error::Invalid { .. }
                | Error::KvFull { .. }
                | Error::Request(_)
                | Error::Model(layerstream_model::Error::Request { .. })
        )
    }
}

/// Result alias for the worker crate.
pub type Result<T> = std::result::Result<T, Error>;
