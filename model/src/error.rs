//! The model crate's error type: every message names the file, tensor, offset or field at fault.

use std::path::PathBuf;

/// Everything that can go wrong reading checkpoints or the layer store.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("{path}: {source}")]
    Io { path: PathBuf, source: std::io::Error },
    #[error("{path}: invalid JSON: {source}")]
    Json { path: PathBuf, source: serde_json::Error },
    #[error("{path}: {msg}")]
    Format { path: PathBuf, msg: String },
    #[error("unsupported architecture {got:?}; supported: {supported}")]
    UnsupportedArch { got: String, supported: String },
    #[error("config field {field}: {msg}")]
    Config { field: String, msg: String },
    #[error("tensor {name}: {msg}")]
    Tensor { name: String, msg: String },
    #[error("{path}: corrupt at offset {offset}: {msg}")]
    Corrupt { path: PathBuf, offset: u64, msg: String },
    #[error("tokenizer: {0}")]
    Tokenizer(String),
    #[error("chat template: {0}")]
    Template(String),
    /// A rendering that went past its `RenderBudget` (output bytes or steps).
    #[error("chat template: {0}")]
    TemplateBudget(String),
    #[error("default model: {0}")]
    Fetch(String),
    /// A draft model that cannot draft for the target (another vocabulary, not smaller).
    #[error("draft model: {0}")]
    Draft(String),
}

/// Result alias for the model crate.
pub type Result<T> = std::result::Result<T, Error>;

impl Error {
    /// Wraps an I/O error with the path it happened on.
    pub fn io(path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        Error::Io { path: path.into(), source }
    }
    /// A malformed-file error for `path`.
    pub fn format(path: impl Into<PathBuf>, msg: impl Into<String>) -> Self {
        Error::Format { path: path.into(), msg: msg.into() }
    }
    /// A problem with one tensor.
    pub fn tensor(name: impl Into<String>, msg: impl Into<String>) -> Self {
        Error::Tensor { name: name.into(), msg: msg.into() }
    }
    /// A missing or invalid config field.
    pub fn config(field: impl Into<String>, msg: impl Into<String>) -> Self {
        Error::Config { field: field.into(), msg: msg.into() }
    }
}

/// Reads a whole regular file, naming it on failure (a FIFO or device would block or never end).
pub fn read_file(path: &std::path::Path) -> Result<Vec<u8>> {
    regular(path)?;
    std::fs::read(path).map_err(|e| Error::io(path, e))
}

/// Whether `name` is a plain file name: one path component, not `.`/`..`, no separators or NUL
/// (names a manifest or a `weight_map` gives must stay inside their directory).
pub fn is_plain_file_name(name: &str) -> bool {
    !name.is_empty() && name != "." && name != ".." && !name.contains(['/', '\\', '\0'])
}

/// Refuses anything but a regular file (following symlinks), before it is opened.
pub fn regular(path: &std::path::Path) -> Result<()> {
    let meta = std::fs::metadata(path).map_err(|e| Error::io(path, e))?;
    if !meta.is_file() {
        return Err(Error::format(path, "not a regular file"));
    }
    Ok(())
}

/// Reads and parses a JSON file, naming it on failure.
pub fn read_json<T: serde::de::DeserializeOwned>(path: &std::path::Path) -> Result<T> {
    let bytes = read_file(path)?;
    serde_json::from_slice(&bytes).map_err(|source| Error::Json { path: path.into(), source })
}
