//! A GGUF made from an HF checkpoint (as llama.cpp's converter would: q/k rows permuted, tokenizer in
//! metadata) imports into a store that gives the same tokenization and the same tokens as the store
//! imported from the HF directory itself.

use layerstream_tests::gguf_writer::{permute_rows, write_gguf, Meta};
use layerstream_tests::*;
use std::path::Path;

fn f32s(st: &safetensors::SafeTensors, name: &str) -> (Vec<usize>, Vec<f32>) {
    let t = st.tensor(name).unwrap();
    assert_eq!(t.dtype(), safetensors::Dtype::F32);
    (
        t.shape().to_vec(),
        t.data().chunks_exact(4).map(|c| f32::from_le_bytes(c.try_into().unwrap())).collect(),
    )
}

/// tiny-llama without its llama3 rope scaling (GGUF carries that as a tensor we don't import).
fn hf_without_rope_scaling(dir: &Path) -> std::path::PathBuf {
    copy_hf_with_config(dir, |cfg| {
        cfg.as_object_mut().unwrap().remove("rope_scaling");
    })
}

fn to_gguf(hf: &Path, out: &Path) {
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
    let meta = vec![
        ("general.architecture", Meta::Str("llama".into())),
        ("llama.block_count", u("num_hidden_layers")),
        ("llama.context_length", u("max_position_embeddings")),
        ("llama.embedding_length", u("hidden_size")),
        ("llama.feed_forward_length", u("intermediate_size")),
        ("llama.attention.head_count", u("num_attention_heads")),
        ("llama.attention.head_count_kv", u("num_key_value_heads")),
        ("llama.rope.freq_base", Meta::F32(cfg["rope_theta"].as_f64().unwrap() as f32)),
        (
            "llama.attention.layer_norm_rms_epsilon",
            Meta::F32(cfg["rms_norm_eps"].as_f64().unwrap() as f32),
        ),
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
    let bytes = std::fs::read(hf.join("model.safetensors")).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let (heads, kv_heads) = (
        cfg["num_attention_heads"].as_u64().unwrap() as usize,
        cfg["num_key_value_heads"].as_u64().unwrap() as usize,
    );
    let mut tensors = Vec::new();
    let mut add = |gguf: String, hf: &str, permute: Option<usize>| {
        let (shape, mut data) = f32s(&st, hf);
        if let Some(h) = permute {
            data = permute_rows(&data, shape[0], shape[1], h);
        }
        tensors.push((gguf, shape, data));
    };
    add("token_embd.weight".into(), "model.embed_tokens.weight", None);
    add("output_norm.weight".into(), "model.norm.weight", None);
    for i in 0..cfg["num_hidden_layers"].as_u64().unwrap() {
        let hf = |s: &str| format!("model.layers.{i}.{s}");
        let g = |s: &str| format!("blk.{i}.{s}");
        add(g("attn_norm.weight"), &hf("input_layernorm.weight"), None);
        add(g("attn_q.weight"), &hf("self_attn.q_proj.weight"), Some(heads));
        add(g("attn_k.weight"), &hf("self_attn.k_proj.weight"), Some(kv_heads));
        add(g("attn_v.weight"), &hf("self_attn.v_proj.weight"), None);
        add(g("attn_output.weight"), &hf("self_attn.o_proj.weight"), None);
        add(g("ffn_norm.weight"), &hf("post_attention_layernorm.weight"), None);
        add(g("ffn_gate.weight"), &hf("mlp.gate_proj.weight"), None);
        add(g("ffn_up.weight"), &hf("mlp.up_proj.weight"), None);
        add(g("ffn_down.weight"), &hf("mlp.down_proj.weight"), None);
    }
    write_gguf(out, &meta, &tensors);
}

#[test]
fn gguf_and_hf_stores_of_the_same_weights_give_the_same_tokens() {
    let dir = tempfile::tempdir().unwrap();
    let hf = hf_without_rope_scaling(dir.path());
    let gguf = dir.path().join("tiny.gguf");
    to_gguf(&hf, &gguf);
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
