//! The cost model: what a placement delivers, predicted from measured figures — the store's disk
//! (O_DIRECT GB/s), the host→device link (none where a worker computes in place), and one layer's
//! and the head's compute at a few row counts. A pass is replayed layer by layer as the stack runs
//! it: the loader reads the disk tier's layers in order, at most `depth` ahead of the layer being
//! computed; a worker that copies (a GPU) takes each non-resident layer over the link into one of
//! its `buffers`, at most that many ahead; compute takes the layers in order, waiting for what it
//! needs, then the head. The third of three passes is the steady state (the next pass's first
//! reads overlap this one's tail). Pure: `layerstream plan` and `bench` feed it.

use serde::{Deserialize, Serialize};

/// Where a layer's weights come from in a pass.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Source {
    /// Resident on the worker's device.
    Device,
    /// Kept in a loader slot from pass to pass (host RAM).
    Ram,
    /// Read from disk every pass.
    Disk,
}

/// Measured figures of one host, store and device.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Figures {
    /// The store's disk: O_DIRECT GB/s over its layer files (with the default read-ahead's reads
    /// in flight).
    pub disk_gbps: f64,
    /// The disk's GB/s with n reads in flight, n ascending (`READS_IN_FLIGHT`): a disk that serves
    /// concurrent reads faster rewards reading further ahead (`best_depth`).
    #[serde(default)]
    pub disk_by_reads: Vec<(usize, f64)>,
    /// Whether the loader reads through the page cache (`--buffered-reads`) because calibration
    /// measured that faster than O_DIRECT on this disk (`buffered_pays`); `disk_gbps` and
    /// `disk_by_reads` are then the buffered figures.
    #[serde(default)]
    pub buffered_reads: bool,
    /// A 4 KiB read, ms.
    pub disk_latency_ms: f64,
    /// Pinned host→device GB/s; None where the worker computes from the slot in place (the CPU).
    pub link_gbps: Option<f64>,
    /// Seconds one decoder layer takes at each measured row count (ascending rows).
    pub layer_s: Vec<(usize, f64)>,
    /// Seconds the head (final norm and vocabulary projection) takes at each row count.
    pub head_s: Vec<(usize, f64)>,
    /// CPU seconds the loader's reads cost per GB in the mode above (`ReadMode::cpu_s_per_gb`).
    #[serde(default)]
    pub read_cpu_s_per_gb: f64,
    /// The share of those CPU seconds a pass's compute loses to them: 1 where the worker's
    /// threads take every core (the reader's copies run on a core a matmul waits for), 0 where a
    /// core is spare or the worker computes on a GPU (`read_cpu_share`).
    #[serde(default)]
    pub read_cpu_share: f64,
    /// Every way of reading calibration measured (O_DIRECT where the filesystem allows it, and
    /// through the page cache): `layerstream plan` chooses between them (`Figures::read_as`).
    #[serde(default)]
    pub read_modes: Vec<ReadMode>,
    /// CPU seconds per GB of the loader's check of each layer it reads (xxh3), on top of the
    /// read's own (`--no-verify` skips it: `layerstream plan` sets this to 0 then).
    #[serde(default)]
    pub verify_cpu_s_per_gb: f64,
}

/// One way of reading the store's layer files, as calibration measured it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ReadMode {
    /// Through the page cache (`--buffered-reads`), else O_DIRECT.
    pub buffered: bool,
    /// GB/s with n reads in flight, n ascending (`READS_IN_FLIGHT`).
    pub by_reads: Vec<(usize, f64)>,
    /// CPU seconds the reading threads spent per GB: a buffered read copies every byte out of the
    /// page cache; O_DIRECT's DMA costs little.
    pub cpu_s_per_gb: f64,
}

/// The share of the loader's read CPU time a CPU worker's compute loses: the part of one reader
/// thread that finds no core beyond the worker's `threads` among `cores` (1 with every core
/// computing, 0 with one spare).
pub fn read_cpu_share(threads: usize, cores: usize) -> f64 {
    (threads as f64 + 1.0 - cores as f64).clamp(0.0, 1.0)
}

/// Reads in flight the disk is measured at: the loader's read-ahead depth plus the read a worker
/// waits on.
pub const READS_IN_FLIGHT: [usize; 6] = [1, 2, 3, 4, 6, 8];

impl Figures {
    /// The disk's GB/s with `n` reads in flight: the curve measured (`disk_gbps` where none was)
    /// fitted non-decreasing (`monotone`), at the largest count not above `n` (the first below it).
    /// More reads in flight are never slower than fewer on a disk that queues them, so a figure
    /// above the ones after it is noise — but noise either way: taking the best figure below `n`
    /// let one fluke carry every depth (a VM's disk read 1.82 GB/s at one read in flight and
    /// 0.49-0.55 at two to eight in one calibration, then 0.27 a read during the run), where the
    /// fit averages it with the figures it stands above.
    pub fn disk_at(&self, n: usize) -> f64 {
        let fit = monotone(&self.disk_by_reads);
        let at = fit.iter().rev().find(|p| p.0 <= n).or(fit.first());
        at.map_or(self.disk_gbps, |p| p.1)
    }

    /// These figures with the disk read `n` files at a time.
    pub fn reading(&self, n: usize) -> Figures {
        Figures { disk_gbps: self.disk_at(n), ..self.clone() }
    }

    /// These figures with the disk at `gbps` where they had `disk_gbps` (each count of reads in
    /// flight scaled alike): a prediction at the rate a run measured, to tell the model's error
    /// from the disk's drift since calibration.
    pub fn with_disk(&self, gbps: f64) -> Figures {
        let k = gbps / self.disk_gbps.max(1e-12);
        Figures {
            disk_gbps: gbps,
            disk_by_reads: self.disk_by_reads.iter().map(|&(n, g)| (n, g * k)).collect(),
            ..self.clone()
        }
    }

    /// These figures with the loader reading through the page cache (`buffered`) or O_DIRECT, as
    /// calibration measured that mode; None where it was not measured (O_DIRECT refused).
    pub fn read_as(&self, buffered: bool) -> Option<Figures> {
        if self.read_modes.is_empty() && buffered == self.buffered_reads {
            return Some(self.clone()); // figures from before both modes were kept
        }
        let m = self.read_modes.iter().find(|m| m.buffered == buffered)?;
        let f = Figures {
            disk_by_reads: m.by_reads.clone(),
            buffered_reads: buffered,
            read_cpu_s_per_gb: m.cpu_s_per_gb,
            ..self.clone()
        };
        Some(Figures { disk_gbps: f.disk_at(3), ..f })
    }
}

/// Whether the loader should read through the page cache: where the best GB/s measured that way
/// (at any count of reads in flight) beats O_DIRECT's best by 10% — O_DIRECT skips a copy and
/// keeps the page cache out of a memory limit, so it keeps a tie. Curves as `disk_by_reads`.
pub fn buffered_pays(direct: &[(usize, f64)], buffered: &[(usize, f64)]) -> bool {
    let best = |c: &[(usize, f64)]| monotone(c).last().map_or(0.0, |p| p.1);
    best(buffered) > 1.1 * best(direct)
}

/// `points` (ascending x) fitted non-decreasing by least squares (pool adjacent violators): a run
/// of figures each above the next is replaced by their mean, so one high figure is shared with the
/// lower ones after it instead of standing for them.
pub fn monotone(points: &[(usize, f64)]) -> Vec<(usize, f64)> {
    // Blocks of (sum, count), each mean at least the one before.
    let mut blocks: Vec<(f64, usize)> = Vec::new();
    for &(_, y) in points {
        blocks.push((y, 1));
        while let [.., (s0, n0), (s1, n1)] = blocks[..] {
            if s0 / n0 as f64 <= s1 / n1 as f64 {
                break;
            }
            blocks.truncate(blocks.len() - 2);
            blocks.push((s0 + s1, n0 + n1));
        }
    }
    let means = blocks.iter().flat_map(|&(s, n)| std::iter::repeat_n(s / n as f64, n));
    points.iter().zip(means).map(|(&(x, _), y)| (x, y)).collect()
}

/// The loader's read-ahead depth (layers read past the one a worker takes: `depth` + 1 reads in
/// flight) among `depths` (ascending) whose predicted pass, `pass(depth)`, is shortest — a disk
/// that serves concurrent reads faster rewards depth, and every slot read into ahead is one the
/// RAM tier does not keep, which `pass` counts. A deeper one must beat the shallower best by 2%
/// (measurement noise does not buy slots). `depths` empty: 2, the loader's default.
pub fn best_depth(depths: &[usize], pass: impl Fn(usize) -> f64) -> usize {
    let mut best: Option<(usize, f64)> = None;
    for &d in depths {
        let t = pass(d);
        if best.is_none_or(|(_, b)| t < b * 0.98) {
            best = Some((d, t));
        }
    }
    best.map_or(2, |(d, _)| d)
}

/// How the loader reads: through the page cache or O_DIRECT (among `modes`, `true` = buffered),
/// and how many layers ahead (among `depths`, by `best_depth` at batch 1) — the mode whose
/// predicted passes at batch 1 and 8, `pass(buffered, depth, rows)`, have the smaller geometric
/// mean: a buffered read may beat O_DIRECT on the disk and still lose where its copies take the
/// cores a batch's compute needs. The page cache must win by 5% (O_DIRECT keeps it out of a
/// memory limit and costs no copy). `modes` empty: O_DIRECT.
pub fn best_reading(
    modes: &[bool],
    depths: &[usize],
    pass: impl Fn(bool, usize, usize) -> f64,
) -> (bool, usize) {
    let mut best: Option<(bool, usize, f64)> = None;
    for &buffered in modes {
        let depth = best_depth(depths, |d| pass(buffered, d, 1));
        let score = (pass(buffered, depth, 1) * pass(buffered, depth, 8)).sqrt();
        let margin = if buffered { 0.95 } else { 1.0 / 0.95 };
        if best.is_none_or(|(_, _, b)| score < b * margin) {
            best = Some((buffered, depth, score));
        }
    }
    best.map_or((false, best_depth(depths, |d| pass(false, d, 1))), |(b, d, _)| (b, d))
}

/// `points` (ascending x) at `x`: linear between points, proportional past the last, the first's
/// value below it.
pub fn interpolate(points: &[(usize, f64)], x: usize) -> f64 {
    let Some(&(x0, y0)) = points.first() else { return 0.0 };
    if x <= x0 {
        return y0;
    }
    for w in points.windows(2) {
        let ((a, ya), (b, yb)) = (w[0], w[1]);
        if x <= b {
            return ya + (yb - ya) * (x - a) as f64 / (b - a).max(1) as f64;
        }
    }
    let (xl, yl) = points[points.len() - 1];
    yl * x as f64 / xl.max(1) as f64
}

/// Predicted decode pass seconds at a few batch sizes (ascending), as `up` hands them to the
/// coordinator (`--predicted-pass 1:0.094,8:0.107,64:0.116`, from `layerstream plan`'s cost model):
/// each decode step's wall time is set beside `at` its batch.
#[derive(Debug, Clone, PartialEq)]
pub struct Curve(pub Vec<(usize, f64)>);

impl Curve {
    /// Predicted seconds of a decode pass over `batch` sequences (`interpolate`).
    pub fn at(&self, batch: usize) -> f64 {
        interpolate(&self.0, batch)
    }
}

impl std::fmt::Display for Curve {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let parts: Vec<String> = self.0.iter().map(|(r, s)| format!("{r}:{s:.6}")).collect();
        f.write_str(&parts.join(","))
    }
}

impl std::str::FromStr for Curve {
    type Err = String;

    /// `rows:seconds,…` with rows ≥ 1 ascending and seconds finite and positive.
    fn from_str(s: &str) -> Result<Curve, String> {
        let bad = |p: &str| format!("{p:?}: expected rows:seconds (e.g. 1:0.094,8:0.107)");
        let mut v = Vec::new();
        for part in s.split(',').map(str::trim).filter(|p| !p.is_empty()) {
            let (r, t) = part.split_once(':').ok_or_else(|| bad(part))?;
            let r: usize = r.trim().parse().map_err(|_| bad(part))?;
            let t: f64 = t.trim().parse().map_err(|_| bad(part))?;
            if r == 0 || !(t.is_finite() && t > 0.0) || v.last().is_some_and(|&(q, _)| q >= r) {
                return Err(format!("{}: rows ≥ 1 ascending, seconds > 0", bad(part)));
            }
            v.push((r, t));
        }
        if v.is_empty() {
            return Err(bad(s));
        }
        Ok(Curve(v))
    }
}

/// What a placement delivers at one batch size.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Prediction {
    /// Sequences per pass (each gets one token).
    pub rows: usize,
    pub pass_s: f64,
    pub tokens_per_s: f64,
    /// Each resource's busy seconds in a pass: compute (layers and head), disk reads, link copies.
    pub compute_s: f64,
    /// Seconds the compute loses to the loader's reads and their checks on the same cores
    /// (`Figures::read_cpu_share`): on the compute's path beside `compute_s`.
    pub read_cpu_s: f64,
    /// Seconds the steps wait for experts fetched outside the worker's cache (`Fetches`): on the
    /// compute's path too. Their reads are in `disk_s` as well.
    pub fetch_s: f64,
    pub disk_s: f64,
    pub link_s: f64,
    /// The resource the pass waits on most: "compute", "disk", "link"; "read-ahead" when the pass
    /// takes 15% longer than its busiest resource (too few slots or buffers to overlap); "expert
    /// fetches" when the steps' waits for experts outside the cache take half the pass.
    pub bound: &'static str,
}

/// Distinct experts one mixture-of-experts layer's step routes `rows` rows to, each row choosing
/// `k` of `e`, with routing spread evenly (a usage history that is skewed only lowers it):
/// e·(1 − (1 − k/e)^rows).
pub fn experts_needed(e: usize, k: usize, rows: usize) -> f64 {
    if e == 0 {
        return 0.0;
    }
    let miss_one = 1.0 - (k.min(e) as f64 / e as f64);
    e as f64 * (1.0 - miss_one.powi(rows.min(i32::MAX as usize) as i32))
}

/// The experts one mixture-of-experts layer's step fetches from outside the worker's cache: the
/// experts needed (`experts_needed`) that the cache misses — it serves a share `held` (0..=1) of
/// the needs.
pub fn expert_misses(e: usize, k: usize, rows: usize, held: f64) -> f64 {
    experts_needed(e, k, rows) * (1.0 - held.clamp(0.0, 1.0))
}

/// What one layer's step fetches on the compute's path: the experts its router chose that the
/// worker's cache does not hold (expected count) and each one's bytes. A worker fetches such an
/// expert when the step needs it (or one layer ahead, where the next router's guess was right), a
/// file at a time, and the step waits for it: each costs the disk's latency and its bytes at the
/// disk's one-read rate, then the link's copy where there is one — not hidden in the read-ahead —
/// or what the worker timed a fetch at in past runs (`measured_s`), whichever is longer (the
/// loader's request, its slot and the copy cost more than the read where the cores are busy).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Fetches {
    pub experts: f64,
    pub bytes_each: u64,
    /// Seconds one fetch took the worker in past runs (0: none timed).
    pub measured_s: f64,
}

impl Fetches {
    /// Bytes fetched (expected).
    pub fn bytes(&self) -> f64 {
        self.experts * self.bytes_each as f64
    }

    /// Seconds the step waits for them with the figures `f`.
    pub fn wait_s(&self, f: &Figures) -> f64 {
        let rate = |gbps: f64| (gbps * 1e9).max(1.0);
        let each = self.bytes_each as f64;
        let link = f.link_gbps.map_or(0.0, |g| each / rate(g));
        let read = f.disk_latency_ms / 1e3 + each / rate(f.disk_at(1)) + link;
        self.experts * read.max(self.measured_s)
    }
}

/// Predicts a pass over `layers` (each its source and bytes) at `rows` sequences, each layer's step
/// also waiting for its `fetches` (by index; none where the slice is shorter).
pub fn predict(
    f: &Figures,
    layers: &[(Source, u64)],
    fetches: &[Fetches],
    rows: usize,
    depth: usize,
    buffers: usize,
) -> Prediction {
    let compute = interpolate(&f.layer_s, rows);
    let head = interpolate(&f.head_s, rows);
    let rate = |gbps: f64| (gbps * 1e9).max(1.0);
    let read: Vec<f64> = layers
        .iter()
        .map(|&(s, b)| if s == Source::Disk { b as f64 / rate(f.disk_gbps) } else { 0.0 })
        .collect();
    let copy: Vec<f64> = layers
        .iter()
        .map(|&(s, b)| match (s, f.link_gbps) {
            (Source::Device, _) | (_, None) => 0.0,
            (_, Some(g)) => b as f64 / rate(g),
        })
        .collect();
    // A layer read from disk also costs the cores its reader's CPU time, which the compute of the
    // layers it overlaps loses: charged to the layer's own compute.
    let cpu_per_byte = f.read_cpu_share * (f.read_cpu_s_per_gb + f.verify_cpu_s_per_gb) / 1e9;
    let cpu: Vec<f64> = layers
        .iter()
        .map(|&(s, b)| if s == Source::Disk { b as f64 * cpu_per_byte } else { 0.0 })
        .collect();
    let wait: Vec<f64> =
        (0..layers.len()).map(|i| fetches.get(i).map_or(0.0, |x| x.wait_s(f))).collect();
    let steps: Vec<f64> = cpu.iter().zip(&wait).map(|(c, w)| compute + c + w).collect();
    let pass_s = replay(layers, &read, &copy, &steps, head, depth.max(1), buffers.max(1));
    let compute_s = compute * layers.len() as f64 + head;
    let read_cpu_s = cpu.iter().sum::<f64>();
    let fetch_s = wait.iter().sum::<f64>();
    let fetched = fetches.iter().map(Fetches::bytes).sum::<f64>() / rate(f.disk_at(1));
    let (disk_s, link_s) = (read.iter().sum::<f64>() + fetched, copy.iter().sum::<f64>());
    let busiest = (compute_s + read_cpu_s + fetch_s).max(disk_s).max(link_s);
    let bound = if fetch_s > pass_s / 2.0 {
        "expert fetches"
    } else if pass_s > busiest * 1.15 {
        "read-ahead"
    } else if busiest == disk_s {
        "disk"
    } else if busiest == link_s {
        "link"
    } else {
        "compute"
    };
    let tokens_per_s = if pass_s > 0.0 { rows as f64 / pass_s } else { 0.0 };
    Prediction { rows, pass_s, tokens_per_s, compute_s, read_cpu_s, fetch_s, disk_s, link_s, bound }
}

/// The steady-state seconds of one pass (see the module doc): three passes replayed, the third
/// timed.
fn replay(
    layers: &[(Source, u64)],
    read: &[f64],
    copy: &[f64],
    compute: &[f64],
    head: f64,
    depth: usize,
    buffers: usize,
) -> f64 {
    let n = layers.len();
    let (mut disk_free, mut link_free, mut done) = (0.0f64, 0.0f64, 0.0f64);
    // Compute-end times of past reads and copies, in order (a read holds its slot, a copy its
    // buffer, until its layer is computed).
    let (mut reads, mut copies): (Vec<f64>, Vec<f64>) = (Vec::new(), Vec::new());
    let mut pass_start = 0.0;
    for pass in 0..3 {
        if pass == 2 {
            pass_start = done;
        }
        for i in 0..n {
            let mut ready = 0.0f64;
            if layers[i].0 == Source::Disk {
                let slot_free = reads.len().checked_sub(depth).map_or(0.0, |k| reads[k]);
                disk_free = disk_free.max(slot_free) + read[i];
                ready = disk_free;
            }
            if copy[i] > 0.0 {
                let buffer_free = copies.len().checked_sub(buffers).map_or(0.0, |k| copies[k]);
                link_free = link_free.max(buffer_free).max(ready) + copy[i];
                ready = link_free;
            }
            done = done.max(ready) + compute[i];
            if layers[i].0 == Source::Disk {
                reads.push(done);
            }
            if copy[i] > 0.0 {
                copies.push(done);
            }
        }
        done += head;
    }
    done - pass_start
}

#[cfg(test)]
mod tests {
    use super::*;

    fn figures(layer: f64, head: f64, disk_gbps: f64, link: Option<f64>) -> Figures {
        Figures {
            disk_gbps,
            disk_by_reads: Vec::new(),
            buffered_reads: false,
            disk_latency_ms: 0.1,
            link_gbps: link,
            layer_s: vec![(1, layer), (8, layer * 2.0), (64, layer * 10.0)],
            head_s: vec![(1, head), (8, head * 2.0), (64, head * 10.0)],
            read_cpu_s_per_gb: 0.0,
            read_cpu_share: 0.0,
            read_modes: Vec::new(),
            verify_cpu_s_per_gb: 0.0,
        }
    }

    /// A disk-bound pass predicted at half the disk's rate takes twice as long on disk; the curve
    /// by reads in flight scales alike; compute is untouched.
    #[test]
    fn with_disk_rescales_every_disk_figure_and_nothing_else() {
        let mut f = figures(0.001, 0.001, 2.0, None);
        f.disk_by_reads = vec![(1, 1.0), (3, 2.0)];
        let pass = [(Source::Disk, 1_000_000_000), (Source::Disk, 1_000_000_000)];
        let slow = f.with_disk(1.0);
        assert_eq!(slow.disk_by_reads, vec![(1, 0.5), (3, 1.0)]);
        assert_eq!(slow.disk_at(3), 1.0);
        let (a, b) = (predict(&f, &pass, &[], 1, 2, 1), predict(&slow, &pass, &[], 1, 2, 1));
        assert!((b.disk_s - 2.0 * a.disk_s).abs() < 1e-9, "{} vs {}", b.disk_s, a.disk_s);
        assert_eq!(a.compute_s, b.compute_s);
        assert!(b.pass_s > 1.9 * a.pass_s, "disk-bound: {} vs {}", b.pass_s, a.pass_s);
    }

    #[test]
    fn a_curve_reads_back_what_it_writes_and_refuses_nonsense() {
        let f = figures(0.01, 0.005, 1.0, None);
        let p = |r| predict(&f, &[(Source::Ram, 1)], &[], r, 1, 1).pass_s;
        let c = Curve(vec![(1, p(1)), (8, p(8)), (64, p(64))]);
        let back: Curve = c.to_string().parse().unwrap();
        assert!(back.0.iter().zip(&c.0).all(|(a, b)| a.0 == b.0 && (a.1 - b.1).abs() < 1e-6));
        assert!((back.at(4) - (c.0[0].1 + (c.0[1].1 - c.0[0].1) * 3.0 / 7.0)).abs() < 1e-6);
        for bad in ["", "8", "0:1", "1:0", "1:x", "8:0.1,1:0.2", "1:NaN", "1:-2"] {
            assert!(bad.parse::<Curve>().is_err(), "{bad:?}");
        }
    }

    #[test]
    fn experts_needed_grow_with_rows_to_every_expert_and_a_cache_saves_its_share() {
        assert_eq!(experts_needed(128, 8, 1), 8.0);
        let at8 = experts_needed(128, 8, 8);
        assert!(at8 > 8.0 && at8 < 64.0, "{at8}");
        assert!((experts_needed(128, 8, 1000) - 128.0).abs() < 1e-6);
        assert_eq!(experts_needed(0, 8, 4), 0.0);
        assert_eq!(expert_misses(128, 8, 1, 0.0), 8.0);
        assert_eq!(expert_misses(128, 8, 1, 0.75), 2.0);
        assert_eq!(expert_misses(128, 8, 1, 1.0), 0.0);
    }

    /// An expert fetched outside the cache stalls its layer's step by the disk's latency and its
    /// bytes at the one-read rate (not the faster rate of the read-ahead's reads in flight), plus
    /// the link where the worker copies; the pass grows by every layer's wait, and a pass that
    /// waits mostly on them says so.
    #[test]
    fn expert_fetches_wait_on_the_compute_path_at_the_one_read_rate() {
        let mut f = figures(0.004, 0.0, 1.0, None);
        f.disk_by_reads = vec![(1, 0.5), (3, 1.5)];
        f.disk_latency_ms = 1.0;
        let x = Fetches { experts: 2.0, bytes_each: 5_000_000, measured_s: 0.0 };
        // 2 × (1 ms + 5 MB ÷ 0.5 GB/s) = 22 ms.
        assert!((x.wait_s(&f) - 0.022).abs() < 1e-9, "{}", x.wait_s(&f));
        let g = Figures { link_gbps: Some(5.0), ..f.clone() };
        assert!((x.wait_s(&g) - 0.024).abs() < 1e-9, "the link's 1 ms each on top");
        let timed = |s: f64| Fetches { measured_s: s, ..x }.wait_s(&f);
        assert!((timed(0.015) - 0.030).abs() < 1e-9, "a fetch timed at 15 ms costs 15 ms");
        assert!((timed(0.005) - 0.022).abs() < 1e-9, "never less than the read itself");
        let layers = [(Source::Device, 1); 4];
        let plain = predict(&f, &layers, &[], 1, 2, 2);
        let some = predict(&f, &layers, &[x, Fetches::default(), x], 1, 2, 2);
        assert!((some.pass_s - plain.pass_s - 0.044).abs() < 1e-9, "{some:?}");
        assert!((some.fetch_s - 0.044).abs() < 1e-9 && some.bound == "expert fetches");
        assert!((some.disk_s - 0.04).abs() < 1e-9, "20 MB at 0.5 GB/s: {}", some.disk_s);
        assert_eq!(plain.bound, "compute");
    }

    #[test]
    fn interpolation_is_linear_between_points_and_proportional_past_the_last() {
        let p = [(1, 1.0), (8, 2.0), (64, 10.0)];
        assert_eq!(interpolate(&p, 1), 1.0);
        assert_eq!(interpolate(&p, 0), 1.0);
        assert!((interpolate(&p, 36) - 6.0).abs() < 1e-9);
        assert_eq!(interpolate(&p, 128), 20.0);
        assert_eq!(interpolate(&[], 5), 0.0);
    }

    #[test]
    fn resident_layers_cost_their_compute_only() {
        let f = figures(0.01, 0.05, 1.0, None);
        let p = predict(&f, &[(Source::Device, 1 << 30); 10], &[], 1, 2, 2);
        assert!((p.pass_s - 0.15).abs() < 1e-9, "{p:?}");
        assert_eq!((p.bound, p.disk_s, p.link_s), ("compute", 0.0, 0.0));
        assert!((p.tokens_per_s - 1.0 / 0.15).abs() < 1e-6);
        let p8 = predict(&f, &[(Source::Device, 1 << 30); 10], &[], 8, 2, 2);
        assert!((p8.pass_s - 0.30).abs() < 1e-9 && p8.tokens_per_s > p.tokens_per_s * 3.0);
    }

    /// Reads overlap compute: a pass is bound by the disk when reading takes longer, by compute
    /// when computing does, and one slot of read-ahead cannot overlap at all.
    #[test]
    fn disk_reads_overlap_compute_as_deep_as_the_read_ahead() {
        // 10 layers of 100 MB from a 1 GB/s disk: 0.1 s each to read.
        let layers = [(Source::Disk, 100_000_000); 10];
        let slow_disk = predict(&figures(0.02, 0.0, 1.0, None), &layers, &[], 1, 2, 2);
        assert!((slow_disk.pass_s - 1.0).abs() < 0.03, "{slow_disk:?}");
        assert_eq!(slow_disk.bound, "disk");
        let slow_compute = predict(&figures(0.3, 0.0, 1.0, None), &layers, &[], 1, 2, 2);
        assert!((slow_compute.pass_s - 3.0).abs() < 0.05, "{slow_compute:?}");
        assert_eq!(slow_compute.bound, "compute");
        let serial = predict(&figures(0.1, 0.0, 1.0, None), &layers, &[], 1, 1, 2);
        assert!((serial.pass_s - 2.0).abs() < 1e-6, "read, compute, read…: {serial:?}");
        assert_eq!(serial.bound, "read-ahead");
        // Half of the layers resident: the disk's half overlaps the resident compute.
        let mixed: Vec<_> = (0..10)
            .map(|i| if i % 2 == 0 { (Source::Device, 0) } else { (Source::Disk, 100_000_000) })
            .collect();
        let m = predict(&figures(0.1, 0.0, 1.0, None), &mixed, &[], 1, 2, 2);
        assert!((m.pass_s - 1.0).abs() < 0.05 && m.disk_s == 0.5, "{m:?}");
    }

    /// The depth is the one whose pass is shortest: deeper where the disk serves concurrent
    /// reads faster, the shallowest where it does not (or gains less than 2%), and the disk's
    /// figure at a count is the one measured at or below it.
    #[test]
    fn read_ahead_goes_as_deep_as_the_disk_rewards() {
        let mut f = figures(0.01, 0.0, 1.0, None);
        f.disk_by_reads = vec![(1, 0.8), (2, 1.0), (3, 1.2), (4, 1.3), (6, 1.4), (8, 1.41)];
        assert_eq!((f.disk_at(5), f.disk_at(8), f.disk_at(20)), (1.3, 1.41, 1.41));
        assert_eq!(figures(0.01, 0.0, 0.7, None).disk_at(3), 0.7, "none measured");
        let mut dip = figures(0.01, 0.0, 1.0, None);
        dip.disk_by_reads = vec![(1, 1.41), (2, 1.0), (3, 1.1), (4, 1.5)];
        let near = |a: f64, b: f64| (a - b).abs() < 1e-9;
        // 1.41 above the two after it: the three share their mean, 1.17.
        assert!(near(dip.disk_at(1), 3.51 / 3.0) && near(dip.disk_at(3), 3.51 / 3.0));
        assert_eq!(dip.disk_at(4), 1.5);
        // One fluke at one read in flight carries no depth (the envelope said 1.82 throughout).
        dip.disk_by_reads = vec![(1, 1.82), (2, 0.49), (3, 0.5), (4, 0.52), (6, 0.5), (8, 0.55)];
        assert!(near(dip.disk_at(3), 4.38 / 6.0), "{}", dip.disk_at(3));
        // Ten 100 MB layers from disk, compute 1 ms each: disk-bound, so the pass is the reads.
        let layers = [(Source::Disk, 100_000_000u64); 10];
        let pass =
            |f: &Figures, d: usize| predict(&f.reading(d + 1), &layers, &[], 1, d + 1, 1).pass_s;
        let depths = [1, 2, 3, 5, 7];
        assert_eq!(best_depth(&depths, |d| pass(&f, d)), 5, "6 in flight: 1.4 GB/s");
        let flat = figures(0.01, 0.0, 1.0, None);
        assert_eq!(best_depth(&depths, |d| pass(&flat, d)), 1, "no gain, no depth");
        // Each slot read ahead costs a RAM-tier layer: past 3 in flight the disk gains less than
        // the extra layer read from disk costs.
        let costly = |d: usize| pass(&f, d) * (1.0 + 0.1 * d as f64);
        assert_eq!(best_depth(&depths, costly), 2);
        assert_eq!(best_depth(&[], |_| 1.0), 2);
    }

    #[test]
    fn a_copying_worker_pays_the_link_for_ram_and_disk_layers_not_resident_ones() {
        let layers = [(Source::Ram, 1_000_000_000), (Source::Device, 1_000_000_000)];
        let f = figures(0.01, 0.0, 1.0, Some(10.0));
        let p = predict(&f, &layers, &[], 1, 2, 2);
        assert!((p.link_s - 0.1).abs() < 1e-9 && p.disk_s == 0.0, "{p:?}");
        assert_eq!(p.bound, "link");
        let in_place = predict(&figures(0.01, 0.0, 1.0, None), &layers, &[], 1, 2, 2);
        assert_eq!(in_place.link_s, 0.0);
        assert!(in_place.pass_s < p.pass_s);
    }

    /// Buffered reads only where they beat O_DIRECT's best by more than 10% at any depth (the
    /// VM disk of 2026-11-29: O_DIRECT 1.04-1.21 GB/s, `dd` through the page cache 2.0).
    #[test]
    fn buffered_reads_only_where_clearly_faster() {
        let direct = [(1, 1.0), (2, 1.2), (4, 1.21)];
        assert!(buffered_pays(&direct, &[(1, 2.0), (2, 2.3)]));
        assert!(!buffered_pays(&direct, &[(1, 1.3), (2, 1.33)]), "within 10%: O_DIRECT");
        assert!(!buffered_pays(&direct, &[]), "not measured");
        assert!(buffered_pays(&[], &[(1, 0.1)]), "O_DIRECT unmeasured (unsupported)");
        let fluke = [(1, 1.82), (2, 0.49), (3, 0.5), (4, 0.52)];
        assert!(buffered_pays(&fluke, &[(1, 1.31), (2, 1.5)]), "one fluke does not win O_DIRECT");
        assert_eq!(monotone(&[(1, 1.0), (2, 3.0), (4, 2.0)]), [(1, 1.0), (2, 2.5), (4, 2.5)]);
        assert_eq!(monotone(&[]), []);
    }

    /// A read's CPU time is charged to compute where the worker's threads take every core: a
    /// compute-bound pass grows by it, a disk-bound one hides it in the compute's idle time, and
    /// a core to spare (or a GPU worker) takes nothing.
    #[test]
    fn reads_cost_the_compute_their_cpu_time_where_they_share_its_cores() {
        assert_eq!(
            (read_cpu_share(2, 2), read_cpu_share(1, 2), read_cpu_share(4, 16)),
            (1.0, 0.0, 0.0)
        );
        assert_eq!(read_cpu_share(16, 16), 1.0);
        // Ten 100 MB layers from a 1 GB/s disk, 0.5 s of CPU per GB read: 0.05 s a layer.
        let layers = [(Source::Disk, 100_000_000u64); 10];
        let with = |layer: f64, share: f64| {
            let mut f = figures(layer, 0.0, 1.0, None);
            (f.read_cpu_s_per_gb, f.read_cpu_share) = (0.5, share);
            predict(&f, &layers, &[], 8, 2, 2)
        };
        let (alone, shared) = (with(0.15, 0.0), with(0.15, 1.0));
        // Compute 0.3 s a layer at 8 rows (`figures` doubles it): 3.0 s, then 3.5 s with reads.
        assert!((alone.pass_s - 3.0).abs() < 0.05 && alone.read_cpu_s == 0.0, "{alone:?}");
        assert!((shared.pass_s - 3.5).abs() < 0.05, "{shared:?}");
        assert!((shared.read_cpu_s - 0.5).abs() < 1e-9 && shared.bound == "compute");
        // Disk-bound (0.02 s of compute a layer): the reads' CPU fits beside it.
        let (alone, shared) = (with(0.01, 0.0), with(0.01, 1.0));
        assert!((shared.pass_s - alone.pass_s).abs() < 0.1 && shared.bound == "disk", "{shared:?}");
    }

    /// The mode whose batch-1 and batch-8 passes are shorter (geometric mean): the page cache
    /// where the disk serves it faster and its copies fit beside the compute; O_DIRECT where
    /// those copies would take the cores a compute-bound batch needs, or on a near tie.
    #[test]
    fn reads_go_through_the_page_cache_only_where_the_whole_pass_gains() {
        let layers = [(Source::Disk, 100_000_000u64); 10];
        let mode = |buffered, gbps, cpu| ReadMode {
            buffered,
            by_reads: vec![(1, gbps)],
            cpu_s_per_gb: cpu,
        };
        let chosen = |layer: f64, modes: Vec<ReadMode>| {
            let mut f = figures(layer, 0.0, 1.0, None);
            (f.read_modes, f.read_cpu_share) = (modes, 1.0);
            let pass = |b: bool, d: usize, r: usize| {
                let g = f.read_as(b).unwrap().reading(d + 1);
                predict(&g, &layers, &[], r, d + 1, 1).pass_s
            };
            best_reading(&[false, true], &[1, 2], pass)
        };
        let (direct, cached) = (mode(false, 1.0, 0.02), mode(true, 2.0, 0.5));
        // Disk-bound (1 ms of compute a layer): 2 GB/s beats 1 GB/s whatever the copies cost.
        assert!(chosen(0.001, vec![direct.clone(), cached.clone()]).0);
        // Compute-bound at batch 8 (0.16 s a layer): 0.05 s of copying a layer loses more there
        // than the faster reads gain at batch 1.
        assert!(!chosen(0.08, vec![direct.clone(), cached]).0);
        // A near tie keeps O_DIRECT.
        assert!(!chosen(0.001, vec![direct.clone(), mode(true, 1.04, 0.0)]).0);
        // Forced or only one measured: that one.
        let one = |b| best_reading(&[b], &[1], |_, _, _| 1.0).0;
        assert!(one(true) && !one(false));
        assert_eq!(best_reading(&[], &[3], |_, _, _| 1.0), (false, 3));
        // Figures cached before both modes were kept answer for their own mode only.
        let old = figures(0.01, 0.0, 1.0, None);
        assert!(old.read_as(false).is_some() && old.read_as(true).is_none());
        let mut both = old.clone();
        both.read_modes = vec![direct, mode(true, 2.0, 0.5)];
        let b = both.read_as(true).unwrap();
        assert!(b.buffered_reads && b.disk_gbps == 2.0 && b.read_cpu_s_per_gb == 0.5);
    }
}
