//! Architecture description shared by every checkpoint format: the dims, RoPE and norms the forward
//! pass needs, parsed from HF `config.json` (both RoPE styles) or GGUF metadata.

use crate::error::{Error, Result};
pub use layerstream_types::rope::{RopeConfig, RopeScaling};
use serde::{Deserialize, Serialize};
use serde_json::Value;

mod rope;
use rope::{parse_rope, rope_params, rope_with};

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
    #[serde(rename = "Qwen3MoeForCausalLM")]
    Qwen3Moe,
    #[serde(rename = "MixtralForCausalLM")]
    Mixtral,
    #[serde(rename = "Gemma3ForCausalLM")]
    Gemma3,
    /// BitNet b1.58: the Llama layer with RMSNorms before `o_proj` and `down_proj` and a
    /// squared-ReLU gate.
    #[serde(rename = "BitNetForCausalLM")]
    BitNet,
    /// gpt-oss: attention sinks, biases everywhere, sliding-window layers alternating with full
    /// ones, experts with a clamped SwiGLU and biases, YaRN.
    #[serde(rename = "GptOssForCausalLM")]
    GptOss,
    /// DeepSeek-V3 (and the models built on it): multi-head latent attention, sigmoid
    /// group-limited routing with shared experts, dense first layers, YaRN.
    #[serde(rename = "DeepseekV3ForCausalLM")]
    DeepseekV3,
}

/// The HF class names accepted, for error messages.
pub const SUPPORTED_ARCHS: &str = "LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM, \
     Qwen3ForCausalLM, Qwen3MoeForCausalLM, MixtralForCausalLM, Gemma3ForCausalLM, \
     BitNetForCausalLM, GptOssForCausalLM, DeepseekV3ForCausalLM (GGUF: llama, qwen2, qwen3, \
     qwen3moe, gemma3, gpt-oss, deepseek2)";

impl Arch {
    /// Parses an HF `architectures` entry.
    pub fn from_hf(name: &str) -> Result<Arch> {
        match name {
            "LlamaForCausalLM" => Ok(Arch::Llama),
            "MistralForCausalLM" => Ok(Arch::Mistral),
            "Qwen2ForCausalLM" => Ok(Arch::Qwen2),
            "Qwen3ForCausalLM" => Ok(Arch::Qwen3),
            "Qwen3MoeForCausalLM" => Ok(Arch::Qwen3Moe),
            "MixtralForCausalLM" => Ok(Arch::Mixtral),
            "Gemma3ForCausalLM" => Ok(Arch::Gemma3),
            "BitNetForCausalLM" => Ok(Arch::BitNet),
            "GptOssForCausalLM" => Ok(Arch::GptOss),
            "DeepseekV3ForCausalLM" => Ok(Arch::DeepseekV3),
            other => {
                Err(Error::UnsupportedArch { got: other.into(), supported: SUPPORTED_ARCHS.into() })
            }
        }
    }
}

/// A mixture-of-experts feed-forward: each token's router picks `top_k` of `experts` expert MLPs.
///
/// Routing is softmax over all experts' logits, the top `top_k` taken, renormalised to sum to 1 when
/// `norm_topk_prob` (Qwen3-MoE's flag; Mixtral's softmax over the top-k logits is the same thing).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct MoeConfig {
    pub experts: usize,
    pub top_k: usize,
    /// Width of each expert's gate/up projections.
    pub expert_intermediate: usize,
    pub norm_topk_prob: bool,
    /// Layers whose MLP is dense (`intermediate_size`) rather than experts, ascending.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub dense_layers: Vec<usize>,
    /// The router and every expert projection add a bias (gpt-oss): the layer file holds
    /// `router_bias`, each expert file `gate_bias`, `up_bias` and `down_bias`.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub bias: bool,
    /// The experts' gate is gpt-oss's clamped SwiGLU instead of SiLU.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub swiglu_clamp: Option<SwigluClamp>,
    /// DeepSeek-V3's router: sigmoid scores, a correction bias (the layer file's
    /// `router_correction`) added for the choice only, experts chosen within the best groups, the
    /// chosen weights scaled (instead of the softmax routing above).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub groups: Option<GroupRouting>,
    /// Width of the shared experts' MLP every token also runs (`shared_gate`, `shared_up`,
    /// `shared_down` in the layer file; 0: none).
    #[serde(default, skip_serializing_if = "is_zero")]
    pub shared_intermediate: usize,
}

fn is_zero(x: &usize) -> bool {
    *x == 0
}

/// DeepSeek-V3's group-limited routing: each group of `experts / n_group` scores the sum of its
/// two best, the `topk_group` best groups are eligible, the top-k of those are chosen, their
/// sigmoid scores (renormalised when `norm_topk_prob`) times `routed_scaling_factor` weigh them.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct GroupRouting {
    pub n_group: usize,
    pub topk_group: usize,
    pub routed_scaling_factor: f32,
}

/// gpt-oss's expert activation: `(min(up, ±limit) + 1) · g · σ(alpha · g)` with
/// `g = min(gate, limit)`, up clamped to `[-limit, limit]`.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct SwigluClamp {
    pub alpha: f32,
    pub limit: f32,
}

/// Gemma 3's departures from the Llama layer: RMSNorm by `1 + w` (stored as `1 + w`, so the kernels
/// see a plain norm), sandwich norms around attention and MLP, GELU (tanh) gating, embeddings scaled
/// by √hidden, attention scaled by `query_pre_attn_scalar^-½`, and sliding-window attention on every
/// layer but `global_layers`, with its own RoPE.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct GemmaConfig {
    pub query_pre_attn_scalar: f64,
    pub sliding_window: usize,
    /// Layers that attend to the whole context, ascending.
    pub global_layers: Vec<usize>,
    /// RoPE of the sliding-window layers.
    pub local_rope: RopeConfig,
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
    /// The experts of a mixture-of-experts model (`None`: every MLP dense).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub moe: Option<MoeConfig>,
    /// Gemma 3's layer (`None`: the Llama layer).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gemma: Option<GemmaConfig>,
    /// Every layer attends to the last this-many positions only (Mistral 7B v0.1's 4096).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sliding_window: Option<usize>,
    /// BitNet's BitLinear projections (`quant_method: "bitnet"`): each decoder projection's input
    /// is quantized per row to 8 bits (absmax) first, as transformers' BitLinear does.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub bitlinear: bool,
    /// Layers exempt from `sliding_window` (gpt-oss's full-attention layers; empty: the window
    /// covers every layer, as Mistral's).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub full_attention_layers: Vec<usize>,
    /// Each attention head has a learned sink logit (the layer's `sinks` tensor) that joins the
    /// softmax's denominator and contributes no value (gpt-oss).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub attn_sinks: bool,
    /// Multi-head latent attention (DeepSeek-V3); `head_dim` is then the RoPE part's width.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mla: Option<crate::config_mla::MlaConfig>,
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

/// Gemma 3's section: attention scalar, window, which layers are global (`layer_types`, else every
/// `sliding_window_pattern`-th), the sliding layers' RoPE; soft-capping is refused (Gemma 3 has none).
fn parse_gemma(arch: Arch, v: &Value) -> Result<Option<GemmaConfig>> {
    if arch != Arch::Gemma3 {
        return Ok(None);
    }
    for cap in ["final_logit_softcapping", "attn_logit_softcapping"] {
        if v.get(cap).is_some_and(|c| !c.is_null()) {
            return Err(Error::config(cap, "logit soft-capping is not supported"));
        }
    }
    let layers = get_usize(v, "num_hidden_layers")?;
    let global_layers = match v.get("layer_types").and_then(Value::as_array) {
        Some(t) => of_type(t, "full_attention"),
        None => {
            let pattern = v.get("sliding_window_pattern").and_then(Value::as_u64).unwrap_or(6);
            (0..layers).filter(|i| ((i + 1) as u64).is_multiple_of(pattern.max(1))).collect()
        }
    };
    let local = rope_params(v, "sliding_attention")
        .filter(|_| v.get("rope_parameters").is_some_and(|p| p.get("sliding_attention").is_some()));
    let local_rope = match local {
        Some(p) => rope_with(
            get_f64(p, "rope_theta").unwrap_or(10000.0),
            Some(p),
            get_f64(v, "max_position_embeddings"),
        )?,
        None => RopeConfig {
            theta: get_f64(v, "rope_local_base_freq").unwrap_or(10000.0),
            scaling: None,
        },
    };
    let head_dim = v.get("head_dim").and_then(Value::as_u64).unwrap_or(256) as f64;
    Ok(Some(GemmaConfig {
        query_pre_attn_scalar: get_f64(v, "query_pre_attn_scalar").unwrap_or(head_dim),
        sliding_window: get_usize(v, "sliding_window")?,
        global_layers,
        local_rope,
    }))
}

/// The layers whose `layer_types` entry is `kind`; without `layer_types`, gpt-oss's pattern (every
/// other layer from the second).
fn layer_types(v: &Value, kind: &str) -> Result<Vec<usize>> {
    let layers = get_usize(v, "num_hidden_layers")?;
    Ok(match v.get("layer_types").and_then(Value::as_array) {
        Some(t) if t.len() != layers => {
            return Err(Error::config(
                "layer_types",
                format!("{} entries for {layers} layers", t.len()),
            ))
        }
        Some(t) => of_type(t, kind),
        None => (1..layers).step_by(2).collect(),
    })
}

/// The indices of the `layer_types` entries equal to `kind`.
fn of_type(types: &[Value], kind: &str) -> Vec<usize> {
    types.iter().enumerate().filter(|(_, k)| k.as_str() == Some(kind)).map(|(i, _)| i).collect()
}

/// The experts section of a Qwen3-MoE or Mixtral config (`None` for dense architectures).
fn parse_moe(arch: Arch, v: &Value) -> Result<Option<MoeConfig>> {
    match arch {
        Arch::Qwen3Moe => {
            let layers = get_usize(v, "num_hidden_layers")?;
            let step = v.get("decoder_sparse_step").and_then(Value::as_u64).unwrap_or(1) as usize;
            if step == 0 {
                return Err(Error::config("decoder_sparse_step", "must be > 0"));
            }
            let only: Vec<usize> = v
                .get("mlp_only_layers")
                .and_then(Value::as_array)
                .map(|a| a.iter().filter_map(Value::as_u64).map(|x| x as usize).collect())
                .unwrap_or_default();
            // transformers: a layer is sparse when it is not in mlp_only_layers and
            // (index + 1) % decoder_sparse_step == 0.
            let dense_layers =
                (0..layers).filter(|i| only.contains(i) || (i + 1) % step != 0).collect();
            Ok(Some(MoeConfig {
                experts: get_usize(v, "num_experts")?,
                top_k: get_usize(v, "num_experts_per_tok")?,
                expert_intermediate: get_usize(v, "moe_intermediate_size")?,
                norm_topk_prob: v.get("norm_topk_prob").and_then(Value::as_bool).unwrap_or(false),
                dense_layers,
                ..MoeConfig::default()
            }))
        }
        Arch::Mixtral => Ok(Some(MoeConfig {
            experts: get_usize(v, "num_local_experts")?,
            top_k: get_usize(v, "num_experts_per_tok")?,
            expert_intermediate: get_usize(v, "intermediate_size")?,
            norm_topk_prob: true,
            ..MoeConfig::default()
        })),
        // The softmax over the top-k biased logits equals the renormalised top-k of the softmax.
        Arch::GptOss => Ok(Some(MoeConfig {
            experts: get_usize(v, "num_local_experts")?,
            top_k: get_usize(v, "num_experts_per_tok")?,
            expert_intermediate: get_usize(v, "intermediate_size")?,
            norm_topk_prob: true,
            bias: true,
            swiglu_clamp: Some(SwigluClamp {
                alpha: get_f64(v, "swiglu_alpha").unwrap_or(1.702) as f32,
                limit: get_f64(v, "swiglu_limit").unwrap_or(7.0) as f32,
            }),
            ..MoeConfig::default()
        })),
        Arch::DeepseekV3 => Ok(Some(crate::config_mla::parse_deepseek_moe(v)?)),
        _ => Ok(None),
    }
}

impl ModelConfig {
    /// The attention window of layer `layer` (`None`: the whole context).
    pub fn window_at(&self, layer: usize) -> Option<usize> {
        match &self.gemma {
            Some(g) => (!g.global_layers.contains(&layer)).then_some(g.sliding_window),
            None => self.sliding_window.filter(|_| !self.full_attention_layers.contains(&layer)),
        }
    }

    /// The experts of layer `layer`, if it is a mixture-of-experts layer.
    pub fn moe_at(&self, layer: usize) -> Option<&MoeConfig> {
        self.moe.as_ref().filter(|m| !m.dense_layers.contains(&layer))
    }

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
            _ if arch == Arch::DeepseekV3 => get_usize(v, "qk_rope_head_dim")?,
            Some(h) => h as usize,
            None => hidden_size / num_heads,
        };
        let (act_key, want) = match arch {
            Arch::Gemma3 => ("hidden_activation", "gelu_pytorch_tanh"),
            Arch::BitNet => ("hidden_act", "relu2"),
            _ => ("hidden_act", "silu"),
        };
        let act = v.get(act_key).and_then(Value::as_str).unwrap_or(want);
        if act != want {
            return Err(Error::config(
                act_key,
                format!("unsupported {act:?}; supported for {arch_name}: {want}"),
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
            qk_norm: matches!(arch, Arch::Qwen3 | Arch::Qwen3Moe | Arch::Gemma3),
            bos_token_id: token_ids(v.get("bos_token_id")).first().copied(),
            eos_token_ids: token_ids(v.get("eos_token_id")),
            moe: parse_moe(arch, v)?,
            gemma: parse_gemma(arch, v)?,
            // Mistral's window covers every layer, gpt-oss's its `sliding_attention` layers
            // (Gemma's are per layer, in its own section).
            sliding_window: match arch {
                Arch::Mistral | Arch::GptOss => {
                    v.get("sliding_window").and_then(Value::as_u64).map(|w| w as usize)
                }
                _ => None,
            },
            full_attention_layers: match arch {
                Arch::GptOss => layer_types(v, "full_attention")?,
                _ => Vec::new(),
            },
            attn_sinks: arch == Arch::GptOss,
            mla: match arch {
                Arch::DeepseekV3 => Some(crate::config_mla::parse_mla(v)?),
                _ => None,
            },
            bitlinear: v
                .get("quantization_config")
                .and_then(|q| q.get("quant_method"))
                .and_then(Value::as_str)
                == Some("bitnet"),
        };
        cfg.validate()?;
        Ok(cfg)
    }

    /// Checks the config is usable: every size > 0 and far from overflowing the byte counts it
    /// multiplies into, heads divide, floats finite and positive, special tokens in the vocabulary.
    pub fn validate(&self) -> Result<()> {
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
        if let Some(m) = &self.moe {
            self.validate_moe(m)?;
        }
        if self.sliding_window == Some(0) {
            return Err(Error::config("sliding_window", "must be > 0 (or null)"));
        }
        if let Some(g) = &self.gemma {
            if g.sliding_window == 0 {
                return Err(Error::config("sliding_window", "must be > 0"));
            }
            positive("query_pre_attn_scalar", g.query_pre_attn_scalar)?;
            positive("rope_local_base_freq", g.local_rope.theta)?;
        }
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

    /// The expert counts and sizes of a mixture-of-experts config.
    fn validate_moe(&self, m: &MoeConfig) -> Result<()> {
        if m.experts == 0 || m.experts > 4096 {
            return Err(Error::config("num_experts", format!("{} is not in 1..=4096", m.experts)));
        }
        if m.top_k == 0 || m.top_k > m.experts {
            return Err(Error::config(
                "num_experts_per_tok",
                format!("{} is not in 1..={} (the number of experts)", m.top_k, m.experts),
            ));
        }
        // The loader numbers layers, then every layer's experts, in a u32 (`layout::unit_file`).
        let units =
            m.experts.checked_mul(self.num_layers).and_then(|x| x.checked_add(self.num_layers));
        if units.is_none_or(|u| u > u32::MAX as usize) {
            return Err(Error::config(
                "num_experts",
                format!(
                    "{} experts × {} layers are too many files to number",
                    m.experts, self.num_layers
                ),
            ));
        }
        if m.expert_intermediate == 0 || m.expert_intermediate > MAX_DIM {
            return Err(Error::config(
                "moe_intermediate_size",
                format!("{} is not in 1..={MAX_DIM}", m.expert_intermediate),
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

    /// What a KV pool keeps per position: the width of a row, and how many rows (keys and values,
    /// or MLA's one row of latent + RoPE key that serves as both).
    pub fn kv_cache_rows(&self) -> (usize, usize) {
        match &self.mla {
            Some(m) => (m.cache_dim(), 1),
            None => (self.kv_dim(), 2),
        }
    }
}

/// The largest size a config may give (far from overflowing the byte counts it multiplies into).
pub(crate) const MAX_DIM: usize = 1 << 24;

/// A float field that must be finite and positive.
fn positive(field: &str, v: f64) -> Result<()> {
    if v.is_finite() && v > 0.0 {
        Ok(())
    } else {
        Err(Error::config(field, format!("must be a finite number > 0, got {v}")))
    }
}

#[cfg(test)]
mod tests;
