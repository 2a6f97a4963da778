//! A model held on one backend: embedding, a range of decoder layers, final norm and lm_head.
//! `forward` runs a batch of sequences through the layers and returns each one's last-row logits.

use crate::error::{Error, Result};
use crate::forward::{head_argmax, head_logits, layer_forward, LayerCtx, SeqRows};
use crate::moe::ResidentExperts;
use crate::weights::{need, LayerWeights};
use layerstream_kernels::{Backend, KvLayout, Precision};
use layerstream_model::layout::layer_file;
use layerstream_model::{DType, ModelConfig, Store};
use layerstream_serving::kv_blocks::{BlockPool, SeqBlocks};
use std::sync::{Arc, Mutex};

/// How a model stores keys and values: dtype, positions per block, positions in all.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct KvOptions {
    pub dtype: DType,
    pub block: usize,
    pub positions: usize,
}

impl KvOptions {
    /// f32 keys and values in blocks of 16 (exact: what transformers computes), room for `positions`.
    pub fn exact(positions: usize) -> KvOptions {
        KvOptions { dtype: DType::F32, block: 16, positions }
    }
}

/// One sequence: its blocks in the model's KV pools and the positions processed so far. Dropping
/// it gives its blocks back.
pub struct SeqState {
    blocks: SeqBlocks,
    pool: Arc<Mutex<BlockPool>>,
    /// Positions processed so far.
    pub len: usize,
}

impl Drop for SeqState {
    fn drop(&mut self) {
        lock(&self.pool).release(&mut self.blocks);
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// A fully resident model.
pub struct Model<B: Backend> {
    pub cfg: ModelConfig,
    pub backend: B,
    pub ctx: LayerCtx,
    embed: B::Weight,
    layers: Vec<LayerWeights<B>>,
    experts: ResidentExperts<B>,
    norm: B::Weight,
    lm_head: Option<B::Weight>,
    /// Each layer's KV pool, and which of their blocks each sequence holds.
    pools: Mutex<Vec<B::KvCache>>,
    blocks: Arc<Mutex<BlockPool>>,
}

impl<B: Backend> Model<B> {
    /// Loads every file of `store` onto `backend`, with exact (f32) KV pools for a context's worth of
    /// positions (taken as used on the CPU).
    pub fn load(backend: B, store: &Store) -> Result<Self> {
        let positions = store.manifest.config.max_position_embeddings.clamp(1, 1 << 17);
        Self::load_kv(backend, store, KvOptions::exact(positions))
    }

    /// Loads every file of `store` onto `backend`, with KV pools as `kv` says.
    pub fn load_kv(backend: B, store: &Store, kv: KvOptions) -> Result<Self> {
        let cfg = store.manifest.config.clone();
        let (h, vocab) = (cfg.hidden_size, cfg.vocab_size);
        let load = |f, name: &str, shape: &[usize]| need(&backend, f, name, shape);
        let embed = crate::weights::embedding(&backend, store, cfg.tie_word_embeddings)?;
        let norm = load(store.load("final_norm.bin")?, "final_norm", &[h])?;
        let lm_head = if cfg.tie_word_embeddings {
            None
        } else {
            Some(load(store.load("lm_head.bin")?, "lm_head", &[vocab, h])?)
        };
        backend.prepare_head(lm_head.as_ref().unwrap_or(&embed));
        let layers = (0..cfg.num_layers)
            .map(|i| LayerWeights::load(&backend, &cfg, &store.load(&layer_file(i))?))
            .collect::<Result<Vec<_>>>()?;
        let experts = ResidentExperts::load(&backend, store, 0..cfg.num_layers as u32)?;
        let ctx = LayerCtx::new(&cfg);
        let blocks = kv.positions.div_ceil(kv.block);
        let layout = KvLayout::new(kv.dtype, kv.block, blocks, ctx.shape)?;
        let pools = (0..layers.len())
            .map(|l| backend.kv_cache(ctx.attn(l as u32).0, layout))
            .collect::<std::result::Result<Vec<_>, _>>()?;
        Ok(Model {
            ctx,
            cfg,
            backend,
            embed,
            layers,
            experts,
            norm,
            lm_head,
            pools: Mutex::new(pools),
            blocks: Arc::new(Mutex::new(BlockPool::new(blocks, kv.block, false))),
        })
    }

    /// This model as a speculative-decoding draft: 8-bit activations in every product, the
    /// vocabulary projection included, even under `--exact` — a draft's arithmetic only proposes
    /// tokens (SmolLM2-135M's CPU head: 2.4 → 0.7 ms a token).
    pub fn into_draft(mut self) -> Self {
        self.ctx.draft = true;
        self.ctx.precision = Precision::Int8;
        self
    }

    /// The same model with its decoder layers' activations in `p` (loaded: `Precision::F32`);
    /// the vocabulary projection stays f32 (`forward::head_tensor`).
    pub fn with_precision(mut self, p: Precision) -> Self {
        self.ctx.precision = p;
        self
    }

    /// A fresh sequence, holding no blocks yet.
    pub fn new_sequence(&self) -> SeqState {
        SeqState { blocks: SeqBlocks::default(), pool: self.blocks.clone(), len: 0 }
    }

    /// Feeds `tokens[i]` to sequence `i` (prefill or decode alike) and returns each sequence's
    /// logits at its last new position.
    pub fn forward(&self, batch: &mut [(&[u32], &mut SeqState)]) -> Result<Vec<Vec<f32>>> {
        let causal = vec![None; batch.len()];
        self.backend.run_step(|| self.forward_here(batch, causal, &[]))
    }

    /// Feeds `tokens` to `seq` and returns its greedy next token: the argmax of `forward`'s
    /// logits, found without them where the backend can (`forward::head_argmax`).
    pub fn forward_argmax(&self, tokens: &[u32], seq: &mut SeqState) -> Result<u32> {
        self.backend.run_step(|| {
            let (x, seqs) = self.layers_with(&mut [(tokens, seq)], vec![None])?;
            let lm = self.lm_head.as_ref().unwrap_or(&self.embed);
            let t = head_argmax(&self.backend, &self.ctx, &x, &seqs, &self.norm, lm)?;
            Ok(t[0])
        })
    }

    /// Feeds `tokens` to `seq`, the last `parents.len()` of them a token tree (`parents` as
    /// `StepSeq.tree_parents`; empty: a chain), and returns the logits of the last `tail` positions.
    pub fn forward_tree(
        &self,
        tokens: &[u32],
        seq: &mut SeqState,
        parents: &[u32],
        tail: usize,
    ) -> Result<Vec<Vec<f32>>> {
        let tree = crate::forward::tree_masks(tokens.len(), parents).map(|m| (m, 0));
        self.backend.run_step(|| self.forward_here(&mut [(tokens, seq)], vec![tree], &[tail]))
    }

    /// Feeds `tokens` to `seq` as the next nodes of a token tree whose first `cached` nodes an
    /// earlier call fed (a draft model growing its tree): `masks[i]` is node i's ancestors among
    /// the tree's nodes, bit `cached + i` itself; returns every new node's logits.
    pub fn forward_grow(
        &self,
        tokens: &[u32],
        seq: &mut SeqState,
        masks: Vec<u64>,
        cached: usize,
    ) -> Result<Vec<Vec<f32>>> {
        let tail = tokens.len();
        let tree = Some((masks, cached));
        self.backend.run_step(|| self.forward_here(&mut [(tokens, seq)], vec![tree], &[tail]))
    }

    /// Forgets positions `len..` of a sequence (rejected drafts): the next tokens go in at `len`.
    pub fn truncate(&self, seq: &mut SeqState, len: usize) -> Result<()> {
        if len > seq.len {
            return Err(Error::invalid(
                "start_pos",
                format!("cannot roll a sequence of {} positions forward to {len}", seq.len),
            ));
        }
        seq.len = len;
        lock(&self.blocks).shrink(&mut seq.blocks, len);
        Ok(())
    }

    /// Feeds `tokens` to `seq` and scores them as llama.cpp's perplexity does: for every new
    /// position `i` from `from` to the second-to-last, the negative log-likelihood the model gives
    /// `tokens[i + 1]` (natural log, f64).
    pub fn score(&self, tokens: &[u32], seq: &mut SeqState, from: usize) -> Result<Vec<f64>> {
        self.backend.run_step(|| {
            let b = &self.backend;
            let (x, _) = self.layers_with(&mut [(tokens, seq)], vec![None])?;
            let n = tokens.len().saturating_sub(1).saturating_sub(from);
            if n == 0 {
                return Ok(Vec::new());
            }
            let h = b.rms_norm(&b.rows(&x, from, n)?, &self.norm, self.ctx.eps)?;
            let lm = self.lm_head.as_ref().unwrap_or(&self.embed);
            let logits = b.to_host(&b.matmul(&h, lm, Precision::F32)?)?;
            let vocab = logits.len() / n;
            Ok(logits
                .chunks_exact(vocab)
                .zip(&tokens[from + 1..])
                .map(|(row, &next)| layerstream_kernels::host::nll(row, next))
                .collect())
        })
    }

    /// `forward` on the calling thread, with each sequence's tree masks (`forward::tree_masks`;
    /// None: causal) and the positions whose logits come back (`head_logits`' tails).
    fn forward_here(
        &self,
        batch: &mut [(&[u32], &mut SeqState)],
        trees: Vec<Option<(Vec<u64>, usize)>>,
        tails: &[usize],
    ) -> Result<Vec<Vec<f32>>> {
        let (x, seqs) = self.layers_with(batch, trees)?;
        let lm = self.lm_head.as_ref().unwrap_or(&self.embed);
        head_logits(&self.backend, &self.ctx, &x, &seqs, tails, &self.norm, lm)
    }

    /// Embeds the batch and runs every layer over it (each sequence's cache grows by its tokens;
    /// `trees[i]`: sequence i's tree masks and how many of the tree's nodes its cache already
    /// holds, None: causal); returns the last layer's output and the rows of each sequence.
    fn layers_with(
        &self,
        batch: &mut [(&[u32], &mut SeqState)],
        trees: Vec<Option<(Vec<u64>, usize)>>,
    ) -> Result<(B::Tensor, Vec<SeqRows>)> {
        let b = &self.backend;
        let ids: Vec<u32> = batch.iter().flat_map(|(t, _)| t.iter().copied()).collect();
        if ids.is_empty() || batch.iter().any(|(t, _)| t.is_empty()) {
            return Err(Error::invalid(
                "seqs.token_ids",
                "every sequence in a step needs at least one token",
            ));
        }
        {
            let mut pool = lock(&self.blocks);
            for (t, s) in batch.iter_mut() {
                pool.grow(&mut s.blocks, s.len + t.len()).map_err(|d| Error::KvFull {
                    positions: pool.blocks() * pool.block(),
                    wanted: d.wanted,
                    available: d.available,
                })?;
            }
        }
        let seqs: Vec<SeqRows> = batch
            .iter()
            .zip(trees)
            .map(|((t, s), tree)| {
                let cached = tree.as_ref().map_or(0, |t| t.1);
                SeqRows {
                    rows: t.len(),
                    start_pos: s.len,
                    tree_from: s.len.saturating_sub(cached),
                    tree: tree.map(|t| t.0),
                    blocks: s.blocks.table.clone(),
                }
            })
            .collect();
        let mut x = crate::forward::embed(b, &self.ctx, &self.embed, &ids)?;
        let mut pools = lock(&self.pools);
        for ((li, lw), pool) in self.layers.iter().enumerate().zip(pools.iter_mut()) {
            let mut experts = &self.experts;
            layer_forward(b, &self.ctx, li as u32, lw, &mut x, &seqs, pool, &mut experts)?;
        }
        for (t, s) in batch.iter_mut() {
            s.len += t.len();
        }
        Ok((x, seqs))
    }
}
