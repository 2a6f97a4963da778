//! `layerstream plan --model STORE [up's flags]`: what `up` would place where on this machine,
//! before anything starts — the memory ledger and each part's share, each worker's layers (resident
//! on its device, or streamed), the KV capacity, the three tiers a pass reads from (device, the
//! loader's RAM tier, the disk) with their bytes, the store's disk measured (O_DIRECT GB/s and
//! latency), and the disk-bound pass time and tokens/s at batch 1, 8 and 64. `--json` prints it as
//! one JSON object. Compute per layer is not measured yet: the figures are upper bounds where the
//! disk is the limit.

use anyhow::{bail, Result};
use layerstream_model::layout::layer_file;
use layerstream_model::plan::layer_bytes;
use serde_json::json;

/// Layers a pass reads from each tier, and their bytes.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct Tiers {
    pub device: (usize, u64),
    pub ram: (usize, u64),
    pub disk: (usize, u64),
}

/// Where each layer of a pass comes from: resident layers from the device; of the `streamed`
/// ones (each `bytes`), the loader's `slots` keep all when they hold them, else — the layers
/// cycle, and the pool evicts the one needed furthest ahead — `slots - 1` stay from pass to pass
/// and the rest are read from disk each pass.
pub fn tiers(resident: (usize, u64), streamed: &[u64], slots: usize) -> Tiers {
    let n = streamed.len();
    let kept = if slots >= n { n } else { slots.saturating_sub(1) };
    let (ram, disk) = streamed.split_at(kept.min(n));
    Tiers {
        device: resident,
        ram: (ram.len(), ram.iter().sum()),
        disk: (disk.len(), disk.iter().sum()),
    }
}

pub fn run(a: crate::up::UpArgs) -> Result<()> {
    let model = crate::run::model_dir(&a.model)?;
    let store = layerstream_model::Store::open(&model)?;
    let (ledger, shares) = crate::up::memory_shares(&a, &store)?;
    let budget = match (shares.worker_budget, a.device.memory_budget) {
        (Some(b), _) | (None, Some(b)) => b,
        (None, None) => {
            bail!("a GPU worker's plan needs its budget: give --memory-budget (its free memory)")
        }
    };
    let budgets = vec![budget; a.workers.max(1)];
    let m = &store.manifest;
    let (plans, kv_capacity) =
        layerstream_coordinator::plan_for(m, &budgets, &a.device.device, &a.plan)?;
    let mut streamed = Vec::new();
    let mut resident = (0usize, 0u64);
    for p in &plans {
        for l in p.layer_start..p.layer_end {
            if p.resident.contains(&l) {
                resident = (resident.0 + 1, resident.1 + layer_bytes(m, l));
            } else {
                streamed.push(layer_bytes(m, l));
            }
        }
    }
    let t = tiers(resident, &streamed, shares.slots);
    let files: Vec<_> = (0..m.config.num_layers).map(|l| store.dir.join(layer_file(l))).collect();
    let disk = layerstream_loader::measure_disk(&files, 1 << 30)?;
    let pass_s = t.disk.1 as f64 / (disk.gbps * 1e9).max(1.0);
    let tps = |b: f64| if pass_s > 0.0 { Some(b / pass_s) } else { None };
    let workers: Vec<_> = plans
        .iter()
        .map(|p| {
            let u = layerstream_model::plan::usage(m, p);
            json!({"layers": [p.layer_start, p.layer_end], "resident": p.resident,
                "budget": budget, "needs": u.total(), "kv_capacity": p.kv_capacity,
                "streaming_buffers": p.streaming_buffers, "expert_cache": p.expert_cache})
        })
        .collect();
    let v = json!({
        "memory": {"usable": ledger.usable(), "summary": ledger.describe()},
        "shares": {"slots": shares.slots, "slot_bytes": shares.slot_size, "worker_budget": budget,
            "kv_host_bytes": shares.kv_host_bytes, "margin": shares.margin},
        "workers": workers,
        "kv_capacity": kv_capacity,
        "tiers": {"device": {"layers": t.device.0, "bytes": t.device.1},
            "ram": {"layers": t.ram.0, "bytes_per_pass": t.ram.1},
            "disk": {"layers": t.disk.0, "bytes_per_pass": t.disk.1}},
        "disk": {"gbps": disk.gbps, "latency_ms": disk.latency_ms, "direct": disk.direct},
        "predicted": {"pass_s": pass_s, "bound": if pass_s > 0.0 { "disk" } else { "memory/compute (not measured)" },
            "tokens_per_s": {"1": tps(1.0), "8": tps(8.0), "64": tps(64.0)}},
    });
    if a.json {
        println!("{v}");
        return Ok(());
    }
    let gb = |b: u64| format!("{:.2} GB", b as f64 / 1e9);
    for (i, p) in plans.iter().enumerate() {
        let k = p.resident.len();
        let n = (p.layer_end - p.layer_start) as usize;
        println!("worker {i}: layers {}..{}: {k} resident on its device, {} streamed; budget {}, KV capacity {} positions",
            p.layer_start, p.layer_end, n - k, gb(budget), p.kv_capacity);
    }
    println!(
        "a pass reads: device {} layers ({}), RAM tier {} layers ({}), disk {} layers ({})",
        t.device.0,
        gb(t.device.1),
        t.ram.0,
        gb(t.ram.1),
        t.disk.0,
        gb(t.disk.1)
    );
    println!(
        "disk: {:.2} GB/s{}, a 4 KiB read {:.2} ms",
        disk.gbps,
        if disk.direct { " (O_DIRECT)" } else { " (buffered)" },
        disk.latency_ms
    );
    match (tps(1.0), tps(8.0), tps(64.0)) {
        (Some(a), Some(b), Some(c)) => println!("predicted, disk-bound: a pass {pass_s:.2} s → at most {a:.2} tok/s at batch 1, {b:.2} at 8, {c:.1} at 64 (compute per layer not measured yet)"),
        _ => println!("predicted: nothing read from disk per pass; the bound is memory or compute (not measured yet)"),
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn streamed_layers_come_from_ram_while_the_slots_hold_them_then_from_disk() {
        let layers = [10u64; 8];
        assert_eq!(
            tiers((2, 20), &layers, 8),
            Tiers { device: (2, 20), ram: (8, 80), disk: (0, 0) }
        );
        assert_eq!(
            tiers((0, 0), &layers, 5),
            Tiers { device: (0, 0), ram: (4, 40), disk: (4, 40) }
        );
        assert_eq!(tiers((0, 0), &layers, 0).disk, (8, 80));
        assert_eq!(tiers((3, 30), &[], 4).ram, (0, 0));
    }
}
