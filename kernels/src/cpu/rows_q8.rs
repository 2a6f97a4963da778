//! Q8_0 weight rows against f32 activation rows, dequantized in registers: the f32 path
//! (`--exact`, and the vocabulary projection on every path) of the format most heads are stored
//! in. `matmul` otherwise writes each weight row out as f32 (`dequant_row`) and reads it back
//! (`dot_rows2`), which left a 128k-vocabulary head compute-bound at ~8 GB/s of weights on the
//! dev VM. Here, with AVX-512, one register holds eight lanes of each of two rows: each weight
//! is `d·q` rounded to f32 as `dequant_row` makes it, multiplied by its activation and added to its
//! lane (a multiply then an add, no FMA) in the same order as `dot_rows2`, and the lanes are summed
//! as `quant::dot` ends. So every output has the bits of the two-pass path, whatever the rows.

/// Activation rows per pass over the weight rows (each dequantized value used for all of them)
/// for four activation rows or fewer.
const BLOCK: usize = 4;
/// Activation rows per pass from five on, for one pair of weight rows: eight running sums, each
/// dequantized pair used eight times. (Two passes of four dequantized every weight twice; two pairs
/// against eight rows, sixteen sums, ran 1.2-1.5x slower than one pair on an Emerald Rapids VM.
/// Eight rows of the 8B head: 113-120 ms against the two-pass path's 195-212,
/// `benchmarks/q8-0-head-cpu-2core.md`.)
const WIDE_BLOCK: usize = 8;
/// Activation rows `matmul` sends here at most (one pass over the weights).
pub const MAX_ROWS: usize = WIDE_BLOCK;
/// Row widths `matmul` sends here at least: on the dev VM (2 threads, `matvec-bench`,
/// benchmarks/q8-0-head-cpu-2core.md) one to four activation rows ran 0.9-2.1x the two-pass path
/// at 576 to 4096 values (about even only at four rows of the narrow ones); narrower rows were not
/// measured.
pub const MIN_WIDTH: usize = 512;

/// Whether `q8_0_rows` runs on this CPU (AVX-512 F and DQ and F16C, detected once, where
/// `isa::avx512()` allows them).
pub fn available() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        static DETECTED: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
        *DETECTED.get_or_init(|| {
            super::isa::avx512()
                && std::is_x86_feature_detected!("avx512f")
                && std::is_x86_feature_detected!("avx512dq")
                && std::is_x86_feature_detected!("f16c")
        })
    }
    #[cfg(not(target_arch = "x86_64"))]
    false
}

/// Weight rows a pass takes at once for one activation row: four pairs, so it still keeps four
/// independent running sums in flight (one pair's sums wait on their own adds).
pub const ROWS: usize = 8;

/// Weight rows a pass takes at once for `m` activation rows: `ROWS` for one, half as many from two
/// (each activation row adds its own sums; eight rows' sums for four activation rows would not
/// fit the 32 registers), a pair from five (`WIDE_BLOCK`).
pub fn rows_for(m: usize) -> usize {
    if m == 1 {
        ROWS
    } else if m <= BLOCK {
        ROWS / 2
    } else {
        ROWS / 4
    }
}

/// `out[j][i] = dot(dequant(w[j]), x_i)` for Q8_0 weight rows `w` (two, four or eight) of `k` values
/// (`k` a multiple of 32) and the `out[j].len()` rows of `x`. Returns false, computing nothing,
/// where the CPU lacks AVX-512 F/DQ and F16C (`available`).
pub fn q8_0_rows(w: &[&[u8]], x: &[f32], k: usize, out: &mut [&mut [f32]]) -> bool {
    assert!(k.is_multiple_of(32) && w.iter().all(|r| r.len() >= k / 32 * 34));
    assert!(w.len() == out.len() && [2, 4, 8].contains(&w.len()));
    let m = out[0].len();
    assert!(out.iter().all(|o| o.len() == m) && x.len() >= m * k);
    #[cfg(target_arch = "x86_64")]
    if available() {
        // SAFETY: the CPU supports AVX-512 F and DQ and F16C (checked at run time by `available`); the
        // asserts above bound every weight block and activation row read.
        unsafe {
            match (w.len(), m > BLOCK) {
                (2, false) => avx512::rows::<1, BLOCK>(w, x, k, out),
                (2, true) => avx512::rows::<1, WIDE_BLOCK>(w, x, k, out),
                // Four or eight weight rows keep `BLOCK` activation rows a pass whatever `m`
                // (right for any; `rows_for` sends a pair from five, which takes `WIDE_BLOCK`).
                (4, _) => avx512::rows::<2, BLOCK>(w, x, k, out),
                _ => avx512::rows::<4, BLOCK>(w, x, k, out),
            }
        }
        return true;
    }
    false
}

#[cfg(target_arch = "x86_64")]
mod avx512 {
    use std::arch::x86_64::*;

    /// A pair of rows' 32 quantized values of one block (at `b0`/`b1`, the 2-byte scale first),
    /// eight of each side by side per step: `[q0[c..c+8] | q1[c..c+8]]` for `c` = 0, 8, 16, 24
    /// (two loads and four shuffles, not two loads and an insert per step).
    #[inline(always)]
    unsafe fn block_pairs(b0: *const u8, b1: *const u8) -> [__m128i; 4] {
        let v0 = _mm256_loadu_si256(b0.add(2).cast());
        let v1 = _mm256_loadu_si256(b1.add(2).cast());
        let (lo, hi) = (_mm256_unpacklo_epi64(v0, v1), _mm256_unpackhi_epi64(v0, v1));
        [
            _mm256_castsi256_si128(lo),
            _mm256_castsi256_si128(hi),
            _mm256_extracti128_si256::<1>(lo),
            _mm256_extracti128_si256::<1>(hi),
        ]
    }

    /// Eight values of each row, dequantized: `[d0·q0 | d1·q1]` for one step of `block_pairs`.
    #[inline(always)]
    unsafe fn weights(q: __m128i, d: __m512) -> __m512 {
        _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q)))
    }

    /// The eight lanes of each half summed in order, as `quant::dot` ends (`k` has no tail).
    #[inline(always)]
    unsafe fn finish(acc: __m512) -> (f32, f32) {
        let mut lanes = [0f32; 16];
        _mm512_storeu_ps(lanes.as_mut_ptr(), acc);
        (lanes[..8].iter().sum(), lanes[8..].iter().sum())
    }

    /// `super::q8_0_rows` for `2·P` weight rows, `P` pairs of them a register each, `B` activation
    /// rows per pass over them.
    ///
    /// # Safety
    /// The CPU must support AVX-512 F and DQ and F16C; each of the `2·P` rows of `w` must hold `k / 32`
    /// blocks, `out` as many slices of one length `m`, and `x` `m` rows of `k`.
    #[target_feature(enable = "avx2,avx512f,avx512dq,f16c")]
    pub unsafe fn rows<const P: usize, const B: usize>(
        w: &[&[u8]],
        x: &[f32],
        k: usize,
        out: &mut [&mut [f32]],
    ) {
        let m = out[0].len();
        // Pair p's scales: lanes 0-7 take row 2p's, lanes 8-15 row 2p+1's.
        let picks: [__m512i; P] = std::array::from_fn(|p| {
            let idx: [i32; 16] = std::array::from_fn(|l| (2 * p + l / 8) as i32);
            _mm512_loadu_si512(idx.as_ptr().cast())
        });
        let mut i = 0;
        while i < m {
            let n = B.min(m - i);
            let mut acc = [[_mm512_setzero_ps(); P]; B];
            for blk in 0..k / 32 {
                let o = blk * 34;
                // The rows' f16 scales converted together (exactly, as `f16_at` does one).
                let mut h = [0u16; 8];
                for (j, hj) in h.iter_mut().enumerate().take(2 * P) {
                    *hj = u16::from_le_bytes([w[j][o], w[j][o + 1]]);
                }
                let scales =
                    _mm512_castps256_ps512(_mm256_cvtph_ps(_mm_loadu_si128(h.as_ptr().cast())));
                let d: [__m512; P] =
                    std::array::from_fn(|p| _mm512_permutexvar_ps(picks[p], scales));
                let qs: [[__m128i; 4]; P] = std::array::from_fn(|p| {
                    block_pairs(w[2 * p].as_ptr().add(o), w[2 * p + 1].as_ptr().add(o))
                });
                for c in (0..32).step_by(8) {
                    let wv: [__m512; P] = std::array::from_fn(|p| weights(qs[p][c / 8], d[p]));
                    for (r, ar) in acc.iter_mut().enumerate().take(n) {
                        let xp = x.as_ptr().add((i + r) * k + blk * 32 + c);
                        let xv = _mm512_broadcast_f32x8(_mm256_loadu_ps(xp));
                        for (a, wp) in ar.iter_mut().zip(&wv) {
                            *a = _mm512_add_ps(*a, _mm512_mul_ps(*wp, xv));
                        }
                    }
                }
            }
            for (r, ar) in acc.iter().enumerate().take(n) {
                for (p, &v) in ar.iter().enumerate() {
                    let (s0, s1) = finish(v);
                    out[2 * p][i + r] = s0;
                    out[2 * p + 1][i + r] = s1;
                }
            }
            i += n;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cpu::rows::dot_rows2;
    use crate::quant::dequant_row;
    use layerstream_types::DType;

    /// Q8_0 rows of varied scales and bytes: each block a scale then 32 signed bytes.
    fn q8_row(k: usize, seed: usize) -> Vec<u8> {
        let mut row = Vec::with_capacity(k / 32 * 34);
        for b in 0..k / 32 {
            let d = half::f16::from_f32(0.001 + ((b * 7 + seed) % 13) as f32 * 0.0037);
            row.extend(d.to_le_bytes());
            row.extend((0..32).map(|i| ((i * 37 + b * 11 + seed * 5) % 256) as u8));
        }
        row
    }

    /// Every row count around the block of four, widths of one to many blocks: the bits of
    /// dequantizing both rows and `dot_rows2` (the path it replaces).
    #[test]
    fn every_output_has_the_bits_of_dequantize_then_dot() {
        if !available() {
            eprintln!(
                "skipping: no AVX-512 F/DQ and F16C on this CPU (the two-pass path runs instead)"
            );
            return;
        }
        for k in [32usize, 64, 96, 576, 4096] {
            let (w0, w1) = (q8_row(k, 1), q8_row(k, 2));
            let (mut f0, mut f1) = (vec![0f32; k], vec![0f32; k]);
            dequant_row(DType::Q8_0, &w0, &mut f0);
            dequant_row(DType::Q8_0, &w1, &mut f1);
            for m in [1usize, 2, 3, 4, 5, 7, 8, 9, 17] {
                let x: Vec<f32> =
                    (0..m * k).map(|i| ((i * 53 % 97) as f32 - 48.0) * 0.021).collect();
                let (mut b0, mut b1) = (vec![0f32; m], vec![0f32; m]);
                dot_rows2(&f0, &f1, &x, k, &mut b0, &mut b1);
                // Two rows, then eight and four (the pair in every place).
                let mut a = [vec![0f32; m], vec![0f32; m]];
                let mut outs: Vec<&mut [f32]> = a.iter_mut().map(|v| v.as_mut_slice()).collect();
                assert!(q8_0_rows(&[&w0, &w1], &x, k, &mut outs));
                let ws: Vec<&[u8]> =
                    (0..ROWS).map(|j| if j % 2 == 0 { &w0[..] } else { &w1[..] }).collect();
                let mut e = vec![vec![0f32; m]; ROWS];
                let mut outs8: Vec<&mut [f32]> = e.iter_mut().map(|v| v.as_mut_slice()).collect();
                assert!(q8_0_rows(&ws, &x, k, &mut outs8));
                let mut f = vec![vec![0f32; m]; 4];
                let mut outs4: Vec<&mut [f32]> = f.iter_mut().map(|v| v.as_mut_slice()).collect();
                assert!(q8_0_rows(&ws[..4], &x, k, &mut outs4));
                e.extend(f);
                for r in 0..m {
                    assert_eq!(a[0][r].to_bits(), b0[r].to_bits(), "k {k} m {m} row {r}");
                    assert_eq!(a[1][r].to_bits(), b1[r].to_bits(), "k {k} m {m} row {r}, second");
                    // The eight, then the four: even places hold w0, odd ones w1.
                    for (j, o) in e.iter().enumerate() {
                        let want = if j % 2 == 0 { b0[r] } else { b1[r] };
                        assert_eq!(
                            o[r].to_bits(),
                            want.to_bits(),
                            "eight: k {k} m {m} row {r} w {j}"
                        );
                    }
                }
            }
        }
    }
}
