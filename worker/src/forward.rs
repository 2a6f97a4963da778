//! The forward pass of decoder layers over a batch of sequences, each with its own KV cache.
//!
//! Matmuls run once over the rows of every sequence in the batch (one weight pass serves them all);
//! attention runs per sequence against that sequence's blocks of the layer's KV pool.

use crate::error::{Error, Result};
use crate::moe::{moe_mlp, ExpertCounts, ExpertSource};
use crate::weights::{LayerWeights, Mlp};
use layerstream_kernels::{AttnShape, Backend, KvSeq, Precision, RopeTable};
use layerstream_model::ModelConfig;

/// One sequence's share of a batch: how many rows it contributes, the position of the first, and
/// the KV blocks its positions live in (every layer's pool alike); for a token tree (speculative
/// decoding), every row's ancestor mask over the tree's positions from `tree_from` (= `start_pos`,
/// or earlier where a draft model grows a tree it cached in part), a row at `tree_from` + its
/// depth − 1, attending to the cache before `tree_from` and to its ancestors.
#[derive(Debug, Clone, PartialEq)]
pub struct SeqRows {
    pub(crate) rows: usize,
    pub(crate) start_pos: usize,
    pub(crate) tree: Option<Vec<u64>>,
    pub(crate) tree_from: usize,
    pub(crate) blocks: Vec<u32>,
}

/// The ancestor masks of a sequence's rows when its last `parents.len()` rows are a token tree
/// hanging from the row before them (`parents[i]`: the parent of tree node i as an offset from that
/// row, 0 = the row itself, i = node i - 1); every earlier row is causal. None without a tree.
pub fn tree_masks(rows: usize, parents: &[u32]) -> Option<Vec<u64>> {
    if parents.is_empty() {
        return None;
    }
    let root = rows - parents.len() - 1;
    let mut anc: Vec<u64> = (0..=root).map(|r| u64::MAX >> (63 - r)).collect();
    for (i, &p) in parents.iter().enumerate() {
        let me = root + 1 + i;
        anc.push(anc[root + p as usize] | 1 << me);
    }
    Some(anc)
}

/// Per-model constants the layers need.
pub struct LayerCtx {
    /// The attention of full-context layers (every layer but Gemma's sliding-window ones).
    pub(crate) shape: AttnShape,
    pub(crate) rope: RopeTable,
    /// The sliding-window layers where only some layers have a window (Gemma 3, gpt-oss): their
    /// attention, RoPE and which layers they are.
    pub(crate) local: Option<(AttnShape, RopeTable, Vec<usize>)>,
    pub(crate) eps: f32,
    pub(crate) moe: Option<layerstream_model::MoeConfig>,
    /// Gemma: GELU (tanh) gating and embeddings scaled by √hidden.
    pub(crate) gelu: bool,
    /// BitNet: squared-ReLU gating, and (BitLinear weights) every projection's input quantized per
    /// row to 8 bits first.
    pub(crate) relu2: bool,
    pub(crate) act_quant: bool,
    pub(crate) embed_scale: Option<f32>,
    /// Multi-head latent attention (DeepSeek-V3).
    pub(crate) mla: Option<layerstream_model::config_mla::MlaConfig>,
    /// A speculative draft model: 8-bit activations everywhere, its vocabulary projection included,
    /// whatever the process uses — its near-ties cost at most a rejected token, never a changed
    /// output.
    pub(crate) draft: bool,
    /// The decoder layers' activations (`Precision::Int8`: the CPU's default, see
    /// `int8_by_default`; a draft model's always).
    pub(crate) precision: Precision,
}

impl LayerCtx {
    /// Derives the attention shapes and RoPE tables from a config.
    pub fn new(cfg: &ModelConfig) -> Self {
        let mut shape = AttnShape::new(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim);
        let g = cfg.gemma.as_ref();
        if let Some(g) = g {
            shape.scale = (1.0 / g.query_pre_attn_scalar.sqrt()) as f32;
        }
        let sliding: Vec<usize> =
            (0..cfg.num_layers).filter(|&l| cfg.window_at(l).is_some()).collect();
        if let Some(m) = &cfg.mla {
            // MLA's absorbed form: every head attends to one kv head of latent + RoPE key, which
            // is also its value (the output's first `kv_lora_rank` columns).
            shape = AttnShape {
                n_kv_heads: 1,
                head_dim: m.cache_dim(),
                scale: m.softmax_scale as f32,
                shared_kv: true,
                ..shape
            };
        }
        let local = match (g, cfg.sliding_window) {
            (Some(g), _) => Some((
                AttnShape { window: g.sliding_window, ..shape },
                RopeTable::new(&g.local_rope, cfg.head_dim),
                sliding,
            )),
            // Some layers windowed (gpt-oss), with the model's one RoPE.
            (None, Some(w)) if !cfg.full_attention_layers.is_empty() => Some((
                AttnShape { window: w, ..shape },
                RopeTable::new(&cfg.rope, cfg.head_dim),
                sliding,
            )),
            // Every layer windowed (Mistral), or none.
            (None, w) => {
                shape.window = w.unwrap_or(0);
                None
            }
        };
        LayerCtx {
            shape,
            rope: RopeTable::new(&cfg.rope, cfg.head_dim),
            local,
            eps: cfg.rms_norm_eps as f32,
            moe: cfg.moe.clone(),
            gelu: g.is_some(),
            relu2: cfg.arch == layerstream_model::Arch::BitNet,
            act_quant: cfg.bitlinear,
            // transformers multiplies by √hidden cast to the activations' dtype (f32 here).
            embed_scale: g.map(|_| (cfg.hidden_size as f32).sqrt()),
            mla: cfg.mla.clone(),
            draft: false,
            precision: Precision::F32,
        }
    }

    /// The same constants with the layers' activations in `p`.
    pub fn with_precision(mut self, p: Precision) -> Self {
        self.precision = p;
        self
    }

    /// Whether any layer has a sliding window (token trees are refused there).
    pub fn windowed(&self) -> bool {
        self.shape.window > 0 || self.local.is_some()
    }

    /// Layer `layer`'s attention and RoPE.
    pub fn attn(&self, layer: u32) -> (AttnShape, &RopeTable) {
        match &self.local {
            Some((s, r, sliding)) if sliding.contains(&(layer as usize)) => (*s, r),
            _ => (self.shape, &self.rope),
        }
    }
}

/// The rows of `ids` from the embedding table, scaled as the model says.
pub fn embed<B: Backend>(
    b: &B,
    ctx: &LayerCtx,
    table: &B::Weight,
    ids: &[u32],
) -> Result<B::Tensor> {
    let mut x = b.embedding(table, ids)?;
    if let Some(s) = ctx.embed_scale {
        b.scale(&mut x, s)?;
    }
    Ok(x)
}

/// `x · wᵀ (+ bias)`; `perm`: `w` is stored in that input order (GPTQ act-order), so `x`'s columns
/// are permuted the same way first; `oscale`: the product is multiplied by it (BitLinear).
fn proj<B: Backend>(
    b: &B,
    ctx: &LayerCtx,
    x: &B::Tensor,
    w: &B::Weight,
    bias: Option<&B::Weight>,
    perm: Option<&[u32]>,
    oscale: Option<f32>,
) -> Result<B::Tensor> {
    let mut y = match perm {
        Some(p) => b.matmul(&b.permute_cols(x, p)?, w, ctx.precision)?,
        None => b.matmul(x, w, ctx.precision)?,
    };
    if let Some(s) = oscale {
        b.scale(&mut y, s)?;
    }
    if let Some(bias) = bias {
        b.add_bias(&mut y, bias)?;
    }
    Ok(y)
}

/// A BitLinear's input: each row quantized to 8 bits by its absolute maximum and back (BitNet);
/// anything else as it is.
fn quant<B: Backend>(b: &B, ctx: &LayerCtx, x: B::Tensor) -> Result<B::Tensor> {
    if ctx.act_quant {
        Ok(b.quant_rows_8bit(&x)?)
    } else {
        Ok(x)
    }
}

/// Where a sequence's rows go in a layer's KV pool.
fn kv_seq(s: &SeqRows) -> KvSeq<'_> {
    KvSeq { table: &s.blocks, start: s.start_pos, tree_from: s.tree_from }
}

/// Positions of every row of a batch, in order (a tree row's: the first row's plus its depth).
pub fn positions(seqs: &[SeqRows]) -> Vec<usize> {
    seqs.iter()
        .flat_map(|s| match &s.tree {
            None => (s.start_pos..s.start_pos + s.rows).collect::<Vec<_>>(),
            Some(anc) => anc.iter().map(|a| s.tree_from + a.count_ones() as usize - 1).collect(),
        })
        .collect()
}

/// Attention of a batch's q, k and v rows, sequence by sequence, each over its own blocks of
/// `pool` (stacked back in `seqs` order).
pub(crate) fn attend<B: Backend>(
    b: &B,
    (q, k, v): (&B::Tensor, &B::Tensor, &B::Tensor),
    pool: &mut B::KvCache,
    seqs: &[SeqRows],
    shape: AttnShape,
    sinks: Option<&[f32]>,
) -> Result<B::Tensor> {
    if seqs.len() == 1 {
        let tree = seqs[0].tree.as_deref();
        return Ok(b.attention(q, k, v, pool, kv_seq(&seqs[0]), shape, tree, sinks)?);
    }
    let mut parts = Vec::with_capacity(seqs.len());
    let mut off = 0;
    for s in seqs {
        let (qs, ks, vs) =
            (b.rows(q, off, s.rows)?, b.rows(k, off, s.rows)?, b.rows(v, off, s.rows)?);
        let tree = s.tree.as_deref();
        parts.push(b.attention(&qs, &ks, &vs, pool, kv_seq(s), shape, tree, sinks)?);
        off += s.rows;
    }
    Ok(b.concat_rows(&parts)?)
}

/// Runs decoder layer `layer` in place on `x` (rows of all sequences, stacked in `seqs` order).
/// `pool` is this layer's KV pool (each sequence's positions at its `blocks`); a mixture-of-experts
/// layer takes its experts from `experts` and returns what they cost.
#[allow(clippy::too_many_arguments)]
pub fn layer_forward<B: Backend>(
    b: &B,
    ctx: &LayerCtx,
    layer: u32,
    w: &LayerWeights<B>,
    x: &mut B::Tensor,
    seqs: &[SeqRows],
    pool: &mut B::KvCache,
    experts: &mut dyn ExpertSource<B>,
) -> Result<ExpertCounts> {
    let pos = positions(seqs);
    let (shape, rope) = ctx.attn(layer);
    let h = quant(b, ctx, b.rms_norm(x, &w.attn_norm, ctx.eps)?)?;
    let (p, s) = (&w.perms, &w.oscales);
    let attn = match (&w.qkv, &w.mla) {
        (_, Some(mw)) => {
            crate::mla::mla_attention(b, ctx, mw, &h, seqs, (&pos, shape, rope), pool)?
        }
        (Some([wq, wk, wv]), None) => {
            let mut q = proj(b, ctx, &h, wq, w.q_bias.as_ref(), p.q.as_deref(), s.q)?;
            let mut k = proj(b, ctx, &h, wk, w.k_bias.as_ref(), p.k.as_deref(), s.k)?;
            let v = proj(b, ctx, &h, wv, w.v_bias.as_ref(), p.v.as_deref(), s.v)?;
            if let (Some(qn), Some(kn)) = (&w.q_norm, &w.k_norm) {
                q = b.rms_norm(&q, qn, ctx.eps)?;
                k = b.rms_norm(&k, kn, ctx.eps)?;
            }
            b.rope(&mut q, &pos, rope)?;
            b.rope(&mut k, &pos, rope)?;
            attend(b, (&q, &k, &v), pool, seqs, shape, w.sinks.as_deref())?
        }
        (None, None) => return Err(Error::Weights(format!("layer {layer} has no attention"))),
    };
    let attn = match &w.attn_sub_norm {
        Some(n) => b.rms_norm(&attn, n, ctx.eps)?,
        None => attn,
    };
    let attn = quant(b, ctx, attn)?;
    let mut o = proj(b, ctx, &attn, &w.o, w.o_bias.as_ref(), p.o.as_deref(), s.o)?;
    if let Some(n) = &w.attn_post_norm {
        o = b.rms_norm(&o, n, ctx.eps)?;
    }
    b.add(x, &o)?;
    let h2 = b.rms_norm(x, &w.ffn_norm, ctx.eps)?;
    let (mut d, counts) = match &w.mlp {
        Mlp::Dense { gate, up, down } => {
            let h2 = quant(b, ctx, h2)?;
            let g = proj(b, ctx, &h2, gate, None, p.gate.as_deref(), s.gate)?;
            let u = proj(b, ctx, &h2, up, None, p.up.as_deref(), s.up)?;
            let a = if ctx.gelu {
                b.gelu_tanh_mul(&g, &u)?
            } else if ctx.relu2 {
                b.relu2_mul(&g, &u)?
            } else {
                b.silu_mul(&g, &u)?
            };
            let a = match &w.ffn_sub_norm {
                Some(n) => b.rms_norm(&a, n, ctx.eps)?,
                None => a,
            };
            let a = quant(b, ctx, a)?;
            (proj(b, ctx, &a, down, None, p.down.as_deref(), s.down)?, ExpertCounts::default())
        }
        Mlp::Experts { shared, .. } => {
            let m = ctx.moe.as_ref().ok_or_else(|| {
                Error::Weights(format!("layer {layer} has a router but the model has no experts"))
            })?;
            let router = w.mlp.router().expect("an experts layer has a router");
            let (mut d, counts) = moe_mlp(b, ctx.precision, layer, &h2, &router, m, experts)?;
            if let Some([g, u, dn]) = shared {
                // DeepSeek-V3's shared experts: every token's, beside the routed ones.
                let p = ctx.precision;
                let a = b.silu_mul(&b.matmul(&h2, g, p)?, &b.matmul(&h2, u, p)?)?;
                b.add(&mut d, &b.matmul(&a, dn, p)?)?;
            }
            (d, counts)
        }
    };
    if let Some(n) = &w.ffn_post_norm {
        d = b.rms_norm(&d, n, ctx.eps)?;
    }
    b.add(x, &d)?;
    Ok(counts)
}

/// The final norm of the last `tails[i]` rows of each sequence `i` (1 each when `tails` is empty):
/// what the vocabulary projection takes.
fn head_input<B: Backend>(
    b: &B,
    ctx: &LayerCtx,
    x: &B::Tensor,
    seqs: &[SeqRows],
    tails: &[usize],
    norm: &B::Weight,
) -> Result<B::Tensor> {
    let mut last = Vec::with_capacity(seqs.len());
    let mut off = 0;
    for (i, s) in seqs.iter().enumerate() {
        off += s.rows;
        let n = tails.get(i).copied().unwrap_or(1).clamp(1, s.rows);
        last.push(b.rows(x, off - n, n)?);
    }
    let last = if last.len() == 1 { last.pop().expect("one part") } else { b.concat_rows(&last)? };
    Ok(b.rms_norm(&last, norm, ctx.eps)?)
}

/// Final norm and lm_head on the last `tails[i]` rows of each sequence `i` (1 each when `tails` is
/// empty; more where a step verifies a draft): logits `[Σ tails, vocab]` on the device.
pub fn head_tensor<B: Backend>(
    b: &B,
    ctx: &LayerCtx,
    x: &B::Tensor,
    seqs: &[SeqRows],
    tails: &[usize],
    norm: &B::Weight,
    lm_head: &B::Weight,
) -> Result<B::Tensor> {
    let h = head_input(b, ctx, x, seqs, tails, norm)?;
    // f32 activations for the vocabulary projection whatever the layers use, but in a draft model:
    // its argmax decides between near-tied tokens (SmolLM2's "What is the capital of France?"
    // opens with "The" at −1.88 against "L" at −1.96, and 8-bit activations here swapped them).
    let p = if ctx.draft { ctx.precision } else { Precision::F32 };
    Ok(b.matmul(&h, lm_head, p)?)
}

/// The greedy token of each sequence's last row: `head_tensor`'s argmax, without the logits where
/// the backend finds the same tokens faster (`Backend::head_argmax`; a draft model keeps its own
/// precision's logits).
pub fn head_argmax<B: Backend>(
    b: &B,
    ctx: &LayerCtx,
    x: &B::Tensor,
    seqs: &[SeqRows],
    norm: &B::Weight,
    lm_head: &B::Weight,
) -> Result<Vec<u32>> {
    if ctx.draft {
        return Ok(b.argmax_rows(&head_tensor(b, ctx, x, seqs, &[], norm, lm_head)?)?);
    }
    Ok(b.head_argmax(&head_input(b, ctx, x, seqs, &[], norm)?, lm_head)?)
}

/// `head_tensor` copied to the host: one logits vector per row (per sequence without tails).
pub fn head_logits<B: Backend>(
    b: &B,
    ctx: &LayerCtx,
    x: &B::Tensor,
    seqs: &[SeqRows],
    tails: &[usize],
    norm: &B::Weight,
    lm_head: &B::Weight,
) -> Result<Vec<Vec<f32>>> {
    let logits = logits_to_host(b, &head_tensor(b, ctx, x, seqs, tails, norm, lm_head)?)?;
    Ok(logits)
}

/// Logits `[sequences, vocab]` copied to the host, one vector per sequence.
pub fn logits_to_host<B: Backend>(b: &B, logits: &B::Tensor) -> Result<Vec<Vec<f32>>> {
    let (_, vocab) = b.dims(logits);
    Ok(b.to_host(logits)?.chunks_exact(vocab).map(<[f32]>::to_vec).collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Rows before the tree are causal; each tree node sees the root's context and its ancestors;
    /// its position is the root's plus its depth.
    #[test]
    fn tree_masks_and_positions() {
        // Two refed rows, the root (row 2), then nodes 3 (child of root), 4 (child of root),
        // 5 (child of node 3).
        let anc = tree_masks(6, &[0, 0, 1]).unwrap();
        assert_eq!(anc, vec![0b1, 0b11, 0b111, 0b1111, 0b10111, 0b101111]);
        let s = SeqRows { rows: 6, start_pos: 10, tree: Some(anc), tree_from: 10, blocks: vec![] };
        let chain = SeqRows { rows: 2, start_pos: 3, tree: None, tree_from: 3, blocks: vec![] };
        // A tree's last two nodes fed after its first four were cached: masks from position 10.
        let grown = SeqRows {
            rows: 2,
            start_pos: 14,
            tree: Some(vec![0b10111, 0b101111]),
            tree_from: 10,
            blocks: vec![],
        };
        assert_eq!(positions(&[s, chain, grown]), vec![10, 11, 12, 13, 13, 14, 3, 4, 13, 14]);
        assert!(tree_masks(3, &[]).is_none());
    }
}
