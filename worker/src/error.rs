//! The worker crate's error type, and its one mapping to gRPC statuses (a bad argument carries its
//! field as a `google.rpc.BadRequest` violation).

use tonic_types::{ErrorDetails, StatusExt};

/// Errors of the forward pass, generation and the worker service.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error(transparent)]
    Model(#[from] layerstream_model::Error),
    #[error(transparent)]
    Kernel(#[from] layerstream_kernels::Error),
    /// The store's weights do not fit the model (a missing, unknown or misshapen tensor).
    #[error("weights: {0}")]
    Weights(String),
    /// An assignment this worker cannot take (a layer range outside the model, none loaded yet).
    #[error("assignment: {0}")]
    Assignment(String),
    /// An assignment larger than this worker's memory budget.
    #[error("{0}")]
    OverBudget(String),
    /// A flag or setting the worker cannot start with.
    #[error("{0}")]
    Config(String),
    /// The loaded stage can no longer be trusted (its copy thread died, a group never arrived, a
    /// slot could not be mapped): the worker drops it and waits to be assigned again.
    #[error("stage: {0}")]
    Stage(String),
    /// A request argument the caller must fix: the field (its protobuf path) and why.
    #[error("{field}: {msg}")]
    Invalid { field: &'static str, msg: String },
    #[error("the KV cache of {positions} positions is full: {wanted} more blocks wanted, {available} free")]
    KvFull { positions: usize, wanted: usize, available: usize },
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
    /// A bug: a step panicked, a blocking task could not be joined, a hand-off failed.
    #[error("{0}")]
    Internal(String),
}

impl Error {
    /// Whether the error is the request's fault (refused before anything changed), so the loaded
    /// stage stays usable; anything else leaves a stage the worker drops.
    pub fn is_request_error(&self) -> bool {
        matches!(self, Error::Invalid { .. } | Error::KvFull { .. } | Error::Assignment(_))
    }

    /// A bad argument: `field` (its protobuf path) is wrong because `msg`.
    pub fn invalid(field: &'static str, msg: impl Into<String>) -> Self {
        Error::Invalid { field, msg: msg.into() }
    }
}

impl From<layerstream_serving::RequestError> for Error {
    fn from(e: layerstream_serving::RequestError) -> Self {
        Error::Invalid { field: e.field().wire_path(), msg: e.reason().to_owned() }
    }
}

/// Result alias for the worker crate.
pub type Result<T> = std::result::Result<T, Error>;

/// The one mapping of the worker's errors to gRPC statuses.
impl From<Error> for tonic::Status {
    fn from(e: Error) -> Self {
        use tonic::Status;
        match &e {
            Error::Invalid { field, msg } => Status::with_error_details(
                tonic::Code::InvalidArgument,
                e.to_string(),
                ErrorDetails::with_bad_request_violation(*field, msg.clone()),
            ),
            Error::KvFull { .. } | Error::OverBudget(_) => {
                Status::resource_exhausted(e.to_string())
            }
            Error::Assignment(_) => Status::failed_precondition(e.to_string()),
            Error::Loader { .. } | Error::Stage(_) => Status::unavailable(e.to_string()),
            Error::Corrupt(_) | Error::Model(layerstream_model::Error::Corrupt { .. }) => {
                Status::data_loss(e.to_string())
            }
            _ => Status::internal(e.to_string()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tonic::Code;

    /// Each kind of failure reaches the coordinator as the status it acts on; a bad argument
    /// names its field in the status details, not only in the text.
    #[test]
    fn errors_map_to_statuses_with_their_field() {
        let s = tonic::Status::from(Error::invalid("seqs.start_pos", "unknown sequence 3"));
        assert_eq!(s.code(), Code::InvalidArgument);
        let v = s.get_details_bad_request().expect("BadRequest").field_violations;
        assert_eq!(
            (v[0].field.as_str(), v[0].description.as_str()),
            ("seqs.start_pos", "unknown sequence 3")
        );
        let from_model = Error::from(layerstream_serving::RequestError::new(
            layerstream_serving::Field::TopP,
            "must be in (0, 1]",
        ));
        assert_eq!(from_model.to_string(), "sampling.top_p: must be in (0, 1]");
        let code = |e: Error| tonic::Status::from(e).code();
        assert_eq!(
            code(Error::KvFull { positions: 32, wanted: 2, available: 1 }),
            Code::ResourceExhausted
        );
        assert_eq!(code(Error::Assignment("none yet".into())), Code::FailedPrecondition);
        assert_eq!(code(Error::Stage("gone".into())), Code::Unavailable);
        assert_eq!(code(Error::Corrupt("xxh3".into())), Code::DataLoss);
        assert_eq!(code(Error::Internal("panic".into())), Code::Internal);
    }
}
