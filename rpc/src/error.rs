//! Errors of the RPC plumbing itself, and their one mapping to gRPC statuses: a call refused by
//! the bearer-token check, and the few failures of servers too small for an error type of their
//! own (the test/bench OTLP sink).

/// What the shared RPC code refuses or fails with.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// No token, or the wrong one.
    #[error("{0}")]
    Unauthenticated(String),
    /// A server-side failure the client cannot fix.
    #[error("{0}")]
    Internal(String),
}

impl From<Error> for tonic::Status {
    fn from(e: Error) -> Self {
        match &e {
            Error::Unauthenticated(_) => tonic::Status::unauthenticated(e.to_string()),
            Error::Internal(_) => tonic::Status::internal(e.to_string()),
        }
    }
}
