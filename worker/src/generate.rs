//! Generation: prefill, then decode token by token with sampling, stop strings, EOS and a token
//! budget, streaming text as it becomes final.

use crate::error::{Error, Result};
use crate::model::Model;
use crate::sampling::{Sampler, SamplingParams};
use layerstream_kernels::Backend;
use layerstream_model::Tokenizer;
use serde::Serialize;
use std::time::Instant;

/// What to generate.
#[derive(Debug, Clone)]
pub struct GenerateParams {
    pub max_new_tokens: usize,
    pub stop: Vec<String>,
    pub ignore_eos: bool,
    pub sampling: SamplingParams,
}

/// Wall-clock figures of one generation.
#[derive(Debug, Clone, Default, Serialize)]
pub struct Timings {
    pub prefill_tokens: usize,
    pub prefill_ms: f64,
    pub decode_tokens: usize,
    pub decode_ms: f64,
    pub prefill_tok_s: f64,
    pub decode_tok_s: f64,
}

/// The result of one generation.
#[derive(Debug, Clone, Serialize)]
pub struct Generation {
    pub input_ids: Vec<u32>,
    pub output_ids: Vec<u32>,
    pub text: String,
    /// "length", "eos" or "stop".
    pub finish_reason: String,
    pub timings: Timings,
}

/// Tracks output text, stop strings and what has been streamed so far.
#[derive(Debug, Clone, Default)]
pub struct TextTracker {
    stop: Vec<String>,
    emitted: usize,
    pub text: String,
}

impl TextTracker {
    /// A tracker for one sequence.
    pub fn new(stop: Vec<String>) -> Self {
        TextTracker { stop, emitted: 0, text: String::new() }
    }

    /// Re-decodes the output; returns (new final text to stream, whether a stop string matched).
    pub fn update(&mut self, tok: &Tokenizer, output: &[u32]) -> Result<(String, bool)> {
        let full = tok.decode(output, true)?;
        if let Some(cut) = self.stop.iter().filter_map(|s| full.find(s.as_str())).min() {
            self.text = full[..cut].to_owned();
            return Ok((self.flush(), true));
        }
        self.text = full;
        // Hold back an incomplete UTF-8 sequence and anything that may begin a stop string.
        let mut safe = self.text.trim_end_matches('\u{FFFD}').len();
        let hold = self.stop.iter().map(|s| s.len().saturating_sub(1)).max().unwrap_or(0);
        safe = safe.saturating_sub(hold).max(self.emitted);
        while !self.text.is_char_boundary(safe) {
            safe -= 1;
        }
        let delta = self.text[self.emitted.min(safe)..safe].to_owned();
        self.emitted = self.emitted.max(safe);
        Ok((delta, false))
    }

    /// Everything not streamed yet.
    pub fn flush(&mut self) -> String {
        let start = self.emitted.min(self.text.len());
        let rest = self.text.get(start..).unwrap_or("").to_owned();
        self.emitted = self.text.len();
        rest
    }
}

/// Checks a request against the model before any work is done.
pub fn check_request(input: &[u32], p: &GenerateParams, vocab: usize, context: usize) -> Result<()> {
    if input.is_empty() {
        return Err(Error::Request("the prompt encodes to zero tokens".into()));
    }
    if let Some(bad) = input.iter().find(|&&t| t as usize >= vocab) {
        return Err(Error::Request(format!("token id {bad} is outside the vocabulary of {vocab}")));
    }
    if input.len() + p.max_new_tokens > context {
        return Err(Error::Request(format!(
            "prompt of {} tokens + max_new_tokens {} exceeds the model's context of {context}",
            input.len(), p.max_new_tokens
        )));
    }
    p.sampling.validate().map_err(Error::Request)
}

/// Generates from `input`, calling `on_text` with each piece of final text.
pub fn generate<B: Backend>(
    model: &Model<B>,
    tok: &Tokenizer,
    input: &[u32],
    p: &GenerateParams,
    mut on_text: impl FnMut(&str),
) -> Result<Generation> {
    let cfg = &model.cfg;
    check_request(input, p, cfg.vocab_size, cfg.max_position_embeddings)?;
    let mut sampler = Sampler::new(p.sampling.clone());
    let mut seq = model.new_sequence(input.len() + p.max_new_tokens)?;
    let mut history = input.to_vec();
    let mut output = Vec::new();
    let mut tracker = TextTracker::new(p.stop.clone());
    let mut t = Timings { prefill_tokens: input.len(), ..Default::default() };
    let mut finish = "length";
    let mut next: Vec<u32> = input.to_vec();
    let start = Instant::now();
    let mut decode_start = start;
    while output.len() < p.max_new_tokens {
        let mut logits = model.forward(&mut [(&next, &mut seq)])?.remove(0);
        if output.is_empty() {
            t.prefill_ms = start.elapsed().as_secs_f64() * 1e3;
            decode_start = Instant::now();
        }
        layerstream_kernels::host::check_logits(&logits, 0)?;
        let id = sampler.sample(&mut logits, &history);
        output.push(id);
        history.push(id);
        if !p.ignore_eos && cfg.eos_token_ids.contains(&id) {
            finish = "eos";
            break;
        }
        let (delta, stopped) = tracker.update(tok, &output)?;
        on_text(&delta);
        if stopped {
            finish = "stop";
            break;
        }
        next = vec![id];
    }
    on_text(&tracker.flush());
    t.decode_tokens = output.len().saturating_sub(1);
    t.decode_ms = decode_start.elapsed().as_secs_f64() * 1e3;
    t.prefill_tok_s = rate(t.prefill_tokens, t.prefill_ms);
    t.decode_tok_s = rate(t.decode_tokens, t.decode_ms);
    Ok(Generation { input_ids: input.to_vec(), output_ids: output, text: tracker.text, finish_reason: finish.into(), timings: t })
}

fn rate(n: usize, ms: f64) -> f64 {
    if ms > 0.0 { n as f64 / (ms / 1e3) } else { 0.0 }
}
