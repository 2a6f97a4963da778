//! Memory accounting of an assignment, shared by the worker (which refuses what exceeds its budget)
//! and the coordinator's planner (which sizes assignments to fit).

use crate::stage::{stream_groups, StagePlan};
use layerstream_model::layout::layer_file;
use layerstream_model::Manifest;

/// KV bytes of one position in one layer (f32 keys and values).
pub fn kv_bytes_per_token_layer(m: &Manifest) -> u64 {
    2 * m.config.kv_dim() as u64 * 4
}

/// Bytes of a store file (0 if absent).
pub fn file_bytes(m: &Manifest, name: &str) -> u64 {
    m.file(name).map_or(0, |f| f.size)
}

/// Bytes of layer `l`'s file.
pub fn layer_bytes(m: &Manifest, l: u32) -> u64 {
    file_bytes(m, &layer_file(l as usize))
}

/// Itemised memory of an assignment.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Usage {
    pub embed_head: u64,
    pub resident: u64,
    pub streaming: u64,
    pub kv: u64,
}

impl Usage {
    /// Total bytes.
    pub fn total(&self) -> u64 {
        self.embed_head + self.resident + self.streaming + self.kv
    }
}

impl std::fmt::Display for Usage {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} bytes (embedding/head {}, resident layers {}, streaming buffers {}, KV cache {})", self.total(), self.embed_head, self.resident, self.streaming, self.kv)
    }
}

/// What `plan` occupies on a worker of the model in `m`.
pub fn usage(m: &Manifest, plan: &StagePlan) -> Usage {
    let tied = m.config.tie_word_embeddings;
    let mut embed_head = 0;
    if plan.embed || (plan.head && tied) {
        embed_head += file_bytes(m, "embed.bin");
    }
    if plan.head {
        embed_head += file_bytes(m, "final_norm.bin") + file_bytes(m, "lm_head.bin");
    }
    let resident = plan.resident.iter().map(|&l| layer_bytes(m, l)).sum();
    let max_group = stream_groups(plan).iter().map(|g| g.iter().map(|&l| layer_bytes(m, l)).sum::<u64>()).max().unwrap_or(0);
    let buffers = if stream_groups(plan).is_empty() { 0 } else { plan.buffers as u64 };
    let kv = plan.kv_capacity as u64 * kv_bytes_per_token_layer(m) * plan.layers.len() as u64;
    Usage { embed_head, resident, streaming: buffers * max_group, kv }
}
