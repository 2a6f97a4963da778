//! The loader daemon's error type (start-up failures; per-request failures are gRPC statuses).

/// What can stop the loader daemon starting or serving.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error(transparent)]
    Model(#[from] layerstream_model::Error),
    #[error("creating /dev/shm/{name} ({bytes} bytes): {source}")]
    Shm { name: String, bytes: usize, source: std::io::Error },
    #[error("{0}")]
    Config(String),
    #[error("binding {path}: {source}")]
    Bind { path: std::path::PathBuf, source: std::io::Error },
    #[error(transparent)]
    Transport(#[from] tonic::transport::Error),
}

/// Result alias for the loader crate.
pub type Result<T> = std::result::Result<T, Error>;
