//! `layerstream synth`: a layer store with random weights of a real model's shapes (valid quantized
//! blocks), so streaming speed can be measured where no large checkpoint can be downloaded.

use crate::config::{Arch, ModelConfig, RopeConfig};
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::layout::{
    expert_file, expert_shape, expert_tensors, layer_file, layer_shape, LAYER_TENSORS, ROUTER,
    ROUTER_BIAS,
};
use crate::source::SourceTensor;
use crate::store::{Manifest, StoreWriter};
use layerstream_types::random::Rng;
use std::path::Path;

/// Shapes `synth` knows: (name, hidden, intermediate, heads, kv heads, vocab, layers).
pub const SHAPES: &[(&str, usize, usize, usize, usize, usize, usize)] = &[
    ("tiny", 256, 512, 4, 2, 1024, 4),
    ("smollm2-135m", 576, 1536, 9, 3, 49152, 30),
    ("llama-3-8b", 4096, 14336, 32, 8, 128256, 32),
    ("llama-3-70b", 8192, 28672, 64, 8, 128256, 80),
    // The 70B's draft: Llama 3.2 1B (its vocabulary; head_dim 64).
    ("llama-3.2-1b", 2048, 8192, 32, 8, 128256, 16),
];

/// Mixture-of-experts shapes: (name, hidden, heads, kv heads, head dim, vocab, layers, experts,
/// experts per token, expert width). The Qwen3 ones have q/k norms; `tiny-moe` is Mixtral-style.
#[allow(clippy::type_complexity)]
pub const MOE_SHAPES: &[(&str, usize, usize, usize, usize, usize, usize, usize, usize, usize)] = &[
    ("tiny-moe", 256, 4, 2, 64, 1024, 4, 8, 2, 256),
    ("qwen3-30b-a3b", 2048, 32, 4, 128, 151936, 48, 128, 8, 768),
    ("qwen3-235b-a22b", 4096, 64, 4, 128, 151936, 94, 128, 8, 1536),
    ("mixtral-8x7b", 4096, 32, 8, 128, 32000, 32, 8, 2, 14336),
];

/// The config of a named shape with `layers` layers (default: the real count).
pub fn shape_config(name: &str, layers: Option<usize>) -> Result<ModelConfig> {
    if let Some(cfg) = crate::synth_arch::arch_config(name, layers) {
        return cfg;
    }
    if let Some(&(_, h, nh, nkv, hd, vocab, nl, experts, top_k, f)) =
        MOE_SHAPES.iter().find(|s| s.0 == name)
    {
        let qwen = name.starts_with("qwen3");
        let cfg = ModelConfig {
            arch: if qwen { Arch::Qwen3Moe } else { Arch::Mixtral },
            head_dim: hd,
            qk_norm: qwen,
            moe: Some(crate::config::MoeConfig {
                experts,
                top_k,
                expert_intermediate: f,
                norm_topk_prob: true,
                ..Default::default()
            }),
            ..dense_config(h, f, nh, nkv, vocab, layers.unwrap_or(nl))
        };
        cfg.validate()?;
        return Ok(cfg);
    }
    let &(_, h, f, nh, nkv, vocab, nl) = SHAPES.iter().find(|s| s.0 == name).ok_or_else(|| {
        Error::config(
            "shape",
            format!(
                "unknown {name:?}; known: {}",
                SHAPES
                    .iter()
                    .map(|s| s.0)
                    .chain(MOE_SHAPES.iter().map(|s| s.0))
                    .chain(crate::synth_arch::ARCH_SHAPES)
                    .collect::<Vec<_>>()
                    .join(", ")
            ),
        )
    })?;
    let cfg = dense_config(h, f, nh, nkv, vocab, layers.unwrap_or(nl));
    cfg.validate()?;
    Ok(cfg)
}

/// A Llama-style config of these sizes (tied embeddings, RoPE base 500000).
fn dense_config(
    h: usize,
    f: usize,
    nh: usize,
    nkv: usize,
    vocab: usize,
    layers: usize,
) -> ModelConfig {
    ModelConfig {
        arch: Arch::Llama,
        hidden_size: h,
        intermediate_size: f,
        num_layers: layers,
        num_heads: nh,
        num_kv_heads: nkv,
        head_dim: h / nh,
        vocab_size: vocab,
        rms_norm_eps: 1e-5,
        rope: RopeConfig { theta: 500000.0, scaling: None },
        max_position_embeddings: 8192,
        tie_word_embeddings: true,
        qk_norm: false,
        bos_token_id: Some(1),
        eos_token_ids: vec![2],
        moe: None,
        gemma: None,
        sliding_window: None,
        bitlinear: false,
        full_attention_layers: Vec::new(),
        attn_sinks: false,
        mla: None,
    }
}

/// A random tensor of `dtype` whose values are zero-mean and small (see `layerstream_types::random`).
fn random_tensor(rng: &mut Rng, dtype: DType, shape: &[usize]) -> Result<SourceTensor> {
    let data = rng
        .tensor(dtype, shape)
        .ok_or_else(|| Error::tensor("synth", format!("{shape:?} is not whole {dtype} blocks")))?;
    Ok(SourceTensor { dtype, shape: shape.to_vec(), data })
}

/// A layer tensor: norms are f32 ones, other vectors (biases, sinks, score corrections) small
/// random f32 values, matrices random in `dtype` — except an MLA matrix whose rows are not whole
/// `dtype` blocks (DeepSeek's 128-wide `k_b` under a 256-value K-quant): Q8_0, else f16.
fn layer_tensor(rng: &mut Rng, dtype: DType, name: &str, shape: &[usize]) -> Result<SourceTensor> {
    match shape {
        [n] if name.ends_with("norm") => Ok(ones(*n)),
        [_] => random_tensor(rng, DType::F32, shape),
        [_, cols] if crate::mla_import::MLA_TENSORS.contains(&name) => {
            let fits = |d: DType| cols.is_multiple_of(d.block_elems());
            let d = [dtype, DType::Q8_0, DType::F16]
                .into_iter()
                .find(|&d| fits(d))
                .unwrap_or(DType::F32);
            random_tensor(rng, d, shape)
        }
        _ => random_tensor(rng, dtype, shape),
    }
}

fn ones(n: usize) -> SourceTensor {
    SourceTensor {
        dtype: DType::F32,
        shape: vec![n],
        data: (0..n).flat_map(|_| 1f32.to_le_bytes()).collect(),
    }
}

/// A word-level tokenizer with one token per id ("t0", "t1", …): enough to run and benchmark.
fn tokenizer_json(vocab: usize) -> String {
    let v: serde_json::Map<String, serde_json::Value> =
        (0..vocab).map(|i| (format!("t{i}"), serde_json::json!(i))).collect();
    serde_json::json!({
        "version": "1.0", "truncation": null, "padding": null, "added_tokens": [], "normalizer": null,
        "pre_tokenizer": {"type": "Whitespace"}, "post_processor": null,
        "decoder": null, "model": {"type": "WordLevel", "vocab": v, "unk_token": "t0"}
    })
    .to_string()
}

/// Writes a synthetic store of shape `name` with weights of `dtype` into the new directory `dst`.
/// The embedding (and the lm_head, tied or not) is f16 for float stores, Q8_0 for quantized ones.
pub fn synth(
    name: &str,
    dtype: DType,
    layers: Option<usize>,
    seed: u64,
    dst: &Path,
) -> Result<Manifest> {
    let cfg = shape_config(name, layers)?;
    if dst.exists() && std::fs::read_dir(dst).map_err(|e| Error::io(dst, e))?.next().is_some() {
        return Err(Error::format(dst, "destination exists and is not empty"));
    }
    std::fs::create_dir_all(dst).map_err(|e| Error::io(dst, e))?;
    let result = (|| {
        let mut rng = Rng::new(seed);
        let mut w = StoreWriter::new(dst);
        let embed_dtype = if dtype.is_quantized() { DType::Q8_0 } else { DType::F16 };
        w.write_tensors(
            "embed.bin",
            vec![(
                "embed".into(),
                random_tensor(&mut rng, embed_dtype, &[cfg.vocab_size, cfg.hidden_size])?,
            )],
        )?;
        for i in 0..cfg.num_layers {
            let mut tensors = Vec::new();
            let moe = cfg.moe_at(i);
            let shared = moe.is_some_and(|m| m.shared_intermediate > 0);
            let wanted = |name: &str| match name {
                "q_norm" | "k_norm" => cfg.qk_norm,
                "q" | "k" | "v" => cfg.mla.is_none(),
                "gate" | "up" | "down" => moe.is_none(),
                "q_bias" | "k_bias" | "v_bias" | "o_bias" | "sinks" => cfg.attn_sinks,
                "router_correction" => moe.is_some_and(|m| m.groups.is_some()),
                "shared_gate" | "shared_up" | "shared_down" => shared,
                _ => LAYER_TENSORS.iter().any(|t| t.name == name && t.required),
            };
            let mla = cfg.mla.iter().flat_map(|m| {
                crate::mla_import::MLA_TENSORS
                    .into_iter()
                    .filter(move |&n| m.q_lora_rank.is_some() || !n.starts_with("q_a"))
            });
            let names = LAYER_TENSORS.iter().map(|t| t.name).filter(|&n| wanted(n)).chain(mla);
            for name in names {
                let shape = layer_shape(&cfg, name).expect("layout covers every layer tensor");
                tensors.push((name.to_owned(), layer_tensor(&mut rng, dtype, name, &shape)?));
            }
            if let Some(m) = moe {
                // The router stays f32, as llama.cpp keeps it in every file type.
                let shape = layer_shape(&cfg, ROUTER).expect("moe config");
                tensors.push((ROUTER.into(), random_tensor(&mut rng, DType::F32, &shape)?));
                if m.bias {
                    tensors.push((ROUTER_BIAS.into(), ones(m.experts)));
                }
                for e in 0..m.experts {
                    let t = expert_tensors(m)
                        .into_iter()
                        .map(|n| {
                            let shape = expert_shape(&cfg, n).expect("moe config");
                            Ok((n.to_owned(), layer_tensor(&mut rng, dtype, n, &shape)?))
                        })
                        .collect::<Result<Vec<_>>>()?;
                    w.write_tensors(&expert_file(i, e), t)?;
                }
            }
            w.write_tensors(&layer_file(i), tensors)?;
        }
        w.write_tensors("final_norm.bin", vec![("final_norm".into(), ones(cfg.hidden_size))])?;
        if !cfg.tie_word_embeddings {
            let head = random_tensor(&mut rng, embed_dtype, &[cfg.vocab_size, cfg.hidden_size])?;
            w.write_tensors("lm_head.bin", vec![("lm_head".into(), head)])?;
        }
        w.write_aux("tokenizer.json", tokenizer_json(cfg.vocab_size).as_bytes())?;
        w.finish(cfg.clone(), format!("synth:{name}:{dtype}"), "tokenizer.json", None)
    })();
    if result.is_err() {
        let _ = std::fs::remove_dir_all(dst);
    }
    result
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn synth_store_opens_verifies_and_has_real_sizes() {
        let dir = tempfile::tempdir().unwrap();
        let dst = dir.path().join("s");
        let m = synth("tiny", DType::Q4K, Some(2), 7, &dst).unwrap();
        let store = crate::Store::open(&dst).unwrap();
        store.verify().unwrap();
        assert_eq!(m.config.num_layers, 2);
        let q = store.manifest.file("layer_001.bin").unwrap().tensor("q").unwrap();
        assert_eq!((q.dtype, q.size), (DType::Q4K, (256 * 256 / 256 * 144) as u64));
        assert!(store.tokenizer().unwrap().encode("t5 t7").unwrap() == vec![5, 7]);
        // q4_k needs rows of whole 256-element blocks: SmolLM2's 576 is not.
        let e = synth("smollm2-135m", DType::Q4K, Some(1), 1, &dir.path().join("x"))
            .unwrap_err()
            .to_string();
        assert!(e.contains("q4_k"), "{e}");
        assert!(!dir.path().join("x").exists());
        assert!(shape_config("gpt-5", None).unwrap_err().to_string().contains("llama-3-70b"));
    }

    /// DeepSeek-V3 and gpt-oss shapes (shrunk: fewer experts would not be their shapes, so the
    /// test writes the real ones' configs with 2 layers at f16 and checks the tiny pieces) open and
    /// verify with their MLA tensors, biases, sinks and shared experts.
    #[test]
    fn arch_shapes_write_what_the_worker_reads() {
        for name in crate::synth_arch::ARCH_SHAPES {
            let cfg = shape_config(name, Some(2)).unwrap();
            assert_eq!(cfg.num_layers, 2, "{name}");
        }
        let d = shape_config("deepseek-v3", Some(2)).unwrap();
        for t in ["k_b", "v_b", "q_a", "kv_a_norm"] {
            assert!(layer_shape(&d, t).is_some(), "{t}");
        }
    }

    /// MoE shapes write a router per layer and every expert as its own file, and the store opens
    /// (the manifest's MoE checks pass) and verifies.
    #[test]
    fn moe_shapes_write_one_file_per_expert() {
        let dir = tempfile::tempdir().unwrap();
        let dst = dir.path().join("m");
        let m = synth("tiny-moe", DType::Q4K, Some(2), 3, &dst).unwrap();
        let store = crate::Store::open(&dst).unwrap();
        store.verify().unwrap();
        let x = m.config.moe.clone().unwrap();
        assert_eq!(m.files.iter().filter(|f| f.name.contains("_expert_")).count(), 2 * x.experts);
        assert_eq!(m.file("layer_001.bin").unwrap().tensor("router").unwrap().dtype, DType::F32);
        let q = shape_config("qwen3-30b-a3b", Some(1)).unwrap();
        assert!(q.qk_norm && q.moe.unwrap().top_k == 8);
    }
}
