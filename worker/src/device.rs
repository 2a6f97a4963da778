//! The worker's compute device, chosen by `--device`: the CPU or a CUDA GPU (opened once per
//! process: context, kernels, cuBLAS), its usable memory budget, and the stage loaded on it.

use crate::error::Result;
use crate::stage::{Stage, StagePlan, StepOut, StepSeq};
use crate::stream::LoaderLink;
use layerstream_kernels::cuda::{parse_cuda_device, CudaBackend, ACTIVATION_RESERVE, RUNTIME_RESERVE};
use layerstream_kernels::{Backend, CpuBackend};
use layerstream_model::{ModelConfig, Store};
use tracing::Span;

/// A device a worker computes on.
#[derive(Clone)]
pub enum Device {
    Cpu(CpuBackend),
    Cuda(CudaBackend),
}

/// A stage loaded on either device.
pub enum AnyStage {
    Cpu(Stage<CpuBackend>),
    Cuda(Stage<CudaBackend>),
}

impl Device {
    /// Opens `cpu` or `cuda[:N]`.
    pub fn open(name: &str) -> anyhow::Result<Device> {
        if let Some(ordinal) = parse_cuda_device(name) {
            return Ok(Device::Cuda(CudaBackend::new(ordinal?)?));
        }
        if name != "cpu" {
            anyhow::bail!("unknown device {name:?}: use cpu or cuda:N");
        }
        Ok(Device::Cpu(CpuBackend::default()))
    }

    /// The bytes assignments may use: the flag on the CPU; on a GPU, the smaller of the flag and
    /// what cuMemGetInfo reports free, less the runtime reserve (GEMM scratch, activations, cuBLAS).
    pub fn budget(&self, flag: u64) -> anyhow::Result<u64> {
        match self {
            Device::Cpu(_) => Ok(flag),
            Device::Cuda(b) => {
                let (free, total) = b.mem_info()?;
                let usable = flag.min(free as u64).saturating_sub(RUNTIME_RESERVE);
                if usable == 0 {
                    anyhow::bail!("{}: budget {flag} bytes with {free} of {total} bytes free leaves nothing after the {RUNTIME_RESERVE}-byte runtime reserve", b.name());
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
            Device::Cuda(_) => Some(crate::budget::step_token_limit(cfg, ACTIVATION_RESERVE)),
        }
    }

    /// Loads an assignment on this device.
    pub fn load(&self, store: Store, plan: StagePlan, link: LoaderLink) -> Result<AnyStage> {
        Ok(match self {
            Device::Cpu(b) => AnyStage::Cpu(Stage::load(b.clone(), store, plan, link)?),
            Device::Cuda(b) => AnyStage::Cuda(Stage::load(b.clone(), store, plan, link)?),
        })
    }
}

impl AnyStage {
    /// The loaded plan.
    pub fn plan(&self) -> &StagePlan {
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

    /// Frees sequences.
    pub fn release(&mut self, ids: &[u64]) {
        match self {
            AnyStage::Cpu(s) => s.release(ids),
            AnyStage::Cuda(s) => s.release(ids),
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
