//! llama.cpp's `deepseek2` GGUF files (DeepSeek-V3 and the models built on it, as its
//! convert_hf_to_gguf.py writes them) read as the `config.json` they came from: the metadata is
//! mapped back to transformers' field names and parsed by the same code as an HF import, so the two
//! formats cannot disagree about what a field means.

use crate::config::ModelConfig;
use crate::error::{Error, Result};
use crate::gguf::{GgufFile, Value as G};
use serde_json::{json, Value};

impl GgufFile {
    /// The config of a `deepseek2` file. Sigmoid routing only: a file whose
    /// `expert_gating_func` is softmax (DeepSeek-V2) is refused; one without the key is read as
    /// sigmoid when it has the V3 score-correction bias (`exp_probs_b`).
    pub(crate) fn deepseek2_config(&self) -> Result<ModelConfig> {
        let m = Meta(self);
        let (get, or) = (|k: &str| m.get(k), |k: &str, d: Value| m.or(k, d));
        let (num, u) = (|k: &str| m.num(k), |k: &str| m.u(k));
        m.check_sigmoid_routing()?;
        let rope = u("rope.dimension_count")?;
        let k_len = u("attention.key_length_mla").or_else(|_| u("attention.key_length"))?;
        let v_len = u("attention.value_length_mla").or_else(|_| u("attention.value_length"))?;
        if k_len <= rope {
            return Err(Error::config(
                Meta::key("attention.key_length_mla"),
                format!("{k_len} leaves no non-RoPE part beside {rope} RoPE dims"),
            ));
        }
        let heads = u("attention.head_count")?;
        let vocab = match get("vocab_size").and_then(G::as_u64) {
            Some(v) => v as usize,
            None => self
                .metadata
                .get("tokenizer.ggml.tokens")
                .and_then(G::as_array)
                .map_or(0, |a| a.len()),
        };
        let rope_scaling = m.rope_scaling()?;
        let id =
            |k: &str| self.metadata.get(k).and_then(G::as_u64).map_or(Value::Null, |v| json!(v));
        let v = json!({
            "architectures": ["DeepseekV3ForCausalLM"],
            "hidden_size": u("embedding_length")?,
            "intermediate_size": u("feed_forward_length")?,
            "moe_intermediate_size": u("expert_feed_forward_length")?,
            "num_hidden_layers": u("block_count")?,
            "num_attention_heads": heads,
            "num_key_value_heads": heads,
            "n_shared_experts": or("expert_shared_count", json!(0)),
            "n_routed_experts": u("expert_count")?,
            "num_experts_per_tok": u("expert_used_count")?,
            "n_group": or("expert_group_count", json!(1)),
            "topk_group": or("expert_group_used_count", json!(1)),
            "routed_scaling_factor": or("expert_weights_scale", json!(1.0)),
            "norm_topk_prob": get("expert_weights_norm").and_then(G::as_bool).unwrap_or(false),
            "first_k_dense_replace": or("leading_dense_block_count", json!(0)),
            "kv_lora_rank": u("attention.kv_lora_rank")?,
            "q_lora_rank": or("attention.q_lora_rank", Value::Null),
            "qk_rope_head_dim": rope,
            "qk_nope_head_dim": k_len - rope,
            "v_head_dim": v_len,
            "max_position_embeddings": u("context_length")?,
            "rope_theta": or("rope.freq_base", json!(10000.0)),
            "rope_scaling": rope_scaling,
            // f32 metadata widened to f64 carries float noise; round it back.
            "rms_norm_eps": (num("attention.layer_norm_rms_epsilon")? as f32) as f64,
            "vocab_size": vocab,
            "bos_token_id": id("tokenizer.ggml.bos_token_id"),
            "eos_token_id": id("tokenizer.ggml.eos_token_id"),
            "tie_word_embeddings": self.tensor("output.weight").is_none(),
            // llama.cpp rotates adjacent pairs (its NORM RoPE) of rows the converter kept as the
            // hub stores them: interleaved.
            "rope_interleave": true,
            "num_nextn_predict_layers": or("nextn_predict_layers", json!(0)),
        });
        ModelConfig::from_hf(&v)
    }
}

/// The `deepseek2.` metadata of a GGUF file, read as config.json's values.
struct Meta<'a>(&'a GgufFile);

impl Meta<'_> {
    /// The full name of field `k`.
    fn key(k: &str) -> String {
        format!("deepseek2.{k}")
    }

    fn get(&self, k: &str) -> Option<&G> {
        self.0.metadata.get(&Self::key(k))
    }

    /// A field as the JSON value config.json would hold (numbers and booleans), or `default`.
    fn or(&self, k: &str, default: Value) -> Value {
        match self.get(k) {
            Some(G::U64(v)) => json!(v),
            Some(G::I64(v)) => json!(v),
            Some(G::F64(v)) => json!(v),
            Some(G::Bool(v)) => json!(v),
            _ => default,
        }
    }

    fn num(&self, k: &str) -> Result<f64> {
        self.get(k).and_then(G::as_f64).ok_or_else(|| {
            Error::config(Self::key(k), "missing from GGUF metadata or not a number")
        })
    }

    fn u(&self, k: &str) -> Result<usize> {
        self.get(k).and_then(G::as_u64).map(|v| v as usize).ok_or_else(|| {
            Error::config(Self::key(k), "missing from GGUF metadata or not an integer")
        })
    }

    /// Sigmoid routing only: a file whose `expert_gating_func` is softmax (DeepSeek-V2) is
    /// refused; one without the key is read as sigmoid when it has the V3 score-correction bias
    /// (`exp_probs_b`).
    fn check_sigmoid_routing(&self) -> Result<()> {
        match self.get("expert_gating_func").and_then(G::as_u64) {
            Some(2) => Ok(()),
            None if self.0.tensors.iter().any(|t| t.name.ends_with(".exp_probs_b.bias")) => Ok(()),
            other => Err(Error::config(
                Self::key("expert_gating_func"),
                format!("{other:?}: only sigmoid routing (DeepSeek-V3, 2) is supported"),
            )),
        }
    }

    /// `rope_scaling` as config.json holds it (null, or YaRN's fields).
    fn rope_scaling(&self) -> Result<Value> {
        Ok(match self.get("rope.scaling.type").and_then(G::as_str) {
            None | Some("none") => Value::Null,
            Some("yarn") => {
                // llama.cpp keeps `0.1 · mscale_all_dim` as the log multiplier.
                // (In f32, as it was written: 0.1f32 / 0.1f32 is exactly 1.)
                let mul = self.get("rope.scaling.yarn_log_multiplier").and_then(G::as_f64);
                let all = (mul.unwrap_or(0.0) as f32 / 0.1f32) as f64;
                json!({
                    "rope_type": "yarn",
                    "factor": self.num("rope.scaling.factor")?,
                    "original_max_position_embeddings": self.num("rope.scaling.original_context_length")?,
                    "beta_fast": self.or("rope.scaling.yarn_beta_fast", json!(32.0)),
                    "beta_slow": self.or("rope.scaling.yarn_beta_slow", json!(1.0)),
                    "mscale": all,
                    "mscale_all_dim": all,
                })
            }
            Some(other) => {
                return Err(Error::config(
                    Self::key("rope.scaling.type"),
                    format!("unsupported {other:?}; supported: none, yarn"),
                ))
            }
        })
    }
}
