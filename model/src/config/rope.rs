//! RoPE from a config: the theta, the scaling object (linear, dynamic, llama3, longrope, YaRN)
//! and the per-attention-kind parameters of newer configs.

use super::*;

/// `rope_parameters`, or its `kind` entry where it holds one per attention kind (Gemma 3 in
/// transformers 5: `full_attention`, `sliding_attention`).
pub(super) fn rope_params<'a>(v: &'a Value, kind: &str) -> Option<&'a Value> {
    let p = v.get("rope_parameters").filter(|p| p.is_object())?;
    Some(p.get(kind).filter(|k| k.is_object()).unwrap_or(p))
}

/// Parses the RoPE section: older `rope_theta` + `rope_scaling`, or newer `rope_parameters` (the
/// `full_attention` entry where it has one per attention kind).
pub(super) fn parse_rope(v: &Value) -> Result<RopeConfig> {
    let params = rope_params(v, "full_attention");
    let scaling_obj = params.or_else(|| v.get("rope_scaling").filter(|p| p.is_object()));
    let theta = params
        .and_then(|p| get_f64(p, "rope_theta"))
        .or_else(|| get_f64(v, "rope_theta"))
        .unwrap_or(10000.0);
    rope_with(theta, scaling_obj, get_f64(v, "max_position_embeddings"))
}

/// A RoPE config of base `theta`, scaled as `scaling_obj` says (`rope_type` default, llama3,
/// linear, yarn; `max_pos`: the config's `max_position_embeddings`, YaRN's factor where it has none).
pub(super) fn rope_with(
    theta: f64,
    scaling_obj: Option<&Value>,
    max_pos: Option<f64>,
) -> Result<RopeConfig> {
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
                "linear" => Some(RopeScaling::Linear {
                    factor: get_f64(s, "factor")
                        .ok_or_else(|| Error::config("rope_scaling.factor", "missing"))?,
                }),
                "yarn" => Some(yarn(s, max_pos)?),
                other => {
                    return Err(Error::config(
                        "rope_scaling.rope_type",
                        format!("unsupported {other:?}; supported: default, llama3, linear, yarn"),
                    ))
                }
            }
        }
    };
    Ok(RopeConfig { theta, scaling })
}

/// YaRN's parameters as transformers reads them: `factor` (else max / original positions),
/// `attention_factor` (else from `mscale` and `mscale_all_dim`, else 0.1·ln factor + 1), β fast and
/// slow (32 and 1 when absent), `truncate` (true when absent).
pub(super) fn yarn(s: &Value, max_pos: Option<f64>) -> Result<RopeScaling> {
    let old = get_f64(s, "original_max_position_embeddings")
        .ok_or_else(|| Error::config("rope_scaling.original_max_position_embeddings", "missing"))?;
    let factor = match (get_f64(s, "factor"), max_pos) {
        (Some(f), _) => f,
        (None, Some(m)) => m / old,
        (None, None) => return Err(Error::config("rope_scaling.factor", "missing")),
    };
    if factor <= 0.0 || old <= 0.0 {
        return Err(Error::config("rope_scaling.factor", "must be positive"));
    }
    let mscale = |scale: f64, m: f64| if scale <= 1.0 { 1.0 } else { 0.1 * m * scale.ln() + 1.0 };
    let nonzero = |name| get_f64(s, name).filter(|x| *x != 0.0);
    let attention_factor = match (get_f64(s, "attention_factor"), nonzero("mscale")) {
        (Some(a), _) => a,
        (None, Some(m)) if nonzero("mscale_all_dim").is_some() => {
            mscale(factor, m) / mscale(factor, get_f64(s, "mscale_all_dim").unwrap_or(0.0))
        }
        _ => mscale(factor, 1.0),
    };
    let beta = |name, default| nonzero(name).unwrap_or(default);
    Ok(RopeScaling::Yarn {
        factor,
        original_max_position_embeddings: old,
        beta_fast: beta("beta_fast", 32.0),
        beta_slow: beta("beta_slow", 1.0),
        truncate: s.get("truncate").and_then(Value::as_bool).unwrap_or(true),
        attention_factor,
    })
}
