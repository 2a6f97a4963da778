//! A model held on one backend: embedding, a range of decoder layers, final norm and lm_head.
//! `forward` runs a batch of sequences through the layers and returns each one's last-row logits.

use crate::error::{Error, Result};
use crate::forward::{head_logits, layer_forward, LayerCtx, SeqRows};
use crate::moe::ResidentExperts;
use crate::weights::{upload, LayerWeights};
use layerstream_kernels::Backend;
use layerstream_model::layout::layer_file;
use layerstream_model::{ModelConfig, Store};

/// Every sequence's KV caches, one per layer.
pub struct SeqState<B: Backend> {
    pub caches: Vec<B::KvCache>,
    /// Positions processed so far.
    pub len: usize,
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
}

impl<B: Backend> Model<B> {
    /// Loads every file of `store` onto `backend`.
    pub fn load(backend: B, store: &Store) -> Result<Self> {
        let cfg = store.manifest.config.clone();
        let (h, vocab) = (cfg.hidden_size, cfg.vocab_size);
        let need =
            |f: &layerstream_model::LoadedFile, name: &str, shape: &[usize]| -> Result<B::Weight> {
                upload(&backend, f, name, Some(shape))?.ok_or_else(|| {
                    Error::Weights(format!("{}: missing tensor {name}", f.entry.name))
                })
            };
        let embed = need(&store.load("embed.bin")?, "embed", &[vocab, h])?;
        let norm = need(&store.load("final_norm.bin")?, "final_norm", &[h])?;
        let lm_head = if cfg.tie_word_embeddings {
            None
        } else {
            Some(need(&store.load("lm_head.bin")?, "lm_head", &[vocab, h])?)
        };
        let layers = (0..cfg.num_layers)
            .map(|i| LayerWeights::load(&backend, &cfg, &store.load(&layer_file(i))?))
            .collect::<Result<Vec<_>>>()?;
        let experts = ResidentExperts::load(&backend, store, 0..cfg.num_layers as u32)?;
        Ok(Model { ctx: LayerCtx::new(&cfg), cfg, backend, embed, layers, experts, norm, lm_head })
    }

    /// A fresh sequence with empty caches sized for `capacity` positions.
    pub fn new_sequence(&self, capacity: usize) -> Result<SeqState<B>> {
        let caches = (0..self.layers.len())
            .map(|_| self.backend.kv_cache(self.ctx.shape, capacity))
            .collect::<std::result::Result<_, _>>()?;
        Ok(SeqState { caches, len: 0 })
    }

    /// Feeds `tokens[i]` to sequence `i` (prefill or decode alike) and returns each sequence's
    /// logits at its last new position.
    pub fn forward(&self, batch: &mut [(&[u32], &mut SeqState<B>)]) -> Result<Vec<Vec<f32>>> {
        let causal = vec![None; batch.len()];
        self.backend.run_step(|| self.forward_here(batch, causal, &[]))
    }

    /// Feeds `tokens` to `seq`, the last `parents.len()` of them a token tree (`parents` as
    /// `StepSeq.tree_parents`; empty: a chain), and returns the logits of the last `tail` positions.
    pub fn forward_tree(
        &self,
        tokens: &[u32],
        seq: &mut SeqState<B>,
        parents: &[u32],
        tail: usize,
    ) -> Result<Vec<Vec<f32>>> {
        let tree = crate::forward::tree_masks(tokens.len(), parents);
        self.backend.run_step(|| self.forward_here(&mut [(tokens, seq)], vec![tree], &[tail]))
    }

    /// Forgets positions `len..` of a sequence (rejected drafts).
    pub fn truncate(&self, seq: &mut SeqState<B>, len: usize) -> Result<()> {
        crate::forward::truncate(&self.backend, &mut seq.caches, len)?;
        seq.len = len;
        Ok(())
    }

    /// Feeds `tokens` to `seq` and scores them as llama.cpp's perplexity does: for every new
    /// position `i` from `from` to the second-to-last, the negative log-likelihood the model gives
    /// `tokens[i + 1]` (natural log, f64).
    pub fn score(&self, tokens: &[u32], seq: &mut SeqState<B>, from: usize) -> Result<Vec<f64>> {
        self.backend.run_step(|| {
            let b = &self.backend;
            let (x, _) = self.layers_with(&mut [(tokens, seq)], vec![None])?;
            let n = tokens.len().saturating_sub(1).saturating_sub(from);
            if n == 0 {
                return Ok(Vec::new());
            }
            let h = b.rms_norm(&b.rows(&x, from, n)?, &self.norm, self.ctx.eps)?;
            let logits = b.to_host(&b.matmul(&h, self.lm_head.as_ref().unwrap_or(&self.embed))?)?;
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
        batch: &mut [(&[u32], &mut SeqState<B>)],
        trees: Vec<Option<Vec<u64>>>,
        tails: &[usize],
    ) -> Result<Vec<Vec<f32>>> {
        let (x, seqs) = self.layers_with(batch, trees)?;
        head_logits(
            &self.backend,
            &self.ctx,
            &x,
            &seqs,
            tails,
            &self.norm,
            self.lm_head.as_ref().unwrap_or(&self.embed),
        )
    }

    /// Embeds the batch and runs every layer over it (each sequence's cache grows by its tokens;
    /// `trees[i]`: sequence i's tree masks, None: causal); returns the last layer's output and the
    /// rows of each sequence.
    fn layers_with(
        &self,
        batch: &mut [(&[u32], &mut SeqState<B>)],
        trees: Vec<Option<Vec<u64>>>,
    ) -> Result<(B::Tensor, Vec<SeqRows>)> {
        let b = &self.backend;
        let ids: Vec<u32> = batch.iter().flat_map(|(t, _)| t.iter().copied()).collect();
        if ids.is_empty() || batch.iter().any(|(t, _)| t.is_empty()) {
            return Err(Error::invalid(
                "seqs.token_ids",
                "every sequence in a step needs at least one token",
            ));
        }
        let seqs: Vec<SeqRows> = batch
            .iter()
            .zip(trees)
            .map(|((t, s), tree)| SeqRows { rows: t.len(), start_pos: s.len, tree })
            .collect();
        let mut x = crate::forward::embed(b, &self.ctx, &self.embed, &ids)?;
        for (li, lw) in self.layers.iter().enumerate() {
            let mut caches: Vec<&mut B::KvCache> =
                batch.iter_mut().map(|(_, s)| &mut s.caches[li]).collect();
            let mut experts = &self.experts;
            layer_forward(b, &self.ctx, li as u32, lw, &mut x, &seqs, &mut caches, &mut experts)?;
        }
        for (t, s) in batch.iter_mut() {
            s.len += t.len();
        }
        Ok((x, seqs))
    }
}
