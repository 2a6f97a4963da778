//! The worker's compute device, chosen by `--device`: the CPU or a CUDA GPU (opened once per
//! process: context, kernels, cuBLAS), its usable memory budget, and the stage loaded on it.

use crate::error::{Error, Result};
use crate::stage::{Stage, StepOut, StepSeq};
use crate::stream::LoaderLink;
use layerstream_kernels::cuda::{
    parse_cuda_device, CudaBackend, ACTIVATION_RESERVE, BUILT_WITH_CUDA, RUNTIME_RESERVE,
    WITHOUT_CUDA,
};
use layerstream_kernels::{Backend, CpuBackend};
use layerstream_model::{ModelConfig, Store};
use layerstream_serving::plan::Assignment;
use tracing::Span;

/// A device a worker computes on.
#[derive(Clone)]
pub enum Device {
    Cpu(CpuBackend),
    Cuda(CudaBackend),
}

/// A stage loaded on either device.
// One per worker process, never moved in a hot path: boxing a variant would buy nothing.
#[allow(clippy::large_enum_variant)]
pub enum AnyStage {
    Cpu(Stage<CpuBackend>),
    Cuda(Stage<CudaBackend>),
}

impl Device {
    /// Checks a device name without opening anything: `Some(ordinal)` for `cuda[:N]`, `None` for
    /// `cpu`; an unknown name, or `cuda:N` in a build without the `cuda` feature, is an error that
    /// says what to do. Commands that start processes call it first, so they fail before spawning.
    pub fn check(name: &str) -> Result<Option<usize>> {
        let refuse = |msg: String| Err(Error::Device { device: name.into(), msg });
        match parse_cuda_device(name) {
            Some(Err(e)) => Err(e.into()),
            Some(Ok(_)) if !BUILT_WITH_CUDA => refuse(WITHOUT_CUDA.into()),
            Some(Ok(ordinal)) => Ok(Some(ordinal)),
            None if name == "cpu" => Ok(None),
            None => refuse("unknown device: use cpu or cuda:N".into()),
        }
    }

    /// Opens `cpu` or `cuda[:N]`.
    pub fn open(name: &str) -> Result<Device> {
        Ok(match Device::check(name)? {
            Some(ordinal) => Device::Cuda(CudaBackend::new(ordinal)?),
            None => Device::Cpu(CpuBackend::default()),
        })
    }

    /// The bytes assignments may use — one rule for every command: the flag if given, else what the
    /// device has available (host MemAvailable on the CPU, free memory on a GPU); on a GPU, never
    /// more than is free, less the runtime reserve (GEMM scratch, activations, cuBLAS).
    pub fn budget(&self, flag: Option<u64>) -> Result<u64> {
        match self {
            Device::Cpu(_) => Ok(flag.unwrap_or_else(layerstream_model::mem::host_available_bytes)),
            Device::Cuda(b) => {
                let (free, total) = b.mem_info()?;
                let usable =
                    flag.unwrap_or(u64::MAX).min(free as u64).saturating_sub(RUNTIME_RESERVE);
                if usable == 0 {
                    return Err(Error::Device {
                        device: b.name(),
                        msg: format!("a budget of {flag:?} bytes with {free} of {total} bytes free leaves nothing after the {RUNTIME_RESERVE}-byte runtime reserve"),
                    });
                }
                Ok(usable)
            }
        }
    }

    /// Most tokens one step may carry on this device: on a GPU what the activation reserve holds for
    /// this model; None on the CPU (host memory, outside the budget).
    pub fn step_token_limit(&self, cfg: &ModelConfig) -> Option<usize> {
        match self {
            Device::Cpu(_) => None,
            Device::Cuda(_) => {
                Some(layerstream_serving::plan::step_token_limit(cfg, ACTIVATION_RESERVE))
            }
        }
    }

    /// Loads an assignment on this device, its layers' activations in `p`.
    pub fn load(
        &self,
        store: Store,
        plan: Assignment,
        link: LoaderLink,
        p: layerstream_kernels::Precision,
    ) -> Result<AnyStage> {
        Ok(match self {
            Device::Cpu(b) => AnyStage::Cpu(Stage::load(b.clone(), store, plan, link, p)?),
            Device::Cuda(b) => AnyStage::Cuda(Stage::load(b.clone(), store, plan, link, p)?),
        })
    }
}

impl AnyStage {
    /// The loaded plan.
    pub fn plan(&self) -> &Assignment {
        match self {
            AnyStage::Cpu(s) => &s.plan,
            AnyStage::Cuda(s) => &s.plan,
        }
    }

    /// Runs one batch step (see `Stage::step`).
    pub fn step(&mut self, batch: &[StepSeq], hidden: &[f32], span: &Span) -> Result<StepOut> {
        match self {
            AnyStage::Cpu(s) => s.step(batch, hidden, span),
            AnyStage::Cuda(s) => s.step(batch, hidden, span),
        }
    }

    /// Moves KV blocks between the device and the host tier (see `Stage::swap`).
    pub fn swap(&mut self, to_host: &[(u32, u32)], to_device: &[(u32, u32)]) -> Result<(u64, u64)> {
        match self {
            AnyStage::Cpu(s) => s.swap(to_host, to_device),
            AnyStage::Cuda(s) => s.swap(to_host, to_device),
        }
    }

    /// Frees sequences.
    pub fn release(&mut self, ids: &[u64]) {
        match self {
            AnyStage::Cpu(s) => s.release(ids),
            AnyStage::Cuda(s) => s.release(ids),
        }
    }

    /// Frees every sequence.
    pub fn release_all(&mut self) {
        match self {
            AnyStage::Cpu(s) => s.release_all(),
            AnyStage::Cuda(s) => s.release_all(),
        }
    }

    /// Live sequences and positions held.
    pub fn kv_used(&self) -> (usize, usize) {
        match self {
            AnyStage::Cpu(s) => s.kv_used(),
            AnyStage::Cuda(s) => s.kv_used(),
        }
    }
}
