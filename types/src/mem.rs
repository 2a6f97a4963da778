//! The host's memory as this process may use it: the one ledger every default size is drawn from.
//! What the stack may use is the least of the kernel's MemAvailable and the memory cgroup's limit
//! less its usage at every level from this process's cgroup up (v2 `memory.max`/`memory.current`,
//! v1 `memory.limit_in_bytes`/`memory.usage_in_bytes`) — a compose service, a Kubernetes pod or a
//! systemd slice has a limit /proc/meminfo does not show — and, for shared-memory slots,
//! /dev/shm's free space. The readers take their roots as arguments so crafted trees test them.

use std::path::Path;

/// What the ledger read, each part when it could be read.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Ledger {
    /// The kernel's MemAvailable.
    pub mem_available: Option<u64>,
    /// The tightest memory cgroup level: its limit and usage (None: no finite limit).
    pub cgroup: Option<Cgroup>,
    /// Free bytes in /dev/shm.
    pub shm_free: Option<u64>,
}

/// One memory cgroup level's limit, usage (its working set) and, where the kernel keeps it, the
/// peak usage since the cgroup was made (what an OOM report names).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Cgroup {
    pub limit: u64,
    pub usage: u64,
    pub peak: Option<u64>,
}

impl Ledger {
    /// The ledger of this process now.
    pub fn read() -> Ledger {
        let cgroups = std::fs::read_to_string("/proc/self/cgroup").unwrap_or_default();
        Ledger {
            mem_available: meminfo("MemAvailable:"),
            cgroup: cgroup_headroom(&cgroups, Path::new("/sys/fs/cgroup")),
            shm_free: fs_free_bytes("/dev/shm"),
        }
    }

    /// Bytes the stack may use in memory: the least of MemAvailable and the cgroup's headroom (8 GiB
    /// when neither can be read).
    pub fn usable(&self) -> u64 {
        let room = self.cgroup.map(|c| c.limit.saturating_sub(c.usage));
        match (self.mem_available, room) {
            (Some(a), Some(r)) => a.min(r),
            (Some(a), None) => a,
            (None, Some(r)) => r,
            (None, None) => 8 << 30,
        }
    }

    /// Bytes shared-memory slots may take: `usable`, and no more than /dev/shm holds.
    pub fn shm_usable(&self) -> u64 {
        self.usable().min(self.shm_free.unwrap_or(u64::MAX))
    }

    /// One line for logs: each part and what is usable.
    pub fn describe(&self) -> String {
        let opt = |b: Option<u64>| b.map_or("unknown".into(), gib);
        let cg = self.cgroup.map_or("no limit".into(), |c| {
            format!("limit {} with {} in use", gib(c.limit), gib(c.usage))
        });
        format!(
            "MemAvailable {}, memory cgroup {cg}, /dev/shm free {}: {} usable",
            opt(self.mem_available),
            opt(self.shm_free),
            gib(self.usable())
        )
    }
}

/// The tightest finite memory limit on the cgroup path of `proc_self_cgroup` (the text of
/// /proc/self/cgroup) under `root` (normally /sys/fs/cgroup), from the process's cgroup up to the
/// root: v2 (`0::/path`, `memory.max` "max" or bytes, `memory.current`, `memory.peak`) or v1
/// (`N:…memory…:/path` under `root/memory`, `memory.limit_in_bytes`, where "no limit" is a number
/// near 2^63, `memory.usage_in_bytes`, `memory.max_usage_in_bytes`). The tightest level is the one with the least room.
pub fn cgroup_headroom(proc_self_cgroup: &str, root: &Path) -> Option<Cgroup> {
    let mut best: Option<Cgroup> = None;
    for line in proc_self_cgroup.lines() {
        let mut parts = line.splitn(3, ':');
        let (Some(_), Some(controllers), Some(path)) = (parts.next(), parts.next(), parts.next())
        else {
            continue;
        };
        let (dir, files) = if controllers.is_empty() {
            (root.to_path_buf(), ("memory.max", "memory.current", "memory.peak"))
        } else if controllers.split(',').any(|c| c == "memory") {
            (
                root.join("memory"),
                ("memory.limit_in_bytes", "memory.usage_in_bytes", "memory.max_usage_in_bytes"),
            )
        } else {
            continue;
        };
        let mut level = dir.join(path.trim_start_matches('/'));
        loop {
            if let Some(c) = read_level(&level, files) {
                if best.is_none_or(|b| {
                    c.limit.saturating_sub(c.usage) < b.limit.saturating_sub(b.usage)
                }) {
                    best = Some(c);
                }
            }
            if level == dir || !level.pop() {
                break;
            }
        }
    }
    best
}

/// One level's finite limit and usage (None: no such files, or no limit). Usage is the working
/// set, as the kubelet counts it: the page cache the kernel can drop at once (`inactive_file` in
/// `memory.stat`, v1 `total_inactive_file`) is not in use — a file read before, even by another
/// program in the same cgroup, must not make the stack think it has no room.
fn read_level(dir: &Path, (limit, usage, peak): (&str, &str, &str)) -> Option<Cgroup> {
    let text = std::fs::read_to_string(dir.join(limit)).ok()?;
    let limit: u64 = text.trim().parse().ok()?; // "max" does not parse: no limit
    if limit >= 1 << 60 {
        return None;
    }
    let usage: u64 = std::fs::read_to_string(dir.join(usage)).ok()?.trim().parse().ok()?;
    let stat = std::fs::read_to_string(dir.join("memory.stat")).unwrap_or_default();
    let inactive = stat
        .lines()
        .filter_map(|l| l.split_once(' '))
        .find(|(k, _)| *k == "total_inactive_file" || *k == "inactive_file")
        .and_then(|(_, v)| v.trim().parse::<u64>().ok())
        .unwrap_or(0);
    let peak = std::fs::read_to_string(dir.join(peak)).ok().and_then(|t| t.trim().parse().ok());
    Some(Cgroup { limit, usage: usage.saturating_sub(inactive), peak })
}

/// What the stack may use (`Ledger::read().usable()`).
pub fn host_available_bytes() -> u64 {
    Ledger::read().usable()
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

/// Free bytes of the filesystem at `path` (None when it cannot be asked).
pub fn fs_free_bytes(path: &str) -> Option<u64> {
    let c = std::ffi::CString::new(path).ok()?;
    // SAFETY: a zeroed statvfs buffer filled by statvfs on a valid NUL-terminated path.
    let mut st: libc::statvfs = unsafe { std::mem::zeroed() };
    // SAFETY: as above; st is a valid out-pointer.
    if unsafe { libc::statvfs(c.as_ptr(), &mut st) } != 0 {
        return None;
    }
    Some(st.f_bavail as u64 * st.f_frsize as u64)
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

/// `b` bytes as GiB with two decimals ("3.50 GiB"): how every memory figure is written.
pub fn gib(b: u64) -> String {
    format!("{:.2} GiB", b as f64 / (1u64 << 30) as f64)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn write(root: &Path, rel: &str, files: &[(&str, &str)]) {
        let d = root.join(rel);
        std::fs::create_dir_all(&d).unwrap();
        for (f, v) in files {
            std::fs::write(d.join(f), v).unwrap();
        }
    }

    #[test]
    fn v2_limits_are_read_up_the_hierarchy_and_max_is_no_limit() {
        let t = tempfile::tempdir().unwrap();
        let r = t.path();
        write(r, "", &[("memory.max", "max\n"), ("memory.current", "9000000000\n")]);
        write(r, "pod", &[("memory.max", "4294967296\n"), ("memory.current", "1073741824\n")]);
        write(r, "pod/ctr", &[("memory.max", "max\n"), ("memory.current", "536870912\n")]);
        let c = cgroup_headroom("0::/pod/ctr\n", r).unwrap();
        assert_eq!(
            c,
            Cgroup { limit: 4 << 30, usage: 1 << 30, peak: None },
            "the pod's limit binds"
        );
        // A tighter child wins.
        write(r, "pod/ctr", &[("memory.max", "1610612736\n"), ("memory.current", "536870912\n")]);
        let c = cgroup_headroom("0::/pod/ctr\n", r).unwrap();
        assert_eq!(c.limit - c.usage, 1 << 30);
        assert_eq!(cgroup_headroom("0::/\n", r), None, "the root: no finite limit");
        let l =
            Ledger { mem_available: Some(20 << 30), cgroup: Some(c), shm_free: Some(512 << 20) };
        assert_eq!(l.usable(), 1 << 30);
        assert_eq!(l.shm_usable(), 512 << 20);
        assert!(l.describe().contains("limit 1.50 GiB"), "{}", l.describe());
    }

    #[test]
    fn v1_limits_are_read_and_unlimited_is_a_huge_number() {
        let t = tempfile::tempdir().unwrap();
        let r = t.path();
        let none = "9223372036854771712\n";
        write(r, "memory", &[("memory.limit_in_bytes", none), ("memory.usage_in_bytes", "1\n")]);
        write(
            r,
            "memory/box",
            &[
                ("memory.limit_in_bytes", "3758096384\n"),
                ("memory.usage_in_bytes", "1178599424\n"),
                // 1 GiB of it is page cache the kernel can drop: not in use.
                ("memory.stat", "cache 1073741824\ntotal_inactive_file 1073741824\n"),
                ("memory.max_usage_in_bytes", "3145728000\n"),
            ],
        );
        let cg = "9:name=systemd:/\n4:memory:/box\n3:cpuset:/\n0::/\n";
        assert_eq!(
            cgroup_headroom(cg, r),
            Some(Cgroup { limit: 3584 << 20, usage: 100 << 20, peak: Some(3000 << 20) })
        );
        assert_eq!(cgroup_headroom("4:cpu,memory:/\n", r), None);
        assert_eq!(cgroup_headroom("garbage", r), None);
        let l =
            Ledger { mem_available: Some(1 << 30), cgroup: cgroup_headroom(cg, r), shm_free: None };
        assert_eq!(l.usable(), 1 << 30, "MemAvailable binds when it is smaller");
        let unknown = Ledger { mem_available: None, cgroup: None, shm_free: None };
        assert_eq!(unknown.usable(), 8 << 30);
    }
}
