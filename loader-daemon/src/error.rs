//! The loader daemon's error type, and its one mapping to gRPC statuses.

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
    /// No layer or expert by that number in the store.
    #[error("no {0} in the store")]
    NoUnit(String),
    /// A call that does not fit the daemon's state (a unit bigger than a slot, a release of a
    /// unit nobody pinned).
    #[error("{0}")]
    Precondition(String),
    /// A unit file whose bytes fail their checksum: never handed out.
    #[error("{0}")]
    Corrupt(String),
    /// A panic left the slot pool in a state the daemon cannot vouch for.
    #[error("loader daemon: {0}; restart it")]
    Broken(String),
    /// A read that failed, or a task that could not be joined.
    #[error("{0}")]
    Internal(String),
}

/// The one mapping of the loader's errors to gRPC statuses.
impl From<Error> for tonic::Status {
    fn from(e: Error) -> Self {
        use tonic::Status;
        match &e {
            Error::NoUnit(_) => Status::not_found(e.to_string()),
            Error::Precondition(_) => Status::failed_precondition(e.to_string()),
            Error::Corrupt(_) => Status::data_loss(e.to_string()),
            Error::Broken(_) => Status::unavailable(e.to_string()),
            _ => Status::internal(e.to_string()),
        }
    }
}

/// Result alias for the loader crate.
pub type Result<T> = std::result::Result<T, Error>;
