//! The host's memory as the kernel reports it: what worker budgets and the loader's RAM tier are
//! sized from.

/// The host's MemAvailable (from /proc/meminfo), or 8 GiB where it cannot be read.
pub fn host_available_bytes() -> u64 {
    meminfo("MemAvailable:").unwrap_or(8 << 30)
}

/// The host's MemTotal (from /proc/meminfo), if it can be read.
pub fn host_total_bytes() -> Option<u64> {
    meminfo("MemTotal:")
}

fn meminfo(key: &str) -> Option<u64> {
    let m = std::fs::read_to_string("/proc/meminfo").ok()?;
    let kib =
        m.lines().find(|l| l.starts_with(key))?.split_whitespace().nth(1)?.parse::<u64>().ok()?;
    Some(kib << 10)
}

/// Parses "123", "64K", "512M", "8G" (powers of 1024).
pub fn parse_bytes(s: &str) -> Result<u64, String> {
    let s = s.trim();
    let (num, mul) = match s.chars().last() {
        Some('K' | 'k') => (&s[..s.len() - 1], 1u64 << 10),
        Some('M' | 'm') => (&s[..s.len() - 1], 1 << 20),
        Some('G' | 'g') => (&s[..s.len() - 1], 1 << 30),
        _ => (s, 1),
    };
    num.trim()
        .parse::<f64>()
        .map(|v| (v * mul as f64) as u64)
        .map_err(|_| format!("{s:?} is not a byte size (e.g. 512M, 8G)"))
}
