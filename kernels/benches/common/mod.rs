//! What the kernel benchmarks share.

use std::time::Instant;

/// The fastest of five runs of `f`, in seconds.
pub fn best(mut f: impl FnMut()) -> f64 {
    (0..5)
        .map(|_| {
            let t = Instant::now();
            f();
            t.elapsed().as_secs_f64()
        })
        .fold(f64::MAX, f64::min)
}
