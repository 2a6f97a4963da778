//! The `Backend` trait: every operation the forward pass needs, over device-resident activations,
//! weights and KV caches. The CPU implementation is always present; CUDA plugs in behind the same trait.

use crate::error::Result;
use crate::rope::RopeTable;
use layerstream_model::DType;

/// Attention geometry of a model.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AttnShape {
    pub n_heads: usize,
    pub n_kv_heads: usize,
    pub head_dim: usize,
}

/// A compute device.
pub trait Backend: Send + Sync + Clone {
    /// Row-major f32 activations `[rows, cols]` on the device.
    type Tensor: Send;
    /// A stored weight on the device (quantized blocks kept as they are).
    type Weight: Send + Sync;
    /// One sequence's keys and values for one layer.
    type KvCache: Send;

    /// A human-readable device name ("cpu", "cuda:0").
    fn name(&self) -> String;

    /// Places a stored tensor on the device; `shape` is row-major with blocks along the last dim.
    fn weight(&self, name: &str, dtype: DType, shape: &[usize], bytes: &[u8]) -> Result<Self::Weight>;
    /// Copies host activations to the device.
    fn from_host(&self, data: &[f32], rows: usize, cols: usize) -> Result<Self::Tensor>;
    /// Copies activations back to the host.
    fn to_host(&self, t: &Self::Tensor) -> Result<Vec<f32>>;
    /// `(rows, cols)` of a tensor.
    fn dims(&self, t: &Self::Tensor) -> (usize, usize);
    /// Rows `[start, start + n)` of `t` as a new tensor.
    fn rows(&self, t: &Self::Tensor, start: usize, n: usize) -> Result<Self::Tensor>;
    /// Stacks tensors of equal width by rows.
    fn concat_rows(&self, parts: &[Self::Tensor]) -> Result<Self::Tensor>;

    /// Gathers embedding rows for `ids` from a `[vocab, hidden]` table.
    fn embedding(&self, table: &Self::Weight, ids: &[u32]) -> Result<Self::Tensor>;
    /// `x[m, k] · w[n, k]ᵀ → [m, n]`, dequantizing `w` as needed.
    fn matmul(&self, x: &Self::Tensor, w: &Self::Weight) -> Result<Self::Tensor>;
    /// Adds a 1-D bias to every row.
    fn add_bias(&self, x: &mut Self::Tensor, bias: &Self::Weight) -> Result<()>;
    /// RMSNorm over groups of `weight.len()` columns (whole rows, or per head for q/k norms).
    fn rms_norm(&self, x: &Self::Tensor, weight: &Self::Weight, eps: f32) -> Result<Self::Tensor>;
    /// Rotates each head of `x` (HF half layout) at the given positions, one per row.
    fn rope(&self, x: &mut Self::Tensor, positions: &[usize], table: &RopeTable) -> Result<()>;
    /// `silu(gate) * up`.
    fn silu_mul(&self, gate: &Self::Tensor, up: &Self::Tensor) -> Result<Self::Tensor>;
    /// `x += y`.
    fn add(&self, x: &mut Self::Tensor, y: &Self::Tensor) -> Result<()>;

    /// An empty KV cache with room for `capacity` positions.
    fn kv_cache(&self, shape: AttnShape, capacity: usize) -> Result<Self::KvCache>;
    /// Positions stored in a cache.
    fn kv_len(&self, cache: &Self::KvCache) -> usize;
    /// Appends `k`, `v` (`[m, kv_dim]`) to the cache at its current length, then computes causal
    /// attention for `q` (`[m, q_dim]`) over everything cached: one sequence's rows.
    fn attention(&self, q: &Self::Tensor, k: &Self::Tensor, v: &Self::Tensor, cache: &mut Self::KvCache, shape: AttnShape) -> Result<Self::Tensor>;
    /// Bytes a cache of `capacity` positions occupies.
    fn kv_bytes(&self, shape: AttnShape, capacity: usize) -> usize {
        2 * capacity * shape.n_kv_heads * shape.head_dim * 4
    }
}
