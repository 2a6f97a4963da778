//! The host's memory as the kernel reports it: what worker budgets and the loader's RAM tier are
//! sized from.

/// The host's MemAvailable (from /proc/meminfo), or 8 GiB where it cannot be read.
pub fn host_available_bytes() -> u64 {
    std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|m| {
            m.lines()
                .find(|l| l.starts_with("MemAvailable:"))
                .and_then(|l| l.split_whitespace().nth(1)?.parse::<u64>().ok())
        })
        .map_or(8 << 30, |kib| kib << 10)
}
