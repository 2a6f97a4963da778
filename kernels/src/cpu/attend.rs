//! The arithmetic of one attention row: a query's score dots against the positions it sees and
//! the probability-weighted sum of their value rows, with AVX where the CPU has it.
//!
//! Each score keeps `quant::dot`'s order (eight lane sums over the head, the lanes added 0..7, then
//! the tail) and each output value adds p·v position by position, a multiply then an add; so the
//! bits are those of one `dot` and one `o += p·v` per position, at any vector width and however
//! many rows a step holds. The vector kernels only change which work runs side by side: eight
//! keys' dots at once (their lane sums transposed into one register and added in order, instead of
//! eight scalar chains), and a head's output kept in registers across every position instead of
//! loaded and stored per position.

use crate::quant::dot;

/// `out[i] = dot(q, keys[i][..q.len()]) · scale` for every key row (each at least `q.len()` long).
pub(super) fn scores(q: &[f32], keys: &[&[f32]], scale: f32, out: &mut [f32]) {
    assert!(out.len() == keys.len() && keys.iter().all(|k| k.len() >= q.len()));
    #[cfg(target_arch = "x86_64")]
    if std::is_x86_feature_detected!("avx") {
        // SAFETY: the CPU has AVX (checked); the lengths were checked above.
        return unsafe { avx::scores(q, keys, scale, out) };
    }
    for (o, k) in out.iter_mut().zip(keys) {
        *o = dot(q, &k[..q.len()]) * scale;
    }
}

/// `o = Σ_t p[t] · values[t][..o.len()]`, position by position from zero (each value row at least
/// `o.len()` long).
pub(super) fn weighted_sum(p: &[f32], values: &[&[f32]], o: &mut [f32]) {
    assert!(p.len() == values.len() && values.iter().all(|v| v.len() >= o.len()));
    o.fill(0.0);
    #[cfg(target_arch = "x86_64")]
    if std::is_x86_feature_detected!("avx") {
        // SAFETY: the CPU has AVX (checked); the lengths were checked above.
        return unsafe { avx::weighted_sum(p, values, o) };
    }
    for (&pt, v) in p.iter().zip(values) {
        for (oi, vi) in o.iter_mut().zip(*v) {
            *oi += pt * vi;
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod avx {
    use std::arch::x86_64::*;

    /// `super::scores`, eight keys at a time.
    ///
    /// # Safety
    /// The CPU must support AVX; `out` holds one value per key and every key row `q.len()` values.
    #[target_feature(enable = "avx")]
    pub unsafe fn scores(q: &[f32], keys: &[&[f32]], scale: f32, out: &mut [f32]) {
        let hd = q.len();
        let body = hd / 8 * 8;
        let mut i = 0;
        while i + 8 <= keys.len() {
            let k = &keys[i..i + 8];
            let mut acc = [_mm256_setzero_ps(); 8];
            for c in (0..body).step_by(8) {
                let qc = _mm256_loadu_ps(q.as_ptr().add(c));
                for j in 0..8 {
                    // SAFETY: c + 8 <= body <= the key row's length (the caller's contract).
                    let kc = _mm256_loadu_ps(k[j].as_ptr().add(c));
                    acc[j] = _mm256_add_ps(acc[j], _mm256_mul_ps(qc, kc));
                }
            }
            let mut sums = [0f32; 8];
            _mm256_storeu_ps(sums.as_mut_ptr(), lane_sums(acc));
            for j in 0..8 {
                let mut s = sums[j];
                for c in body..hd {
                    s += q[c] * k[j][c];
                }
                out[i + j] = s * scale;
            }
            i += 8;
        }
        for j in i..keys.len() {
            out[j] = super::dot(q, &keys[j][..hd]) * scale;
        }
    }

    /// Lane `j` of the result: the eight lanes of `acc[j]` added in order, 0 first (what
    /// `quant::dot` does to its one accumulator): the 8×8 block transposed, then seven vector adds.
    #[inline(always)]
    unsafe fn lane_sums(a: [__m256; 8]) -> __m256 {
        let t: [__m256; 8] = [
            _mm256_unpacklo_ps(a[0], a[1]),
            _mm256_unpackhi_ps(a[0], a[1]),
            _mm256_unpacklo_ps(a[2], a[3]),
            _mm256_unpackhi_ps(a[2], a[3]),
            _mm256_unpacklo_ps(a[4], a[5]),
            _mm256_unpackhi_ps(a[4], a[5]),
            _mm256_unpacklo_ps(a[6], a[7]),
            _mm256_unpackhi_ps(a[6], a[7]),
        ];
        // u[l]: lane l (low half) and lane l + 4 (high half) of rows 0-3 (u[l]) and 4-7 (u[l + 4]).
        let u: [__m256; 8] = [
            _mm256_shuffle_ps::<0x44>(t[0], t[2]),
            _mm256_shuffle_ps::<0xEE>(t[0], t[2]),
            _mm256_shuffle_ps::<0x44>(t[1], t[3]),
            _mm256_shuffle_ps::<0xEE>(t[1], t[3]),
            _mm256_shuffle_ps::<0x44>(t[4], t[6]),
            _mm256_shuffle_ps::<0xEE>(t[4], t[6]),
            _mm256_shuffle_ps::<0x44>(t[5], t[7]),
            _mm256_shuffle_ps::<0xEE>(t[5], t[7]),
        ];
        // v[l]: lane l of every row.
        let v: [__m256; 8] = [
            _mm256_permute2f128_ps::<0x20>(u[0], u[4]),
            _mm256_permute2f128_ps::<0x20>(u[1], u[5]),
            _mm256_permute2f128_ps::<0x20>(u[2], u[6]),
            _mm256_permute2f128_ps::<0x20>(u[3], u[7]),
            _mm256_permute2f128_ps::<0x31>(u[0], u[4]),
            _mm256_permute2f128_ps::<0x31>(u[1], u[5]),
            _mm256_permute2f128_ps::<0x31>(u[2], u[6]),
            _mm256_permute2f128_ps::<0x31>(u[3], u[7]),
        ];
        let mut s = v[0];
        for x in &v[1..] {
            s = _mm256_add_ps(s, *x);
        }
        s
    }

    /// `super::weighted_sum` into a zeroed `o`: 64 output values at a time in eight registers
    /// across every position, then 8 at a time, then the tail.
    ///
    /// # Safety
    /// The CPU must support AVX; `p` holds one weight per value row, each `o.len()` values long.
    #[target_feature(enable = "avx")]
    pub unsafe fn weighted_sum(p: &[f32], values: &[&[f32]], o: &mut [f32]) {
        let hd = o.len();
        let mut c0 = 0;
        while c0 + 64 <= hd {
            columns::<8>(p, values, c0, o);
            c0 += 64;
        }
        while c0 + 8 <= hd {
            columns::<1>(p, values, c0, o);
            c0 += 8;
        }
        for c in c0..hd {
            let mut a = o[c];
            for (&pt, v) in p.iter().zip(values) {
                a += pt * v[c];
            }
            o[c] = a;
        }
    }

    /// Output values `c0..c0 + 8·N` summed over every position in `N` registers.
    #[inline(always)]
    unsafe fn columns<const N: usize>(p: &[f32], values: &[&[f32]], c0: usize, o: &mut [f32]) {
        let mut acc = [_mm256_setzero_ps(); N];
        for (&pt, v) in p.iter().zip(values) {
            let pb = _mm256_set1_ps(pt);
            let at = v.as_ptr().add(c0);
            for (j, a) in acc.iter_mut().enumerate() {
                // SAFETY: c0 + 8·N <= the value row's length (the caller's contract).
                *a = _mm256_add_ps(*a, _mm256_mul_ps(pb, _mm256_loadu_ps(at.add(8 * j))));
            }
        }
        for (j, a) in acc.iter().enumerate() {
            _mm256_storeu_ps(o.as_mut_ptr().add(c0 + 8 * j), *a);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn gen(n: usize, mul: usize, seed: usize) -> Vec<f32> {
        (0..n).map(|i| (((i + seed) * mul) % 1009) as f32 * 1.37e-3 - 0.69).collect()
    }

    /// Every score is `quant::dot` times the scale, bit for bit, at head sizes with and without a
    /// tail and key counts around the eight-key step.
    #[test]
    fn scores_are_the_dots_bits() {
        for hd in [8, 12, 64, 80, 128, 256] {
            for n in [1, 7, 8, 9, 16, 23] {
                let q = gen(hd, 31, 1);
                let rows: Vec<Vec<f32>> = (0..n).map(|t| gen(hd + 3, 17, t * 5)).collect();
                let keys: Vec<&[f32]> = rows.iter().map(|r| r.as_slice()).collect();
                let mut got = vec![0f32; n];
                scores(&q, &keys, 0.125, &mut got);
                for (t, g) in got.iter().enumerate() {
                    let want = dot(&q, &rows[t][..hd]) * 0.125;
                    assert_eq!(g.to_bits(), want.to_bits(), "hd {hd} n {n} key {t}");
                }
            }
        }
    }

    /// Every output value is the position-by-position `o += p·v` from zero, bit for bit.
    #[test]
    fn weighted_sums_are_the_running_sums_bits() {
        for hd in [8, 12, 64, 72, 200, 256] {
            for n in [1, 5, 64] {
                let p = gen(n, 13, 2);
                let rows: Vec<Vec<f32>> = (0..n).map(|t| gen(hd + 1, 29, t * 3)).collect();
                let values: Vec<&[f32]> = rows.iter().map(|r| r.as_slice()).collect();
                let mut got = vec![f32::NAN; hd];
                weighted_sum(&p, &values, &mut got);
                let mut want = vec![0f32; hd];
                for (pt, v) in p.iter().zip(&rows) {
                    for (o, x) in want.iter_mut().zip(v) {
                        *o += pt * x;
                    }
                }
                for (c, (g, w)) in got.iter().zip(&want).enumerate() {
                    assert_eq!(g.to_bits(), w.to_bits(), "hd {hd} n {n} value {c}");
                }
            }
        }
    }
}
