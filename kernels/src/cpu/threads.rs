//! How many threads the CPU kernels use: every core by default; `--threads N` (worker, `up`, `run`)
//! sets the process's compute pool once at start, so several CPU workers on one host each keep to
//! their share of the cores instead of all contending for every core.

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

/// The threads each of `workers` CPU workers on this host gets by default: the cores shared out, at
/// least one each.
pub fn share_of_cores(workers: usize) -> usize {
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    (cores / workers.max(1)).max(1)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cores_are_shared_out_at_least_one_each() {
        let cores = std::thread::available_parallelism().unwrap().get();
        assert_eq!(share_of_cores(1), cores);
        assert_eq!(share_of_cores(cores), 1);
        assert_eq!(share_of_cores(cores * 4), 1);
        assert!(set_cpu_threads(0).is_err());
    }
}
