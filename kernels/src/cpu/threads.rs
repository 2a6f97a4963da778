//! How many threads the CPU kernels use: every core by default; `--threads N` (worker, `up`, `run`,
//! `bench`) sets the process's compute pool once at start, e.g. so CPU workers sharing a host keep
//! to their share of the cores, or to compare with a peer at the same thread count.

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

/// Threads the CPU kernels use now.
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
}
