//! A worker's stage of the pipeline: its layer range with resident and streamed layers, optional
//! embedding and head, per-sequence KV caches and samplers, and the step that runs a batch through it
//! while a copy thread streams the next layer group from the loader.

use crate::error::{Error, Result};
use crate::forward::{head_logits, layer_forward, LayerCtx, SeqRows};
use crate::sampling::{Sampler, SamplingParams};
use crate::budget::layer_bytes;
use crate::stream::{Fetched, LoaderLink};
use crate::weights::{upload, LayerWeights};
use layerstream_kernels::Backend;
use layerstream_model::layout::layer_file;
use layerstream_model::{LoadedFile, ModelConfig, Store};
use std::collections::HashMap;
use std::sync::mpsc;
use std::time::Instant;
use tracing::{info_span, Span};

/// What the coordinator assigned.
#[derive(Debug, Clone, PartialEq)]
pub struct StagePlan {
    pub layers: std::ops::Range<u32>,
    pub resident: Vec<u32>,
    pub group_size: usize,
    pub buffers: usize,
    pub kv_capacity: usize,
    pub embed: bool,
    pub head: bool,
    pub prefetch: bool,
}

/// One sequence in a step.
#[derive(Debug, Clone)]
pub struct StepSeq {
    pub seq_id: u64,
    pub start_pos: usize,
    pub tokens: Vec<u32>,
    pub sampling: Option<SamplingParams>,
}

/// Timing of one layer in one step.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct LayerTiming {
    pub layer: u32,
    pub resident: bool,
    pub bytes: u64,
    pub transfer_ms: f64,
    pub compute_ms: f64,
    pub stall_ms: f64,
}

/// What a step produced.
#[derive(Debug, Default)]
pub struct StepOut {
    pub hidden: Vec<f32>,
    pub tokens: Vec<u32>,
    pub layers: Vec<LayerTiming>,
}

struct Seq<B: Backend> {
    caches: Vec<B::KvCache>,
    len: usize,
    sampler: Option<Sampler>,
    history: Vec<u32>,
}

/// A streamed group after its transfer.
struct Group<B: Backend> {
    layers: Vec<(u32, LayerWeights<B>, Span, LayerTiming)>,
}

/// The worker's loaded assignment.
pub struct Stage<B: Backend> {
    pub cfg: ModelConfig,
    pub plan: StagePlan,
    backend: B,
    ctx: LayerCtx,
    store: Store,
    embed: Option<B::Weight>,
    /// Final norm and lm_head (`None` = tied: the embedding table).
    head: Option<(B::Weight, Option<B::Weight>)>,
    resident: HashMap<u32, LayerWeights<B>>,
    groups: Vec<Vec<u32>>,
    link: LoaderLink,
    seqs: HashMap<u64, Seq<B>>,
}

fn need<B: Backend>(b: &B, f: &LoadedFile, name: &str, shape: &[usize]) -> Result<B::Weight> {
    upload(b, f, name, Some(shape))?.ok_or_else(|| Error::Shape(format!("{}: missing tensor {name}", f.entry.name)))
}

/// Streamed layers of a plan, chunked into groups in layer order.
pub fn stream_groups(plan: &StagePlan) -> Vec<Vec<u32>> {
    let streamed: Vec<u32> = plan.layers.clone().filter(|l| !plan.resident.contains(l)).collect();
    streamed.chunks(plan.group_size.max(1)).map(<[u32]>::to_vec).collect()
}

impl<B: Backend> Stage<B> {
    /// Loads an assignment: embedding/head from the store, resident layers through the loader.
    pub fn load(backend: B, store: Store, plan: StagePlan, mut link: LoaderLink) -> Result<Self> {
        let cfg = store.manifest.config.clone();
        let (h, vocab) = (cfg.hidden_size, cfg.vocab_size);
        if plan.layers.end as usize > cfg.num_layers || plan.layers.start >= plan.layers.end {
            return Err(Error::Request(format!("layer range {:?} is invalid for {} layers", plan.layers, cfg.num_layers)));
        }
        let tied = cfg.tie_word_embeddings;
        let embed = if plan.embed || (plan.head && tied) { Some(need(&backend, &store.load("embed.bin")?, "embed", &[vocab, h])?) } else { None };
        let head = if plan.head {
            let norm = need(&backend, &store.load("final_norm.bin")?, "final_norm", &[h])?;
            let lm = if tied { None } else { Some(need(&backend, &store.load("lm_head.bin")?, "lm_head", &[vocab, h])?) };
            Some((norm, lm))
        } else {
            None
        };
        let groups = stream_groups(&plan);
        if let Some(max_layer) = groups.iter().flatten().map(|&l| layer_bytes(&store.manifest, l)).max() {
            // Enough buffers for every layer in flight: the groups queued ahead, one computing, one copying.
            backend.stream_buffers(plan.buffers.max(1) * plan.group_size.max(1), max_layer as usize)?;
        }
        let mut resident = HashMap::new();
        for &l in &plan.resident {
            resident.insert(l, Self::load_layer(&backend, &cfg, &store, &mut link, l, &Span::current(), false)?.0);
        }
        link.set_order(groups.iter().flatten().copied().collect())?;
        Ok(Stage { ctx: LayerCtx::new(&cfg), cfg, plan, backend, store, embed, head, resident, groups, link, seqs: HashMap::new() })
    }

    /// Copies layer `layer` from its loader slot (registered with the device once) to the device in
    /// one transfer: into a streaming buffer (`streamed`) or its own allocation. Returns the weights,
    /// what was fetched, and the device-timed copy milliseconds where the backend measures them.
    fn load_layer(b: &B, cfg: &ModelConfig, store: &Store, link: &mut LoaderLink, layer: u32, span: &Span, streamed: bool) -> Result<(LayerWeights<B>, Fetched, Option<f64>)> {
        let name = layer_file(layer as usize);
        let entry = store.manifest.file(&name).ok_or_else(|| Error::Shape(format!("no {name} in the manifest")))?.clone();
        let ((w, ms), f) = link.with_slot(layer, span, |region, len| {
            if len as u64 != entry.size {
                return Err(Error::Shape(format!("{name}: loader delivered {len} bytes, manifest says {}", entry.size)));
            }
            b.register_host(region)?;
            let (blob, ms) = b.upload_blob(&region[..len], streamed)?;
            Ok((LayerWeights::from_blob(b, cfg, &entry, &blob)?, ms))
        })?;
        Ok((w, f, ms))
    }

    /// Live sequences and positions held.
    pub fn kv_used(&self) -> (usize, usize) {
        (self.seqs.len(), self.seqs.values().map(|s| s.len).sum())
    }

    /// Frees sequences' caches and samplers.
    pub fn release(&mut self, ids: &[u64]) {
        for id in ids {
            self.seqs.remove(id);
        }
    }

    fn prepare(&mut self, batch: &[StepSeq]) -> Result<()> {
        let n_layers = self.plan.layers.len();
        let new_tokens: usize = batch.iter().map(|s| s.tokens.len()).sum();
        if self.kv_used().1 + new_tokens > self.plan.kv_capacity {
            return Err(Error::Request(format!("KV cache full: {} + {new_tokens} positions exceed capacity {}", self.kv_used().1, self.plan.kv_capacity)));
        }
        for s in batch {
            if s.tokens.is_empty() {
                return Err(Error::Request(format!("sequence {} has no tokens in this step", s.seq_id)));
            }
            if !self.seqs.contains_key(&s.seq_id) {
                if s.start_pos != 0 {
                    return Err(Error::Request(format!("unknown sequence {} at position {}", s.seq_id, s.start_pos)));
                }
                let caches = (0..n_layers).map(|_| self.backend.kv_cache(self.ctx.shape, 0)).collect::<std::result::Result<_, _>>()?;
                let sampler = if self.plan.head { Some(Sampler::new(s.sampling.clone().unwrap_or_default())) } else { None };
                self.seqs.insert(s.seq_id, Seq { caches, len: 0, sampler, history: Vec::new() });
            }
            let seq = &self.seqs[&s.seq_id];
            if seq.len != s.start_pos {
                return Err(Error::Request(format!("sequence {} is at position {}, step says {}", s.seq_id, seq.len, s.start_pos)));
            }
        }
        Ok(())
    }

    /// Runs one batch step: embeds (first stage) or takes `hidden`, runs every layer of the range
    /// (streamed groups arriving from the copy thread), then samples (last stage) or returns hidden.
    pub fn step(&mut self, batch: &[StepSeq], hidden: &[f32], step_span: &Span) -> Result<StepOut> {
        self.prepare(batch)?;
        let b = self.backend.clone();
        let b = &b;
        let rows: usize = batch.iter().map(|s| s.tokens.len()).sum();
        let mut x = match (&self.embed, self.plan.embed) {
            (Some(e), true) => b.embedding(e, &batch.iter().flat_map(|s| s.tokens.iter().copied()).collect::<Vec<_>>())?,
            _ => {
                let h = self.cfg.hidden_size;
                if hidden.len() != rows * h {
                    return Err(Error::Request(format!("hidden states hold {} values, {rows} rows × {h} expected", hidden.len())));
                }
                b.from_host(hidden, rows, h)?
            }
        };
        let seq_rows: Vec<SeqRows> = batch.iter().map(|s| SeqRows { rows: s.tokens.len(), start_pos: s.start_pos }).collect();
        let timings = self.run_layers(&mut x, batch, &seq_rows, step_span)?;
        for s in batch {
            let seq = self.seqs.get_mut(&s.seq_id).expect("prepared");
            seq.len += s.tokens.len();
            if self.plan.head {
                seq.history.extend_from_slice(&s.tokens);
            }
        }
        let mut out = StepOut { layers: timings, ..Default::default() };
        let b = &self.backend;
        if let Some((norm, lm)) = &self.head {
            let lm = lm.as_ref().or(self.embed.as_ref()).expect("tied head keeps the embedding");
            let logits = head_logits(b, &self.ctx, &x, &seq_rows, norm, lm)?;
            for (s, mut l) in batch.iter().zip(logits) {
                let seq = self.seqs.get_mut(&s.seq_id).expect("prepared");
                let hist = seq.history.clone();
                out.tokens.push(seq.sampler.as_mut().expect("head stage samples").sample(&mut l, &hist));
            }
        } else {
            out.hidden = b.to_host(&x)?;
        }
        Ok(out)
    }

    fn run_layers(&mut self, x: &mut B::Tensor, batch: &[StepSeq], seq_rows: &[SeqRows], step_span: &Span) -> Result<Vec<LayerTiming>> {
        let Stage { backend: b, ctx, cfg, store, resident, groups, link, seqs, plan, .. } = self;
        let range = plan.layers.clone();
        let mut timings = Vec::with_capacity(range.len());
        // The batch's sequences in batch order, looked up once per step (not once per layer).
        let mut by_id: HashMap<u64, &mut Seq<B>> = seqs.iter_mut().map(|(k, v)| (*k, v)).collect();
        let mut ordered: Vec<&mut Seq<B>> = batch.iter().map(|s| by_id.remove(&s.seq_id).expect("prepared")).collect();
        let mut compute = |layer: u32, w: &LayerWeights<B>, span: &Span, mut t: LayerTiming, x: &mut B::Tensor| -> Result<LayerTiming> {
            let li = (layer - range.start) as usize;
            let mut caches: Vec<&mut B::KvCache> = ordered.iter_mut().map(|s| &mut s.caches[li]).collect();
            let cs = info_span!(parent: span, "compute", layer, rows = b.dims(x).0, device_ms = tracing::field::Empty);
            // Timed on the device (CUDA events around the layer's kernels; host clock on the CPU), and
            // waited for, so the span covers the compute itself.
            t.compute_ms = cs.in_scope(|| -> Result<f64> {
                let m0 = b.mark()?;
                layer_forward(b, ctx, w, x, seq_rows, &mut caches)?;
                let m1 = b.mark()?;
                Ok(b.elapsed_ms(&m0, &m1)?)
            })?;
            cs.record("device_ms", t.compute_ms);
            Ok(t)
        };
        let layer_span = |l: u32, resident: bool| info_span!(parent: step_span, "layer", otel.name = format!("layer {l}"), layer = l, resident);
        let fetch_group = |g: &[u32], link: &mut LoaderLink| -> Result<Group<B>> {
            let mut layers = Vec::with_capacity(g.len());
            for &l in g {
                let span = layer_span(l, false);
                let h2d = info_span!(parent: &span, "h2d", layer = l, bytes = tracing::field::Empty, gbps = tracing::field::Empty, device_ms = tracing::field::Empty);
                // The transfer: slot → device in one copy (CUDA: event-timed on the copy stream; CPU:
                // into the weight storage, timed from acquire to usable weights).
                let t0 = Instant::now();
                let (w, f, dev_ms) = h2d.in_scope(|| Self::load_layer(b, cfg, store, link, l, &h2d, true))?;
                let transfer_ms = dev_ms.unwrap_or(t0.elapsed().as_secs_f64() * 1e3);
                h2d.record("bytes", f.bytes as i64);
                h2d.record("gbps", f.bytes as f64 / (transfer_ms / 1e3).max(1e-9) / 1e9);
                if let Some(ms) = dev_ms {
                    h2d.record("device_ms", ms);
                }
                drop(h2d);
                layers.push((l, w, span, LayerTiming { layer: l, bytes: f.bytes as u64, transfer_ms, ..Default::default() }));
            }
            Ok(Group { layers })
        };
        let first_of_group: HashMap<u32, usize> = groups.iter().enumerate().map(|(i, g)| (g[0], i)).collect();
        let mut run = |next_group: &mut dyn FnMut() -> Result<Group<B>>, x: &mut B::Tensor| -> Result<()> {
            let mut pending: Option<Group<B>> = None;
            for l in range.clone() {
                if let Some(w) = resident.get(&l) {
                    let span = layer_span(l, true);
                    timings.push(compute(l, w, &span, LayerTiming { layer: l, resident: true, ..Default::default() }, x)?);
                    continue;
                }
                if first_of_group.contains_key(&l) {
                    let t0 = Instant::now();
                    let g = next_group()?;
                    let stall = t0.elapsed().as_secs_f64() * 1e3;
                    pending = Some(g);
                    if let Some(p) = pending.as_mut() {
                        p.layers[0].3.stall_ms = stall;
                    }
                }
                let g = pending.as_mut().ok_or_else(|| Error::Request(format!("layer {l} has no group")))?;
                let idx = g.layers.iter().position(|e| e.0 == l).ok_or_else(|| Error::Request(format!("layer {l} missing from its group")))?;
                let (_, w, span, t) = &g.layers[idx];
                timings.push(compute(l, w, span, t.clone(), x)?);
                if idx + 1 == g.layers.len() {
                    pending = None; // evict the group as a unit after its compute
                }
            }
            Ok(())
        };
        if !plan.prefetch || groups.is_empty() || plan.buffers < 2 {
            let mut it = groups.iter();
            run(&mut || fetch_group(it.next().expect("group order"), link), x)?;
        } else {
            let cap = plan.buffers - 2;
            std::thread::scope(|s| -> Result<()> {
                let (tx, rx) = mpsc::sync_channel::<Result<Group<B>>>(cap);
                let groups_ref = &*groups;
                let link_ref = &mut *link;
                let copier = s.spawn(move || {
                    for g in groups_ref {
                        let r = fetch_group(g, link_ref);
                        let failed = r.is_err();
                        if tx.send(r).is_err() || failed {
                            return;
                        }
                    }
                });
                let res = run(&mut || rx.recv().map_err(|_| Error::Request("copy thread ended early".into()))?, x);
                drop(rx);
                let _ = copier.join();
                res
            })?;
        }
        Ok(timings)
    }
}

impl<B: Backend> Drop for Stage<B> {
    fn drop(&mut self) {
        // Unpin the slot mappings before the link unmaps them.
        for region in self.link.regions() {
            self.backend.unregister_host(region);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn groups_chunk_streamed_layers_in_order() {
        let plan = StagePlan { layers: 0..10, resident: vec![0, 5], group_size: 3, buffers: 2, kv_capacity: 1, embed: true, head: true, prefetch: true };
        assert_eq!(stream_groups(&plan), vec![vec![1, 2, 3], vec![4, 6, 7], vec![8, 9]]);
    }
}
