//! A store written back out as a GGUF v3 file that llama.cpp loads (`synth --gguf`): the very same
//! weights, so llama.cpp and layerstream can be benchmarked on one set of random weights of a real
//! shape. Dense Llama-architecture stores only (what `synth` writes for the dense shapes): tensors in
//! llama.cpp's names, q/k rows permuted into its interleaved-RoPE order (whole rows move, quantized
//! blocks are copied as they are), the vocabulary as a merge-less `gpt2` token list.

use crate::error::{Error, Result};
use crate::gguf::move_head_rows;
use crate::layout::dense_llama_tensors;
use crate::store::Store;
use std::io::Write;
use std::path::Path;

const ALIGN: u64 = 32;

/// Appends a GGUF string (u64 length, bytes).
pub fn put_str(b: &mut Vec<u8>, s: &str) {
    b.extend((s.len() as u64).to_le_bytes());
    b.extend(s.as_bytes());
}

/// A GGUF metadata value (the types the writers here need).
#[derive(Clone)]
pub enum Meta {
    U32(u32),
    F32(f32),
    Bool(bool),
    Str(String),
    Strs(Vec<String>),
    I32s(Vec<i32>),
}

/// Appends one metadata key and value.
pub fn put_meta(b: &mut Vec<u8>, key: &str, v: &Meta) {
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

/// The store's vocabulary in id order (from `tokenizer.json`'s model vocabulary).
fn vocabulary(store: &Store) -> Result<Vec<String>> {
    let p = store.dir.join(&store.manifest.tokenizer);
    let v: serde_json::Value = crate::error::read_json(&p)?;
    let map = v["model"]["vocab"]
        .as_object()
        .ok_or_else(|| Error::format(&p, "tokenizer has no model.vocab map"))?;
    let mut toks = vec![String::new(); store.manifest.config.vocab_size];
    for (t, id) in map {
        if let Some(slot) = id.as_u64().and_then(|i| toks.get_mut(i as usize)) {
            *slot = t.clone();
        }
    }
    for (i, t) in toks.iter_mut().enumerate().filter(|(_, t)| t.is_empty()) {
        *t = format!("[unused{i}]");
    }
    Ok(toks)
}

/// Writes `store` as a GGUF file at `out` (see the module docs).
pub fn export(store: &Store, out: &Path) -> Result<()> {
    let cfg = &store.manifest.config;
    // (GGUF name, store file, canonical tensor name) in file order.
    let list: Vec<(String, String, String)> =
        dense_llama_tensors(store)?.into_iter().map(|t| (t.gguf, t.file, t.name)).collect();
    let mut infos = Vec::new();
    let mut offset = 0u64;
    let mut sizes = Vec::with_capacity(list.len());
    for (gname, file, tname) in &list {
        let t = store
            .manifest
            .file(file)
            .and_then(|f| f.tensor(tname))
            .ok_or_else(|| Error::tensor(tname, format!("missing from {file}")))?;
        put_str(&mut infos, gname);
        infos.extend((t.shape.len() as u32).to_le_bytes());
        t.shape.iter().rev().for_each(|d| infos.extend((*d as u64).to_le_bytes()));
        let code = t.dtype.ggml_type().ok_or_else(|| {
            Error::tensor(tname, format!("stored as {}, which GGUF has no type for", t.dtype))
        })?;
        infos.extend(code.to_le_bytes());
        infos.extend(offset.to_le_bytes());
        sizes.push(t.size);
        offset = offset
            .checked_add(t.size)
            .and_then(|e| e.div_ceil(ALIGN).checked_mul(ALIGN))
            .ok_or_else(|| Error::tensor(tname, "sizes past 2^64 bytes"))?;
    }
    let toks = vocabulary(store)?;
    let n = toks.len();
    let mut meta = vec![
        ("general.architecture", Meta::Str("llama".into())),
        ("general.name", Meta::Str(format!("layerstream {}", store.manifest.source))),
        ("llama.context_length", Meta::U32(cfg.max_position_embeddings as u32)),
        ("llama.embedding_length", Meta::U32(cfg.hidden_size as u32)),
        ("llama.block_count", Meta::U32(cfg.num_layers as u32)),
        ("llama.feed_forward_length", Meta::U32(cfg.intermediate_size as u32)),
        ("llama.attention.head_count", Meta::U32(cfg.num_heads as u32)),
        ("llama.attention.head_count_kv", Meta::U32(cfg.num_kv_heads as u32)),
        ("llama.rope.freq_base", Meta::F32(cfg.rope.theta as f32)),
        ("llama.attention.layer_norm_rms_epsilon", Meta::F32(cfg.rms_norm_eps as f32)),
        ("llama.vocab_size", Meta::U32(n as u32)),
        ("tokenizer.ggml.model", Meta::Str("gpt2".into())),
        ("tokenizer.ggml.pre", Meta::Str("default".into())),
        ("tokenizer.ggml.tokens", Meta::Strs(toks)),
        ("tokenizer.ggml.token_type", Meta::I32s(vec![1; n])),
        ("tokenizer.ggml.merges", Meta::Strs(vec![])),
    ];
    if let Some(b) = cfg.bos_token_id {
        meta.push(("tokenizer.ggml.bos_token_id", Meta::U32(b)));
    }
    if let Some(&e) = cfg.eos_token_ids.first() {
        meta.push(("tokenizer.ggml.eos_token_id", Meta::U32(e)));
    }
    let mut head = b"GGUF".to_vec();
    head.extend(3u32.to_le_bytes());
    head.extend((list.len() as u64).to_le_bytes());
    head.extend((meta.len() as u64).to_le_bytes());
    for (k, v) in &meta {
        put_meta(&mut head, k, v);
    }
    head.extend(infos);
    head.resize((head.len() as u64).div_ceil(ALIGN) as usize * ALIGN as usize, 0);
    let file = std::fs::File::create(out).map_err(|e| Error::io(out, e))?;
    let mut w = std::io::BufWriter::new(file);
    let werr = |e| Error::io(out, e);
    w.write_all(&head).map_err(werr)?;
    let mut loaded: Option<crate::LoadedFile> = None;
    for ((_, file, tname), size) in list.iter().zip(sizes) {
        if loaded.as_ref().is_none_or(|l| &l.entry.name != file) {
            loaded = Some(store.load(file)?);
        }
        let l = loaded.as_ref().expect("just loaded");
        let (t, bytes) = l.tensor(tname).ok_or_else(|| Error::tensor(tname, "missing"))?;
        let data = match tname.as_str() {
            "q" => move_head_rows(bytes, t.shape[0], cfg.num_heads, true),
            "k" => move_head_rows(bytes, t.shape[0], cfg.num_kv_heads, true),
            _ => bytes.to_vec(),
        };
        w.write_all(&data).map_err(werr)?;
        let pad = (size.div_ceil(ALIGN) * ALIGN - size) as usize;
        w.write_all(&vec![0u8; pad]).map_err(werr)?;
    }
    w.flush().map_err(werr)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The exported file imports back into a store with the same tensors (q/k rows restored to HF
    /// order), so llama.cpp reads the weights the store computes with.
    #[test]
    fn export_then_import_gives_the_same_tensors() {
        let dir = tempfile::tempdir().unwrap();
        crate::synth::synth("tiny", crate::DType::Q4K, Some(2), 5, &dir.path().join("s")).unwrap();
        let store = Store::open(&dir.path().join("s")).unwrap();
        let gguf = dir.path().join("s.gguf");
        export(&store, &gguf).unwrap();
        crate::import::import(&gguf, &dir.path().join("back"), false).unwrap();
        let back = Store::open(&dir.path().join("back")).unwrap();
        assert_eq!(back.manifest.config.num_layers, 2);
        for f in ["embed.bin", "layer_000.bin", "layer_001.bin", "final_norm.bin"] {
            let (a, b) = (store.load(f).unwrap(), back.load(f).unwrap());
            for t in &a.entry.tensors {
                let (ta, da) = a.tensor(&t.name).unwrap();
                let (tb, db) = b.tensor(&t.name).unwrap();
                assert_eq!((ta.dtype, &ta.shape), (tb.dtype, &tb.shape), "{f}:{}", t.name);
                assert_eq!(da, db, "{f}:{}", t.name);
            }
        }
    }
}
