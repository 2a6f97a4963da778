//! Small host-side numeric helpers used by sampling and tests: softmax, argmax, log-softmax, and the
//! check that a row of logits is finite.

/// Fails, naming the row and the first bad logit, when row `r` of the logits holds a NaN or an
/// infinity: any token chosen from it would be garbage (argmax of a NaN row is its first index).
pub fn check_logits(row: &[f32], r: usize) -> crate::Result<()> {
    match row.iter().position(|v| !v.is_finite()) {
        None => Ok(()),
        Some(i) => Err(crate::Error::NonFinite(format!("row {r}: logit {i} is {}", row[i]))),
    }
}

/// Index of the largest value (first on ties).
pub fn argmax(x: &[f32]) -> usize {
    let mut best = 0;
    for (i, &v) in x.iter().enumerate() {
        if v > x[best] {
            best = i;
        }
    }
    best
}

/// The negative log-likelihood (natural log, f64) the logits `row` give token `next`:
/// log-sum-exp of the row minus its logit.
pub fn nll(row: &[f32], next: u32) -> f64 {
    let max = row.iter().fold(f32::NEG_INFINITY, |m, &v| m.max(v)) as f64;
    let lse = max + row.iter().map(|&v| (v as f64 - max).exp()).sum::<f64>().ln();
    lse - row[next as usize] as f64
}

/// In-place softmax (max-subtracted).
pub fn softmax(x: &mut [f32]) {
    let m = x.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let mut s = 0.0;
    for v in x.iter_mut() {
        *v = (*v - m).exp();
        s += *v;
    }
    for v in x.iter_mut() {
        *v /= s;
    }
}

/// Softmax in place with an extra logit `sink` in the denominator only (an attention sink).
pub fn softmax_sink(x: &mut [f32], sink: f32) {
    let m = x.iter().copied().fold(sink, f32::max);
    let mut s = (sink - m).exp();
    for v in x.iter_mut() {
        *v = (*v - m).exp();
        s += *v;
    }
    for v in x.iter_mut() {
        *v /= s;
    }
}

/// gpt-oss's clamped SwiGLU of one gate and up value (transformers' `GptOssExperts._apply_gate`).
pub fn swiglu_clamp(g: f32, u: f32, alpha: f32, limit: f32) -> f32 {
    let g = g.min(limit);
    let u = u.clamp(-limit, limit);
    (u + 1.0) * (g / (1.0 + (-g * alpha).exp()))
}

/// `acc[idx[i]] += scale[i] * y[i]` over rows of `cols` values (rows of `y` in order).
pub fn add_rows_scaled(acc: &mut [f32], y: &[f32], cols: usize, idx: &[usize], scale: &[f32]) {
    for ((&r, &w), yrow) in idx.iter().zip(scale).zip(y.chunks_exact(cols.max(1))) {
        for (a, &v) in acc[r * cols..(r + 1) * cols].iter_mut().zip(yrow) {
            *a += v * w;
        }
    }
}

/// Checks `gather_rows` indices against a tensor of `rows` rows.
pub fn check_gather(rows: usize, idx: &[usize]) -> crate::Result<()> {
    crate::error::ensure(idx.iter().all(|&r| r < rows), "gather_rows", || {
        format!("row indices {idx:?} outside {rows} rows")
    })
}

/// Checks `add_rows_scaled` operands: `acc` and `y` dims, one index and one scale per row of `y`.
pub fn check_add_rows(
    (rows, cols): (usize, usize),
    (yr, yc): (usize, usize),
    idx: &[usize],
    scale: &[f32],
) -> crate::Result<()> {
    crate::error::ensure(
        yc == cols && yr == idx.len() && scale.len() == idx.len() && idx.iter().all(|&r| r < rows),
        "add_rows_scaled",
        || format!("acc {rows}x{cols}, y {yr}x{yc}, {} indices, {} scales", idx.len(), scale.len()),
    )
}

/// GELU, tanh approximation (PyTorch `gelu(approximate="tanh")`), computed in f32 as PyTorch does.
pub fn gelu_tanh(x: f32) -> f32 {
    const K: f32 = 0.797_884_6; // sqrt(2 / pi)
    0.5 * x * (1.0 + (K * (x + 0.044715 * x * x * x)).tanh())
}

/// The indices of the `k` largest values, largest first (ties: the lower index first, as `argmax`).
pub fn top_k(x: &[f32], k: usize) -> Vec<u32> {
    let mut idx: Vec<u32> = (0..x.len() as u32).collect();
    let by = |a: &u32, b: &u32| x[*b as usize].total_cmp(&x[*a as usize]).then(a.cmp(b));
    let k = k.min(idx.len());
    if k > 0 && k < idx.len() {
        idx.select_nth_unstable_by(k - 1, by);
    }
    idx.truncate(k);
    idx.sort_unstable_by(by);
    idx
}

/// `relu(x)²` (transformers' `ReLUSquaredActivation`).
pub fn relu2(x: f32) -> f32 {
    let r = x.max(0.0);
    r * r
}

/// One row quantized to 8 bits by its absolute maximum and back, as transformers' BitLinear
/// computes it in f32: `scale = 127 / max(max|x|, 1e-5)`, `round(x·scale)` (ties to even, as
/// torch rounds) clamped to −128..127, then divided by `scale`.
pub fn quant_row_8bit(row: &mut [f32]) {
    let amax = row.iter().fold(0f32, |m, v| m.max(v.abs())).max(1e-5);
    let scale = 127.0 / amax;
    for v in row.iter_mut() {
        *v = (*v * scale).round_ties_even().clamp(-128.0, 127.0) / scale;
    }
}

/// Checks `perm` indexes the `cols` columns of a tensor (`Backend::permute_cols`).
pub fn check_perm(cols: usize, perm: &[u32]) -> crate::Result<()> {
    crate::error::ensure(
        perm.len() == cols && perm.iter().all(|&p| (p as usize) < cols),
        "permute_cols",
        || format!("an order of {} inputs for a width of {cols}", perm.len()),
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::Backend;

    #[test]
    fn non_finite_logits_are_an_error_naming_the_row_and_the_logit() {
        assert!(check_logits(&[0.5, -3.0, 1e30], 0).is_ok());
        for bad in [f32::NAN, f32::INFINITY, f32::NEG_INFINITY] {
            let e = check_logits(&[0.5, bad, 1.0], 4).unwrap_err().to_string();
            assert!(
                e.contains("non-finite") && e.contains("row 4") && e.contains("logit 1"),
                "{e}"
            );
        }
        // The CPU backend's greedy pick refuses a NaN row instead of answering token 0.
        let c = crate::cpu::CpuBackend::default();
        let rows = c.from_host(&[1.0, 2.0, f32::NAN, f32::NAN], 2, 2).unwrap();
        assert!(c.argmax_rows(&rows).unwrap_err().to_string().contains("row 1"));
        assert_eq!(
            c.argmax_rows(&c.from_host(&[1.0, 2.0, 5.0, 4.0], 2, 2).unwrap()).unwrap(),
            [1, 0]
        );
    }

    #[test]
    fn softmax_sums_to_one_and_orders() {
        let mut x = vec![1.0, 3.0, 2.0];
        softmax(&mut x);
        assert!((x.iter().sum::<f32>() - 1.0).abs() < 1e-6);
        assert!(x[1] > x[2] && x[2] > x[0]);
        assert!((x[1] / x[2] - 1f32.exp()).abs() < 1e-5);
    }

    #[test]
    fn top_k_is_largest_first_with_ties_as_argmax() {
        let x = [1.0, 5.0, 3.0, 5.0, -1.0];
        assert_eq!(top_k(&x, 3), vec![1, 3, 2]);
        assert_eq!(top_k(&x, 1)[0] as usize, argmax(&x));
        assert_eq!(top_k(&x, 9).len(), 5);
    }

    #[test]
    fn argmax_first_of_ties() {
        assert_eq!(argmax(&[1.0, 5.0, 5.0, -1.0]), 1);
    }

    #[test]
    fn rows_quantize_to_255_levels_of_their_maximum_ties_to_even() {
        // max 1.27: scale 100; 0.005·100 = 0.5 rounds to 0, 0.015·100 = 1.5 to 2 (ties to even).
        let mut row = [1.27f32, -1.27, 0.005, 0.015, 0.3333, 0.0];
        super::quant_row_8bit(&mut row);
        let scale = 127.0 / 1.27f32;
        let want =
            [127.0, -127.0, 0.0, 2.0, (0.3333f32 * scale).round(), 0.0].map(|q: f32| q / scale);
        assert_eq!(row, want);
        assert_eq!(super::relu2(-2.0), 0.0);
        assert_eq!(super::relu2(3.0), 9.0);
    }
}
