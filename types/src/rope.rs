//! Rotary position embedding parameters, as the store records them and the kernels apply them.

use serde::{Deserialize, Serialize};

/// RoPE frequency scaling variants.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "lowercase")]
pub enum RopeScaling {
    /// Llama 3.1's piecewise wavelength scaling.
    Llama3 {
        factor: f64,
        low_freq_factor: f64,
        high_freq_factor: f64,
        original_max_position_embeddings: f64,
    },
    /// Positions divided by `factor` (every inverse frequency divided by it): Gemma 3's global layers.
    Linear { factor: f64 },
    /// YaRN (gpt-oss, DeepSeek-V3): frequencies blended between interpolated (÷ `factor`) and
    /// original by a ramp over the dimensions whose rotation counts at
    /// `original_max_position_embeddings` lie between `beta_slow` and `beta_fast`; cos and sin are
    /// multiplied by `attention_factor`.
    Yarn {
        factor: f64,
        original_max_position_embeddings: f64,
        beta_fast: f64,
        beta_slow: f64,
        /// Bounds of the ramp rounded outward (transformers' `truncate`, default true).
        truncate: bool,
        attention_factor: f64,
    },
}

/// Rotary position embedding parameters (HF "half" layout: pairs (i, i + d/2)).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RopeConfig {
    pub theta: f64,
    pub scaling: Option<RopeScaling>,
}
