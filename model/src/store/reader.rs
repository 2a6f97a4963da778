//! Opens a store (sizes always checked), verifies checksums, and reads files and tensors.

use super::{checksum, FileEntry, Manifest, TensorEntry, FORMAT_VERSION, MANIFEST};
use crate::error::{read_json, Error, Result};
use crate::tokenizer::Tokenizer;
use std::path::{Path, PathBuf};

/// An opened layer store.
#[derive(Debug, Clone)]
pub struct Store {
    pub dir: PathBuf,
    pub manifest: Manifest,
}

/// A store file read into memory, with its tensor directory.
#[derive(Debug, Clone)]
pub struct LoadedFile {
    pub entry: FileEntry,
    pub bytes: Vec<u8>,
}

impl LoadedFile {
    /// The bytes and description of a tensor, or `None` if the file lacks it.
    pub fn tensor(&self, name: &str) -> Option<(&TensorEntry, &[u8])> {
        let t = self.entry.tensor(name)?;
        Some((t, &self.bytes[t.offset as usize..(t.offset + t.size) as usize]))
    }
}

impl Store {
    /// Opens `dir`: parses the manifest and checks every file exists with its recorded size.
    pub fn open(dir: &Path) -> Result<Store> {
        let mpath = dir.join(MANIFEST);
        if !mpath.exists() {
            return Err(Error::format(
                dir,
                "not a layer store (no manifest.json); create one with `layerstream import`",
            ));
        }
        let manifest: Manifest = read_json(&mpath)?;
        if manifest.format_version != FORMAT_VERSION {
            return Err(Error::format(
                &mpath,
                format!(
                    "store format {} unsupported (this build reads {FORMAT_VERSION})",
                    manifest.format_version
                ),
            ));
        }
        manifest.config.validate()?;
        for f in &manifest.files {
            let p = dir.join(&f.name);
            let meta = std::fs::metadata(&p).map_err(|e| Error::io(&p, e))?;
            if meta.len() != f.size {
                return Err(Error::Corrupt {
                    path: p,
                    offset: meta.len().min(f.size),
                    msg: format!(
                        "size {} but the manifest says {} ({})",
                        meta.len(),
                        f.size,
                        if meta.len() < f.size { "truncated" } else { "trailing bytes" }
                    ),
                });
            }
            for t in &f.tensors {
                if t.offset + t.size > f.size
                    || t.dtype.tensor_bytes(&t.shape) != Some(t.size as usize)
                {
                    return Err(Error::Corrupt {
                        path: p,
                        offset: t.offset,
                        msg: format!("tensor {} entry is inconsistent", t.name),
                    });
                }
            }
        }
        Ok(Store { dir: dir.into(), manifest })
    }

    /// Checks every file's and tensor's checksum; the error names the file and the offset of the
    /// first corrupt tensor.
    pub fn verify(&self) -> Result<()> {
        for f in &self.manifest.files {
            self.verify_file(f)?;
        }
        Ok(())
    }

    fn verify_file(&self, f: &FileEntry) -> Result<Vec<u8>> {
        let p = self.dir.join(&f.name);
        let bytes = std::fs::read(&p).map_err(|e| Error::io(&p, e))?;
        if bytes.len() as u64 != f.size {
            return Err(Error::Corrupt {
                path: p,
                offset: bytes.len() as u64,
                msg: format!("size changed to {}", bytes.len()),
            });
        }
        if checksum(&bytes) == f.checksum {
            return Ok(bytes);
        }
        for t in &f.tensors {
            let s = &bytes[t.offset as usize..(t.offset + t.size) as usize];
            if checksum(s) != t.checksum {
                return Err(Error::Corrupt {
                    path: p,
                    offset: t.offset,
                    msg: format!("checksum mismatch in tensor {} ({} bytes)", t.name, t.size),
                });
            }
        }
        Err(Error::Corrupt {
            path: p,
            offset: 0,
            msg: "file checksum mismatch (outside any tensor: padding)".into(),
        })
    }

    /// Reads a whole file (size-checked, not checksummed: `verify` does that).
    pub fn load(&self, name: &str) -> Result<LoadedFile> {
        let entry = self
            .manifest
            .file(name)
            .ok_or_else(|| {
                Error::format(self.dir.join(MANIFEST), format!("no file {name} in the manifest"))
            })?
            .clone();
        let p = self.dir.join(name);
        let bytes = std::fs::read(&p).map_err(|e| Error::io(&p, e))?;
        if bytes.len() as u64 != entry.size {
            return Err(Error::Corrupt {
                path: p,
                offset: bytes.len() as u64,
                msg: format!("size {} but the manifest says {}", bytes.len(), entry.size),
            });
        }
        Ok(LoadedFile { entry, bytes })
    }

    /// Loads the tokenizer and chat template.
    pub fn tokenizer(&self) -> Result<Tokenizer> {
        let m = &self.manifest;
        let template = match &m.chat_template {
            Some(name) => {
                let p = self.dir.join(name);
                Some(std::fs::read_to_string(&p).map_err(|e| Error::io(p, e))?)
            }
            None => None,
        };
        Tokenizer::from_file(
            &self.dir.join(&m.tokenizer),
            template,
            m.config.bos_token_id,
            m.config.eos_token_ids.first().copied(),
        )
    }

    /// Total bytes of all layer files.
    pub fn layer_bytes(&self) -> u64 {
        (0..self.manifest.config.num_layers)
            .filter_map(|i| self.manifest.file(&crate::layout::layer_file(i)))
            .map(|f| f.size)
            .sum()
    }
}
