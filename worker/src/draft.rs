//! Drafters for speculative decoding: prompt lookup over the tokens so far, or a smaller draft
//! model with its own KV cache per sequence, proposing its greedy continuation (used by
//! `layerstream run`, and by a pipeline's head stage when its assignment names a draft model).

use crate::error::Result;
use crate::model::{Model, SeqState};
use layerstream_kernels::Backend;
use layerstream_model::spec::{ngram_propose, SpecMode};
use std::time::Instant;

/// One sequence's state in a draft model: its cache holds the first `seq.len` tokens of the history.
pub struct DraftState<B: Backend> {
    seq: SeqState<B>,
    /// Milliseconds per drafted token (a running average; 0 before the first).
    ms_per_token: f64,
}

impl<B: Backend> DraftState<B> {
    /// An empty draft cache for a sequence of up to `capacity` positions.
    pub fn new(model: &Model<B>, capacity: usize) -> Result<Self> {
        Ok(DraftState { seq: model.new_sequence(capacity)?, ms_per_token: 0.0 })
    }

    /// Milliseconds each drafted token costs.
    pub fn ms_per_token(&self) -> f64 {
        self.ms_per_token
    }

    /// Forgets what the cache holds past the first `valid` tokens (rejected drafts), then catches
    /// it up with `history` and takes the draft model's argmax `max` times.
    pub fn propose(
        &mut self,
        model: &Model<B>,
        history: &[u32],
        valid: usize,
        max: usize,
    ) -> Result<Vec<u32>> {
        if self.seq.len > valid {
            model.truncate(&mut self.seq, valid)?;
        }
        let mut feed = history[self.seq.len.min(history.len())..].to_vec();
        if max == 0 || feed.is_empty() {
            return Ok(Vec::new());
        }
        let t0 = Instant::now();
        let mut out = Vec::with_capacity(max);
        while out.len() < max {
            let logits = model.forward(&mut [(&feed, &mut self.seq)])?.remove(0);
            layerstream_kernels::host::check_logits(&logits, 0)?;
            let d = layerstream_kernels::host::argmax(&logits) as u32;
            out.push(d);
            feed = vec![d];
        }
        let ms = t0.elapsed().as_secs_f64() * 1e3 / max as f64;
        self.ms_per_token =
            if self.ms_per_token == 0.0 { ms } else { 0.8 * self.ms_per_token + 0.2 * ms };
        Ok(out)
    }
}

/// Who proposes the next tokens in `run`.
pub enum Drafter<'m, B: Backend> {
    Ngram,
    Model(&'m Model<B>, DraftState<B>),
}

impl<'m, B: Backend> Drafter<'m, B> {
    /// The drafter `mode` (resolved: `Ngram` or `Draft`) names, for a sequence of up to `capacity`
    /// positions.
    pub fn new(mode: SpecMode, draft: Option<&'m Model<B>>, capacity: usize) -> Result<Self> {
        Ok(match (mode, draft) {
            (SpecMode::Draft, Some(model)) => {
                Drafter::Model(model, DraftState::new(model, capacity)?)
            }
            _ => Drafter::Ngram,
        })
    }

    /// Milliseconds each drafted token costs (0 for prompt lookup).
    pub fn ms_per_token(&self) -> f64 {
        match self {
            Drafter::Ngram => 0.0,
            Drafter::Model(_, d) => d.ms_per_token(),
        }
    }

    /// Up to `max` tokens to follow `history`, of which the first `valid` tokens are final (the
    /// last token was just sampled).
    pub fn propose(&mut self, history: &[u32], valid: usize, max: usize) -> Result<Vec<u32>> {
        match self {
            Drafter::Ngram => Ok(ngram_propose(history, max)),
            Drafter::Model(m, d) => d.propose(m, history, valid, max),
        }
    }
}
