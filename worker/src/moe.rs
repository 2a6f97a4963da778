//! Mixture-of-experts feed-forward: the router picks each token's experts, tokens are grouped per
//! expert so every expert's weights are read once per step, and the experts' outputs are added back
//! into each token's row weighted by the router. Where the experts come from (resident, or fetched
//! into a device cache) is the `ExpertSource`'s business.

use crate::error::{Error, Result};
use layerstream_kernels::{Backend, Precision};
use layerstream_model::layout::{expert_shape, expert_tensors};
use layerstream_model::{FileEntry, ModelConfig, MoeConfig};
use std::collections::BTreeMap;
use std::sync::Arc;

/// One expert's matrices on a device (views of its file's blob).
pub struct ExpertWeights<B: Backend> {
    pub(crate) gate: B::Weight,
    pub(crate) up: B::Weight,
    pub(crate) down: B::Weight,
    /// gpt-oss: the gate, up and down biases.
    pub(crate) biases: Option<[B::Weight; 3]>,
    /// Bytes of its store file.
    pub(crate) bytes: u64,
}

impl<B: Backend> ExpertWeights<B> {
    /// The expert in `blob` (its whole file on the device), shapes checked against `cfg`.
    pub fn from_blob(b: &B, cfg: &ModelConfig, entry: &FileEntry, blob: &B::Blob) -> Result<Self> {
        let get = |name: &str| -> Result<B::Weight> {
            let t = entry
                .tensor(name)
                .ok_or_else(|| Error::Weights(format!("{}: missing tensor {name}", entry.name)))?;
            let want = expert_shape(cfg, name).ok_or_else(|| {
                Error::Weights(format!("{}: the model has no experts", entry.name))
            })?;
            if t.shape != want {
                return Err(Error::Weights(format!(
                    "{}: tensor {name} has shape {:?}, the config needs {want:?}",
                    entry.name, t.shape
                )));
            }
            let range = t.offset as usize..(t.offset + t.size) as usize;
            Ok(b.weight_in(blob, &format!("{}:{name}", entry.name), t.dtype, &t.shape, range)?)
        };
        let m = cfg
            .moe
            .as_ref()
            .ok_or_else(|| Error::Weights(format!("{}: the model has no experts", entry.name)))?;
        let all = expert_tensors(m);
        if entry.tensors.len() != all.len() {
            return Err(Error::Weights(format!(
                "{}: {} tensors, an expert has {}",
                entry.name,
                entry.tensors.len(),
                all.join(", ")
            )));
        }
        Ok(ExpertWeights {
            gate: get("gate")?,
            up: get("up")?,
            down: get("down")?,
            biases: match m.bias {
                true => Some([get("gate_bias")?, get("up_bias")?, get("down_bias")?]),
                false => None,
            },
            bytes: entry.size,
        })
    }

    /// Loads an expert file's bytes onto the device (one transfer).
    pub fn load(b: &B, cfg: &ModelConfig, entry: &FileEntry, bytes: &[u8]) -> Result<Self> {
        let (blob, _) = b.upload_blob(bytes, false)?;
        Self::from_blob(b, cfg, entry, &blob)
    }
}

/// What a layer's experts cost one step.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct ExpertCounts {
    /// Distinct experts the step's tokens chose.
    pub(crate) needed: u32,
    /// Of those, already on the device.
    pub(crate) hit: u32,
    /// Of those, not on the device but read ahead on a prediction.
    pub(crate) prefetched: u32,
    /// Of those, fetched on demand without a prediction.
    pub(crate) missed: u32,
    /// Bytes copied onto the device for them.
    pub(crate) bytes: u64,
    /// Milliseconds spent bringing them onto the device.
    pub(crate) transfer_ms: f64,
}

impl std::ops::AddAssign for ExpertCounts {
    fn add_assign(&mut self, o: Self) {
        self.needed += o.needed;
        self.hit += o.hit;
        self.prefetched += o.prefetched;
        self.missed += o.missed;
        self.bytes += o.bytes;
        self.transfer_ms += o.transfer_ms;
    }
}

/// Where a step gets the experts its tokens chose.
pub trait ExpertSource<B: Backend> {
    /// Experts `ids` (ascending, distinct) of layer `layer`, on the device, in `ids` order, and what
    /// getting them cost.
    fn experts(
        &mut self,
        layer: u32,
        ids: &[u32],
    ) -> Result<(Vec<Arc<ExpertWeights<B>>>, ExpertCounts)>;
}

/// A dense model's source: asking it for experts is a store inconsistency.
pub struct NoExperts;

impl<B: Backend> ExpertSource<B> for NoExperts {
    fn experts(
        &mut self,
        layer: u32,
        _: &[u32],
    ) -> Result<(Vec<Arc<ExpertWeights<B>>>, ExpertCounts)> {
        Err(Error::Weights(format!("layer {layer} has a router but the model has no experts")))
    }
}

/// Every expert of every layer on the device (`run`, or a stage whose experts all fit).
pub struct ResidentExperts<B: Backend> {
    pub(crate) layers: std::collections::HashMap<u32, Vec<Arc<ExpertWeights<B>>>>,
}

impl<B: Backend> ResidentExperts<B> {
    /// Loads every expert of `layers` from `store`.
    pub fn load(
        b: &B,
        store: &layerstream_model::Store,
        layers: impl Iterator<Item = u32>,
    ) -> Result<Self> {
        let cfg = &store.manifest.config;
        let mut out = std::collections::HashMap::new();
        for l in layers {
            let Some(m) = cfg.moe_at(l as usize) else { continue };
            let experts = (0..m.experts)
                .map(|e| {
                    let f = store.load(&layerstream_model::layout::expert_file(l as usize, e))?;
                    Ok(Arc::new(ExpertWeights::load(b, cfg, &f.entry, &f.bytes)?))
                })
                .collect::<Result<Vec<_>>>()?;
            out.insert(l, experts);
        }
        Ok(ResidentExperts { layers: out })
    }
}

impl<B: Backend> ExpertSource<B> for &ResidentExperts<B> {
    fn experts(
        &mut self,
        layer: u32,
        ids: &[u32],
    ) -> Result<(Vec<Arc<ExpertWeights<B>>>, ExpertCounts)> {
        let all = self
            .layers
            .get(&layer)
            .ok_or_else(|| Error::Stage(format!("layer {layer}'s experts are not loaded")))?;
        let got = ids
            .iter()
            .map(|&e| {
                all.get(e as usize)
                    .cloned()
                    .ok_or_else(|| Error::Stage(format!("layer {layer} has no expert {e}")))
            })
            .collect::<Result<Vec<_>>>()?;
        let n = ids.len() as u32;
        Ok((got, ExpertCounts { needed: n, hit: n, ..Default::default() }))
    }
}

/// Each row's chosen experts and weights: softmax over every expert's logit, the `top_k` largest
/// (ties to the lower index), renormalised to sum to 1 when `norm_topk_prob`.
pub fn route(logits: &[f32], m: &MoeConfig) -> Vec<Vec<(u32, f32)>> {
    logits
        .chunks_exact(m.experts)
        .map(|row| {
            let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            let exp: Vec<f32> = row.iter().map(|&v| (v - max).exp()).collect();
            let sum: f32 = exp.iter().sum();
            let mut chosen: Vec<(u32, f32)> =
                top(&exp, m.top_k).into_iter().map(|e| (e as u32, exp[e] / sum)).collect();
            if m.norm_topk_prob {
                let s: f32 = chosen.iter().map(|t| t.1).sum();
                for t in &mut chosen {
                    t.1 /= s;
                }
            }
            chosen
        })
        .collect()
}

/// The routing grouped by expert (ascending): the rows that chose it and their weights.
pub fn by_expert(routes: &[Vec<(u32, f32)>]) -> BTreeMap<u32, (Vec<usize>, Vec<f32>)> {
    let mut g: BTreeMap<u32, (Vec<usize>, Vec<f32>)> = BTreeMap::new();
    for (row, r) in routes.iter().enumerate() {
        for &(e, w) in r {
            let slot = g.entry(e).or_default();
            slot.0.push(row);
            slot.1.push(w);
        }
    }
    g
}

/// A layer's router: its weight, the bias its logits add (gpt-oss), the correction its sigmoid
/// scores add for the choice (DeepSeek-V3, on the host).
pub struct Router<'a, B: Backend> {
    pub weight: &'a B::Weight,
    pub bias: Option<&'a B::Weight>,
    pub correction: Option<&'a [f32]>,
}

/// The experts layer `layer`'s router picks for the rows of `h` (its input, already normed), its
/// product in `p`.
pub fn choose<B: Backend>(
    b: &B,
    p: Precision,
    h: &B::Tensor,
    r: &Router<'_, B>,
    m: &MoeConfig,
) -> Result<Vec<Vec<(u32, f32)>>> {
    let mut logits = b.matmul(h, r.weight, p)?;
    if let Some(bias) = r.bias {
        b.add_bias(&mut logits, bias)?;
    }
    let logits = b.to_host(&logits)?;
    if let Some(i) = logits.iter().position(|v| !v.is_finite()) {
        return Err(Error::Stage(format!("router logit {i} is {}", logits[i])));
    }
    match (&m.groups, r.correction) {
        (Some(g), Some(c)) if c.len() == m.experts => Ok(route_groups(&logits, m, g, c)),
        (Some(_), _) => Err(Error::Stage(format!(
            "group routing needs {} score corrections, the layer has {:?}",
            m.experts,
            r.correction.map(<[f32]>::len)
        ))),
        (None, _) => Ok(route(&logits, m)),
    }
}

/// The `k` largest of `v` (their indices; ties to the lower index).
fn top(v: &[f32], k: usize) -> Vec<usize> {
    let mut order: Vec<usize> = (0..v.len()).collect();
    order.sort_by(|&a, &b| v[b].total_cmp(&v[a]).then(a.cmp(&b)));
    order.truncate(k);
    order
}

/// DeepSeek-V3's routing (transformers' `DeepseekV3TopkRouter`): sigmoid scores, `correction`
/// added for the choice only; each group scored by its two best corrected scores, the best
/// `topk_group` groups eligible, their top-k chosen; weights are the chosen experts' plain scores,
/// renormalised when `norm_topk_prob`, times `routed_scaling_factor`.
pub fn route_groups(
    logits: &[f32],
    m: &MoeConfig,
    g: &layerstream_model::GroupRouting,
    correction: &[f32],
) -> Vec<Vec<(u32, f32)>> {
    let per = m.experts / g.n_group;
    logits
        .chunks_exact(m.experts)
        .map(|row| {
            let scores: Vec<f32> = row.iter().map(|&x| 1.0 / (1.0 + (-x).exp())).collect();
            let choice: Vec<f32> = scores.iter().zip(correction).map(|(s, c)| s + c).collect();
            let group_score: Vec<f32> = choice
                .chunks_exact(per)
                .map(|grp| top(grp, 2.min(per)).iter().map(|&i| grp[i]).sum())
                .collect();
            let groups = top(&group_score, g.topk_group);
            let masked: Vec<f32> = (0..m.experts)
                .map(|e| if groups.contains(&(e / per)) { choice[e] } else { f32::NEG_INFINITY })
                .collect();
            let chosen = top(&masked, m.top_k);
            let sum: f32 = chosen.iter().map(|&e| scores[e]).sum::<f32>() + 1e-20;
            chosen
                .iter()
                .map(|&e| {
                    let w = if m.norm_topk_prob { scores[e] / sum } else { scores[e] };
                    (e as u32, w * g.routed_scaling_factor)
                })
                .collect()
        })
        .collect()
}

/// The mixture-of-experts MLP on `h` (the post-attention-normed rows): each expert computes once
/// over the rows that chose it, its output added into theirs scaled by their router weight; every
/// product in `p`.
pub fn moe_mlp<B: Backend>(
    b: &B,
    p: Precision,
    layer: u32,
    h: &B::Tensor,
    router: &Router<'_, B>,
    m: &MoeConfig,
    source: &mut dyn ExpertSource<B>,
) -> Result<(B::Tensor, ExpertCounts)> {
    let groups = by_expert(&choose(b, p, h, router, m)?);
    let ids: Vec<u32> = groups.keys().copied().collect();
    let (weights, counts) = source.experts(layer, &ids)?;
    let (rows, cols) = b.dims(h);
    let mut acc = b.from_host(&vec![0.0; rows * cols], rows, cols)?;
    for ((rows, scale), w) in groups.values().zip(&weights) {
        let x = b.gather_rows(h, rows)?;
        let (mut g, mut u) = (b.matmul(&x, &w.gate, p)?, b.matmul(&x, &w.up, p)?);
        if let Some([gb, ub, _]) = &w.biases {
            b.add_bias(&mut g, gb)?;
            b.add_bias(&mut u, ub)?;
        }
        let a = match m.swiglu_clamp {
            Some(c) => b.swiglu_clamp_mul(&g, &u, c.alpha, c.limit)?,
            None => b.silu_mul(&g, &u)?,
        };
        let mut d = b.matmul(&a, &w.down, p)?;
        if let Some([_, _, db]) = &w.biases {
            b.add_bias(&mut d, db)?;
        }
        b.add_rows_scaled(&mut acc, &d, rows, scale)?;
    }
    Ok((acc, counts))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg(experts: usize, top_k: usize, norm: bool) -> MoeConfig {
        MoeConfig {
            experts,
            top_k,
            expert_intermediate: 4,
            norm_topk_prob: norm,
            ..Default::default()
        }
    }

    /// DeepSeek-V3's routing as transformers computes it, worked by hand: 8 experts in 4 groups of
    /// 2, top-2 groups, top-3 experts; the correction moves the choice, not the weights.
    #[test]
    fn group_routing_follows_deepseek() {
        let g = layerstream_model::GroupRouting {
            n_group: 4,
            topk_group: 2,
            routed_scaling_factor: 2.5,
        };
        let m = MoeConfig { groups: Some(g), ..cfg(8, 3, true) };
        let logits = [2.0f32, 1.0, -1.0, 3.0, 0.5, 0.4, -2.0, -3.0];
        // A correction that lifts group 3 (experts 6, 7) over group 0's second best.
        let corr = [0.0f32, 0.0, 0.0, 0.0, 0.0, 0.0, 1.5, 1.5];
        let r = route_groups(&logits, &m, &g, &corr);
        let s = |x: f32| 1.0 / (1.0 + (-x).exp());
        // Group sums: g0 = s(2)+s(1) = 1.61, g1 = s(-1)+s(3) = 1.22, g2 = 1.22, g3 = 0.17+0.05+3.
        // Best two groups: 3 and 0; their corrected scores: e6 1.62, e7 1.55, e0 0.88, e1 0.73.
        let ids: Vec<u32> = r[0].iter().map(|t| t.0).collect();
        assert_eq!(ids, vec![6, 7, 0]);
        let sum = s(-2.0) + s(-3.0) + s(2.0);
        for (e, w) in &r[0] {
            let want = s(logits[*e as usize]) / sum * 2.5;
            assert!((w - want).abs() < 1e-6, "expert {e}");
        }
    }

    /// Top-k of the softmax, renormalised or not; Mixtral's softmax over the top-k logits equals
    /// the renormalised form.
    #[test]
    fn routing_follows_the_definition() {
        let logits = [0.1f32, 2.0, -1.0, 1.5];
        let r = route(&logits, &cfg(4, 2, false));
        let z: f32 = logits.iter().map(|v| v.exp()).sum();
        assert_eq!(r[0].iter().map(|t| t.0).collect::<Vec<_>>(), vec![1, 3]);
        assert!((r[0][0].1 - 2f32.exp() / z).abs() < 1e-6);
        let n = route(&logits, &cfg(4, 2, true));
        let (a, b) = (2f32.exp(), 1.5f32.exp());
        assert!((n[0][0].1 - a / (a + b)).abs() < 1e-6 && (n[0][1].1 - b / (a + b)).abs() < 1e-6);
        let g = by_expert(&[n[0].clone(), vec![(3, 1.0)]]);
        assert_eq!(g.keys().copied().collect::<Vec<_>>(), vec![1, 3]);
        assert_eq!(g[&3].0, vec![0, 1]);
    }
}
