//! A worker's stage of the pipeline: its layer range with resident and streamed layers, optional
//! embedding and head, per-sequence KV caches and samplers, and the step that runs a batch through it
//! while the copy side (`prefetch`) streams the next layer groups from the loader.

use crate::draft::DraftState;
use crate::error::{Error, Result};
use crate::experts::ExpertCache;
use crate::forward::{layer_forward, LayerCtx, SeqRows};
use crate::model::{KvOptions, Model};
use crate::moe::{choose, ExpertCounts, NoExperts};
use crate::prefetch::{Fetcher, LayerSource, StepMark};
use crate::sampling::{Sampler, SamplingParams};
use crate::stream::LoaderLink;
use crate::weights::{need, LayerWeights};
use layerstream_kernels::{Backend, KvLayout};
use layerstream_model::{ModelConfig, Store};
use layerstream_serving::plan::{streaming_buffers, Assignment, AssignmentExt};
use layerstream_telemetry::TraceParent;
use std::collections::HashMap;
use std::time::Instant;
use tracing::{info_span, Span};

mod check;
mod head;

pub use check::{check_step, StepLimits};

/// One sequence in a step.
#[derive(Debug, Clone)]
pub struct StepSeq {
    pub(crate) seq_id: u64,
    pub(crate) start_pos: usize,
    pub(crate) tokens: Vec<u32>,
    pub(crate) sampling: Option<SamplingParams>,
    /// More of the prompt follows (chunked prefill): nothing is sampled for it (0 is returned).
    pub(crate) prompt_continues: bool,
    /// Draws its sampler made before it was resumed (skipped by the new sampler).
    pub(crate) draws_before: u64,
    /// The last `draft_len` tokens are a speculative draft, verified by the head stage.
    pub(crate) draft_len: usize,
    /// Tokens the head's draft model proposes after this step, for the next.
    pub(crate) draft_next: usize,
    /// The draft is a token tree with these parents (empty: a chain).
    pub(crate) tree_parents: Vec<u32>,
    /// Candidates the head's draft branches on per step of its chain (1: a chain).
    pub(crate) draft_width: usize,
    /// Its KV blocks, covering every position up to this step's last.
    pub(crate) blocks: Vec<u32>,
    /// A new sequence on cached blocks: the tokens of positions `..start_pos`.
    pub(crate) cached: Vec<u32>,
    /// The tokens its output format allows at the sampled position (a bitmask; empty: all).
    pub(crate) allowed: Vec<u32>,
    /// Prompt log-probabilities: the id to score at each row from the first, and how many
    /// alternatives to return with each.
    pub(crate) score_ids: Vec<u32>,
    pub(crate) score_top: usize,
}

/// Timing of one layer in one step.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct LayerTiming {
    pub(crate) layer: u32,
    pub(crate) resident: bool,
    pub(crate) bytes: u64,
    pub(crate) transfer_ms: f64,
    pub(crate) compute_ms: f64,
    pub(crate) stall_ms: f64,
    /// What the layer's experts cost (mixture-of-experts layers).
    pub(crate) experts: crate::moe::ExpertCounts,
}

/// What a step produced.
#[derive(Debug, Default)]
pub struct StepOut {
    pub(crate) hidden: Vec<f32>,
    /// Per sequence (last worker): its tokens, log-probabilities, scores and next draft.
    pub(crate) results: Vec<layerstream_rpc::v1::SeqResult>,
    pub(crate) layers: Vec<LayerTiming>,
    /// Wall time of the pass over the layer range (embedding, head and sampling excluded).
    pub(crate) layers_ms: f64,
    /// The time the draft model took proposing the sequences' next drafts (`draft_next`).
    pub(crate) draft_ms: f64,
    /// The head's estimate of one level of drafting (0: not measured yet).
    pub(crate) draft_level_ms: f64,
}

struct Seq {
    len: usize,
    sampler: Option<Sampler>,
    history: Vec<u32>,
    /// Drafted positions of its last step, which the next step may cut (a rejected draft).
    rollback: usize,
    /// Its cache in the head's draft model.
    draft: Option<DraftState>,
}

/// The batch's sequences, in batch order (each prepared, each once in a step).
fn in_batch_order<'a>(seqs: &'a mut HashMap<u64, Seq>, batch: &[StepSeq]) -> Vec<&'a mut Seq> {
    let mut by_id: HashMap<u64, &mut Seq> = seqs.iter_mut().map(|(k, v)| (*k, v)).collect();
    batch.iter().map(|s| by_id.remove(&s.seq_id).expect("prepared")).collect()
}

/// The worker's loaded assignment.
pub struct Stage<B: Backend> {
    pub(crate) cfg: ModelConfig,
    pub(crate) plan: Assignment,
    backend: B,
    ctx: LayerCtx,
    embed: Option<B::Weight>,
    /// Final norm and lm_head (`None` = tied: the embedding table).
    head: Option<(B::Weight, Option<B::Weight>)>,
    resident: HashMap<u32, LayerWeights<B>>,
    groups: Vec<Vec<u32>>,
    fetcher: Fetcher<B>,
    /// The experts of a mixture-of-experts model's layers (None for a dense model).
    experts: Option<ExpertCache<B>>,
    seqs: HashMap<u64, Seq>,
    /// Each layer's KV pool (the range's first layer first), laid out as `kv`.
    pools: Vec<B::KvCache>,
    kv: KvLayout,
    /// The host-RAM KV tier: per slot, one block of every layer's pool (`swap`).
    host: HashMap<u32, Vec<u8>>,
    /// The head's draft model (an assignment with `draft_model`), fully resident.
    draft: Option<Model<B>>,
    /// Its milliseconds per level of drafting, as last measured (0: not yet).
    draft_level_ms: f64,
}

/// The KV pool an assignment asks for: its dtype and block size, `kv_capacity` positions.
fn kv_layout(plan: &Assignment, ctx: &LayerCtx) -> Result<KvLayout> {
    let dtype = plan.kv_dtype().map_err(|e| Error::invalid("kv_dtype", e))?;
    let block = plan.kv_block();
    Ok(KvLayout::new(dtype, block, plan.kv_positions().div_ceil(block), ctx.shape)?)
}

impl<B: Backend + 'static> Stage<B> {
    /// Loads an assignment: embedding/head from the store, resident layers through the loader; with
    /// prefetch on, the copy thread starts on the first streamed group right away. Its layers'
    /// activations are in `precision`.
    pub fn load(
        backend: B,
        store: Store,
        plan: Assignment,
        mut link: LoaderLink,
        precision: layerstream_kernels::Precision,
    ) -> Result<Self> {
        let cfg = store.manifest.config.clone();
        let (h, vocab) = (cfg.hidden_size, cfg.vocab_size);
        if plan.layer_end as usize > cfg.num_layers || plan.layer_start >= plan.layer_end {
            return Err(Error::Assignment(format!(
                "layer range {:?} is invalid for {} layers",
                plan.layers(),
                cfg.num_layers
            )));
        }
        let tied = cfg.tie_word_embeddings;
        let embed = if plan.embed || (plan.head && tied) {
            Some(crate::weights::embedding(&backend, &store, plan.head && tied)?)
        } else {
            None
        };
        let head = if plan.head {
            let norm = need(&backend, store.load("final_norm.bin")?, "final_norm", &[h])?;
            let lm = if tied {
                None
            } else {
                Some(need(&backend, store.load("lm_head.bin")?, "lm_head", &[vocab, h])?)
            };
            if let Some(w) = lm.as_ref().or(embed.as_ref()) {
                backend.prepare_head(w);
            }
            Some((norm, lm))
        } else {
            None
        };
        let groups = plan.stream_groups();
        let (count, bytes) = streaming_buffers(&store.manifest, &plan);
        if count > 0 {
            backend.stream_buffers(count, bytes as usize)?;
        }
        let experts = match cfg.moe {
            Some(_) => Some(ExpertCache::new(
                backend.clone(),
                store.clone(),
                plan.layers(),
                plan.expert_cache as usize,
                link.sibling("experts"),
                link.sibling("experts-ahead"),
            )?),
            None => None,
        };
        let ctx = LayerCtx::new(&cfg).with_precision(precision);
        let kv = kv_layout(&plan, &ctx)?;
        let pools = plan
            .layers()
            .map(|l| backend.kv_cache(ctx.attn(l).0, kv))
            .collect::<std::result::Result<Vec<_>, _>>()?;
        let draft = if plan.head && !plan.draft_model.is_empty() {
            let d = Store::open(std::path::Path::new(&plan.draft_model))?;
            layerstream_serving::spec::check_draft(&store, &d)?;
            let opts = KvOptions { dtype: kv.dtype, block: kv.block, positions: kv.positions() };
            let m = Model::load_kv(backend.clone(), &d, opts)?.into_draft();
            tracing::info!(draft = %plan.draft_model, layers = m.cfg.num_layers, "draft model loaded");
            Some(m)
        } else {
            None
        };
        let src = LayerSource { backend: backend.clone(), cfg: cfg.clone(), store };
        let mut resident = HashMap::new();
        for &l in &plan.resident {
            resident.insert(l, src.load_layer(&mut link, l, &Span::current(), false)?.0);
        }
        link.set_order(groups.iter().flatten().copied().collect())?;
        // Groups in flight: one computing, one being copied, `buffers - 2` finished and queued.
        let queue = (plan.prefetch && plan.streaming_buffers >= 2).then(|| plan.buffers() - 2);
        let fetcher = Fetcher::new(
            src,
            groups.clone(),
            link,
            queue,
            StepMark { number: 0, parent: TraceParent::of(&Span::current()) },
        );
        Ok(Stage {
            ctx,
            pools,
            kv,
            host: HashMap::new(),
            cfg,
            plan,
            backend,
            embed,
            head,
            resident,
            groups,
            fetcher,
            experts,
            seqs: HashMap::new(),
            draft,
            draft_level_ms: 0.0,
        })
    }

    /// Live sequences and positions held.
    pub fn kv_used(&self) -> (usize, usize) {
        (self.seqs.len(), self.seqs.values().map(|s| s.len).sum())
    }

    /// Moves KV blocks: each `(device block, host slot)` of `to_host` copied out of every layer's
    /// pool into the host tier, then each `(host slot, device block)` of `to_device` copied back
    /// (the slot emptied). Returns the bytes moved each way. Checked whole before anything moves:
    /// blocks inside the pool, slots inside `kv_host_blocks`, every slot brought back holding a
    /// block.
    pub fn swap(&mut self, to_host: &[(u32, u32)], to_device: &[(u32, u32)]) -> Result<(u64, u64)> {
        let slots = self.plan.kv_host_blocks;
        let bad = |msg: String| Err(Error::invalid("to_host", msg));
        for (d, h) in to_host.iter().copied().chain(to_device.iter().map(|&(h, d)| (d, h))) {
            if d as usize >= self.kv.blocks || h >= slots {
                return bad(format!(
                    "device block {d} / host slot {h}: the pool has {} blocks, the host tier {slots} slots",
                    self.kv.blocks
                ));
            }
        }
        let going: std::collections::HashSet<u32> = to_host.iter().map(|m| m.1).collect();
        if let Some(&(h, _)) =
            to_device.iter().find(|(h, _)| !self.host.contains_key(h) && !going.contains(h))
        {
            return bad(format!("host slot {h} holds no block"));
        }
        let (mut out, mut back) = (0u64, 0u64);
        for &(d, h) in to_host {
            let mut bytes = Vec::new();
            for pool in &self.pools {
                bytes.extend(self.backend.kv_read(pool, d)?);
            }
            out += bytes.len() as u64;
            self.host.insert(h, bytes);
        }
        for &(h, d) in to_device {
            let bytes = self.host.remove(&h).expect("checked");
            let per = bytes.len() / self.pools.len().max(1);
            for (pool, part) in self.pools.iter_mut().zip(bytes.chunks_exact(per.max(1))) {
                self.backend.kv_write(pool, d, part)?;
            }
            back += bytes.len() as u64;
        }
        Ok((out, back))
    }

    /// Frees sequences' caches and samplers.
    pub fn release(&mut self, ids: &[u64]) {
        for id in ids {
            self.seqs.remove(id);
        }
    }

    /// Frees every sequence.
    pub fn release_all(&mut self) {
        self.seqs.clear();
        self.host.clear();
    }

    /// Checks a whole step against this stage before anything changes (`check_step`), then creates
    /// the caches and samplers of the sequences it starts.
    fn prepare(&mut self, batch: &[StepSeq], hidden: &[f32]) -> Result<()> {
        let hidden = (!self.plan.embed).then_some(hidden);
        let limits = StepLimits {
            vocab: self.cfg.vocab_size,
            context: self.cfg.max_position_embeddings,
            hidden_size: self.cfg.hidden_size,
            windowed: self.ctx.windowed(),
            kv_block: self.kv.block,
            kv_blocks: self.kv.blocks,
        };
        check_step(batch, hidden, limits, |id| self.seqs.get(&id).map(|s| (s.len, s.rollback)))?;
        // Rejected drafts of live sequences leave their caches (and the head's history).
        for s in batch {
            if let Some(seq) = self.seqs.get_mut(&s.seq_id) {
                if s.start_pos < seq.len {
                    seq.len = s.start_pos;
                    seq.history.truncate(seq.history.len().min(s.start_pos));
                }
                seq.rollback = s.draft_len;
            }
        }
        let fresh: Vec<&StepSeq> =
            batch.iter().filter(|s| !self.seqs.contains_key(&s.seq_id)).collect();
        for s in fresh {
            let sampler = if self.plan.head {
                let mut sampler = Sampler::new(s.sampling.clone().unwrap_or_default());
                sampler.skip(s.draws_before);
                Some(sampler)
            } else {
                None
            };
            let draft = self.draft.as_ref().map(DraftState::new);
            let history = if self.plan.head { s.cached.clone() } else { Vec::new() };
            let len = s.start_pos;
            let seq = Seq { len, sampler, history, rollback: s.draft_len, draft };
            self.seqs.insert(s.seq_id, seq);
        }
        Ok(())
    }

    /// Runs one batch step: embeds (first stage) or takes `hidden`, runs every layer of the range
    /// (streamed groups arriving from the copy thread), then samples (last stage) or returns hidden.
    pub fn step(&mut self, batch: &[StepSeq], hidden: &[f32], step_span: &Span) -> Result<StepOut> {
        let b = self.backend.clone();
        b.run_step(|| self.step_here(batch, hidden, step_span))
    }

    /// `step` on the calling thread.
    fn step_here(
        &mut self,
        batch: &[StepSeq],
        hidden: &[f32],
        step_span: &Span,
    ) -> Result<StepOut> {
        self.prepare(batch, hidden)?;
        let b = self.backend.clone();
        let b = &b;
        let rows: usize = batch.iter().map(|s| s.tokens.len()).sum();
        let mut x = match (&self.embed, self.plan.embed) {
            (Some(e), true) => crate::forward::embed(
                b,
                &self.ctx,
                e,
                &batch.iter().flat_map(|s| s.tokens.iter().copied()).collect::<Vec<_>>(),
            )?,
            _ => b.from_host(hidden, rows, self.cfg.hidden_size)?,
        };
        let seq_rows: Vec<SeqRows> = batch
            .iter()
            .map(|s| SeqRows {
                rows: s.tokens.len(),
                start_pos: s.start_pos,
                tree: crate::forward::tree_masks(s.tokens.len(), &s.tree_parents),
                tree_from: s.start_pos,
                blocks: s.blocks.clone(),
            })
            .collect();
        let t_layers = Instant::now();
        let timings = self.run_layers(&mut x, &seq_rows, step_span)?;
        let layers_ms = t_layers.elapsed().as_secs_f64() * 1e3;
        for s in batch {
            let seq = self.seqs.get_mut(&s.seq_id).expect("prepared");
            seq.len += s.tokens.len();
            if self.plan.head {
                seq.history.extend_from_slice(&s.tokens);
            }
        }
        let mut out = StepOut { layers: timings, layers_ms, ..Default::default() };
        if self.head.is_some() {
            self.head_tokens(batch, &x, &seq_rows, step_span, &mut out)?;
        } else {
            out.hidden = self.backend.to_host(&x)?;
        }
        Ok(out)
    }

    /// Runs `x` through every layer of the range: resident layers from memory, streamed ones as
    /// their groups arrive from the copy thread (each group evicted after its last layer).
    fn run_layers(
        &mut self,
        x: &mut B::Tensor,
        seq_rows: &[SeqRows],
        step_span: &Span,
    ) -> Result<Vec<LayerTiming>> {
        let Stage { backend: b, ctx, resident, groups, fetcher, pools, plan, experts, .. } = self;
        let range = plan.layers();
        let step_no = fetcher.begin_step(step_span);
        let mut timings = Vec::with_capacity(range.len());
        let mut pass =
            LayerPass { b, ctx, first: range.start, seq_rows, pools, experts: experts.as_mut() };
        let layer_span = |l: u32, resident: bool| info_span!(parent: step_span, "layer", otel.name = format!("layer {l}"), layer = l as i64, resident);
        let first_of_group: HashMap<u32, usize> =
            groups.iter().enumerate().map(|(i, g)| (g[0], i)).collect();
        let mut pending: Option<crate::prefetch::Group<B>> = None;
        for l in range.clone() {
            if let Some(w) = resident.get(&l) {
                let span = layer_span(l, true);
                // The next layer's weights, where they are already here (for expert predictions).
                let next = resident.get(&(l + 1)).or_else(|| {
                    let g = pending.as_ref()?;
                    g.layers.iter().find(|a| a.layer == l + 1).map(|a| &a.weights)
                });
                let t = LayerTiming { layer: l, resident: true, ..Default::default() };
                timings.push(pass.compute(
                    l,
                    w,
                    next.filter(|_| l + 1 < range.end),
                    &span,
                    t,
                    x,
                )?);
                continue;
            }
            if let Some(&gi) = first_of_group.get(&l) {
                let t0 = Instant::now();
                let mut g = fetcher.next(gi)?;
                g.layers[0].timing.stall_ms = t0.elapsed().as_secs_f64() * 1e3;
                pending = Some(g);
            }
            let g =
                pending.as_mut().ok_or_else(|| Error::Stage(format!("layer {l} has no group")))?;
            let idx = g
                .layers
                .iter()
                .position(|e| e.layer == l)
                .ok_or_else(|| Error::Stage(format!("layer {l} missing from its group")))?;
            let a = &mut g.layers[idx];
            if g.step != step_no {
                // Copied ahead, during an earlier step or between steps: that copy stays traced
                // where it ran; this step's compute gets its own layer span.
                a.span.record("next_step", true);
                a.span = layer_span(l, false);
            }
            let g = &*g;
            let a = &g.layers[idx];
            let next = g
                .layers
                .get(idx + 1)
                .map(|n| &n.weights)
                .or_else(|| resident.get(&(l + 1)).filter(|_| l + 1 < range.end));
            timings.push(pass.compute(l, &a.weights, next, &a.span, a.timing.clone(), x)?);
            if idx + 1 == g.layers.len() {
                pending = None; // evict the group as a unit after its compute
            }
        }
        Ok(timings)
    }
}

/// What computing the layers of one step needs, borrowed from the stage for that step.
struct LayerPass<'s, B: Backend> {
    b: &'s B,
    ctx: &'s LayerCtx,
    /// The range's first layer (caches are indexed from it).
    first: u32,
    seq_rows: &'s [SeqRows],
    /// Each layer's KV pool.
    pools: &'s mut [B::KvCache],
    experts: Option<&'s mut ExpertCache<B>>,
}

impl<B: Backend + 'static> LayerPass<'_, B> {
    /// Computes `layer` (weights `w`) on `x`, timed on the device (CUDA events around the layer's
    /// kernels; host clock on the CPU) and waited for, so its `compute` span covers the compute
    /// itself; then guesses the next layer's experts from this layer's output.
    fn compute(
        &mut self,
        layer: u32,
        w: &LayerWeights<B>,
        next: Option<&LayerWeights<B>>,
        span: &Span,
        mut t: LayerTiming,
        x: &mut B::Tensor,
    ) -> Result<LayerTiming> {
        let (b, ctx, seq_rows) = (self.b, self.ctx, self.seq_rows);
        let li = (layer - self.first) as usize;
        let pool = &mut self.pools[li];
        let cs = info_span!(parent: span, "compute", layer = layer as i64, rows = b.dims(x).0 as i64, device_ms = tracing::field::Empty);
        let experts = &mut self.experts;
        let (ms, counts) = cs.in_scope(|| -> Result<(f64, ExpertCounts)> {
            let m0 = b.mark()?;
            let counts = match experts.as_mut() {
                Some(c) => layer_forward(b, ctx, layer, w, x, seq_rows, pool, &mut **c)?,
                None => layer_forward(b, ctx, layer, w, x, seq_rows, pool, &mut NoExperts)?,
            };
            let m1 = b.mark()?;
            Ok((b.elapsed_ms(&m0, &m1)?, counts))
        })?;
        (t.compute_ms, t.experts) = (ms, counts);
        cs.record("device_ms", t.compute_ms);
        if counts.needed > 0 {
            info_span!(parent: span, "experts", layer = layer as i64, needed = counts.needed as i64, hit = counts.hit as i64, prefetched = counts.prefetched as i64, missed = counts.missed as i64, bytes = counts.bytes as i64).in_scope(|| {});
        }
        if let Some(nw) = next {
            self.predict_experts(layer + 1, nw, span, x)?;
        }
        Ok(t)
    }

    /// The next layer's router on this layer's output guesses its experts: the copy thread brings
    /// them in while that layer's attention computes.
    fn predict_experts(
        &self,
        layer: u32,
        w: &LayerWeights<B>,
        span: &Span,
        x: &B::Tensor,
    ) -> Result<()> {
        let (Some(c), Some(m)) = (self.experts.as_ref(), self.ctx.moe.as_ref()) else {
            return Ok(());
        };
        let (true, Some(router)) = (c.predicts(), w.mlp.router()) else { return Ok(()) };
        let _p = info_span!(parent: span, "predict experts", layer = layer as i64).entered();
        let h = self.b.rms_norm(x, &w.ffn_norm, self.ctx.eps)?;
        let ids: std::collections::BTreeSet<u32> =
            choose(self.b, self.ctx.precision, &h, &router, m)?
                .into_iter()
                .flatten()
                .map(|(e, _)| e)
                .collect();
        c.predict(layer, &ids.into_iter().collect::<Vec<_>>(), TraceParent::of(span));
        Ok(())
    }
}

impl<B: Backend> Drop for Stage<B> {
    fn drop(&mut self) {
        // Stop the copy thread, then unpin the slot mappings before the link unmaps them.
        if let Some(link) = self.fetcher.stop() {
            for region in link.regions() {
                self.backend.unregister_host(region);
            }
        }
    }
}
