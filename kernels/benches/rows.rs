//! `cargo bench -p layerstream-kernels --bench rows`: one weight matrix (SmolLM2's MLP up
//! projection, 1536 × 576, f32 after dequantization) against m activation rows, four ways side by
//! side — `dot` row by row (the matvec path before `rows`), `dot_rows` (four activation rows per
//! pass), `dot_rows2` (two weight rows too: what `matmul` runs below GEMM_MIN_ROWS) and the GEMM
//! path — in GFLOP/s, with the ratios; best of five. Every way but GEMM gives the same bits.

use layerstream_kernels::cpu::gemm_f32;
use layerstream_kernels::cpu::rows::{dot_rows, dot_rows2};
use layerstream_kernels::quant::dot;
mod common;
use common::best;

fn main() {
    let (n, k) = (1536usize, 576usize);
    let w: Vec<f32> = (0..n * k).map(|i| ((i * 37 % 101) as f32 - 50.0) * 0.013).collect();
    println!("| rows m | dot GFLOP/s | dot_rows | dot_rows2 | GEMM | dot_rows2 / dot | dot_rows2 / GEMM |");
    println!("|---|---|---|---|---|---|---|");
    for m in [1usize, 8, 32, 150, 255] {
        let x: Vec<f32> = (0..m * k).map(|i| ((i * 53 % 97) as f32 - 48.0) * 0.021).collect();
        let (mut o0, mut o1) = (vec![0f32; m], vec![0f32; m]);
        let plain = best(|| {
            for r in 0..n {
                for (i, o) in o0.iter_mut().enumerate() {
                    *o = dot(&w[r * k..(r + 1) * k], &x[i * k..(i + 1) * k]);
                }
                std::hint::black_box(&o0);
            }
        });
        let rows = best(|| {
            for r in 0..n {
                dot_rows(&w[r * k..(r + 1) * k], &x, k, &mut o0);
                std::hint::black_box(&o0);
            }
        });
        let rows2 = best(|| {
            for r in (0..n).step_by(2) {
                let (w0, w1) = (&w[r * k..(r + 1) * k], &w[(r + 1) * k..(r + 2) * k]);
                dot_rows2(w0, w1, &x, k, &mut o0, &mut o1);
                std::hint::black_box((&o0, &o1));
            }
        });
        let mut out = vec![0f32; m * n];
        let gemm = best(|| {
            gemm_f32(&x, &w, &mut out, m, n, k);
            std::hint::black_box(&out);
        });
        let g = |s: f64| 2.0 * (m * n * k) as f64 / s / 1e9;
        println!(
            "| {m} | {:.1} | {:.1} | {:.1} | {:.1} | {:.2} | {:.2} |",
            g(plain),
            g(rows),
            g(rows2),
            g(gemm),
            plain / rows2,
            gemm / rows2
        );
    }
}
