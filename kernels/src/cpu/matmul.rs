//! CPU matmul. With 8-bit activations (the default on the CPU) every step of a format with an
//! 8-bit dot takes it, one row or many (`int8::dot`: the one-row, few-row or sixteen-lane kernels,
//! which give a row the same bits whatever else its step holds). Otherwise (`--exact`, f32-only
//! formats): dequantize each weight row and dot it with every activation row (`rows`, two weight
//! rows at a time) below `GEMM_MIN_ROWS` rows, dequantize tiles of weight rows and GEMM each from
//! there.

use crate::cpu::int8::prefetch;
use crate::cpu::rows::{dot_rows, dot_rows2};
use crate::cpu::rows_q8;
use crate::quant::dequant_row;
use layerstream_types::DType;
use rayon::prelude::*;

/// Weight rows handed to one rayon task.
const ROWS_PER_TASK: usize = 32;
/// Bytes of f32 weight rows dequantized at a time for the GEMM path (a tile of rows: within L2/L3).
const TILE_BYTES: usize = 4 << 20;
/// From this many activation rows on, dequantize the weight tile by tile and use GEMM.
///
/// Below it every output is `dot(dequantized weight row, x row)` computed the same way whatever the
/// batch holds, so a sequence gets bit-identical results alone or batched with others.
pub const GEMM_MIN_ROWS: usize = 256;

/// `out[m, n] = x[m, k] · w[n, k]ᵀ` for a stored weight of `dtype`, `(n, k)` its shape, with
/// activations in `p` (8-bit where `int8::supports` the format).
pub fn matmul(
    dtype: DType,
    w: &[u8],
    wf32: Option<&[f32]>,
    (n, k): (usize, usize),
    x: &[f32],
    m: usize,
    p: crate::Precision,
) -> Vec<f32> {
    let row_bytes = w.len() / n.max(1);
    let int8 = p == crate::Precision::Int8
        && crate::cpu::int8::supports(dtype)
        && wf32.is_none()
        && k.is_multiple_of(32);
    if m >= GEMM_MIN_ROWS && !int8 {
        let mut out = vec![0f32; m * n];
        if let Some(f) = wf32 {
            gemm_f32(x, f, &mut out, m, n, k);
            return out;
        }
        // Dequantize a tile of weight rows at a time into a buffer that stays in cache, and
        // multiply it into its columns of `out`: the whole weight in f32 would be n·k·4 bytes
        // (940 MB for a 70B model's MLP projection).
        let tile = (TILE_BYTES / (k.max(1) * 4)).clamp(16, n.max(16)) / 16 * 16;
        let mut buf = vec![0f32; tile.min(n) * k];
        for r0 in (0..n).step_by(tile) {
            let rows = tile.min(n - r0);
            let b = &mut buf[..rows * k];
            b.par_chunks_mut(k)
                .zip(w[r0 * row_bytes..(r0 + rows) * row_bytes].par_chunks(row_bytes))
                .for_each(|(o, r)| dequant_row(dtype, r, o));
            gemm_f32_strided(x, b, &mut out[r0..], m, rows, k, n);
        }
        return out;
    }
    // Transposed result [n, m]: each task owns whole weight rows, two at a time (each activation
    // row then loaded once for both).
    if int8 {
        // Activations quantized to 8 bits once, integer dots per weight block.
        let xq = crate::cpu::int8::quantize(x, k, m);
        return by_tasks(n, m, |c, block| {
            let r0 = c * ROWS_PER_TASK;
            let wr = &w[r0 * row_bytes..(r0 + block.len() / m) * row_bytes];
            crate::cpu::int8::dot(dtype, wr, row_bytes, &xq, block);
        });
    }
    // Q8_0 rows dequantized in registers where the CPU can (the same bits: `rows_q8`).
    // Up to `rows_q8::MAX_ROWS` activation rows (past them the f32 row, dequantized once and read
    // from cache for every activation row, costs less than dequantizing again per eight rows), and
    // rows of `rows_q8::MIN_WIDTH` values at least.
    let fused = dtype == DType::Q8_0
        && wf32.is_none()
        && k.is_multiple_of(32)
        && k >= rows_q8::MIN_WIDTH
        && m <= rows_q8::MAX_ROWS
        && rows_q8::available();
    by_tasks(n, m, |c, block| {
        if fused {
            return q8_0_block(&w[c * ROWS_PER_TASK * row_bytes..], row_bytes, x, k, m, block);
        }
        let (mut d0, mut d1) = (vec![0f32; k], vec![0f32; k]);
        let mut pairs = block.chunks_exact_mut(2 * m);
        let mut r = c * ROWS_PER_TASK;
        for pair in pairs.by_ref() {
            let (o0, o1) = pair.split_at_mut(m);
            let (w0, w1): (&[f32], &[f32]) = match wf32 {
                Some(f) => (&f[r * k..(r + 1) * k], &f[(r + 1) * k..(r + 2) * k]),
                None => {
                    // Each cache line of the two rows, `int8::PREFETCH` ahead.
                    let rows = &w[r * row_bytes..(r + 2) * row_bytes];
                    (0..rows.len()).step_by(64).for_each(|o| prefetch(rows[o..].as_ptr()));
                    dequant_row(dtype, &w[r * row_bytes..(r + 1) * row_bytes], &mut d0);
                    dequant_row(dtype, &w[(r + 1) * row_bytes..(r + 2) * row_bytes], &mut d1);
                    (&d0, &d1)
                }
            };
            dot_rows2(w0, w1, x, k, o0, o1);
            r += 2;
        }
        let last = pairs.into_remainder();
        if !last.is_empty() {
            let w0: &[f32] = match wf32 {
                Some(f) => &f[r * k..(r + 1) * k],
                None => {
                    dequant_row(dtype, &w[r * row_bytes..(r + 1) * row_bytes], &mut d0);
                    &d0
                }
            };
            dot_rows(w0, x, k, last);
        }
    })
}

/// One task's `block` of transposed outputs (`m` per weight row) from the Q8_0 rows at the start of
/// `w` through `rows_q8` (where it is `available`): eight weight rows at a time, then pairs, the last
/// row beside itself.
fn q8_0_block(w: &[u8], row_bytes: usize, x: &[f32], k: usize, m: usize, block: &mut [f32]) {
    let row = |j: usize| &w[j * row_bytes..(j + 1) * row_bytes];
    let mut ran = true;
    let rows = rows_q8::rows_for(m);
    for (g, chunk) in block.chunks_mut(rows * m).enumerate() {
        let r = g * rows;
        // Each cache line of the group's rows, `int8::PREFETCH` ahead (rows read side by side are
        // as many streams; a narrow row is too short for the hardware to follow each).
        let span = (r * row_bytes).min(w.len())..((r + rows) * row_bytes).min(w.len());
        span.step_by(64).for_each(|o| prefetch(w[o..].as_ptr()));
        if chunk.len() == rows * m {
            // Arrays, not vectors: at a narrow width an allocation per group cost as much as its
            // arithmetic.
            let mut parts = chunk.chunks_mut(m);
            let mut outs: [&mut [f32]; rows_q8::ROWS] =
                std::array::from_fn(|_| parts.next().unwrap_or_default());
            let ws: [&[u8]; rows_q8::ROWS] =
                std::array::from_fn(|j| row((r + j).min(r + rows - 1)));
            ran &= rows_q8::q8_0_rows(&ws[..rows], x, k, &mut outs[..rows]);
            continue;
        }
        let mut outs: Vec<&mut [f32]> = chunk.chunks_mut(m).collect();
        let mut spare = vec![0f32; m];
        for (j, pair) in outs.chunks_mut(2).enumerate() {
            let a = r + 2 * j;
            ran &= match pair {
                [o0, o1] => rows_q8::q8_0_rows(&[row(a), row(a + 1)], x, k, &mut [o0, o1]),
                [o0] => rows_q8::q8_0_rows(&[row(a), row(a)], x, k, &mut [o0, &mut spare]),
                _ => true,
            };
        }
    }
    debug_assert!(ran, "q8_0_block runs only where rows_q8 is available");
}

/// `out[m, n]` from tasks of `ROWS_PER_TASK` weight rows: `task(c, block)` fills `block` with
/// the outputs of weight rows `c·ROWS_PER_TASK…` transposed (`m` per weight row, as the kernels
/// give them), which the task then writes into its columns of `out` — a run of up to 32 values
/// per output row. One row: the block is `out`'s own slice. (A whole transposed result turned
/// afterwards cost a second allocation and a pass writing every value to another cache line.)
fn by_tasks(n: usize, m: usize, task: impl Fn(usize, &mut [f32]) + Sync) -> Vec<f32> {
    if m == 1 {
        let mut out = vec![0f32; n];
        out.par_chunks_mut(ROWS_PER_TASK).enumerate().for_each(|(c, block)| task(c, block));
        return out;
    }
    // Not zeroed first: every value is written by one task below (a step's zeroing of [512, 1536]
    // ran on the calling thread alone, 2% of a prefill).
    let mut out = Vec::<f32>::with_capacity(m * n);
    let dst = Columns(out.as_mut_ptr());
    (0..n.div_ceil(ROWS_PER_TASK)).into_par_iter().for_each_init(Vec::new, |block, c| {
        let (r0, rows) = (c * ROWS_PER_TASK, ROWS_PER_TASK.min(n - c * ROWS_PER_TASK));
        block.resize(rows * m, 0.0);
        task(c, block);
        // Turned through a tile of 16 outputs × the task's rows: reading the block a value per
        // weight row for each output row touched `rows` cache lines `m` floats apart (at m = 512,
        // 2 KiB apart: two of the first-level cache's sets, fewer ways than rows — a miss a value,
        // 4% of an 8B-shaped 512-token prefill); a tile reads each line of the block once.
        let mut tile = [[0f32; ROWS_PER_TASK]; 16];
        for a0 in (0..m).step_by(16) {
            let w = 16.min(m - a0);
            for (r, v) in block.chunks_exact(m).enumerate() {
                for (t, &x) in tile.iter_mut().zip(&v[a0..a0 + w]) {
                    t[r] = x;
                }
            }
            for (a, t) in (a0..a0 + w).zip(&tile) {
                // SAFETY: a < m and r0 + rows <= n: inside `out` (m·n values); task c alone
                // writes columns r0..r0 + rows, and `out` outlives the parallel loop.
                unsafe { std::ptr::copy_nonoverlapping(t.as_ptr(), dst.at(a * n + r0), rows) };
            }
        }
    });
    // SAFETY: the tasks cover columns 0..n of every row a < m: all m·n values are written.
    unsafe { out.set_len(m * n) };
    out
}

/// `out`'s values, written by the tasks of `by_tasks` each in its own columns.
struct Columns(*mut f32);
// SAFETY: the tasks write disjoint elements (their own columns) and nothing reads `out` until
// every task has ended.
unsafe impl Sync for Columns {}

impl Columns {
    /// The address of value `i` (a method, so closures capture the `Sync` wrapper).
    fn at(&self, i: usize) -> *mut f32 {
        self.0.wrapping_add(i)
    }
}

/// `out[m, n] = a[m, k] · b[n, k]ᵀ` through the `gemm` crate.
pub fn gemm_f32(a: &[f32], b: &[f32], out: &mut [f32], m: usize, n: usize, k: usize) {
    gemm_f32_strided(a, b, out, m, n, k, n)
}

/// `gemm_f32` into the first `n` columns of `out` viewed as rows of `ld` (≥ n) values.
fn gemm_f32_strided(
    a: &[f32],
    b: &[f32],
    out: &mut [f32],
    m: usize,
    n: usize,
    k: usize,
    ld: usize,
) {
    assert!(ld >= n && a.len() >= m * k && b.len() >= n * k);
    assert!(m == 0 || out.len() >= (m - 1) * ld + n);
    // SAFETY: the asserts above bound every access: dst is m×n with row stride ld (rs = ld,
    // cs = 1), lhs is m×k row-major, rhs is bᵀ viewed as k×n (row stride 1, column stride k)
    // over n×k storage.
    unsafe {
        gemm::gemm(
            m,
            n,
            k,
            out.as_mut_ptr(),
            1,
            ld as isize,
            false,
            a.as_ptr(),
            1,
            k as isize,
            b.as_ptr(),
            k as isize,
            1,
            0.0,
            1.0,
            false,
            false,
            false,
            gemm::Parallelism::Rayon(0),
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Precision::{Int8, F32};

    #[test]
    fn gemm_matches_naive() {
        let (m, n, k) = (5, 7, 33);
        let a: Vec<f32> = (0..m * k).map(|i| (i % 13) as f32 * 0.1 - 0.5).collect();
        let b: Vec<f32> = (0..n * k).map(|i| (i % 7) as f32 * 0.2 - 0.6).collect();
        let mut out = vec![0f32; m * n];
        gemm_f32(&a, &b, &mut out, m, n, k);
        for i in 0..m {
            for j in 0..n {
                let want: f32 = (0..k).map(|t| a[i * k + t] * b[j * k + t]).sum();
                assert!((out[i * n + j] - want).abs() < 1e-4, "{i},{j}");
            }
        }
    }

    #[test]
    fn rows_are_independent_of_the_batch_and_match_a_naive_reference() {
        // 71 rows: tasks of 32, 32 and 7 (Q8_0's fused path: eights, pairs and a last row), rows
        // as wide as the fused path takes.
        let (n, k) = (71, super::rows_q8::MIN_WIDTH);
        let types = [DType::Q8_0, DType::Q4_0, DType::Q4_1, DType::Q2K, DType::Q3K, DType::Q4K];
        for dtype in types.into_iter().chain([DType::Q5K, DType::Q6K, DType::Bf16]) {
            let mut seed = 3u64;
            let mut rnd = || {
                seed = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                (seed >> 33) as u32
            };
            let mut w: Vec<u8> =
                (0..dtype.row_bytes(k).unwrap() * n).map(|_| rnd() as u8).collect();
            crate::quant::tests::sanitize(dtype, &mut w, &mut rnd);
            let x: Vec<f32> = (0..5 * k).map(|i| ((i * 17) % 11) as f32 * 0.1 - 0.5).collect();
            let batched = matmul(dtype, &w, None, (n, k), &x, 5, F32);
            let mut deq = vec![0f32; n * k];
            for (o, r) in deq.chunks_exact_mut(k).zip(w.chunks_exact(dtype.row_bytes(k).unwrap())) {
                dequant_row(dtype, r, o);
            }
            // Three rows: Q8_0's fused path in groups of four weight rows.
            let three = matmul(dtype, &w, None, (n, k), &x[..3 * k], 3, F32);
            for r in 0..5 {
                let single = matmul(dtype, &w, None, (n, k), &x[r * k..(r + 1) * k], 1, F32);
                for j in 0..n {
                    assert_eq!(
                        batched[r * n + j].to_bits(),
                        single[j].to_bits(),
                        "{dtype}: row {r} differs alone vs batched"
                    );
                    if r < 3 {
                        assert_eq!(three[r * n + j].to_bits(), single[j].to_bits(), "{dtype}");
                    }
                    let dot = crate::quant::dot(&deq[j * k..(j + 1) * k], &x[r * k..(r + 1) * k]);
                    assert_eq!(single[j].to_bits(), dot.to_bits(), "{dtype}: row {r}, output {j}");
                    let naive: f64 =
                        (0..k).map(|t| deq[j * k + t] as f64 * x[r * k + t] as f64).sum();
                    assert!(
                        (single[j] as f64 - naive).abs() < 1e-3 * naive.abs().max(1.0),
                        "{dtype}"
                    );
                }
            }
            // On the 8-bit path: each row the same bits alone and batched.
            if crate::cpu::int8::supports(dtype) {
                let many = matmul(dtype, &w, None, (n, k), &x, 5, Int8);
                for r in 0..5 {
                    let one = matmul(dtype, &w, None, (n, k), &x[r * k..(r + 1) * k], 1, Int8);
                    for j in 0..n {
                        assert_eq!(
                            many[r * n + j].to_bits(),
                            one[j].to_bits(),
                            "{dtype} 8-bit row {r}"
                        );
                    }
                }
            }
            // The GEMM path agrees with the row path to rounding.
            let big: Vec<f32> =
                (0..GEMM_MIN_ROWS * k).map(|i| ((i * 7) % 13) as f32 * 0.05 - 0.3).collect();
            let g = matmul(dtype, &w, None, (n, k), &big, GEMM_MIN_ROWS, F32);
            let one = matmul(dtype, &w, None, (n, k), &big[..k], 1, F32);
            for j in 0..n {
                assert!((g[j] - one[j]).abs() < 1e-3 * one[j].abs().max(1.0));
            }
        }
    }
    /// Every output lands in its place for row and column counts that fill neither the
    /// transposing tile (16 outputs) nor a task (32 weight rows): 37 rows × 71 weight rows, each
    /// output the bits of its row alone, on both paths.
    #[test]
    fn outputs_land_in_place_for_partial_tiles_and_tasks() {
        let (n, k, m) = (71, 256, 37);
        let w = layerstream_types::random::Rng::new(9).tensor(DType::Q4K, &[n, k]).unwrap();
        let x: Vec<f32> = (0..m * k).map(|i| ((i * 29 % 97) as f32 - 48.0) * 0.02).collect();
        for p in [F32, Int8] {
            let all = matmul(DType::Q4K, &w, None, (n, k), &x, m, p);
            for r in 0..m {
                let one = matmul(DType::Q4K, &w, None, (n, k), &x[r * k..(r + 1) * k], 1, p);
                let got: Vec<u32> = all[r * n..(r + 1) * n].iter().map(|v| v.to_bits()).collect();
                if p == Int8 {
                    assert_eq!(got, one.iter().map(|v| v.to_bits()).collect::<Vec<_>>(), "row {r}");
                } else {
                    // f32 takes the GEMM from its threshold: rounding apart, not bits.
                    for (g, o) in all[r * n..(r + 1) * n].iter().zip(&one) {
                        assert!((g - o).abs() <= 1e-3 * o.abs().max(1.0), "row {r}: {g} vs {o}");
                    }
                }
            }
        }
    }
}

#[cfg(test)]
mod precision_tests {
    use super::matmul;
    use crate::Precision::{self, Int8, F32};
    use layerstream_types::DType;

    /// A product's precision is its own argument: f32 and 8-bit products of one weight, run at
    /// once on two threads (as a draft model's 8-bit steps beside an `--exact` target's), each give
    /// the bits they give alone — and the two paths differ, so the test would see a leak.
    #[test]
    fn f32_and_8_bit_products_side_by_side_keep_their_own_bits() {
        let (n, k, m) = (64, 256, 12);
        let w = layerstream_types::random::Rng::new(5).tensor(DType::Q4K, &[n, k]).unwrap();
        let x: Vec<f32> = (0..m * k).map(|i| ((i * 37 % 101) as f32 - 50.0) * 0.03).collect();
        let run = |p: Precision| matmul(DType::Q4K, &w, None, (n, k), &x, m, p);
        let (alone_f32, alone_int8) = (run(F32), run(Int8));
        assert_ne!(alone_f32, alone_int8, "the 8-bit path is a different arithmetic");
        std::thread::scope(|s| {
            let a = s.spawn(|| (0..20).map(|_| run(F32)).collect::<Vec<_>>());
            let b = s.spawn(|| (0..20).map(|_| run(Int8)).collect::<Vec<_>>());
            assert!(a.join().unwrap().iter().all(|o| *o == alone_f32));
            assert!(b.join().unwrap().iter().all(|o| *o == alone_int8));
        });
    }
}
