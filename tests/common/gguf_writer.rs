//! A minimal GGUF v3 writer for tests: turns an HF llama checkpoint into the file llama.cpp's
//! converter would make (q/k rows permuted for interleaved RoPE, tokenizer as gguf metadata).

use std::path::Path;

pub use layerstream_model::gguf_export::Meta;
use layerstream_model::gguf_export::{put_meta, put_str};

/// Writes a GGUF file: metadata, then F32 tensors (row-major `shape`, name → data).
pub fn write_gguf(path: &Path, meta: &[(&str, Meta)], tensors: &[(String, Vec<usize>, Vec<f32>)]) {
    let mut b = b"GGUF".to_vec();
    b.extend(3u32.to_le_bytes());
    b.extend((tensors.len() as u64).to_le_bytes());
    b.extend((meta.len() as u64).to_le_bytes());
    for (k, v) in meta {
        put_meta(&mut b, k, v);
    }
    let mut offset = 0u64;
    for (name, shape, data) in tensors {
        put_str(&mut b, name);
        b.extend((shape.len() as u32).to_le_bytes());
        for d in shape.iter().rev() {
            b.extend((*d as u64).to_le_bytes());
        }
        b.extend(0u32.to_le_bytes()); // F32
        b.extend(offset.to_le_bytes());
        offset += (data.len() * 4).div_ceil(32) as u64 * 32;
    }
    b.resize(b.len().div_ceil(32) * 32, 0);
    for (_, _, data) in tensors {
        let start = b.len();
        b.extend(data.iter().flat_map(|x| x.to_le_bytes()));
        b.resize(start + (data.len() * 4).div_ceil(32) * 32, 0);
    }
    std::fs::write(path, b).unwrap();
}

/// llama.cpp's q/k permutation of f32 rows (`gguf::move_head_rows`).
pub fn permute_rows(data: &[f32], rows: usize, _cols: usize, heads: usize) -> Vec<f32> {
    let bytes: Vec<u8> = data.iter().flat_map(|x| x.to_le_bytes()).collect();
    layerstream_model::gguf::move_head_rows(&bytes, rows, heads, true)
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect()
}
