//! A stage's experts on the device: a cache of single experts with its own capacity, filled from the
//! loader's shm one expert file at a time (the loader reads and caches them individually).
//!
//! Every expert of the stage's layers is kept when the plan says so (`expert_cache` 0); otherwise the
//! cache holds at most `capacity` experts, evicting the least recently used one that the layer being
//! computed does not need. Predictions (the next layer's router applied to this layer's output) go to
//! a copy thread that brings those experts onto the device while the step computes; a step that needs
//! an expert the thread is copying waits for that copy instead of making another. A layer that needs
//! more experts than the capacity holds them all while it computes (the cache shrinks back after).
//! The hot set comes first: every expert a step needs is counted in the store's usage history
//! (`expert_history`, kept across runs), a cache starts with the hottest experts of its layers
//! loaded, and among the experts of the layer needed last it evicts the least routed-to first. The
//! copy thread saves the history when enough needs were counted (off the step's path).

use crate::error::{Error, Result};
use crate::expert_history::History;
use crate::moe::{ExpertCounts, ExpertSource, ExpertWeights};
use crate::stream::LoaderLink;
use layerstream_kernels::Backend;
use layerstream_model::layout::{expert_file, expert_unit};
use layerstream_model::{ModelConfig, Store};
use layerstream_telemetry::TraceParent;
use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::Instant;
use tracing::info_span;

type Key = (u32, u32);

/// What copying experts onto the device needs.
#[derive(Clone)]
struct Copier<B: Backend> {
    backend: B,
    cfg: ModelConfig,
    store: Store,
}

impl<B: Backend> Copier<B> {
    /// Copies expert `key` from its loader slot onto the device: the weights and milliseconds.
    fn fetch(&self, link: &mut LoaderLink, (layer, e): Key) -> Result<(ExpertWeights<B>, f64)> {
        let name = expert_file(layer as usize, e as usize);
        let span = info_span!("expert", layer = layer as i64, expert = e as i64);
        let t0 = Instant::now();
        let unit = expert_unit(&self.cfg, layer, e);
        let w =
            link.with_file(unit, &self.store.manifest, &name, &span, |entry, region, bytes| {
                let _copy = info_span!(parent: &span, "expert copy").entered();
                self.backend.register_host(region)?;
                ExpertWeights::load(&self.backend, &self.cfg, entry, bytes)
            })?;
        Ok((w, t0.elapsed().as_secs_f64() * 1e3))
    }
}

struct Entry<B: Backend> {
    weights: Arc<ExpertWeights<B>>,
    last_use: u64,
    /// Brought in on a prediction and not yet used.
    predicted: bool,
}

/// The cache proper, shared with the copy thread.
struct State<B: Backend> {
    map: HashMap<Key, Entry<B>>,
    capacity: usize,
    /// The stage's layers: first and count.
    layers: (u32, u32),
    clock: u64,
    /// Predicted experts waiting for the copy thread, and the one it is copying.
    queued: VecDeque<Key>,
    copying: Option<Key>,
    /// Bytes and milliseconds the copy thread spent since the last layer took them.
    ahead: (u64, f64),
    stop: bool,
    parent: TraceParent,
    /// Routing counts of the store's experts (saved at `history_path`; None: not kept, every
    /// expert is on the device).
    history: History,
    history_path: Option<std::path::PathBuf>,
    gate: Gate,
}

/// Whether predictions are paying: of the experts the copy thread brought in on a prediction, the
/// share a step then used. A wrong prediction is not free — its read and copy take the loader, the
/// disk and (on the CPU) a core from the step, and its slot in the cache evicts an expert that may
/// be needed — so below `MIN_PRECISION` only one prediction in `PROBE` is followed, enough to
/// notice when they pay again. (Measured on a 2-core VM, synthetic qwen3-30b-a3b: 240 experts
/// brought in ahead over 16 steps, 18 of them used.)
#[derive(Debug, Clone, Copy, Default, PartialEq)]
struct Gate {
    /// Experts brought in on a prediction, and those a step then used (decayed).
    issued: f64,
    used: f64,
    /// Predictions made (followed or not).
    calls: u64,
}

impl Gate {
    const WARMUP: f64 = 32.0;
    const MIN_PRECISION: f64 = 0.25;
    const PROBE: u64 = 8;
    const DECAY_AT: f64 = 256.0;

    /// Whether the prediction now being made is followed (counts it).
    fn follow(&mut self) -> bool {
        self.calls += 1;
        self.issued < Self::WARMUP
            || self.used >= Self::MIN_PRECISION * self.issued
            || self.calls.is_multiple_of(Self::PROBE)
    }

    /// One expert brought in on a prediction.
    fn brought(&mut self) {
        self.issued += 1.0;
        if self.issued > Self::DECAY_AT {
            self.issued /= 2.0;
            self.used /= 2.0;
        }
    }
}

impl<B: Backend> State<B> {
    /// The history to save now, when enough needs were recorded since the last save (`force`:
    /// whatever was recorded); saving is the caller's, outside the lock.
    fn history_to_save(&mut self, force: bool) -> Option<(History, std::path::PathBuf)> {
        let path = self.history_path.clone()?;
        let h = (self.history.due() || (force && self.history.unsaved() > 0))
            .then(|| self.history.clone())?;
        self.history.saved();
        Some((h, path))
    }

    /// Makes room for one more expert, never evicting one in `keep`. Layers run in a known cyclic
    /// order, so the expert evicted is the one whose layer comes back last counting from `now` (the
    /// layer being computed or copied for), the least recently used among those: plain LRU would
    /// evict exactly the layer needed next whenever the cache is smaller than a cycle's needs.
    fn make_room(&mut self, keep: &HashSet<Key>, now: u32) {
        let len = self.layers.1.max(1);
        // Layers after `now` in the cycle before `l` comes again (0: `l` is `now`).
        let ahead = |l: u32| (l + len - now) % len;
        while self.map.len() >= self.capacity {
            let victim = self
                .map
                .iter()
                .filter(|(k, _)| !keep.contains(k))
                .max_by_key(|(k, v)| {
                    let rare = std::cmp::Reverse(self.history.count(**k));
                    (ahead(k.0), rare, std::cmp::Reverse(v.last_use))
                })
                .map(|(k, _)| *k);
            match victim {
                Some(k) => {
                    self.map.remove(&k);
                }
                None => break,
            }
        }
    }
}

struct Shared<B: Backend> {
    state: Mutex<State<B>>,
    changed: Condvar,
}

impl<B: Backend> Shared<B> {
    fn lock(&self) -> MutexGuard<'_, State<B>> {
        // Plain data: a panic mid-update leaves at worst a stale entry.
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// A stage's experts (see the module docs).
pub struct ExpertCache<B: Backend> {
    copier: Copier<B>,
    shared: Arc<Shared<B>>,
    link: LoaderLink,
    thread: Option<JoinHandle<LoaderLink>>,
    /// Every expert of the stage is kept (no predictions, no evictions).
    all: bool,
}

impl<B: Backend + 'static> ExpertCache<B> {
    /// A cache for the MoE layers of `layers`: `capacity` 0 loads every expert now and keeps them;
    /// otherwise it starts empty with a copy thread for predictions. `link` and `ahead` are loader
    /// links of their own (the step's fetches and the copy thread's).
    pub fn new(
        backend: B,
        store: Store,
        layers: std::ops::Range<u32>,
        capacity: usize,
        mut link: LoaderLink,
        ahead: LoaderLink,
    ) -> Result<Self> {
        let cfg = store.manifest.config.clone();
        let copier = Copier { backend, cfg: cfg.clone(), store };
        let every: Vec<Key> = crate::expert_history::keys(&cfg, layers.clone());
        let all = capacity == 0 || capacity >= every.len();
        let mut state = State {
            map: HashMap::new(),
            capacity: if all { every.len().max(1) } else { capacity },
            layers: (layers.start, layers.len() as u32),
            clock: 0,
            queued: VecDeque::new(),
            copying: None,
            ahead: (0, 0.0),
            stop: false,
            parent: TraceParent::default(),
            history: History::default(),
            history_path: None,
            gate: Gate::default(),
        };
        // Every expert, or the hottest the capacity holds by the store's usage history.
        let first = if all {
            every.clone()
        } else {
            let path = crate::expert_history::path_for(&copier.store);
            state.history = History::load(&path);
            state.history.start_run(&every);
            state.history_path = Some(path);
            state.history.hottest(&every, state.capacity)
        };
        for &k in &first {
            let (w, _) = copier.fetch(&mut link, k)?;
            state.map.insert(k, Entry { weights: Arc::new(w), last_use: 0, predicted: false });
        }
        if !all && !first.is_empty() {
            tracing::info!(
                experts = first.len(),
                capacity = state.capacity,
                "expert cache: the hottest experts by this store's usage history loaded"
            );
        }
        let shared = Arc::new(Shared { state: Mutex::new(state), changed: Condvar::new() });
        let thread = if all || every.is_empty() {
            None
        } else {
            let (c, s) = (copier.clone(), shared.clone());
            Some(
                std::thread::Builder::new()
                    .name("layerstream-experts".into())
                    .spawn(move || copy_ahead(c, s, ahead))
                    .map_err(|e| Error::Stage(format!("starting the expert copy thread: {e}")))?,
            )
        };
        Ok(ExpertCache { copier, shared, link, thread, all })
    }

    /// Whether predictions are worth making (some experts are not on the device).
    pub fn predicts(&self) -> bool {
        !self.all
    }

    /// Queues the experts of `layer` a prediction chose for the copy thread (those not on the
    /// device yet), replacing older predictions not yet started; `parent` is the trace to join.
    pub fn predict(&self, layer: u32, ids: &[u32], parent: TraceParent) {
        if self.all {
            return;
        }
        let mut s = self.shared.lock();
        if !s.gate.follow() {
            return;
        }
        s.queued.clear();
        s.parent = parent;
        for &e in ids {
            let k = (layer, e);
            if !s.map.contains_key(&k) && s.copying != Some(k) {
                s.queued.push_back(k);
            }
        }
        drop(s);
        self.shared.changed.notify_all();
    }
}

/// The copy thread: copies queued predictions onto the device until the cache is dropped.
fn copy_ahead<B: Backend>(
    c: Copier<B>,
    shared: Arc<Shared<B>>,
    mut link: LoaderLink,
) -> LoaderLink {
    loop {
        let (key, parent) = {
            let mut s = shared.lock();
            loop {
                if s.stop {
                    return link;
                }
                // The usage history is saved here, off the step's path.
                if let Some((h, path)) = s.history_to_save(false) {
                    drop(s);
                    save_history(&h, &path);
                    s = shared.lock();
                    continue;
                }
                if let Some(k) = s.queued.pop_front() {
                    if !s.map.contains_key(&k) {
                        s.copying = Some(k);
                        break (k, s.parent.clone());
                    }
                } else {
                    s = shared.changed.wait(s).unwrap_or_else(|p| p.into_inner());
                }
            }
        };
        let span = info_span!(parent: None, "prefetch experts", layer = key.0 as i64, expert = key.1 as i64);
        parent.adopt(&span);
        let got = span.in_scope(|| c.fetch(&mut link, key));
        let mut s = shared.lock();
        s.copying = None;
        match got {
            Ok((w, ms)) => {
                s.ahead.0 += w.bytes;
                s.ahead.1 += ms;
                s.gate.brought();
                let keep: HashSet<Key> = s.queued.iter().copied().chain([key]).collect();
                s.make_room(&keep, key.0);
                let clock = s.clock;
                s.map.insert(key, Entry { weights: Arc::new(w), last_use: clock, predicted: true });
            }
            // A failed prediction costs nothing: the step fetches the expert itself if it needs it.
            Err(e) => {
                tracing::warn!(layer = key.0, expert = key.1, error = %e, "expert prefetch failed")
            }
        }
        drop(s);
        shared.changed.notify_all();
    }
}

impl<B: Backend + 'static> ExpertSource<B> for ExpertCache<B> {
    fn experts(
        &mut self,
        layer: u32,
        ids: &[u32],
    ) -> Result<(Vec<Arc<ExpertWeights<B>>>, ExpertCounts)> {
        let keep: HashSet<Key> = ids.iter().map(|&e| (layer, e)).collect();
        let mut counts = ExpertCounts { needed: ids.len() as u32, ..Default::default() };
        let mut out = Vec::with_capacity(ids.len());
        let mut s = self.shared.lock();
        s.clock += 1;
        for &e in ids {
            let k = (layer, e);
            s.history.record(k);
            // An expert the copy thread is bringing in now: wait for it rather than copy it twice.
            while s.copying == Some(k) {
                s = self.shared.changed.wait(s).unwrap_or_else(|p| p.into_inner());
            }
            let clock = s.clock;
            if let Some(entry) = s.map.get_mut(&k) {
                entry.last_use = clock;
                let predicted = std::mem::take(&mut entry.predicted);
                out.push(entry.weights.clone());
                if predicted {
                    s.gate.used += 1.0;
                    counts.prefetched += 1;
                } else {
                    counts.hit += 1;
                }
                continue;
            }
            s.queued.retain(|q| *q != k);
            drop(s);
            let (w, ms) = self.copier.fetch(&mut self.link, k)?;
            counts.missed += 1;
            counts.bytes += w.bytes;
            counts.transfer_ms += ms;
            let w = Arc::new(w);
            out.push(w.clone());
            s = self.shared.lock();
            s.history.fetched(ms);
            s.make_room(&keep, layer);
            let clock = s.clock;
            s.map.insert(k, Entry { weights: w, last_use: clock, predicted: false });
        }
        let (bytes, ms) = std::mem::take(&mut s.ahead);
        counts.bytes += bytes;
        counts.transfer_ms += ms;
        let due = s.history.due();
        drop(s);
        if due {
            // The copy thread saves it (a history is kept only where there is one).
            self.shared.changed.notify_all();
        }
        Ok((out, counts))
    }
}

/// Saves a usage history; a failure is logged (the history only speeds the next start).
fn save_history(h: &History, path: &std::path::Path) {
    if let Err(e) = h.save(path) {
        tracing::warn!(path = %path.display(), error = %e, "expert usage history not saved");
    }
}

impl<B: Backend> Drop for ExpertCache<B> {
    fn drop(&mut self) {
        let save = self.shared.lock().history_to_save(true);
        if let Some((h, path)) = save {
            save_history(&h, &path);
        }
        self.shared.lock().stop = true;
        self.shared.changed.notify_all();
        let ahead = self.thread.take().and_then(|t| t.join().ok());
        // The slot mappings are unpinned before the links unmap them.
        for region in self.link.regions().chain(ahead.iter().flat_map(LoaderLink::regions)) {
            self.copier.backend.unregister_host(region);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::Gate;

    /// Predictions are followed while they warm up and while a quarter of what they bring in is
    /// used; below that only one in `PROBE`, until they pay again; old figures halve.
    #[test]
    fn predictions_are_followed_only_while_they_pay() {
        let mut g = Gate::default();
        assert!((0..40).all(|_| g.follow()), "warming up");
        (0..40).for_each(|_| g.brought());
        g.used = 5.0;
        let followed = (0..80).filter(|_| g.follow()).count();
        assert_eq!(followed, 80 / Gate::PROBE as usize, "probes only: 5 of 40 used");
        g.used = 10.0;
        assert!((0..8).all(|_| g.follow()), "a quarter used: followed again");
        (0..300).for_each(|_| g.brought());
        assert!(g.issued <= Gate::DECAY_AT && g.used < 10.0, "{g:?}");
    }
}
