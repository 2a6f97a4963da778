//! How many threads the CPU kernels use: every core by default; `--threads N` (worker, `up`, `run`,
//! `bench`) sets the process's compute pool once at start, e.g. to compare with a peer at the same
//! thread count; a worker's `--concurrent-threads` adds a second pool (`ComputePool`) for the steps
//! it runs while the other workers of its pipeline compute too, so workers sharing a host keep to
//! their share of the cores only then.

use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

/// How long a pool thread with nothing to do during a step spins before yielding its core to other
/// threads, and before leaving the step to sleep as usual (`in_pool`).
const SPIN_IDLE: Duration = Duration::from_micros(50);
const YIELD_IDLE: Duration = Duration::from_millis(2);

/// Sets the compute pool of this process to `n` threads (call before any kernel runs). Fails if
/// `n` is 0 or the pool was already started.
pub fn set_cpu_threads(n: usize) -> crate::Result<()> {
    if n == 0 {
        return Err(crate::Error::Device("--threads must be at least 1".into()));
    }
    rayon::ThreadPoolBuilder::new()
        .num_threads(n)
        .thread_name(|i| format!("layerstream-cpu-{i}"))
        .build_global()
        .map_err(|e| crate::Error::Device(format!("setting {n} compute threads: {e}")))
}

/// A second compute pool, for the steps a worker runs while every other worker of its pipeline
/// computes too (micro-batches in flight): its share of a host it shares.
pub struct ComputePool(rayon::ThreadPool);

impl ComputePool {
    /// A pool of `n` threads (at least 1).
    pub fn new(n: usize) -> crate::Result<Self> {
        rayon::ThreadPoolBuilder::new()
            .num_threads(n.max(1))
            .thread_name(|i| format!("layerstream-cpu-shared-{i}"))
            .build()
            .map(ComputePool)
            .map_err(|e| crate::Error::Device(format!("starting {n} compute threads: {e}")))
    }

    /// Runs `f` with every kernel inside it on this pool's threads.
    pub fn run<R: Send>(&self, f: impl FnOnce() -> R + Send) -> R {
        self.0.install(f)
    }
}

/// Runs `f` on a thread of the current compute pool (on the caller when it is one already), so the
/// kernels inside split their work from a pool thread: each split is then a push onto that thread's
/// own queue, where from outside the pool every split is a cross-thread hand-off and a sleep. While
/// `f` runs, the pool's other threads stay awake looking for its splits (as llama.cpp's threads spin
/// through a graph) instead of going to sleep between kernels: a decode step's ~250 splits each
/// woke a sleeping thread first, and on a 2-vCPU VM that made 2 threads only 1.3-1.7× one
/// (benchmarks/vs-llama-cpp-cpu-2core.md).
pub fn in_pool<R: Send>(f: impl FnOnce() -> R + Send) -> R {
    let done = &AtomicBool::new(false);
    rayon::scope(|s| {
        let me = rayon::current_thread_index();
        for _ in 1..rayon::current_num_threads() {
            s.spawn(move |_| {
                // The step's own thread may take one of these while it waits: it must not spin
                // there (the step could not finish), so it leaves at once.
                if rayon::current_thread_index() == me {
                    return;
                }
                let mut idle_since = None;
                while !done.load(Ordering::Acquire) {
                    if rayon::yield_now() == Some(rayon::Yield::Executed) {
                        idle_since = None;
                        continue;
                    }
                    // Idle: spin through the gaps between kernels; give the core to other
                    // threads after SPIN_IDLE, and leave after YIELD_IDLE (a step waiting for a
                    // streamed layer must not hold a core its loader needs).
                    let idle = idle_since.get_or_insert_with(Instant::now).elapsed();
                    if idle > YIELD_IDLE {
                        return;
                    }
                    if idle > SPIN_IDLE {
                        std::thread::yield_now();
                    } else {
                        std::hint::spin_loop();
                    }
                }
            });
        }
        let r = f();
        done.store(true, Ordering::Release);
        r
    })
}

/// Threads the CPU kernels use now (inside `ComputePool::run`: that pool's).
pub fn cpu_threads() -> usize {
    rayon::current_num_threads()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn zero_threads_is_refused() {
        assert!(set_cpu_threads(0).is_err());
    }

    #[test]
    fn a_compute_pool_runs_its_work_on_its_own_threads() {
        let pool = ComputePool::new(3).unwrap();
        assert_eq!(pool.run(cpu_threads), 3);
        let name = pool.run(|| std::thread::current().name().map(str::to_owned));
        assert!(name.unwrap_or_default().starts_with("layerstream-cpu-shared-"));
    }
}
