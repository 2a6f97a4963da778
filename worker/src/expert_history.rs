//! How often each expert was routed to, kept per store across runs: the expert cache counts every
//! expert a step needs, saves the counts under the cache root (`expert-usage/<store identity>.json`,
//! written whole and renamed) every `SAVE_EVERY` needs and when it is dropped, and at the next start
//! loads the hottest experts of its layers before the first step and evicts the least used first.
//! Counts are halved when they grow large, so the history follows a changing workload.
//!
//! It also keeps how often a run met an expert it had never counted (`novelty`): of the needs of
//! runs that started with a history of their layers, the share that went to a first-time expert,
//! halved at each start so the latest runs weigh most. A cache misses such a need whatever it
//! holds; `layerstream plan` charges that share beside what the hottest experts leave. And what
//! a miss costs: the milliseconds a step waited for each expert it fetched, decayed alike.

use layerstream_types::stats::Decayed;
use std::collections::HashMap;
use std::path::{Path, PathBuf};

/// (layer, expert).
pub type Key = (u32, u32);

/// Every expert of the mixture-of-experts layers among `layers`, as history keys.
pub fn keys(cfg: &layerstream_model::ModelConfig, layers: std::ops::Range<u32>) -> Vec<Key> {
    layers
        .filter_map(|l| cfg.moe_at(l as usize).map(|m| (l, m.experts as u32)))
        .flat_map(|(l, n)| (0..n).map(move |e| (l, e)))
        .collect()
}

/// Needs recorded between saves.
pub const SAVE_EVERY: u64 = 4096;
/// A count past this halves every count.
const AGE_AT: u64 = 1 << 40;

/// Routing counts of one store's experts.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct History {
    counts: HashMap<Key, u64>,
    /// Needs recorded since the last save.
    unsaved: u64,
    /// Needs of runs that started with a history, each 1 where it went to a first-time expert.
    novel: Decayed,
    /// Whether this run counts `novel` (`start_run` found counts of its layers).
    counting: bool,
    /// Fetches of an expert a step needed and the cache missed, each its milliseconds: what a miss
    /// costs a step on this host, as the worker timed it.
    fetch: Decayed,
}

/// The file: counts as (layer, expert, count) and `novel` as [needs, first-time needs]; a file of
/// the counts alone (the format before novelty was kept) reads with no novelty.
#[derive(serde::Serialize, serde::Deserialize)]
#[serde(untagged)]
enum Saved {
    Full {
        counts: Vec<(u32, u32, u64)>,
        novel: Decayed,
        #[serde(default)]
        fetch: Decayed,
    },
    Counts(Vec<(u32, u32, u64)>),
}

impl History {
    /// Counts one routing of `key`.
    pub fn record(&mut self, key: Key) {
        let c = self.counts.entry(key).or_insert(0);
        if self.counting {
            self.novel.add(if *c == 0 { 1.0 } else { 0.0 });
        }
        *c += 1;
        self.unsaved += 1;
        if *c >= AGE_AT {
            self.counts.values_mut().for_each(|v| *v /= 2);
            self.counts.retain(|_, v| *v > 0);
        }
    }

    /// A run of a cache over `keys` starts: past runs' novelty counts half, and this run counts its
    /// own where the history knows any of `keys` (a first run's experts are all new: that says
    /// nothing of how often a later run meets unseen ones).
    pub fn start_run(&mut self, keys: &[Key]) {
        self.novel.halve();
        self.fetch.halve();
        self.counting = keys.iter().any(|&k| self.count(k) > 0);
    }

    /// The share of a run's needs that go to experts the history never counted, as past runs that
    /// started with a history met them (latest weighing most); None before such a run.
    pub fn novelty(&self) -> Option<f64> {
        self.novel.mean()
    }

    /// Counts one fetch of a missed expert that took `ms` (the step waited for it).
    pub fn fetched(&mut self, ms: f64) {
        self.fetch.add(ms);
    }

    /// Seconds a step waited for one missed expert, as past runs timed it (latest weighing most);
    /// None before any was fetched.
    pub fn fetch_s(&self) -> Option<f64> {
        self.fetch.mean().map(|ms| ms / 1e3)
    }

    /// Whether no routing was counted (a store not yet run, or its history lost).
    pub fn is_empty(&self) -> bool {
        self.counts.is_empty()
    }

    /// How often `key` was routed to.
    pub fn count(&self, key: Key) -> u64 {
        self.counts.get(&key).copied().unwrap_or(0)
    }

    /// The `n` most routed-to of `candidates` (ties: lower layer, then lower expert), never one
    /// that was not routed to at all.
    pub fn hottest(&self, candidates: &[Key], n: usize) -> Vec<Key> {
        let mut hot: Vec<(u64, Key)> =
            candidates.iter().map(|&k| (self.count(k), k)).filter(|&(c, _)| c > 0).collect();
        hot.sort_by(|a, b| b.0.cmp(&a.0).then(a.1.cmp(&b.1)));
        hot.into_iter().take(n).map(|(_, k)| k).collect()
    }

    /// The share of `candidates`' routings that their `n` hottest took (what a cache holding them
    /// would have served); None without a history of them.
    pub fn coverage(&self, candidates: &[Key], n: usize) -> Option<f64> {
        let total: u64 = candidates.iter().map(|&k| self.count(k)).sum();
        let hot: u64 = self.hottest(candidates, n).iter().map(|&k| self.count(k)).sum();
        (total > 0).then(|| hot as f64 / total as f64)
    }

    /// Whether enough needs were recorded since the last save to save again.
    pub fn due(&self) -> bool {
        self.unsaved >= SAVE_EVERY
    }

    /// The history saved at `path`; empty when there is none or it cannot be read (a history only
    /// speeds a start up: a damaged one is started afresh, and said).
    pub fn load(path: &Path) -> History {
        let Ok(bytes) = std::fs::read(path) else { return History::default() };
        match serde_json::from_slice::<Saved>(&bytes) {
            Ok(saved) => {
                let (v, novel, fetch) = match saved {
                    Saved::Full { counts, novel, fetch } => (counts, novel, fetch),
                    Saved::Counts(counts) => (counts, Decayed::default(), Decayed::default()),
                };
                let counts = v.into_iter().map(|(l, e, c)| ((l, e), c)).collect();
                History { counts, novel, fetch, ..History::default() }
            }
            Err(e) => {
                tracing::warn!(path = %path.display(), error = %e, "expert usage history unreadable; starting afresh");
                History::default()
            }
        }
    }

    /// Needs recorded since the last save.
    pub fn unsaved(&self) -> u64 {
        self.unsaved
    }

    /// Notes that the counts as they are now were saved (`save` took a copy).
    pub fn saved(&mut self) {
        self.unsaved = 0;
    }

    /// Writes the history to `path` (a temporary file renamed over it), merged with what another
    /// process (another worker of the same store) saved there since: the larger count of each
    /// expert wins; its novelty and fetch times replace the file's (they started from them).
    pub fn save(&self, path: &Path) -> std::io::Result<()> {
        let there = History::load(path);
        let mut merged = there.counts;
        for (&k, &c) in &self.counts {
            let v = merged.entry(k).or_insert(0);
            *v = (*v).max(c);
        }
        let mut v: Vec<(u32, u32, u64)> = merged.into_iter().map(|((l, e), c)| (l, e, c)).collect();
        v.sort_unstable();
        // This process's figures grew from the file's at its start (decayed): they supersede it,
        // unless it has none.
        let saved = Saved::Full {
            counts: v,
            novel: self.novel.or(there.novel),
            fetch: self.fetch.or(there.fetch),
        };
        let bytes = serde_json::to_vec(&saved).map_err(std::io::Error::other)?;
        layerstream_types::cache::write_whole(path, &bytes)
    }
}

/// Where a store's history lives.
pub fn path_for(store: &layerstream_model::Store) -> PathBuf {
    layerstream_types::cache_dir().join("expert-usage").join(format!("{}.json", store.identity()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_hottest_experts_are_kept_across_a_save_and_a_load() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("h.json");
        let mut h = History::default();
        for (k, n) in [((0, 3), 5), ((0, 1), 2), ((1, 7), 9), ((1, 2), 2)] {
            (0..n).for_each(|_| h.record(k));
        }
        let all = [(0, 0), (0, 1), (0, 3), (1, 2), (1, 7)];
        assert_eq!(h.hottest(&all, 3), [(1, 7), (0, 3), (0, 1)], "by count, ties by key");
        assert_eq!(h.hottest(&all, 10).len(), 4, "never an expert not routed to");
        assert_eq!(h.hottest(&[(0, 0)], 1), Vec::<Key>::new());
        assert_eq!(h.coverage(&all, 1), Some(9.0 / 18.0));
        assert_eq!(h.coverage(&all, 10), Some(1.0));
        assert_eq!(h.coverage(&[(0, 0)], 1), None);
        h.save(&path).unwrap();
        h.saved();
        assert!(!h.due());
        let back = History::load(&path);
        assert_eq!(back.hottest(&all, 3), h.hottest(&all, 3));
        // Another worker's save merges: the larger count of each wins.
        let mut other = History::default();
        (0..20).for_each(|_| other.record((0, 0)));
        other.save(&path).unwrap();
        let merged = History::load(&path);
        assert_eq!((merged.count((0, 0)), merged.count((1, 7))), (20, 9));
        // A damaged file is a fresh history, not an error.
        std::fs::write(&path, b"{not json").unwrap();
        assert_eq!(History::load(&path), History::default());
        assert_eq!(History::load(&dir.path().join("absent.json")), History::default());
    }

    /// A first run counts no novelty (all its experts are new); a later run counts the share of
    /// its needs that went to experts never counted before, kept across a save; each start halves
    /// the past; the counts-only file of before reads with none.
    #[test]
    fn novelty_is_the_share_of_a_later_runs_needs_that_meet_unseen_experts() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("h.json");
        let keys: Vec<Key> = (0..8).map(|e| (0, e)).collect();
        let mut h = History::default();
        h.start_run(&keys);
        (0..4).for_each(|e| h.record((0, e)));
        assert_eq!(h.novelty(), None, "a first run's experts are all new");
        h.start_run(&keys);
        // 6 needs: experts 0 and 1 again, then 4 and 5 twice each (first-time once each).
        for e in [0, 1, 4, 4, 5, 5] {
            h.record((0, e));
        }
        assert_eq!(h.novelty(), Some(2.0 / 6.0));
        h.save(&path).unwrap();
        let mut back = History::load(&path);
        assert_eq!(back.novelty(), Some(2.0 / 6.0));
        back.start_run(&keys);
        (0..6).for_each(|_| back.record((0, 0)));
        // (6 / 2 + 6) needs, (2 / 2 + 0) first-time.
        assert_eq!(back.novelty(), Some(1.0 / 9.0));
        // Fetch times: kept across a save, halved at a start like novelty.
        assert_eq!(back.fetch_s(), None);
        back.fetched(12.0);
        back.fetched(8.0);
        back.save(&path).unwrap();
        // A later start's (decayed) figures replace the file's, though they count less.
        let mut later = History::load(&path);
        later.start_run(&keys);
        later.fetched(2.0);
        later.save(&path).unwrap();
        assert!((History::load(&path).fetch_s().unwrap() - 0.006).abs() < 1e-12);
        back.save(&path).unwrap();
        let mut again = History::load(&path);
        assert!((again.fetch_s().unwrap() - 0.010).abs() < 1e-12);
        again.start_run(&keys);
        again.fetched(40.0);
        // (20 / 2 + 40) ms over (2 / 2 + 1) fetches.
        assert!((again.fetch_s().unwrap() - 0.025).abs() < 1e-12);
        std::fs::write(&path, b"[[0,3,5],[1,7,9]]").unwrap();
        let old = History::load(&path);
        assert_eq!((old.count((1, 7)), old.novelty()), (9, None));
    }

    #[test]
    fn saves_come_due_and_counts_age() {
        let mut h = History::default();
        (0..SAVE_EVERY).for_each(|_| h.record((0, 0)));
        assert!(h.due());
        h.saved();
        assert!(!h.due());
        h.counts.insert((0, 1), AGE_AT - 1);
        h.counts.insert((0, 2), 1);
        h.record((0, 1));
        assert_eq!(h.count((0, 1)), AGE_AT / 2);
        assert_eq!(h.count((0, 2)), 0, "halved away");
    }
}
