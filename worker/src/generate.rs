//! Generation: prefill, then decode token by token with sampling, stop strings, EOS and a token
//! budget, streaming text as it becomes final.

use crate::error::Result;
use crate::model::Model;
use crate::sampling::Sampler;
use layerstream_kernels::Backend;
use layerstream_model::{check_request, FinishReason, GenerateParams, Stopper, Tokenizer};
use serde::Serialize;
use std::time::Instant;

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
    #[serde(serialize_with = "layerstream_model::stop::serialize_reason")]
    pub finish_reason: FinishReason,
    pub timings: Timings,
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
    let mut stopper = Stopper::new(p, &cfg.eos_token_ids);
    let mut t = Timings { prefill_tokens: input.len(), ..Default::default() };
    let mut next: Vec<u32> = input.to_vec();
    let start = Instant::now();
    let mut decode_start = start;
    let finish = loop {
        if p.max_new_tokens == 0 {
            break FinishReason::Length;
        }
        let mut logits = model.forward(&mut [(&next, &mut seq)])?.remove(0);
        if history.len() == input.len() {
            t.prefill_ms = start.elapsed().as_secs_f64() * 1e3;
            decode_start = Instant::now();
        }
        layerstream_kernels::host::check_logits(&logits, 0)?;
        let id = sampler.sample(&mut logits, &history);
        history.push(id);
        let step = stopper.push(tok, id)?;
        on_text(&step.delta);
        if let Some(reason) = step.finish {
            break reason;
        }
        next = vec![id];
    };
    let output = stopper.output().to_vec();
    t.decode_tokens = output.len().saturating_sub(1);
    t.decode_ms = decode_start.elapsed().as_secs_f64() * 1e3;
    t.prefill_tok_s = rate(t.prefill_tokens, t.prefill_ms);
    t.decode_tok_s = rate(t.decode_tokens, t.decode_ms);
    Ok(Generation {
        input_ids: input.to_vec(),
        output_ids: output,
        text: stopper.text,
        finish_reason: finish,
        timings: t,
    })
}

fn rate(n: usize, ms: f64) -> f64 {
    if ms > 0.0 {
        n as f64 / (ms / 1e3)
    } else {
        0.0
    }
}
