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

/// Rows of keys or values: position i's head at `buf[at[i]..at[i] + len]` (a pool's rows read in
/// place, or a gathered copy's).
#[derive(Clone, Copy)]
pub(super) struct Rows<'a> {
    pub buf: &'a [f32],
    pub at: &'a [usize],
}

impl Rows<'_> {
    /// Whether every row of `len` values lies inside the buffer.
    fn hold(&self, len: usize) -> bool {
        self.at.iter().all(|&a| a.checked_add(len).is_some_and(|e| e <= self.buf.len()))
    }

    /// Row `i`, `len` values.
    fn row(&self, i: usize, len: usize) -> &[f32] {
        &self.buf[self.at[i]..self.at[i] + len]
    }
}

/// `out[i] = dot(q, key row i) · scale` for every key row.
pub(super) fn scores(q: &[f32], keys: Rows<'_>, scale: f32, out: &mut [f32]) {
    assert!(out.len() == keys.at.len() && keys.hold(q.len()));
    #[cfg(target_arch = "x86_64")]
    if std::is_x86_feature_detected!("avx") {
        // SAFETY: the CPU has AVX (checked); the rows were checked to lie inside the buffer.
        return unsafe { avx::scores(q, keys, scale, out) };
    }
    for (i, o) in out.iter_mut().enumerate() {
        *o = dot(q, keys.row(i, q.len())) * scale;
    }
}

/// `o = Σ_i p[i] · value row i`, position by position from zero.
pub(super) fn weighted_sum(p: &[f32], values: Rows<'_>, o: &mut [f32]) {
    assert!(p.len() == values.at.len() && values.hold(o.len()));
    o.fill(0.0);
    #[cfg(target_arch = "x86_64")]
    if std::is_x86_feature_detected!("avx") {
        // SAFETY: the CPU has AVX (checked); the rows were checked to lie inside the buffer.
        return unsafe { avx::weighted_sum(p, values, o) };
    }
    let len = o.len();
    for (i, &pt) in p.iter().enumerate() {
        for (oi, vi) in o.iter_mut().zip(values.row(i, len)) {
            *oi += pt * vi;
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod avx {
    use super::Rows;
    use std::arch::x86_64::*;

    /// `super::scores`, eight keys at a time.
    ///
    /// # Safety
    /// The CPU must support AVX; `out` holds one value per key row and every row lies inside
    /// the buffer (`q.len()` values).
    #[target_feature(enable = "avx")]
    pub unsafe fn scores(q: &[f32], keys: Rows<'_>, scale: f32, out: &mut [f32]) {
        let hd = q.len();
        let body = hd / 8 * 8;
        let (base, n) = (keys.buf.as_ptr(), keys.at.len());
        let mut i = 0;
        while i + 8 <= n {
            let k: [*const f32; 8] = [
                base.add(keys.at[i]),
                base.add(keys.at[i + 1]),
                base.add(keys.at[i + 2]),
                base.add(keys.at[i + 3]),
                base.add(keys.at[i + 4]),
                base.add(keys.at[i + 5]),
                base.add(keys.at[i + 6]),
                base.add(keys.at[i + 7]),
            ];
            let mut acc = [_mm256_setzero_ps(); 8];
            for c in (0..body).step_by(8) {
                let qc = _mm256_loadu_ps(q.as_ptr().add(c));
                for j in 0..8 {
                    // SAFETY: c + 8 <= body <= hd, and each row's hd values lie inside the buffer.
                    let kc = _mm256_loadu_ps(k[j].add(c));
                    acc[j] = _mm256_add_ps(acc[j], _mm256_mul_ps(qc, kc));
                }
            }
            let mut sums = [0f32; 8];
            _mm256_storeu_ps(sums.as_mut_ptr(), lane_sums(acc));
            for j in 0..8 {
                let mut s = sums[j];
                for (c, &qc) in q.iter().enumerate().skip(body) {
                    s += qc * *k[j].add(c);
                }
                out[i + j] = s * scale;
            }
            i += 8;
        }
        for (j, o) in out.iter_mut().enumerate().skip(i) {
            *o = super::dot(q, keys.row(j, hd)) * scale;
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
    /// The CPU must support AVX; `p` holds one weight per value row, each row inside the buffer
    /// (`o.len()` values).
    #[target_feature(enable = "avx")]
    pub unsafe fn weighted_sum(p: &[f32], values: Rows<'_>, o: &mut [f32]) {
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
        for (c, oc) in o.iter_mut().enumerate().skip(c0) {
            for (&pt, &at) in p.iter().zip(values.at) {
                *oc += pt * values.buf[at + c];
            }
        }
    }

    /// Output values `c0..c0 + 8·N` summed over every position in `N` registers.
    #[inline(always)]
    unsafe fn columns<const N: usize>(p: &[f32], values: Rows<'_>, c0: usize, o: &mut [f32]) {
        let mut acc = [_mm256_setzero_ps(); N];
        let base = values.buf.as_ptr().add(c0);
        for (&pt, &at) in p.iter().zip(values.at) {
            let pb = _mm256_set1_ps(pt);
            let v = base.add(at);
            for (j, a) in acc.iter_mut().enumerate() {
                // SAFETY: c0 + 8·N <= the row's length, inside the buffer (the caller's contract).
                *a = _mm256_add_ps(*a, _mm256_mul_ps(pb, _mm256_loadu_ps(v.add(8 * j))));
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

    /// `rows` in one buffer, last first (so the offsets are not in order), with their offsets.
    fn laid_out(rows: &[Vec<f32>]) -> (Vec<f32>, Vec<usize>) {
        let buf: Vec<f32> = rows.iter().rev().flatten().copied().collect();
        let len = rows.first().map_or(0, |r| r.len());
        (buf, (0..rows.len()).map(|i| (rows.len() - 1 - i) * len).collect())
    }

    /// Rows outside the buffer are refused before anything is read.
    #[test]
    #[should_panic]
    fn rows_past_the_buffer_are_refused() {
        let buf = vec![0f32; 64];
        scores(&[0.0; 32], Rows { buf: &buf, at: &[0, 40] }, 1.0, &mut [0.0; 2]);
    }

    /// Every score is `quant::dot` times the scale, bit for bit, at head sizes with and without a
    /// tail and key counts around the eight-key step.
    #[test]
    fn scores_are_the_dots_bits() {
        for hd in [8, 12, 64, 80, 128, 256] {
            for n in [1, 7, 8, 9, 16, 23] {
                let q = gen(hd, 31, 1);
                let rows: Vec<Vec<f32>> = (0..n).map(|t| gen(hd + 3, 17, t * 5)).collect();
                let (buf, at) = laid_out(&rows);
                let mut got = vec![0f32; n];
                scores(&q, Rows { buf: &buf, at: &at }, 0.125, &mut got);
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
                let (buf, at) = laid_out(&rows);
                let mut got = vec![f32::NAN; hd];
                weighted_sum(&p, Rows { buf: &buf, at: &at }, &mut got);
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
