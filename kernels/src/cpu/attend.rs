//! The arithmetic of one attention row: a query's score dots against the positions it sees and
//! the probability-weighted sum of their value rows.
//!
//! One order for every step, so a row's bits do not depend on how many rows or positions its step
//! holds: a score is eight lane sums over the head (lane l takes values l, l + 8, …, each a fused
//! multiply-add where the CPU has FMA), the lanes added 0..7, then the tail; an output value adds
//! p·v position by position (fused likewise). With AVX and FMA eight keys' dots run side by side
//! (their lane sums transposed into one register and added in that order) and a head's output
//! stays in registers across every position; elsewhere the same order runs as scalar code with
//! separate multiplies and adds (a CPU without FMA gets its own bits, the same at every row count).

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

/// Whether this CPU runs the vector kernels (AVX and FMA; detected once).
pub(super) fn vector() -> bool {
    static DETECTED: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    #[cfg(target_arch = "x86_64")]
    return *DETECTED.get_or_init(|| {
        std::is_x86_feature_detected!("avx") && std::is_x86_feature_detected!("fma")
    });
    #[cfg(not(target_arch = "x86_64"))]
    return *DETECTED.get_or_init(|| false);
}

/// `out[i] = (q · key row i) · scale` for every key row, in the module's order.
pub(super) fn scores(q: &[f32], keys: Rows<'_>, scale: f32, out: &mut [f32]) {
    assert!(out.len() == keys.at.len() && keys.hold(q.len()));
    #[cfg(target_arch = "x86_64")]
    if vector() {
        // SAFETY: the CPU has AVX and FMA (checked); the rows were checked to lie inside the buffer.
        return unsafe { avx::scores(q, keys, scale, out) };
    }
    for (i, o) in out.iter_mut().enumerate() {
        *o = score_lanes(q, keys.row(i, q.len()), |a, b, c| a * b + c) * scale;
    }
}

/// One score in the module's order, `fma(a, b, c)` the multiply-add (fused or not).
#[inline(always)]
fn score_lanes(q: &[f32], k: &[f32], fma: impl Fn(f32, f32, f32) -> f32) -> f32 {
    let mut acc = [0f32; 8];
    let (cq, ck) = (q.chunks_exact(8), k.chunks_exact(8));
    let (rq, rk) = (cq.remainder(), ck.remainder());
    for (x, y) in cq.zip(ck) {
        for l in 0..8 {
            acc[l] = fma(x[l], y[l], acc[l]);
        }
    }
    let mut s: f32 = acc.iter().sum();
    for (x, y) in rq.iter().zip(rk) {
        s = fma(*x, *y, s);
    }
    s
}

/// `o = Σ_i p[i] · value row i`, position by position from zero, in the module's order.
pub(super) fn weighted_sum(p: &[f32], values: Rows<'_>, o: &mut [f32]) {
    assert!(p.len() == values.at.len() && values.hold(o.len()));
    o.fill(0.0);
    #[cfg(target_arch = "x86_64")]
    if vector() {
        // SAFETY: the CPU has AVX and FMA (checked); the rows were checked to lie inside the buffer.
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

    /// `super::scores`, eight keys at a time (a last group of fewer repeats its last key and
    /// keeps the real ones).
    ///
    /// # Safety
    /// The CPU must support AVX and FMA; `out` holds one value per key row and every row lies
    /// inside the buffer (`q.len()` values).
    #[target_feature(enable = "avx,fma")]
    pub unsafe fn scores(q: &[f32], keys: Rows<'_>, scale: f32, out: &mut [f32]) {
        let hd = q.len();
        let body = hd / 8 * 8;
        let (base, n) = (keys.buf.as_ptr(), keys.at.len());
        let mut i = 0;
        while i < n {
            let key = |j: usize| base.add(keys.at[(i + j).min(n - 1)]);
            let k: [*const f32; 8] =
                [key(0), key(1), key(2), key(3), key(4), key(5), key(6), key(7)];
            let mut acc = [_mm256_setzero_ps(); 8];
            for c in (0..body).step_by(8) {
                let qc = _mm256_loadu_ps(q.as_ptr().add(c));
                for j in 0..8 {
                    // SAFETY: c + 8 <= body <= hd, and each row's hd values lie inside the buffer.
                    acc[j] = _mm256_fmadd_ps(qc, _mm256_loadu_ps(k[j].add(c)), acc[j]);
                }
            }
            let mut sums = [0f32; 8];
            _mm256_storeu_ps(sums.as_mut_ptr(), lane_sums(acc));
            for j in 0..8.min(n - i) {
                let mut s = sums[j];
                for (c, &qc) in q.iter().enumerate().skip(body) {
                    s = qc.mul_add(*k[j].add(c), s);
                }
                out[i + j] = s * scale;
            }
            i += 8;
        }
    }

    /// Lane `j` of the result: the eight lanes of `acc[j]` added in order, 0 first (what
    /// `score_lanes` does to its accumulators): the 8×8 block transposed, then seven vector adds.
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
    /// The CPU must support AVX and FMA; `p` holds one weight per value row, each row inside the
    /// buffer (`o.len()` values).
    #[target_feature(enable = "avx,fma")]
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
                *oc = pt.mul_add(values.buf[at + c], *oc);
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
                *a = _mm256_fmadd_ps(pb, _mm256_loadu_ps(v.add(8 * j)), *a);
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

    /// The multiply-add the vector kernels use on this CPU (fused where it has FMA).
    fn fma(a: f32, b: f32, c: f32) -> f32 {
        if vector() {
            a.mul_add(b, c)
        } else {
            a * b + c
        }
    }

    /// Every score is the scalar order's (`score_lanes`) times the scale, bit for bit — so a key's
    /// score is the same alone or among 23 — at head sizes with and without a tail and key counts
    /// around the eight-key step; and within 1e-5 of the exact dot.
    #[test]
    fn scores_are_the_scalar_orders_bits() {
        for hd in [8, 12, 64, 80, 128, 256] {
            for n in [1, 7, 8, 9, 16, 23] {
                let q = gen(hd, 31, 1);
                let rows: Vec<Vec<f32>> = (0..n).map(|t| gen(hd + 3, 17, t * 5)).collect();
                let (buf, at) = laid_out(&rows);
                let mut got = vec![0f32; n];
                scores(&q, Rows { buf: &buf, at: &at }, 0.125, &mut got);
                for (t, g) in got.iter().enumerate() {
                    let want = score_lanes(&q, &rows[t][..hd], fma) * 0.125;
                    assert_eq!(g.to_bits(), want.to_bits(), "hd {hd} n {n} key {t}");
                    let exact: f64 =
                        q.iter().zip(&rows[t]).map(|(&a, &b)| a as f64 * b as f64).sum();
                    assert!((*g as f64 - exact * 0.125).abs() < 1e-5, "hd {hd} key {t}");
                }
            }
        }
    }

    /// Every output value is the position-by-position `o = p·v + o` from zero, bit for bit.
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
                        *o = fma(*pt, *x, *o);
                    }
                }
                for (c, (g, w)) in got.iter().zip(&want).enumerate() {
                    assert_eq!(g.to_bits(), w.to_bits(), "hd {hd} n {n} value {c}");
                }
            }
        }
    }
}
