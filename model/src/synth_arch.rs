//! `synth` shapes of the biggest open mixtures of experts, from their published `config.json`
//! (parsed as an import would parse it): DeepSeek-V3 (MLA, 256 routed experts of which 8 within 4
//! of 8 groups, a shared expert) and gpt-oss-120b/20b (sinks, alternating sliding window, 128/32
//! experts with biases). Fewer layers keep DeepSeek-V3's dense first layer (one instead of three,
//! so a short store still has experts) and gpt-oss's sliding/full alternation.

use crate::config::ModelConfig;
use crate::error::Result;
use serde_json::{json, Value};

/// The shape names this module knows.
pub const ARCH_SHAPES: [&str; 3] = ["deepseek-v3", "gpt-oss-120b", "gpt-oss-20b"];

/// DeepSeek-V3's `config.json` (the hub's, the fields layerstream reads).
fn deepseek_v3() -> Value {
    json!({
        "architectures": ["DeepseekV3ForCausalLM"], "hidden_size": 7168, "intermediate_size": 18432,
        "moe_intermediate_size": 2048, "num_hidden_layers": 61, "num_attention_heads": 128,
        "num_key_value_heads": 128, "n_shared_experts": 1, "n_routed_experts": 256,
        "routed_scaling_factor": 2.5, "kv_lora_rank": 512, "q_lora_rank": 1536,
        "qk_rope_head_dim": 64, "v_head_dim": 128, "qk_nope_head_dim": 128, "n_group": 8,
        "topk_group": 4, "num_experts_per_tok": 8, "first_k_dense_replace": 3,
        "norm_topk_prob": true, "scoring_func": "sigmoid", "max_position_embeddings": 163840,
        "rope_theta": 10000, "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40,
            "mscale": 1.0, "mscale_all_dim": 1.0, "original_max_position_embeddings": 4096,
            "type": "yarn"},
        "rms_norm_eps": 1e-6, "vocab_size": 129280, "bos_token_id": 0, "eos_token_id": 1,
        "tie_word_embeddings": false, "hidden_act": "silu", "num_nextn_predict_layers": 1
    })
}

/// gpt-oss's `config.json` with `layers` layers and `experts` experts (120b: 36 and 128; 20b: 24
/// and 32).
fn gpt_oss(layers: usize, experts: usize) -> Value {
    json!({
        "architectures": ["GptOssForCausalLM"], "hidden_size": 2880, "intermediate_size": 2880,
        "num_hidden_layers": layers, "num_attention_heads": 64, "num_key_value_heads": 8,
        "head_dim": 64, "num_local_experts": experts, "num_experts_per_tok": 4,
        "sliding_window": 128, "vocab_size": 201088, "rope_theta": 150000,
        "rope_scaling": {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
            "original_max_position_embeddings": 4096, "truncate": false},
        "swiglu_limit": 7.0, "max_position_embeddings": 131072, "rms_norm_eps": 1e-5,
        "attention_bias": true, "eos_token_id": 200002, "bos_token_id": 199998,
        "tie_word_embeddings": false, "hidden_act": "silu"
    })
}

/// The config of shape `name` with `layers` layers (default: the real count), or `None` if this
/// module does not know `name`.
pub fn arch_config(name: &str, layers: Option<usize>) -> Option<Result<ModelConfig>> {
    let mut v = match name {
        "deepseek-v3" => deepseek_v3(),
        "gpt-oss-120b" => gpt_oss(36, 128),
        "gpt-oss-20b" => gpt_oss(24, 32),
        _ => return None,
    };
    if let Some(n) = layers {
        v["num_hidden_layers"] = json!(n);
        if name == "deepseek-v3" && n < 61 {
            v["first_k_dense_replace"] = json!(1);
        }
    }
    Some(ModelConfig::from_hf(&v))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The published sizes come out as the papers give them: DeepSeek-V3 caches 576 values per
    /// token and layer (vs 128 × (192 + 128) in full heads), gpt-oss alternates its window.
    #[test]
    fn published_shapes() {
        let d = arch_config("deepseek-v3", Some(4)).unwrap().unwrap();
        assert_eq!(d.kv_cache_rows(), (576, 1));
        let m = d.moe.as_ref().unwrap();
        assert_eq!(
            (m.experts, m.top_k, m.dense_layers.clone(), m.shared_intermediate),
            (256, 8, vec![0], 2048)
        );
        let g = arch_config("gpt-oss-120b", Some(4)).unwrap().unwrap();
        assert_eq!((g.full_attention_layers.clone(), g.sliding_window), (vec![1, 3], Some(128)));
        assert_eq!(g.kv_cache_rows(), (512, 2));
        assert!(arch_config("gpt-5", None).is_none());
    }
}
