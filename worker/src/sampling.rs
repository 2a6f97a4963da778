//! Token sampling: repetition penalty, temperature, top-k, top-p, seeded randomness; greedy at
//! temperature 0. Same seed and logits → same tokens.

use layerstream_kernels::host::{argmax, softmax};
use serde::{Deserialize, Serialize};

/// Per-request sampling settings (HF `generate` semantics).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SamplingParams {
    /// 0 = greedy.
    pub temperature: f32,
    /// 0 = off.
    pub top_k: usize,
    /// 1 = off.
    pub top_p: f32,
    /// 1 = off; >1 discourages tokens already in the prompt or output.
    pub repetition_penalty: f32,
    pub seed: u64,
}

impl Default for SamplingParams {
    fn default() -> Self {
        SamplingParams { temperature: 0.0, top_k: 0, top_p: 1.0, repetition_penalty: 1.0, seed: 0 }
    }
}

impl SamplingParams {
    /// From wire values where 0 means "unset" for top_p and repetition_penalty (proto3 defaults).
    pub fn from_wire(temperature: f32, top_k: u32, top_p: f32, repetition_penalty: f32, seed: u64) -> Self {
        SamplingParams {
            temperature,
            top_k: top_k as usize,
            top_p: if top_p <= 0.0 { 1.0 } else { top_p },
            repetition_penalty: if repetition_penalty <= 0.0 { 1.0 } else { repetition_penalty },
            seed,
        }
    }

    /// Rejects out-of-range values with a message naming the field.
    pub fn validate(&self) -> Result<(), String> {
        if !(self.temperature >= 0.0 && self.temperature.is_finite()) {
            return Err(format!("temperature must be >= 0, got {}", self.temperature));
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            return Err(format!("top_p must be in (0, 1], got {}", self.top_p));
        }
        if !(self.repetition_penalty > 0.0 && self.repetition_penalty.is_finite()) {
            return Err(format!("repetition_penalty must be > 0, got {}", self.repetition_penalty));
        }
        Ok(())
    }
}

/// A sampler with its own random stream.
#[derive(Debug, Clone)]
pub struct Sampler {
    pub params: SamplingParams,
    state: u64,
}

impl Sampler {
    /// Creates a sampler seeded from `params.seed`.
    pub fn new(params: SamplingParams) -> Self {
        let state = params.seed ^ 0x9E37_79B9_7F4A_7C15;
        Sampler { params, state }
    }

    /// splitmix64 → uniform in [0, 1).
    fn uniform(&mut self) -> f64 {
        self.state = self.state.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.state;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^= z >> 31;
        (z >> 11) as f64 / (1u64 << 53) as f64
    }

    /// Whether `sample` is a plain argmax (temperature 0, no repetition penalty): the head can then
    /// pick the token on the device without copying the logits back.
    pub fn is_greedy(&self) -> bool {
        self.params.temperature == 0.0 && self.params.repetition_penalty == 1.0
    }

    /// Picks the next token from `logits` given the tokens seen so far.
    pub fn sample(&mut self, logits: &mut [f32], history: &[u32]) -> u32 {
        let p = self.params.clone();
        if p.repetition_penalty != 1.0 {
            let mut seen = history.to_vec();
            seen.sort_unstable();
            seen.dedup();
            for &t in &seen {
                if let Some(l) = logits.get_mut(t as usize) {
                    *l = if *l > 0.0 { *l / p.repetition_penalty } else { *l * p.repetition_penalty };
                }
            }
        }
        if p.temperature == 0.0 {
            return argmax(logits) as u32;
        }
        let mut idx: Vec<u32> = (0..logits.len() as u32).collect();
        idx.sort_unstable_by(|&a, &b| logits[b as usize].total_cmp(&logits[a as usize]));
        if p.top_k > 0 {
            idx.truncate(p.top_k);
        }
        let mut probs: Vec<f32> = idx.iter().map(|&i| logits[i as usize] / p.temperature).collect();
        softmax(&mut probs);
        if p.top_p < 1.0 {
            let mut cum = 0.0;
            let keep = probs.iter().position(|&x| {
                cum += x;
                cum >= p.top_p
            });
            let n = keep.map_or(probs.len(), |k| k + 1);
            probs.truncate(n);
            idx.truncate(n);
            let s: f32 = probs.iter().sum();
            probs.iter_mut().for_each(|x| *x /= s);
        }
        let r = self.uniform() as f32;
        let mut cum = 0.0;
        for (i, &pr) in probs.iter().enumerate() {
            cum += pr;
            if r < cum {
                return idx[i];
            }
        }
        *idx.last().expect("at least one candidate")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn logits() -> Vec<f32> {
        (0..50).map(|i| ((i * 37) % 23) as f32 * 0.3).collect()
    }

    #[test]
    fn greedy_is_argmax() {
        let mut s = Sampler::new(SamplingParams::default());
        let mut l = logits();
        let want = argmax(&l) as u32;
        assert_eq!(s.sample(&mut l, &[]), want);
    }

    #[test]
    fn same_seed_same_tokens_other_seed_differs() {
        let p = SamplingParams { temperature: 1.5, seed: 42, ..Default::default() };
        let run = |p: &SamplingParams| {
            let mut s = Sampler::new(p.clone());
            (0..40).map(|_| s.sample(&mut logits(), &[])).collect::<Vec<_>>()
        };
        assert_eq!(run(&p), run(&p));
        assert_ne!(run(&p), run(&SamplingParams { seed: 43, ..p.clone() }));
    }

    #[test]
    fn top_k_one_is_greedy_and_top_p_limits_support() {
        let mut s = Sampler::new(SamplingParams { temperature: 2.0, top_k: 1, seed: 1, ..Default::default() });
        let want = argmax(&logits()) as u32;
        for _ in 0..10 {
            assert_eq!(s.sample(&mut logits(), &[]), want);
        }
        let mut l = vec![0.0f32; 10];
        l[3] = 10.0;
        l[7] = 9.0;
        let mut s = Sampler::new(SamplingParams { temperature: 1.0, top_p: 0.5, seed: 5, ..Default::default() });
        for _ in 0..20 {
            assert_eq!(s.sample(&mut l.clone(), &[]), 3);
        }
    }

    #[test]
    fn repetition_penalty_moves_greedy_choice() {
        let mut l = vec![2.0f32, 1.9, -1.0];
        let mut s = Sampler::new(SamplingParams { repetition_penalty: 1.2, ..Default::default() });
        assert_eq!(s.sample(&mut l, &[0]), 1);
        assert!((l[0] - 2.0 / 1.2).abs() < 1e-6);
    }

    #[test]
    fn invalid_params_are_named() {
        let p = SamplingParams { top_p: 0.0, ..Default::default() };
        assert!(p.validate().unwrap_err().contains("top_p"));
    }
}
