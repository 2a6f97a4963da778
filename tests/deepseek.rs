//! DeepSeek-V3 (multi-head latent attention with q/kv LoRA and interleaved decoupled RoPE, YaRN
//! with mscale, sigmoid group-limited routing with a score-correction bias, a shared expert, a
//! dense first layer) from the hub's layout: the KV cache holds the latent and the RoPE key only,
//! `run` equals transformers' goldens, and `up` streams the routed experts over two workers.

use layerstream_tests::stack::*;
use layerstream_tests::*;

const NAME: &str = "tiny-deepseek-v3";

#[test]
fn tiny_deepseek_v3_matches_transformers() {
    let dir = tempfile::tempdir().unwrap();
    let store = import(&model_dir(NAME), dir.path());
    store.verify().unwrap();
    let cfg = &store.manifest.config;
    let mla = cfg.mla.clone().expect("MLA");
    assert_eq!((mla.kv_lora_rank, mla.qk_rope_head_dim, mla.q_lora_rank), (32, 16, Some(48)));
    let m = cfg.moe.clone().expect("experts");
    assert_eq!((m.dense_layers.clone(), m.shared_intermediate), (vec![0], 32));
    // One cached row of latent + RoPE key per position and layer: 48 f32 values, where the same
    // heads stored in full would take 4 heads × (48 keys + 32 values).
    assert_eq!(
        layerstream_model::plan::kv_bytes_per_token_layer(
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
}

/// Two workers, a device expert cache smaller than a layer's 16 experts: transformers' tokens.
#[test]
fn deepseek_v3_streams_experts_over_two_workers() {
    let dir = tempfile::tempdir().unwrap();
    let store = import(&model_dir(NAME), dir.path());
    let stack = Stack::up(&store.dir, &["--workers", "2", "--expert-cache", "6"]);
    for st in greedy_goldens_through(&stack, NAME) {
        assert!(st["experts_missed"].as_u64().unwrap() > 0, "{st}");
    }
    stack.shutdown();
}
