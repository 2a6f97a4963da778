//! `layerstream matvec-bench`: the decode matvec's weight bandwidth per stored type, weight shape and
//! activation rows (1-8, what decode steps carry), on the CPU or a GPU, as GB/s of weights read and
//! as a share of the device's peak (a GPU's from its memory clock and bus width; the CPU's when
//! `--peak-gbps` says it). Side by side in one run, each against the default kernel: the
//! element-run kernel the wide-load one replaced (CUDA) and 8-bit activations (`--int8-activations`).
//! Each timing cycles through copies of the weight, 256 MiB or more in all, so no cache holds them.

use anyhow::Result;
use layerstream_kernels::{Backend, CpuBackend, Precision};
use layerstream_model::DType;

/// Arguments of `layerstream matvec-bench`.
#[derive(clap::Args, Debug)]
pub struct MatvecBenchArgs {
    /// Device: cpu or cuda:N.
    #[arg(long, env = "LAYERSTREAM_DEVICE", default_value = "cpu")]
    pub device: String,
    /// Weight types.
    #[arg(
        long,
        env = "LAYERSTREAM_MATVEC_DTYPES",
        value_delimiter = ',',
        default_value = "q4_k,q6_k,q8_0,q4_0,q4_1,f16"
    )]
    pub dtypes: Vec<String>,
    /// Weight shapes as OUTxIN (llama-3-8b's attention, MLP up and down by default).
    #[arg(
        long,
        env = "LAYERSTREAM_MATVEC_SHAPES",
        value_delimiter = ',',
        default_value = "4096x4096,14336x4096,4096x14336"
    )]
    pub shapes: Vec<String>,
    /// Activation rows per matmul.
    #[arg(long, env = "LAYERSTREAM_MATVEC_ROWS", value_delimiter = ',', default_value = "1,2,4,8")]
    pub rows: Vec<usize>,
    /// Timed matmuls per configuration (after two untimed ones).
    #[arg(long, env = "LAYERSTREAM_MATVEC_ITERS", default_value_t = 20)]
    pub iters: usize,
    /// CPU compute threads (default: every core).
    #[arg(long, env = "LAYERSTREAM_THREADS")]
    pub threads: Option<usize>,
    /// The device's peak memory bandwidth in GB/s, for the share column (a GPU reports its own).
    #[arg(long, env = "LAYERSTREAM_MATVEC_PEAK_GBPS")]
    pub peak_gbps: Option<f64>,
}

/// A kernel choice compared in one run.
#[derive(Clone, Copy, PartialEq)]
enum Mode {
    Default,
    ElementRuns,
    Int8,
}

impl Mode {
    fn name(self) -> &'static str {
        match self {
            Mode::Default => "default (f32 activations)",
            Mode::ElementRuns => "element runs (before)",
            Mode::Int8 => "8-bit activations",
        }
    }

    /// Switches the CUDA matvec's load width to this mode's (a process-wide benchmark switch).
    fn set(self) {
        use std::sync::atomic::Ordering;
        layerstream_kernels::cuda::WIDE_MATVEC.store(self != Mode::ElementRuns, Ordering::Relaxed);
    }

    /// The activations this mode multiplies with.
    fn precision(self) -> Precision {
        match self {
            Mode::Int8 => Precision::Int8,
            _ => Precision::F32,
        }
    }
}

/// Parses "OUTxIN".
fn shape(s: &str) -> Result<(usize, usize)> {
    let bad = || anyhow::anyhow!("--shapes: {s:?} is not OUTxIN (e.g. 4096x4096)");
    let (n, k) = s.split_once('x').ok_or_else(bad)?;
    Ok((n.trim().parse().map_err(|_| bad())?, k.trim().parse().map_err(|_| bad())?))
}

/// Runs the command.
pub fn run(a: MatvecBenchArgs) -> Result<()> {
    if let Some(n) = a.threads {
        layerstream_kernels::cpu::threads::set_cpu_threads(n)?;
    }
    let dtypes = a.dtypes.iter().map(|d| crate::parse_dtype(d)).collect::<Result<Vec<_>>>()?;
    let shapes = a.shapes.iter().map(|s| shape(s)).collect::<Result<Vec<_>>>()?;
    anyhow::ensure!(
        a.rows.iter().all(|&m| (1..=8).contains(&m)),
        "--rows: the matvec path takes 1 to 8 activation rows"
    );
    match layerstream_kernels::cuda::parse_cuda_device(&a.device) {
        None if a.device == "cpu" => {
            let threads = layerstream_kernels::cpu::threads::cpu_threads();
            let peak = a.peak_gbps.or_else(|| Some(read_gbps(threads)));
            let how =
                if a.peak_gbps.is_some() { "given" } else { "measured: threads summing 1 GiB" };
            println!("cpu, {threads} threads; peak {} ({how})", peak_text(peak));
            let modes = [Mode::Default, Mode::Int8];
            let int8 = layerstream_kernels::cpu::int8::supports;
            table(&CpuBackend::default(), &a, &dtypes, &shapes, peak, &modes, int8)
        }
        None => anyhow::bail!("--device {:?}: use cpu or cuda:N", a.device),
        Some(ordinal) => {
            let ordinal = ordinal?;
            let info = layerstream_kernels::cuda::open_device(ordinal)?;
            let peak = a.peak_gbps.or(Some(info.peak_gbps));
            println!("{}: {}; peak {}", a.device, info.name, peak_text(peak));
            let b = layerstream_kernels::cuda::CudaBackend::new(ordinal)?;
            let modes = [Mode::Default, Mode::ElementRuns, Mode::Int8];
            let int8 = layerstream_kernels::cuda::source::matvec_q8_supports;
            table(&b, &a, &dtypes, &shapes, peak, &modes, int8)
        }
    }
}

/// The host's read bandwidth in GB/s with `threads` threads: the best of three passes summing a
/// 1 GiB buffer, each thread its own contiguous part.
fn read_gbps(threads: usize) -> f64 {
    let buf = vec![1u64; 1 << 27];
    let part = buf.len().div_ceil(threads.max(1));
    let mut best = 0f64;
    for _ in 0..3 {
        let t = std::time::Instant::now();
        let sum: u64 = std::thread::scope(|s| {
            let hs: Vec<_> = buf
                .chunks(part)
                .map(|c| s.spawn(move || c.iter().fold(0u64, |a, &v| a.wrapping_add(v))))
                .collect();
            hs.into_iter().map(|h| h.join().expect("a summing thread panicked")).sum()
        });
        std::hint::black_box(sum);
        best = best.max((buf.len() * 8) as f64 / t.elapsed().as_secs_f64() / 1e9);
    }
    best
}

fn peak_text(p: Option<f64>) -> String {
    p.map_or("unknown (--peak-gbps)".into(), |p| format!("{p:.0} GB/s"))
}

/// Prints one row per dtype, shape, row count and mode (8-bit activations where `int8` says the
/// device has an 8-bit kernel for the dtype).
fn table<B: Backend>(
    b: &B,
    a: &MatvecBenchArgs,
    dtypes: &[DType],
    shapes: &[(usize, usize)],
    peak: Option<f64>,
    modes: &[Mode],
    int8: fn(DType) -> bool,
) -> Result<()>
where
    B::Tensor: Sync,
{
    println!("| dtype | OUTxIN | rows | kernel | µs | weight GB/s | of peak | vs default |");
    println!("|---|---|---|---|---|---|---|---|");
    let mut rng = layerstream_types::random::Rng::new(7);
    for &dtype in dtypes {
        for &(n, k) in shapes {
            let Some(bytes) = rng.tensor(dtype, &[n, k]) else {
                println!("| {dtype} | {n}x{k} | | not whole {dtype} blocks: skipped | | | | |");
                continue;
            };
            // Copies in turn, 256 MiB or more in all: several times a GPU's L2 (60 MB on an
            // H200) or a CPU's last-level cache, so the timings read memory, not the cache.
            let copies = (256usize << 20).div_ceil(bytes.len()).clamp(1, 64);
            let w = (0..copies)
                .map(|_| b.weight("w", dtype, &[n, k], &bytes))
                .collect::<Result<Vec<_>, _>>()?;
            for &m in &a.rows {
                let xs: Vec<f32> =
                    (0..m * k).map(|i| ((i * 7919) % 1000) as f32 / 1e3 - 0.5).collect();
                let x = b.from_host(&xs, m, k)?;
                let mut base = None;
                for &mode in modes.iter().filter(|&&md| md != Mode::Int8 || int8(dtype)) {
                    mode.set();
                    let p = mode.precision();
                    let us = b.run_step(|| time_us(b, &x, &w, a.iters.max(1), p))?;
                    let gbps = bytes.len() as f64 / us / 1e3;
                    let base_us = *base.get_or_insert(us);
                    let share = peak.map_or(String::new(), |p| format!("{:.0}%", 100.0 * gbps / p));
                    println!(
                        "| {dtype} | {n}x{k} | {m} | {} | {us:.1} | {gbps:.1} | {share} | {:.2} |",
                        mode.name(),
                        base_us / us
                    );
                }
            }
        }
    }
    Mode::Default.set();
    Ok(())
}

/// Microseconds per `x · wᵀ`, over `iters` (at least one round of the copies `w`) after one untimed
/// round, timed by the device's marks.
fn time_us<B: Backend>(
    b: &B,
    x: &B::Tensor,
    w: &[B::Weight],
    iters: usize,
    p: Precision,
) -> Result<f64> {
    for w in w {
        b.matmul(x, w, p)?;
    }
    let iters = iters.max(w.len());
    let start = b.mark()?;
    for i in 0..iters {
        b.matmul(x, &w[i % w.len()], p)?;
    }
    let end = b.mark()?;
    Ok(b.elapsed_ms(&start, &end)? * 1e3 / iters as f64)
}
