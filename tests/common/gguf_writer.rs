//! A minimal GGUF v3 writer for tests: turns an HF llama checkpoint into the file llama.cpp's
//! converter would make (q/k rows permuted for interleaved RoPE, tokenizer as gguf metadata).

use std::path::Path;

#[derive(Clone)]
pub enum Meta {
    U32(u32),
    F32(f32),
    Bool(bool),
    Str(String),
    Strs(Vec<String>),
    I32s(Vec<i32>),
}

fn put_str(b: &mut Vec<u8>, s: &str) {
    b.extend((s.len() as u64).to_le_bytes());
    b.extend(s.as_bytes());
}

fn put_meta(b: &mut Vec<u8>, key: &str, v: &Meta) {
    put_str(b, key);
    match v {
        Meta::U32(x) => {
            b.extend(4u32.to_le_bytes());
            b.extend(x.to_le_bytes());
        }
        Meta::F32(x) => {
            b.extend(6u32.to_le_bytes());
            b.extend(x.to_le_bytes());
        }
        Meta::Bool(x) => {
            b.extend(7u32.to_le_bytes());
            b.push(*x as u8);
        }
        Meta::Str(s) => {
            b.extend(8u32.to_le_bytes());
            put_str(b, s);
        }
        Meta::Strs(v) => {
            b.extend(9u32.to_le_bytes());
            b.extend(8u32.to_le_bytes());
            b.extend((v.len() as u64).to_le_bytes());
            v.iter().for_each(|s| put_str(b, s));
        }
        Meta::I32s(v) => {
            b.extend(9u32.to_le_bytes());
            b.extend(5u32.to_le_bytes());
            b.extend((v.len() as u64).to_le_bytes());
            v.iter().for_each(|x| b.extend(x.to_le_bytes()));
        }
    }
}

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

/// llama.cpp's q/k permutation: HF row `h*hd + j*hd/2 + i` moves to `h*hd + 2i + j`.
pub fn permute_rows(data: &[f32], rows: usize, cols: usize, heads: usize) -> Vec<f32> {
    let hd = rows / heads;
    let mut out = vec![0f32; data.len()];
    for h in 0..heads {
        for j in 0..2 {
            for i in 0..hd / 2 {
                let src = h * hd + j * hd / 2 + i;
                let dst = h * hd + 2 * i + j;
                out[dst * cols..(dst + 1) * cols]
                    .copy_from_slice(&data[src * cols..(src + 1) * cols]);
            }
        }
    }
    out
}
