//! The last steps as the live page shows them (`/api/stack`'s `steps`): each step's batch, rows and
//! wall time — beside the cost model's prediction for a decode step — and each worker's layers.

use layerstream_rpc::v1::LayerTiming;
use serde::Serialize;

/// Steps kept for the live page.
pub const RECENT_STEPS: usize = 32;

/// One step as the live page shows it.
#[derive(Debug, Clone, Serialize)]
pub struct StepView {
    /// Milliseconds since the Unix epoch when the step ended.
    pub(crate) at_ms: u64,
    /// Sequences and token rows in the step.
    pub(crate) batch: usize,
    pub(crate) rows: usize,
    /// Wall time of the whole step through every worker.
    pub(crate) wall_ms: f64,
    /// What the cost model predicted for it: decode steps (one row a sequence) of a stack started
    /// with a prediction (`--predicted-pass`).
    pub(crate) predicted_ms: Option<f64>,
    /// Per worker, in pipeline order.
    pub(crate) workers: Vec<WorkerStepView>,
}

/// One worker's part of a step.
#[derive(Debug, Clone, Serialize)]
pub struct WorkerStepView {
    pub(crate) worker: String,
    pub(crate) wall_ms: f64,
    pub(crate) layers: Vec<LayerView>,
}

/// One layer of a step: streamed or resident, and where its time went.
#[derive(Debug, Clone, Serialize)]
pub struct LayerView {
    pub(crate) layer: u32,
    pub(crate) resident: bool,
    pub(crate) bytes: u64,
    pub(crate) transfer_ms: f64,
    pub(crate) compute_ms: f64,
    pub(crate) stall_ms: f64,
}

impl From<&LayerTiming> for LayerView {
    fn from(t: &LayerTiming) -> Self {
        LayerView {
            layer: t.layer,
            resident: t.resident,
            bytes: t.bytes,
            transfer_ms: t.transfer_ms,
            compute_ms: t.compute_ms,
            stall_ms: t.stall_ms,
        }
    }
}
