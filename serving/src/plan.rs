//! The plan as both sides of the wire read it: the proto `Assignment` (one plan type, on the wire and
//! in code) and the memory arithmetic of an assignment over a store's manifest. The coordinator's
//! planner sizes assignments with it; a worker refuses one that exceeds its budget with the same sums.

use layerstream_model::layout::layer_file;
use layerstream_model::store::Manifest;
use layerstream_model::{DType, ModelConfig};
pub use layerstream_proto::v1::Assignment;
use std::ops::Range;

/// Readings of an `Assignment` with the proto's "0 means the default" rules applied once.
pub trait AssignmentExt {
    /// The layer range `[layer_start, layer_end)`.
    fn layers(&self) -> Range<u32>;
    /// Streamed layers per group (at least 1).
    fn group(&self) -> usize;
    /// Groups in flight (at least 1).
    fn buffers(&self) -> usize;
    /// KV positions, over all sequences.
    fn kv_positions(&self) -> usize;
    /// The KV pool's dtype (empty: f32) and positions per block (0: 16).
    fn kv_dtype(&self) -> Result<DType, String>;
    fn kv_block(&self) -> usize;
    /// Streamed layers, chunked into groups in layer order.
    fn stream_groups(&self) -> Vec<Vec<u32>>;
}

impl AssignmentExt for Assignment {
    fn layers(&self) -> Range<u32> {
        self.layer_start..self.layer_end
    }
    fn group(&self) -> usize {
        self.group_size.max(1) as usize
    }
    fn buffers(&self) -> usize {
        self.streaming_buffers.max(1) as usize
    }
    fn kv_positions(&self) -> usize {
        self.kv_capacity as usize
    }
    fn kv_dtype(&self) -> Result<DType, String> {
        if self.kv_dtype.is_empty() {
            return Ok(DType::F32);
        }
        layerstream_model::dtype::parse_kv_dtype(&self.kv_dtype)
    }
    fn kv_block(&self) -> usize {
        if self.kv_block == 0 {
            16
        } else {
            self.kv_block as usize
        }
    }
    fn stream_groups(&self) -> Vec<Vec<u32>> {
        let streamed: Vec<u32> = self.layers().filter(|l| !self.resident.contains(l)).collect();
        streamed.chunks(self.group()).map(<[u32]>::to_vec).collect()
    }
}

/// KV bytes of one position in one layer (keys and values in `dtype`, rows padded to 4 bytes as
/// the pools store them).
pub fn kv_bytes_per_token_layer(m: &Manifest, dtype: DType) -> u64 {
    // The config comes from a file: a crafted width saturates rather than wraps.
    let (dim, rows) = m.config.kv_cache_rows();
    let row = dtype.row_bytes(dim).unwrap_or(dim.saturating_mul(4));
    (row as u64).div_ceil(4).saturating_mul(4 * rows as u64)
}

/// Device bytes one token of a step keeps alive at the peak of a layer's forward pass (f32): what
/// `layer_forward` holds until it returns — the residual, both norms' outputs, o and down (5 × hidden),
/// q, the attention output and its per-sequence pieces (3 × q width), k and v and their pieces
/// (4 × kv width), gate, up and SiLU·up (3 × intermediate) — plus a GEMM input's f16 copy (half the
/// intermediate width in f32 terms). Under MLA a head's query and output are as wide as the cached
/// row (latent + RoPE key), and the projections before them count twice.
pub fn activation_bytes_per_token(cfg: &ModelConfig) -> u64 {
    let (h, i) = (cfg.hidden_size, cfg.intermediate_size);
    let (q, kv) = match &cfg.mla {
        Some(m) => (2 * cfg.num_heads * m.cache_dim(), 2 * m.cache_dim()),
        None => (cfg.num_heads * cfg.head_dim, cfg.kv_dim()),
    };
    let floats = 5 * h + 3 * q + 4 * kv + 3 * i + i / 2;
    floats as u64 * 4
}

/// Most tokens one step may carry when `reserve` bytes hold its activations (at least 1).
pub fn step_token_limit(cfg: &ModelConfig, reserve: u64) -> usize {
    (reserve / activation_bytes_per_token(cfg).max(1)).max(1) as usize
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
    /// Experts kept on the device (mixture-of-experts models).
    pub experts: u64,
}

impl Usage {
    /// Total bytes.
    pub fn total(&self) -> u64 {
        [self.embed_head, self.resident, self.streaming, self.kv, self.experts]
            .iter()
            .fold(0u64, |a, &b| a.saturating_add(b))
    }
}

impl std::fmt::Display for Usage {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} bytes (embedding/head {}, resident layers {}, streaming buffers {}, KV cache {}{})",
            self.total(),
            self.embed_head,
            self.resident,
            self.streaming,
            self.kv,
            if self.experts > 0 { format!(", experts {}", self.experts) } else { String::new() }
        )
    }
}

/// What `a` occupies on a worker of the model in `m` (one that copies what it streams: a GPU's).
pub fn usage(m: &Manifest, a: &Assignment) -> Usage {
    usage_with(m, a, false)
}

/// Bytes a worker keeps for the embedding (`embed`) and the head (`head`: the final norm and the
/// vocabulary projection, which is the embedding itself where the two are tied), whatever it streams.
/// A worker that computes from host memory (`in_place`: the CPU) maps an embedding it only looks
/// rows up in (`weights::embedding` in the worker): the page cache holds those rows, not the worker.
pub fn embed_head_bytes(m: &Manifest, embed: bool, head: bool, in_place: bool) -> u64 {
    let tied = m.config.tie_word_embeddings;
    let mut bytes = 0;
    if (embed && !in_place) || (head && tied) {
        bytes += file_bytes(m, "embed.bin");
    }
    if head {
        bytes += file_bytes(m, "final_norm.bin") + file_bytes(m, "lm_head.bin");
    }
    bytes
}

/// Whether a worker on `device` computes streamed layers where the loader put them (the CPU: its
/// weights point into the pinned shm slot), so its streaming buffers take no memory of its own.
pub fn streams_in_place(device: &str) -> bool {
    device == "cpu"
}

/// `usage` on a worker that streams in place (`streams_in_place`) or not: one rule for the planner
/// and for the worker that checks an assignment against its budget.
pub fn usage_with(m: &Manifest, a: &Assignment, in_place: bool) -> Usage {
    let embed_head = embed_head_bytes(m, a.embed, a.head, in_place);
    let resident = a.resident.iter().map(|&l| layer_bytes(m, l)).sum();
    let (count, bytes) = streaming_buffers(m, a);
    // Saturating: a crafted capacity must exceed every budget, not wrap below it.
    let kv = a
        .kv_capacity
        .saturating_mul(kv_bytes_per_token_layer(m, a.kv_dtype().unwrap_or(DType::F32)))
        .saturating_mul(a.layers().len() as u64);
    let streaming = if in_place { 0 } else { count as u64 * bytes };
    Usage { embed_head, resident, streaming, kv, experts: expert_bytes(m, a) }
}

/// Every expert of `a`'s mixture-of-experts layers: (count, total bytes, largest file's bytes).
pub fn range_experts(m: &Manifest, a: &Assignment) -> (usize, u64, u64) {
    let sizes: Vec<u64> = a
        .layers()
        .filter_map(|l| m.config.moe_at(l as usize).map(|x| (l as usize, x.experts)))
        .flat_map(|(l, n)| {
            (0..n).map(move |e| file_bytes(m, &layerstream_model::layout::expert_file(l, e)))
        })
        .collect();
    // Sizes come from the manifest: a crafted one saturates rather than wraps.
    let total = sizes.iter().fold(0u64, |a, &b| a.saturating_add(b));
    (sizes.len(), total, sizes.iter().copied().max().unwrap_or(0))
}

/// Device bytes of the experts `a` keeps: all of its range's (`expert_cache` 0, or at least as
/// many), else `expert_cache` of the largest.
pub fn expert_bytes(m: &Manifest, a: &Assignment) -> u64 {
    let (n, all, largest) = range_experts(m, a);
    match a.expert_cache as usize {
        0 => all,
        c if c >= n => all,
        c => (c as u64).saturating_mul(largest),
    }
}

/// The streaming buffers `a` needs: how many and the bytes of each. One buffer holds one layer;
/// `a.buffers()` groups may be in flight (one computing, one copying, the rest queued), so there
/// are `buffers × group size` buffers of the largest streamed layer (none when nothing streams).
pub fn streaming_buffers(m: &Manifest, a: &Assignment) -> (usize, u64) {
    let groups = a.stream_groups();
    let Some(largest) = groups.iter().flatten().map(|&l| layer_bytes(m, l)).max() else {
        return (0, 0);
    };
    let widest = groups.iter().map(Vec::len).max().unwrap_or(1);
    (a.buffers() * widest, largest)
}

#[cfg(test)]
mod tests {
    use super::*;
    use layerstream_model::synth::shape_config;

    /// Under a GPU's activation reserve a 70B-shaped step still carries a few hundred tokens (a
    /// prompt chunk stays a GEMM, not a row-by-row matvec), and SmolLM2 is not held below the
    /// coordinator's default of 2048.
    #[test]
    fn step_token_limits_under_the_activation_reserve() {
        let reserve = 320 << 20;
        let big = shape_config("llama-3-70b", Some(1)).unwrap();
        let per = activation_bytes_per_token(&big);
        assert!(per > 4 * 3 * 28672, "at least gate, up and SiLU·up per token: {per}");
        let n = step_token_limit(&big, reserve);
        assert!((256..2048).contains(&n), "70B: {n} tokens per step");
        assert!(n as u64 * per <= reserve && (n as u64 + 1) * per > reserve);
        assert!(step_token_limit(&shape_config("smollm2-135m", Some(1)).unwrap(), reserve) > 2048);
        assert_eq!(step_token_limit(&big, 1), 1, "always at least one token");
    }

    #[test]
    fn groups_skip_resident_layers_and_keep_layer_order() {
        let a = Assignment {
            layer_start: 0,
            layer_end: 10,
            resident: vec![0, 5],
            group_size: 3,
            streaming_buffers: 2,
            ..Default::default()
        };
        assert_eq!(a.stream_groups(), vec![vec![1, 2, 3], vec![4, 6, 7], vec![8, 9]]);
        assert_eq!(
            Assignment { group_size: 0, ..a.clone() }.group(),
            1,
            "0 on the wire is one layer a group"
        );
    }

    #[test]
    fn usage_counts_each_part_once() {
        let dir = tempfile::tempdir().unwrap();
        let m = layerstream_model::synth::synth(
            "tiny",
            layerstream_model::DType::Q8_0,
            Some(4),
            3,
            &dir.path().join("s"),
        )
        .unwrap();
        let layer = layer_bytes(&m, 0);
        let a = Assignment {
            layer_start: 0,
            layer_end: 4,
            resident: vec![0],
            group_size: 1,
            streaming_buffers: 2,
            kv_capacity: 8,
            embed: true,
            head: true,
            ..Default::default()
        };
        let u = usage(&m, &a);
        assert_eq!(u.resident, layer);
        assert_eq!(u.streaming, 2 * layer, "two buffers of one layer");
        assert_eq!(u.kv, 8 * kv_bytes_per_token_layer(&m, DType::F32) * 4);
        // A crafted capacity saturates: it exceeds every budget instead of wrapping below one.
        let huge = Assignment { kv_capacity: u64::MAX, ..a.clone() };
        assert_eq!((usage(&m, &huge).kv, usage(&m, &huge).total()), (u64::MAX, u64::MAX));
        assert_eq!(
            u.embed_head,
            file_bytes(&m, "embed.bin") + file_bytes(&m, "final_norm.bin"),
            "tied: one embedding"
        );
        let all = Assignment { resident: vec![0, 1, 2, 3], ..a.clone() };
        assert_eq!(streaming_buffers(&m, &all), (0, 0), "nothing streams");
        // Tied, the embedding is the head: a CPU worker keeps it too.
        let cpu = usage_with(&m, &a, true);
        assert_eq!((cpu.embed_head, cpu.streaming), (u.embed_head, 0));
        // Untied, a CPU worker maps the embedding it only looks rows up in; a GPU's holds it.
        let mut untied = m.clone();
        untied.config.tie_word_embeddings = false;
        let norm = file_bytes(&m, "final_norm.bin");
        assert_eq!(usage_with(&untied, &a, true).embed_head, norm, "the head file is absent here");
        assert_eq!(usage_with(&untied, &a, false).embed_head, u.embed_head);
        let first = Assignment { head: false, ..a.clone() };
        assert_eq!(usage_with(&m, &first, true).embed_head, 0, "lookups alone, even tied");
    }
}
