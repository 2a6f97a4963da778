//! DeepSeek-V3 (multi-head latent attention with q/kv LoRA and interleaved decoupled RoPE, YaRN
//! with mscale, sigmoid group-limited routing with a score-correction bias, a shared expert, a
//! dense first layer) from the hub's layout: the KV cache holds the latent and the RoPE key only,
//! `run` equals transformers' goldens, and `up` streams the routed experts over two workers.

use layerstream_tests::stack::*;
use layerstream_tests::*;

const NAME: &str = "tiny-deepseek-v3";

/// llama.cpp's `deepseek2` file of the tiny checkpoint (bf16; tests/fixtures/gguf/gen.sh).
fn converted() -> std::path::PathBuf {
    fixtures().join("gguf").join("tiny-deepseek-v3-bf16.gguf")
}

#[test]
fn tiny_deepseek_v3_matches_transformers() {
    check(&model_dir(NAME));
}

/// The GGUF's metadata maps back to the HF config's fields (parsed by the same code), its split
/// `attn_k_b`/`attn_v_b` are the importer's `k_b`/`v_b`: the same store, transformers' tokens.
#[test]
fn deepseek_v3_gguf_from_llama_cpp_matches_transformers() {
    let dir = tempfile::tempdir().unwrap();
    let hf = import(&model_dir(NAME), &dir.path().join("hf")).manifest.config;
    let gguf = check(&converted()).manifest.config;
    // The converter does not record the MTP layer the HF config declares (neither imports it).
    let no_mtp = |m: Option<layerstream_model::config_mla::MlaConfig>| {
        m.map(|m| layerstream_model::config_mla::MlaConfig { mtp_layers_skipped: 0, ..m })
    };
    assert_eq!(no_mtp(gguf.mla), no_mtp(hf.mla));
    assert_eq!((gguf.moe, gguf.rope), (hf.moe, hf.rope));
}

fn check(src: &std::path::Path) -> layerstream_model::Store {
    let dir = tempfile::tempdir().unwrap();
    let store = import(src, dir.path());
    store.verify().unwrap();
    let cfg = &store.manifest.config;
    let mla = cfg.mla.clone().expect("MLA");
    assert_eq!((mla.kv_lora_rank, mla.qk_rope_head_dim, mla.q_lora_rank), (32, 16, Some(48)));
    let m = cfg.moe.clone().expect("experts");
    assert_eq!((m.dense_layers.clone(), m.shared_intermediate), (vec![0], 32));
    // One cached row of latent + RoPE key per position and layer: 48 f32 values, where the same
    // heads stored in full would take 4 heads × (48 keys + 32 values).
    assert_eq!(
        layerstream_serving::plan::kv_bytes_per_token_layer(
            &store.manifest,
            layerstream_model::DType::F32
        ),
        48 * 4
    );
    let layer = store.manifest.file(&layerstream_model::layout::layer_file(1)).unwrap();
    for t in ["k_b", "v_b", "kv_a", "k_rope_a", "router", "router_correction", "shared_gate"] {
        assert!(layer.tensor(t).is_some(), "layer 1 has {t}");
    }
    assert!(store.manifest.file(&layerstream_model::layout::expert_file(0, 0)).is_none());
    check_model_against_goldens(NAME, &store);
    store
}

/// Two workers, a device expert cache smaller than a layer's 16 experts: transformers' tokens,
/// from HF and from the GGUF.
#[test]
fn deepseek_v3_streams_experts_over_two_workers() {
    streamed(&model_dir(NAME));
}

#[test]
fn deepseek_v3_gguf_streams_experts_over_two_workers() {
    streamed(&converted());
}

fn streamed(src: &std::path::Path) {
    let dir = tempfile::tempdir().unwrap();
    let store = import(src, dir.path());
    let stack = Stack::up(&store.dir, &["--workers", "2", "--expert-cache", "6"]);
    for st in greedy_goldens_through(&stack, NAME) {
        assert!(st["experts_missed"].as_u64().unwrap() > 0, "{st}");
    }
    stack.shutdown();
}

/// Inconsistent ranks or head sizes, impossible groups: refused at import naming the field or the
/// tensor, nothing left behind.
#[test]
fn bad_deepseek_configs_name_the_field_or_tensor() {
    for (field, value, want) in [
        ("topk_group", serde_json::json!(5), "topk_group"),
        ("n_group", serde_json::json!(3), "n_group"),
        ("kv_lora_rank", serde_json::json!(24), "kv_a_proj_with_mqa"),
        ("qk_nope_head_dim", serde_json::json!(24), "qk_head_dim"),
        ("v_head_dim", serde_json::json!(16), "kv_b_proj"),
        ("q_lora_rank", serde_json::json!(40), "q_a_proj"),
    ] {
        let err = import_error_with(NAME, field, value);
        assert!(err.contains(want), "{field}: {err}");
    }
}

/// DeepSeek-V3 as deepseek-ai publishes it: FP8 e4m3 weights with 128×128 `weight_scale_inv`
/// blocks (tests/fixtures/deepseek/gen_fp8.py). Every projection stays FP8 as stored, except the key
/// blocks of `kv_b_proj`, which the absorbed form needs transposed (decoded to f32 first); the
/// tokens equal transformers' on the blocks' values.
#[test]
fn deepseek_v3_fp8_checkpoint_matches_transformers() {
    let name = "tiny-deepseek-v3-fp8";
    let dir = tempfile::tempdir().unwrap();
    let store = import(&model_dir(name), dir.path());
    let layer = store.manifest.file(&layerstream_model::layout::layer_file(1)).unwrap();
    let dtype = |t: &str| layer.tensor(t).unwrap().dtype;
    use layerstream_model::DType;
    assert_eq!(
        (dtype("q_nope_b"), dtype("v_b"), dtype("o")),
        (DType::Fp8E4m3B128, DType::Fp8E4m3B128, DType::Fp8E4m3B128)
    );
    assert_eq!(dtype("k_b"), DType::F32);
    let expert = store.manifest.file(&layerstream_model::layout::expert_file(1, 3)).unwrap();
    assert_eq!(expert.tensor("down").unwrap().dtype, DType::Fp8E4m3B128);
    check_model_against_goldens(name, &store);
}
