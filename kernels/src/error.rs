//! The kernels crate's error type.

/// Errors from a backend: bad shapes, unsupported types, device failures.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("shape mismatch in {op}: {msg}")]
    Shape { op: &'static str, msg: String },
    #[error("weight {name}: {msg}")]
    Weight { name: String, msg: String },
    #[error("device: {0}")]
    Device(String),
    /// Logits holding a NaN or an infinity: the arithmetic broke down, no token can be chosen.
    #[error("non-finite logits: {0}")]
    NonFinite(String),
}

/// Result alias for the kernels crate.
pub type Result<T> = std::result::Result<T, Error>;

/// Returns a shape error unless `ok`.
pub fn ensure(ok: bool, op: &'static str, msg: impl FnOnce() -> String) -> Result<()> {
    if ok {
        Ok(())
    } else {
        Err(Error::Shape { op, msg: msg() })
    }
}
