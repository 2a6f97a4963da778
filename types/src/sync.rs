//! Locks that outlive a panic: a thread that panics while holding a mutex poisons it, and
//! `lock().unwrap()` would then panic every later caller — one failed request taking the rest of
//! a process down. The state a guard protects here is left consistent between statements, so the
//! next caller takes the lock as it was.

use std::sync::{Mutex, MutexGuard, PoisonError};

/// Locks `m`, poisoned or not.
pub fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_panic_while_locked_does_not_stop_the_next_caller() {
        let m = std::sync::Arc::new(Mutex::new(1));
        let m2 = m.clone();
        let r = std::thread::spawn(move || {
            let _g = m2.lock().unwrap();
            panic!("while holding the lock");
        })
        .join();
        assert!(r.is_err() && m.is_poisoned());
        *lock(&m) += 1;
        assert_eq!(*lock(&m), 2);
    }
}
