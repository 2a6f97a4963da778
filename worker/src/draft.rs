//! Drafters for speculative decoding: prompt lookup over the tokens so far, or a smaller draft
//! model with its own KV cache per sequence, proposing its greedy continuation (used by
//! `layerstream run`, and by a pipeline's head stage when its assignment names a draft model).

use crate::error::Result;
use crate::model::{Model, SeqState};
use layerstream_kernels::Backend;
use layerstream_model::spec::{ngram_propose, DraftCost, SpecMode};
use std::time::Instant;

/// Tokens of context a probing draft (one that measures the draft model's cost) sees.
const PROBE_CONTEXT: usize = 4;

/// One sequence's state in a draft model: its cache holds the tokens `fed`.
pub struct DraftState {
    seq: SeqState,
    fed: Vec<u32>,
    /// Milliseconds per level of drafting — one forward pass of the draft model (a running
    /// average; 0 before the first measurement).
    ms_per_level: f64,
}

impl DraftState {
    /// An empty draft cache for a sequence.
    pub fn new<B: Backend>(model: &Model<B>) -> Self {
        DraftState { seq: model.new_sequence(), fed: Vec::new(), ms_per_level: 0.0 }
    }

    /// Milliseconds each level of drafting costs (0: not measured yet).
    pub fn ms_per_level(&self) -> f64 {
        self.ms_per_level
    }

    /// Forgets what the cache holds past its common prefix with `history` (rejected drafts), keeping
    /// at least the last token to feed, and feeds `tokens` after it; returns the last logits.
    fn feed<B: Backend>(&mut self, model: &Model<B>, history: &[u32]) -> Result<Vec<f32>> {
        let keep = self.fed.iter().zip(history).take_while(|(a, b)| a == b).count();
        let keep = keep.min(history.len().saturating_sub(1));
        if self.seq.len > keep {
            model.truncate(&mut self.seq, keep)?;
            self.fed.truncate(keep);
        }
        let new = &history[keep..];
        let logits = model.forward(&mut [(new, &mut self.seq)])?.remove(0);
        self.fed.extend_from_slice(new);
        layerstream_kernels::host::check_logits(&logits, 0)?;
        Ok(logits)
    }

    /// A token tree of at most `max` tokens after `history`: the draft model's greedy chain, and at
    /// each of its steps the next `width - 1` most likely tokens as leaves beside it (width 1: the
    /// chain alone). `probe`: the cost of a level is not known yet, so it is measured on the last
    /// few tokens of the history instead of after catching up with all of it. Returns the tokens and their parents (0: the last token of `history`; i: token
    /// i - 1), each parent before its child.
    pub fn propose_tree<B: Backend>(
        &mut self,
        model: &Model<B>,
        history: &[u32],
        max: usize,
        width: usize,
        probe: bool,
    ) -> Result<(Vec<u32>, Vec<u32>)> {
        let width = width.max(1);
        let levels = max / width;
        if levels == 0 || history.is_empty() {
            return Ok((Vec::new(), Vec::new()));
        }
        let (mut tokens, mut parents) = (Vec::with_capacity(max), Vec::with_capacity(max));
        let mut parent = 0u32;
        // Each level's milliseconds; the first also catches the draft up with the history (a
        // prefill the first time), so it measures a level only when it fed few tokens.
        let mut level_ms = Vec::with_capacity(levels);
        let common = self.fed.iter().zip(history).take_while(|(a, b)| a == b).count();
        let mut caught_up = history.len() - common <= PROBE_CONTEXT;
        let mut path = history.to_vec();
        if probe && !caught_up {
            // What a level costs is not known yet: measure it on the last few tokens alone rather
            // than catch the draft up with the whole history first (a prefill that, where drafting
            // does not pay, is all it would cost). The draft is poorer; it is verified all the same.
            model.truncate(&mut self.seq, 0)?;
            self.fed.clear();
            path = history[history.len() - PROBE_CONTEXT..].to_vec();
            caught_up = true;
        }
        for _ in 0..levels {
            let t0 = Instant::now();
            let logits = self.feed(model, &path)?;
            level_ms.push(t0.elapsed().as_secs_f64() * 1e3);
            let top = layerstream_kernels::host::top_k(&logits, width);
            let chain = tokens.len() as u32 + 1;
            for &t in &top {
                tokens.push(t);
                parents.push(parent);
            }
            path.push(top[0]);
            parent = chain;
        }
        let measured = if caught_up { &level_ms[..] } else { &level_ms[1..] };
        if !measured.is_empty() {
            let ms = measured.iter().sum::<f64>() / measured.len() as f64;
            self.ms_per_level =
                if self.ms_per_level == 0.0 { ms } else { 0.8 * self.ms_per_level + 0.2 * ms };
        }
        Ok((tokens, parents))
    }
}

/// Who proposes the next tokens in `run`.
pub enum Drafter<'m, B: Backend> {
    Ngram,
    Model(&'m Model<B>, DraftState),
}

impl<'m, B: Backend> Drafter<'m, B> {
    /// The drafter `mode` (resolved: `Ngram` or `Draft`) names.
    pub fn new(mode: SpecMode, draft: Option<&'m Model<B>>) -> Self {
        match (mode, draft) {
            (SpecMode::Draft, Some(model)) => Drafter::Model(model, DraftState::new(model)),
            _ => Drafter::Ngram,
        }
    }

    /// What a level of drafting costs.
    pub fn cost(&self) -> DraftCost {
        match self {
            Drafter::Ngram => DraftCost::Free,
            Drafter::Model(_, d) => DraftCost::of_model(d.ms_per_level()),
        }
    }

    /// Up to `max` tokens to follow `history` and their parents (a tree of `width` candidates per
    /// step with a draft model — a probing one on the last few tokens until its cost is measured;
    /// prompt lookup drafts a chain).
    pub fn propose(
        &mut self,
        history: &[u32],
        max: usize,
        width: usize,
    ) -> Result<(Vec<u32>, Vec<u32>)> {
        match self {
            Drafter::Ngram => {
                let t = ngram_propose(history, max);
                let chain = (0..t.len() as u32).collect();
                Ok((t, chain))
            }
            Drafter::Model(m, d) => {
                let probe = d.ms_per_level() == 0.0;
                d.propose_tree(m, history, max, width, probe)
            }
        }
    }
}
