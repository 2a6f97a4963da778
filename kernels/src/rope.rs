//! RoPE inverse frequencies (default and llama3-scaled), computed as transformers does.

use layerstream_types::{RopeConfig, RopeScaling};

/// Per-pair inverse frequencies for one head dimension.
#[derive(Debug, Clone, PartialEq)]
pub struct RopeTable {
    pub head_dim: usize,
    pub inv_freq: Vec<f32>,
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
        RopeTable { head_dim, inv_freq: inv.into_iter().map(|x| x as f32).collect() }
    }

    /// (cos, sin) of each pair's angle at `pos`.
    pub fn cos_sin(&self, pos: usize) -> (Vec<f32>, Vec<f32>) {
        self.inv_freq
            .iter()
            .map(|&f| {
                let a = (pos as f32 * f) as f64;
                (a.cos() as f32, a.sin() as f32)
            })
            .unzip()
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
}
