//! Streaming buffers and pinned host memory for the CUDA backend.
//!
//! `configure` allocates N device buffers once; `upload` leases a free one, makes the copy stream wait
//! for the compute work that last read it (its `released` event), copies the layer on the copy stream
//! timed by events, and waits for the copy so the loader slot can be released. Dropping the lease (when
//! the layer's weights are dropped after its compute was queued) records `released` on the compute
//! stream and returns the buffer: no allocation per layer, and no overwrite before the reads finish.
//! Loader slot mappings are registered once with cuMemHostRegister so copies run at pinned speed.

use super::driver::{derr, DevBuf, Event, Gpu};
use crate::error::{Error, Result};
use cudarc::driver::{result, sys};
use layerstream_types::sync::lock;
use std::collections::HashMap;
use std::sync::{Arc, Condvar, Mutex};

struct Buf {
    dev: DevBuf,
    released: Event,
    generation: u64,
}

#[derive(Default)]
struct State {
    free: Vec<Buf>,
    count: usize,
    generation: u64,
}

/// Host ranges registered with the driver: start → (length, registered).
type Registered = HashMap<usize, (usize, bool)>;

/// The streaming buffers and registered host memory of one backend.
pub struct StreamPool {
    gpu: Arc<Gpu>,
    state: Mutex<State>,
    cv: Condvar,
    registered: Mutex<Registered>,
}

/// A streaming buffer holding one layer until the last weight viewing it is dropped.
pub struct Lease {
    buf: Option<Buf>,
    len: usize,
    pool: Arc<StreamPoolRef>,
}

/// What a lease needs to give its buffer back.
pub struct StreamPoolRef(std::sync::Weak<StreamPool>, Arc<Gpu>);

impl Lease {
    /// Device address of the layer's bytes.
    pub fn ptr(&self) -> u64 {
        self.buf.as_ref().map_or(0, |b| b.dev.ptr)
    }

    /// Bytes of the layer.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the layer is empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

impl Drop for Lease {
    fn drop(&mut self) {
        let Some(buf) = self.buf.take() else { return };
        let _ = self.pool.1.bind();
        // Everything that reads this buffer was queued on the compute stream before this drop.
        if buf.released.record(self.pool.1.compute).is_err() {
            let _ = self.pool.1.sync_compute();
        }
        if let Some(pool) = self.pool.0.upgrade() {
            let mut st = lock(&pool.state);
            if st.generation == buf.generation {
                st.free.push(buf);
            }
            drop(st);
            pool.cv.notify_all();
        }
    }
}

impl StreamPool {
    /// An empty pool on `gpu`.
    pub fn new(gpu: Arc<Gpu>) -> StreamPool {
        StreamPool {
            gpu,
            state: Mutex::new(State::default()),
            cv: Condvar::new(),
            registered: Mutex::new(HashMap::new()),
        }
    }

    /// Replaces the buffers with `count` buffers of `bytes` each.
    pub fn configure(&self, count: usize, bytes: usize) -> Result<()> {
        let mut st = lock(&self.state);
        st.generation += 1;
        st.free.clear();
        st.count = 0;
        for _ in 0..count {
            let dev = DevBuf::plain(&self.gpu, bytes)?;
            let released = Event::new(&self.gpu, false)?;
            let generation = st.generation;
            st.free.push(Buf { dev, released, generation });
            st.count += 1;
        }
        Ok(())
    }

    /// Copies `bytes` host→device on the copy stream into `dst` and waits for it; returns the
    /// event-timed milliseconds of the copy.
    pub fn copy_in(&self, dst: u64, bytes: &[u8]) -> Result<f64> {
        let g = &self.gpu;
        g.bind()?;
        let (t0, t1) = (Event::new(g, true)?, Event::new(g, true)?);
        t0.record(g.copy)?;
        if !bytes.is_empty() {
            // SAFETY: `dst` has room for `bytes`; the host memory stays alive and unchanged until the
            // copy completes, which `t1.elapsed_ms` waits for before returning.
            unsafe { result::memcpy_htod_async(dst, bytes, g.copy) }
                .map_err(derr("host→device copy"))?;
        }
        t1.record(g.copy)?;
        t0.elapsed_ms(&t1)
    }

    /// Leases a free buffer (waiting for one) and copies a layer into it.
    pub fn upload(self: &Arc<Self>, bytes: &[u8]) -> Result<(Lease, f64)> {
        let buf = {
            let mut st = lock(&self.state);
            if st.count == 0 {
                return Err(Error::Device(
                    "no streaming buffers: stream_buffers was not called".into(),
                ));
            }
            loop {
                if let Some(b) = st.free.pop() {
                    break b;
                }
                st = self.cv.wait(st).unwrap_or_else(std::sync::PoisonError::into_inner);
            }
        };
        let lease = Lease {
            len: bytes.len(),
            buf: Some(buf),
            pool: Arc::new(StreamPoolRef(Arc::downgrade(self), self.gpu.clone())),
        };
        let b = lease.buf.as_ref().expect("just leased");
        if bytes.len() > b.dev.bytes {
            return Err(Error::Device(format!(
                "a {}-byte layer does not fit a {}-byte streaming buffer",
                bytes.len(),
                b.dev.bytes
            )));
        }
        self.gpu.bind()?;
        b.released.wait_on(self.gpu.copy)?;
        let ms = self.copy_in(b.dev.ptr, bytes)?;
        Ok((lease, ms))
    }

    /// Registers `bytes` (a whole slot mapping) as pinned memory, once. A mapping the driver refuses
    /// is remembered and copied from as pageable memory, with one notice on stderr.
    pub fn register(&self, bytes: &[u8]) -> Result<()> {
        let key = bytes.as_ptr() as usize;
        let mut reg = lock(&self.registered);
        if reg.get(&key).is_some_and(|(len, _)| *len == bytes.len()) || bytes.is_empty() {
            return Ok(());
        }
        self.gpu.bind()?;
        let try_flags = |flags: u32| {
            // SAFETY: `bytes` is a live mapping that stays mapped until `unregister` is called for it.
            unsafe { sys::cuMemHostRegister_v2(bytes.as_ptr() as *mut _, bytes.len(), flags) }
        };
        // Slots are mapped read-only in workers: ask for a read-only registration first.
        let mut r = try_flags(sys::CU_MEMHOSTREGISTER_READ_ONLY);
        if r != sys::CUresult::CUDA_SUCCESS {
            r = try_flags(0);
        }
        let ok = r == sys::CUresult::CUDA_SUCCESS;
        if !ok {
            eprintln!("layerstream: cuMemHostRegister of a {}-byte loader slot failed ({r:?}); copies from it use pageable memory", bytes.len());
        }
        reg.insert(key, (bytes.len(), ok));
        Ok(())
    }

    /// Unregisters a mapping registered with `register`.
    pub fn unregister(&self, bytes: &[u8]) {
        let key = bytes.as_ptr() as usize;
        if let Some((_, true)) = lock(&self.registered).remove(&key) {
            let _ = self.gpu.bind();
            // SAFETY: the pointer was registered by `register` and is still mapped.
            unsafe { sys::cuMemHostUnregister(key as *mut _) };
        }
    }

    /// Bytes of host memory currently registered.
    pub fn registered_bytes(&self) -> usize {
        lock(&self.registered).values().filter(|(_, ok)| *ok).map(|(len, _)| len).sum()
    }
}

impl Drop for StreamPool {
    fn drop(&mut self) {
        let _ = self.gpu.bind();
        for (key, (_, ok)) in lock(&self.registered).drain() {
            if ok {
                // SAFETY: registered by `register`; unregistering an address no longer mapped only
                // returns an error, which is ignored.
                unsafe { sys::cuMemHostUnregister(key as *mut _) };
            }
        }
    }
}
