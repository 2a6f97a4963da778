//! Conversions between the wire's step messages (`layerstream.v1`) and the stage's own types, so
//! the service only moves values across the boundary.

use crate::stage::{LayerTiming, StepOut, StepSeq};
use layerstream_rpc::v1;

impl From<v1::StepSeq> for StepSeq {
    fn from(s: v1::StepSeq) -> Self {
        StepSeq {
            seq_id: s.seq_id,
            start_pos: s.start_pos as usize,
            sampling: s.sampling.as_ref().map(crate::SamplingParams::from_wire),
            tokens: s.token_ids,
            prompt_continues: s.prompt_continues,
            draws_before: s.draws_before as u64,
            draft_len: s.draft_len as usize,
            draft_next: (s.draft_next as usize).min(layerstream_serving::spec::MAX_DRAFT),
            tree_parents: s.tree_parents,
            draft_width: (s.draft_width as usize).clamp(1, layerstream_serving::spec::MAX_WIDTH),
            blocks: s.blocks,
            cached: s.cached_ids,
            allowed: s.allowed,
            score_ids: s.score_ids,
            score_top: (s.score_top as usize)
                .min(layerstream_serving::generation::MAX_TOP_LOGPROBS),
        }
    }
}

/// A layer's timing on the wire: its experts' bytes and copy time counted with the layer's.
impl From<LayerTiming> for v1::LayerTiming {
    fn from(t: LayerTiming) -> Self {
        v1::LayerTiming {
            layer: t.layer,
            resident: t.resident,
            bytes: t.bytes + t.experts.bytes,
            transfer_ms: t.transfer_ms + t.experts.transfer_ms,
            compute_ms: t.compute_ms,
            stall_ms: t.stall_ms,
            experts_needed: t.experts.needed,
            experts_hit: t.experts.hit,
            experts_prefetched: t.experts.prefetched,
            experts_missed: t.experts.missed,
        }
    }
}

/// A step's answer (hidden states already placed: inline bytes or a shared-memory reference).
pub fn step_response(
    out: StepOut,
    hidden: Vec<u8>,
    hidden_ref: Option<v1::HiddenRef>,
    wall_ms: f64,
) -> v1::StepResponse {
    v1::StepResponse {
        hidden,
        hidden_ref,
        results: out.results,
        draft_ms: out.draft_ms,
        draft_level_ms: out.draft_level_ms,
        layers: out.layers.into_iter().map(Into::into).collect(),
        wall_ms,
        layers_ms: out.layers_ms,
    }
}

/// The hidden states a step request carries: from the sending worker's shared memory, or inline
/// little-endian f32 bytes.
pub fn step_hidden(req: &v1::StepRequest) -> crate::Result<Vec<f32>> {
    match &req.hidden_ref {
        Some(r) => crate::handoff::read(r).map_err(|m| crate::Error::invalid("hidden_ref", m)),
        None if !req.hidden.len().is_multiple_of(4) => Err(crate::Error::invalid(
            "hidden",
            format!("{} bytes is not a whole number of little-endian f32 values", req.hidden.len()),
        )),
        None => Ok(crate::handoff::le_f32s(&req.hidden)),
    }
}
