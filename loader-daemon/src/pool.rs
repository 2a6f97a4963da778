//! The slot pool's bookkeeping, free of I/O: which layer each slot holds, pins (refcounts), LRU order,
//! and which slot a new load may take. A pinned slot is never chosen for a load.

/// State of one slot.
#[derive(Debug, Clone, PartialEq)]
pub enum SlotState {
    Empty,
    /// A read into the slot is in progress.
    Loading(u32),
    /// The slot holds this layer's file.
    Ready(u32),
}

#[derive(Debug, Clone)]
struct Slot {
    state: SlotState,
    pins: u32,
    last_used: u64,
}

/// What `acquire` decided.
#[derive(Debug, Clone, PartialEq)]
pub enum Acquire {
    /// The layer is ready in this slot, now pinned.
    Hit(usize),
    /// The layer is being read into this slot: wait and retry.
    Wait,
    /// The caller must read the layer into this slot (marked Loading), then call `loaded`.
    Load(usize),
    /// Every slot is pinned or loading: wait for a release and retry.
    Full,
}

/// Slot bookkeeping.
#[derive(Debug)]
pub struct Pool {
    slots: Vec<Slot>,
    tick: u64,
}

impl Pool {
    /// A pool of `n` empty slots.
    pub fn new(n: usize) -> Pool {
        Pool { slots: vec![Slot { state: SlotState::Empty, pins: 0, last_used: 0 }; n], tick: 0 }
    }

    /// Slot holding or loading `layer`.
    pub fn find(&self, layer: u32) -> Option<usize> {
        self.slots.iter().position(
            |s| matches!(s.state, SlotState::Ready(l) | SlotState::Loading(l) if l == layer),
        )
    }

    /// A slot a load may take: empty first, else the least recently used unpinned ready slot,
    /// never one holding a layer in `keep`.
    fn victim(&self, keep: &[u32]) -> Option<usize> {
        if let Some(i) = self.slots.iter().position(|s| s.state == SlotState::Empty) {
            return Some(i);
        }
        self.slots
            .iter()
            .enumerate()
            .filter(|(_, s)| {
                s.pins == 0 && matches!(s.state, SlotState::Ready(l) if !keep.contains(&l))
            })
            .min_by_key(|(_, s)| s.last_used)
            .map(|(i, _)| i)
    }

    /// Pins `layer` for a reader, or says what to do.
    pub fn acquire(&mut self, layer: u32) -> Acquire {
        self.tick += 1;
        match self.find(layer) {
            Some(i) => match self.slots[i].state {
                SlotState::Ready(_) => {
                    self.slots[i].pins += 1;
                    self.slots[i].last_used = self.tick;
                    Acquire::Hit(i)
                }
                _ => Acquire::Wait,
            },
            None => match self.victim(&[]) {
                Some(i) => {
                    self.slots[i].state = SlotState::Loading(layer);
                    Acquire::Load(i)
                }
                None => Acquire::Full,
            },
        }
    }

    /// Starts a prefetch of `layer` if it is absent and a slot not holding any of `keep` is free.
    pub fn start_prefetch(&mut self, layer: u32, keep: &[u32]) -> Option<usize> {
        if self.find(layer).is_some() {
            return None;
        }
        let i = self.victim(keep)?;
        self.slots[i].state = SlotState::Loading(layer);
        Some(i)
    }

    /// Marks a load finished (`ok`) or failed (slot emptied).
    pub fn loaded(&mut self, slot: usize, ok: bool) {
        self.tick += 1;
        let s = &mut self.slots[slot];
        s.state = match (&s.state, ok) {
            (SlotState::Loading(l), true) => SlotState::Ready(*l),
            _ => SlotState::Empty,
        };
        s.last_used = self.tick;
    }

    /// Unpins `layer`; returns false if it was not pinned.
    pub fn release(&mut self, layer: u32) -> bool {
        match self.slots.iter_mut().find(|s| s.state == SlotState::Ready(layer) && s.pins > 0) {
            Some(s) => {
                s.pins -= 1;
                true
            }
            None => false,
        }
    }

    /// Pins held on a slot.
    pub fn pins(&self, slot: usize) -> u32 {
        self.slots[slot].pins
    }

    /// Number of slots.
    pub fn len(&self) -> usize {
        self.slots.len()
    }

    /// Whether the pool has no slots.
    pub fn is_empty(&self) -> bool {
        self.slots.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hit_after_load_and_shared_by_two_readers() {
        let mut p = Pool::new(2);
        assert_eq!(p.acquire(5), Acquire::Load(0));
        assert_eq!(p.acquire(5), Acquire::Wait);
        p.loaded(0, true);
        assert_eq!(p.acquire(5), Acquire::Hit(0));
        assert_eq!(p.acquire(5), Acquire::Hit(0));
        assert_eq!(p.pins(0), 2);
    }

    #[test]
    fn pinned_slots_are_never_overwritten() {
        let mut p = Pool::new(2);
        for (l, s) in [(1, 0), (2, 1)] {
            assert_eq!(p.acquire(l), Acquire::Load(s));
            p.loaded(s, true);
            assert_eq!(p.acquire(l), Acquire::Hit(s));
        }
        assert_eq!(p.acquire(3), Acquire::Full);
        assert!(p.release(1));
        assert_eq!(p.acquire(3), Acquire::Load(0), "the unpinned slot is reused");
        assert!(!p.release(1), "layer 1 is gone");
    }

    #[test]
    fn lru_victim_and_prefetch_respects_keep() {
        let mut p = Pool::new(2);
        for (l, s) in [(1, 0), (2, 1)] {
            p.acquire(l);
            p.loaded(s, true);
            p.acquire(l);
            p.release(l);
        }
        p.acquire(1); // touch 1: 2 is now LRU
        p.release(1);
        assert_eq!(p.start_prefetch(3, &[2]), Some(0), "2 is kept, so 1 goes");
        assert_eq!(p.start_prefetch(3, &[]), None, "already loading");
        p.loaded(0, false);
        assert_eq!(p.find(3), None, "a failed load empties the slot");
    }
}
