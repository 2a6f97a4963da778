//! Per-request accounting of where time went: bytes streamed, transfer, compute and stall time over
//! the steps a request rode, turned into the `Stats` message (tokens/s, overlap %).

use layerstream_rpc::v1::{LayerTiming, Stats};
use std::time::Duration;

/// Sums over the steps of one request.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Acc {
    pub(crate) bytes: u64,
    pub(crate) transfer_ms: f64,
    pub(crate) compute_ms: f64,
    pub(crate) stall_ms: f64,
    pub(crate) steps: u64,
    pub(crate) max_batch: u32,
    pub(crate) layers_ms: f64,
    pub(crate) ideal_ms: f64,
    /// Time from arrival to the first generated token.
    pub(crate) first_token: Option<Duration>,
    /// Replays after worker faults.
    pub(crate) replays: u32,
    /// Σ of the workers' wall times in the steps, and the most workers a step had.
    pub(crate) busy_ms: f64,
    pub(crate) workers: u32,
    /// Experts needed, hit, prefetched and missed (mixture-of-experts layers).
    pub(crate) experts: [u64; 4],
    /// Speculative decoding: tokens drafted and accepted; steps that emitted tokens.
    pub(crate) spec_drafted: u64,
    pub(crate) spec_accepted: u64,
    pub(crate) passes: u64,
    /// Prompt tokens found in the prefix cache; times preempted for KV blocks.
    pub(crate) cached_tokens: u32,
    pub(crate) preemptions: u32,
}

impl Acc {
    /// A step that emitted tokens for this request, after drafting `drafted` and accepting
    /// `accepted` of them.
    pub fn spec(&mut self, drafted: usize, accepted: usize) {
        self.spec_drafted += drafted as u64;
        self.spec_accepted += accepted as u64;
        self.passes += 1;
    }

    /// Adds one step's layer timings and the wall time of its layer passes.
    pub fn add(&mut self, layers: &[LayerTiming], layers_ms: f64, batch: usize) {
        self.steps += 1;
        self.max_batch = self.max_batch.max(batch as u32);
        self.layers_ms += layers_ms;
        for l in layers {
            self.ideal_ms += l.transfer_ms.max(l.compute_ms);
            self.bytes += l.bytes;
            self.transfer_ms += l.transfer_ms;
            self.compute_ms += l.compute_ms;
            self.stall_ms += l.stall_ms;
            for (acc, n) in self.experts.iter_mut().zip([
                l.experts_needed,
                l.experts_hit,
                l.experts_prefetched,
                l.experts_missed,
            ]) {
                *acc += n as u64;
            }
        }
    }

    /// Adds one step's wall time on each worker.
    pub fn add_busy(&mut self, worker_walls_ms: &[f64]) {
        self.busy_ms += worker_walls_ms.iter().sum::<f64>();
        self.workers = self.workers.max(worker_walls_ms.len() as u32);
    }

    /// Share of transfer time hidden behind compute: 100 when nothing was streamed.
    pub fn overlap_pct(&self) -> f64 {
        if self.transfer_ms <= 0.0 {
            return 100.0;
        }
        ((self.transfer_ms - self.stall_ms).max(0.0) / self.transfer_ms * 100.0).min(100.0)
    }

    /// The final stats: `wall` since admission, `since_arrival` since the request arrived.
    pub fn stats(
        &self,
        prompt: usize,
        completion: usize,
        wall: Duration,
        since_arrival: Duration,
    ) -> Stats {
        let wall_ms = wall.as_secs_f64() * 1e3;
        let first = self.first_token.unwrap_or_default();
        let after_first = since_arrival.saturating_sub(first).as_secs_f64();
        let decode_tokens_per_s = if completion >= 2 && after_first > 0.0 {
            (completion - 1) as f64 / after_first
        } else {
            0.0
        };
        Stats {
            prompt_tokens: prompt as u64,
            completion_tokens: completion as u64,
            tokens_per_s: if wall_ms > 0.0 { completion as f64 / (wall_ms / 1e3) } else { 0.0 },
            bytes_streamed: self.bytes,
            transfer_ms: self.transfer_ms,
            compute_ms: self.compute_ms,
            overlap_pct: self.overlap_pct(),
            wall_ms,
            steps: self.steps,
            stall_ms: self.stall_ms,
            max_batch: self.max_batch,
            layers_ms: self.layers_ms,
            ideal_ms: self.ideal_ms,
            first_token_ms: self.first_token.map_or(0.0, |d| d.as_secs_f64() * 1e3),
            decode_tokens_per_s,
            replays: self.replays,
            workers_busy_pct: if self.workers > 0 && wall_ms > 0.0 {
                self.busy_ms / (self.workers as f64 * wall_ms) * 100.0
            } else {
                0.0
            },
            experts_needed: self.experts[0],
            experts_hit: self.experts[1],
            experts_prefetched: self.experts[2],
            experts_missed: self.experts[3],
            spec_drafted: self.spec_drafted,
            spec_accepted: self.spec_accepted,
            weight_passes: self.passes,
            tokens_per_pass: if self.passes > 0 {
                completion as f64 / self.passes as f64
            } else {
                0.0
            },
            cached_tokens: self.cached_tokens,
            preemptions: self.preemptions,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn overlap_is_hidden_share_of_transfer() {
        let mut a = Acc::default();
        a.add(
            &[LayerTiming {
                bytes: 10,
                transfer_ms: 4.0,
                stall_ms: 1.0,
                compute_ms: 5.0,
                ..Default::default()
            }],
            6.0,
            3,
        );
        assert_eq!(a.overlap_pct(), 75.0);
        a.add(
            &[
                LayerTiming { bytes: 10, transfer_ms: 4.0, stall_ms: 4.0, ..Default::default() },
                LayerTiming { compute_ms: 2.0, ..Default::default() },
            ],
            7.0,
            1,
        );
        assert_eq!(
            (a.layers_ms, a.ideal_ms),
            (13.0, 11.0),
            "ideal = Σ max(transfer, compute) per layer"
        );
        assert_eq!(a.max_batch, 3);
        assert_eq!(a.overlap_pct(), 37.5);
        assert_eq!(Acc::default().overlap_pct(), 100.0);
        assert_eq!(
            a.stats(3, 2, Duration::from_secs(1), Duration::from_secs(1)).bytes_streamed,
            20
        );
        // First token 0.5 s after arrival, 5 tokens by 2.5 s: 4 tokens over the 2 s after the first.
        a.first_token = Some(Duration::from_millis(500));
        let st = a.stats(3, 5, Duration::from_secs(2), Duration::from_millis(2500));
        assert_eq!((st.first_token_ms, st.decode_tokens_per_s), (500.0, 2.0));
        assert_eq!(
            a.stats(3, 1, Duration::from_secs(2), Duration::from_secs(2)).decode_tokens_per_s,
            0.0,
            "one token has no decode rate"
        );
        // Two workers busy 600 and 400 ms of a 1 s request: each idle half the time on average.
        a.add_busy(&[600.0, 400.0]);
        let st = a.stats(3, 5, Duration::from_secs(1), Duration::from_secs(1));
        assert_eq!(st.workers_busy_pct, 50.0);
    }
}
