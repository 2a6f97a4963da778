//! The `Backend` trait: every operation the forward pass needs, over device-resident activations,
//! weights and KV caches. The CPU implementation is always present; CUDA plugs in behind the same trait.

use crate::error::Result;
use crate::kv::{KvLayout, KvSeq};
use crate::rope::RopeTable;
use layerstream_types::DType;
use std::sync::Arc;

/// Attention geometry of a layer.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AttnShape {
    pub n_heads: usize,
    pub n_kv_heads: usize,
    pub head_dim: usize,
    /// Score scale (1/√head_dim unless the model says otherwise).
    pub scale: f32,
    /// Sliding window: a row attends to the last `window` positions, itself included (0 = all).
    /// A cache of such a layer keeps only what later rows can still see.
    pub window: usize,
    /// The values are the keys (MLA's latent: each head's output is read from the first columns
    /// of the one kv head's keys): the pool stores keys only and `attention` ignores `v`.
    pub shared_kv: bool,
}

impl AttnShape {
    /// Full causal attention scaled by 1/√head_dim.
    pub fn new(n_heads: usize, n_kv_heads: usize, head_dim: usize) -> AttnShape {
        AttnShape {
            n_heads,
            n_kv_heads,
            head_dim,
            scale: 1.0 / (head_dim as f32).sqrt(),
            window: 0,
            shared_kv: false,
        }
    }

    /// Checks that attention sinks, if any, are one finite logit per head.
    pub fn check_sinks(&self, sinks: Option<&[f32]>) -> crate::Result<()> {
        crate::error::ensure(
            sinks.is_none_or(|s| s.len() == self.n_heads && s.iter().all(|x| x.is_finite())),
            "attention",
            || {
                format!(
                    "{} sinks for {} heads (finite ones)",
                    sinks.map_or(0, <[f32]>::len),
                    self.n_heads
                )
            },
        )
    }

    /// Checks q/k/v (`(rows, cols)` each) and a token tree's ancestor masks (one per new row, each
    /// over the `cached` tree rows an earlier call stored and the new rows: row i is its own
    /// ancestor — bit `cached + i` — and sees none after it; at most 64 rows in all; full-context
    /// layers only) against this shape for one `attention` call; returns `(q_dim, kv_dim)`.
    pub fn check(
        &self,
        q: (usize, usize),
        k: (usize, usize),
        v: (usize, usize),
        tree: Option<(&[u64], usize)>,
    ) -> crate::Result<(usize, usize)> {
        let (qd, kvd) = (self.n_heads * self.head_dim, self.n_kv_heads * self.head_dim);
        crate::error::ensure(
            q.1 == qd && k.1 == kvd && v.1 == kvd && k.0 == q.0 && v.0 == q.0,
            "attention",
            || format!("q {q:?}, k {k:?}, v {v:?} for {self:?}"),
        )?;
        crate::error::ensure(
            self.n_kv_heads > 0 && self.n_heads.is_multiple_of(self.n_kv_heads),
            "attention",
            || format!("{self:?}: heads not a multiple of kv heads"),
        )?;
        if let Some((anc, cached)) = tree {
            let ok = cached + q.0 <= 64
                && anc.len() == q.0
                && self.window == 0
                && anc.iter().enumerate().all(|(i, &a)| {
                    let me = cached + i;
                    a >> me & 1 == 1 && (me == 63 || a >> (me + 1) == 0)
                });
            crate::error::ensure(ok, "attention", || {
                format!("a token tree of {} new rows after {cached} cached ones with masks {anc:x?} (window {}): each row must be its own ancestor, see none after it, at most 64 rows, no window", q.0, self.window)
            })?;
        }
        Ok((qd, kvd))
    }
}

/// One row's job for `Backend::sample_rows`: how it picks, its uniform draw (`Sampler::draw`), and
/// the ids its repetition penalty applies to, each once.
pub struct RowPick<'a> {
    pub pick: crate::sampling::Pick,
    pub r: f32,
    pub seen: &'a [u32],
}

/// A compute device.
/// Bytes someone else owns and keeps unchanged while this value lives (`Backend::map_blob`).
pub trait MappedBytes: Send + Sync + std::fmt::Debug {
    fn bytes(&self) -> &[u8];
}

/// The arithmetic a matmul's activations take: a value the caller passes with every product
/// (the layers' choice, the head's, a draft model's), never a switch the kernels look up.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Precision {
    /// f32 activations: transformers' arithmetic (`--exact`, and every vocabulary projection).
    #[default]
    F32,
    /// Activations quantized to 8 bits per step, multiplied in integers with the weight blocks of
    /// formats that have such a kernel (`cpu::int8::supports`; on CUDA `matvec_q8`), as llama.cpp
    /// computes; other formats take f32.
    Int8,
}

pub trait Backend: Send + Sync + Clone {
    /// Row-major f32 activations `[rows, cols]` on the device.
    type Tensor: Send;
    /// A stored weight on the device (quantized blocks kept as they are).
    type Weight: Send + Sync;
    /// One layer's pool of KV blocks, shared by the sequences (each finds its positions through
    /// its block table, `KvSeq`).
    type KvCache: Send;
    /// One whole store file on the device; a layer's weights are views into it (`weight_in`).
    type Blob: Send + Sync;
    /// A point in the device's compute order, for timing (`mark`, `elapsed_ms`).
    type Mark: Send;

    /// A human-readable device name ("cpu", "cuda:0").
    fn name(&self) -> String;

    /// Runs `f`, a step of kernels, where this device's kernels launch cheapest (the CPU: on a
    /// thread of its compute pool; others: here).
    fn run_step<R: Send>(&self, f: impl FnOnce() -> R + Send) -> R {
        f()
    }

    /// Places a stored tensor on the device; `shape` is row-major with blocks along the last dim.
    fn weight(
        &self,
        name: &str,
        dtype: DType,
        shape: &[usize],
        bytes: &[u8],
    ) -> Result<Self::Weight>;
    /// Copies a whole file (e.g. a loader shm slot) to the device in one transfer. `streamed`: into one
    /// of the reusable streaming buffers (`stream_buffers`) rather than a new allocation. Returns the
    /// blob and, where the device times it, the transfer's own milliseconds.
    fn upload_blob(&self, bytes: &[u8], streamed: bool) -> Result<(Self::Blob, Option<f64>)>;
    /// A whole file the device computes from where it lies — host memory another owner maps and
    /// keeps unchanged until `bytes` drops (a loader slot, pinned) — instead of a copy: the CPU
    /// does, so a streamed layer costs no second copy and no second memory. None: the device must
    /// copy (`upload_blob`).
    fn map_blob(&self, _bytes: Arc<dyn MappedBytes>) -> Option<Self::Blob> {
        None
    }
    /// Whether `map_blob` maps (the device computes from host memory).
    fn maps_host(&self) -> bool {
        false
    }
    /// A weight stored at `range` of `blob` (no copy where the device allows).
    fn weight_in(
        &self,
        blob: &Self::Blob,
        name: &str,
        dtype: DType,
        shape: &[usize],
        range: std::ops::Range<usize>,
    ) -> Result<Self::Weight>;
    /// Allocates `count` streaming buffers of `bytes` each, once (replacing earlier ones).
    fn stream_buffers(&self, _count: usize, _bytes: usize) -> Result<()> {
        Ok(())
    }
    /// Registers host memory (a loader slot mapping) for direct device copies; idempotent.
    fn register_host(&self, _bytes: &[u8]) -> Result<()> {
        Ok(())
    }
    /// Undoes `register_host` before the memory is unmapped.
    fn unregister_host(&self, _bytes: &[u8]) {}
    /// Marks the current point of the compute order.
    fn mark(&self) -> Result<Self::Mark>;
    /// Milliseconds between two marks, waiting for the later one to complete.
    fn elapsed_ms(&self, start: &Self::Mark, end: &Self::Mark) -> Result<f64>;
    /// The greedy token of each row of `x` against the head `w`: the argmax of the f32-activation
    /// logits (`matmul` with `Precision::F32`, then `argmax_rows`); a backend may find the same
    /// tokens faster (the CPU screens them at 8 bits: `cpu::head_screen`).
    fn head_argmax(&self, x: &Self::Tensor, w: &Self::Weight) -> Result<Vec<u32>> {
        self.argmax_rows(&self.matmul(x, w, Precision::F32)?)
    }
    /// Readies `w` as a vocabulary projection for `head_argmax` at load time (the CPU computes each
    /// row's Σ|w| once, so a first request does not wait for it).
    fn prepare_head(&self, _w: &Self::Weight) {}
    /// Index of the largest value of each row (greedy sampling without copying logits back).
    fn argmax_rows(&self, t: &Self::Tensor) -> Result<Vec<u32>> {
        let (rows, cols) = self.dims(t);
        let host = self.to_host(t)?;
        host.chunks_exact(cols.max(1))
            .take(rows)
            .enumerate()
            .map(|(r, row)| {
                crate::host::check_logits(row, r).map(|()| crate::host::argmax(row) as u32)
            })
            .collect()
    }

    /// Whether `sample_rows` samples on this device (else the caller copies the logits back and
    /// samples on the host).
    fn samples_on_device(&self) -> bool {
        false
    }

    /// Samples each row of `logits` on the device, without copying them back: per row its token, or
    /// `None` where the row must be sampled on the host (from the row as left here: penalised
    /// already, so with no further penalty and the same draw). A row with no job gives token 0.
    /// Only called where `samples_on_device`.
    fn sample_rows(
        &self,
        _logits: &mut Self::Tensor,
        _jobs: &[Option<RowPick<'_>>],
    ) -> Result<Vec<Option<u32>>> {
        Err(crate::Error::Device(format!("{} samples on the host", self.name())))
    }

    /// Copies host activations to the device.
    // `self` is the device the tensor is created on, not the source of the conversion.
    #[allow(clippy::wrong_self_convention)]
    fn from_host(&self, data: &[f32], rows: usize, cols: usize) -> Result<Self::Tensor>;
    /// Copies activations back to the host.
    fn to_host(&self, t: &Self::Tensor) -> Result<Vec<f32>>;
    /// `(rows, cols)` of a tensor.
    fn dims(&self, t: &Self::Tensor) -> (usize, usize);
    /// Rows `[start, start + n)` of `t` as a new tensor.
    fn rows(&self, t: &Self::Tensor, start: usize, n: usize) -> Result<Self::Tensor>;
    /// Stacks tensors of equal width by rows.
    fn concat_rows(&self, parts: &[Self::Tensor]) -> Result<Self::Tensor>;

    /// Columns `[start, start + n)` of `t` as a new tensor (one head's slice of a projection). The
    /// default goes through the host.
    fn cols(&self, t: &Self::Tensor, start: usize, n: usize) -> Result<Self::Tensor> {
        let (rows, cols) = self.dims(t);
        crate::error::ensure(start + n <= cols, "cols", || {
            format!("columns {start}..{} of {cols}", start + n)
        })?;
        let host = self.to_host(t)?;
        let data: Vec<f32> = host
            .chunks_exact(cols.max(1))
            .flat_map(|r| r[start..start + n].iter().copied())
            .collect();
        self.from_host(&data, rows, n)
    }
    /// Tensors of equal row counts side by side, in order. The default goes through the host.
    fn concat_cols(&self, parts: &[&Self::Tensor]) -> Result<Self::Tensor> {
        let rows = parts.first().map_or(0, |p| self.dims(p).0);
        crate::error::ensure(parts.iter().all(|p| self.dims(p).0 == rows), "concat_cols", || {
            "row counts differ".into()
        })?;
        let hosts = parts.iter().map(|p| self.to_host(p)).collect::<Result<Vec<_>>>()?;
        let widths: Vec<usize> = parts.iter().map(|p| self.dims(p).1).collect();
        let mut data = Vec::with_capacity(rows * widths.iter().sum::<usize>());
        for r in 0..rows {
            for (h, &w) in hosts.iter().zip(&widths) {
                data.extend_from_slice(&h[r * w..(r + 1) * w]);
            }
        }
        self.from_host(&data, rows, widths.iter().sum())
    }
    /// Rows `idx` of `t`, in that order, as a new tensor (a mixture-of-experts layer's tokens for one
    /// expert). The default goes through the host.
    fn gather_rows(&self, t: &Self::Tensor, idx: &[usize]) -> Result<Self::Tensor> {
        let (rows, cols) = self.dims(t);
        crate::host::check_gather(rows, idx)?;
        let host = self.to_host(t)?;
        let data: Vec<f32> =
            idx.iter().flat_map(|&r| host[r * cols..(r + 1) * cols].iter().copied()).collect();
        self.from_host(&data, idx.len(), cols)
    }
    /// gpt-oss's clamped SwiGLU elementwise: `(clamp(u, ±limit) + 1) · g' · σ(alpha · g')` with
    /// `g' = min(g, limit)`. The default goes through the host.
    fn swiglu_clamp_mul(
        &self,
        g: &Self::Tensor,
        u: &Self::Tensor,
        alpha: f32,
        limit: f32,
    ) -> Result<Self::Tensor> {
        let (rows, cols) = self.dims(g);
        crate::error::ensure(self.dims(u) == (rows, cols), "swiglu_clamp_mul", || {
            format!("{:?} vs {:?}", self.dims(u), (rows, cols))
        })?;
        let (g, u) = (self.to_host(g)?, self.to_host(u)?);
        let out: Vec<f32> = g
            .iter()
            .zip(&u)
            .map(|(&a, &b)| crate::host::swiglu_clamp(a, b, alpha, limit))
            .collect();
        self.from_host(&out, rows, cols)
    }
    /// `relu(g)² · u` elementwise (BitNet's squared-ReLU gate). The default goes through the host.
    fn relu2_mul(&self, g: &Self::Tensor, u: &Self::Tensor) -> Result<Self::Tensor> {
        let (rows, cols) = self.dims(g);
        crate::error::ensure(self.dims(u) == (rows, cols), "relu2_mul", || {
            format!("{:?} vs {:?}", self.dims(u), (rows, cols))
        })?;
        let (g, u) = (self.to_host(g)?, self.to_host(u)?);
        let out: Vec<f32> = g.iter().zip(&u).map(|(&a, &b)| crate::host::relu2(a) * b).collect();
        self.from_host(&out, rows, cols)
    }
    /// Each row quantized to 8 bits by its absolute maximum and back, as transformers' BitLinear
    /// quantizes its input (`round(x·127/max|x|)` clamped to −128..127, divided back; ties to even).
    /// The default goes through the host.
    fn quant_rows_8bit(&self, t: &Self::Tensor) -> Result<Self::Tensor> {
        let (rows, cols) = self.dims(t);
        let mut host = self.to_host(t)?;
        host.chunks_exact_mut(cols.max(1)).for_each(crate::host::quant_row_8bit);
        self.from_host(&host, rows, cols)
    }
    /// `out[r, j] = t[r, perm[j]]`: activations put in the input order a weight is stored in (GPTQ
    /// act-order). The default goes through the host.
    fn permute_cols(&self, t: &Self::Tensor, perm: &[u32]) -> Result<Self::Tensor> {
        let (rows, cols) = self.dims(t);
        crate::host::check_perm(cols, perm)?;
        let host = self.to_host(t)?;
        let data: Vec<f32> = host
            .chunks_exact(cols.max(1))
            .take(rows)
            .flat_map(|row| perm.iter().map(move |&p| row[p as usize]))
            .collect();
        self.from_host(&data, rows, cols)
    }
    /// `acc[idx[i]] += scale[i] * y[i]` for every row `i` of `y` (an expert's output added into the
    /// layer's, weighted by the router). The default goes through the host.
    fn add_rows_scaled(
        &self,
        acc: &mut Self::Tensor,
        y: &Self::Tensor,
        idx: &[usize],
        scale: &[f32],
    ) -> Result<()> {
        let (rows, cols) = self.dims(acc);
        crate::host::check_add_rows((rows, cols), self.dims(y), idx, scale)?;
        let mut a = self.to_host(acc)?;
        let y = self.to_host(y)?;
        crate::host::add_rows_scaled(&mut a, &y, cols, idx, scale);
        *acc = self.from_host(&a, rows, cols)?;
        Ok(())
    }

    /// Gathers embedding rows for `ids` from a `[vocab, hidden]` table.
    fn embedding(&self, table: &Self::Weight, ids: &[u32]) -> Result<Self::Tensor>;
    /// `x[m, k] · w[n, k]ᵀ → [m, n]`, dequantizing `w` as needed, with activations in `p` (8-bit
    /// only where the backend has a kernel for `w`'s format; f32 otherwise).
    fn matmul(&self, x: &Self::Tensor, w: &Self::Weight, p: Precision) -> Result<Self::Tensor>;
    /// Adds a 1-D bias to every row.
    fn add_bias(&self, x: &mut Self::Tensor, bias: &Self::Weight) -> Result<()>;
    /// RMSNorm over groups of `weight.len()` columns (whole rows, or per head for q/k norms).
    fn rms_norm(&self, x: &Self::Tensor, weight: &Self::Weight, eps: f32) -> Result<Self::Tensor>;
    /// Rotates each head of `x` (HF half layout) at the given positions, one per row.
    fn rope(&self, x: &mut Self::Tensor, positions: &[usize], table: &RopeTable) -> Result<()>;
    /// `gelu_tanh(gate) * up` (GELU's tanh form, Gemma's GeGLU). The default goes through the host.
    fn gelu_tanh_mul(&self, gate: &Self::Tensor, up: &Self::Tensor) -> Result<Self::Tensor> {
        let (rows, cols) = self.dims(gate);
        crate::error::ensure(self.dims(up) == (rows, cols), "gelu_tanh_mul", || {
            "gate and up differ in size".into()
        })?;
        let (g, u) = (self.to_host(gate)?, self.to_host(up)?);
        let out: Vec<f32> =
            g.iter().zip(&u).map(|(&a, &b)| crate::host::gelu_tanh(a) * b).collect();
        self.from_host(&out, rows, cols)
    }
    /// `x *= s` (Gemma's embedding scale). The default goes through the host.
    fn scale(&self, x: &mut Self::Tensor, s: f32) -> Result<()> {
        let (rows, cols) = self.dims(x);
        let v: Vec<f32> = self.to_host(x)?.iter().map(|a| a * s).collect();
        *x = self.from_host(&v, rows, cols)?;
        Ok(())
    }
    /// `silu(gate) * up`.
    fn silu_mul(&self, gate: &Self::Tensor, up: &Self::Tensor) -> Result<Self::Tensor>;
    /// `x += y`.
    fn add(&self, x: &mut Self::Tensor, y: &Self::Tensor) -> Result<()>;

    /// One layer's KV pool (`layout.blocks` blocks of `layout.block` positions in `layout.dtype`).
    fn kv_cache(&self, shape: AttnShape, layout: KvLayout) -> Result<Self::KvCache>;
    /// Stores `k`, `v` (`[m, kv_dim]`) at positions `seq.start..` of one sequence (through its block
    /// table, quantized as the pool stores them), then computes attention for `q` (`[m, q_dim]`)
    /// over the sequence's positions `..seq.start + m`: causal — or, given a token tree's ancestor
    /// masks (`tree`, speculative decoding), new row i attends to the positions before
    /// `seq.start` and to the new rows whose bit is set in `tree[i]` (its ancestors and itself), so
    /// every root-to-leaf path computes as if fed alone. A tree has at most 64 new rows and runs on
    /// full-context layers only. Positions at and after `seq.start` are overwritten, so a rejected
    /// draft is forgotten by feeding from its first position again. `sinks` (gpt-oss, one per
    /// head): a logit each head's softmax counts in its denominator, with no value.
    #[allow(clippy::too_many_arguments)]
    fn attention(
        &self,
        q: &Self::Tensor,
        k: &Self::Tensor,
        v: &Self::Tensor,
        cache: &mut Self::KvCache,
        seq: KvSeq<'_>,
        shape: AttnShape,
        tree: Option<&[u64]>,
        sinks: Option<&[f32]>,
    ) -> Result<Self::Tensor>;
    /// Block `block` of a pool as bytes (its keys, then its values), for a host tier.
    fn kv_read(&self, cache: &Self::KvCache, block: u32) -> Result<Vec<u8>>;
    /// Writes what `kv_read` gave back into block `block` of a pool of the same layout.
    fn kv_write(&self, cache: &mut Self::KvCache, block: u32, bytes: &[u8]) -> Result<()>;
}
