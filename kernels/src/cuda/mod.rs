//! The CUDA device, behind the `cuda` cargo feature (cudarc with the driver loaded at run time, so the
//! feature builds on machines without CUDA). Without the feature, the same functions exist and report
//! "built without CUDA", so callers never need `#[cfg]`.
//!
//! `source`: the `.cu` kernels and their NVRTC compilation; `driver`: context, streams, buffers,
//! events; `stream_pool`: reusable streaming buffers and pinned (registered) loader slots; `backend`:
//! `CudaBackend`, the `Backend` implementation (`backend/ops`: its GEMM, gated, sampling and
//! attention helpers). Device probing (name, compute capability,
//! `cuMemGetInfo`) is below.

use crate::error::{Error, Result};

#[cfg(feature = "cuda")]
mod backend;
#[cfg(feature = "cuda")]
mod driver;
pub mod source;
#[cfg(feature = "cuda")]
mod stream_pool;
#[cfg(not(feature = "cuda"))]
mod stub;
#[cfg(test)]
mod test_data;
#[cfg(test)]
mod tests_emu;
#[cfg(all(test, feature = "cuda"))]
mod tests_gpu;

#[cfg(feature = "cuda")]
pub use backend::{CudaBackend, CudaBlob, CudaKv, CudaTensor, CudaWeight, GemmPrecision};
#[cfg(not(feature = "cuda"))]
pub use stub::CudaBackend;

/// Whether `matmul` may use the wide-load matvec (`matvec32_*`); off only to measure it against the
/// element-run kernel (`layerstream matvec-bench`).
pub static WIDE_MATVEC: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(true);

/// Threads per attention block: the context tile (ATT_MAX_THREADS in attention.cu is the most). Here,
/// not in backend.rs, so the host emulator's test launches the kernel with the same block.
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
pub(crate) const ATTENTION_THREADS: u32 = 128;

/// Device memory a CUDA worker keeps outside its plan: the GEMM dequantization scratch, cuBLAS's
/// workspace, the head's logits and a step's activations.
/// Whether this build can open CUDA devices (the `cuda` feature).
pub const BUILT_WITH_CUDA: bool = cfg!(feature = "cuda");

/// The reason a `cuda:N` device is refused in a build without the feature, with what to do.
pub const WITHOUT_CUDA: &str = "this layerstream was built without CUDA: rebuild with `cargo build --release -p layerstream --features cuda` (libcuda is loaded at run time; building needs no CUDA)";

pub const RUNTIME_RESERVE: u64 = 512 << 20;
/// The part of `RUNTIME_RESERVE` a step's activations may use (the rest holds the GEMM scratch, at
/// most 128 MiB, cuBLAS's workspace and the logits): a worker accepts steps of at most this many
/// bytes of activations, and the coordinator splits prompts to stay under it.
pub const ACTIVATION_RESERVE: u64 = 320 << 20;

/// What a CUDA device reports.
#[derive(Debug, Clone, PartialEq)]
pub struct CudaDeviceInfo {
    pub ordinal: usize,
    pub name: String,
    pub compute_capability: (i32, i32),
    pub free_bytes: usize,
    pub total_bytes: usize,
    /// Peak memory bandwidth in GB/s: 2 transfers per memory clock × the bus width.
    pub peak_gbps: f64,
}

/// Parses "cuda:N" (or "cuda" = 0) into an ordinal; `None` for other device names.
pub fn parse_cuda_device(name: &str) -> Option<Result<usize>> {
    let rest = name.strip_prefix("cuda")?;
    Some(match rest.strip_prefix(':') {
        None if rest.is_empty() => Ok(0),
        Some(n) => n.parse().map_err(|_| Error::Device(format!("{name:?}: expected cuda:N"))),
        None => return None,
    })
}

#[cfg(feature = "cuda")]
/// Opens device `ordinal` and reads its properties.
pub fn open_device(ordinal: usize) -> Result<CudaDeviceInfo> {
    use cudarc::driver::CudaContext;
    // SAFETY: only probes whether libcuda can be loaded; CudaContext::new panics instead of failing
    // when it cannot, so this check must come first.
    if !unsafe { cudarc::driver::sys::is_culib_present() } {
        return Err(Error::Device("no CUDA driver (libcuda.so) on this machine".into()));
    }
    let err = |e: cudarc::driver::DriverError| Error::Device(format!("cuda:{ordinal}: {e:?}"));
    let count = CudaContext::device_count().map_err(err)?;
    if ordinal as i32 >= count {
        return Err(Error::Device(format!("cuda:{ordinal} does not exist ({count} device(s))")));
    }
    let ctx = CudaContext::new(ordinal).map_err(err)?;
    let (free_bytes, total_bytes) = ctx.mem_get_info().map_err(err)?;
    use cudarc::driver::sys::CUdevice_attribute as A;
    let clock_khz = ctx.attribute(A::CU_DEVICE_ATTRIBUTE_MEMORY_CLOCK_RATE).map_err(err)?;
    let bus_bits = ctx.attribute(A::CU_DEVICE_ATTRIBUTE_GLOBAL_MEMORY_BUS_WIDTH).map_err(err)?;
    Ok(CudaDeviceInfo {
        peak_gbps: 2.0 * clock_khz as f64 * 1e3 * (bus_bits as f64 / 8.0) / 1e9,
        ordinal,
        name: ctx.name().map_err(err)?,
        compute_capability: ctx.compute_capability().map_err(err)?,
        free_bytes,
        total_bytes,
    })
}

#[cfg(not(feature = "cuda"))]
/// Stand-in: this build has no CUDA support.
pub fn open_device(ordinal: usize) -> Result<CudaDeviceInfo> {
    Err(Error::Device(format!("cuda:{ordinal}: {WITHOUT_CUDA}")))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn device_names_parse() {
        assert_eq!(parse_cuda_device("cuda:3").unwrap().unwrap(), 3);
        assert_eq!(parse_cuda_device("cuda").unwrap().unwrap(), 0);
        assert!(parse_cuda_device("cuda:x").unwrap().is_err());
        assert!(parse_cuda_device("cpu").is_none());
    }

    /// On a GPU machine this opens device 0; elsewhere it must fail with the reason, not panic.
    #[test]
    fn open_device_reports_memory_or_skips_with_the_reason() {
        match open_device(0) {
            Ok(info) => {
                assert!(info.total_bytes > 0 && info.free_bytes <= info.total_bytes);
                eprintln!(
                    "cuda:0 is {} ({:?}), {} of {} bytes free",
                    info.name, info.compute_capability, info.free_bytes, info.total_bytes
                );
            }
            Err(e) => {
                let msg = e.to_string();
                eprintln!("skipping CUDA device checks: {msg}");
                assert!(
                    msg.contains("without CUDA")
                        || msg.contains("libcuda")
                        || msg.contains("cuda:0"),
                    "{msg}"
                );
            }
        }
    }
}
