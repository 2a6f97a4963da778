//! What a mixture-of-experts pass fetches from outside the workers' expert caches, for the cost
//! model (`cost::Fetches`): per MoE layer, the experts a step needs (`cost::experts_needed`) that
//! the worker's cache misses. The share its cache serves comes from the store's usage history —
//! what the hottest experts it holds took of the history's routings, less the share of a run's
//! needs that meet experts the history never saw (`History::novelty`) — else from its share of the
//! experts (routing spread evenly: the worst case for a cache). `plan --expert-misses` sets the
//! share missed instead (`bench` passes the share its run measured). Each fetch costs what the
//! history timed one at (`History::fetch_s`) where that is more than the disk's read.

use layerstream_coordinator::cost::{expert_misses, Fetches};
use layerstream_serving::plan::Assignment;
use layerstream_worker::expert_history::History;

/// Where the share of needs a worker's cache misses comes from.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Misses {
    /// The store's usage history (an even spread where it has none of a worker's layers).
    History,
    /// This share of every need (`--expert-misses`: a run's measured share).
    Share(f64),
}

/// Each layer's expected fetches at `rows` sequences, in pass order (`plans`' layers, in turn):
/// none for a dense layer or a worker that keeps every expert (`expert_cache` 0).
pub fn expert_fetches(
    m: &layerstream_model::Manifest,
    plans: &[Assignment],
    rows: usize,
    history: &History,
    misses: Misses,
) -> Vec<Fetches> {
    let mut out = Vec::new();
    for p in plans {
        let (n, total, _) = layerstream_serving::plan::range_experts(m, p);
        let keys = layerstream_worker::expert_history::keys(&m.config, p.layer_start..p.layer_end);
        let held = match (p.expert_cache as usize, misses) {
            (0, _) => 1.0,
            (_, Misses::Share(s)) => 1.0 - s,
            (c, Misses::History) => match history.coverage(&keys, c) {
                Some(hot) => hot * (1.0 - history.novelty().unwrap_or(0.0)),
                None => c as f64 / n.max(1) as f64,
            },
        };
        let bytes_each = total / n.max(1) as u64;
        let measured_s = history.fetch_s().unwrap_or(0.0);
        for l in p.layer_start..p.layer_end {
            let experts = m
                .config
                .moe_at(l as usize)
                .map_or(0.0, |moe| expert_misses(moe.experts, moe.top_k, rows, held));
            out.push(Fetches { experts, bytes_each, measured_s });
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Without a usage history a cache of a quarter of the experts serves a quarter of the
    /// routings (an even spread); with a history whose routings all went to as many experts as the
    /// cache holds, nothing is fetched — unless later runs met unseen experts (novelty), whose
    /// share is fetched whatever the cache holds; a given share overrides both; a cache of every
    /// expert fetches nothing.
    #[test]
    fn fetches_come_from_the_usage_history_else_from_an_even_spread() {
        let dir = tempfile::tempdir().unwrap();
        let m = layerstream_model::synth::synth(
            "tiny-moe",
            layerstream_model::DType::Q8_0,
            Some(2),
            1,
            dir.path(),
        )
        .unwrap();
        let moe = m.config.moe_at(0).unwrap().clone();
        let (e, k) = (moe.experts, moe.top_k);
        let plan = |cache: u32| Assignment {
            layer_end: 2,
            resident: vec![0, 1],
            expert_cache: cache,
            ..Default::default()
        };
        let each = layerstream_serving::plan::range_experts(&m, &plan(0)).2;
        let quarter = (2 * e / 4) as u32;
        let at = |h: &History, cache: u32, rows: usize, x: Misses| {
            expert_fetches(&m, &[plan(cache)], rows, h, x)
        };
        let fetch = |experts: f64| vec![Fetches { experts, bytes_each: each, measured_s: 0.0 }; 2];
        let empty = History::default();
        assert_eq!(at(&empty, quarter, 1, Misses::History), fetch(expert_misses(e, k, 1, 0.25)));
        assert!(expert_misses(e, k, 1, 0.25) > 0.0);
        let mut hot = History::default();
        let keys = layerstream_worker::expert_history::keys(&m.config, 0..2);
        hot.start_run(&keys);
        for l in 0..2 {
            (0..(e / 4) as u32).for_each(|x| hot.record((l, x)));
        }
        assert_eq!(at(&hot, quarter, 1, Misses::History), fetch(0.0));
        // A later run: half its needs go to experts never seen.
        hot.start_run(&keys);
        hot.record((0, 0));
        hot.record((0, (e - 1) as u32));
        assert_eq!(hot.novelty(), Some(0.5));
        let served = hot.coverage(&keys, quarter as usize).unwrap() * 0.5;
        assert!(served > 0.25 && served < 0.5, "the unseen expert took a routing: {served}");
        assert_eq!(at(&hot, quarter, 1, Misses::History), fetch(k as f64 * (1.0 - served)));
        assert_eq!(at(&hot, quarter, 1, Misses::Share(0.25)), fetch(k as f64 * 0.25));
        assert_eq!(at(&empty, 0, 8, Misses::History), fetch(0.0));
        hot.fetched(12.0);
        assert!(at(&hot, quarter, 1, Misses::Share(0.25)).iter().all(|x| x.measured_s == 0.012));
    }
}
