//! Writes store files: tensors padded to 4 KiB offsets, checksums recorded as they are written.

use super::{checksum, FileEntry, Manifest, TensorEntry, ALIGN, FORMAT_VERSION, MANIFEST};
use crate::config::ModelConfig;
use crate::error::{Error, Result};
use crate::source::SourceTensor;
use std::path::{Path, PathBuf};

/// Accumulates files into a store directory; `finish` writes the manifest last.
pub struct StoreWriter {
    dir: PathBuf,
    files: Vec<FileEntry>,
}

fn pad_to(buf: &mut Vec<u8>, align: u64) {
    let len = buf.len() as u64;
    buf.resize(len.div_ceil(align).saturating_mul(align) as usize, 0);
}

impl StoreWriter {
    /// Starts writing into `dir` (which must exist and be empty).
    pub fn new(dir: &Path) -> Self {
        StoreWriter { dir: dir.into(), files: Vec::new() }
    }

    fn write(&self, name: &str, bytes: &[u8]) -> Result<()> {
        let p = self.dir.join(name);
        std::fs::write(&p, bytes).map_err(|e| Error::io(p, e))
    }

    /// Writes one file of tensors, each at a 4 KiB-aligned offset.
    pub fn write_tensors(
        &mut self,
        name: &str,
        tensors: Vec<(String, SourceTensor)>,
    ) -> Result<()> {
        let mut buf = Vec::new();
        let mut entries = Vec::with_capacity(tensors.len());
        for (tname, t) in tensors {
            let offset = buf.len() as u64;
            entries.push(TensorEntry {
                name: tname,
                dtype: t.dtype,
                shape: t.shape,
                offset,
                size: t.data.len() as u64,
                checksum: checksum(&t.data),
            });
            buf.extend_from_slice(&t.data);
            pad_to(&mut buf, ALIGN);
        }
        self.write(name, &buf)?;
        self.files.push(FileEntry {
            name: name.into(),
            size: buf.len() as u64,
            checksum: checksum(&buf),
            tensors: entries,
        });
        Ok(())
    }

    /// Writes a non-tensor file (tokenizer, chat template).
    pub fn write_aux(&mut self, name: &str, bytes: &[u8]) -> Result<()> {
        self.write(name, bytes)?;
        self.files.push(FileEntry {
            name: name.into(),
            size: bytes.len() as u64,
            checksum: checksum(bytes),
            tensors: vec![],
        });
        Ok(())
    }

    /// Writes `manifest.json` and returns it.
    pub fn finish(
        self,
        config: ModelConfig,
        source: String,
        tokenizer: &str,
        chat_template: Option<&str>,
    ) -> Result<Manifest> {
        let manifest = Manifest {
            format_version: FORMAT_VERSION,
            source,
            config,
            tokenizer: tokenizer.into(),
            chat_template: chat_template.map(str::to_owned),
            files: self.files,
        };
        let json = serde_json::to_vec_pretty(&manifest).expect("manifest serializes");
        let p = self.dir.join(MANIFEST);
        std::fs::write(&p, json).map_err(|e| Error::io(p, e))?;
        Ok(manifest)
    }
}
