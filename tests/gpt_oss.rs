//! gpt-oss (attention sinks, sliding-window layers alternating with full ones, biased q/k/v/o,
//! router and experts, the clamped SwiGLU, YaRN) from the hub's stacked-expert layout: the store
//! splits the experts into one file each, `run` equals transformers' goldens, and `up` streams the
//! experts a step needs over two workers with the same tokens.

use layerstream_tests::stack::*;
use layerstream_tests::*;

const NAME: &str = "tiny-gpt-oss";

/// The GGUF llama.cpp's convert_hf_to_gguf.py wrote from the tiny checkpoint (bf16, lossless;
/// tests/fixtures/gguf/gen.sh): `gpt-oss` with stacked `ffn_*_exps` and their biases.
fn converted() -> std::path::PathBuf {
    fixtures().join("gguf").join("tiny-gpt-oss-bf16.gguf")
}

#[test]
fn tiny_gpt_oss_matches_transformers() {
    check(NAME, &model_dir(NAME));
}

#[test]
fn gpt_oss_gguf_from_llama_cpp_matches_transformers() {
    check(NAME, &converted());
}

/// llama.cpp's MXFP4_MOE file (llama-quantize: experts MXFP4, other matrices Q8_0), against
/// transformers on the weights gguf-py dequantizes from it (tests/fixtures/gpt_oss/gen_gguf_mxfp4.py).
#[test]
fn gpt_oss_mxfp4_moe_gguf_matches_its_dequantized_weights() {
    let name = "tiny-gpt-oss-MXFP4_MOE";
    let store = check(name, &fixtures().join("gguf").join(format!("{name}.gguf")));
    let f = store.manifest.file(&layerstream_model::layout::expert_file(1, 3)).unwrap();
    assert_eq!(f.tensor("down").unwrap().dtype, layerstream_model::DType::Mxfp4);
}

/// The hub's MXFP4 layout (`quant_method: "mxfp4"`, experts as `*_blocks` + e8m0 `*_scales`,
/// tests/fixtures/gpt_oss/gen_mxfp4.py): the experts stored as MXFP4 rows, computed as stored,
/// against transformers' goldens on that checkpoint.
#[test]
fn gpt_oss_mxfp4_checkpoint_matches_transformers() {
    let name = "tiny-gpt-oss-mxfp4";
    let store = check(name, &model_dir(name));
    let f = store.manifest.file(&layerstream_model::layout::expert_file(2, 7)).unwrap();
    for t in ["gate", "up", "down"] {
        assert_eq!(f.tensor(t).unwrap().dtype, layerstream_model::DType::Mxfp4, "{t}");
    }
    assert_eq!(f.tensor("gate_bias").unwrap().dtype, layerstream_model::DType::Bf16);
}

fn check(name: &str, src: &std::path::Path) -> layerstream_model::Store {
    let dir = tempfile::tempdir().unwrap();
    let store = import(src, dir.path());
    store.verify().unwrap();
    let cfg = &store.manifest.config;
    assert_eq!((cfg.sliding_window, cfg.full_attention_layers.clone()), (Some(8), vec![1, 3]));
    assert!(cfg.attn_sinks);
    let m = cfg.moe.clone().expect("experts");
    assert!(m.bias && m.swiglu_clamp.is_some());
    for l in 0..cfg.num_layers {
        let layer = store.manifest.file(&layerstream_model::layout::layer_file(l)).unwrap();
        for t in ["router", "router_bias", "sinks", "q_bias", "o_bias"] {
            assert!(layer.tensor(t).is_some(), "layer {l} has {t}");
        }
        let f = store.manifest.file(&layerstream_model::layout::expert_file(l, 5)).unwrap();
        let names: Vec<&str> = f.tensors.iter().map(|t| t.name.as_str()).collect();
        assert_eq!(names, ["gate", "up", "down", "gate_bias", "up_bias", "down_bias"]);
    }
    check_model_against_goldens(name, &store);
    store
}

/// Two workers, a device expert cache smaller than a layer's experts: transformers' tokens, and
/// only the experts the steps chose moved.
#[test]
fn gpt_oss_streams_experts_over_two_workers() {
    streamed(&model_dir(NAME));
}

#[test]
fn gpt_oss_gguf_streams_experts_over_two_workers() {
    streamed(&converted());
}

fn streamed(src: &std::path::Path) {
    let dir = tempfile::tempdir().unwrap();
    let store = import(src, dir.path());
    let stack = Stack::up(&store.dir, &["--workers", "2", "--expert-cache", "3"]);
    for st in greedy_goldens_through(&stack, NAME) {
        assert!(st["experts_missed"].as_u64().unwrap() > 0, "{st}");
    }
    stack.shutdown();
}

/// Bad gpt-oss configs are refused at import, naming the field.
#[test]
fn bad_gpt_oss_configs_name_the_field() {
    for (field, value, want) in [
        ("layer_types", serde_json::json!(["full_attention"]), "layer_types"),
        (
            "rope_scaling",
            serde_json::json!({"rope_type": "yarn", "factor": 32.0}),
            "original_max_position_embeddings",
        ),
    ] {
        let err = import_error_with(NAME, field, value);
        assert!(err.contains(want), "{field}: {err}");
    }
}
