//! CPU matmul: fused dequantize-dot per row for matvec (decode), dequantize-then-GEMM for prefill.

use crate::quant::{dequant_row, dot_row};
use layerstream_model::DType;
use rayon::prelude::*;

/// Rows of `w` handed to one rayon task in matvec.
const ROWS_PER_TASK: usize = 64;

/// `out[m, n] = x[m, k] · w[n, k]ᵀ` for a stored weight of `dtype`.
pub fn matmul(dtype: DType, w: &[u8], wf32: Option<&[f32]>, n: usize, k: usize, x: &[f32], m: usize) -> Vec<f32> {
    let mut out = vec![0f32; m * n];
    let row_bytes = w.len() / n;
    if m <= 2 {
        for (xi, oi) in x.chunks_exact(k).zip(out.chunks_exact_mut(n)) {
            oi.par_chunks_mut(ROWS_PER_TASK).enumerate().for_each(|(c, o)| {
                for (j, v) in o.iter_mut().enumerate() {
                    let r = c * ROWS_PER_TASK + j;
                    *v = match wf32 {
                        Some(f) => crate::quant::dot(&f[r * k..(r + 1) * k], xi),
                        None => dot_row(dtype, &w[r * row_bytes..(r + 1) * row_bytes], xi),
                    };
                }
            });
        }
        return out;
    }
    let owned;
    let wf = match wf32 {
        Some(f) => f,
        None => {
            let mut buf = vec![0f32; n * k];
            buf.par_chunks_mut(k).zip(w.par_chunks(row_bytes)).for_each(|(o, r)| dequant_row(dtype, r, o));
            owned = buf;
            &owned
        }
    };
    gemm_f32(x, wf, &mut out, m, n, k);
    out
}

/// `out[m, n] = a[m, k] · b[n, k]ᵀ` through the `gemm` crate.
pub fn gemm_f32(a: &[f32], b: &[f32], out: &mut [f32], m: usize, n: usize, k: usize) {
    assert!(a.len() >= m * k && b.len() >= n * k && out.len() >= m * n);
    // SAFETY: the asserts above bound every access: dst is m×n row-major (rs = n, cs = 1), lhs is
    // m×k row-major, rhs is bᵀ viewed as k×n (row stride 1, column stride k) over n×k storage.
    unsafe {
        gemm::gemm(
            m, n, k,
            out.as_mut_ptr(), 1, n as isize,
            false,
            a.as_ptr(), 1, k as isize,
            b.as_ptr(), k as isize, 1,
            0.0, 1.0,
            false, false, false,
            gemm::Parallelism::Rayon(0),
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
    fn matvec_and_gemm_paths_agree_on_quantized_weights() {
        let (n, k) = (70, 64);
        let dtype = DType::Q8_0;
        let mut w = vec![0u8; dtype.row_bytes(k).unwrap() * n];
        for (bi, b) in w.chunks_exact_mut(34).enumerate() {
            b[0..2].copy_from_slice(&half::f16::from_f32(0.01 * (bi % 5 + 1) as f32).to_le_bytes());
            for (j, q) in b[2..].iter_mut().enumerate() {
                *q = ((bi * 31 + j * 7) % 255) as u8;
            }
        }
        let x: Vec<f32> = (0..3 * k).map(|i| ((i * 17) % 11) as f32 * 0.1 - 0.5).collect();
        let batched = matmul(dtype, &w, None, n, k, &x, 3);
        for r in 0..3 {
            let single = matmul(dtype, &w, None, n, k, &x[r * k..(r + 1) * k], 1);
            for j in 0..n {
                assert!((batched[r * n + j] - single[j]).abs() < 1e-4);
            }
        }
    }
}
