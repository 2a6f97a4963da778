//! The activation estimate a GPU worker sizes its steps by (`plan::activation_bytes_per_token`)
//! against what a forward pass really holds. A counting allocator measures the CPU backend's peak
//! heap over one step: its tensors have the shapes the CUDA backend allocates, plus temporaries of
//! its own (transposed matmul outputs, dequantized rows), so the GPU's activations stay below it.

use layerstream_kernels::CpuBackend;
use layerstream_model::{synth, DType, Store};
use layerstream_serving::plan::activation_bytes_per_token;
use layerstream_worker::Model;
use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicUsize, Ordering};

static LIVE: AtomicUsize = AtomicUsize::new(0);
static PEAK: AtomicUsize = AtomicUsize::new(0);

struct Counting;

impl Counting {
    fn grew(by: usize) {
        let now = LIVE.fetch_add(by, Ordering::SeqCst) + by;
        PEAK.fetch_max(now, Ordering::SeqCst);
    }
}

// SAFETY: every call forwards to the system allocator unchanged; the counters only observe sizes.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, l: Layout) -> *mut u8 {
        // SAFETY: forwarded with the caller's layout.
        let p = unsafe { System.alloc(l) };
        if !p.is_null() {
            Self::grew(l.size());
        }
        p
    }
    unsafe fn dealloc(&self, p: *mut u8, l: Layout) {
        LIVE.fetch_sub(l.size(), Ordering::SeqCst);
        // SAFETY: `p` came from `alloc`/`realloc` with this layout.
        unsafe { System.dealloc(p, l) }
    }
    unsafe fn realloc(&self, p: *mut u8, l: Layout, new: usize) -> *mut u8 {
        // SAFETY: `p` came from this allocator with layout `l`.
        let q = unsafe { System.realloc(p, l, new) };
        if !q.is_null() {
            LIVE.fetch_sub(l.size(), Ordering::SeqCst);
            Self::grew(new);
        }
        q
    }
}

#[global_allocator]
static ALLOC: Counting = Counting;

/// Prefill steps of 64 and 200 tokens (the matvec-per-row path a GPU chunk mirrors) on SmolLM2 shapes:
/// the peak heap above what was live before stays within the estimate (plus the head's logits, which
/// the GPU's reserve covers separately) and above a quarter of it (the estimate is not loose).
#[test]
fn a_steps_peak_memory_stays_within_the_activation_estimate() {
    let dir = tempfile::tempdir().unwrap();
    synth::synth("smollm2-135m", DType::Q8_0, Some(2), 5, &dir.path().join("s")).unwrap();
    let store = Store::open(&dir.path().join("s")).unwrap();
    let model = Model::load(CpuBackend::default(), &store).unwrap();
    let cfg = &store.manifest.config;
    let per = activation_bytes_per_token(cfg) as usize;
    let logits = 4 * cfg.vocab_size * 4;
    for rows in [64usize, 200] {
        let ids: Vec<u32> = (0..rows as u32).map(|i| 1 + i * 37 % 1000).collect();
        let mut seq = model.new_sequence(); // KV is budgeted apart from activations
        let base = LIVE.load(Ordering::SeqCst);
        PEAK.store(base, Ordering::SeqCst);
        model.forward(&mut [(&ids[..], &mut seq)]).unwrap();
        let peak = PEAK.load(Ordering::SeqCst) - base;
        let est = per * rows;
        eprintln!("{rows} tokens: peak {peak} bytes, estimate {est} (+{logits} logits)");
        assert!(
            peak <= est + logits,
            "{rows} tokens: a step held {peak} bytes, over the estimate {est} + {logits}"
        );
        assert!(
            peak * 4 > est,
            "{rows} tokens: the estimate {est} is over 4× the real peak {peak}"
        );
    }
}
