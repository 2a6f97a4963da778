//! Host→device copy microbenchmark: pinned (cuMemHostAlloc), pageable, and pageable memory registered
//! in place with cuMemHostRegister (what workers do with loader shm slots), timed with CUDA events on
//! one stream. The pinned figure is the link's practical peak the streamed benchmarks compare with.

use crate::error::{Error, Result};

/// GB/s of each host memory kind for one copy size.
#[derive(Debug, Clone, PartialEq)]
pub struct H2dReport {
    pub bytes: usize,
    pub pinned_gbps: f64,
    pub pageable_gbps: f64,
    pub registered_gbps: f64,
}

#[cfg(feature = "cuda")]
/// Copies `bytes` to device `ordinal` `iters` times from each kind of host memory.
pub fn h2d_bench(ordinal: usize, bytes: usize, iters: usize) -> Result<H2dReport> {
    use cudarc::driver::{sys, CudaContext, CudaStream, DriverError};
    use std::sync::Arc;
    crate::cuda::open_device(ordinal)?;
    let err = |e: DriverError| Error::Device(format!("cuda:{ordinal}: {e:?}"));
    let ctx = CudaContext::new(ordinal).map_err(err)?;
    let stream = ctx.new_stream().map_err(err)?;
    let mut dst = stream.alloc_zeros::<u8>(bytes).map_err(err)?;
    let time = |stream: &Arc<CudaStream>,
                f: &mut dyn FnMut() -> std::result::Result<(), DriverError>|
     -> Result<f64> {
        f().map_err(err)?; // warm-up
        let start = ctx.new_event(Some(sys::CUevent_flags::CU_EVENT_DEFAULT)).map_err(err)?;
        let end = ctx.new_event(Some(sys::CUevent_flags::CU_EVENT_DEFAULT)).map_err(err)?;
        start.record(stream).map_err(err)?;
        for _ in 0..iters {
            f().map_err(err)?;
        }
        end.record(stream).map_err(err)?;
        end.synchronize().map_err(err)?;
        let ms = start.elapsed_ms(&end).map_err(err)? as f64;
        Ok((bytes * iters) as f64 / (ms / 1e3) / 1e9)
    };
    // SAFETY: the pinned buffer is fully written before any copy reads it.
    let mut pinned = unsafe { ctx.alloc_pinned_with_flags::<u8>(bytes, 0) }.map_err(err)?;
    pinned.as_mut_slice().map_err(err)?.fill(1);
    let pinned_gbps = time(&stream, &mut || stream.memcpy_htod(&pinned, &mut dst))?;
    let pageable = vec![2u8; bytes];
    let pageable_gbps = time(&stream, &mut || stream.memcpy_htod(&pageable, &mut dst))?;
    let mut registered = vec![3u8; bytes];
    // SAFETY: registers a live allocation of `bytes` bytes; it is unregistered below before it is freed.
    let r = unsafe { sys::cuMemHostRegister_v2(registered.as_mut_ptr().cast(), bytes, 0) };
    if r != sys::CUresult::CUDA_SUCCESS {
        return Err(Error::Device(format!("cuMemHostRegister: {r:?}")));
    }
    let registered_gbps = time(&stream, &mut || stream.memcpy_htod(&registered, &mut dst));
    stream.synchronize().map_err(err)?;
    // SAFETY: the pointer was registered above and every copy from it has completed.
    unsafe { sys::cuMemHostUnregister(registered.as_mut_ptr().cast()) };
    Ok(H2dReport { bytes, pinned_gbps, pageable_gbps, registered_gbps: registered_gbps? })
}

#[cfg(not(feature = "cuda"))]
/// Stand-in: this build has no CUDA support.
pub fn h2d_bench(ordinal: usize, _bytes: usize, _iters: usize) -> Result<H2dReport> {
    crate::cuda::open_device(ordinal)?;
    Err(Error::Device("built without CUDA".into()))
}
