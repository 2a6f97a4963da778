//! The disk as runs served it: the loader's GB/s over a run in which it was kept reading (the
//! disk, not the compute, bounded the run), per way of reading, decayed so the latest runs weigh
//! most. Calibration reads 512 MiB at each count of reads in flight when a stack starts; a run
//! reads the store's disk tier pass after pass, as the stack does — on the virtual disks this was
//! built on the two differed by 20-40% (calibration 1.19 GB/s, runs 1.44-1.47). `bench` records
//! each disk-bound run here (`record`), after its own prediction was made; `plan` (and bench's
//! next prediction) predicts at the served rate where there is one (`rate`) and says so.
//!
//! Kept under the cache root beside the calibration figures, keyed as they are less the way of
//! measuring (`calibration::key`): `--recalibrate` measures calibration again and keeps these.

use crate::calibration;
use layerstream_model::Store;
use layerstream_types::stats::Decayed;
use layerstream_worker::DeviceFlags;
use serde::{Deserialize, Serialize};
use std::path::{Path, PathBuf};

/// The least the loader must have read in a run for its rate to count.
const MIN_BYTES: u64 = 256 << 20;
/// The least share of a run's wall time the loader must have had a read in flight: below it the
/// compute (or the requests' pace) bounded the run and the reads came as slots freed, one or two
/// in flight (a compute-bound batch of 8 read at 1.12 GB/s where disk-bound passes read at 1.47).
const MIN_BUSY: f64 = 0.8;

/// The GB/s a run's disk served, where the run was disk-bound: `bytes` read over the `busy_s` a
/// read was in flight, when that is at least `MIN_BUSY` of the run's `wall_s` and `MIN_BYTES` were
/// read; None otherwise.
pub fn disk_bound_rate(bytes: u64, busy_s: f64, wall_s: f64) -> Option<f64> {
    (bytes >= MIN_BYTES && busy_s > 0.0 && busy_s >= MIN_BUSY * wall_s)
        .then(|| bytes as f64 / busy_s / 1e9)
}

/// The served rates, per way of reading.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
struct Rates {
    direct: Decayed,
    buffered: Decayed,
}

impl Rates {
    fn of(&mut self, buffered: bool) -> &mut Decayed {
        if buffered {
            &mut self.buffered
        } else {
            &mut self.direct
        }
    }
}

/// The file: the key it belongs to and the rates.
#[derive(Serialize, Deserialize)]
struct Saved {
    key: String,
    rates: Rates,
}

fn path(root: &Path, store: &Store, device: &DeviceFlags) -> (String, PathBuf) {
    let key = format!("{} served", calibration::key(store, device));
    let p = calibration::path_in(root, &key, "served.json");
    (key, p)
}

fn load(root: &Path, store: &Store, device: &DeviceFlags) -> Rates {
    let (key, p) = path(root, store, device);
    std::fs::read(p)
        .ok()
        .and_then(|b| serde_json::from_slice::<Saved>(&b).ok())
        .filter(|s| s.key == key)
        .map_or_else(Rates::default, |s| s.rates)
}

/// The GB/s past disk-bound runs read `store` at on this host, `buffered` or O_DIRECT, and how
/// many runs that is (decayed: the last counts 1, the one before ½, …); None before any.
pub fn rate(store: &Store, device: &DeviceFlags, buffered: bool) -> Option<(f64, f64)> {
    rate_in(&layerstream_types::cache_dir(), store, device, buffered)
}

fn rate_in(root: &Path, store: &Store, device: &DeviceFlags, buffered: bool) -> Option<(f64, f64)> {
    let mut r = load(root, store, device);
    let d = *r.of(buffered);
    d.mean().map(|g| (g, d.count()))
}

/// Counts a disk-bound run's `gbps`, read `buffered` or O_DIRECT: earlier runs count half.
pub fn record(
    store: &Store,
    device: &DeviceFlags,
    buffered: bool,
    gbps: f64,
) -> std::io::Result<()> {
    record_in(&layerstream_types::cache_dir(), store, device, buffered, gbps)
}

fn record_in(
    root: &Path,
    store: &Store,
    device: &DeviceFlags,
    buffered: bool,
    gbps: f64,
) -> std::io::Result<()> {
    let mut r = load(root, store, device);
    let d = r.of(buffered);
    d.halve();
    d.add(gbps);
    let (key, p) = path(root, store, device);
    let bytes =
        serde_json::to_vec_pretty(&Saved { key, rates: r }).map_err(std::io::Error::other)?;
    layerstream_types::cache::write_whole(&p, &bytes)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A run counts where the loader read enough and was busy most of it.
    #[test]
    fn only_disk_bound_runs_count() {
        let gb = 1_000_000_000;
        assert_eq!(disk_bound_rate(3 * gb, 2.0, 2.2), Some(1.5));
        assert_eq!(disk_bound_rate(3 * gb, 2.0, 4.0), None, "busy half the run: compute-bound");
        assert_eq!(disk_bound_rate(100 << 20, 0.1, 0.1), None, "too little read");
        assert_eq!(disk_bound_rate(3 * gb, 0.0, 0.0), None, "no busy time");
    }

    /// Rates are kept per store and way of reading, the latest weighing most, and a file of
    /// another key is not read.
    #[test]
    fn served_rates_are_kept_per_store_and_mode() {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path().join("cache");
        let a = calibration::tiny_store(dir.path(), "a", 1);
        let b = calibration::tiny_store(dir.path(), "b", 2);
        let dev = calibration::cpu_device();
        let rate = |s: &Store, buffered| rate_in(&root, s, &dev, buffered);
        let record = |s: &Store, buffered, g| record_in(&root, s, &dev, buffered, g);
        assert_eq!(rate(&a, false), None);
        record(&a, false, 1.0).unwrap();
        record(&a, false, 2.5).unwrap();
        assert_eq!(rate(&a, false), Some((2.0, 1.5)), "(0.5 + 2.5) / 1.5");
        assert_eq!(rate(&a, true), None, "the page cache's rate is its own");
        assert_eq!(rate(&b, false), None, "another store");
        let (_, p) = path(&root, &a, &dev);
        let mut s: Saved = serde_json::from_slice(&std::fs::read(&p).unwrap()).unwrap();
        s.key.push_str(" elsewhere");
        std::fs::write(&p, serde_json::to_vec(&s).unwrap()).unwrap();
        assert_eq!(rate(&a, false), None, "a file of another key");
    }
}
