//! Choosing a token from a row of logits — repetition penalty, temperature, top-k, top-p, one
//! uniform draw — as one function of the logits and the draw, so the host sampler and the device
//! sampler (CUDA `sample_rows`, checked against this) pick the same token from the same draw.

use crate::host::argmax;
use crate::nucleus::{draw_unordered, nucleus};

/// How a row is sampled: 0 temperature = greedy; top-k 0 and top-p 1 = off; penalty 1 = off.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Pick {
    pub temperature: f32,
    pub top_k: usize,
    pub top_p: f32,
    pub repetition_penalty: f32,
}

impl Pick {
    /// Whether choosing draws a uniform number (temperature above 0).
    pub fn draws(&self) -> bool {
        self.temperature != 0.0
    }
}

/// Divides a positive logit by `penalty`, multiplies a negative one (the convention of
/// transformers' repetition penalty).
pub fn penalize(logit: f32, penalty: f32) -> f32 {
    if logit > 0.0 {
        logit / penalty
    } else {
        logit * penalty
    }
}

/// The token `p` picks from `logits` given `seen` (the ids to penalise, each once) and `r`, a
/// uniform draw in [0, 1) (unused when greedy). Penalises `logits` in place.
pub fn choose(logits: &mut [f32], seen: &[u32], p: &Pick, r: f32) -> u32 {
    if p.repetition_penalty != 1.0 {
        for &t in seen {
            if let Some(l) = logits.get_mut(t as usize) {
                *l = penalize(*l, p.repetition_penalty);
            }
        }
    }
    if !p.draws() {
        return argmax(logits) as u32;
    }
    if p.top_k == 0 && p.top_p >= 1.0 {
        return draw_unordered(logits, p.temperature, r);
    }
    let (idx, probs) = nucleus(logits, p);
    let mut cum = 0.0;
    for (i, &pr) in probs.iter().enumerate() {
        cum += pr;
        if r < cum {
            return idx[i];
        }
    }
    *idx.last().expect("at least one candidate")
}
