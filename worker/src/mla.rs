//! Multi-head latent attention (DeepSeek-V3) in its absorbed form. Each position caches one row:
//! the normed latent `c` (`kv_lora_rank`) and the RoPE key `k_r` — one kv head that every query
//! head attends to. Head h's query is mapped into the latent space by its key block
//! (`q_lat = q_nope · W_UKᵀ`, the store's `k_b`), so its score against position t is
//! `q_lat · c_t + q_rope · k_r,t`, exactly the expanded head's `q_nope · k_nope + q_rope · k_rope`;
//! its output is the attended latent (the first `kv_lora_rank` columns, the values being the keys)
//! mapped out by its value block (`v_b`).

use crate::error::{Error, Result};
use crate::forward::{attend, LayerCtx, SeqRows};
use layerstream_kernels::{AttnShape, Backend, RopeTable};
use layerstream_model::config_mla::MlaConfig;
use layerstream_model::{FileEntry, ModelConfig};

/// One MLA layer's attention weights on a device; `k_b` and `v_b` as one view per head.
pub struct MlaWeights<B: Backend> {
    q_a: Option<(B::Weight, B::Weight)>,
    q_nope_b: B::Weight,
    q_rope_b: B::Weight,
    kv_a: B::Weight,
    k_rope_a: B::Weight,
    kv_a_norm: B::Weight,
    k_b: Vec<B::Weight>,
    v_b: Vec<B::Weight>,
}

/// A layer's tensor by name, shape checked (`weights::LayerWeights::from_blob`'s reader).
pub type Reader<'a, B> = &'a dyn Fn(&str) -> Result<Option<<B as Backend>::Weight>>;

impl<B: Backend> MlaWeights<B> {
    /// The MLA tensors of a layer file already on the device.
    pub fn from_blob(
        b: &B,
        cfg: &ModelConfig,
        m: &MlaConfig,
        entry: &FileEntry,
        blob: &B::Blob,
        opt: Reader<'_, B>,
    ) -> Result<Self> {
        let req = |name: &str| {
            opt(name)?
                .ok_or_else(|| Error::Weights(format!("{}: missing tensor {name}", entry.name)))
        };
        // Per-head views of a `[heads · rows, cols]` tensor (its shape was checked by `req`).
        let heads = |name: &str, rows: usize| -> Result<Vec<B::Weight>> {
            req(name)?;
            let t = entry.tensor(name).expect("read above");
            let per = t.size as usize / cfg.num_heads;
            (0..cfg.num_heads)
                .map(|h| {
                    let start = t.offset as usize + h * per;
                    let shape = [rows, t.shape[1]];
                    let label = format!("{}:{name}[{h}]", entry.name);
                    Ok(b.weight_in(blob, &label, t.dtype, &shape, start..start + per)?)
                })
                .collect()
        };
        Ok(MlaWeights {
            q_a: match m.q_lora_rank {
                Some(_) => Some((req("q_a")?, req("q_a_norm")?)),
                None => None,
            },
            q_nope_b: req("q_nope_b")?,
            q_rope_b: req("q_rope_b")?,
            kv_a: req("kv_a")?,
            k_rope_a: req("k_rope_a")?,
            kv_a_norm: req("kv_a_norm")?,
            k_b: heads("k_b", m.kv_lora_rank)?,
            v_b: heads("v_b", m.v_head_dim)?,
        })
    }
}

/// MLA over the normed rows `h` of a batch (at positions `pos`, with the layer's attention shape
/// and RoPE table): stores each row's latent + RoPE key in `pool` and
/// returns every head's output side by side (`[rows, heads · v_head_dim]`, before `o`).
pub fn mla_attention<B: Backend>(
    b: &B,
    ctx: &LayerCtx,
    w: &MlaWeights<B>,
    h: &B::Tensor,
    seqs: &[SeqRows],
    (pos, shape, rope): (&[usize], AttnShape, &RopeTable),
    pool: &mut B::KvCache,
) -> Result<B::Tensor> {
    let m = ctx.mla.as_ref().ok_or_else(|| Error::Weights("MLA weights, no MLA config".into()))?;
    let (r, nope, rd) = (m.kv_lora_rank, m.qk_nope_head_dim, m.qk_rope_head_dim);
    let q_low = match &w.q_a {
        Some((a, norm)) => Some(b.rms_norm(&b.matmul(h, a, ctx.precision)?, norm, ctx.eps)?),
        None => None,
    };
    let q_in = q_low.as_ref().unwrap_or(h);
    let q_nope = b.matmul(q_in, &w.q_nope_b, ctx.precision)?;
    let mut q_rope = b.matmul(q_in, &w.q_rope_b, ctx.precision)?;
    b.rope(&mut q_rope, pos, rope)?;
    let latent = b.rms_norm(&b.matmul(h, &w.kv_a, ctx.precision)?, &w.kv_a_norm, ctx.eps)?;
    let mut k_rope = b.matmul(h, &w.k_rope_a, ctx.precision)?;
    b.rope(&mut k_rope, pos, rope)?;
    let key = b.concat_cols(&[&latent, &k_rope])?;
    // Each head's query: its non-RoPE part mapped into the latent space, then its RoPE part.
    let mut parts = Vec::with_capacity(2 * w.k_b.len());
    for (i, k_b) in w.k_b.iter().enumerate() {
        parts.push(b.matmul(&b.cols(&q_nope, i * nope, nope)?, k_b, ctx.precision)?);
        parts.push(b.cols(&q_rope, i * rd, rd)?);
    }
    let q = b.concat_cols(&parts.iter().collect::<Vec<_>>())?;
    let out = attend(b, (&q, &key, &key), pool, seqs, shape, None)?;
    let heads: Vec<B::Tensor> = w
        .v_b
        .iter()
        .enumerate()
        .map(|(i, v_b)| Ok(b.matmul(&b.cols(&out, i * (r + rd), r)?, v_b, ctx.precision)?))
        .collect::<Result<_>>()?;
    Ok(b.concat_cols(&heads.iter().collect::<Vec<_>>())?)
}
