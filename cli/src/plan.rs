//! `layerstream plan --model STORE [up's flags]`: what `up` would place where on this machine,
//! before anything starts — the memory ledger and each part's share, each worker's layers (resident
//! on its device, or streamed), the KV capacity, where each layer of a pass comes from (the device,
//! the loader's RAM tier, the disk: the slot pool's own decisions replayed) with their bytes, the
//! calibration (`calibration.rs`: disk, link, compute per layer) and the cost model's predicted
//! pass time and tokens/s at batch 1, 8 and 64 with what bounds each. `--json` prints it as one
//! JSON object; `up` logs the same prediction.

use crate::plan_experts::{expert_fetches, Misses};
use anyhow::{bail, Result};
use layerstream_coordinator::cost::{best_reading, predict, Fetches, Figures, Prediction, Source};
use layerstream_loader::DEFAULT_PREFETCH_DEPTH;
use layerstream_serving::plan::{layer_bytes, Assignment};
use serde_json::json;

/// Layers a pass reads from each tier, and their bytes.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct Tiers {
    pub device: (usize, u64),
    pub ram: (usize, u64),
    pub disk: (usize, u64),
}

/// Sums layers by source.
pub fn tiers(layers: &[(Source, u64)]) -> Tiers {
    let mut t = Tiers::default();
    for &(s, b) in layers {
        let e = match s {
            Source::Device => &mut t.device,
            Source::Ram => &mut t.ram,
            Source::Disk => &mut t.disk,
        };
        *e = (e.0 + 1, e.1 + b);
    }
    t
}

/// Where each layer of a pass comes from (in pass order): resident layers from the device; the
/// streamed ones (every worker's, in turn) from the loader's slots or, where the pool
/// (`disk_reads_per_pass`: `slots` slots, `depth` read ahead) reads them again each pass, the disk.
pub fn sources(
    m: &layerstream_model::Manifest,
    plans: &[Assignment],
    slots: usize,
    depth: usize,
) -> Vec<(Source, u64)> {
    let order: Vec<u32> = plans
        .iter()
        .flat_map(|p| (p.layer_start..p.layer_end).filter(|l| !p.resident.contains(l)))
        .collect();
    let disk = layerstream_loader::disk_reads_per_pass(&order, slots, depth);
    plans
        .iter()
        .flat_map(|p| p.layer_start..p.layer_end)
        .map(|l| {
            let s = if plans.iter().any(|p| p.resident.contains(&l)) {
                Source::Device
            } else if disk.contains(&l) {
                Source::Disk
            } else {
                Source::Ram
            };
            (s, layer_bytes(m, l))
        })
        .collect()
}

/// What `up` would do, and what it would deliver.
pub struct Placement {
    pub plans: Vec<Assignment>,
    pub kv_capacity: usize,
    pub budget: u64,
    pub layers: Vec<(Source, u64)>,
    pub figures: Figures,
    pub cached: bool,
    /// For each batch size asked for: each layer's expert fetches at that batch
    /// (`plan_experts::expert_fetches`) and what the pass predicts.
    pub fetches: Vec<Vec<Fetches>>,
    pub predicted: Vec<Prediction>,
    /// Layers the loader reads ahead: `--prefetch-depth`, or the cost model's choice.
    pub prefetch_depth: usize,
    /// Whether the expert fetches come from the store's usage history (else routing is taken as
    /// spread evenly over the experts: the worst case for a cache), or a share given.
    pub routing_history: bool,
    /// The share of a run's expert needs that meet experts the history never saw
    /// (`History::novelty`), where the history knows it.
    pub novelty: Option<f64>,
    /// The disk's GB/s as past disk-bound runs were served (`served::rate`) and how many runs
    /// (decayed), where the prediction used it.
    pub served: Option<(f64, f64)>,
    /// The disk's GB/s at the chosen read-ahead as calibration measured it.
    pub calibrated_gbps: f64,
}

/// Plans `a` over `shares` as the coordinator will, calibrates (cached) and predicts a pass at
/// each of `rows` sequences — with the disk at `disk_gbps` where given (`plan --disk-gbps`: the
/// way of reading and the read-ahead are still chosen from calibration, as `up` chose them) and
/// the expert caches missing as `misses` says.
pub fn placement(
    a: &crate::up::UpArgs,
    store: &layerstream_model::Store,
    shares: &crate::fit::Shares,
    rows: &[usize],
    (disk_gbps, misses): (Option<f64>, Misses),
) -> Result<Placement> {
    let budget = match layerstream_worker::Device::check(&a.device.compute.device) {
        // One GPU for every worker: the budget each will report — its free memory (or the flag,
        // never more) less the runtime reserve.
        Ok(Some(_)) => layerstream_worker::Device::open(&a.device.compute.device)?
            .budget(a.device.memory_budget)?,
        _ => match shares.worker_budget {
            Some(b) => b,
            None => bail!(
                "a stack over several devices needs each worker's budget: give --memory-budget"
            ),
        },
    };
    let budgets = vec![budget; a.workers.max(1)];
    let m = &store.manifest;
    let (plans, kv_capacity) = layerstream_coordinator::plan_for(
        m,
        &budgets,
        &a.device.compute.device,
        !a.device.compute.int8(),
        &a.plan,
    )?;
    let (mut measured, cached) = crate::calibration::figures(store, &a.device, a.recalibrate)?;
    if !a.pool.verify_every_read {
        // The loader checks nothing it reads (`--no-verify`, which excludes the flag), or each
        // file's first read only: a pass of the steady state re-reads files already checked.
        measured.verify_cpu_s_per_gb = 0.0;
    }
    let buffers = a.plan.streaming_buffers * a.plan.layer_group_size;
    let history = layerstream_worker::expert_history::History::load(
        &layerstream_worker::expert_history::path_for(store),
    );
    // The loader reads `depth` layers past the one a worker takes, which it takes while the one
    // before computes: one more read in flight than the depth. Unless given, the depth and the
    // way of reading (O_DIRECT, the page cache) the cost model predicts best (`best_reading`).
    let layers_at = |depth: usize| sources(m, &plans, shares.slots, depth + 1);
    let modes: Vec<bool> = match (a.pool.buffered_reads, a.pool.direct_reads) {
        (true, _) => vec![true],
        (_, true) => vec![false],
        _ => [false, true].into_iter().filter(|&b| measured.read_as(b).is_some()).collect(),
    };
    // Reads in flight beyond the slots the workers do not pin cannot happen.
    let room = shares.slots.saturating_sub(shares.pinned).max(1);
    let depths: Vec<usize> = match a.pool.prefetch_depth {
        Some(d) => vec![d],
        None => (measured.disk_by_reads.iter().map(|p| p.0))
            .filter(|&n| n >= 2 && n <= room)
            .map(|n| n - 1)
            .collect(),
    };
    let fetches_at = |r: usize| expert_fetches(m, &plans, r, &history, misses);
    let pass_as = |buffered: bool, d: usize, r: usize| {
        let f = measured.read_as(buffered).unwrap_or_else(|| measured.clone());
        predict(&f.reading(d + 1), &layers_at(d), &fetches_at(r), r, d + 1, buffers).pass_s
    };
    let (buffered, prefetch_depth) = best_reading(&modes, &depths, pass_as);
    let measured = measured.read_as(buffered).unwrap_or(measured);
    let figures = measured.reading(prefetch_depth + 1);
    let calibrated_gbps = figures.disk_gbps;
    // The disk as past disk-bound runs read it, where there were any (`served`), else as
    // calibration measured it; a rate given (`--disk-gbps`) over both.
    let served = crate::served::rate(store, &a.device, buffered);
    let figures = match (disk_gbps, served) {
        (Some(g), _) | (None, Some((g, _))) => figures.with_disk(g),
        (None, None) => figures,
    };
    let layers = layers_at(prefetch_depth);
    let fetches: Vec<_> = rows.iter().map(|&r| fetches_at(r)).collect();
    let predicted = rows
        .iter()
        .zip(&fetches)
        .map(|(&r, x)| predict(&figures, &layers, x, r, prefetch_depth + 1, buffers))
        .collect();
    Ok(Placement {
        plans,
        kv_capacity,
        budget,
        layers,
        figures,
        cached,
        fetches,
        predicted,
        prefetch_depth,
        routing_history: !history.is_empty(),
        novelty: history.novelty(),
        served: served.filter(|_| disk_gbps.is_none()),
        calibrated_gbps,
    })
}

/// One line per batch size: tokens/s, pass time, what bounds it.
pub fn describe_predictions(p: &[Prediction]) -> String {
    p.iter()
        .map(|p| {
            format!(
                "batch {}: {:.2} tok/s (a pass {:.2} s: compute {:.2} s, reading's CPU {:.2} s, \
                 waits for experts {:.2} s, disk {:.2} s, link {:.2} s; bound by {})",
                p.rows,
                p.tokens_per_s,
                p.pass_s,
                p.compute_s,
                p.read_cpu_s,
                p.fetch_s,
                p.disk_s,
                p.link_s,
                p.bound
            )
        })
        .collect::<Vec<_>>()
        .join("\n  ")
}

/// One batch size's prediction as `layerstream plan --json` prints it.
#[derive(Debug, Clone, serde::Deserialize)]
pub struct Predicted {
    pub rows: usize,
    pub pass_s: f64,
    pub tokens_per_s: f64,
    pub bound: String,
}

/// The cost model's prediction for the stack `up_args` (an `up` command line) would run, at each
/// of `rows` (with the disk at `disk_gbps` where given: `--disk-gbps`; the expert caches missing
/// the share `expert_misses` of the needs where given: `--expert-misses`): what `bench` prints
/// beside what it measures, and what `up` hands the coordinator for a GPU stack. `layerstream plan
/// --json` answers it in a process of its own, so a GPU's calibration holds no device context
/// beside the stacks.
pub fn predict_stack(
    up_args: &[String],
    rows: &[usize],
    (disk_gbps, expert_misses): (Option<f64>, Option<f64>),
) -> Result<(Vec<Predicted>, Reading)> {
    let batches: Vec<String> = rows.iter().map(usize::to_string).collect();
    let disk = disk_gbps.map(|g| format!("--disk-gbps={g}"));
    let misses = expert_misses.map(|s| format!("--expert-misses={s}"));
    let out = std::process::Command::new(std::env::current_exe()?)
        .arg("plan")
        .args(up_args.iter().skip(1))
        .args(["--json", "--batches", &batches.join(",")])
        .args(disk.into_iter().chain(misses))
        .stdin(std::process::Stdio::null())
        .output()?;
    if !out.status.success() {
        let err = String::from_utf8_lossy(&out.stderr);
        bail!("layerstream plan: {}", err.lines().last().unwrap_or("failed"));
    }
    let v: serde_json::Value = serde_json::from_slice(&out.stdout)?;
    let p: Vec<Predicted> = serde_json::from_value(v["predicted"].clone())?;
    if p.len() != rows.len() {
        bail!("layerstream plan printed no prediction: {v}");
    }
    let depth = v["prefetch_depth"].as_u64().map_or(DEFAULT_PREFETCH_DEPTH, |d| d as usize);
    let buffered = v["calibration"]["buffered_reads"].as_bool().unwrap_or(false);
    Ok((p, Reading { depth, buffered }))
}

/// How the loader reads, as the cost model chose: layers ahead, and through the page cache or not.
#[derive(Debug, Clone, Copy)]
pub struct Reading {
    /// Layers read ahead of each worker.
    pub depth: usize,
    /// Through the page cache (`--buffered-reads`), not O_DIRECT.
    pub buffered: bool,
}

/// What the cost model predicts for the stack `up` starts (`a`, over `shares`), logged, as the
/// curve the coordinator sets each decode step beside, and how the loader should read (None: no
/// prediction; the loader reads its default depth ahead, O_DIRECT). CPU workers are calibrated
/// here; a GPU stack asks a `layerstream plan` process with `up`'s own command line (this process
/// must hold no device context for the stack's life). A prediction that cannot be made is said and
/// skipped: the coordinator's own plan decides whether the stack runs.
pub fn for_up(
    a: &crate::up::UpArgs,
    store: &layerstream_model::Store,
    shares: &crate::fit::Shares,
) -> (Option<layerstream_coordinator::cost::Curve>, Option<Reading>) {
    use layerstream_coordinator::cost::Curve;
    let rows = crate::calibration::ROWS;
    let predicted = if a.device.compute.device == "cpu" {
        placement(a, store, shares, &rows, (None, Misses::History)).map(|p| {
            let each = |p: &Prediction| Predicted {
                rows: p.rows,
                pass_s: p.pass_s,
                tokens_per_s: p.tokens_per_s,
                bound: p.bound.to_owned(),
            };
            let reading = Reading { depth: p.prefetch_depth, buffered: p.figures.buffered_reads };
            (p.predicted.iter().map(each).collect::<Vec<_>>(), reading)
        })
    } else {
        let args: Vec<String> = std::env::args().skip(1).collect();
        if args.first().map(String::as_str) != Some("up") {
            return (None, None); // not started from a command line to hand on
        }
        predict_stack(&args, &rows, (None, None))
    };
    match predicted {
        Ok((p, reading)) => {
            let lines: Vec<String> = p
                .iter()
                .map(|p| {
                    format!(
                        "batch {}: {:.2} tok/s (a pass {:.3} s; bound by {})",
                        p.rows, p.tokens_per_s, p.pass_s, p.bound
                    )
                })
                .collect();
            eprintln!("layerstream up: predicted decode:\n  {}", lines.join("\n  "));
            if a.pool.prefetch_depth.is_none() {
                let depth = reading.depth;
                eprintln!("layerstream up: the loader reads {depth} layers ahead (the cost model's choice for this disk; --prefetch-depth sets it)");
            }
            if reading.buffered && !a.pool.buffered_reads {
                eprintln!("layerstream up: the loader reads through the page cache (the cost model's choice: its faster reads outweigh their copies' CPU here; --direct-reads refuses it)");
            }
            (Some(Curve(p.iter().map(|p| (p.rows, p.pass_s)).collect())), Some(reading))
        }
        Err(e) => {
            eprintln!("layerstream up: no prediction: {e:#}");
            (None, None)
        }
    }
}

/// `layerstream plan`'s arguments: `up`'s, and the batch sizes to predict.
#[derive(clap::Args, Debug)]
pub struct PlanArgs {
    #[command(flatten)]
    pub up: crate::up::UpArgs,
    /// Sequences per pass to predict decode at (comma-separated).
    #[arg(long, env = "LAYERSTREAM_PLAN_BATCHES", value_delimiter = ',', default_value = "1,8,64")]
    pub batches: Vec<usize>,
    /// Predict with the store's disk reading this many GB/s with the loader's reads in flight
    /// instead of the calibrated figure (the read-ahead and the way of reading are still chosen
    /// from calibration): `bench` passes the rate the loader measured during its run (bytes ÷ the
    /// wall time a read was in flight), to tell the cost model's error from the disk's drift.
    #[arg(long, env = "LAYERSTREAM_PLAN_DISK_GBPS", value_name = "GB_PER_S", value_parser = positive_gbps)]
    pub disk_gbps: Option<f64>,
    /// Predict with each worker's expert cache missing this share (0..1) of the experts its steps
    /// need instead of what the store's usage history suggests: `bench` passes the share its run
    /// measured, to tell the cost model's error from a prompt's unseen experts.
    #[arg(long, env = "LAYERSTREAM_PLAN_EXPERT_MISSES", value_name = "SHARE", value_parser = share)]
    pub expert_misses: Option<f64>,
}

/// A share: a number from 0 to 1.
fn share(s: &str) -> std::result::Result<f64, String> {
    match s.parse::<f64>() {
        Ok(x) if (0.0..=1.0).contains(&x) => Ok(x),
        _ => Err(format!("{s:?} is not a share: expected a number from 0 to 1, e.g. 0.02")),
    }
}

/// A disk rate: a finite number of GB/s above 0.
fn positive_gbps(s: &str) -> std::result::Result<f64, String> {
    match s.parse::<f64>() {
        Ok(g) if g.is_finite() && g > 0.0 => Ok(g),
        _ => Err(format!("{s:?} is not a disk rate: expected GB/s above 0, e.g. 1.5")),
    }
}

pub fn run(args: PlanArgs) -> Result<()> {
    let a = args.up;
    if args.batches.is_empty() || args.batches.contains(&0) {
        bail!("--batches takes sequence counts of 1 or more, e.g. 1,8,64");
    }
    let model = crate::run::model_dir(&a.model)?;
    let store = layerstream_model::Store::open(&model)?;
    let (ledger, shares) = crate::up::memory_shares(&a, &store)?;
    let misses = args.expert_misses.map_or(Misses::History, Misses::Share);
    let p = placement(&a, &store, &shares, &args.batches, (args.disk_gbps, misses))?;
    let m = &store.manifest;
    let t = tiers(&p.layers);
    let in_place = layerstream_serving::plan::streams_in_place(&a.device.compute.device);
    let workers: Vec<_> = p
        .plans
        .iter()
        .map(|w| {
            let u = layerstream_serving::plan::usage_with(m, w, in_place);
            json!({"layers": [w.layer_start, w.layer_end], "resident": w.resident,
                "budget": p.budget, "needs": u.total(), "kv_capacity": w.kv_capacity,
                "kv_dtype": w.kv_dtype, "streaming_buffers": w.streaming_buffers,
                "expert_cache": w.expert_cache})
        })
        .collect();
    let source = |s: Source| match s {
        Source::Device => "device",
        Source::Ram => "ram",
        Source::Disk => "disk",
    };
    let f = &p.figures;
    // Expected expert reads per pass (mixture-of-experts stores) at each batch size.
    let expert_bytes: Vec<u64> =
        p.fetches.iter().map(|x| x.iter().map(Fetches::bytes).sum::<f64>() as u64).collect();
    let routing = match misses {
        Misses::Share(_) => "given",
        Misses::History if p.routing_history => "usage history",
        Misses::History => "even",
    };
    let v = json!({
        "memory": {"usable": ledger.usable(), "summary": ledger.describe()},
        "shares": {"slots": shares.slots, "slot_bytes": shares.slot_size, "worker_budget": p.budget,
            "kv_host_bytes": shares.kv_host_bytes, "margin": shares.margin},
        "workers": workers,
        "kv_capacity": p.kv_capacity,
        "layers": p.layers.iter().map(|&(s, _)| source(s)).collect::<Vec<_>>(),
        "tiers": {"device": {"layers": t.device.0, "bytes": t.device.1},
            "ram": {"layers": t.ram.0, "bytes_per_pass": t.ram.1},
            "disk": {"layers": t.disk.0, "bytes_per_pass": t.disk.1},
            "experts_from_disk_bytes_per_pass": expert_bytes,
            "expert_routing": routing, "expert_novelty": p.novelty},
        "calibration": {"cached": p.cached, "disk_gbps": f.disk_gbps,
            "disk_gbps_calibrated": p.calibrated_gbps,
            "disk_gbps_served": p.served.map(|s| s.0), "served_runs": p.served.map(|s| s.1),
            "disk_gbps_by_reads_in_flight": f.disk_by_reads, "buffered_reads": f.buffered_reads,
            "read_cpu_s_per_gb": f.read_cpu_s_per_gb, "verify_cpu_s_per_gb": f.verify_cpu_s_per_gb,
            "read_cpu_share": f.read_cpu_share, "read_modes": f.read_modes,
            "disk_latency_ms": f.disk_latency_ms, "link_gbps": f.link_gbps,
            "layer_s": f.layer_s, "head_s": f.head_s},
        "prefetch_depth": p.prefetch_depth,
        "predicted": p.predicted,
    });
    if a.json {
        println!("{v}");
        return Ok(());
    }
    let gb = |b: u64| format!("{:.2} GB", b as f64 / 1e9);
    for (i, w) in p.plans.iter().enumerate() {
        let k = w.resident.len();
        let n = (w.layer_end - w.layer_start) as usize;
        println!("worker {i}: layers {}..{}: {k} resident on its device, {} streamed; budget {}, KV capacity {} positions ({})",
            w.layer_start, w.layer_end, n - k, gb(p.budget), w.kv_capacity, w.kv_dtype);
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
    if expert_bytes.iter().any(|&b| b > 0) || p.plans.iter().any(|w| w.expert_cache > 0) {
        let caches: Vec<String> = p.plans.iter().map(|w| w.expert_cache.to_string()).collect();
        let at: Vec<String> = (expert_bytes.iter().zip(&args.batches))
            .map(|(&b, r)| format!("{} at batch {r}", gb(b)))
            .collect();
        let routing = match (misses, p.novelty) {
            (Misses::Share(x), _) => {
                format!("each cache missing {:.1}% of its needs, as given", x * 100.0)
            }
            (_, _) if !p.routing_history => "no usage history yet: routing taken as spread evenly \
                over the experts, the worst case for a cache — a first run saves its routing and \
                later plans use it"
                .to_owned(),
            (_, Some(x)) => format!(
                "routing as this store's usage history counted it; {:.1}% of a run's needs met \
                 experts the history had not seen, and miss whatever the cache holds",
                x * 100.0
            ),
            (_, None) => "routing as this store's usage history counted it (no run since its \
                first to say how often a run meets unseen experts)"
                .to_owned(),
        };
        println!(
            "experts: a cache of {} per worker; fetched from disk a pass, the steps waiting for \
             them, {} ({routing})",
            caches.join(", "),
            at.join(", ")
        );
    }
    let ms = |v: &[(usize, f64)]| {
        v.iter().map(|(r, s)| format!("{:.1} ms at {r}", s * 1e3)).collect::<Vec<_>>().join(", ")
    };
    let reads: Vec<String> =
        f.disk_by_reads.iter().map(|(n, g)| format!("{g:.2} at {n}")).collect();
    println!(
        "read-ahead: {} layers ({}; disk GB/s by reads in flight{}: {})",
        p.prefetch_depth,
        if a.pool.prefetch_depth.is_some() {
            "--prefetch-depth"
        } else {
            "the cost model's choice"
        },
        match (f.buffered_reads, a.pool.buffered_reads || a.pool.direct_reads) {
            (true, false) => ", through the page cache: the cost model's choice here",
            (false, false) if f.read_modes.len() > 1 => ", O_DIRECT: the cost model's choice here",
            (true, true) => ", through the page cache (--buffered-reads)",
            (false, true) => ", O_DIRECT (--direct-reads)",
            _ => "",
        },
        reads.join(", ")
    );
    println!(
        "calibration{}: disk {:.2} GB/s (a 4 KiB read {:.2} ms; reading costs {:.3} s of CPU a GB, \
         its check {:.3}, {:.0}% of it taken from the compute){}; a layer {}; the head {}",
        if p.cached { " (cached; --recalibrate measures again)" } else { "" },
        p.calibrated_gbps,
        f.disk_latency_ms,
        f.read_cpu_s_per_gb,
        f.verify_cpu_s_per_gb,
        f.read_cpu_share * 100.0,
        f.link_gbps.map_or(String::new(), |g| format!(", link {g:.1} GB/s")),
        ms(&f.layer_s),
        ms(&f.head_s)
    );
    if let Some((g, runs)) = p.served {
        println!(
            "the disk as past runs served it: {g:.2} GB/s ({runs:.2} runs, the latest counting 1, \
             the one before ½; calibration {:.2} at this read-ahead): the prediction's",
            p.calibrated_gbps
        );
    }
    println!("predicted:\n  {}", describe_predictions(&p.predicted));
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tiers_sum_each_source() {
        let l = [(Source::Device, 5), (Source::Disk, 7), (Source::Ram, 3), (Source::Disk, 7)];
        assert_eq!(tiers(&l), Tiers { device: (1, 5), ram: (1, 3), disk: (2, 14) });
        assert_eq!(tiers(&[]), Tiers::default());
    }
}
