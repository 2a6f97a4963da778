//! `cargo bench -p layerstream-kernels --bench many_rows`: one weight matrix of an 8B model's
//! attention shape (4096 × 4096) against m activation rows through `cpu::matmul`, all threads,
//! three ways side by side in one run — f32 activations (`--exact`: dequantized rows, GEMM from 256
//! rows), 8-bit activations row by row (`int8_batch`: the few-row kernel, every m) and 8-bit
//! activations sixteen (AVX-512 VNNI) or eight (AVX2) rows to a register (`int8_lanes`: the default
//! from `int8::LANES_FROM` rows, from `NARROW_FROM` for some formats) — in activation rows per
//! second, with the ratios; best of five.
//! The 8-bit ways give the same bits; the f32 way does not. `MANY_ROWS_TYPES=q4_k,q8_0` and
//! `MANY_ROWS_M=64,512` run a part of the table; `MANY_ROWS_SHAPE=4096x14336` (n × k) another
//! matrix (that one an 8B model's FFN down projection: rows of 14336 values).

use layerstream_kernels::cpu::int8::set_lanes;
use layerstream_kernels::cpu::matmul;
use layerstream_kernels::Precision;
use layerstream_types::DType;
mod common;
use common::best;

fn main() {
    let shape = std::env::var("MANY_ROWS_SHAPE").unwrap_or_else(|_| "4096x4096".into());
    let (n, k) = shape
        .split_once('x')
        .and_then(|(n, k)| Some((n.parse::<usize>().ok()?, k.parse::<usize>().ok()?)))
        .expect("MANY_ROWS_SHAPE is n x k, as 4096x14336");
    println!("threads: {}, weights {n} x {k}", rayon::current_num_threads());
    println!("| weights | rows m | f32 rows/s | int8 row-by-row rows/s | int8 lanes rows/s | lanes / f32 | lanes / row-by-row |");
    println!("|---|---|---|---|---|---|---|");
    let pick = |var: &str| {
        std::env::var(var).ok().map(|v| v.to_lowercase().split(',').map(str::to_owned).collect())
    };
    let (types, ms): (Option<Vec<String>>, Option<Vec<String>>) =
        (pick("MANY_ROWS_TYPES"), pick("MANY_ROWS_M"));
    for dtype in [DType::Q4K, DType::Q6K, DType::Q8_0, DType::Q4_1, DType::Q4_0, DType::Q5K] {
        if types.as_ref().is_some_and(|t| !t.contains(&dtype.to_string())) {
            continue;
        }
        let w = layerstream_types::random::Rng::new(3).tensor(dtype, &[n, k]).unwrap();
        for m in [1usize, 8, 16, 20, 64, 512] {
            if ms.as_ref().is_some_and(|v| !v.contains(&m.to_string())) {
                continue;
            }
            let x: Vec<f32> = (0..m * k).map(|i| ((i * 53 % 97) as f32 - 48.0) * 0.021).collect();
            let run = |p| std::hint::black_box(matmul(dtype, &w, None, (n, k), &x, m, p));
            let f32_path = best(|| {
                run(Precision::F32);
            });
            let int8 = |lanes: bool| {
                set_lanes(lanes);
                let t = best(|| {
                    run(Precision::Int8);
                });
                set_lanes(true);
                t
            };
            let (rows, lanes) = (int8(false), int8(true));
            let r = |s: f64| m as f64 / s;
            println!(
                "| {dtype} | {m} | {:.0} | {:.0} | {:.0} | {:.2} | {:.2} |",
                r(f32_path),
                r(rows),
                r(lanes),
                f32_path / lanes,
                rows / lanes
            );
        }
    }
}
