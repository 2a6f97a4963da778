//! Calibration at start: the figures the cost model predicts from — the store's disk (GB/s read
//! O_DIRECT and through the page cache, the faster way kept, and a 4 KiB read's latency), the
//! host→device link where the worker copies, and one layer's and the head's compute at 1, 8 and 64
//! rows on the worker's device — measured once and cached per host and store under the cache root
//! (`calibration/<key>.json`). The key names everything that changes
//! the figures (host, CPU, cores, device, threads, precision, the store's files, the store's
//! filesystem, this build); a changed key or `--recalibrate` measures again.

use anyhow::{Context, Result};
use layerstream_coordinator::cost::{buffered_pays, Figures, READS_IN_FLIGHT};
use layerstream_model::layout::layer_file;
use layerstream_model::Store;
use layerstream_worker::DeviceFlags;
use serde::{Deserialize, Serialize};
use std::hash::{Hash, Hasher};
use std::path::PathBuf;

/// Row counts one layer's compute is measured at.
pub const ROWS: [usize; 3] = [1, 8, 64];

/// A cache file: the key it was measured under and the figures.
#[derive(Serialize, Deserialize)]
struct Cached {
    key: String,
    figures: Figures,
}

/// What the figures depend on, as one line.
pub fn key(store: &Store, device: &DeviceFlags) -> String {
    let cpu = std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|s| s.lines().find(|l| l.starts_with("model name")).map(str::to_owned))
        .unwrap_or_default();
    let host = std::fs::read_to_string("/proc/sys/kernel/hostname").unwrap_or_default();
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let fs = std::fs::metadata(&store.dir).map_or(0, |m| std::os::unix::fs::MetadataExt::dev(&m));
    let int8 = device.compute.int8();
    format!(
        "host={} cpu={} cores={cores} device={} threads={:?} int8={int8} store={} fs={fs} \
         build={}",
        host.trim(),
        cpu.split(':').nth(1).unwrap_or("").trim(),
        device.compute.device,
        device.compute.threads,
        store.identity(),
        env!("CARGO_PKG_VERSION"),
    )
}

fn path_for(key: &str) -> PathBuf {
    let mut h = std::collections::hash_map::DefaultHasher::new();
    key.hash(&mut h);
    layerstream_types::cache_dir().join("calibration").join(format!("{:016x}.json", h.finish()))
}

/// The figures for `store` on `device`: from the cache when its key matches and `recalibrate` is
/// off, else measured and cached (a cache that cannot be written is only a warning). Returns
/// whether they came from the cache.
pub fn figures(store: &Store, device: &DeviceFlags, recalibrate: bool) -> Result<(Figures, bool)> {
    let key = format!("{} reads={:?} modes=direct,buffered", key(store, device), READS_IN_FLIGHT);
    let path = path_for(&key);
    if !recalibrate {
        let cached =
            std::fs::read(&path).ok().and_then(|b| serde_json::from_slice::<Cached>(&b).ok());
        if let Some(c) = cached.filter(|c| c.key == key) {
            return Ok((c.figures, true));
        }
    }
    let f = measure(store, device)?;
    let write = || -> std::io::Result<()> {
        let c = Cached { key: key.clone(), figures: f.clone() };
        let bytes = serde_json::to_vec_pretty(&c).map_err(std::io::Error::other)?;
        layerstream_types::cache::write_whole(&path, &bytes)
    };
    if let Err(e) = write() {
        eprintln!("layerstream: calibration not cached ({}): {e}", path.display());
    }
    Ok((f, false))
}

/// Measures the figures: the disk over the layer files at each count of `READS_IN_FLIGHT` the
/// store has files for (at most 512 MiB a count, two files a reader at least, as the loader's
/// read-ahead reads them), the link (a GPU), the middle layer's and the head's compute.
fn measure(store: &Store, device: &DeviceFlags) -> Result<Figures> {
    let cfg = &store.manifest.config;
    let files: Vec<_> = (0..cfg.num_layers).map(|l| store.dir.join(layer_file(l))).collect();
    // Both ways the loader can read (O_DIRECT, the page cache), the faster kept (`buffered_pays`).
    let curve = |buffered: bool| -> Result<(Vec<(usize, f64)>, layerstream_loader::DiskFigures)> {
        let (mut by_reads, mut disk) = (Vec::new(), None);
        for n in READS_IN_FLIGHT.into_iter().filter(|&n| n == 1 || n <= files.len()) {
            let d = layerstream_loader::measure_disk(&files, 512 << 20, n, buffered)
                .with_context(|| format!("measuring the disk under {}", store.dir.display()))?;
            by_reads.push((n, d.gbps));
            if n <= layerstream_loader::DEFAULT_PREFETCH_DEPTH + 1 {
                disk = Some(d);
            }
        }
        Ok((by_reads, disk.expect("one read at a time is always measured")))
    };
    // Where O_DIRECT is refused the first curve was read through the page cache already.
    let (mut by_reads, mut disk) = curve(false)?;
    let mut buffered_reads = false;
    if disk.direct {
        let buffered = curve(true)?;
        if buffered_pays(&by_reads, &buffered.0) {
            ((by_reads, disk), buffered_reads) = (buffered, true);
        }
    }
    device.apply_threads()?;
    let dev = layerstream_worker::Device::open(&device.compute.device)?;
    let kv = layerstream_model::DType::F32;
    let layer = (cfg.num_layers / 2) as u32;
    let precision = device.compute.precision();
    let probe = layerstream_worker::Probe { layer, rows: &ROWS, kv_dtype: kv, reps: 2, precision };
    let c = layerstream_worker::measure_compute(&dev, store, &probe)
        .context("measuring a layer's compute")?;
    Ok(Figures {
        disk_gbps: disk.gbps,
        disk_by_reads: by_reads,
        buffered_reads,
        disk_latency_ms: disk.latency_ms,
        link_gbps: layerstream_worker::measure_link(&dev, 256 << 20)?,
        layer_s: c.layer_s,
        head_s: c.head_s,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Figures are measured once, then read back while the key holds; `--recalibrate` measures
    /// again; a different store is a different key.
    #[test]
    fn figures_are_cached_per_store_and_remeasured_on_request() {
        let dir = tempfile::tempdir().unwrap();
        let cache = dir.path().join("cache");
        std::env::set_var("LAYERSTREAM_CACHE", &cache);
        let synth = |name: &str, seed| {
            let d = dir.path().join(name);
            layerstream_model::synth::synth(
                "tiny",
                layerstream_model::DType::Q8_0,
                Some(4),
                seed,
                &d,
            )
            .unwrap();
            Store::open(&d).unwrap()
        };
        let (a, b) = (synth("a", 1), synth("b", 2));
        let dev = DeviceFlags {
            compute: layerstream_worker::ComputeFlags {
                device: "cpu".into(),
                threads: None,
                int8_activations: false,
                exact: false,
            },
            memory_budget: None,
            concurrent_threads: None,
            link_gbps: None,
        };
        let (f, cached) = figures(&a, &dev, false).unwrap();
        assert!(!cached && f.disk_gbps > 0.0 && f.link_gbps.is_none());
        // Four layer files: the disk at 1, 2, 3 and 4 reads in flight.
        assert_eq!(f.disk_by_reads.iter().map(|p| p.0).collect::<Vec<_>>(), [1, 2, 3, 4]);
        assert!(f.disk_by_reads.iter().all(|p| p.1 > 0.0));
        assert_eq!(f.layer_s.iter().map(|p| p.0).collect::<Vec<_>>(), ROWS);
        let (again, cached) = figures(&a, &dev, false).unwrap();
        // JSON keeps a float to within its last bit (serde_json without float_roundtrip).
        let close = |x: f64, y: f64| (x - y).abs() <= 1e-12 * x.abs().max(y.abs());
        let pairs = |p: &[(usize, f64)], q: &[(usize, f64)]| {
            p.len() == q.len() && p.iter().zip(q).all(|(a, b)| a.0 == b.0 && close(a.1, b.1))
        };
        assert!(cached, "read back from the cache");
        assert!(close(again.disk_gbps, f.disk_gbps) && pairs(&again.layer_s, &f.layer_s));
        assert!(pairs(&again.head_s, &f.head_s) && again.link_gbps == f.link_gbps);
        assert!(!figures(&a, &dev, true).unwrap().1, "--recalibrate measures again");
        assert!(!figures(&b, &dev, false).unwrap().1, "another store, another key");
        assert_ne!(key(&a, &dev), key(&b, &dev));
        assert_eq!(std::fs::read_dir(cache.join("calibration")).unwrap().count(), 2);
    }
}
