//! The scheduler's paged KV cache: one block manager (`BlockPool`) that every worker's pools
//! follow (each step names every sequence's blocks), prefix caching at admission, blocks taken as
//! sequences grow, and preemption when the pool runs dry: the newest sequence not in flight gives
//! its blocks back — copied to the workers' host-RAM tier (`Worker/Swap`) and copied back when it
//! resumes, or, when the tier is full or off, replayed later from its prompt and output so far.
//! Cached prefix blocks the device must give up go to the host tier too, and a later prompt's
//! lookup brings them back.

use super::active::Active;
use super::core::Core;
use super::SeqRequest;
use layerstream_serving::kv_blocks::BlockPool;

impl Core {
    /// A fresh block manager for the pool every worker holds (after a plan or a fault the workers'
    /// pools are new, so nothing cached survives).
    pub(super) fn fresh_blocks(&self) -> BlockPool {
        let block = self.limits.kv_block.max(1);
        BlockPool::new(self.limits.kv_capacity.div_ceil(block), block, self.limits.prefix_cache)
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
        self.host.back.extend(a.swapped.iter().copied().zip(fresh.table.iter().copied()));
        self.host.emptied.append(&mut a.swapped);
        a.blocks = fresh;
        self.kv_gauges();
    }

    /// The block moves decided since the last step, taken to be made on every worker.
    pub(crate) fn take_swaps(&mut self) -> Option<(super::core::Moves, super::core::Moves)> {
        self.host.take_moves()
    }

    /// The moves taken were made: the slots they emptied are free.
    pub(crate) fn swapped(&mut self, moved: (usize, usize), bytes: (u64, u64)) {
        self.host.moved();
        self.metrics.swapped(moved.0, bytes.0, moved.1, bytes.1);
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
        let (pool, tier) = (&mut self.blocks, &mut self.host.prefixes);
        let (blocks, cached, restore) =
            pool.lookup_tiered(&a.req.input_ids, a.req.salt, |h| tier.remove(&h));
        // Blocks found in the host tier are copied back before the sequence's first step.
        self.host.emptied.extend(restore.iter().map(|r| r.0));
        self.host.back.extend(restore);
        (a.blocks, a.pos, a.base) = (blocks, cached, cached);
        a.acc.cached_tokens = a.acc.cached_tokens.max(cached as u32);
        self.metrics.prefix(self.blocks.counts);
    }

    /// Whether `r` has a sibling (same job, same prompt) still prefilling a prompt long enough to
    /// share a block: `r` then waits, to find those blocks cached.
    pub(super) fn sibling_prefilling(&self, r: &SeqRequest) -> bool {
        self.blocks.caching()
            && r.params.prompt_logprobs.is_none()
            && r.input_ids.len() > self.blocks.block()
            && self.active.iter().any(|a| {
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
        } else if self.spec.mode == layerstream_serving::spec::SpecMode::Off {
            1
        } else {
            1 + a.req.params.speculative.max(self.spec.max)
        };
        self.blocks.blocks_for(a.pos + bring).saturating_sub(a.blocks.table.len())
    }

    /// Blocks the next steps of the active sequences not in flight (`in_flight`, one each) add.
    fn growth(&self, in_flight: &[bool]) -> usize {
        let waiting = self.active.iter().zip(in_flight).filter(|(_, &f)| !f);
        waiting.map(|(a, _)| self.next_growth(a)).sum()
    }

    /// Preempts the newest sequences not in flight until the others' next steps fit the pool:
    /// each goes to the host tier when it has room (its blocks copied out before anything reuses
    /// them), else gives its blocks back to be replayed (the workers forget it). The oldest
    /// sequence is never preempted for a newer one. Preempted sequences resume oldest first.
    pub fn make_room(&mut self) {
        let mut flight: Vec<bool> = self.active.iter().map(|a| self.in_flight(a)).collect();
        self.spill(&flight);
        loop {
            if self.growth(&flight) <= self.blocks.available() {
                break;
            }
            let Some(i) = (1..self.active.len()).rev().find(|&i| !flight[i]) else { break };
            flight.remove(i);
            let mut a = self.active.remove(i);
            let n = a.blocks.table.len();
            if n > 0 && self.host.available() >= n {
                let slots: Vec<u32> = (0..n).filter_map(|_| self.host.slot()).collect();
                self.host.out.extend(a.blocks.table.iter().copied().zip(slots.iter().copied()));
                self.blocks.release(&mut a.blocks);
                a.swapped = slots;
                tracing::info!(
                    seq = a.req.seq_id,
                    blocks = n,
                    "KV pool full: sequence preempted to the host tier"
                );
            } else {
                self.metrics.replayed_tokens.inc_by(a.pos as u64);
                self.blocks.release(&mut a.blocks);
                a.rewind();
                self.release.push(a.req.seq_id);
                tracing::info!(
                    seq = a.req.seq_id,
                    free = self.blocks.available(),
                    "KV pool full: sequence preempted, to be replayed"
                );
            }
            a.lane = None;
            a.acc.preemptions += 1;
            self.metrics.preempted.inc();
            self.preempted.push_front(a);
        }
        self.preempted.make_contiguous().sort_by_key(|a| a.req.seq_id);
        self.kv_gauges();
    }

    /// Before the next steps take blocks: the cached prefix blocks they would evict from the device
    /// go to the host tier instead (when it is on), to come back on a later prompt's lookup.
    fn spill(&mut self, in_flight: &[bool]) {
        if self.limits.host_blocks == 0 || !self.limits.prefix_cache {
            return;
        }
        let short = self.growth(in_flight).saturating_sub(self.blocks.free_now());
        for (block, key) in self.blocks.evict_idle(short) {
            let Some(slot) = self.host.slot() else { break };
            self.host.out.push((block, slot));
            self.host.prefixes.insert(key, slot);
            self.host.prefix_order.push_back(key);
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

    pub(super) fn kv_gauges(&self) {
        let used = self.blocks.blocks() - self.blocks.available();
        self.metrics.kv_blocks.set(used as i64);
        self.metrics.kv_cached_blocks.set(self.blocks.cached_blocks() as i64);
    }
}
