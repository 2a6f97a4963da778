//! The coordinator's error type, mapped once to gRPC statuses here (a refused request carries its
//! field as a `google.rpc.BadRequest` violation) and once to OpenAI errors in `http::error`.

use layerstream_serving::RequestError;
use tonic_types::{ErrorDetails, StatusExt};

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
    /// A request a client must fix.
    #[error(transparent)]
    Request(#[from] RequestError),
    /// The queue is full: retry later.
    #[error("{0}")]
    Busy(String),
    /// No job by that id (never made, or forgotten).
    #[error("no job {0}")]
    NoJob(String),
    /// The stack cannot take this now (its journal cannot be written, say): retry later.
    #[error("{0}")]
    Unavailable(String),
    /// A job's request ended in error after it was queued.
    #[error("{0}")]
    Aborted(String),
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

    /// The same error about a job's only request (a door that takes one request per call).
    pub fn single(self) -> Self {
        match self {
            Error::Request(r) => Error::Request(r.single()),
            other => other,
        }
    }

    /// The `reason` label of `layerstream_requests_rejected_total` for a refused request.
    pub fn reject_reason(&self) -> &'static str {
        match self {
            Error::Busy(_) => "resource_exhausted",
            Error::Request(_) => "invalid_argument",
            _ => "unavailable",
        }
    }
}

/// Result alias for the coordinator crate.
pub type Result<T> = std::result::Result<T, Error>;

impl From<Error> for tonic::Status {
    fn from(e: Error) -> Self {
        match &e {
            Error::Request(r) => tonic::Status::with_error_details(
                tonic::Code::InvalidArgument,
                r.to_string(),
                ErrorDetails::with_bad_request_violation(r.field_path(), r.describe()),
            ),
            Error::Busy(_) => tonic::Status::resource_exhausted(e.to_string()),
            Error::NoJob(_) => tonic::Status::not_found(e.to_string()),
            Error::Aborted(_) => tonic::Status::aborted(e.to_string()),
            Error::StepTimeout { .. } => tonic::Status::deadline_exceeded(e.to_string()),
            Error::Worker { .. } | Error::Transport(_) | Error::Unavailable(_) => {
                tonic::Status::unavailable(e.to_string())
            }
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
        let bad = RequestError::new(layerstream_serving::Field::TopP, "must be in (0, 1]");
        let status = tonic::Status::from(Error::from(bad.in_request(1)));
        assert_eq!(status.code(), Code::InvalidArgument);
        assert_eq!(status.message(), "request 1: top_p: must be in (0, 1]");
        let v = &status.get_details_bad_request().expect("a BadRequest detail").field_violations;
        assert_eq!(v.len(), 1);
        assert_eq!(v[0].field, "requests[1].sampling.top_p");
        assert_eq!(v[0].description, "top_p: must be in (0, 1]");
        assert_eq!(code(Error::Busy("full".into())), Code::ResourceExhausted);
        assert_eq!(code(Error::NoJob("job-1".into())), Code::NotFound);
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
