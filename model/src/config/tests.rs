//! Configs parsed from transformers' config.json shapes.
use super::*;
use serde_json::json;

fn base() -> Value {
    json!({"architectures": ["LlamaForCausalLM"], "hidden_size": 64, "intermediate_size": 160,
           "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
           "vocab_size": 100, "rms_norm_eps": 1e-5, "eos_token_id": [2, 3]})
}

#[test]
fn both_rope_styles_parse_the_same() {
    let mut old = base();
    old["rope_theta"] = json!(500000.0);
    old["rope_scaling"] = json!({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 64});
    let mut new = base();
    new["rope_parameters"] = json!({"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
        "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 64});
    let a = ModelConfig::from_hf(&old).unwrap();
    let b = ModelConfig::from_hf(&new).unwrap();
    assert_eq!(a, b);
    assert_eq!(a.rope.theta, 500000.0);
    assert!(matches!(a.rope.scaling, Some(RopeScaling::Llama3 { .. })));
    assert_eq!(a.eos_token_ids, vec![2, 3]);
    assert_eq!(a.head_dim, 16);
}

#[test]
fn unknown_architecture_lists_supported() {
    let mut v = base();
    v["architectures"] = json!(["GPTNeoXForCausalLM"]);
    let e = ModelConfig::from_hf(&v).unwrap_err().to_string();
    assert!(e.contains("GPTNeoXForCausalLM") && e.contains("Qwen3ForCausalLM"), "{e}");
}

/// Qwen3-MoE: sparse layers are those not in `mlp_only_layers` with (i + 1) % step == 0, as in
/// transformers; Mixtral: every layer, renormalised; impossible expert counts are named.
#[test]
fn moe_sections_parse_as_transformers_reads_them() {
    let mut v = base();
    v["architectures"] = json!(["Qwen3MoeForCausalLM"]);
    v["num_hidden_layers"] = json!(6);
    v["num_experts"] = json!(8);
    v["num_experts_per_tok"] = json!(2);
    v["moe_intermediate_size"] = json!(32);
    v["decoder_sparse_step"] = json!(2);
    v["mlp_only_layers"] = json!([3]);
    let c = ModelConfig::from_hf(&v).unwrap();
    let m = c.moe.clone().unwrap();
    assert_eq!(m.dense_layers, vec![0, 2, 3, 4], "odd layers sparse, but 3 is MLP-only");
    assert!(!m.norm_topk_prob && c.qk_norm);
    assert!(c.moe_at(1).is_some() && c.moe_at(3).is_none() && c.moe_at(5).is_some());
    let mut huge = v.clone();
    huge["num_experts"] = json!(4096);
    huge["num_hidden_layers"] = json!(1 << 21);
    huge["mlp_only_layers"] = json!([]);
    let e = ModelConfig::from_hf(&huge).unwrap_err().to_string();
    assert!(e.contains("too many files to number"), "{e}");
    v["num_experts_per_tok"] = json!(9);
    let e = ModelConfig::from_hf(&v).unwrap_err().to_string();
    assert!(e.contains("num_experts_per_tok") && e.contains("1..=8"), "{e}");
    let mut x = base();
    x["architectures"] = json!(["MixtralForCausalLM"]);
    x["num_local_experts"] = json!(4);
    x["num_experts_per_tok"] = json!(2);
    let m = ModelConfig::from_hf(&x).unwrap().moe.unwrap();
    assert!(m.norm_topk_prob && m.dense_layers.is_empty() && m.expert_intermediate == 160);
    x.as_object_mut().unwrap().remove("num_local_experts");
    let e = ModelConfig::from_hf(&x).unwrap_err().to_string();
    assert!(e.contains("num_local_experts"), "{e}");
}

#[test]
fn bad_gqa_is_rejected() {
    let mut v = base();
    v["num_key_value_heads"] = json!(3);
    assert!(ModelConfig::from_hf(&v).unwrap_err().to_string().contains("num_key_value_heads"));
}
