//! A layer file's bytes on the CPU device. Resident layers are copied in once; a streamed layer is
//! read where the loader put it — its shm slot, pinned while the blob lives — so streaming costs no
//! memcpy and no second copy in memory (the reusable streaming buffers this replaced each held one).

use std::sync::Arc;

/// A layer file's bytes on the CPU device: owned (a resident layer's copy), or mapped where they
/// lie (a streamed layer in its pinned loader slot).
#[derive(Debug)]
pub struct Blob {
    buf: Vec<u8>,
    mapped: Option<Arc<dyn crate::MappedBytes>>,
}

impl Blob {
    /// An owned copy of `bytes`.
    pub fn owned(bytes: &[u8]) -> Blob {
        Blob { buf: bytes.to_vec(), mapped: None }
    }

    /// `bytes` where they lie, kept (and their owner's hold on them) until this blob drops.
    pub fn mapped(bytes: Arc<dyn crate::MappedBytes>) -> Blob {
        Blob { buf: Vec::new(), mapped: Some(bytes) }
    }
}

impl std::ops::Deref for Blob {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        match &self.mapped {
            Some(m) => m.bytes(),
            None => &self.buf,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicBool, Ordering};

    #[derive(Debug)]
    struct Held(Vec<u8>, Arc<AtomicBool>);
    impl crate::MappedBytes for Held {
        fn bytes(&self) -> &[u8] {
            &self.0
        }
    }
    impl Drop for Held {
        fn drop(&mut self) {
            self.1.store(true, Ordering::SeqCst);
        }
    }

    /// A mapped blob reads its owner's bytes (no copy) and lets go of the owner when it drops; an
    /// owned one is a copy.
    #[test]
    fn mapped_blobs_read_in_place_and_release_their_owner() {
        let released = Arc::new(AtomicBool::new(false));
        let owner = Arc::new(Held(vec![1, 2, 3], released.clone()));
        let at = owner.0.as_ptr();
        let b = Blob::mapped(owner);
        assert_eq!((&b[..], b.as_ptr()), (&[1u8, 2, 3][..], at));
        assert!(!released.load(Ordering::SeqCst));
        drop(b);
        assert!(released.load(Ordering::SeqCst));
        assert_eq!(&Blob::owned(&[9, 8])[..], &[9, 8]);
    }
}
