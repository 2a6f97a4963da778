//! The layer store: one file per layer plus embedding, final norm and lm_head, described by
//! `manifest.json`. Tensors sit at 4 KiB-aligned offsets so readers can use O_DIRECT, and every file
//! and tensor carries an xxh3 checksum.

mod manifest;
mod mapped;
mod reader;
mod writer;

pub use manifest::{FileEntry, Manifest, TensorEntry, ALIGN, FORMAT_VERSION, MANIFEST};
pub use mapped::MappedFile;
pub use reader::{check_bytes, LoadedFile, Store};
pub use writer::StoreWriter;

/// The checksum we record: xxh3-64 in hex with its algorithm named.
pub fn checksum(bytes: &[u8]) -> String {
    format!("xxh3:{:016x}", xxhash_rust::xxh3::xxh3_64(bytes))
}
