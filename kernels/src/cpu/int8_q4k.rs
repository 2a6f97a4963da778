//! Q4_K and Q5_K against a few activation rows (2 to `MAX_ROWS`: a batched decode step, drafted
//! rows to verify) with AVX-512 VNNI: one `vpdpbusd` multiplies four 4- or 5-bit weights
//! (unsigned) by four 8-bit activations (signed) and adds them into an i32 lane, so a sub-block's 32 products take
//! eight of them — where the few-row kernel (`int8_batch::q45k`) takes a `vpmaddubsw`, a `vpmaddwd`
//! and its share of a horizontal sum (`sums8`) per activation row.
//!
//! For that the eight sub-blocks of a super-block are laid out with lane c holding sub-block c
//! (`transpose8`: instruction t takes values 4t..4t+4 of each): the weights once a super-block for
//! every activation row, the activations once a call for every weight row. Each lane then ends
//! with its sub-block's integer sum, the one `sums8` gives, and it is scaled, added and summed with
//! `q45k`'s f32 operations in `q45k`'s order: every output has the bits of the one-row, few-row
//! and many-row kernels (a sequence's logits do not depend on what its step holds).

use super::int8::{prefetch, Q8Row, QK};
use super::int8_batch::{hsum, q45k_scales, q45k_values};
use std::arch::x86_64::*;

/// The most activation rows a call takes.
pub const MAX_ROWS: usize = 8;

/// Bytes of a Q4_K super-block (256 values: d, dmin, 12 bytes of scales, 128 of nibbles), or with
/// `fifth` of a Q5_K one (32 bytes of fifth bits more).
const fn sb(fifth: bool) -> usize {
    if fifth {
        176
    } else {
        144
    }
}

/// Whether this CPU runs it (AVX-512 VL and VNNI, as `int8_lanes` detects them, within
/// `isa::cap`).
pub fn available() -> bool {
    super::int8_lanes::isa() == Some(super::int8_lanes::Isa::Vnni)
}

/// Whether a step of `m` activation rows of `dtype` is this kernel's.
pub fn takes(dtype: layerstream_types::DType, m: usize) -> bool {
    use layerstream_types::DType;
    matches!(dtype, DType::Q4K | DType::Q5K) && (2..=MAX_ROWS).contains(&m) && available()
}

/// The 8 × 8 transpose of `v`'s i32 lanes: lane c of `out[t]` is lane t of `v[c]`.
#[inline(always)]
unsafe fn transpose8(v: [__m256i; 8]) -> [__m256i; 8] {
    // Per 128-bit half: pairs of rows, then quadruples, then the halves swapped into place.
    let lo32 = |a, b| _mm256_unpacklo_epi32(a, b);
    let hi32 = |a, b| _mm256_unpackhi_epi32(a, b);
    let (a0, a1, a2, a3) = (lo32(v[0], v[1]), hi32(v[0], v[1]), lo32(v[2], v[3]), hi32(v[2], v[3]));
    let (a4, a5, a6, a7) = (lo32(v[4], v[5]), hi32(v[4], v[5]), lo32(v[6], v[7]), hi32(v[6], v[7]));
    let lo64 = |a, b| _mm256_unpacklo_epi64(a, b);
    let hi64 = |a, b| _mm256_unpackhi_epi64(a, b);
    let b = [lo64(a0, a2), hi64(a0, a2), lo64(a1, a3), hi64(a1, a3)];
    let c = [lo64(a4, a6), hi64(a4, a6), lo64(a5, a7), hi64(a5, a7)];
    let mut out = [_mm256_setzero_si256(); 8];
    for t in 0..4 {
        out[t] = _mm256_permute2x128_si256(b[t], c[t], 0x20);
        out[t + 4] = _mm256_permute2x128_si256(b[t], c[t], 0x31);
    }
    out
}

/// Each row's activations, super-block by super-block, transposed as the weights are: row a's
/// super-block s at `[(a · nsb + s) · 8 ..][..8]`.
#[inline(always)]
unsafe fn activations(xs: &[Q8Row], nsb: usize) -> Vec<__m256i> {
    let mut t = Vec::with_capacity(xs.len() * nsb * 8);
    for x in xs {
        for s in 0..nsb {
            let v: [__m256i; 8] = std::array::from_fn(|c| {
                _mm256_loadu_si256(x.q[(8 * s + c) * QK..].as_ptr() as *const __m256i)
            });
            t.extend_from_slice(&transpose8(v));
        }
    }
    t
}

/// `out[j·m + a]` = Q4_K (`FIFTH`: Q5_K) weight row `j` of `w` (rows of `rb` bytes) · activation
/// row `a` of `xs` (`m` = `xs.len()`, 2 to `MAX_ROWS`), with the bits of `int8_batch::q45k`.
///
/// # Safety
/// `available()` must hold; `w` must hold `out.len() / m` rows of `rb` bytes (whole super-blocks)
/// and every row of `xs` at least a weight row's values.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
pub unsafe fn dot<const FIFTH: bool>(w: &[u8], rb: usize, xs: &[Q8Row], out: &mut [f32]) {
    let (nsb, m) = (rb / sb(FIFTH), xs.len());
    assert!(
        (2..=MAX_ROWS).contains(&m),
        "int8_q4k::dot takes 2 to {MAX_ROWS} activation rows, not {m}"
    );
    let xt = activations(xs, nsb);
    // Four rows a pass at most: eight rows' sums, accumulators and offsets beside the weights'
    // eight vectors overflow the 32 registers, and the row's second pass reads it from L1.
    let mut a0 = 0;
    while a0 < m {
        let n = (m - a0).min(4);
        let (x, t) = (&xs[a0..a0 + n], &xt[a0 * nsb * 8..]);
        match n {
            1 => rows::<1, FIFTH>(w, rb, x, t, out, m, a0),
            2 => rows::<2, FIFTH>(w, rb, x, t, out, m, a0),
            3 => rows::<3, FIFTH>(w, rb, x, t, out, m, a0),
            _ => rows::<4, FIFTH>(w, rb, x, t, out, m, a0),
        }
        a0 += n;
    }
}

/// `dot` for the `N` rows `xs` (their chains of `vpdpbusd` side by side; `xt` their transposed
/// activations), rows `a0..a0 + N` of each weight row's `m` outputs.
// Rows index the activations, the accumulators and the outputs alike.
#[allow(clippy::needless_range_loop)]
#[inline(always)]
unsafe fn rows<const N: usize, const FIFTH: bool>(
    w: &[u8],
    rb: usize,
    xs: &[Q8Row],
    xt: &[__m256i],
    out: &mut [f32],
    m: usize,
    a0: usize,
) {
    let (bb, nsb) = (sb(FIFTH), rb / sb(FIFTH));
    for (j, o) in out.chunks_exact_mut(m).enumerate() {
        let o = &mut o[a0..a0 + N];
        let row = w.as_ptr().add(j * rb);
        let mut acc = [_mm256_setzero_ps(); N];
        let mut off = [_mm256_setzero_ps(); N];
        for s in 0..nsb {
            let b = row.add(s * bb);
            for line in (0..bb).step_by(64) {
                prefetch(b.add(line));
            }
            let (dsc, dmn) = q45k_scales(b);
            let wt = transpose8(q45k_values::<FIFTH>(b));
            let mut isum = [_mm256_setzero_si256(); N];
            for t in 0..8 {
                for a in 0..N {
                    isum[a] = _mm256_dpbusd_epi32(isum[a], wt[t], xt[(a * nsb + s) * 8 + t]);
                }
            }
            for a in 0..N {
                let (dx, ds) = xs[a].scales8(8 * s);
                off[a] = _mm256_fmadd_ps(dmn, _mm256_loadu_ps(ds.as_ptr()), off[a]);
                let scale = _mm256_mul_ps(dsc, _mm256_loadu_ps(dx.as_ptr()));
                acc[a] = _mm256_fmadd_ps(scale, _mm256_cvtepi32_ps(isum[a]), acc[a]);
            }
        }
        for a in 0..N {
            o[a] = hsum(_mm256_add_ps(acc[a], off[a]));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cpu::int8::quantize_row;
    use layerstream_types::DType;

    /// Activation rows of different magnitudes and signs, the extremes ±127 included.
    fn rows(m: usize, k: usize) -> Vec<Q8Row> {
        (0..m)
            .map(|a| {
                let x: Vec<f32> = (0..k)
                    .map(|i| ((i * 37 + a * 11) % 101) as f32 * 0.02 * (a + 1) as f32 - 1.0)
                    .collect();
                quantize_row(&x)
            })
            .collect()
    }

    #[test]
    fn the_transpose_moves_lane_t_of_row_c_to_lane_c_of_row_t() {
        if !available() {
            eprintln!("skipped: this CPU has no AVX-512 VNNI (or isa::cap turned it off)");
            return;
        }
        #[target_feature(enable = "avx2")]
        unsafe fn check() {
            let v: [__m256i; 8] = std::array::from_fn(|c| {
                _mm256_setr_epi32(
                    (c * 8) as i32,
                    (c * 8 + 1) as i32,
                    (c * 8 + 2) as i32,
                    (c * 8 + 3) as i32,
                    (c * 8 + 4) as i32,
                    (c * 8 + 5) as i32,
                    (c * 8 + 6) as i32,
                    (c * 8 + 7) as i32,
                )
            });
            for (t, r) in transpose8(v).iter().enumerate() {
                let lanes: [i32; 8] = std::mem::transmute(*r);
                assert_eq!(lanes, std::array::from_fn(|c| (c * 8 + t) as i32), "row {t}");
            }
        }
        // SAFETY: `available()` implies AVX2.
        unsafe { check() }
    }

    #[test]
    fn every_output_has_the_bits_of_the_one_row_kernel() {
        if !available() {
            eprintln!("skipped: this CPU has no AVX-512 VNNI (or isa::cap turned it off)");
            return;
        }
        for (dtype, (k, n)) in [DType::Q4K, DType::Q5K]
            .into_iter()
            .flat_map(|d| [(256, 5), (512, 3), (4096, 4)].map(|s| (d, s)))
        {
            let w = layerstream_types::random::Rng::new(k as u64).tensor(dtype, &[n, k]).unwrap();
            let rb = w.len() / n;
            for m in 2..=MAX_ROWS {
                let xs = rows(m, k);
                let mut got = vec![0f32; n * m];
                // SAFETY: checked `available()`; `w` holds n rows of rb bytes, each x k values.
                unsafe {
                    match dtype {
                        DType::Q5K => dot::<true>(&w, rb, &xs, &mut got),
                        _ => dot::<false>(&w, rb, &xs, &mut got),
                    }
                };
                for j in 0..n {
                    for a in 0..m {
                        let mut one = [0f32];
                        let row = &w[j * rb..(j + 1) * rb];
                        crate::cpu::int8::dot_rows(dtype, row, rb, &xs[a..a + 1], &mut one);
                        assert_eq!(
                            got[j * m + a].to_bits(),
                            one[0].to_bits(),
                            "{dtype:?} k {k} m {m} row {j} act {a}"
                        );
                    }
                }
                assert!(got.iter().any(|v| *v != 0.0), "the products are not all zero");
            }
        }
    }
}
