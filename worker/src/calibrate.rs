//! Calibration: one decoder layer's compute and the head's (as a greedy step runs it), measured on
//! a device at the row counts a cost model needs (1, 8 and 64 sequences decoding one token each),
//! on the real weights of a store, with the precision the worker would use. The layer is loaded as
//! a resident one; its KV cache holds one block per sequence. On the CPU every timed run starts
//! with the CPU's caches emptied of the layer (`Evict`), as in a pass, where every other layer ran
//! since. The figures feed `layerstream plan`'s prediction.

use crate::device::Device;
use crate::error::{Error, Result};
use crate::forward::{head_argmax, layer_forward, LayerCtx, SeqRows};
use crate::moe::ResidentExperts;
use crate::weights::{upload, LayerWeights};
use layerstream_kernels::{Backend, KvLayout};
use layerstream_model::layout::layer_file;
use layerstream_model::{DType, Store};
use std::time::Instant;

/// Seconds per call at each row count: one decoder layer's, and the head's (final norm, vocabulary
/// projection and each row's greedy token).
#[derive(Debug, Clone, PartialEq)]
pub struct ComputeFigures {
    pub layer_s: Vec<(usize, f64)>,
    pub head_s: Vec<(usize, f64)>,
}

/// What to measure: layer `layer` and the head at each of `rows` (sequences of one decode row
/// each; KV in `kv_dtype`), each figure the median of at least `reps` timed runs (more, up to
/// `MAX_REPS`, until `TIMED_S` seconds are timed) after one untimed.
#[derive(Debug, Clone, Copy)]
pub struct Probe<'a> {
    pub layer: u32,
    pub rows: &'a [usize],
    pub kv_dtype: DType,
    pub reps: usize,
    /// The layer's activations, as the stack computes them (`ComputeFlags::precision`).
    pub precision: layerstream_kernels::Precision,
}

/// Seconds each figure is timed over at least (more runs than `Probe::reps` where one is short),
/// and the most runs it takes. Each figure is the runs' median: a stack's passes run at a shared
/// machine's typical speed, and the fastest of a few runs caught a quiet moment — one calibration
/// of an 8B layer at 8 rows on a VM read 26 ms as the fastest of two where the model's passes took
/// 38 ms a layer, and 44 ms twenty minutes later.
const TIMED_S: f64 = 0.3;
const MAX_REPS: usize = 32;

/// Measures `probe` on `device` with `store`'s weights.
pub fn measure(device: &Device, store: &Store, probe: &Probe) -> Result<ComputeFigures> {
    match device {
        Device::Cpu(b) => {
            let usable = layerstream_types::mem::Ledger::read().usable();
            measure_on(b, store, probe, Some(Evict::new(llc_bytes(), usable)))
        }
        Device::Cuda(b) => measure_on(b, store, probe, None),
    }
}

/// A buffer touched line by line between a CPU figure's timed runs, so that each run reads the
/// layer from memory as a pass does (there, every other layer of the range ran since): run after
/// run, a mixture-of-experts layer's routed experts and attention (≈31 MB at the qwen3-30b-a3b
/// shape) stay in a 32 MiB last-level cache, and calibration timed them faster than any pass.
struct Evict {
    buf: Vec<u8>,
}

impl Evict {
    fn new(llc: Option<u64>, usable: u64) -> Evict {
        // Filled with ones, not zeros: zeroed pages would all map the kernel's one zero page.
        Evict { buf: vec![1; evict_bytes(llc, usable)] }
    }

    /// Reads a byte of every cache line: the cache then holds this buffer, not the layer (read,
    /// not written: the timed run does not write back dirty lines a pass would not have).
    fn run(&self) {
        let sum = (0..self.buf.len()).step_by(64).fold(0u8, |s, i| s ^ self.buf[i]);
        std::hint::black_box(sum);
    }
}

/// Bytes to touch to empty a last-level cache of `llc` bytes: twice it (its replacement is not
/// exact LRU), 64 MiB where the size is unknown, at most 1 GiB — and at most an eighth of the
/// `usable` memory (the ledger's, at least 1 MiB): a VM reporting a 260 MiB L3 asked for 520 MiB,
/// and a stack in a 448 MiB memory cgroup was killed while it calibrated. A buffer smaller than
/// the cache leaves part of the layer cached: the figure is then a little fast, not fatal.
fn evict_bytes(llc: Option<u64>, usable: u64) -> usize {
    let want = llc.map_or(64 << 20, |b| b.saturating_mul(2)).clamp(1 << 20, 1 << 30);
    want.min(usable / 8).max(1 << 20) as usize
}

/// A cache size as sysfs writes it (`32768K`, `1M`, `512`), in bytes.
fn parse_cache_size(s: &str) -> Option<u64> {
    let s = s.trim();
    let (n, unit) = match s.as_bytes().last()? {
        b'K' => (&s[..s.len() - 1], 1u64 << 10),
        b'M' => (&s[..s.len() - 1], 1 << 20),
        b'G' => (&s[..s.len() - 1], 1 << 30),
        _ => (s, 1),
    };
    n.parse::<u64>().ok()?.checked_mul(unit)
}

/// The size of CPU 0's highest-level cache, from sysfs (None where it is not there).
fn llc_bytes() -> Option<u64> {
    let dir = std::fs::read_dir("/sys/devices/system/cpu/cpu0/cache").ok()?;
    let read = |p: std::path::PathBuf| std::fs::read_to_string(p).ok();
    dir.flatten()
        .filter_map(|e| {
            let level: u32 = read(e.path().join("level"))?.trim().parse().ok()?;
            Some((level, parse_cache_size(&read(e.path().join("size"))?)?))
        })
        .max()
        .map(|(_, size)| size)
}

/// The pinned host→device link in GB/s: `bytes` registered with the device and copied twice, the
/// faster copy timed on the device where it can. None on the CPU (it computes from host memory).
pub fn measure_link(device: &Device, bytes: usize) -> Result<Option<f64>> {
    let Device::Cuda(b) = device else { return Ok(None) };
    let host = vec![1u8; bytes.max(1)];
    b.register_host(&host)?;
    let mut best = f64::INFINITY;
    for _ in 0..2 {
        let t = Instant::now();
        let (_blob, ms) = b.upload_blob(&host, false)?; // freed after the timing
        let secs = ms.map_or(t.elapsed().as_secs_f64(), |ms| ms / 1e3);
        best = best.min(secs);
    }
    b.unregister_host(&host);
    Ok(Some(host.len() as f64 / best.max(1e-9) / 1e9))
}

fn measure_on<B: Backend>(
    b: &B,
    store: &Store,
    probe: &Probe,
    evict: Option<Evict>,
) -> Result<ComputeFigures> {
    let Probe { layer, rows, kv_dtype, reps, precision } = *probe;
    let cfg = &store.manifest.config;
    if layer as usize >= cfg.num_layers {
        return Err(Error::invalid("layer", format!("the model has {} layers", cfg.num_layers)));
    }
    let ctx = LayerCtx::new(cfg).with_precision(precision);
    let w = LayerWeights::load(b, cfg, &store.load(&layer_file(layer as usize))?)?;
    let experts = ResidentExperts::load(b, store, layer..layer + 1)?;
    let head_file = if cfg.tie_word_embeddings { "embed.bin" } else { "lm_head.bin" };
    let head_name = if cfg.tie_word_embeddings { "embed" } else { "lm_head" };
    let missing = |f: &str, t: &str| Error::Weights(format!("{f}: missing tensor {t}"));
    let lm = upload(b, &store.load(head_file)?, head_name, None)?
        .ok_or_else(|| missing(head_file, head_name))?;
    let norm = upload(b, &store.load("final_norm.bin")?, "final_norm", None)?
        .ok_or_else(|| missing("final_norm.bin", "final_norm"))?;
    let most = rows.iter().copied().max().unwrap_or(1).max(1);
    let layout = KvLayout::new(kv_dtype, 16, most, ctx.shape)?;
    let mut pool = b.kv_cache(ctx.attn(layer).0, layout)?;
    let h = cfg.hidden_size;
    let (mut layer_s, mut head_s) = (Vec::new(), Vec::new());
    for &r in rows {
        let seqs: Vec<SeqRows> = (0..r.max(1))
            .map(|i| SeqRows {
                rows: 1,
                start_pos: 0,
                tree: None,
                tree_from: 0,
                blocks: vec![i as u32],
            })
            .collect();
        let x0: Vec<f32> = (0..seqs.len() * h).map(|i| ((i % 97) as f32 - 48.0) / 97.0).collect();
        let time = |f: &mut (dyn FnMut() -> Result<()> + Send)| -> Result<f64> {
            b.run_step(&mut *f)?; // untimed: first touches
            let mut took: Vec<f64> = Vec::new();
            while took.len() < reps.max(1)
                || (took.iter().sum::<f64>() < TIMED_S && took.len() < MAX_REPS)
            {
                if let Some(e) = &evict {
                    e.run();
                }
                let t = Instant::now();
                b.run_step(&mut *f)?;
                took.push(t.elapsed().as_secs_f64());
            }
            Ok(layerstream_types::stats::median(&mut took))
        };
        let mut x = b.from_host(&x0, seqs.len(), h)?;
        let l = time(&mut || {
            let mut ex = &experts;
            layer_forward(b, &ctx, layer, &w, &mut x, &seqs, &mut pool, &mut ex)?;
            b.to_host(&b.rows(&x, 0, 1)?)?; // waits for the device
            Ok(())
        })?;
        let mut x = b.from_host(&x0, seqs.len(), h)?;
        // Moved in whole: a tensor need only be Send.
        let (xr, c, sq, nm, lmr) = (&mut x, &ctx, &seqs, &norm, &lm);
        // As a greedy step takes it (temperature 0: `submit`'s and `bench`'s default): the
        // backend's argmax (on the CPU a one-row head screens at 8 bits — 20.5 ms where the full
        // f32 logits took 51.6 at the qwen3-30b-a3b shape).
        let hd = time(&mut move || {
            std::hint::black_box(head_argmax(b, c, &*xr, sq, nm, lmr)?);
            Ok(())
        })?;
        layer_s.push((seqs.len(), l));
        head_s.push((seqs.len(), hd));
    }
    Ok(ComputeFigures { layer_s, head_s })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The tiny model's layer and head are timed at each row count, and more rows take longer
    /// than one (64 rows do 64 times the multiply-adds).
    #[test]
    fn a_layer_and_the_head_are_timed_at_each_row_count() {
        let dir = tempfile::tempdir().unwrap();
        layerstream_model::synth::synth("tiny", DType::Q8_0, Some(64), 1, dir.path()).unwrap();
        let store = Store::open(dir.path()).unwrap();
        let dev = Device::open("cpu").unwrap();
        let probe = Probe {
            layer: 0,
            rows: &[1, 8, 64],
            kv_dtype: DType::F32,
            reps: 2,
            precision: layerstream_kernels::Precision::Int8,
        };
        let f = measure(&dev, &store, &probe).unwrap();
        let rows: Vec<usize> = f.layer_s.iter().map(|p| p.0).collect();
        assert_eq!(rows, [1, 8, 64]);
        assert!(f.layer_s.iter().chain(&f.head_s).all(|p| p.1 > 0.0 && p.1.is_finite()), "{f:?}");
        assert!(f.head_s[2].1 > f.head_s[0].1, "{f:?}");
        let e = measure(&dev, &store, &Probe { layer: 99, ..probe }).unwrap_err().to_string();
        assert!(e.contains("layer"), "{e}");
    }

    /// Cache sizes as sysfs writes them, and the bytes touched to empty such a cache.
    #[test]
    fn a_cache_size_is_read_and_twice_it_is_touched() {
        assert_eq!(parse_cache_size("32768K\n"), Some(32 << 20));
        assert_eq!(parse_cache_size("1M"), Some(1 << 20));
        assert_eq!(parse_cache_size("2G"), Some(2 << 30));
        assert_eq!(parse_cache_size("512"), Some(512));
        assert_eq!(parse_cache_size("K"), None);
        assert_eq!(parse_cache_size("lots"), None);
        assert_eq!(parse_cache_size(&format!("{}K", u64::MAX)), None);
        let lots = 64u64 << 30;
        assert_eq!(evict_bytes(Some(32 << 20), lots), 64 << 20);
        assert_eq!(evict_bytes(None, lots), 64 << 20);
        assert_eq!(evict_bytes(Some(4 << 30), lots), 1 << 30, "capped");
        assert_eq!(evict_bytes(Some(1), lots), 1 << 20, "at least a MiB");
        // A 260 MiB L3 in a 448 MiB cgroup: an eighth of what is usable, not 520 MiB.
        assert_eq!(evict_bytes(Some(260 << 20), 448 << 20), 56 << 20, "within the ledger");
        assert_eq!(evict_bytes(Some(260 << 20), 1 << 20), 1 << 20, "at least a MiB");
        // This machine's, where sysfs has it: a real size, at least its L1's 16 KiB.
        if let Some(b) = llc_bytes() {
            assert!(b >= 16 << 10, "{b}");
        }
    }
}
