//! The planner: (model, workers' budgets, options) → each worker's layer range (in proportion to
//! the budgets, the head's compute counted on the last), resident layers, streaming buffers and KV
//! capacity. Pure logic, validated up front: a budget that cannot fit is an
//! error before anything is loaded.

use crate::error::{Error, Result};
use layerstream_model::Manifest;
use layerstream_serving::plan::{layer_bytes, range_experts, usage_with, Assignment};

/// A worker as the planner sees it.
#[derive(Debug, Clone, PartialEq)]
pub struct WorkerSpec {
    pub(crate) address: String,
    pub(crate) budget: u64,
    /// The KV dtype it stores (resolved from `--kv-dtype` for its device).
    pub(crate) kv_dtype: String,
    /// It computes streamed layers where the loader put them (a CPU worker): its streaming buffers
    /// take no memory of its own.
    pub(crate) in_place: bool,
    /// Its dtype came from `--kv-dtype auto` and may be halved past RAM (`auto_kv_dtypes`).
    pub(crate) kv_auto: bool,
}

impl WorkerSpec {
    /// A worker on `device` (`exact`: it keeps f32 activations) with `flags`' KV dtype.
    pub(crate) fn new(
        address: String,
        budget: u64,
        device: &str,
        exact: bool,
        kv: &crate::KvFlags,
    ) -> Self {
        let in_place = layerstream_serving::plan::streams_in_place(device);
        WorkerSpec {
            address,
            budget,
            kv_dtype: kv.dtype_for(device),
            in_place,
            kv_auto: kv.kv_dtype == "auto" && in_place && !exact,
        }
    }
}

/// Planner options (from the coordinator's flags).
#[derive(Debug, Clone, PartialEq)]
pub struct PlanOptions {
    /// Resident layers per worker; `None` = as many as each budget allows.
    pub(crate) resident_layers: Option<usize>,
    pub(crate) group_size: usize,
    pub(crate) buffers: usize,
    pub(crate) kv_capacity: usize,
    pub(crate) prefetch: bool,
    /// Experts kept per worker (mixture-of-experts models); `None` = every expert if the budget
    /// holds them, else what the budget leaves after the resident layers (see `plan`).
    pub(crate) expert_cache: Option<usize>,
    /// Speculative decoding's draft model, placed whole on the head worker: its store directory and
    /// the bytes its weights and KV cache take there (`draft_bytes`).
    pub(crate) draft: Option<(String, u64)>,
    /// Positions per KV block.
    pub(crate) kv_block: usize,
    /// Slots of each worker's host-RAM KV tier.
    pub(crate) kv_host_blocks: u32,
}

/// The plan the coordinator would make over `budgets` (one worker each, `device` for the KV
/// dtype) with `flags` and no draft model: each worker's assignment and the KV capacity (for
/// `layerstream plan`, which shows it before anything starts).
pub fn plan_for(
    m: &Manifest,
    budgets: &[u64],
    device: &str,
    exact: bool,
    flags: &crate::PlanFlags,
) -> Result<(Vec<Assignment>, usize)> {
    let mut workers: Vec<WorkerSpec> = budgets
        .iter()
        .enumerate()
        .map(|(i, &budget)| {
            WorkerSpec::new(format!("worker {i}"), budget, device, exact, &flags.kv)
        })
        .collect();
    let mut o = PlanOptions {
        resident_layers: flags.resident_layers,
        group_size: flags.layer_group_size,
        buffers: flags.streaming_buffers,
        kv_capacity: DEFAULT_KV_CAPACITY,
        prefetch: !flags.no_prefetch,
        expert_cache: flags.expert_cache,
        draft: None,
        kv_block: flags.kv.kv_block,
        kv_host_blocks: 0,
    };
    auto_kv_dtypes(m, &mut workers, &o);
    o.kv_capacity = kv_capacity_that_fits(m, &workers, &o, flags.kv_capacity);
    Ok((plan(m, &workers, &o)?, o.kv_capacity))
}

/// Whether a worker's budget cannot keep its whole range resident, experts included (`plans`: a
/// plan with as many resident layers as fit; None: not even that plans) — the model streams past
/// its memory.
fn past_memory(plans: Option<&Vec<Assignment>>, i: usize) -> bool {
    plans.and_then(|p| p.get(i)).is_none_or(|p| {
        p.resident.len() < (p.layer_end - p.layer_start) as usize || p.expert_cache > 0
    })
}

/// `--kv-dtype auto` on a CPU worker not under `--exact` is f32 (as transformers computes) while
/// its budget keeps every layer of its range resident with the smallest KV cache; past that the KV
/// cache takes bytes from resident layers — each one a layer more read per pass — and f16 halves it.
pub fn auto_kv_dtypes(m: &Manifest, workers: &mut [WorkerSpec], o: &PlanOptions) {
    let trial = PlanOptions { kv_capacity: MIN_KV_CAPACITY, resident_layers: None, ..o.clone() };
    let plans = plan(m, workers, &trial).ok();
    for (i, w) in workers.iter_mut().enumerate() {
        if w.kv_auto && past_memory(plans.as_ref(), i) {
            w.kv_dtype = "f16".into();
        }
    }
}

/// KV positions planned when `--kv-capacity` is not given and the budgets hold them.
pub const DEFAULT_KV_CAPACITY: usize = 8192;
/// Past memory, the KV cache's most: this fraction of a worker's budget.
pub const PAST_MEMORY_KV_SHARE: u64 = 8;
/// The fewest positions an automatic capacity goes down to (then the plan's own error says why).
pub const MIN_KV_CAPACITY: usize = 256;

/// The KV capacity to plan with: `flag` when given; else the model's context (at most
/// `DEFAULT_KV_CAPACITY`), halved until every worker's budget holds a streaming plan with it (so
/// a KV cache never makes a model that fits unplannable; resident layers then take what is left)
/// and, on a worker that cannot keep all its layers resident, the cache takes at most
/// `1 / PAST_MEMORY_KV_SHARE` of its budget (every byte more is read from disk on every pass),
/// down to `MIN_KV_CAPACITY`. Whole KV blocks.
pub fn kv_capacity_that_fits(
    m: &Manifest,
    workers: &[WorkerSpec],
    o: &PlanOptions,
    flag: Option<usize>,
) -> usize {
    if let Some(c) = flag {
        return c;
    }
    let block = o.kv_block.max(1);
    let whole = |c: usize| (c / block).max(1) * block;
    let mut c = whole(m.config.max_position_embeddings.clamp(MIN_KV_CAPACITY, DEFAULT_KV_CAPACITY));
    while c > MIN_KV_CAPACITY {
        let trial = PlanOptions { kv_capacity: c, resident_layers: Some(0), ..o.clone() };
        let fitted = PlanOptions { kv_capacity: c, resident_layers: None, ..o.clone() };
        let most = plan(m, workers, &fitted).ok();
        let small_enough = |(i, w): (usize, &WorkerSpec)| {
            let kv = most.as_ref().map_or(u64::MAX, |p| {
                layerstream_serving::plan::usage_with(m, &p[i], w.in_place).kv
            });
            !past_memory(most.as_ref(), i) || kv <= w.budget / PAST_MEMORY_KV_SHARE
        };
        if plan(m, workers, &trial).is_ok() && workers.iter().enumerate().all(small_enough) {
            return c;
        }
        c = whole(c / 2).max(MIN_KV_CAPACITY);
    }
    c
}

/// The bytes a draft model takes on its worker: every store file, and f32 keys and values for
/// `kv_capacity` positions on every layer.
/// The draft's config comes from a file: a crafted size saturates (and then exceeds every budget)
/// rather than wrapping below one.
pub fn draft_bytes(draft: &Manifest, kv_capacity: usize) -> u64 {
    let c = &draft.config;
    let kv = [c.num_layers, c.num_kv_heads, c.head_dim, 4, kv_capacity]
        .into_iter()
        .fold(2u64, |a, n| a.saturating_mul(n as u64));
    draft.files.iter().fold(kv, |a, f| a.saturating_add(f.size))
}

/// The head's compute (final norm and lm_head, run for every sampled row) in layers' worth: its
/// multiply-adds per token over one layer's (attention projections and MLP). SmolLM2-135M: 8.0.
pub fn head_layers(c: &layerstream_model::ModelConfig) -> f64 {
    let (h, q, kv) = (c.hidden_size, c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim);
    let layer = h * q + 2 * h * kv + q * h + 3 * h * c.intermediate_size;
    (h * c.vocab_size) as f64 / layer.max(1) as f64
}

/// Splits `n` layers over workers in proportion to their budgets, the last worker's share of the
/// work including the head (`head` layers' worth of compute, see `head_layers`), so with
/// micro-batches in flight no worker waits on a slower one; each worker gets at least one layer.
pub fn split_layers(n: usize, budgets: &[u64], head: f64) -> Result<Vec<std::ops::Range<u32>>> {
    let w = budgets.len();
    if w == 0 {
        return Err(Error::Plan("no workers".into()));
    }
    if w > n {
        return Err(Error::Plan(format!(
            "{w} workers but only {n} layers: every worker needs at least one layer"
        )));
    }
    let total: f64 = budgets.iter().map(|&b| b.max(1) as f64).sum();
    let work = n as f64 + head.max(0.0);
    let (mut out, mut start, mut cum) = (Vec::with_capacity(w), 0u32, 0.0);
    for (i, &b) in budgets.iter().enumerate() {
        cum += b.max(1) as f64 / total * work;
        let end = if i == w - 1 {
            n
        } else {
            // At least one layer here and one for each worker after.
            (cum.round() as usize).clamp(start as usize + 1, n - (w - 1 - i))
        };
        out.push(start..end as u32);
        start = end as u32;
    }
    Ok(out)
}

/// `k` of the layers in `range` spread evenly, starting with the first, so every streamed layer has
/// resident compute in front of it to hide its load behind.
pub fn interleave(range: &std::ops::Range<u32>, k: usize) -> Vec<u32> {
    let n = range.len();
    let k = k.min(n);
    (0..k).map(|i| range.start + (i * n / k) as u32).collect()
}

/// Plans every worker as the assignments sent to them; errors name the worker and what does not fit.
pub fn plan(m: &Manifest, workers: &[WorkerSpec], o: &PlanOptions) -> Result<Vec<Assignment>> {
    let budgets: Vec<u64> = workers.iter().map(|w| w.budget).collect();
    let ranges = split_layers(m.config.num_layers, &budgets, head_layers(&m.config))?;
    let last = ranges.len() - 1;
    let mut plans = Vec::with_capacity(ranges.len());
    for (i, (range, w)) in ranges.into_iter().zip(workers).enumerate() {
        // The head worker holds the draft model beside its layers.
        let draft = o.draft.as_ref().filter(|_| i == last);
        let spec = WorkerSpec {
            budget: w.budget.checked_sub(draft.map_or(0, |d| d.1)).ok_or_else(|| {
                Error::Plan(format!(
                    "worker {}: the draft model needs {} bytes, more than its memory budget of {} bytes",
                    w.address,
                    draft.map_or(0, |d| d.1),
                    w.budget
                ))
            })?,
            ..w.clone()
        };
        let w = &spec;
        // What an assignment takes on this worker: a CPU worker's streaming buffers are the
        // loader's slots themselves.
        let usage = |m: &Manifest, a: &Assignment| usage_with(m, a, w.in_place);
        let mut p = Assignment {
            worker: w.address.clone(),
            layer_start: range.start,
            layer_end: range.end,
            resident: Vec::new(),
            group_size: o.group_size.max(1) as u32,
            streaming_buffers: o.buffers as u32,
            kv_capacity: o.kv_capacity as u64,
            embed: i == 0,
            head: i == last,
            prefetch: o.prefetch,
            bytes_needed: 0,
            assignment_id: String::new(),
            micro_batches: 1,
            expert_cache: o.expert_cache.unwrap_or(0) as u32,
            draft_model: draft.map_or(String::new(), |d| d.0.clone()),
            kv_dtype: w.kv_dtype.clone(),
            kv_block: o.kv_block as u32,
            kv_host_blocks: o.kv_host_blocks,
        };
        let (n_experts, _, largest_expert) = range_experts(m, &p);
        let whole = Assignment { resident: range.clone().collect(), ..p.clone() };
        if o.expert_cache.is_none() && n_experts > 0 && usage(m, &whole).total() > w.budget {
            // Attention and routers (the layer files) stay resident first: they are small and every
            // token uses them. The experts get a cache of one layer's worth at least, then whatever
            // the budget leaves.
            p.expert_cache = m.config.moe.as_ref().map_or(1, |x| x.experts) as u32;
        }
        let k = match o.resident_layers {
            Some(k) => k.min(range.len()),
            None => {
                // The most resident layers whose usage fits the budget.
                (0..=range.len())
                    .rev()
                    .find(|&k| usage(m, &Assignment { resident: interleave(&range, k), ..p.clone() }).total() <= w.budget)
                    .ok_or_else(|| {
                        let u = usage(m, &Assignment { resident: vec![], ..p.clone() });
                        Error::Plan(format!("worker {}: memory budget {} bytes cannot hold even a streaming plan for layers {}..{}: needs {u}", w.address, w.budget, range.start, range.end))
                    })?
            }
        };
        p.resident = interleave(&range, k);
        if p.expert_cache > 0 && o.expert_cache.is_none() && largest_expert > 0 {
            let spare = w.budget.saturating_sub(usage(m, &p).total()) / largest_expert;
            p.expert_cache = (p.expert_cache as u64 + spare).min(n_experts as u64) as u32;
        }
        if p.expert_cache as usize >= n_experts {
            p.expert_cache = 0; // a cache that holds every expert is every expert kept
        }
        let u = usage(m, &p);
        if u.total() > w.budget {
            return Err(Error::Plan(format!(
                "worker {}: layers {}..{} with {k} resident need {u}, more than its memory budget of {} bytes",
                w.address, range.start, range.end, w.budget
            )));
        }
        if range.clone().any(|l| layer_bytes(m, l) == 0) {
            return Err(Error::Plan(format!(
                "the store lacks a layer file in {}..{}",
                range.start, range.end
            )));
        }
        p.bytes_needed = u.total() + draft.map_or(0, |d| d.1);
        plans.push(p);
    }
    Ok(plans)
}

#[cfg(test)]
mod tests;
