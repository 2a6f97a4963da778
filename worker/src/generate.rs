//! Generation: prefill, then decode with sampling, stop strings, EOS and a token budget, streaming
//! text as it becomes final; optionally speculative (a drafter proposes tokens, one pass verifies
//! them all, the KV cache rolls back past the first rejected one).

use crate::draft::Drafter;
use crate::error::Result;
use crate::model::Model;
use crate::sampling::Sampler;
use layerstream_kernels::Backend;
use layerstream_model::Tokenizer;
use layerstream_serving::spec::{
    choose_draft, drafted_child, levels, tree_or_chain, Acceptance, PassCost, SpecMode,
};
use layerstream_serving::{check_request, FinishReason, GenerateParams, Stopper};
use serde::Serialize;
use std::time::Instant;

/// Wall-clock figures of one generation, and what speculation did.
#[derive(Debug, Clone, Default, Serialize)]
pub struct Timings {
    pub prefill_tokens: usize,
    pub prefill_ms: f64,
    pub decode_tokens: usize,
    pub decode_ms: f64,
    pub prefill_tok_s: f64,
    pub decode_tok_s: f64,
    /// Tokens drafted, and of those accepted.
    pub spec_drafted: usize,
    pub spec_accepted: usize,
    /// Weight passes that emitted tokens, and generated tokens per pass.
    pub weight_passes: usize,
    pub tokens_per_pass: f64,
}

/// The result of one generation.
#[derive(Debug, Clone, Serialize)]
pub struct Generation {
    pub input_ids: Vec<u32>,
    pub output_ids: Vec<u32>,
    pub text: String,
    #[serde(serialize_with = "layerstream_serving::stop::serialize_reason")]
    pub finish_reason: FinishReason,
    pub timings: Timings,
}

/// How `generate` speculates: the drafter (`Off`, `Ngram` or `Draft`, resolved), the most tokens it
/// drafts per pass, the draft model for `Draft`, and the candidates a draft model's tree branches
/// on per step (1: a chain).
pub struct Speculation<'m, B: Backend> {
    pub mode: SpecMode,
    pub max: usize,
    pub draft: Option<&'m Model<B>>,
    pub width: usize,
}

impl<B: Backend> Speculation<'_, B> {
    /// No speculation.
    pub fn off() -> Self {
        Speculation { mode: SpecMode::Off, max: 0, draft: None, width: 1 }
    }
}

/// Generates from `input`, calling `on_text` with each piece of final text.
pub fn generate<B: Backend>(
    model: &Model<B>,
    tok: &Tokenizer,
    input: &[u32],
    p: &GenerateParams,
    spec: &Speculation<'_, B>,
    mut on_text: impl FnMut(&str),
) -> Result<Generation> {
    let cfg = &model.cfg;
    check_request(input, p, cfg.vocab_size, cfg.max_position_embeddings)?;
    let mut sampler = Sampler::new(p.sampling.clone());
    let mut seq = model.new_sequence();
    let limit = p.speculative.max(spec.max);
    let mut drafter = match spec.mode {
        SpecMode::Off => None,
        _ if limit == 0 => None,
        mode => Some(Drafter::new(mode, spec.draft)),
    };
    let (mut acceptance, mut cost) = (Acceptance::default(), PassCost::default());
    let mut history = input.to_vec();
    let mut stopper = Stopper::new(p, &cfg.eos_token_ids);
    let mut t = Timings { prefill_tokens: input.len(), ..Default::default() };
    let mut next: Vec<u32> = input.to_vec();
    let start = Instant::now();
    let mut decode_start = start;
    let finish = 'gen: loop {
        if p.max_new_tokens == 0 {
            break FinishReason::Length;
        }
        let remaining = p.max_new_tokens - (history.len() - input.len());
        let (draft, parents) = match drafter.as_mut() {
            Some(d) => {
                let limits = (p.speculative.n_min, limit.min(remaining - 1));
                let choice = DraftChoice { rows: next.len() - 1, width: spec.width, limits };
                choice.draft(d, &history, acceptance.rate(), &cost)?
            }
            None => (Vec::new(), Vec::new()),
        };
        let feed = [next.as_slice(), &draft].concat();
        let t0 = Instant::now();
        // Greedy and undrafted: only the argmax is wanted (the backend may find it without every
        // logit); otherwise the rows' logits.
        let argmax = (draft.is_empty() && sampler.is_greedy())
            .then(|| model.forward_argmax(&feed, &mut seq))
            .transpose()?;
        let rows = match argmax {
            Some(_) => Vec::new(),
            None => model.forward_tree(&feed, &mut seq, &parents, draft.len() + 1)?,
        };
        if history.len() == input.len() {
            t.prefill_ms = start.elapsed().as_secs_f64() * 1e3;
            decode_start = Instant::now();
        } else {
            cost.record(feed.len(), t0.elapsed().as_secs_f64() * 1e3);
        }
        t.weight_passes += 1;
        t.spec_drafted += draft.len();
        // Walk the draft from the row of the last token fed before it: sample each row as without a
        // draft and follow the drafted child that agrees.
        let (mut at, mut accepted) = (0usize, 0);
        let before = history.len();
        loop {
            let id = match argmax {
                Some(id) => id,
                None => {
                    let mut logits = rows[at].clone();
                    layerstream_kernels::host::check_logits(&logits, at)?;
                    sampler.sample(&mut logits, &history)
                }
            };
            history.push(id);
            let step = stopper.push(tok, id)?;
            on_text(&step.delta);
            let child = drafted_child(&draft, &parents, at, id);
            if let Some(reason) = step.finish {
                t.spec_accepted += accepted + usize::from(child.is_some());
                break 'gen reason;
            }
            match child {
                Some(c) => {
                    at = c + 1;
                    accepted += 1;
                }
                None => break,
            }
        }
        t.spec_accepted += accepted;
        acceptance.record(levels(&parents, draft.len()), accepted);
        // The cache keeps what is final: a chain's accepted prefix; a tree's rows up to the token
        // before it (the accepted branch is fed again, in order, with the next token).
        let keep = if parents.is_empty() { history.len() - 1 } else { before };
        if seq.len > keep {
            model.truncate(&mut seq, keep)?;
        }
        next = history[keep..].to_vec();
    };
    let output = stopper.output().to_vec();
    t.decode_tokens = output.len().saturating_sub(1);
    t.finish(decode_start.elapsed(), history.len() - input.len());
    Ok(Generation {
        input_ids: input.to_vec(),
        output_ids: output,
        text: stopper.text,
        finish_reason: finish,
        timings: t,
    })
}

/// How a step's draft is sized: the rows fed before it (the tokens after the last step's), the
/// draft model's tree width, and the request's (min, max) draft.
struct DraftChoice {
    rows: usize,
    width: usize,
    limits: (usize, usize),
}

impl DraftChoice {
    /// The draft (tokens, tree parents) as long as maximises tokens per millisecond at acceptance
    /// rate `rate` and the measured pass cost; empty when no size pays or fewer than the minimum
    /// were proposed.
    fn draft<B: Backend>(
        &self,
        d: &mut Drafter<'_, B>,
        history: &[u32],
        rate: f64,
        cost: &PassCost,
    ) -> Result<(Vec<u32>, Vec<u32>)> {
        let (min, max) = self.limits;
        // A tree's rows (the tokens fed again before the draft, and the draft) fit a mask.
        let max = if self.width > 1 { max.min(63usize.saturating_sub(self.rows)) } else { max };
        let k = choose_draft(rate, cost, (self.rows, 0.0), d.cost(), (min, max), self.width);
        let (t, p) = if k > 0 { d.propose(history, k, self.width)? } else { Default::default() };
        Ok(if t.len() < min || t.is_empty() { Default::default() } else { (t, tree_or_chain(p)) })
    }
}

impl Timings {
    /// The rates, once decoding took `decode` and `generated` tokens came out.
    fn finish(&mut self, decode: std::time::Duration, generated: usize) {
        self.decode_ms = decode.as_secs_f64() * 1e3;
        self.prefill_tok_s = rate(self.prefill_tokens, self.prefill_ms);
        self.decode_tok_s = rate(self.decode_tokens, self.decode_ms);
        self.tokens_per_pass = match self.weight_passes {
            0 => 0.0,
            n => generated as f64 / n as f64,
        };
    }
}

fn rate(n: usize, ms: f64) -> f64 {
    if ms > 0.0 {
        n as f64 / (ms / 1e3)
    } else {
        0.0
    }
}
