//! DeepSeek-V3's departures from the Llama layer, as `config.json` describes them: multi-head latent
//! attention (`MlaConfig`) and the router's group-limited sigmoid scores (`MoeConfig::groups`).

use crate::config::{GroupRouting, MoeConfig, MAX_DIM};
use crate::error::{Error, Result};
use serde::{Deserialize, Serialize};
use serde_json::Value;

/// Multi-head latent attention: keys and values come from one compressed latent of
/// `kv_lora_rank` values per position (normed) plus one shared RoPE key of `qk_rope_head_dim`;
/// queries from an optional low-rank `q_lora_rank` projection. The cache keeps the latent and the
/// RoPE key only; decode multiplies each head's query into the latent space instead of expanding
/// keys and values (the absorbed form).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct MlaConfig {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub q_lora_rank: Option<usize>,
    pub kv_lora_rank: usize,
    pub qk_nope_head_dim: usize,
    pub qk_rope_head_dim: usize,
    pub v_head_dim: usize,
    /// The softmax scale: `(nope + rope)^-½`, times YaRN's `mscale(factor, mscale_all_dim)²`.
    pub softmax_scale: f64,
    /// The checkpoint's RoPE rows hold interleaved pairs (the importer reorders them).
    #[serde(default)]
    pub rope_interleave: bool,
    /// Multi-token-prediction layers the checkpoint declares (`num_nextn_predict_layers`), not
    /// imported: transformers does not run them either.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub mtp_layers_skipped: usize,
}

fn is_zero(x: &usize) -> bool {
    *x == 0
}

impl MlaConfig {
    /// Width of one cached position: the latent, then the RoPE key.
    pub fn cache_dim(&self) -> usize {
        self.kv_lora_rank + self.qk_rope_head_dim
    }
}

/// A positive size no larger than `config::MAX_DIM` (the products of these sizes — heads × ranks,
/// shared experts × width — must stay far from overflowing).
fn usize_of(v: &Value, field: &str) -> Result<usize> {
    v.get(field)
        .and_then(Value::as_u64)
        .filter(|&x| x > 0 && x <= MAX_DIM as u64)
        .map(|x| x as usize)
        .ok_or_else(|| Error::config(field, format!("missing or not an integer in 1..={MAX_DIM}")))
}

/// The MLA section of a DeepSeek-V3 config; `num_heads` checks `qk_nope_head_dim` against
/// `kv_b_proj`'s rows later (import).
pub fn parse_mla(v: &Value) -> Result<MlaConfig> {
    let q_lora_rank = match v.get("q_lora_rank") {
        None | Some(Value::Null) => None,
        Some(_) => Some(usize_of(v, "q_lora_rank")?),
    };
    let (nope, rope) = (usize_of(v, "qk_nope_head_dim")?, usize_of(v, "qk_rope_head_dim")?);
    if let Some(h) = v.get("qk_head_dim").and_then(Value::as_u64) {
        if h as usize != nope + rope {
            return Err(Error::config(
                "qk_head_dim",
                format!("{h} is not qk_nope_head_dim {nope} + qk_rope_head_dim {rope}"),
            ));
        }
    }
    if !rope.is_multiple_of(2) {
        return Err(Error::config("qk_rope_head_dim", "must be even for RoPE"));
    }
    // transformers' yarn_apply_mscale: only a YaRN-scaled model with `mscale_all_dim` set.
    let rope_params = v.get("rope_parameters").or_else(|| v.get("rope_scaling"));
    let mut scale = ((nope + rope) as f64).powf(-0.5);
    if let Some(p) = rope_params.filter(|p| {
        p.get("rope_type")
            .or_else(|| p.get("type"))
            .and_then(Value::as_str)
            .is_some_and(|t| t != "default")
    }) {
        let all = p.get("mscale_all_dim").and_then(Value::as_f64).unwrap_or(0.0);
        let factor = p.get("factor").and_then(Value::as_f64).unwrap_or(1.0);
        if all != 0.0 && factor > 1.0 {
            let m = 0.1 * all * factor.ln() + 1.0;
            scale *= m * m;
        }
    }
    Ok(MlaConfig {
        q_lora_rank,
        kv_lora_rank: usize_of(v, "kv_lora_rank")?,
        qk_nope_head_dim: nope,
        qk_rope_head_dim: rope,
        v_head_dim: usize_of(v, "v_head_dim")?,
        softmax_scale: scale,
        rope_interleave: v.get("rope_interleave").and_then(Value::as_bool).unwrap_or(true),
        mtp_layers_skipped: v.get("num_nextn_predict_layers").and_then(Value::as_u64).unwrap_or(0)
            as usize,
    })
}

/// DeepSeek-V3's experts: `n_routed_experts` chosen by sigmoid scores within the best
/// `topk_group` of `n_group` groups, shared experts beside them, the first
/// `first_k_dense_replace` layers dense.
pub fn parse_deepseek_moe(v: &Value) -> Result<MoeConfig> {
    let experts = usize_of(v, "n_routed_experts")?;
    let layers = usize_of(v, "num_hidden_layers")?;
    let n_group = v.get("n_group").and_then(Value::as_u64).unwrap_or(1).max(1) as usize;
    let topk_group = v.get("topk_group").and_then(Value::as_u64).unwrap_or(1) as usize;
    if topk_group == 0 || topk_group > n_group {
        return Err(Error::config(
            "topk_group",
            format!("{topk_group} is not in 1..=n_group ({n_group})"),
        ));
    }
    if !experts.is_multiple_of(n_group) {
        return Err(Error::config(
            "n_group",
            format!("{experts} routed experts do not divide into {n_group} groups"),
        ));
    }
    let top_k = usize_of(v, "num_experts_per_tok")?;
    if top_k > topk_group * (experts / n_group) {
        return Err(Error::config(
            "num_experts_per_tok",
            format!(
                "{top_k} experts cannot come from {topk_group} groups of {}",
                experts / n_group
            ),
        ));
    }
    if v.get("scoring_func").and_then(Value::as_str).is_some_and(|s| s != "sigmoid") {
        return Err(Error::config("scoring_func", "only \"sigmoid\" (DeepSeek-V3) is supported"));
    }
    let inter = usize_of(v, "moe_intermediate_size")?;
    let shared = match v.get("n_shared_experts").and_then(Value::as_u64) {
        None | Some(0) => 0,
        Some(_) => usize_of(v, "n_shared_experts")?,
    };
    let shared_intermediate =
        shared.checked_mul(inter).filter(|&w| w <= MAX_DIM).ok_or_else(|| {
            Error::config("n_shared_experts", format!("{shared} × {inter} is too wide"))
        })?;
    let dense = v.get("first_k_dense_replace").and_then(Value::as_u64).unwrap_or(0) as usize;
    Ok(MoeConfig {
        experts,
        top_k,
        expert_intermediate: inter,
        norm_topk_prob: v.get("norm_topk_prob").and_then(Value::as_bool).unwrap_or(false),
        dense_layers: (0..dense.min(layers)).collect(),
        groups: Some(GroupRouting {
            n_group,
            topk_group,
            routed_scaling_factor: v
                .get("routed_scaling_factor")
                .and_then(Value::as_f64)
                .unwrap_or(1.0) as f32,
        }),
        shared_intermediate,
        ..MoeConfig::default()
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    /// The tiny DeepSeek-V3's sections, and the softmax scale transformers computes for it
    /// (48^-½ · (0.1 · ln 32 + 1)²).
    #[test]
    fn tiny_deepseek_sections() {
        let v = json!({"q_lora_rank": 48, "kv_lora_rank": 32, "qk_nope_head_dim": 32,
            "qk_rope_head_dim": 16, "v_head_dim": 32, "n_routed_experts": 16, "n_group": 4,
            "topk_group": 2, "num_experts_per_tok": 4, "moe_intermediate_size": 32,
            "n_shared_experts": 1, "first_k_dense_replace": 1, "num_hidden_layers": 4,
            "routed_scaling_factor": 2.5, "norm_topk_prob": true,
            "rope_scaling": {"rope_type": "yarn", "factor": 32.0, "mscale": 1.0, "mscale_all_dim": 1.0,
                "original_max_position_embeddings": 4096}});
        let m = parse_mla(&v).unwrap();
        assert_eq!((m.q_lora_rank, m.cache_dim()), (Some(48), 48));
        let mscale = 0.1 * 32f64.ln() + 1.0;
        assert!((m.softmax_scale - mscale * mscale / 48f64.sqrt()).abs() < 1e-12);
        let e = parse_deepseek_moe(&v).unwrap();
        assert_eq!((e.dense_layers, e.shared_intermediate), (vec![0], 32));
        assert_eq!(e.groups.unwrap().routed_scaling_factor, 2.5);
        for (field, bad, want) in [
            ("topk_group", json!(5), "topk_group"),
            ("n_group", json!(3), "n_group"),
            ("qk_head_dim", json!(40), "qk_head_dim"),
            ("num_experts_per_tok", json!(9), "num_experts_per_tok"),
            ("kv_lora_rank", json!(1u64 << 62), "kv_lora_rank"),
            ("n_shared_experts", json!(1u64 << 40), "n_shared_experts"),
        ] {
            let mut w = v.clone();
            w[field] = bad;
            let err = parse_mla(&w).and_then(|_| parse_deepseek_moe(&w)).unwrap_err().to_string();
            assert!(err.contains(want), "{field}: {err}");
        }
    }
}
