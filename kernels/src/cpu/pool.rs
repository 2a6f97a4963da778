//! Streaming buffers of the CPU device: allocated and touched once (`Backend::stream_buffers`), lent
//! to streamed layer files and returned when the layer's weights drop. A fresh allocation per layer
//! page-faults on every 4 KiB of it, which made a CPU "transfer" run at ~1 GB/s instead of memcpy's
//! ~14 GB/s on the 2-core build machine.

use std::sync::{Arc, Mutex};

/// The idle buffers, at most `keep` of them.
#[derive(Debug, Default)]
pub struct Pool {
    idle: Mutex<(Vec<Vec<u8>>, usize)>,
}

impl Pool {
    /// Replaces the idle buffers with `count` buffers of `bytes` each, every page written once.
    pub fn fill(&self, count: usize, bytes: usize) {
        let fresh: Vec<Vec<u8>> = (0..count).map(|_| touched(bytes)).collect();
        *self.idle.lock().expect("pool lock") = (fresh, count);
    }

    /// A copy of `bytes` in an idle buffer (a plain new copy when none is idle or it is too small),
    /// returned here on drop.
    pub fn lend(self: &Arc<Self>, bytes: &[u8]) -> Blob {
        let idle = self.idle.lock().expect("pool lock").0.pop();
        let buf = match idle {
            Some(mut buf) if buf.len() >= bytes.len() => {
                buf[..bytes.len()].copy_from_slice(bytes);
                buf
            }
            _ => bytes.to_vec(),
        };
        Blob { buf, len: bytes.len(), home: Some(Arc::clone(self)) }
    }

    /// Idle buffers now.
    #[cfg(test)]
    fn idle(&self) -> usize {
        self.idle.lock().expect("pool lock").0.len()
    }
}

/// `bytes` bytes with every page written (so the copies into it do not fault).
fn touched(bytes: usize) -> Vec<u8> {
    let mut v = Vec::with_capacity(bytes);
    v.resize(bytes, 0xA5);
    v
}

/// A layer file's bytes on the CPU device: lent from a pool (streamed) or owned.
#[derive(Debug)]
pub struct Blob {
    buf: Vec<u8>,
    len: usize,
    home: Option<Arc<Pool>>,
}

impl Blob {
    /// An owned copy of `bytes`, not from any pool.
    pub fn owned(bytes: &[u8]) -> Blob {
        Blob { buf: bytes.to_vec(), len: bytes.len(), home: None }
    }
}

impl std::ops::Deref for Blob {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        &self.buf[..self.len]
    }
}

impl Drop for Blob {
    fn drop(&mut self) {
        if let Some(pool) = &self.home {
            let mut idle = pool.idle.lock().expect("pool lock");
            if idle.0.len() < idle.1 {
                idle.0.push(std::mem::take(&mut self.buf));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lent_buffers_come_back_and_are_reused_without_growing_the_pool() {
        let pool = Arc::new(Pool::default());
        pool.fill(2, 64);
        let (a, b) = (pool.lend(&[1; 10]), pool.lend(&[2; 64]));
        assert_eq!((&a[..], b.len(), pool.idle()), (&[1u8; 10][..], 64, 0));
        let a_ptr = a.buf.as_ptr();
        // A third lend while both are out gets a new buffer; returning three keeps two.
        let c = pool.lend(&[3; 100]);
        assert_eq!(&c[..], &[3u8; 100][..]);
        drop(a);
        assert_eq!(pool.idle(), 1);
        let d = pool.lend(&[4; 8]);
        assert_eq!(
            (d.buf.as_ptr(), &d[..]),
            (a_ptr, &[4u8; 8][..]),
            "the returned buffer is reused"
        );
        drop((b, c, d));
        assert_eq!(pool.idle(), 2);
        assert_eq!(&Blob::owned(&[9, 8])[..], &[9, 8]);
    }
}
