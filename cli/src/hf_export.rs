//! A store written back out as a Hugging Face checkpoint (`synth --hf DIR`): `config.json`
//! (`LlamaForCausalLM`), `model.safetensors` and the store's tokenizer, so transformers runs the very
//! weights layerstream runs (and llama.cpp, from `synth --gguf`). Quantized tensors are written as
//! the f32 values the CPU kernels dequantize them to (exact); f32/f16/bf16 tensors as stored. The
//! file is written tensor by tensor, row by row, so a 70B-shaped store needs no more memory than a
//! row. Dense Llama stores only, as the GGUF export.

use anyhow::{bail, Context, Result};
use layerstream_kernels::quant::dequant_row;
use layerstream_model::layout::dense_llama_tensors;
use layerstream_model::{DType, Store};
use std::io::Write;
use std::path::Path;

/// (HF name, store file, store tensor name) of every tensor, in file order; a layer tensor a plain
/// Llama checkpoint has no place for (biases, q/k norms, Gemma's norms) is an error.
fn tensor_list(store: &Store) -> Result<Vec<(String, String, String)>> {
    let mut list = Vec::new();
    for t in dense_llama_tensors(store)? {
        if t.layer.is_some_and(|lt| !lt.required) {
            bail!("{}: tensor {} has no place in a plain Llama checkpoint", t.file, t.name);
        }
        list.push((t.hf, t.file, t.name));
    }
    Ok(list)
}

/// The safetensors dtype a stored tensor is written as, its bytes per value, and whether its bytes
/// are written as stored (float formats) rather than dequantized to f32.
fn hf_dtype(d: DType) -> (&'static str, u64, bool) {
    match d {
        DType::F16 => ("F16", 2, true),
        DType::Bf16 => ("BF16", 2, true),
        DType::F32 => ("F32", 4, true),
        _ => ("F32", 4, false),
    }
}

/// The `config.json` transformers builds the model from.
fn config_json(store: &Store, torch_dtype: &str) -> serde_json::Value {
    let c = &store.manifest.config;
    serde_json::json!({
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": c.hidden_size,
        "intermediate_size": c.intermediate_size,
        "num_hidden_layers": c.num_layers,
        "num_attention_heads": c.num_heads,
        "num_key_value_heads": c.num_kv_heads,
        "head_dim": c.head_dim,
        "vocab_size": c.vocab_size,
        "rms_norm_eps": c.rms_norm_eps,
        "rope_theta": c.rope.theta,
        "max_position_embeddings": c.max_position_embeddings,
        "tie_word_embeddings": c.tie_word_embeddings,
        "bos_token_id": c.bos_token_id,
        "eos_token_id": c.eos_token_ids.first(),
        "hidden_act": "silu",
        "attention_bias": false,
        "mlp_bias": false,
        "torch_dtype": torch_dtype,
    })
}

/// Writes `store` as a Hugging Face checkpoint directory `dir` (see the module docs).
pub fn export(store: &Store, dir: &Path) -> Result<()> {
    let list = tensor_list(store)?;
    let mut header = serde_json::Map::new();
    header.insert("__metadata__".into(), serde_json::json!({"format": "pt"}));
    let mut offset = 0u64;
    let mut dtypes = std::collections::BTreeSet::new();
    // Each tensor's size in the file, checked against what is written for it below.
    let mut sizes = Vec::with_capacity(list.len());
    for (hf, file, name) in &list {
        let t = store.manifest.file(file).and_then(|f| f.tensor(name)).context("listed tensor")?;
        let (dt, width, _) = hf_dtype(t.dtype);
        dtypes.insert(dt);
        let size =
            t.shape.iter().try_fold(width, |a, &d| a.checked_mul(d as u64)).with_context(|| {
                format!("{file}:{name}: shape {:?} is past 2^64 bytes", t.shape)
            })?;
        let end = offset
            .checked_add(size)
            .with_context(|| format!("{file}:{name}: the checkpoint would pass 2^64 bytes"))?;
        header.insert(
            hf.clone(),
            serde_json::json!({"dtype": dt, "shape": t.shape, "data_offsets": [offset, end]}),
        );
        sizes.push(size);
        offset = end;
    }
    let mut head = serde_json::to_vec(&header)?;
    head.resize(head.len().div_ceil(8) * 8, b' ');
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    let path = dir.join("model.safetensors");
    let mut w = std::io::BufWriter::new(
        std::fs::File::create(&path).with_context(|| format!("creating {}", path.display()))?,
    );
    w.write_all(&(head.len() as u64).to_le_bytes())?;
    w.write_all(&head)?;
    let mut loaded: Option<layerstream_model::LoadedFile> = None;
    for ((_, file, name), size) in list.iter().zip(sizes) {
        if loaded.as_ref().is_none_or(|l| &l.entry.name != file) {
            loaded = Some(store.load(file)?);
        }
        let l = loaded.as_ref().context("just loaded")?;
        let (t, bytes) = l.tensor(name).context("listed tensor")?;
        let cols = *t.shape.last().context("a tensor has a shape")?;
        let rb = t.dtype.row_bytes(cols).with_context(|| {
            format!("{file}:{name}: {cols} columns are not whole {} blocks", t.dtype)
        })?;
        let as_stored = hf_dtype(t.dtype).2;
        // Bytes this tensor's data will take: as stored, or 4 per value of its whole rows.
        let written = if as_stored {
            Some(bytes.len() as u64)
        } else {
            cols.checked_mul(4)
                .and_then(|c| (bytes.len() / rb.max(1)).checked_mul(c))
                .map(|b| b as u64)
        };
        if rb == 0 || !bytes.len().is_multiple_of(rb) || written != Some(size) {
            bail!(
                "{file}:{name}: {} bytes of {} do not hold shape {:?}",
                bytes.len(),
                t.dtype,
                t.shape
            );
        }
        if as_stored {
            w.write_all(bytes)?;
            continue;
        }
        let mut row = vec![0f32; cols];
        for r in bytes.chunks_exact(rb) {
            dequant_row(t.dtype, r, &mut row);
            for v in &row {
                w.write_all(&v.to_le_bytes())?;
            }
        }
    }
    w.flush()?;
    let torch_dtype = match dtypes.iter().next() {
        Some(&"BF16") if dtypes.len() == 1 => "bfloat16",
        Some(&"F16") if dtypes.len() == 1 => "float16",
        _ => "float32",
    };
    std::fs::write(
        dir.join("config.json"),
        serde_json::to_vec_pretty(&config_json(store, torch_dtype))?,
    )?;
    std::fs::copy(store.dir.join(&store.manifest.tokenizer), dir.join("tokenizer.json"))?;
    let tok_cfg = serde_json::json!({"tokenizer_class": "PreTrainedTokenizerFast"});
    std::fs::write(dir.join("tokenizer_config.json"), serde_json::to_vec_pretty(&tok_cfg)?)?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The checkpoint imports back (through the HF importer) into a store whose every tensor holds
    /// the values the synthesized store's blocks dequantize to; the config round-trips.
    #[test]
    fn export_then_import_gives_the_dequantized_values() {
        for dtype in [DType::Q4K, DType::Bf16] {
            let dir = tempfile::tempdir().unwrap();
            let src = dir.path().join("s");
            layerstream_model::synth::synth("tiny", dtype, Some(2), 9, &src).unwrap();
            let store = Store::open(&src).unwrap();
            export(&store, &dir.path().join("hf")).unwrap();
            layerstream_model::import::import(
                &dir.path().join("hf"),
                &dir.path().join("back"),
                false,
            )
            .unwrap();
            let back = Store::open(&dir.path().join("back")).unwrap();
            let (a, b) = (&store.manifest.config, &back.manifest.config);
            assert_eq!(
                (a.num_layers, a.hidden_size, a.num_kv_heads, a.vocab_size, a.tie_word_embeddings),
                (b.num_layers, b.hidden_size, b.num_kv_heads, b.vocab_size, b.tie_word_embeddings)
            );
            for f in ["embed.bin", "layer_000.bin", "layer_001.bin", "final_norm.bin"] {
                let (la, lb) = (store.load(f).unwrap(), back.load(f).unwrap());
                for t in &la.entry.tensors {
                    let (ta, da) = la.tensor(&t.name).unwrap();
                    let (tb, db) = lb.tensor(&t.name).unwrap();
                    assert_eq!(ta.shape, tb.shape, "{f}:{}", t.name);
                    let cols = *ta.shape.last().unwrap();
                    let values = |d: DType, bytes: &[u8]| -> Vec<f32> {
                        let rb = d.row_bytes(cols).unwrap();
                        let mut out = vec![0f32; bytes.len() / rb * cols];
                        for (o, r) in out.chunks_exact_mut(cols).zip(bytes.chunks_exact(rb)) {
                            dequant_row(d, r, o);
                        }
                        out
                    };
                    let (va, vb) = (values(ta.dtype, da), values(tb.dtype, db));
                    assert!(
                        va.iter().zip(&vb).all(|(x, y)| x.to_bits() == y.to_bits()),
                        "{f}:{}",
                        t.name
                    );
                }
            }
        }
    }
}
