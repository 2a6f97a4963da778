//! The slot pool's bookkeeping, free of I/O: which layer each slot holds, pins (refcounts), and which
//! slot a new load may take. A pinned slot is never chosen for a load. Eviction is by next use: the
//! workers stream their layers in a known cyclic order, so the layer needed furthest in the future
//! goes first (LRU over a cyclic order evicts exactly the layer needed next); ties go LRU.

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

/// The disk's busy time: wall time while at least one read is in flight. Bytes read ÷ these
/// seconds is the disk's rate as the loader drove it, reads in flight together (the figure the cost
/// model's `disk_gbps` stands for); bytes ÷ the sum of each read's own seconds is the rate per read.
#[derive(Debug, Default)]
pub struct Busy {
    in_flight: usize,
    since: Option<std::time::Instant>,
    total: std::time::Duration,
}

impl Busy {
    /// A read starts at `now`.
    pub fn begin(&mut self, now: std::time::Instant) {
        if self.in_flight == 0 {
            self.since = Some(now);
        }
        self.in_flight += 1;
    }

    /// A read ends at `now` (one `begin` each).
    pub fn end(&mut self, now: std::time::Instant) {
        self.in_flight = self.in_flight.saturating_sub(1);
        if self.in_flight == 0 {
            if let Some(s) = self.since.take() {
                self.total += now.saturating_duration_since(s);
            }
        }
    }

    /// Seconds busy up to `now`, a read in flight counted to `now`.
    pub fn seconds(&self, now: std::time::Instant) -> f64 {
        let open =
            self.since.map_or(std::time::Duration::ZERO, |s| now.saturating_duration_since(s));
        (self.total + open).as_secs_f64()
    }
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

    /// A slot a load may take: empty first, else the unpinned ready slot whose layer is needed
    /// furthest in the future (`next_use`: steps until a layer is read again, `usize::MAX` = never),
    /// the least recently used among equals; never one holding a layer in `keep`.
    fn victim(&self, keep: &[u32], next_use: &dyn Fn(u32) -> usize) -> Option<usize> {
        if let Some(i) = self.slots.iter().position(|s| s.state == SlotState::Empty) {
            return Some(i);
        }
        self.slots
            .iter()
            .enumerate()
            .filter_map(|(i, s)| match s.state {
                SlotState::Ready(l) if s.pins == 0 && !keep.contains(&l) => {
                    Some((i, next_use(l), s.last_used))
                }
                _ => None,
            })
            .max_by_key(|&(_, next, last)| (next, std::cmp::Reverse(last)))
            .map(|(i, _, _)| i)
    }

    /// Pins `layer` for a reader, or says what to do (`next_use` as for eviction).
    pub fn acquire(&mut self, layer: u32, next_use: &dyn Fn(u32) -> usize) -> Acquire {
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
            None => match self.victim(&[], next_use) {
                Some(i) => {
                    self.slots[i].state = SlotState::Loading(layer);
                    Acquire::Load(i)
                }
                None => Acquire::Full,
            },
        }
    }

    /// Starts a prefetch of `layer` if it is absent and a slot not holding any of `keep` is free
    /// (one holding a layer needed later than `layer` itself: prefetching must not evict what is
    /// needed sooner).
    pub fn start_prefetch(
        &mut self,
        layer: u32,
        keep: &[u32],
        next_use: &dyn Fn(u32) -> usize,
    ) -> Option<usize> {
        if self.find(layer).is_some() {
            return None;
        }
        let i = self.victim(keep, next_use)?;
        if let SlotState::Ready(l) = self.slots[i].state {
            if next_use(l) < next_use(layer) {
                return None;
            }
        }
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

    /// Whether a slot holds its layer's bytes (read, not being read).
    #[cfg(test)]
    pub fn is_ready(&self, slot: usize) -> bool {
        matches!(self.slots[slot].state, SlotState::Ready(_))
    }

    /// Pins held on a slot.
    pub fn pins(&self, slot: usize) -> u32 {
        self.slots[slot].pins
    }

    /// Number of slots.
    pub fn len(&self) -> usize {
        self.slots.len()
    }
}

/// The layers of `order` (one worker's streamed layers, cycled) that a pool of `slots` slots reads
/// from disk on every pass once it has settled, when the loader reads `depth` layers ahead and the
/// worker holds the layer it computes and the one it takes next: this pool's own decisions replayed
/// over three passes (reads finishing at once; a release tops the read-ahead up, as the daemon's).
/// The rest of `order` stays in slots from pass to pass (the RAM tier). For `layerstream plan`'s
/// cost model.
pub fn disk_reads_per_pass(order: &[u32], slots: usize, depth: usize) -> Vec<u32> {
    let n = order.len();
    if n == 0 || slots == 0 {
        return order.to_vec();
    }
    let mut p = Pool::new(slots);
    let mut read = Vec::new();
    for pass in 0..3 {
        for (pos, &layer) in order.iter().enumerate() {
            let next_use = |l: u32| {
                order.iter().position(|&x| x == l).map_or(usize::MAX, |i| (i + n - pos) % n)
            };
            let mut load = |p: &mut Pool, slot: usize, l: u32| {
                p.loaded(slot, true);
                if pass == 2 {
                    read.push(l);
                }
            };
            loop {
                match p.acquire(layer, &next_use) {
                    Acquire::Hit(_) => break,
                    Acquire::Load(slot) => load(&mut p, slot, layer),
                    // Every slot pinned: the worker lets go of the layer it held.
                    Acquire::Wait | Acquire::Full => {
                        let prev = order[(pos + n - 1) % n];
                        if !p.release(prev) {
                            return order.to_vec();
                        }
                    }
                }
            }
            // The read-ahead after the acquire, and again once the release frees a slot.
            let ahead: Vec<u32> = (1..=depth.min(n - 1)).map(|d| order[(pos + d) % n]).collect();
            for release in [false, true] {
                if release {
                    p.release(order[(pos + n - 1) % n]);
                }
                for &l in &ahead {
                    if let Some(slot) = p.start_prefetch(l, &ahead, &next_use) {
                        load(&mut p, slot, l);
                    }
                }
            }
        }
    }
    read.sort_unstable();
    read.dedup();
    read
}

/// Whether `/dev/shm` (`free` bytes, None when unknown) holds `n` slots of `slot_size` bytes; the
/// error names what is needed and how to give it.
pub fn check_shm_room(n: usize, slot_size: usize, free: Option<u64>) -> crate::Result<()> {
    let need = n as u64 * slot_size as u64;
    match free {
        Some(free) if free < need => Err(crate::Error::Config(format!(
            "/dev/shm has {free} bytes free; the slot pool needs {need} ({n} slots × {slot_size} \
             bytes): give the container more shared memory (compose `shm_size`, `docker run \
             --shm-size`, a Kubernetes emptyDir with medium Memory) or use fewer slots (--slots)"
        ))),
        _ => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Overlapping reads count once: busy from the first start to the last end, gaps excluded; a
    /// read still in flight counts up to now.
    #[test]
    fn busy_counts_wall_time_with_a_read_in_flight_once() {
        use std::time::{Duration, Instant};
        let t0 = Instant::now();
        let at = |ms: u64| t0 + Duration::from_millis(ms);
        let mut b = Busy::default();
        b.begin(at(0));
        b.begin(at(10));
        b.end(at(30));
        assert!((b.seconds(at(40)) - 0.040).abs() < 1e-9, "one read still in flight");
        b.end(at(50));
        b.begin(at(100)); // a 50 ms gap with nothing read
        b.end(at(120));
        assert!((b.seconds(at(500)) - 0.070).abs() < 1e-9, "{}", b.seconds(at(500)));
        b.end(at(130)); // an unmatched end changes nothing
        assert!((b.seconds(at(500)) - 0.070).abs() < 1e-9);
    }

    /// No order known: every layer is "never needed", so ties fall back to LRU.
    fn lru(_: u32) -> usize {
        usize::MAX
    }

    #[test]
    fn hit_after_load_and_shared_by_two_readers() {
        let mut p = Pool::new(2);
        assert_eq!(p.acquire(5, &lru), Acquire::Load(0));
        assert_eq!(p.acquire(5, &lru), Acquire::Wait);
        p.loaded(0, true);
        assert_eq!(p.acquire(5, &lru), Acquire::Hit(0));
        assert_eq!(p.acquire(5, &lru), Acquire::Hit(0));
        assert_eq!(p.pins(0), 2);
    }

    #[test]
    fn pinned_slots_are_never_overwritten() {
        let mut p = Pool::new(2);
        for (l, s) in [(1, 0), (2, 1)] {
            assert_eq!(p.acquire(l, &lru), Acquire::Load(s));
            p.loaded(s, true);
            assert_eq!(p.acquire(l, &lru), Acquire::Hit(s));
        }
        assert_eq!(p.acquire(3, &lru), Acquire::Full);
        assert!(p.release(1));
        assert_eq!(p.acquire(3, &lru), Acquire::Load(0), "the unpinned slot is reused");
        assert!(!p.release(1), "layer 1 is gone");
    }

    #[test]
    fn lru_victim_and_prefetch_respects_keep() {
        let mut p = Pool::new(2);
        for (l, s) in [(1, 0), (2, 1)] {
            p.acquire(l, &lru);
            p.loaded(s, true);
            p.acquire(l, &lru);
            p.release(l);
        }
        p.acquire(1, &lru); // touch 1: 2 is now LRU
        p.release(1);
        assert_eq!(p.start_prefetch(3, &[2], &lru), Some(0), "2 is kept, so 1 goes");
        assert_eq!(p.start_prefetch(3, &[], &lru), None, "already loading");
        p.loaded(0, false);
        assert_eq!(p.find(3), None, "a failed load empties the slot");
    }

    /// A worker streaming 10 layers cyclically through 4 slots: LRU evicts exactly the layer needed
    /// next (every read misses); evicting by next use keeps 3 of the 4 slots useful every cycle.
    #[test]
    fn next_use_eviction_beats_lru_on_a_cyclic_order() {
        let order: Vec<u32> = (0..10).collect();
        let run = |by_next_use: bool| {
            let mut p = Pool::new(4);
            let mut misses = 0;
            for step in 0..100usize {
                let layer = order[step % 10];
                // Steps until each layer is read again, from the one being read now.
                let next = |l: u32| {
                    if by_next_use {
                        (l as usize + 10 - step % 10) % 10
                    } else {
                        usize::MAX
                    }
                };
                match p.acquire(layer, &next) {
                    Acquire::Hit(_) => {}
                    Acquire::Load(s) => {
                        misses += 1;
                        p.loaded(s, true);
                        assert_eq!(p.acquire(layer, &next), Acquire::Hit(s));
                    }
                    other => panic!("{other:?}"),
                }
                assert!(p.release(layer));
            }
            misses
        };
        assert_eq!(run(false), 100, "LRU over a cyclic order misses every read");
        let misses = run(true);
        assert!(misses <= 100 - 27, "next-use eviction: {misses} misses of 100");
    }

    #[test]
    fn a_pool_larger_than_dev_shm_is_refused_with_its_sizes() {
        check_shm_room(8, 1 << 20, Some(8 << 20)).unwrap();
        check_shm_room(8, 1 << 20, None).unwrap();
        let e = check_shm_room(8, 1 << 20, Some(5 << 20)).unwrap_err().to_string();
        assert!(
            e.contains("5242880 bytes free") && e.contains("8388608") && e.contains("shm_size"),
            "{e}"
        );
    }

    #[test]
    fn a_pool_that_holds_every_layer_reads_none_per_pass_and_a_small_one_reads_the_rest() {
        let order: Vec<u32> = (0..10).collect();
        assert!(disk_reads_per_pass(&order, 10, 2).is_empty());
        assert!(disk_reads_per_pass(&order, 12, 2).is_empty());
        // Fewer slots than layers: the layers read ahead and the one computing cycle through the
        // slots that are not kept; more slots, no more reads, and never fewer than the layers that
        // do not fit.
        let mut last = order.len();
        for slots in 3..10 {
            let r = disk_reads_per_pass(&order, slots, 2);
            assert!(r.len() >= order.len() - slots && r.len() <= last, "{slots} slots: {r:?}");
            last = r.len();
        }
        assert!(last <= 5, "9 slots keep most of 10 layers: {last} read");
        assert_eq!(disk_reads_per_pass(&order, 4, 2).len(), 10, "4 slots: all in flight");
        assert_eq!(disk_reads_per_pass(&order, 0, 2), order);
        assert!(disk_reads_per_pass(&[], 4, 2).is_empty());
    }
}
