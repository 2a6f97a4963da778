//! The scheduler's paged KV cache: one block manager (`BlockPool`) that every worker's pools
//! follow (each step names every sequence's blocks), prefix caching at admission, blocks taken as
//! sequences grow, and preemption — the newest sequence not in flight gives its blocks back and is
//! replayed later from its prompt and output so far — when the pool runs dry.

use super::{Active, Scheduler};
use layerstream_model::kv_blocks::BlockPool;

impl Scheduler {
    /// A fresh block manager for the pool every worker holds (after a plan or a fault the workers'
    /// pools are new, so nothing cached survives).
    pub(super) fn fresh_blocks(&self) -> BlockPool {
        let block = self.limits.kv_block.max(1);
        BlockPool::new(self.limits.kv_capacity.div_ceil(block), block, self.limits.prefix_cache)
    }

    /// Forgets every block (the workers' pools were replaced): active sequences keep none.
    pub(super) fn reset_blocks(&mut self, active: &mut [Active]) {
        let counts = self.blocks.counts;
        self.blocks = self.fresh_blocks();
        self.blocks.counts = counts;
        for a in active {
            a.blocks = Default::default();
            a.base = 0;
        }
        self.kv_gauges();
    }

    /// Blocks a waiting request needs to start: its prompt and one generated token.
    pub(super) fn blocks_to_admit(&self, prompt: usize) -> usize {
        self.blocks.blocks_for(prompt + 1)
    }

    /// A sequence joins: it starts after the longest prefix of its prompt the pool holds.
    pub(super) fn start_sequence(&mut self, a: &mut Active) {
        if a.pos > 0 {
            return;
        }
        let (blocks, cached) = self.blocks.lookup(&a.req.input_ids);
        (a.blocks, a.pos, a.base) = (blocks, cached, cached);
        a.acc.cached_tokens = a.acc.cached_tokens.max(cached as u32);
        self.metrics.prefix(self.blocks.counts);
    }

    /// Blocks a sequence not in flight may add in its next step (its next prompt chunk, or a
    /// decode token and a draft).
    fn next_growth(&self, a: &Active) -> usize {
        let end = a.prefill_end();
        let bring = if a.pos < end {
            (end - a.pos).min(self.limits.max_step_tokens)
        } else {
            1 + a.req.params.speculative.max(self.spec.1)
        };
        self.blocks.blocks_for(a.pos + bring).saturating_sub(a.blocks.table.len())
    }

    /// Preempts the newest sequences not in flight until the others' next steps fit the pool;
    /// returns them (their blocks given back, to be replayed). The oldest sequence is never
    /// preempted for a newer one.
    pub(super) fn make_room(
        &mut self,
        active: &mut Vec<Active>,
        in_flight: &[bool],
    ) -> Vec<Active> {
        let mut flight = in_flight.to_vec();
        let mut out = Vec::new();
        loop {
            let want: usize = active
                .iter()
                .zip(&flight)
                .filter(|(_, &f)| !f)
                .map(|(a, _)| self.next_growth(a))
                .sum();
            if want <= self.blocks.available() {
                return out;
            }
            let Some(i) = (1..active.len()).rev().find(|&i| !flight[i]) else { return out };
            flight.remove(i);
            let mut a = active.remove(i);
            self.blocks.release(&mut a.blocks);
            (a.pos, a.base, a.lane) = (0, 0, None);
            a.acc.preemptions += 1;
            a.next_draft = Default::default();
            a.refeed = false;
            self.metrics.preempted.inc();
            tracing::info!(
                seq = a.req.seq_id,
                free = self.blocks.available(),
                "KV pool full: sequence preempted, to be replayed"
            );
            out.push(a);
        }
    }

    /// Gives `a` blocks for positions up to `end`; false when the pool cannot (it sits out).
    pub(super) fn grow(&mut self, a: &mut Active, end: usize) -> bool {
        let ok = self.blocks.grow(&mut a.blocks, end).is_ok();
        self.kv_gauges();
        ok
    }

    /// After a step: the sequence's committed positions are `..a.pos`; blocks past them (rejected
    /// drafts) go back, full ones are keyed for sharing.
    pub(super) fn settle(&mut self, a: &mut Active) {
        self.blocks.shrink(&mut a.blocks, a.pos);
        let known = a.history();
        self.blocks.commit(&mut a.blocks, &known[..a.pos.min(known.len())]);
        self.kv_gauges();
    }

    /// A sequence leaves: its blocks go back (keyed ones stay cached).
    pub(super) fn free_blocks(&mut self, a: &mut Active) {
        self.blocks.release(&mut a.blocks);
        self.kv_gauges();
    }

    fn kv_gauges(&self) {
        let used = self.blocks.blocks() - self.blocks.available();
        self.metrics.kv_blocks.set(used as i64);
        self.metrics.kv_cached_blocks.set(self.blocks.cached_blocks() as i64);
    }
}
