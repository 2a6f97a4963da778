//! `cargo bench -p layerstream-kernels --bench decode_dot`: the decode matvec (one activation row)
//! over SmolLM2-shaped weight rows (k = 576; K-quants: 4096), one thread, the two CPU paths side by side — f32
//! activations (dequantize two rows, then `dot_rows2`: what `matmul` runs by default) and 8-bit
//! activations (`int8::dot_rows`, `--int8-activations`) — for Q4_1, Q5_0, Q8_0, Q4_K and Q6_K rows held in cache
//! (256 KiB) and streamed from memory (~128 MiB), with a plain read of the same bytes as the
//! memory ceiling. Prints ns per 32-value block, weight GB/s and the ratios; best of five.

use layerstream_kernels::cpu::int8::{dot_rows as int8_rows, quantize_row};
use layerstream_kernels::cpu::rows::dot_rows2;
use layerstream_kernels::quant::dequant_row;
use layerstream_types::DType;
mod common;
use common::best;

/// Sums the buffer as u64 words (what reading it costs, at least).
fn read_all(w: &[u8]) -> u64 {
    w.chunks_exact(8).fold(0u64, |a, c| a.wrapping_add(u64::from_le_bytes(c.try_into().unwrap())))
}

fn main() {
    println!("| weights | where | f32 path ns/block | int8 path ns/block | plain read ns/block | f32 GB/s | int8 GB/s | read GB/s | int8 / f32 speed |");
    println!("|---|---|---|---|---|---|---|---|---|");
    for dtype in [DType::Q4_1, DType::Q5_0, DType::Q8_0, DType::Q4K, DType::Q6K] {
        // SmolLM2's width; K-quants (super-blocks of 256) at an 8B model's.
        let k = if dtype.block_elems() == 256 { 4096 } else { 576 };
        let x: Vec<f32> = (0..k).map(|i| ((i * 53 % 97) as f32 - 48.0) * 0.021).collect();
        let xq = quantize_row(&x);
        let rb = dtype.row_bytes(k).unwrap();
        for (place, bytes) in [("cache", 256usize << 10), ("memory", 128 << 20)] {
            let n = (bytes / rb) & !31;
            let w = layerstream_types::random::Rng::new(3).tensor(dtype, &[n, k]).unwrap();
            let (mut d0, mut d1, mut o0, mut o1) = (vec![0f32; k], vec![0f32; k], [0f32], [0f32]);
            let reps = (256 << 20) / (n * rb);
            let f32_path = best(|| {
                for _ in 0..reps {
                    for r in (0..n).step_by(2) {
                        dequant_row(dtype, &w[r * rb..(r + 1) * rb], &mut d0);
                        dequant_row(dtype, &w[(r + 1) * rb..(r + 2) * rb], &mut d1);
                        dot_rows2(&d0, &d1, &x, k, &mut o0, &mut o1);
                        std::hint::black_box((&o0, &o1));
                    }
                }
            });
            let mut out = [0f32; 32];
            let int8_path = best(|| {
                for _ in 0..reps {
                    for c in w.chunks_exact(32 * rb) {
                        int8_rows(dtype, c, rb, std::slice::from_ref(&xq), &mut out);
                        std::hint::black_box(&out);
                    }
                }
            });
            let read = best(|| {
                for _ in 0..reps {
                    std::hint::black_box(read_all(&w));
                }
            });
            let blocks = (reps * n * k / 32) as f64;
            let gbs = |s: f64| (reps * n * rb) as f64 / s / 1e9;
            let ns = |s: f64| s * 1e9 / blocks;
            println!(
                "| {dtype} | {place} | {:.2} | {:.2} | {:.2} | {:.1} | {:.1} | {:.1} | {:.2} |",
                ns(f32_path),
                ns(int8_path),
                ns(read),
                gbs(f32_path),
                gbs(int8_path),
                gbs(read),
                f32_path / int8_path
            );
        }
    }
}
