//! The scheduler's paged KV cache: one block manager (`BlockPool`) that every worker's pools
//! follow (each step names every sequence's blocks), prefix caching at admission, blocks taken as
//! sequences grow, and preemption when the pool runs dry: the newest sequence not in flight gives
//! its blocks back — copied to the workers' host-RAM tier (`Worker/Swap`) and copied back when it
//! resumes, or, when the tier is full or off, replayed later from its prompt and output so far.
//! Cached prefix blocks the device must give up go to the host tier too, and a later prompt's
//! lookup brings them back.

use super::{Active, Scheduler, SeqRequest};
use layerstream_model::kv_blocks::BlockPool;

impl Scheduler {
    /// A fresh block manager for the pool every worker holds (after a plan or a fault the workers'
    /// pools are new, so nothing cached survives).
    pub(super) fn fresh_blocks(&self) -> BlockPool {
        let block = self.limits.kv_block.max(1);
        BlockPool::new(self.limits.kv_capacity.div_ceil(block), block, self.limits.prefix_cache)
    }

    /// Forgets every block and the host tier (the workers' pools were replaced): active sequences
    /// keep none, and swapped-out ones will be replayed.
    pub(super) fn reset_blocks(&mut self, active: &mut [Active]) {
        let counts = self.blocks.counts;
        self.blocks = self.fresh_blocks();
        self.blocks.counts = counts;
        for a in active {
            a.blocks = Default::default();
            a.base = 0;
        }
        self.host_free = (0..self.limits.host_blocks as u32).rev().collect();
        self.host_prefixes.clear();
        self.host_prefix_order.clear();
        (self.swaps, self.host_emptied) = (Default::default(), Vec::new());
        for a in self.preempted.iter_mut().filter(|a| !a.swapped.is_empty()) {
            a.swapped.clear();
            (a.pos, a.base, a.refeed, a.next_draft) = (0, 0, false, Default::default());
        }
        self.kv_gauges();
    }

    /// A preempted sequence swapped to the host tier takes device blocks again and has its blocks
    /// copied back into them before its next step (admission counted the blocks).
    pub(super) fn resume(&mut self, a: &mut Active) {
        if a.swapped.is_empty() {
            return;
        }
        let mut fresh = Default::default();
        let ok = self.blocks.grow(&mut fresh, a.swapped.len() * self.blocks.block()).is_ok();
        debug_assert!(ok, "admission counted the blocks");
        self.swaps.1.extend(a.swapped.iter().copied().zip(fresh.table.iter().copied()));
        self.host_emptied.append(&mut a.swapped);
        a.blocks = fresh;
        self.kv_gauges();
    }

    /// Makes the block moves decided since the last step on every worker.
    pub(super) async fn flush_swaps(&mut self) -> crate::Result<()> {
        if self.swaps.0.is_empty() && self.swaps.1.is_empty() {
            return Ok(());
        }
        let (out, back) = std::mem::take(&mut self.swaps);
        let (bytes_out, bytes_in) = self.pipeline.swap(&out, &back).await?;
        self.host_free.append(&mut self.host_emptied);
        self.metrics.swapped(out.len(), bytes_out, back.len(), bytes_in);
        Ok(())
    }

    /// Blocks a waiting request needs to start: its prompt and one generated token.
    pub(super) fn blocks_to_admit(&self, prompt: usize) -> usize {
        self.blocks.blocks_for(prompt + 1)
    }

    /// A sequence joins: it starts after the longest prefix of its prompt the pool holds.
    pub(super) fn start_sequence(&mut self, a: &mut Active) {
        // A request scoring its prompt computes every position: no cached prefix.
        if a.pos > 0 || a.req.params.prompt_logprobs.is_some() {
            return;
        }
        let (pool, tier) = (&mut self.blocks, &mut self.host_prefixes);
        let (blocks, cached, restore) =
            pool.lookup_tiered(&a.req.input_ids, a.req.salt, |h| tier.remove(&h));
        // Blocks found in the host tier are copied back before the sequence's first step.
        self.host_emptied.extend(restore.iter().map(|r| r.0));
        self.swaps.1.extend(restore);
        (a.blocks, a.pos, a.base) = (blocks, cached, cached);
        a.acc.cached_tokens = a.acc.cached_tokens.max(cached as u32);
        self.metrics.prefix(self.blocks.counts);
    }

    /// Whether `r` has a sibling (same job, same prompt) still prefilling a prompt long enough to
    /// share a block: `r` then waits, to find those blocks cached.
    pub(super) fn sibling_prefilling(&self, r: &SeqRequest, active: &[Active]) -> bool {
        self.blocks.caching()
            && r.params.prompt_logprobs.is_none()
            && r.input_ids.len() > self.blocks.block()
            && active.iter().any(|a| {
                a.req.trace_id == r.trace_id
                    && a.req.input_ids == r.input_ids
                    && a.pos < a.req.input_ids.len()
            })
    }

    /// Blocks a sequence not in flight may add in its next step (its next prompt chunk, or a
    /// decode token and a draft).
    pub(super) fn next_growth(&self, a: &Active) -> usize {
        let end = a.prefill_end();
        let bring = if a.pos < end {
            (end - a.pos).min(self.limits.max_step_tokens)
        } else if self.spec.0 == layerstream_model::spec::SpecMode::Off {
            1
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
        self.spill(active, in_flight);
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
            let n = a.blocks.table.len();
            if n > 0 && self.host_free.len() + self.host_prefixes.len() >= n {
                // To the host tier: its blocks are copied out before anything reuses them.
                let slots: Vec<u32> = (0..n).filter_map(|_| self.host_slot()).collect();
                self.swaps.0.extend(a.blocks.table.iter().copied().zip(slots.iter().copied()));
                a.swapped = slots;
                tracing::info!(
                    seq = a.req.seq_id,
                    blocks = n,
                    "KV pool full: sequence preempted to the host tier"
                );
            } else {
                self.metrics.replayed_tokens.inc_by(a.pos as u64);
                (a.pos, a.base) = (0, 0);
                a.next_draft = Default::default();
                a.refeed = false;
                tracing::info!(
                    seq = a.req.seq_id,
                    free = self.blocks.available(),
                    "KV pool full: sequence preempted, to be replayed"
                );
            }
            self.blocks.release(&mut a.blocks);
            a.lane = None;
            a.acc.preemptions += 1;
            self.metrics.preempted.inc();
            out.push(a);
        }
    }

    /// Before the next steps take blocks: the cached prefix blocks they would evict from the device
    /// go to the host tier instead (when it is on), to come back on a later prompt's lookup.
    fn spill(&mut self, active: &[Active], in_flight: &[bool]) {
        if self.limits.host_blocks == 0 || !self.limits.prefix_cache {
            return;
        }
        let want: usize = active
            .iter()
            .zip(in_flight)
            .filter(|(_, &f)| !f)
            .map(|(a, _)| self.next_growth(a))
            .sum();
        let short = want.saturating_sub(self.blocks.free_now());
        for (block, key) in self.blocks.evict_idle(short) {
            let Some(slot) = self.host_slot() else { break };
            self.swaps.0.push((block, slot));
            self.host_prefixes.insert(key, slot);
            self.host_prefix_order.push_back(key);
        }
    }

    /// A free host slot: a never-used or emptied one, else the oldest cached prefix block's.
    fn host_slot(&mut self) -> Option<u32> {
        if let Some(s) = self.host_free.pop() {
            return Some(s);
        }
        while let Some(key) = self.host_prefix_order.pop_front() {
            if let Some(s) = self.host_prefixes.remove(&key) {
                return Some(s);
            }
        }
        None
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
        // The history is gathered only when a block has filled (every `--kv-block` positions),
        // not on every step.
        if self.blocks.needs_commit(&a.blocks, a.pos) {
            let known = a.history();
            self.blocks.commit(&mut a.blocks, a.req.salt, &known[..a.pos.min(known.len())]);
        }
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
