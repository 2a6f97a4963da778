//! A thin layer over the CUDA driver for the backend: the context with its compute and copy streams,
//! the NVRTC-compiled kernel module, the cuBLAS handle, device buffers (stream-ordered for
//! activations, plain for weights and streaming buffers), events, and kernel launches.

use crate::cuda::source;
use crate::error::{Error, Result};
use cudarc::cublas;
use cudarc::driver::{result, sys, CudaContext, DriverError};
use std::collections::HashMap;
use std::ffi::{c_void, CString};
use std::sync::{Arc, Mutex};

/// Maps a driver error to ours, naming what failed.
pub fn derr(what: &'static str) -> impl Fn(DriverError) -> Error {
    move |e| Error::Device(format!("CUDA {what}: {e:?}"))
}

/// One device: context, streams, kernels, cuBLAS.
pub struct Gpu {
    pub ctx: Arc<CudaContext>,
    pub ordinal: usize,
    /// Compute capability, major × 10 + minor (90 for Hopper).
    pub sm: u32,
    /// Kernels, GEMMs, activations and KV caches.
    pub compute: sys::CUstream,
    /// Host→device weight copies.
    pub copy: sys::CUstream,
    module: sys::CUmodule,
    funcs: HashMap<String, sys::CUfunction>,
    pub blas: Mutex<cublas::sys::cublasHandle_t>,
}

// SAFETY: the raw handles are plain driver objects usable from any thread once the context is bound
// (every entry point calls `bind`); the cuBLAS handle, which is not thread-safe, sits behind a Mutex.
unsafe impl Send for Gpu {}
// SAFETY: as above; shared references only launch work or read immutable handles.
unsafe impl Sync for Gpu {}

impl Gpu {
    /// Opens device `ordinal`, compiles (or loads cached) kernels for its architecture, creates the
    /// streams and the cuBLAS handle.
    pub fn open(ordinal: usize) -> Result<Arc<Gpu>> {
        crate::cuda::open_device(ordinal)?;
        let ctx = CudaContext::new(ordinal).map_err(derr("creating the context"))?;
        ctx.bind_to_thread().map_err(derr("binding the context"))?;
        let (major, minor) =
            ctx.compute_capability().map_err(derr("reading the compute capability"))?;
        let ptx = source::compile(&format!("sm_{major}{minor}"))?;
        let image = CString::new(ptx).map_err(|_| Error::Device("PTX holds a NUL byte".into()))?;
        // SAFETY: `image` is a NUL-terminated PTX string that outlives the call.
        let module = unsafe { result::module::load_data(image.as_ptr() as *const c_void) }
            .map_err(derr("loading the kernel module"))?;
        let mut funcs = HashMap::new();
        for name in source::kernel_names() {
            let c = CString::new(name.clone()).expect("kernel names hold no NUL");
            // SAFETY: `module` was just loaded and is kept alive by this Gpu.
            let f = unsafe { result::module::get_function(module, c) }.map_err(|e| {
                Error::Device(format!("kernel {name} missing from the module: {e:?}"))
            })?;
            funcs.insert(name, f);
        }
        let compute = result::stream::create(result::stream::StreamKind::NonBlocking)
            .map_err(derr("creating the compute stream"))?;
        let copy = result::stream::create(result::stream::StreamKind::NonBlocking)
            .map_err(derr("creating the copy stream"))?;
        // Keep memory freed by stream-ordered frees in the pool for the next step instead of handing it
        // back to the driver at every synchronisation.
        // SAFETY: the device handle comes from the live context; the attribute takes a u64.
        unsafe {
            let pool = result::device::get_default_mem_pool(ctx.cu_device())
                .map_err(derr("getting the memory pool"))?;
            let mut threshold = u64::MAX;
            result::mem_pool::set_attribute(
                pool,
                sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD,
                &mut threshold as *mut u64 as *mut c_void,
            )
            .map_err(derr("setting the pool release threshold"))?;
        }
        // SAFETY: probes whether libcublas can be loaded (creating a handle panics when it cannot).
        if !unsafe { cublas::sys::is_culib_present() } {
            return Err(Error::Device("cuBLAS (libcublas.so) not found: add the CUDA toolkit's lib directory to LD_LIBRARY_PATH".into()));
        }
        let handle = cublas::result::create_handle()
            .map_err(|e| Error::Device(format!("cuBLAS handle: {e:?}")))?;
        // SAFETY: the handle and the stream were just created on this context.
        unsafe { cublas::result::set_stream(handle, compute as _) }
            .map_err(|e| Error::Device(format!("cuBLAS stream: {e:?}")))?;
        Ok(Arc::new(Gpu {
            ctx,
            ordinal,
            sm: (major * 10 + minor) as u32,
            compute,
            copy,
            module,
            funcs,
            blas: Mutex::new(handle),
        }))
    }

    /// Makes this device's context current on the calling thread.
    pub fn bind(&self) -> Result<()> {
        self.ctx.bind_to_thread().map_err(derr("binding the context"))
    }

    /// Launches kernel `name` on the compute stream. Each argument is passed as 8 bytes: pointers and
    /// 64-bit integers as they are, 32-bit ints and floats in the low half (the driver reads as many
    /// bytes as the parameter's type has; x86-64 and aarch64 are little-endian).
    pub fn launch(
        &self,
        name: &str,
        grid: (u32, u32, u32),
        block: u32,
        shared: u32,
        args: &[u64],
    ) -> Result<()> {
        let f = *self.funcs.get(name).ok_or_else(|| Error::Device(format!("no kernel {name}")))?;
        let mut vals = args.to_vec();
        let mut params: Vec<*mut c_void> =
            vals.iter_mut().map(|v| v as *mut u64 as *mut c_void).collect();
        // SAFETY: `f` comes from the loaded module; `params` points at one live 8-byte value per kernel
        // parameter, in order, and the driver copies them before returning.
        unsafe { result::launch_kernel(f, grid, (block, 1, 1), shared, self.compute, &mut params) }
            .map_err(|e| Error::Device(format!("launching {name}: {e:?}")))
    }

    /// Device memory `(free, total)` in bytes, as the driver reports it.
    pub fn mem_info(&self) -> Result<(usize, usize)> {
        self.bind()?;
        result::mem_get_info().map_err(derr("cuMemGetInfo"))
    }

    /// Waits for everything queued on the compute stream.
    pub fn sync_compute(&self) -> Result<()> {
        // SAFETY: the stream belongs to this live context.
        unsafe { result::stream::synchronize(self.compute) }
            .map_err(derr("synchronising the compute stream"))
    }
}

impl Drop for Gpu {
    fn drop(&mut self) {
        let _ = self.bind();
        // SAFETY: nothing else holds these handles: every buffer and event keeps the Gpu alive, so this
        // runs after all of them are gone.
        unsafe {
            let _ = result::stream::synchronize(self.compute);
            let _ = result::stream::synchronize(self.copy);
            let _ = cublas::result::destroy_handle(*layerstream_types::sync::lock(&self.blas));
            let _ = result::stream::destroy(self.compute);
            let _ = result::stream::destroy(self.copy);
            let _ = result::module::unload(self.module);
        }
    }
}

/// Converts a kernel argument to the 8-byte slot `Gpu::launch` takes.
pub fn i(v: i32) -> u64 {
    v as u32 as u64
}

/// A float kernel argument.
pub fn f(v: f32) -> u64 {
    v.to_bits() as u64
}

/// Device memory. Stream-ordered buffers (activations, KV caches) are allocated and freed on the
/// compute stream; the others (weights, streaming buffers) with plain cuMemAlloc/cuMemFree.
pub struct DevBuf {
    pub ptr: u64,
    pub bytes: usize,
    ordered: bool,
    gpu: Arc<Gpu>,
}

impl DevBuf {
    /// A stream-ordered buffer on the compute stream (contents undefined).
    pub fn ordered(gpu: &Arc<Gpu>, bytes: usize) -> Result<DevBuf> {
        let ptr = if bytes == 0 {
            0
        } else {
            // SAFETY: the stream is live; every use of this memory is on the compute stream.
            unsafe { result::malloc_async(gpu.compute, bytes) }.map_err(|e| {
                Error::Device(format!("allocating {bytes} bytes on the device: {e:?}"))
            })?
        };
        Ok(DevBuf { ptr, bytes, ordered: true, gpu: gpu.clone() })
    }

    /// A plain allocation (contents undefined).
    pub fn plain(gpu: &Arc<Gpu>, bytes: usize) -> Result<DevBuf> {
        gpu.bind()?;
        // SAFETY: allocation only; the memory is written before it is read.
        let ptr = if bytes == 0 {
            0
        } else {
            unsafe { result::malloc_sync(bytes) }.map_err(|e| {
                Error::Device(format!("allocating {bytes} bytes on the device: {e:?}"))
            })?
        };
        Ok(DevBuf { ptr, bytes, ordered: false, gpu: gpu.clone() })
    }
}

impl Drop for DevBuf {
    fn drop(&mut self) {
        if self.ptr == 0 {
            return;
        }
        let _ = self.gpu.bind();
        // SAFETY: the pointer came from the matching allocation call and is freed once. Ordered frees
        // run after the work already queued on the compute stream, which is the only stream using it;
        // plain frees synchronise the device.
        unsafe {
            if self.ordered {
                let _ = result::free_async(self.ptr, self.gpu.compute);
            } else {
                let _ = result::free_sync(self.ptr);
            }
        }
    }
}

/// A CUDA event (timing or ordering).
pub struct Event {
    ev: sys::CUevent,
    gpu: Arc<Gpu>,
}

// SAFETY: events are driver handles usable from any thread with the context bound.
unsafe impl Send for Event {}
// SAFETY: as above.
unsafe impl Sync for Event {}

impl Event {
    /// A new event; `timing` events can be measured with `elapsed_ms`.
    pub fn new(gpu: &Arc<Gpu>, timing: bool) -> Result<Event> {
        gpu.bind()?;
        let flags = if timing {
            sys::CUevent_flags::CU_EVENT_DEFAULT
        } else {
            sys::CUevent_flags::CU_EVENT_DISABLE_TIMING
        };
        let ev = result::event::create(flags).map_err(derr("creating an event"))?;
        Ok(Event { ev, gpu: gpu.clone() })
    }

    /// Records the event on `stream`.
    pub fn record(&self, stream: sys::CUstream) -> Result<()> {
        // SAFETY: event and stream belong to the live context.
        unsafe { result::event::record(self.ev, stream) }.map_err(derr("recording an event"))
    }

    /// Makes `stream` wait for this event's last recording (no-op if never recorded).
    pub fn wait_on(&self, stream: sys::CUstream) -> Result<()> {
        // SAFETY: event and stream belong to the live context.
        unsafe {
            result::stream::wait_event(
                stream,
                self.ev,
                sys::CUevent_wait_flags::CU_EVENT_WAIT_DEFAULT,
            )
        }
        .map_err(derr("waiting on an event"))
    }

    /// Blocks the host until the event completes.
    pub fn sync(&self) -> Result<()> {
        self.gpu.bind()?;
        // SAFETY: the event belongs to the live context.
        unsafe { result::event::synchronize(self.ev) }.map_err(derr("synchronising an event"))
    }

    /// Milliseconds from this event to `end` (both recorded; waits for `end`).
    pub fn elapsed_ms(&self, end: &Event) -> Result<f64> {
        end.sync()?;
        // SAFETY: both events were created with timing and recorded on this context.
        unsafe { result::event::elapsed(self.ev, end.ev) }
            .map(f64::from)
            .map_err(derr("reading event time"))
    }
}

impl Drop for Event {
    fn drop(&mut self) {
        let _ = self.gpu.bind();
        // SAFETY: the event is destroyed once; the driver defers destruction until it completes.
        unsafe {
            let _ = result::event::destroy(self.ev);
        }
    }
}
