//! Drafters for speculative decoding: prompt lookup over the tokens so far, or a smaller draft
//! model with its own KV cache per sequence, proposing its greedy continuation (used by
//! `layerstream run`, and by a pipeline's head stage when its assignment names a draft model).

use crate::error::Result;
use crate::model::{Model, SeqState};
use layerstream_kernels::Backend;
use layerstream_serving::spec::{ngram_propose, DraftCost, SpecMode};
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

    /// Up to `max` drafted tokens after `history` and their parents (0: the last token of
    /// `history`; i: token i − 1), each parent before its child: the draft model's greedy chain
    /// (`width` 1), or a token tree grown best first (`best_first`). `probe`: the cost of a draft
    /// pass is not known yet, so it is measured on the last few tokens of the history instead of
    /// after catching up with all of it (a prefill the first time).
    pub fn propose_tree<B: Backend>(
        &mut self,
        model: &Model<B>,
        history: &[u32],
        max: usize,
        width: usize,
        probe: bool,
    ) -> Result<(Vec<u32>, Vec<u32>)> {
        if max == 0 || history.is_empty() {
            return Ok((Vec::new(), Vec::new()));
        }
        let common = self.fed.iter().zip(history).take_while(|(a, b)| a == b).count();
        let mut caught_up = history.len() - common <= PROBE_CONTEXT;
        let mut path = history.to_vec();
        if probe && !caught_up {
            // What a pass costs is not known yet: measure it on the last few tokens alone rather
            // than catch the draft up with the whole history first (a prefill that, where drafting
            // does not pay, is all it would cost). The draft is poorer; it is verified all the same.
            model.truncate(&mut self.seq, 0)?;
            self.fed.clear();
            path = history[history.len() - PROBE_CONTEXT..].to_vec();
            caught_up = true;
        }
        // Each draft pass's milliseconds; the first also catches the draft up with the history, so
        // it measures a pass only when it fed few tokens.
        let mut pass_ms = Vec::with_capacity(max);
        let t0 = Instant::now();
        let root = self.feed(model, &path)?;
        pass_ms.push(t0.elapsed().as_secs_f64() * 1e3);
        let drafted = if width <= 1 {
            self.chain(model, path, root, max, &mut pass_ms)?
        } else {
            self.best_first(model, &root, max.min(63), width, &mut pass_ms)?
        };
        let measured = if caught_up { &pass_ms[..] } else { &pass_ms[1..] };
        if !measured.is_empty() {
            let ms = measured.iter().sum::<f64>() / measured.len() as f64;
            self.ms_per_level =
                if self.ms_per_level == 0.0 { ms } else { 0.8 * self.ms_per_level + 0.2 * ms };
        }
        Ok(drafted)
    }

    /// The greedy chain after `path` (whose last logits are `logits`): one pass per token, each
    /// kept in the cache (the next step reuses what was accepted).
    fn chain<B: Backend>(
        &mut self,
        model: &Model<B>,
        mut path: Vec<u32>,
        mut logits: Vec<f32>,
        max: usize,
        pass_ms: &mut Vec<f64>,
    ) -> Result<(Vec<u32>, Vec<u32>)> {
        let mut tokens = Vec::with_capacity(max);
        loop {
            let t = layerstream_kernels::host::top_k(&logits, 1)[0];
            tokens.push(t);
            path.push(t);
            if tokens.len() == max {
                break;
            }
            let t0 = Instant::now();
            logits = self.feed(model, &path)?;
            pass_ms.push(t0.elapsed().as_secs_f64() * 1e3);
        }
        let parents = (0..tokens.len() as u32).collect();
        Ok((tokens, parents))
    }

    /// A token tree of at most `max` nodes grown best first, as SpecExec does: the candidates are
    /// the `width` most likely continuations of the root and of every node grown so far, scored by
    /// the draft's log-probability of their whole path; each round adds the `width` best and runs
    /// them through the draft in one pass (their rows attend to their own ancestors only,
    /// `Model::forward_grow`) for their continuations. A likely branch grows deep, an unlikely one
    /// stops at a leaf. The tree's rows leave the draft's cache afterwards.
    fn best_first<B: Backend>(
        &mut self,
        model: &Model<B>,
        root: &[f32],
        max: usize,
        width: usize,
        pass_ms: &mut Vec<f64>,
    ) -> Result<(Vec<u32>, Vec<u32>)> {
        let base = self.seq.len;
        let mut cands = continuations(root, width, 0.0, 0, 0);
        let (mut tokens, mut parents) = (Vec::with_capacity(max), Vec::with_capacity(max));
        let (mut masks, mut score) = (Vec::with_capacity(max), Vec::with_capacity(max));
        while tokens.len() < max && !cands.is_empty() {
            cands.sort_by(|a, b| b.logp.total_cmp(&a.logp));
            let first = tokens.len();
            for c in cands.drain(..width.min(max - first).min(cands.len())) {
                masks.push(c.ancestors | 1 << tokens.len());
                tokens.push(c.token);
                parents.push(c.parent);
                score.push(c.logp);
            }
            if tokens.len() == max {
                break;
            }
            let t0 = Instant::now();
            let new = masks[first..].to_vec();
            let logits = model.forward_grow(&tokens[first..], &mut self.seq, new, first)?;
            pass_ms.push(t0.elapsed().as_secs_f64() * 1e3);
            for (i, l) in logits.iter().enumerate() {
                let node = first + i;
                layerstream_kernels::host::check_logits(l, 0)?;
                cands.extend(continuations(l, width, score[node], node as u32 + 1, masks[node]));
            }
        }
        model.truncate(&mut self.seq, base)?;
        Ok((tokens, parents))
    }
}

/// A token the tree may grow: its parent (0: the root; i: node i − 1), the parent's ancestor mask
/// and the draft's log-probability of the path ending in it.
struct Candidate {
    token: u32,
    parent: u32,
    ancestors: u64,
    logp: f64,
}

/// The `k` most likely continuations of a node whose path scores `logp` (log-softmax of `logits`).
fn continuations(
    logits: &[f32],
    k: usize,
    logp: f64,
    parent: u32,
    ancestors: u64,
) -> Vec<Candidate> {
    let max = logits.iter().fold(f32::NEG_INFINITY, |a, &b| a.max(b)) as f64;
    let lse = max + logits.iter().map(|&x| (x as f64 - max).exp()).sum::<f64>().ln();
    layerstream_kernels::host::top_k(logits, k)
        .into_iter()
        .map(|t| Candidate {
            token: t,
            parent,
            ancestors,
            logp: logp + logits[t as usize] as f64 - lse,
        })
        .collect()
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
