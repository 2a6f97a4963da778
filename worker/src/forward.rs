//! The forward pass of decoder layers over a batch of sequences, each with its own KV cache.
//!
//! Matmuls run once over the rows of every sequence in the batch (one weight pass serves them all);
//! attention runs per sequence against that sequence's cache.

use crate::error::Result;
use crate::weights::LayerWeights;
use layerstream_kernels::{AttnShape, Backend, RopeTable};
use layerstream_model::ModelConfig;

/// One sequence's share of a batch: how many rows it contributes and the position of the first.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SeqRows {
    pub rows: usize,
    pub start_pos: usize,
}

/// Per-model constants the layers need.
pub struct LayerCtx {
    pub shape: AttnShape,
    pub rope: RopeTable,
    pub eps: f32,
}

impl LayerCtx {
    /// Derives the attention shape and RoPE table from a config.
    pub fn new(cfg: &ModelConfig) -> Self {
        LayerCtx {
            shape: AttnShape {
                n_heads: cfg.num_heads,
                n_kv_heads: cfg.num_kv_heads,
                head_dim: cfg.head_dim,
            },
            rope: RopeTable::new(&cfg.rope, cfg.head_dim),
            eps: cfg.rms_norm_eps as f32,
        }
    }
}

fn proj<B: Backend>(
    b: &B,
    x: &B::Tensor,
    w: &B::Weight,
    bias: Option<&B::Weight>,
) -> Result<B::Tensor> {
    let mut y = b.matmul(x, w)?;
    if let Some(bias) = bias {
        b.add_bias(&mut y, bias)?;
    }
    Ok(y)
}

/// Positions of every row of a batch, in order.
pub fn positions(seqs: &[SeqRows]) -> Vec<usize> {
    seqs.iter().flat_map(|s| s.start_pos..s.start_pos + s.rows).collect()
}

/// Runs one decoder layer in place on `x` (rows of all sequences, stacked in `seqs` order).
/// `caches[i]` is sequence i's KV cache for this layer.
pub fn layer_forward<B: Backend>(
    b: &B,
    ctx: &LayerCtx,
    w: &LayerWeights<B>,
    x: &mut B::Tensor,
    seqs: &[SeqRows],
    caches: &mut [&mut B::KvCache],
) -> Result<()> {
    let pos = positions(seqs);
    let h = b.rms_norm(x, &w.attn_norm, ctx.eps)?;
    let mut q = proj(b, &h, &w.q, w.q_bias.as_ref())?;
    let mut k = proj(b, &h, &w.k, w.k_bias.as_ref())?;
    let v = proj(b, &h, &w.v, w.v_bias.as_ref())?;
    if let (Some(qn), Some(kn)) = (&w.q_norm, &w.k_norm) {
        q = b.rms_norm(&q, qn, ctx.eps)?;
        k = b.rms_norm(&k, kn, ctx.eps)?;
    }
    b.rope(&mut q, &pos, &ctx.rope)?;
    b.rope(&mut k, &pos, &ctx.rope)?;
    let attn = if seqs.len() == 1 {
        b.attention(&q, &k, &v, caches[0], ctx.shape)?
    } else {
        let mut parts = Vec::with_capacity(seqs.len());
        let mut off = 0;
        for (s, cache) in seqs.iter().zip(caches.iter_mut()) {
            let (qs, ks, vs) =
                (b.rows(&q, off, s.rows)?, b.rows(&k, off, s.rows)?, b.rows(&v, off, s.rows)?);
            parts.push(b.attention(&qs, &ks, &vs, cache, ctx.shape)?);
            off += s.rows;
        }
        b.concat_rows(&parts)?
    };
    let o = proj(b, &attn, &w.o, w.o_bias.as_ref())?;
    b.add(x, &o)?;
    let h2 = b.rms_norm(x, &w.ffn_norm, ctx.eps)?;
    let g = b.matmul(&h2, &w.gate)?;
    let u = b.matmul(&h2, &w.up)?;
    let a = b.silu_mul(&g, &u)?;
    let d = b.matmul(&a, &w.down)?;
    b.add(x, &d)?;
    Ok(())
}

/// Final norm and lm_head on the last row of each sequence: logits `[sequences, vocab]` on the device.
pub fn head_tensor<B: Backend>(
    b: &B,
    ctx: &LayerCtx,
    x: &B::Tensor,
    seqs: &[SeqRows],
    norm: &B::Weight,
    lm_head: &B::Weight,
) -> Result<B::Tensor> {
    let mut last = Vec::with_capacity(seqs.len());
    let mut off = 0;
    for s in seqs {
        off += s.rows;
        last.push(b.rows(x, off - 1, 1)?);
    }
    let last = b.concat_rows(&last)?;
    let h = b.rms_norm(&last, norm, ctx.eps)?;
    Ok(b.matmul(&h, lm_head)?)
}

/// `head_tensor` copied to the host: one logits vector per sequence.
pub fn head_logits<B: Backend>(
    b: &B,
    ctx: &LayerCtx,
    x: &B::Tensor,
    seqs: &[SeqRows],
    norm: &B::Weight,
    lm_head: &B::Weight,
) -> Result<Vec<Vec<f32>>> {
    let logits = logits_to_host(b, &head_tensor(b, ctx, x, seqs, norm, lm_head)?)?;
    debug_assert_eq!(logits.len(), seqs.len());
    Ok(logits)
}

/// Logits `[sequences, vocab]` copied to the host, one vector per sequence.
pub fn logits_to_host<B: Backend>(b: &B, logits: &B::Tensor) -> Result<Vec<Vec<f32>>> {
    let (_, vocab) = b.dims(logits);
    Ok(b.to_host(logits)?.chunks_exact(vocab).map(<[f32]>::to_vec).collect())
}
