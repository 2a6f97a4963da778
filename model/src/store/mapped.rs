//! A store file mapped rather than read (`Store::map`): for a weight of which a pass touches a few
//! rows — the token embedding, looked up one row a token — only the pages those rows lie in come
//! into memory, and under a memory limit they are the page cache's to drop (clean file pages),
//! where a read file is the process's own memory for as long as it runs.

use super::{FileEntry, Store};
use crate::error::{Error, Result};

/// A store file mapped read-only, with its tensor directory.
#[derive(Debug)]
pub struct MappedFile {
    pub entry: FileEntry,
    map: memmap2::Mmap,
}

impl MappedFile {
    /// The file's bytes (the mapping: pages come in as they are touched).
    pub fn bytes(&self) -> &[u8] {
        &self.map
    }
}

impl Store {
    /// Maps file `name` read-only, size-checked and (unless `verify` is off) checksummed — the
    /// check touches every page once; they stay the page cache's, not the process's. Reads are
    /// advised random: a row's lookup brings in its pages, not the kernel's read-ahead around them.
    pub fn map(&self, name: &str) -> Result<MappedFile> {
        let entry = self.entry(name)?;
        let p = self.dir.join(&entry.name);
        let file = std::fs::File::open(&p).map_err(|e| Error::io(&p, e))?;
        // SAFETY: store files are written once (`StoreWriter`) and never modified in place; the
        // mapping is read-only, so no Rust reference aliases a mutable view. A file truncated
        // under a running worker would fault on access, as it would for llama.cpp's mmap.
        let map = unsafe { memmap2::Mmap::map(&file) }.map_err(|e| Error::io(&p, e))?;
        super::reader::check_whole(&p, &entry, &map, self.verify)?;
        // Advice only: a kernel that ignores it reads ahead as it would for any mapping.
        let _ = map.advise(memmap2::Advice::Random);
        Ok(MappedFile { entry, map })
    }
}

#[cfg(test)]
mod tests {
    fn store(dir: &std::path::Path) -> crate::Store {
        crate::synth::synth("tiny", crate::DType::Q8_0, Some(1), 3, dir).unwrap();
        crate::Store::open(dir).unwrap()
    }

    #[test]
    fn a_mapped_file_holds_the_read_files_bytes_and_a_corrupt_one_is_refused() {
        let d = tempfile::tempdir().unwrap();
        let s = store(&d.path().join("s"));
        let read = s.load("embed.bin").unwrap();
        let mapped = s.map("embed.bin").unwrap();
        assert_eq!(mapped.bytes(), &read.bytes[..]);
        assert_eq!(mapped.entry, read.entry);
        let p = d.path().join("s").join("embed.bin");
        let mut b = std::fs::read(&p).unwrap();
        b[read.entry.tensors[0].offset as usize] ^= 0xff;
        std::fs::write(&p, &b).unwrap();
        let e = s.map("embed.bin").unwrap_err().to_string();
        assert!(e.contains("embed.bin") && e.contains("checksum mismatch in tensor embed"), "{e}");
        assert!(s.map("lm_head.bin").unwrap_err().to_string().contains("no file lm_head.bin"));
    }
}
