//! How many threads the CPU kernels use: every core by default; `--threads N` (worker, `up`, `run`,
//! `bench`) sets the process's compute pool once at start, e.g. to compare with a peer at the same
//! thread count; a worker's `--concurrent-threads` adds a second pool (`ComputePool`) for the steps
//! it runs while the other workers of its pipeline compute too, so workers sharing a host keep to
//! their share of the cores only then.

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
/// own queue, where from outside the pool every split is a cross-thread hand-off and a sleep.
pub fn in_pool<R: Send>(f: impl FnOnce() -> R + Send) -> R {
    rayon::scope(|_| f())
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
