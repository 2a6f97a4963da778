//! A GGUF made from an HF checkpoint (as llama.cpp's converter would: q/k rows permuted, tokenizer in
//! metadata) imports into a store that gives the same tokenization and the same tokens as the store
//! imported from the HF directory itself.

use layerstream_tests::gguf_writer::{permute_rows, write_gguf, Meta};
use layerstream_tests::*;
use std::path::Path;

/// Every tensor of an HF checkpoint directory (single or sharded safetensors) as f32.
fn hf_tensors(dir: &Path) -> Vec<(String, Vec<usize>, Vec<f32>)> {
    let mut out = Vec::new();
    let mut files: Vec<_> = std::fs::read_dir(dir)
        .unwrap()
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.extension().is_some_and(|e| e == "safetensors"))
        .collect();
    files.sort();
    for f in files {
        let bytes = std::fs::read(&f).unwrap();
        let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
        for (name, t) in st.tensors() {
            let d = t.data();
            let v: Vec<f32> = match t.dtype() {
                safetensors::Dtype::F32 => {
                    d.chunks_exact(4).map(|c| f32::from_le_bytes(c.try_into().unwrap())).collect()
                }
                safetensors::Dtype::F16 => d
                    .chunks_exact(2)
                    .map(|c| half::f16::from_le_bytes([c[0], c[1]]).to_f32())
                    .collect(),
                safetensors::Dtype::BF16 => d
                    .chunks_exact(2)
                    .map(|c| half::bf16::from_le_bytes([c[0], c[1]]).to_f32())
                    .collect(),
                other => panic!("{name}: {other:?}"),
            };
            out.push((name, t.shape().to_vec(), v));
        }
    }
    out
}

/// tiny-llama without its llama3 rope scaling (GGUF carries that as a tensor we don't import).
fn hf_without_rope_scaling(dir: &Path) -> std::path::PathBuf {
    copy_hf_with_config(dir, |cfg| {
        cfg.as_object_mut().unwrap().remove("rope_scaling");
    })
}

/// Writes `hf` as llama.cpp's converter would for GGUF architecture `arch` (llama: q/k rows permuted
/// into its rotary layout; qwen2/qwen3: HF order), f32 tensors, the tokenizer in metadata.
fn to_gguf(hf: &Path, out: &Path, arch: &str) {
    let cfg: serde_json::Value =
        serde_json::from_slice(&std::fs::read(hf.join("config.json")).unwrap()).unwrap();
    let tj: serde_json::Value =
        serde_json::from_slice(&std::fs::read(hf.join("tokenizer.json")).unwrap()).unwrap();
    let tc: serde_json::Value =
        serde_json::from_slice(&std::fs::read(hf.join("tokenizer_config.json")).unwrap()).unwrap();
    let vocab = tj["model"]["vocab"].as_object().unwrap();
    let mut tokens = vec![String::new(); vocab.len()];
    for (t, id) in vocab {
        tokens[id.as_u64().unwrap() as usize] = t.clone();
    }
    let mut types = vec![1i32; tokens.len()];
    for a in tj["added_tokens"].as_array().unwrap() {
        types[a["id"].as_u64().unwrap() as usize] = 3;
    }
    let merges: Vec<String> = tj["model"]["merges"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| {
            m.as_array()
                .map(|p| format!("{} {}", p[0].as_str().unwrap(), p[1].as_str().unwrap()))
                .unwrap_or_else(|| m.as_str().unwrap().into())
        })
        .collect();
    let u = |k: &str| Meta::U32(cfg[k].as_u64().unwrap() as u32);
    let key = |k: &str| format!("{arch}.{k}");
    let mut meta: Vec<(String, Meta)> = vec![
        ("general.architecture".into(), Meta::Str(arch.into())),
        (key("block_count"), u("num_hidden_layers")),
        (key("context_length"), u("max_position_embeddings")),
        (key("embedding_length"), u("hidden_size")),
        (key("feed_forward_length"), u("intermediate_size")),
        (key("attention.head_count"), u("num_attention_heads")),
        (key("attention.head_count_kv"), u("num_key_value_heads")),
        (key("rope.freq_base"), Meta::F32(cfg["rope_theta"].as_f64().unwrap() as f32)),
        (
            key("attention.layer_norm_rms_epsilon"),
            Meta::F32(cfg["rms_norm_eps"].as_f64().unwrap() as f32),
        ),
    ];
    if let Some(hd) = cfg["head_dim"].as_u64() {
        meta.push((key("attention.key_length"), Meta::U32(hd as u32)));
        meta.push((key("attention.value_length"), Meta::U32(hd as u32)));
    }
    let tokenizer = vec![
        ("tokenizer.ggml.model", Meta::Str("gpt2".into())),
        ("tokenizer.ggml.pre", Meta::Str("smollm".into())),
        ("tokenizer.ggml.tokens", Meta::Strs(tokens)),
        ("tokenizer.ggml.token_type", Meta::I32s(types)),
        ("tokenizer.ggml.merges", Meta::Strs(merges)),
        ("tokenizer.ggml.bos_token_id", u("bos_token_id")),
        ("tokenizer.ggml.eos_token_id", u("eos_token_id")),
        ("tokenizer.ggml.add_bos_token", Meta::Bool(false)),
        ("tokenizer.chat_template", Meta::Str(tc["chat_template"].as_str().unwrap().into())),
    ];
    meta.extend(tokenizer.into_iter().map(|(k, v)| (k.to_owned(), v)));
    let (heads, kv_heads) = (
        cfg["num_attention_heads"].as_u64().unwrap() as usize,
        cfg["num_key_value_heads"].as_u64().unwrap() as usize,
    );
    // HF name suffix → (GGUF suffix, heads whose rows llama.cpp permutes for the llama architecture).
    let per_layer: [(&str, &str, Option<usize>); 14] = [
        ("input_layernorm.weight", "attn_norm.weight", None),
        ("self_attn.q_proj.weight", "attn_q.weight", Some(heads)),
        ("self_attn.k_proj.weight", "attn_k.weight", Some(kv_heads)),
        ("self_attn.v_proj.weight", "attn_v.weight", None),
        ("self_attn.o_proj.weight", "attn_output.weight", None),
        ("self_attn.q_proj.bias", "attn_q.bias", Some(heads)),
        ("self_attn.k_proj.bias", "attn_k.bias", Some(kv_heads)),
        ("self_attn.v_proj.bias", "attn_v.bias", None),
        ("self_attn.q_norm.weight", "attn_q_norm.weight", None),
        ("self_attn.k_norm.weight", "attn_k_norm.weight", None),
        ("post_attention_layernorm.weight", "ffn_norm.weight", None),
        ("mlp.gate_proj.weight", "ffn_gate.weight", None),
        ("mlp.up_proj.weight", "ffn_up.weight", None),
        ("mlp.down_proj.weight", "ffn_down.weight", None),
    ];
    let mut tensors = Vec::new();
    for (name, shape, mut data) in hf_tensors(hf) {
        let gguf = match name.as_str() {
            "model.embed_tokens.weight" => "token_embd.weight".to_owned(),
            "model.norm.weight" => "output_norm.weight".to_owned(),
            "lm_head.weight" => "output.weight".to_owned(),
            n => {
                let rest = n.strip_prefix("model.layers.").unwrap_or_else(|| panic!("{n}"));
                let (i, suffix) = rest.split_once('.').unwrap();
                let &(_, g, permute) = per_layer
                    .iter()
                    .find(|p| p.0 == suffix)
                    .unwrap_or_else(|| panic!("no GGUF name for {n}"));
                if let (Some(h), "llama") = (permute, arch) {
                    let cols = shape.get(1).copied().unwrap_or(1);
                    data = permute_rows(&data, shape[0], cols, h);
                }
                format!("blk.{i}.{g}")
            }
        };
        tensors.push((gguf, shape, data));
    }
    let meta: Vec<(&str, Meta)> = meta.iter().map(|(k, v)| (k.as_str(), v.clone())).collect();
    write_gguf(out, &meta, &tensors);
}

#[test]
fn gguf_and_hf_stores_of_the_same_weights_give_the_same_tokens() {
    let dir = tempfile::tempdir().unwrap();
    let hf = hf_without_rope_scaling(dir.path());
    let gguf = dir.path().join("tiny.gguf");
    to_gguf(&hf, &gguf, "llama");
    let hf_store = dir.path().join("hf-store");
    let gguf_store = dir.path().join("gguf-store");
    layerstream(&["import", hf.to_str().unwrap(), hf_store.to_str().unwrap()]);
    layerstream(&["import", gguf.to_str().unwrap(), gguf_store.to_str().unwrap()]);
    let a = layerstream_model::Store::open(&hf_store).unwrap();
    let b = layerstream_model::Store::open(&gguf_store).unwrap();
    // The q/k rows came back in HF order: the layer files hold identical bytes.
    assert_eq!(
        a.manifest.file("layer_000.bin").unwrap().tensor("q"),
        b.manifest.file("layer_000.bin").unwrap().tensor("q")
    );
    let (ta, tb) = (a.tokenizer().unwrap(), b.tokenizer().unwrap());
    for g in goldens("tiny-llama") {
        assert_eq!(ta.encode(&g.prompt_text).unwrap(), tb.encode(&g.prompt_text).unwrap());
        let ga = run_golden(&hf_store, &g);
        let gb = run_golden(&gguf_store, &g);
        assert_eq!(ga.len(), g.greedy_ids.len());
        assert_eq!(ga, gb, "{}: HF and GGUF stores disagree", g.name);
    }
    // Chat rendering from GGUF metadata equals the HF tokenizer_config template.
    let chat = |s: &Path| {
        last_json(&layerstream(&[
            "run",
            "--model",
            s.to_str().unwrap(),
            "--chat",
            "hi",
            "--max-new-tokens",
            "1",
            "--json",
        ]))["input_ids"]
            .clone()
    };
    assert_eq!(chat(&hf_store), chat(&gguf_store));
}

/// GGUF files of the qwen2 (q/k/v biases, untied head) and qwen3 (q/k norms, explicit head size,
/// tied head) architectures, written as llama.cpp's converter writes them (no q/k permutation for
/// these), import into stores whose tokens equal transformers' greedy goldens and the HF store's.
#[test]
fn qwen2_and_qwen3_gguf_files_give_transformers_tokens() {
    for (model, arch) in [("tiny-qwen2", "qwen2"), ("tiny-qwen3", "qwen3")] {
        let dir = tempfile::tempdir().unwrap();
        let gguf = dir.path().join("m.gguf");
        to_gguf(&model_dir(model), &gguf, arch);
        let (hf_store, gguf_store) = (dir.path().join("hf"), dir.path().join("gguf"));
        layerstream(&["import", model_dir(model).to_str().unwrap(), hf_store.to_str().unwrap()]);
        layerstream(&["import", gguf.to_str().unwrap(), gguf_store.to_str().unwrap()]);
        let cfg = layerstream_model::Store::open(&gguf_store).unwrap().manifest.config;
        assert_eq!(cfg.qk_norm, arch == "qwen3", "{model}");
        for g in goldens(model) {
            let got = run_golden(&gguf_store, &g);
            assert_greedy(model, &g, &got);
            assert_eq!(
                got,
                run_golden(&hf_store, &g),
                "{model}/{}: GGUF and HF stores disagree",
                g.name
            );
        }
    }
}
