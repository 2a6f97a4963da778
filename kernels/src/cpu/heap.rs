//! How a compute process's allocator treats a step's buffers. Each CPU matmul, attention and
//! activation of a step allocates its output afresh (megabytes at 512 rows); glibc's defaults map
//! the largest with `mmap` and give heap tops back to the kernel, so the next step faults the same
//! pages in again, zeroed — 8-10% of a 512-token SmolLM2 prefill went to page faults in `perf`.
//! Kept in the heap instead (buffers up to 32 MiB from the heap, freed tops of up to 64 MiB kept),
//! a step reuses the last step's pages. A step's peak memory does not change (the step's activation
//! share is budgeted as before); an idle process keeps at most what its largest step freed.

/// Buffers of up to this many bytes come from the heap (glibc's largest mmap threshold on 64-bit).
const FROM_HEAP_UP_TO: i32 = 32 << 20;

/// Freed memory at a heap's top is kept up to this many bytes.
const KEEP_FREED: i32 = 64 << 20;

/// Applies the policy above once per process (glibc only; elsewhere the allocator's own). Call
/// before the first step.
pub fn keep_step_buffers() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        #[cfg(all(target_os = "linux", target_env = "gnu"))]
        // SAFETY: mallopt only changes the allocator's thresholds; called once, with valid
        // parameters (a nonzero return is success, zero leaves glibc's defaults, which is safe).
        unsafe {
            libc::mallopt(libc::M_MMAP_THRESHOLD, FROM_HEAP_UP_TO);
            libc::mallopt(libc::M_TRIM_THRESHOLD, KEEP_FREED);
        };
    });
}

#[cfg(all(test, target_os = "linux", target_env = "gnu"))]
mod tests {
    use super::*;

    /// This thread's minor page faults so far.
    fn faults() -> i64 {
        let mut u = std::mem::MaybeUninit::<libc::rusage>::zeroed();
        // SAFETY: getrusage fills the struct it is given; RUSAGE_THREAD names the calling thread.
        unsafe {
            libc::getrusage(libc::RUSAGE_THREAD, u.as_mut_ptr());
            u.assume_init().ru_minflt
        }
    }

    /// A step-sized buffer freed and taken again is served from pages already in memory: a
    /// second 8 MiB buffer written whole faults in almost none of its 2048 pages (glibc's
    /// defaults map and unmap it, faulting every page in again, zeroed).
    #[test]
    fn a_freed_step_buffer_is_taken_again_without_page_faults() {
        keep_step_buffers();
        let fill = || std::hint::black_box(vec![1u8; 8 << 20]).len();
        fill();
        let before = faults();
        fill();
        let again = faults() - before;
        assert!(again < 256, "{again} page faults for a buffer the last step freed");
    }
}
