//! How a child process ended, in words a user can act on: its exit code or the signal that killed
//! it, and for SIGKILL under a memory limit, the memory cgroup's limit and peak as the memory
//! ledger reads them (the kernel's OOM killer sends SIGKILL and says nothing else). Never a bare
//! "(None)".

use layerstream_model::mem::gib;
use std::os::unix::process::ExitStatusExt;
use std::process::ExitStatus;

/// "exited with code 1", "was killed by SIGBUS (signal 7)", "was killed by SIGKILL (signal 9) —
/// the memory cgroup's limit is 3.5 GiB and its peak 3.5 GiB: out of memory?".
pub fn describe(status: ExitStatus) -> String {
    describe_with(status, memory_cgroup())
}

/// `describe` given the memory cgroup's (limit, peak) bytes, when known.
fn describe_with(status: ExitStatus, memory: Option<(u64, u64)>) -> String {
    if let Some(code) = status.code() {
        return format!("exited with code {code}");
    }
    let Some(sig) = status.signal() else { return format!("ended ({status})") };
    let mut s = format!("was killed by {} (signal {sig})", signal_name(sig));
    if sig == libc::SIGKILL {
        if let Some((limit, peak)) = memory {
            s.push_str(&format!(
                " — the memory cgroup's limit is {} and its peak {}{}",
                gib(limit),
                gib(peak),
                if peak * 100 >= limit * 95 { ": out of memory?" } else { "" }
            ));
        }
    }
    if sig == libc::SIGBUS {
        s.push_str(" — a shared-memory region could not be backed: is /dev/shm full?");
    }
    s
}

fn signal_name(sig: i32) -> &'static str {
    match sig {
        libc::SIGKILL => "SIGKILL",
        libc::SIGTERM => "SIGTERM",
        libc::SIGINT => "SIGINT",
        libc::SIGSEGV => "SIGSEGV",
        libc::SIGBUS => "SIGBUS",
        libc::SIGABRT => "SIGABRT",
        libc::SIGILL => "SIGILL",
        libc::SIGFPE => "SIGFPE",
        _ => "a signal",
    }
}

/// This process's memory cgroup limit and peak usage (its usage now where the kernel keeps no
/// peak), as the memory ledger reads them; None without a finite limit.
fn memory_cgroup() -> Option<(u64, u64)> {
    let c = layerstream_model::mem::Ledger::read().cgroup?;
    Some((c.limit, c.peak.unwrap_or(c.usage)))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn killed(sig: i32) -> ExitStatus {
        ExitStatus::from_raw(sig)
    }

    #[test]
    fn deaths_are_named() {
        assert_eq!(describe_with(ExitStatus::from_raw(3 << 8), None), "exited with code 3");
        let oom = describe_with(killed(9), Some((3584 << 20, 3580 << 20)));
        assert_eq!(
            oom,
            "was killed by SIGKILL (signal 9) — the memory cgroup's limit is 3.50 GiB and its peak 3.50 GiB: out of memory?"
        );
        let not_oom = describe_with(killed(9), Some((4 << 30, 1 << 30)));
        assert!(!not_oom.contains("out of memory"), "{not_oom}");
        assert_eq!(describe_with(killed(9), None), "was killed by SIGKILL (signal 9)");
        assert!(describe_with(killed(7), None).contains("/dev/shm"));
    }
}
