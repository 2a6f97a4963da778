//! A running sequence as the scheduler keeps it: its request, how far the workers' caches hold it,
//! its output so far, its KV blocks and its drafting state — and the one `rewind` that every replay
//! (a fault, a preemption without a host tier, workers that forgot their caches) goes through.

use super::SeqRequest;
use crate::stats::Acc;
use layerstream_serving::kv_blocks::SeqBlocks;
use layerstream_serving::spec::Acceptance;
use layerstream_serving::Stopper;
use std::time::Instant;

/// A draft for a sequence's next step: its tokens and their tree parents (empty: a chain).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct Draft {
    pub(crate) tokens: Vec<u32>,
    pub(crate) parents: Vec<u32>,
}

/// One sequence the scheduler runs.
pub(crate) struct Active {
    pub(crate) req: SeqRequest,
    /// Tokens the workers' KV caches hold for it (0 again after a fault: it is replayed).
    pub(crate) pos: usize,
    /// Output tokens, their text, and the stop criteria.
    pub(crate) stopper: Stopper,
    pub(crate) acc: Acc,
    pub(crate) started: Instant,
    /// The micro-batch it rides (None: not placed yet, or waiting for a lane to come back).
    pub(crate) lane: Option<usize>,
    /// How often its drafted tokens were accepted (speculative decoding).
    pub(crate) acceptance: Acceptance,
    /// The head's draft model's proposal to follow its known tokens (for its next step).
    pub(crate) next_draft: Draft,
    /// Its last step verified a token tree (or its format forced tokens): the caches hold its
    /// tokens up to the one before, and the rest goes in again with the next token, in one chunk.
    pub(crate) refeed: bool,
    /// Its KV blocks, and the position its first step on the workers starts at (the prompt tokens
    /// found in the prefix cache; 0 without).
    pub(crate) blocks: SeqBlocks,
    pub(crate) base: usize,
    /// Preempted to the host tier: the host slots holding its blocks, in table order (empty: not
    /// swapped out).
    pub(crate) swapped: Vec<u32>,
    /// Output tokens its format forced (emitted without sampling: no draw).
    pub(crate) forced: usize,
    /// Its prompt's log-probabilities so far (a request with `prompt_logprobs`), and whether they
    /// were sent.
    pub(crate) scores: Vec<layerstream_rpc::v1::TokenLogprobs>,
    pub(crate) scores_sent: bool,
}

impl Active {
    /// A sequence about to start: nothing in the caches, nothing generated.
    pub(crate) fn new(req: SeqRequest, eos: &[u32]) -> Self {
        let stopper = Stopper::new(&req.params, eos);
        Active {
            req,
            pos: 0,
            stopper,
            acc: Acc::default(),
            started: Instant::now(),
            lane: None,
            acceptance: Acceptance::default(),
            next_draft: Draft::default(),
            refeed: false,
            blocks: SeqBlocks::default(),
            base: 0,
            swapped: Vec::new(),
            forced: 0,
            scores: Vec::new(),
            scores_sent: false,
        }
    }

    /// The workers hold nothing of it any more: it is replayed from position 0 (its prompt and
    /// output so far prefilled again). Its blocks must have gone back to the pool (or the pool was
    /// replaced); host slots it held are forgotten.
    pub(crate) fn rewind(&mut self) {
        (self.pos, self.base, self.refeed) = (0, 0, false);
        self.next_draft = Draft::default();
        self.blocks = SeqBlocks::default();
        self.swapped.clear();
    }

    /// Tokens known so far: the prompt, then every output token.
    pub(crate) fn known(&self) -> usize {
        self.req.input_ids.len() + self.stopper.output().len()
    }

    /// Where prefilling ends and decoding starts: the prompt's end, or — for a sequence replayed
    /// after a fault — the last output token, which then goes in as a normal decode.
    pub(crate) fn prefill_end(&self) -> usize {
        if self.stopper.output().is_empty() {
            self.req.input_ids.len()
        } else if self.refeed {
            // After a tree: the accepted branch and the new token go in as one chunk that samples.
            self.known()
        } else {
            self.known() - 1
        }
    }

    /// Every known token: the prompt, then the output.
    pub(crate) fn history(&self) -> Vec<u32> {
        [self.req.input_ids.as_slice(), self.stopper.output()].concat()
    }

    /// The `n` known tokens from `pos` on.
    pub(crate) fn tokens(&self, n: usize) -> Vec<u32> {
        let input = &self.req.input_ids;
        (self.pos..self.pos + n)
            .map(|i| {
                input.get(i).copied().unwrap_or_else(|| self.stopper.output()[i - input.len()])
            })
            .collect()
    }
}

impl SeqRequest {
    /// Whether it was cancelled or its client went away.
    pub(crate) fn gone(&self) -> bool {
        self.cancel.load(std::sync::atomic::Ordering::Relaxed) || self.events.is_closed()
    }
}
