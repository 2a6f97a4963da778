//! Opens a store (sizes always checked), verifies checksums, and reads files and tensors.

use super::{checksum, FileEntry, Manifest, TensorEntry, FORMAT_VERSION, MANIFEST};
use crate::error::{read_json, Error, Result};
use crate::tokenizer::Tokenizer;
use std::path::{Path, PathBuf};

/// Checks `bytes`, the whole of the file `entry` describes (found at `path`), against its checksum.
/// A mismatch names the file, the first tensor whose bytes differ and its offset (or the padding).
pub fn check_bytes(path: &Path, entry: &FileEntry, bytes: &[u8]) -> Result<()> {
    if bytes.len() as u64 == entry.size && checksum(bytes) == entry.checksum {
        return Ok(());
    }
    let corrupt = |offset, msg| Error::Corrupt { path: path.into(), offset, msg };
    if bytes.len() as u64 != entry.size {
        return Err(corrupt(
            bytes.len() as u64,
            format!("{} bytes where the manifest says {}", bytes.len(), entry.size),
        ));
    }
    for t in &entry.tensors {
        // Ranges were checked against the file size when the store was opened.
        let s = &bytes[t.offset as usize..(t.offset + t.size) as usize];
        if checksum(s) != t.checksum {
            return Err(corrupt(
                t.offset,
                format!("checksum mismatch in tensor {} ({} bytes)", t.name, t.size),
            ));
        }
    }
    Err(corrupt(0, "file checksum mismatch (outside any tensor: padding)".into()))
}

/// `bytes`, read or mapped from `path`, are the whole of `entry`'s file: its recorded size, and
/// its checksums when `check`.
pub(super) fn check_whole(path: &Path, entry: &FileEntry, bytes: &[u8], check: bool) -> Result<()> {
    if bytes.len() as u64 != entry.size {
        return Err(Error::Corrupt {
            path: path.into(),
            offset: bytes.len() as u64,
            msg: format!("size {} but the manifest says {}", bytes.len(), entry.size),
        });
    }
    if check {
        check_bytes(path, entry, bytes)?;
    }
    Ok(())
}

/// An opened layer store.
#[derive(Debug, Clone)]
pub struct Store {
    pub dir: PathBuf,
    pub manifest: Manifest,
    /// Whether `load` checks checksums (on by default; `--no-verify` turns it off for measurements).
    pub verify: bool,
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
    /// What the store holds, as 16 hex digits: its files' names and checksums hashed (xxh3), so two
    /// stores with the same weights share it and any changed file changes it. Caches of what was
    /// measured or learned about a store (calibration, expert usage) are keyed by it.
    pub fn identity(&self) -> String {
        let mut h = xxhash_rust::xxh3::Xxh3::new();
        for f in &self.manifest.files {
            h.update(f.name.as_bytes());
            h.update(&[0]);
            h.update(f.checksum.as_bytes());
            h.update(&[0]);
        }
        format!("{:016x}", h.digest())
    }

    /// Opens `dir`: parses the manifest, checks that it is consistent (`Manifest::check`) and that
    /// every file exists as a regular file with its recorded size.
    pub fn open(dir: &Path) -> Result<Store> {
        let mpath = dir.join(MANIFEST);
        match std::fs::metadata(&mpath) {
            Ok(_) => {}
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                return Err(Error::format(
                    dir,
                    "not a layer store (no manifest.json); create one with `layerstream import`",
                ))
            }
            // Permission denied (and the like) is said as it is, naming the path.
            Err(e) => return Err(Error::io(&mpath, e)),
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
        manifest.check().map_err(|msg| Error::format(&mpath, msg))?;
        for f in &manifest.files {
            let p = dir.join(&f.name);
            let meta = std::fs::metadata(&p).map_err(|e| Error::io(&p, e))?;
            if !meta.is_file() {
                return Err(Error::format(&p, "not a regular file"));
            }
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
        }
        Ok(Store { dir: dir.into(), manifest, verify: true })
    }

    /// Checks every file's and tensor's checksum; the error names the file and the offset of the
    /// first corrupt tensor.
    pub fn verify(&self) -> Result<()> {
        for f in &self.manifest.files {
            self.read(f, true)?;
        }
        Ok(())
    }

    /// Reads a whole file, size-checked and (unless `verify` is off) checksummed: corrupt bytes are
    /// never handed out.
    pub fn load(&self, name: &str) -> Result<LoadedFile> {
        let entry = self.entry(name)?;
        let bytes = self.read(&entry, self.verify)?;
        Ok(LoadedFile { entry, bytes })
    }

    /// The manifest's entry for file `name`, or an error naming it.
    pub(super) fn entry(&self, name: &str) -> Result<FileEntry> {
        let e = self.manifest.file(name).ok_or_else(|| {
            Error::format(self.dir.join(MANIFEST), format!("no file {name} in the manifest"))
        })?;
        Ok(e.clone())
    }

    /// The bytes of `entry`'s file, of the recorded size, checksummed when `check`.
    fn read(&self, entry: &FileEntry, check: bool) -> Result<Vec<u8>> {
        let p = self.dir.join(&entry.name);
        let bytes = std::fs::read(&p).map_err(|e| Error::io(&p, e))?;
        check_whole(&p, entry, &bytes, check)?;
        Ok(bytes)
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
