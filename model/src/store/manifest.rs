//! `manifest.json`: the model config, and per file its size, checksum and tensor directory.

use crate::config::ModelConfig;
use crate::dtype::DType;
use serde::{Deserialize, Serialize};

/// Alignment of every tensor inside a store file, and of file sizes.
pub const ALIGN: u64 = 4096;
/// Name of the manifest inside a store directory.
pub const MANIFEST: &str = "manifest.json";
/// Store format version written by this build.
pub const FORMAT_VERSION: u32 = 1;

/// One tensor inside a store file.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TensorEntry {
    pub name: String,
    pub dtype: DType,
    pub shape: Vec<usize>,
    pub offset: u64,
    pub size: u64,
    pub checksum: String,
}

/// One file of the store.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct FileEntry {
    pub name: String,
    pub size: u64,
    pub checksum: String,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub tensors: Vec<TensorEntry>,
}

impl FileEntry {
    /// A tensor of this file by canonical name.
    pub fn tensor(&self, name: &str) -> Option<&TensorEntry> {
        self.tensors.iter().find(|t| t.name == name)
    }
}

/// The whole store description.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Manifest {
    pub format_version: u32,
    /// What the store was imported from (path and format), for humans.
    pub source: String,
    pub config: ModelConfig,
    pub tokenizer: String,
    pub chat_template: Option<String>,
    pub files: Vec<FileEntry>,
}

impl Manifest {
    /// A file entry by name.
    pub fn file(&self, name: &str) -> Option<&FileEntry> {
        self.files.iter().find(|f| f.name == name)
    }

    /// Size of the largest layer file (the default streaming slot size).
    pub fn max_layer_bytes(&self) -> u64 {
        (0..self.config.num_layers)
            .filter_map(|i| self.file(&crate::layout::layer_file(i)))
            .map(|f| f.size)
            .max()
            .unwrap_or(0)
    }
}
