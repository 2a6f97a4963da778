//! Drafters for `layerstream run`'s speculative decoding: prompt lookup over the tokens so far, or a
//! smaller draft model with its own KV cache, proposing its greedy continuation.

use crate::error::Result;
use crate::model::{Model, SeqState};
use layerstream_kernels::Backend;
use layerstream_model::spec::{ngram_propose, SpecMode};
use std::time::Instant;

/// A draft model's sequence: its cache holds `seq.len` positions of the history.
pub struct DraftModel<'m, B: Backend> {
    model: &'m Model<B>,
    seq: SeqState<B>,
    /// Milliseconds per drafted token (a running average; 0 before the first).
    ms_per_token: f64,
}

/// Who proposes the next tokens.
pub enum Drafter<'m, B: Backend> {
    Ngram,
    Model(DraftModel<'m, B>),
}

impl<'m, B: Backend> Drafter<'m, B> {
    /// The drafter `mode` (resolved: `Ngram` or `Draft`) names, for a sequence of up to `capacity`
    /// positions.
    pub fn new(mode: SpecMode, draft: Option<&'m Model<B>>, capacity: usize) -> Result<Self> {
        Ok(match (mode, draft) {
            (SpecMode::Draft, Some(model)) => Drafter::Model(DraftModel {
                model,
                seq: model.new_sequence(capacity)?,
                ms_per_token: 0.0,
            }),
            _ => Drafter::Ngram,
        })
    }

    /// Milliseconds each drafted token costs (0 for prompt lookup).
    pub fn ms_per_token(&self) -> f64 {
        match self {
            Drafter::Ngram => 0.0,
            Drafter::Model(d) => d.ms_per_token,
        }
    }

    /// Up to `max` tokens to follow `history`.
    pub fn propose(&mut self, history: &[u32], max: usize) -> Result<Vec<u32>> {
        match self {
            Drafter::Ngram => Ok(ngram_propose(history, max)),
            Drafter::Model(d) => d.propose(history, max),
        }
    }

    /// The first `valid` positions of the history are final (the rest were rejected drafts).
    pub fn rollback(&mut self, valid: usize) -> Result<()> {
        match self {
            Drafter::Ngram => Ok(()),
            Drafter::Model(d) if d.seq.len > valid => d.model.truncate(&mut d.seq, valid),
            Drafter::Model(_) => Ok(()),
        }
    }
}

impl<B: Backend> DraftModel<'_, B> {
    /// Catches the draft's cache up with `history`, then takes its argmax `max` times.
    fn propose(&mut self, history: &[u32], max: usize) -> Result<Vec<u32>> {
        if max == 0 {
            return Ok(Vec::new());
        }
        let t0 = Instant::now();
        let mut feed = history[self.seq.len.min(history.len())..].to_vec();
        if feed.is_empty() {
            return Ok(Vec::new()); // not after a rollback, which leaves the last token to feed
        }
        let mut out = Vec::with_capacity(max);
        while out.len() < max {
            let logits = self.model.forward(&mut [(&feed, &mut self.seq)])?.remove(0);
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
