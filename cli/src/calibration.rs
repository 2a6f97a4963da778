//! Calibration at start: the figures the cost model predicts from — the store's disk (GB/s read
//! O_DIRECT and through the page cache, the faster way kept, and a 4 KiB read's latency), the
//! host→device link where the worker copies, and one layer's and the head's compute at 1, 8 and 64
//! rows on the worker's device — measured once and cached per host and store under the cache root
//! (`calibration/<key>.json`). The key names everything that changes
//! the figures (host, CPU, cores, device, threads, precision, the store's files, the store's
//! filesystem, this build, how the figures are measured: `METHOD`); a changed key or
//! `--recalibrate` measures again.

use anyhow::{Context, Result};
use layerstream_coordinator::cost::{
    buffered_pays, read_cpu_share, Figures, ReadMode, READS_IN_FLIGHT,
};
use layerstream_model::layout::layer_file;
use layerstream_model::Store;
use layerstream_worker::DeviceFlags;
use serde::{Deserialize, Serialize};
use std::hash::{Hash, Hasher};
use std::path::PathBuf;

/// Row counts one layer's compute is measured at.
pub const ROWS: [usize; 3] = [1, 8, 64];

/// How the figures are measured, in the key: a cache written by an earlier way of measuring is
/// measured again rather than trusted. 1: the first five layer files re-read, the fastest of two
/// compute runs; 2: the store read cyclically (a VM host had cached those five files: 1.89 GB/s
/// calibrated where passes got 0.81); 3: each compute figure the median of 0.3 s of runs (the
/// fastest of two read an 8B layer at 8 rows 26 ms where passes took 38-44); 4: on the CPU each
/// compute run after the last-level cache was emptied of the layer (a qwen3-30b-a3b layer's routed
/// experts stayed in a 32 MiB L3 from run to run), and the head timed as a greedy step runs it
/// (a one-row head screens at 8 bits: 20 ms against the full f32 logits' 52 at that shape). Bump it
/// with any change to `measure` or what it calls.
pub const METHOD: u32 = 4;

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
    path_in(&layerstream_types::cache_dir(), key, "json")
}

/// The file under `root` for figures of `key`, ending `ext`.
pub fn path_in(root: &std::path::Path, key: &str, ext: &str) -> PathBuf {
    let mut h = std::collections::hash_map::DefaultHasher::new();
    key.hash(&mut h);
    root.join("calibration").join(format!("{:016x}.{ext}", h.finish()))
}

/// The figures for `store` on `device`: from the cache when its key matches and `recalibrate` is
/// off, else measured and cached (a cache that cannot be written is only a warning). Returns
/// whether they came from the cache.
pub fn figures(store: &Store, device: &DeviceFlags, recalibrate: bool) -> Result<(Figures, bool)> {
    let key = format!(
        "{} reads={:?} modes=direct,buffered,cpu,verify method={METHOD}",
        key(store, device),
        READS_IN_FLIGHT
    );
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
/// store has files for (two rounds of at most 512 MiB a count, two files a reader at least, as the
/// loader's read-ahead reads them, the files taken cyclically across every measurement), the link
/// (a GPU), the middle layer's and the head's compute.
fn measure(store: &Store, device: &DeviceFlags) -> Result<Figures> {
    let cfg = &store.manifest.config;
    let files: Vec<_> = (0..cfg.num_layers).map(|l| store.dir.join(layer_file(l))).collect();
    // Both ways the loader can read (O_DIRECT, the page cache): both kept for `plan` to choose
    // between with the cost model (`Figures::read_as`); the faster, by `buffered_pays`, named.
    // One cursor through the files for every measurement: the store read cyclically, as a pass
    // re-reads its disk tier, never the same few files over and over (`measure_disk`).
    let mut at = 0;
    let mut curve = |buffered: bool| -> Result<(ReadMode, layerstream_loader::DiskFigures)> {
        let (mut by_reads, mut disk, mut cpu) = (Vec::new(), None, Vec::new());
        for n in READS_IN_FLIGHT.into_iter().filter(|&n| n == 1 || n <= files.len()) {
            let d = layerstream_loader::measure_disk(&files, at, 512 << 20, n, buffered)
                .with_context(|| format!("measuring the disk under {}", store.dir.display()))?;
            at = d.next;
            by_reads.push((n, d.gbps));
            cpu.push(d.cpu_s_per_gb);
            if n <= layerstream_loader::DEFAULT_PREFETCH_DEPTH + 1 {
                disk = Some(d);
            }
        }
        let disk = disk.expect("one read at a time is always measured");
        // The median over the counts: one count's figure moves with what else the host ran.
        cpu.sort_by(f64::total_cmp);
        let mode = ReadMode { buffered: !disk.direct, by_reads, cpu_s_per_gb: cpu[cpu.len() / 2] };
        Ok((mode, disk))
    };
    // Where O_DIRECT is refused the first curve was read through the page cache already.
    let (first, mut disk) = curve(false)?;
    let mut modes = vec![first];
    if disk.direct {
        let (buffered, d) = curve(true)?;
        if buffered_pays(&modes[0].by_reads, &buffered.by_reads) {
            disk = d;
        }
        modes.push(buffered);
    }
    let chosen = modes.iter().find(|m| m.buffered != disk.direct).expect("measured").clone();
    device.apply_threads()?;
    let dev = layerstream_worker::Device::open(&device.compute.device)?;
    let kv = layerstream_model::DType::F32;
    let layer = (cfg.num_layers / 2) as u32;
    let precision = device.compute.precision();
    let probe = layerstream_worker::Probe { layer, rows: &ROWS, kv_dtype: kv, reps: 2, precision };
    let c = layerstream_worker::measure_compute(&dev, store, &probe)
        .context("measuring a layer's compute")?;
    let link_gbps = layerstream_worker::measure_link(&dev, 256 << 20)?;
    let verify_cpu_s_per_gb = measure_verify(&files[layer as usize])?;
    // A CPU worker's compute shares the cores with the loader's reader threads.
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let share = if link_gbps.is_none() {
        read_cpu_share(layerstream_kernels::cpu::threads::cpu_threads(), cores)
    } else {
        0.0
    };
    Ok(Figures {
        disk_gbps: disk.gbps,
        disk_by_reads: chosen.by_reads,
        buffered_reads: chosen.buffered,
        disk_latency_ms: disk.latency_ms,
        link_gbps,
        layer_s: c.layer_s,
        head_s: c.head_s,
        read_cpu_s_per_gb: chosen.cpu_s_per_gb,
        read_cpu_share: share,
        read_modes: modes,
        verify_cpu_s_per_gb,
    })
}

/// CPU seconds per GB of the check the loader makes of every layer it reads (xxh3 over the file,
/// `layerstream_model::checksum`), timed over `file` in memory, the faster of two.
fn measure_verify(file: &std::path::Path) -> Result<f64> {
    let bytes = std::fs::read(file).with_context(|| format!("reading {}", file.display()))?;
    let mut best = f64::INFINITY;
    for _ in 0..2 {
        let t = std::time::Instant::now();
        std::hint::black_box(layerstream_model::store::checksum(std::hint::black_box(&bytes)));
        best = best.min(t.elapsed().as_secs_f64());
    }
    Ok(best / (bytes.len().max(1) as f64 / 1e9))
}

/// A tiny synthetic store of four layers under `dir`/`name` (tests).
#[cfg(test)]
pub(crate) fn tiny_store(dir: &std::path::Path, name: &str, seed: u64) -> Store {
    let d = dir.join(name);
    layerstream_model::synth::synth("tiny", layerstream_model::DType::Q8_0, Some(4), seed, &d)
        .unwrap();
    Store::open(&d).unwrap()
}

/// The CPU device with default flags (tests).
#[cfg(test)]
pub(crate) fn cpu_device() -> DeviceFlags {
    DeviceFlags {
        compute: layerstream_worker::ComputeFlags {
            device: "cpu".into(),
            threads: None,
            int8_activations: false,
            exact: false,
        },
        memory_budget: None,
        concurrent_threads: None,
        link_gbps: None,
    }
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
        let (a, b) = (tiny_store(dir.path(), "a", 1), tiny_store(dir.path(), "b", 2));
        let dev = cpu_device();
        let (f, cached) = figures(&a, &dev, false).unwrap();
        assert!(!cached && f.disk_gbps > 0.0 && f.link_gbps.is_none());
        // Four layer files: the disk at 1, 2, 3 and 4 reads in flight.
        assert_eq!(f.disk_by_reads.iter().map(|p| p.0).collect::<Vec<_>>(), [1, 2, 3, 4]);
        assert!(f.disk_by_reads.iter().all(|p| p.1 > 0.0));
        // Every way of reading that works here kept for `plan` to choose from, the chosen one
        // among them; what reading and checking cost the CPU measured (the check hashes every
        // byte: never free).
        let chosen = f.read_modes.iter().find(|m| m.buffered == f.buffered_reads).unwrap();
        assert_eq!(
            (chosen.cpu_s_per_gb, &chosen.by_reads),
            (f.read_cpu_s_per_gb, &f.disk_by_reads)
        );
        assert!(f.read_modes.iter().all(|m| m.cpu_s_per_gb >= 0.0) && f.verify_cpu_s_per_gb > 0.0);
        assert!((0.0..=1.0).contains(&f.read_cpu_share));
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
        // A cache file of an earlier way of measuring (its key names another method) is not
        // trusted: measured again, and the new figures cached beside it.
        let path = std::fs::read_dir(cache.join("calibration"))
            .unwrap()
            .map(|e| e.unwrap().path())
            .find(|p| {
                let c: Cached = serde_json::from_slice(&std::fs::read(p).unwrap()).unwrap();
                c.key.starts_with(&key(&a, &dev))
            })
            .unwrap();
        let mut c: Cached = serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap();
        assert!(c.key.ends_with(&format!(" method={METHOD}")), "{}", c.key);
        c.key = c.key.replace(&format!("method={METHOD}"), &format!("method={}", METHOD - 1));
        let old = path_for(&c.key);
        std::fs::write(&old, serde_json::to_vec(&c).unwrap()).unwrap();
        std::fs::remove_file(&path).unwrap();
        assert!(!figures(&a, &dev, false).unwrap().1, "an earlier method's figures measured again");
        assert!(figures(&a, &dev, false).unwrap().1, "and this method's cached");
    }
}
