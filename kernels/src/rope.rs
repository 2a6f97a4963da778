//! RoPE inverse frequencies (default, llama3, linear and YaRN scaling) and the factor cos and sin
//! are multiplied by, computed as transformers does.

use layerstream_types::{RopeConfig, RopeScaling};

/// Per-pair inverse frequencies for one head dimension.
#[derive(Debug, Clone, PartialEq)]
pub struct RopeTable {
    pub head_dim: usize,
    pub inv_freq: Vec<f32>,
    /// What cos and sin are multiplied by (YaRN's attention factor; 1 otherwise).
    pub attn_factor: f32,
}

impl RopeTable {
    /// Builds the table for `head_dim` from a config.
    pub fn new(cfg: &RopeConfig, head_dim: usize) -> RopeTable {
        let mut inv: Vec<f64> = (0..head_dim / 2)
            .map(|i| 1.0 / cfg.theta.powf((2 * i) as f64 / head_dim as f64))
            .collect();
        if let Some(RopeScaling::Llama3 {
            factor,
            low_freq_factor,
            high_freq_factor,
            original_max_position_embeddings: old,
        }) = cfg.scaling
        {
            let low_wavelen = old / low_freq_factor;
            let high_wavelen = old / high_freq_factor;
            for f in inv.iter_mut() {
                let wavelen = 2.0 * std::f64::consts::PI / *f;
                if wavelen > low_wavelen {
                    *f /= factor;
                } else if wavelen >= high_wavelen {
                    let smooth =
                        (old / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor);
                    *f = (1.0 - smooth) * *f / factor + smooth * *f;
                }
            }
        }
        if let Some(RopeScaling::Linear { factor }) = cfg.scaling {
            for f in inv.iter_mut() {
                *f /= factor;
            }
        }
        let mut attn_factor = 1.0;
        if let Some(RopeScaling::Yarn {
            factor,
            original_max_position_embeddings: old,
            beta_fast,
            beta_slow,
            truncate,
            attention_factor,
        }) = cfg.scaling
        {
            inv = yarn(&inv, cfg.theta, head_dim, factor, old, (beta_fast, beta_slow), truncate);
            attn_factor = attention_factor as f32;
        }
        RopeTable { head_dim, inv_freq: inv.into_iter().map(|x| x as f32).collect(), attn_factor }
    }

    /// (cos, sin) of each pair's angle at `pos`, times the attention factor.
    pub fn cos_sin(&self, pos: usize) -> (Vec<f32>, Vec<f32>) {
        self.inv_freq
            .iter()
            .map(|&f| {
                let a = (pos as f32 * f) as f64;
                (a.cos() as f32 * self.attn_factor, a.sin() as f32 * self.attn_factor)
            })
            .unzip()
    }
}

/// YaRN's inverse frequencies (transformers' `_compute_yarn_parameters`): each pair's frequency
/// blended between `inv / factor` (interpolated) and `inv` (extrapolated) by a linear ramp over
/// the pair index between the dimensions where a wavelength fits `beta_fast` and `beta_slow` times
/// into `old` positions.
fn yarn(
    inv: &[f64],
    theta: f64,
    head_dim: usize,
    factor: f64,
    old: f64,
    (beta_fast, beta_slow): (f64, f64),
    truncate: bool,
) -> Vec<f64> {
    let dim = head_dim as f64;
    let correction =
        |rot: f64| dim * (old / (rot * 2.0 * std::f64::consts::PI)).ln() / (2.0 * theta.ln());
    let (mut low, mut high) = (correction(beta_fast), correction(beta_slow));
    if truncate {
        (low, high) = (low.floor(), high.ceil());
    }
    let (low, mut high) = (low.max(0.0), high.min(dim - 1.0));
    if low == high {
        high += 0.001;
    }
    inv.iter()
        .enumerate()
        .map(|(i, &f)| {
            // transformers computes the ramp in f32.
            let ramp = (((i as f64 - low) / (high - low)) as f32).clamp(0.0, 1.0) as f64;
            let extrapolation = 1.0 - ramp;
            f / factor * (1.0 - extrapolation) + f * extrapolation
        })
        .collect()
}

/// gpt-oss's published YaRN: factor 32 over 4096 positions, β 32/1, attention factor 0.1·ln 32 + 1.
#[cfg(test)]
pub(crate) fn gpt_oss_yarn() -> RopeScaling {
    RopeScaling::Yarn {
        factor: 32.0,
        original_max_position_embeddings: 4096.0,
        beta_fast: 32.0,
        beta_slow: 1.0,
        truncate: false,
        attention_factor: 0.1 * 32f64.ln() + 1.0,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn llama3_scaling_keeps_high_and_divides_low_frequencies() {
        let base = RopeConfig { theta: 500000.0, scaling: None };
        let scaled = RopeConfig {
            theta: 500000.0,
            scaling: Some(RopeScaling::Llama3 {
                factor: 8.0,
                low_freq_factor: 1.0,
                high_freq_factor: 4.0,
                original_max_position_embeddings: 64.0,
            }),
        };
        let a = RopeTable::new(&base, 16);
        let b = RopeTable::new(&scaled, 16);
        assert_eq!(a.inv_freq[0], b.inv_freq[0]); // wavelength 2π < 16: untouched
        let last = a.inv_freq.len() - 1;
        assert!((b.inv_freq[last] - a.inv_freq[last] / 8.0).abs() < 1e-12); // very long wavelength
        assert_eq!(a.inv_freq[1], (1.0 / 500000f64.powf(2.0 / 16.0)) as f32);
    }

    /// YaRN as transformers computes it for gpt-oss's published config (head_dim 64, θ 150000,
    /// factor 32 over 4096 positions, β 32/1): pairs 0..=8 keep their frequency, pairs from 18 on
    /// are divided by 32, the ones between blend linearly; cos and sin carry 0.1·ln 32 + 1.
    #[test]
    fn yarn_blends_between_the_correction_bounds() {
        let yarn = gpt_oss_yarn();
        let base = RopeTable::new(&RopeConfig { theta: 150000.0, scaling: None }, 64);
        let t = RopeTable::new(&RopeConfig { theta: 150000.0, scaling: Some(yarn) }, 64);
        // low = 64·ln(4096/(32·2π))/(2·ln 150000), high = 64·ln(4096/2π)/(2·ln 150000)
        let (low, high) = (8.092_779_f64, 17.398_025_f64);
        for i in 0..32 {
            let ramp = ((i as f64 - low) / (high - low)).clamp(0.0, 1.0);
            let want =
                base.inv_freq[i] as f64 * (1.0 - ramp) + base.inv_freq[i] as f64 / 32.0 * ramp;
            assert!((t.inv_freq[i] as f64 - want).abs() <= 1e-4 * want, "pair {i}");
        }
        assert!((t.attn_factor - 1.346_574).abs() < 1e-5);
        let (c, s) = t.cos_sin(0);
        assert_eq!((c[0], s[0]), (t.attn_factor, 0.0));
    }
}
