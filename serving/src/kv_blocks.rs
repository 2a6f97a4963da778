//! The block manager of a paged KV cache (pure logic; the coordinator holds the one every worker
//! of a pipeline follows, a single-process run holds its own): which blocks each sequence's
//! positions live in, which are free, and — prefix caching — which full blocks hold a known token
//! prefix. A full block is keyed by a hash chained over the tokens of every block before it and its
//! own (xxh3), so equal keys mean equal prefixes; the chain starts from a salt (a request's
//! `cache_salt`, its tenant), so sequences only ever share blocks within one salt; blocks are shared by reference count, and a
//! cached block no sequence uses is evicted least recently used first, only when a fresh block is
//! needed. Only full blocks are shared, and a sequence always computes at least its last prompt
//! token itself, so no shared block is ever written again (no copy-on-write needed).

use std::collections::{BTreeMap, HashMap};
use xxhash_rust::xxh3::xxh3_64_with_seed;

/// One sequence's blocks: `table[i]` holds positions `i * block .. (i + 1) * block`; the first
/// `hashes.len()` of them are full, committed and keyed (shared or shareable).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct SeqBlocks {
    pub table: Vec<u32>,
    hashes: Vec<u64>,
}

/// The pool ran dry: the blocks a request wanted and those it could have.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Dry {
    pub wanted: usize,
    pub available: usize,
}

/// Counters of prefix lookups (for metrics).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct PrefixCounts {
    /// Lookups made and positions they asked about.
    pub queries: u64,
    pub queried_tokens: u64,
    /// Positions found cached.
    pub hit_tokens: u64,
}

/// A pool of `blocks` KV blocks of `block` positions.
#[derive(Debug, Clone)]
pub struct BlockPool {
    block: usize,
    /// Never-used or released blocks, lowest id last (taken first: the CPU grows its storage to
    /// the highest id in use).
    free: Vec<u32>,
    /// Sequences using each block.
    refs: Vec<u32>,
    /// Keyed full blocks, and each keyed block's key.
    by_hash: HashMap<u64, u32>,
    hash_of: HashMap<u32, u64>,
    /// Keyed blocks no sequence uses, by when they were last used (evicted oldest first).
    idle: BTreeMap<u64, u32>,
    idle_at: HashMap<u32, u64>,
    tick: u64,
    /// Whether full blocks are keyed and looked up (prefix caching).
    caching: bool,
    pub counts: PrefixCounts,
}

impl BlockPool {
    /// A pool of `blocks` empty blocks of `block` positions; `caching` keeps full blocks for reuse.
    pub fn new(blocks: usize, block: usize, caching: bool) -> BlockPool {
        BlockPool {
            block: block.max(1),
            free: (0..blocks as u32).rev().collect(),
            refs: vec![0; blocks],
            by_hash: HashMap::new(),
            hash_of: HashMap::new(),
            idle: BTreeMap::new(),
            idle_at: HashMap::new(),
            tick: 0,
            caching,
            counts: PrefixCounts::default(),
        }
    }

    /// Positions per block.
    pub fn block(&self) -> usize {
        self.block
    }

    /// Whether full blocks are kept and found by their tokens (prefix caching).
    pub fn caching(&self) -> bool {
        self.caching
    }

    /// Blocks of the pool.
    pub fn blocks(&self) -> usize {
        self.refs.len()
    }

    /// Blocks no sequence uses and no prefix keys.
    pub fn free_now(&self) -> usize {
        self.free.len()
    }

    /// Takes up to `n` of the least recently used idle keyed blocks out of the cache (they become
    /// free); returns each with its key, so a host tier can keep its contents.
    pub fn evict_idle(&mut self, n: usize) -> Vec<(u32, u64)> {
        let mut out = Vec::new();
        while out.len() < n {
            let Some((&t, &b)) = self.idle.iter().next() else { break };
            self.idle.remove(&t);
            self.idle_at.remove(&b);
            let h = self.hash_of.remove(&b).expect("idle blocks are keyed");
            self.by_hash.remove(&h);
            self.free.push(b);
            out.push((b, h));
        }
        out
    }

    /// Blocks a sequence could take now: free ones and cached ones no sequence uses.
    pub fn available(&self) -> usize {
        self.free.len() + self.idle.len()
    }

    /// Blocks holding positions `..len`.
    pub fn blocks_for(&self, len: usize) -> usize {
        len.div_ceil(self.block)
    }

    /// Keyed blocks held (in use or idle).
    pub fn cached_blocks(&self) -> usize {
        self.by_hash.len()
    }

    fn take(&mut self) -> Option<u32> {
        if let Some(b) = self.free.pop() {
            return Some(b);
        }
        // Evict the least recently used idle cached block.
        let (&t, &b) = self.idle.iter().next()?;
        self.idle.remove(&t);
        self.idle_at.remove(&b);
        if let Some(h) = self.hash_of.remove(&b) {
            self.by_hash.remove(&h);
        }
        Some(b)
    }

    /// Grows `seq`'s table to hold positions `..len`; nothing changes when the pool cannot.
    pub fn grow(&mut self, seq: &mut SeqBlocks, len: usize) -> Result<(), Dry> {
        let need = self.blocks_for(len).saturating_sub(seq.table.len());
        if need > self.available() {
            return Err(Dry { wanted: need, available: self.available() });
        }
        for _ in 0..need {
            let b = self.take().expect("counted");
            self.refs[b as usize] = 1;
            seq.table.push(b);
        }
        Ok(())
    }

    /// Gives back `seq`'s blocks past position `len` (rejected drafts that filled a block).
    pub fn shrink(&mut self, seq: &mut SeqBlocks, len: usize) {
        let keep = self.blocks_for(len).max(seq.hashes.len());
        while seq.table.len() > keep {
            let b = seq.table.pop().expect("longer than keep");
            self.unref(b);
        }
    }

    fn unref(&mut self, b: u32) {
        let r = &mut self.refs[b as usize];
        *r = r.saturating_sub(1);
        if *r > 0 {
            return;
        }
        if self.hash_of.contains_key(&b) {
            self.tick += 1;
            self.idle.insert(self.tick, b);
            self.idle_at.insert(b, self.tick);
        } else {
            self.free.push(b);
        }
    }

    /// Gives back every block of `seq` (cached ones stay cached until evicted).
    pub fn release(&mut self, seq: &mut SeqBlocks) {
        for b in std::mem::take(&mut seq.table).into_iter().rev() {
            self.unref(b);
        }
        seq.hashes.clear();
    }

    /// A new sequence for `tokens` (its prompt): its longest cached prefix of full blocks, shared,
    /// leaving at least the last token to compute. Returns the sequence and the positions cached.
    pub fn lookup(&mut self, tokens: &[u32]) -> (SeqBlocks, usize) {
        let (seq, cached, _) = self.lookup_tiered(tokens, 0, |_| None);
        (seq, cached)
    }

    /// `lookup`, continued past the device's cached blocks into a host tier: `host(key)` takes a
    /// block's slot out of the tier when it holds that key. Such a block gets a fresh device block
    /// (keyed again); the third value lists (host slot, device block) copies to make before the
    /// sequence's first step. Only blocks committed under the same `salt` are found.
    pub fn lookup_tiered(
        &mut self,
        tokens: &[u32],
        salt: u64,
        mut host: impl FnMut(u64) -> Option<u32>,
    ) -> (SeqBlocks, usize, Vec<(u32, u32)>) {
        let mut seq = SeqBlocks::default();
        let mut restore = Vec::new();
        if !self.caching {
            return (seq, 0, restore);
        }
        self.counts.queries += 1;
        self.counts.queried_tokens += tokens.len() as u64;
        let mut h = salt;
        for chunk in tokens[..tokens.len().saturating_sub(1)].chunks_exact(self.block) {
            h = key(h, chunk);
            let b = match self.by_hash.get(&h) {
                Some(&b) => b,
                None if self.available() > 0 => match host(h) {
                    Some(slot) => {
                        let b = self.take().expect("available");
                        self.by_hash.insert(h, b);
                        self.hash_of.insert(b, h);
                        restore.push((slot, b));
                        b
                    }
                    None => break,
                },
                None => break,
            };
            if self.refs[b as usize] == 0 {
                if let Some(t) = self.idle_at.remove(&b) {
                    self.idle.remove(&t);
                }
            }
            self.refs[b as usize] += 1;
            seq.table.push(b);
            seq.hashes.push(h);
        }
        let cached = seq.hashes.len() * self.block;
        self.counts.hit_tokens += cached as u64;
        (seq, cached, restore)
    }

    /// Whether `commit` with `len` known tokens would key a new block (so a caller can skip
    /// gathering the tokens: a sequence fills a block every `block` positions).
    pub fn needs_commit(&self, seq: &SeqBlocks, len: usize) -> bool {
        self.caching && (len / self.block).min(seq.table.len()) > seq.hashes.len()
    }

    /// Keys the blocks of `seq` that `tokens` (its committed tokens, from position 0) fill, so later
    /// sequences can share them (those looking up with the same `salt`). A block whose prefix
    /// another block already holds stays private.
    pub fn commit(&mut self, seq: &mut SeqBlocks, salt: u64, tokens: &[u32]) {
        if !self.caching {
            return;
        }
        let full = (tokens.len() / self.block).min(seq.table.len());
        while seq.hashes.len() < full {
            let i = seq.hashes.len();
            let h = key(
                seq.hashes.last().copied().unwrap_or(salt),
                &tokens[i * self.block..(i + 1) * self.block],
            );
            let b = seq.table[i];
            if !self.by_hash.contains_key(&h) && !self.hash_of.contains_key(&b) {
                self.by_hash.insert(h, b);
                self.hash_of.insert(b, h);
            }
            seq.hashes.push(h);
        }
    }
}

/// The salt of a request's `cache_salt` text (0, no salt, for an empty one).
pub fn salt_of(text: &str) -> u64 {
    if text.is_empty() {
        0
    } else {
        xxhash_rust::xxh3::xxh3_64_with_seed(text.as_bytes(), 0x5a17)
    }
}

/// A block's key: its tokens hashed with the key of the block before it.
fn key(prev: u64, tokens: &[u32]) -> u64 {
    let bytes: Vec<u8> = tokens.iter().flat_map(|t| t.to_le_bytes()).collect();
    xxh3_64_with_seed(&bytes, prev)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Sequences take blocks as they grow and give them back; a request larger than what is free
    /// changes nothing and says how much there was.
    #[test]
    fn blocks_are_taken_as_sequences_grow_and_given_back() {
        let mut p = BlockPool::new(4, 16, false);
        let (mut a, mut b) = (SeqBlocks::default(), SeqBlocks::default());
        p.grow(&mut a, 17).unwrap();
        assert_eq!(a.table, vec![0, 1]);
        p.grow(&mut a, 32).unwrap();
        assert_eq!(a.table.len(), 2);
        assert_eq!(p.grow(&mut b, 48), Err(Dry { wanted: 3, available: 2 }));
        assert!(b.table.is_empty());
        p.grow(&mut b, 20).unwrap();
        p.shrink(&mut b, 10);
        assert_eq!((b.table.len(), p.available()), (1, 1));
        p.release(&mut a);
        assert_eq!(p.available(), 3);
        // Released blocks are reused lowest first.
        let mut c = SeqBlocks::default();
        p.grow(&mut c, 1).unwrap();
        assert_eq!(c.table, vec![0]);
    }

    /// A second sequence with the same prefix shares its full blocks (never its last token's), a
    /// different token in a block ends the match, and idle cached blocks are evicted oldest first
    /// only when fresh ones run out.
    #[test]
    fn prefixes_are_shared_and_evicted_least_recently_used() {
        let mut p = BlockPool::new(6, 4, true);
        let prompt: Vec<u32> = (0..10).collect();
        let (mut a, cached) = p.lookup(&prompt);
        assert_eq!(cached, 0);
        p.grow(&mut a, 12).unwrap();
        let output: Vec<u32> = prompt.iter().copied().chain([50, 51]).collect();
        assert!(p.needs_commit(&a, output.len()));
        p.commit(&mut a, 0, &output);
        assert_eq!(p.cached_blocks(), 3);
        // Keyed: nothing new until another block fills.
        assert!(!p.needs_commit(&a, output.len()) && !p.needs_commit(&a, 15));
        // The same first 8 tokens, then others: two blocks shared.
        let other: Vec<u32> = (0..8).chain([99, 98, 97]).collect();
        let (b, cached) = p.lookup(&other);
        assert_eq!((cached, &b.table[..], p.refs[0]), (8, &a.table[..2], 2));
        // A prompt of exactly 8 tokens computes its last one: one block shared.
        let (c, cached) = p.lookup(&prompt[..8]);
        assert_eq!((cached, c.table.len()), (4, 1));
        let order = a.table.clone();
        for mut s in [a, b, c] {
            p.release(&mut s);
        }
        assert_eq!((p.available(), p.cached_blocks()), (6, 3));
        // Fresh blocks first, then the idle cached ones, least recently used first.
        let mut d = SeqBlocks::default();
        p.grow(&mut d, 16).unwrap();
        assert_eq!(p.cached_blocks(), 2);
        assert!(!d.table.contains(&order[0]) && !d.table.contains(&order[1]));
        assert!(d.table.contains(&order[2]));
        assert_eq!(p.counts, PrefixCounts { queries: 3, queried_tokens: 29, hit_tokens: 12 });
    }

    /// Idle keyed blocks evicted to a host tier are found there again: a lookup restores them into
    /// fresh blocks and says which slot goes where.
    #[test]
    fn evicted_prefixes_come_back_from_a_host_tier() {
        let mut p = BlockPool::new(3, 2, true);
        let prompt = [1, 2, 3, 4, 5];
        let (mut a, _) = p.lookup(&prompt);
        p.grow(&mut a, 5).unwrap();
        p.commit(&mut a, 0, &prompt);
        p.release(&mut a);
        assert_eq!((p.free_now(), p.cached_blocks()), (1, 2));
        let evicted = p.evict_idle(5);
        assert_eq!((evicted.len(), p.free_now(), p.cached_blocks()), (2, 3, 0));
        let tier: std::collections::HashMap<u64, u32> =
            evicted.iter().enumerate().map(|(i, &(_, h))| (h, 10 + i as u32)).collect();
        let (b, cached, restore) = p.lookup_tiered(&prompt, 0, |h| tier.get(&h).copied());
        assert_eq!((cached, restore.len()), (4, 2));
        assert_eq!(restore.iter().map(|r| r.1).collect::<Vec<_>>(), b.table);
        assert_eq!(p.cached_blocks(), 2, "restored blocks are keyed again");
    }

    /// Without caching nothing is keyed or found.
    #[test]
    fn caching_off_finds_nothing() {
        let mut p = BlockPool::new(4, 2, false);
        let (mut a, _) = p.lookup(&[1, 2, 3, 4, 5]);
        p.grow(&mut a, 5).unwrap();
        p.commit(&mut a, 0, &[1, 2, 3, 4, 5]);
        assert_eq!(p.lookup(&[1, 2, 3, 4, 5]).1, 0);
        assert_eq!(p.counts.queries, 0);
    }

    /// Blocks committed under one salt are found only under that salt: another tenant's lookup
    /// (another salt, or none) of the same prompt finds nothing cached.
    #[test]
    fn salts_keep_prefixes_apart() {
        let mut p = BlockPool::new(8, 4, true);
        let prompt: Vec<u32> = (0..13).collect();
        let (a_salt, b_salt) = (salt_of("tenant-a"), salt_of("tenant-b"));
        assert_eq!(salt_of(""), 0);
        let (mut a, _, _) = p.lookup_tiered(&prompt, a_salt, |_| None);
        p.grow(&mut a, prompt.len()).unwrap();
        p.commit(&mut a, a_salt, &prompt);
        assert_eq!(p.lookup_tiered(&prompt, a_salt, |_| None).1, 12, "same tenant: cached");
        assert_eq!(p.lookup_tiered(&prompt, b_salt, |_| None).1, 0, "another tenant");
        assert_eq!(p.lookup(&prompt).1, 0, "no salt");
    }
}
