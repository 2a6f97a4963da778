//! Architecture description shared by every checkpoint format: the dims, RoPE and norms the forward
//! pass needs, parsed from HF `config.json` (both RoPE styles) or GGUF metadata.

use crate::error::{Error, Result};
pub use layerstream_types::rope::{RopeConfig, RopeScaling};
use serde::{Deserialize, Serialize};
use serde_json::Value;

/// Decoder-only architectures the forward pass implements.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum Arch {
    #[serde(rename = "LlamaForCausalLM")]
    Llama,
    #[serde(rename = "MistralForCausalLM")]
    Mistral,
    #[serde(rename = "Qwen2ForCausalLM")]
    Qwen2,
    #[serde(rename = "Qwen3ForCausalLM")]
    Qwen3,
}

/// The HF class names accepted, for error messages.
pub const SUPPORTED_ARCHS: &str =
    "LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM (GGUF: llama, qwen2, qwen3)";

impl Arch {
    /// Parses an HF `architectures` entry.
    pub fn from_hf(name: &str) -> Result<Arch> {
        match name {
            "LlamaForCausalLM" => Ok(Arch::Llama),
            "MistralForCausalLM" => Ok(Arch::Mistral),
            "Qwen2ForCausalLM" => Ok(Arch::Qwen2),
            "Qwen3ForCausalLM" => Ok(Arch::Qwen3),
            other => {
                Err(Error::UnsupportedArch { got: other.into(), supported: SUPPORTED_ARCHS.into() })
            }
        }
    }
}

/// Everything the forward pass needs to know about a model.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ModelConfig {
    pub arch: Arch,
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub num_layers: usize,
    pub num_heads: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
    pub vocab_size: usize,
    pub rms_norm_eps: f64,
    pub rope: RopeConfig,
    pub max_position_embeddings: usize,
    pub tie_word_embeddings: bool,
    /// Per-head RMSNorm on q and k before RoPE (Qwen3).
    pub qk_norm: bool,
    pub bos_token_id: Option<u32>,
    pub eos_token_ids: Vec<u32>,
}

fn get_usize(v: &Value, field: &str) -> Result<usize> {
    v.get(field)
        .and_then(Value::as_u64)
        .map(|x| x as usize)
        .ok_or_else(|| Error::config(field, "missing or not a non-negative integer"))
}

fn get_f64(v: &Value, field: &str) -> Option<f64> {
    v.get(field).and_then(Value::as_f64)
}

fn token_ids(v: Option<&Value>) -> Vec<u32> {
    match v {
        Some(Value::Number(n)) => n.as_u64().map(|x| vec![x as u32]).unwrap_or_default(),
        Some(Value::Array(a)) => a.iter().filter_map(Value::as_u64).map(|x| x as u32).collect(),
        _ => Vec::new(),
    }
}

/// Parses the RoPE section: older `rope_theta` + `rope_scaling`, or newer `rope_parameters`.
fn parse_rope(v: &Value) -> Result<RopeConfig> {
    let params = v.get("rope_parameters").filter(|p| p.is_object());
    let scaling_obj = params.or_else(|| v.get("rope_scaling").filter(|p| p.is_object()));
    let theta = params
        .and_then(|p| get_f64(p, "rope_theta"))
        .or_else(|| get_f64(v, "rope_theta"))
        .unwrap_or(10000.0);
    let scaling = match scaling_obj {
        None => None,
        Some(s) => {
            let kind = s
                .get("rope_type")
                .or_else(|| s.get("type"))
                .and_then(Value::as_str)
                .unwrap_or("default");
            match kind {
                "default" => None,
                "llama3" => {
                    let f = |name: &str| {
                        get_f64(s, name)
                            .ok_or_else(|| Error::config(format!("rope_scaling.{name}"), "missing"))
                    };
                    Some(RopeScaling::Llama3 {
                        factor: f("factor")?,
                        low_freq_factor: f("low_freq_factor")?,
                        high_freq_factor: f("high_freq_factor")?,
                        original_max_position_embeddings: f("original_max_position_embeddings")?,
                    })
                }
                other => {
                    return Err(Error::config(
                        "rope_scaling.rope_type",
                        format!("unsupported {other:?}; supported: default, llama3"),
                    ))
                }
            }
        }
    };
    Ok(RopeConfig { theta, scaling })
}

impl ModelConfig {
    /// Parses an HF `config.json` value.
    pub fn from_hf(v: &Value) -> Result<ModelConfig> {
        let arch_name = v
            .get("architectures")
            .and_then(|a| a.get(0))
            .and_then(Value::as_str)
            .ok_or_else(|| Error::config("architectures", "missing"))?;
        let arch = Arch::from_hf(arch_name)?;
        let hidden_size = get_usize(v, "hidden_size")?;
        let num_heads = get_usize(v, "num_attention_heads")?;
        let head_dim = match v.get("head_dim").and_then(Value::as_u64) {
            Some(h) => h as usize,
            None => hidden_size / num_heads,
        };
        let act = v.get("hidden_act").and_then(Value::as_str).unwrap_or("silu");
        if act != "silu" {
            return Err(Error::config(
                "hidden_act",
                format!("unsupported {act:?}; supported: silu"),
            ));
        }
        let cfg = ModelConfig {
            arch,
            hidden_size,
            intermediate_size: get_usize(v, "intermediate_size")?,
            num_layers: get_usize(v, "num_hidden_layers")?,
            num_heads,
            num_kv_heads: v
                .get("num_key_value_heads")
                .and_then(Value::as_u64)
                .map_or(num_heads, |x| x as usize),
            head_dim,
            vocab_size: get_usize(v, "vocab_size")?,
            rms_norm_eps: get_f64(v, "rms_norm_eps").unwrap_or(1e-6),
            rope: parse_rope(v)?,
            max_position_embeddings: v
                .get("max_position_embeddings")
                .and_then(Value::as_u64)
                .unwrap_or(4096) as usize,
            tie_word_embeddings: v
                .get("tie_word_embeddings")
                .and_then(Value::as_bool)
                .unwrap_or(false),
            qk_norm: arch == Arch::Qwen3,
            bos_token_id: token_ids(v.get("bos_token_id")).first().copied(),
            eos_token_ids: token_ids(v.get("eos_token_id")),
        };
        cfg.validate()?;
        Ok(cfg)
    }

    /// Checks the config is usable: every size > 0 and far from overflowing the byte counts it
    /// multiplies into, heads divide, floats finite and positive, special tokens in the vocabulary.
    pub fn validate(&self) -> Result<()> {
        const MAX_DIM: usize = 1 << 24;
        for (field, val) in [
            ("hidden_size", self.hidden_size),
            ("intermediate_size", self.intermediate_size),
            ("num_hidden_layers", self.num_layers),
            ("num_attention_heads", self.num_heads),
            ("num_key_value_heads", self.num_kv_heads),
            ("head_dim", self.head_dim),
            ("vocab_size", self.vocab_size),
            ("max_position_embeddings", self.max_position_embeddings),
        ] {
            if val == 0 {
                return Err(Error::config(field, "must be > 0"));
            }
            if val > MAX_DIM {
                return Err(Error::config(
                    field,
                    format!("{val} is implausibly large (> {MAX_DIM})"),
                ));
            }
        }
        if !self.num_heads.is_multiple_of(self.num_kv_heads) {
            return Err(Error::config(
                "num_key_value_heads",
                format!(
                    "{} does not divide num_attention_heads {}",
                    self.num_kv_heads, self.num_heads
                ),
            ));
        }
        if !self.head_dim.is_multiple_of(2) {
            return Err(Error::config("head_dim", "must be even for RoPE"));
        }
        let positive = |field: &str, v: f64| {
            if v.is_finite() && v > 0.0 {
                Ok(())
            } else {
                Err(Error::config(field, format!("must be a finite number > 0, got {v}")))
            }
        };
        positive("rms_norm_eps", self.rms_norm_eps)?;
        positive("rope_theta", self.rope.theta)?;
        if let Some(crate::config::RopeScaling::Llama3 {
            factor,
            low_freq_factor,
            high_freq_factor,
            original_max_position_embeddings,
        }) = &self.rope.scaling
        {
            positive("rope_scaling.factor", *factor)?;
            positive("rope_scaling.low_freq_factor", *low_freq_factor)?;
            positive("rope_scaling.high_freq_factor", *high_freq_factor)?;
            positive(
                "rope_scaling.original_max_position_embeddings",
                *original_max_position_embeddings,
            )?;
            if high_freq_factor <= low_freq_factor {
                return Err(Error::config(
                    "rope_scaling.high_freq_factor",
                    "must be greater than low_freq_factor",
                ));
            }
        }
        if let Some(&t) = self.eos_token_ids.iter().find(|&&t| t as usize >= self.vocab_size) {
            return Err(Error::config(
                "eos_token_id",
                format!("{t} is outside the vocabulary of {}", self.vocab_size),
            ));
        }
        if let Some(t) = self.bos_token_id.filter(|&t| t as usize >= self.vocab_size) {
            return Err(Error::config(
                "bos_token_id",
                format!("{t} is outside the vocabulary of {}", self.vocab_size),
            ));
        }
        Ok(())
    }

    /// Width of the q projection output.
    pub fn q_dim(&self) -> usize {
        self.num_heads * self.head_dim
    }

    /// Width of the k and v projection outputs.
    pub fn kv_dim(&self) -> usize {
        self.num_kv_heads * self.head_dim
    }
}

#[cfg(test)]
mod tests {
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

    #[test]
    fn bad_gqa_is_rejected() {
        let mut v = base();
        v["num_key_value_heads"] = json!(3);
        assert!(ModelConfig::from_hf(&v).unwrap_err().to_string().contains("num_key_value_heads"));
    }
}
