//! The coordinator's error type, mapped once to gRPC status codes at the service edge.

/// What can stop the coordinator starting or fail a step.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("planning failed: {0}")]
    Plan(String),
    #[error("worker {worker}: {msg}")]
    Worker { worker: String, msg: String },
    /// A worker refused weights that fail their checksum: not recoverable by replaying.
    #[error("worker {worker}: {msg}")]
    Corrupt { worker: String, msg: String },
    #[error("worker {worker} did not answer a step within {timeout:?}")]
    StepTimeout { worker: String, timeout: std::time::Duration },
    #[error("{0}")]
    Setup(String),
    #[error("binding {addr}: {source}")]
    Bind { addr: String, source: std::io::Error },
    #[error(transparent)]
    Model(#[from] layerstream_model::Error),
    #[error(transparent)]
    Transport(#[from] tonic::transport::Error),
    #[error(transparent)]
    Io(#[from] std::io::Error),
}

impl Error {
    /// Whether replaying the step cannot help (the same bytes would be read again).
    pub fn is_permanent(&self) -> bool {
        matches!(self, Error::Corrupt { .. })
    }
}

/// Result alias for the coordinator crate.
pub type Result<T> = std::result::Result<T, Error>;

impl From<Error> for tonic::Status {
    fn from(e: Error) -> Self {
        match &e {
            Error::Model(layerstream_model::Error::Request { .. }) => {
                tonic::Status::invalid_argument(e.to_string())
            }
            Error::Model(
                layerstream_model::Error::Tokenizer(_) | layerstream_model::Error::Template(_),
            ) => tonic::Status::invalid_argument(e.to_string()),
            Error::StepTimeout { .. } => tonic::Status::deadline_exceeded(e.to_string()),
            Error::Worker { .. } | Error::Transport(_) => tonic::Status::unavailable(e.to_string()),
            Error::Corrupt { .. } => tonic::Status::data_loss(e.to_string()),
            _ => tonic::Status::internal(e.to_string()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tonic::Code;

    /// Each kind of failure reaches a client as the status code it can act on.
    #[test]
    fn errors_map_to_the_status_a_client_can_act_on() {
        let code = |e: Error| tonic::Status::from(e).code();
        let bad = layerstream_model::Error::Request {
            field: "top_p".into(),
            msg: "must be in (0, 1]".into(),
        };
        assert_eq!(code(bad.into()), Code::InvalidArgument);
        assert_eq!(
            code(layerstream_model::Error::Template("no template".into()).into()),
            Code::InvalidArgument
        );
        let timeout =
            Error::StepTimeout { worker: "w".into(), timeout: std::time::Duration::from_secs(1) };
        assert_eq!(code(timeout), Code::DeadlineExceeded);
        assert_eq!(
            code(Error::Worker { worker: "w".into(), msg: "gone".into() }),
            Code::Unavailable
        );
        assert_eq!(code(Error::Plan("no fit".into())), Code::Internal);
    }
}
