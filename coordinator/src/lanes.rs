//! Micro-batches in flight ("lanes"): the running sequences are split into groups that move through
//! the workers independently, so while worker k runs one group, worker k-1 already runs the next and
//! no worker waits for the whole batch. This module holds the pure parts: the `--micro-batches`
//! setting, how many lanes a plan allows, and which lane each sequence rides next.

use layerstream_rpc::v1::Assignment;
use std::fmt;
use std::str::FromStr;

/// `--micro-batches`: `auto`, or a fixed count (1 = every step through the workers in turn).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum MicroBatches {
    #[default]
    Auto,
    Fixed(usize),
}

impl FromStr for MicroBatches {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        if s.eq_ignore_ascii_case("auto") {
            return Ok(MicroBatches::Auto);
        }
        match s.parse::<usize>() {
            Ok(n) if n >= 1 => Ok(MicroBatches::Fixed(n)),
            _ => Err(format!("`{s}` is neither `auto` nor a count of at least 1")),
        }
    }
}

impl fmt::Display for MicroBatches {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            MicroBatches::Auto => f.write_str("auto"),
            MicroBatches::Fixed(n) => write!(f, "{n}"),
        }
    }
}

/// Whether a worker streams any of its layers (holds fewer resident than it runs) or experts (an
/// expert cache smaller than its experts).
pub fn streams(a: &Assignment) -> bool {
    (a.resident.len() as u32) < a.layer_end.saturating_sub(a.layer_start) || a.expert_cache > 0
}

/// How many micro-batches the plan runs, and why. `auto` is one per worker: with as many groups in
/// flight as workers every worker has one to run, and more would only shrink each worker's batch.
/// A worker that streams layers would stream them once per micro-batch (the bytes multiplied by
/// the count), so a plan with one runs a single micro-batch whatever was asked.
pub fn choose(setting: MicroBatches, stages: &[Assignment]) -> (usize, String) {
    if let Some(s) = stages.iter().find(|a| streams(a)) {
        let m = match setting {
            MicroBatches::Fixed(1) => return (1, "--micro-batches 1".into()),
            m => m,
        };
        return (
            1,
            format!(
                "--micro-batches {m}, but {} streams layers {}..{} ({} resident{}): one micro-batch, \
                 so each streamed layer is read once per step",
                s.worker,
                s.layer_start,
                s.layer_end,
                s.resident.len(),
                if s.expert_cache > 0 {
                    format!(", experts through a cache of {}", s.expert_cache)
                } else {
                    String::new()
                }
            ),
        );
    }
    match setting {
        MicroBatches::Fixed(n) => (n, format!("--micro-batches {n}")),
        MicroBatches::Auto => (
            stages.len().max(1),
            format!(
                "--micro-batches auto: one per worker ({}), every layer resident",
                stages.len()
            ),
        ),
    }
}

/// Which lane each sequence rides next, given its lane now (`None`: not placed yet, or held back)
/// in admission order and which lanes have a step in flight (`busy`; one entry per lane). A lane
/// in flight keeps its sequences; the others are refilled so every lane carries about the same
/// number, `ceil(sequences / lanes used)`: an idle lane keeps its own up to that many (in order),
/// the rest and the unplaced go to the idle lane with the fewest, and what does not fit waits
/// (`None`) for the next lane to come back. With one lane every sequence rides it.
pub fn place(lanes: &[Option<usize>], busy: &[bool]) -> Vec<Option<usize>> {
    let m = busy.len().max(1);
    let total = lanes.len();
    if total == 0 {
        return Vec::new();
    }
    let used = m.min(total);
    let target = total.div_ceil(used);
    let mut count = vec![0usize; m];
    let mut out: Vec<Option<usize>> = lanes.to_vec();
    for l in out.iter_mut() {
        match *l {
            Some(k) if k < m && busy[k] => count[k] += 1,
            Some(k) if k < m && count[k] < target => count[k] += 1,
            _ => *l = None,
        }
    }
    for l in out.iter_mut().filter(|l| l.is_none()) {
        let best = (0..m).filter(|&k| !busy[k] && count[k] < target).min_by_key(|&k| count[k]);
        if let Some(k) = best {
            count[k] += 1;
            *l = Some(k);
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn stage(start: u32, end: u32, resident: &[u32]) -> Assignment {
        Assignment {
            worker: format!("w{start}"),
            layer_start: start,
            layer_end: end,
            resident: resident.to_vec(),
            ..Default::default()
        }
    }

    #[test]
    fn the_setting_parses_and_prints_back() {
        assert_eq!("auto".parse(), Ok(MicroBatches::Auto));
        assert_eq!("3".parse(), Ok(MicroBatches::Fixed(3)));
        assert!("0".parse::<MicroBatches>().unwrap_err().contains("at least 1"));
        assert!("x".parse::<MicroBatches>().is_err());
        assert_eq!(MicroBatches::Fixed(4).to_string(), "4");
        assert_eq!(MicroBatches::Auto.to_string(), "auto");
    }

    #[test]
    fn auto_is_one_per_worker_unless_a_worker_streams() {
        let resident = [stage(0, 2, &[0, 1]), stage(2, 4, &[2, 3]), stage(4, 5, &[4])];
        assert_eq!(choose(MicroBatches::Auto, &resident).0, 3);
        assert_eq!(choose(MicroBatches::Fixed(5), &resident).0, 5);
        let mixed = [stage(0, 2, &[0, 1]), stage(2, 4, &[2])];
        let (n, why) = choose(MicroBatches::Auto, &mixed);
        assert_eq!(n, 1);
        assert!(why.contains("w2 streams layers 2..4"), "{why}");
        assert_eq!(choose(MicroBatches::Fixed(4), &mixed).0, 1);
        assert_eq!(choose(MicroBatches::Auto, &[]).0, 1);
    }

    #[test]
    fn sequences_spread_evenly_over_idle_lanes() {
        // Startup: nothing placed, two idle lanes.
        assert_eq!(place(&[None; 4], &[false, false]), [Some(0), Some(1), Some(0), Some(1)]);
        // One sequence: one lane.
        assert_eq!(place(&[None], &[false, false]), [Some(0)]);
        // One lane: everything rides it.
        assert_eq!(place(&[Some(0), None, None], &[false]), [Some(0); 3]);
    }

    #[test]
    fn a_busy_lane_keeps_its_sequences_and_the_surplus_waits() {
        // Lane 0 in flight with one; 5 more arrive: lane 1 takes its share (3), two wait.
        let got = place(&[Some(0), None, None, None, None, None], &[true, false]);
        assert_eq!(got, [Some(0), Some(1), Some(1), Some(1), None, None]);
        // Lane 0 comes back while lane 1 is in flight: it takes the two waiting ones.
        let got = place(&got, &[false, true]);
        assert_eq!(got, [Some(0), Some(1), Some(1), Some(1), Some(0), Some(0)]);
        // An idle lane with more than its share gives the surplus to an idle lane with fewer.
        let got = place(&[Some(0), Some(0), Some(0), Some(0)], &[false, false]);
        assert_eq!(got, [Some(0), Some(0), Some(1), Some(1)]);
        // A lane index beyond the count (fewer lanes after a re-plan) is placed again.
        assert_eq!(place(&[Some(3)], &[false, false]), [Some(0)]);
    }
}
