//! The 8-bit path for steps of many activation rows (prefill, large batches) with AVX-512 VNNI:
//! sixteen activation rows side by side in the lanes of one register, so one `vpdpbusd` multiplies
//! four values of a weight unit (broadcast) with the same four values of sixteen rows, and a weight
//! row is unpacked once per step (`int8_units`) however many rows there are.
//!
//! Each output is computed with the arithmetic of the one-row and few-row kernels (`int8_avx2`,
//! `int8_batch`, `int8_kq_avx2`) — the same exact integer sums of four values, the same f32
//! products and fused adds in the same order, the same final sum of eight partial sums — so a
//! sequence's row has the same bits whatever its step holds: one row or three hundred, a prefill
//! or a decode, alone or beside other sequences. Only the order in which outputs are computed
//! differs.

use super::int8::Q8Row;
use super::int8_units::{form, unpack, Form, Unit};
use layerstream_types::DType;
use std::arch::x86_64::*;

/// Activation rows per group (the lanes of a 512-bit register of i32).
pub const LANES: usize = 16;

/// Weight rows unpacked at a time (8 rows of 4096 values: 96 KiB of units).
const TILE: usize = 8;

/// Sixteen lanes of four bytes.
#[derive(Clone, Copy)]
#[repr(C, align(64))]
struct Bytes64([u8; 64]);

/// Sixteen lanes of f32.
#[derive(Clone, Copy)]
#[repr(C, align(64))]
struct F32x16([f32; 16]);

/// Up to sixteen quantized activation rows interleaved: for unit i and t in 0..8, the four values
/// 4t..4t+4 of each row as unsigned bytes (q + 128) in its lane; per unit the rows' scales and
/// d·Σq. Rows past the real ones are zeros with scale 0.
struct Group {
    rows: usize,
    x: Vec<Bytes64>,
    dx: Vec<F32x16>,
    ds: Vec<F32x16>,
}

/// Quantized activation rows laid out for `dot_lanes`, built once per step.
pub struct Q8Lanes {
    groups: Vec<Group>,
    units: usize,
}

impl Q8Lanes {
    /// Interleaves `xs` (each of `units` 32-value blocks at least) in groups of sixteen rows.
    pub fn new(xs: &[Q8Row], units: usize) -> Q8Lanes {
        let groups = xs
            .chunks(LANES)
            .map(|rows| {
                let mut g = Group {
                    rows: rows.len(),
                    x: vec![Bytes64([128; 64]); units * 8],
                    dx: vec![F32x16([0.0; 16]); units],
                    ds: vec![F32x16([0.0; 16]); units],
                };
                for (lane, row) in rows.iter().enumerate() {
                    for i in 0..units {
                        let (d, q, ds) = row.block(i);
                        g.dx[i].0[lane] = d;
                        g.ds[i].0[lane] = ds;
                        for t in 0..8 {
                            for (b, &v) in g.x[8 * i + t].0[4 * lane..4 * lane + 4]
                                .iter_mut()
                                .zip(&q[4 * t..4 * t + 4])
                            {
                                *b = (v as u8) ^ 0x80;
                            }
                        }
                    }
                }
                g
            })
            .collect();
        Q8Lanes { groups, units }
    }

    /// Activation rows held.
    pub fn rows(&self) -> usize {
        self.groups.iter().map(|g| g.rows).sum()
    }

    /// 32-value units per row.
    pub fn units(&self) -> usize {
        self.units
    }
}

/// Whether this CPU runs `dot_lanes` (AVX-512 F/BW/VL with VNNI, and the AVX2 set the weight
/// unpacking uses; detected once).
pub fn available() -> bool {
    static DETECTED: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *DETECTED.get_or_init(|| {
        super::int8::simd()
            && std::is_x86_feature_detected!("avx512f")
            && std::is_x86_feature_detected!("avx512bw")
            && std::is_x86_feature_detected!("avx512vl")
            && std::is_x86_feature_detected!("avx512vnni")
    })
}

/// `out[j·m + a]` = weight row `j` of `w` (rows of `rb` bytes of `dtype`) · activation row `a` of
/// `lanes` (m rows), with the bits `int8::dot_rows` gives for any subset of those rows.
///
/// # Safety
/// `available()` must be true; `w` must hold `out.len() / m` rows of `rb` bytes, whole blocks of
/// `dtype` (one `int8::supports`) spanning `lanes.units` units of 32 values.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
pub unsafe fn dot_lanes(dtype: DType, w: &[u8], rb: usize, lanes: &Q8Lanes, out: &mut [f32]) {
    let m = lanes.rows();
    let u = lanes.units;
    let f = form(dtype);
    // A tile of weight rows unpacked at a time, then each group of activation rows against every
    // row of the tile: a group (units × 640 bytes) stays in cache for the tile's rows instead of
    // all groups streaming past each weight row (at 512 rows of 4096 values they are 2.6 MB).
    let mut units = vec![Unit::default(); u * TILE];
    for (t0, o) in out.chunks_mut(m * TILE).enumerate() {
        let rows = o.len() / m;
        for (r, us) in units.chunks_exact_mut(u).take(rows).enumerate() {
            unpack(dtype, w.as_ptr().add((t0 * TILE + r) * rb), us);
        }
        let mut a0 = 0;
        for g in &lanes.groups {
            for (r, us) in units.chunks_exact(u).take(rows).enumerate() {
                let sums = match f {
                    Form::Plain => group::<0>(us, g),
                    Form::Kquant45 => group::<1>(us, g),
                    Form::Scaled16 => group::<2>(us, g),
                    Form::Q2k => group::<3>(us, g),
                };
                o[r * m + a0..r * m + a0 + g.rows].copy_from_slice(&sums[..g.rows]);
            }
            a0 += g.rows;
        }
    }
}

/// One weight row's units against one group of rows; `FORM` as `Form` in declaration order.
#[inline(always)]
unsafe fn group<const FORM: u8>(units: &[Unit], g: &Group) -> [f32; LANES] {
    let zero = _mm512_setzero_ps();
    let mut acc = [zero; 8];
    let mut off = [zero; 8];
    let ones = _mm512_set1_epi32(0x0101_0101);
    for (i, u) in units.iter().enumerate() {
        let x = g.x.as_ptr().add(8 * i);
        let dx = _mm512_load_ps(g.dx[i].0.as_ptr());
        let ds = _mm512_load_ps(g.ds[i].0.as_ptr());
        let vp = u.v.as_ptr() as *const i32;
        let xv: [__m512i; 8] =
            std::array::from_fn(|t| _mm512_load_si512((*x.add(t)).0.as_ptr() as *const __m512i));
        let p: [__m512i; 8] = std::array::from_fn(|t| {
            let wt = _mm512_set1_epi32(std::ptr::read_unaligned(vp.add(t)));
            _mm512_dpbusd_epi32(_mm512_set1_epi32(u.bias[t]), xv[t], wt)
        });
        match FORM {
            0 | 1 => {
                let f = _mm512_mul_ps(_mm512_set1_ps(u.d), dx);
                for t in 0..8 {
                    acc[t] = _mm512_fmadd_ps(f, _mm512_cvtepi32_ps(p[t]), acc[t]);
                }
                let o = if FORM == 0 { 0 } else { i % 8 };
                off[o] = _mm512_fmadd_ps(_mm512_set1_ps(u.c), ds, off[o]);
            }
            2 => {
                let f = _mm512_mul_ps(_mm512_set1_ps(u.d), dx);
                let (sa, sb) = (_mm512_set1_epi32(u.sa), _mm512_set1_epi32(u.sb));
                for t in 0..8 {
                    let s = _mm512_mullo_epi32(p[t], if t < 4 { sa } else { sb });
                    acc[t] = _mm512_fmadd_ps(f, _mm512_cvtepi32_ps(s), acc[t]);
                }
            }
            _ => {
                let (d, mdmin) = (_mm512_set1_ps(u.d), _mm512_set1_ps(u.c));
                for t in 0..8 {
                    let (sc, mn) = if t < 4 { (u.sa, u.ma) } else { (u.sb, u.mb) };
                    // Σ of the four activations: Σ (q + 128) − 512.
                    let sx = _mm512_dpbusd_epi32(_mm512_set1_epi32(-512), xv[t], ones);
                    let iq = _mm512_mullo_epi32(p[t], _mm512_set1_epi32(sc));
                    let im = _mm512_mullo_epi32(sx, _mm512_set1_epi32(mn));
                    let tt = _mm512_fmadd_ps(
                        mdmin,
                        _mm512_cvtepi32_ps(im),
                        _mm512_mul_ps(d, _mm512_cvtepi32_ps(iq)),
                    );
                    acc[t] = _mm512_fmadd_ps(dx, tt, acc[t]);
                }
            }
        }
    }
    if FORM == 1 {
        for t in 0..8 {
            acc[t] = _mm512_add_ps(acc[t], off[t]);
        }
    }
    // `int8_batch::hsum`'s order: ((v0 + v4) + (v2 + v6)) + ((v1 + v5) + (v3 + v7)).
    let h = |a: usize, b: usize| _mm512_add_ps(acc[a], acc[b]);
    let sum = _mm512_add_ps(_mm512_add_ps(h(0, 4), h(2, 6)), _mm512_add_ps(h(1, 5), h(3, 7)));
    let sum = if FORM == 0 { _mm512_add_ps(sum, off[0]) } else { sum };
    let mut r = [0f32; LANES];
    _mm512_storeu_ps(r.as_mut_ptr(), sum);
    r
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cpu::int8::{dot_rows, dot_scalar, quantize_row, supports, Acts};
    use crate::quant::{dequant_row, dot as f32_dot};

    /// Every format with an 8-bit dot, with a width of an odd number of its blocks.
    const TYPES: [(DType, usize); 13] = [
        (DType::Q8_0, 32 * 7),
        (DType::Q4_0, 32 * 9),
        (DType::Q4_1, 32 * 5),
        (DType::Q5_0, 32 * 11),
        (DType::Q5_1, 32 * 3),
        (DType::Mxfp4, 32 * 7),
        (DType::Int8B128, 128 * 3),
        (DType::Int4G128, 128 * 5),
        (DType::Q2K, 256 * 3),
        (DType::Q3K, 256),
        (DType::Q4K, 256 * 3),
        (DType::Q5K, 256 * 5),
        (DType::Q6K, 256 * 3),
    ];

    /// Rows of activations with different magnitudes and signs (row a scaled by a − 4.5).
    fn activations(m: usize, k: usize) -> Vec<f32> {
        (0..m * k)
            .map(|i| {
                let (a, t) = (i / k, i % k);
                ((t * 37 + a * 11) % 101) as f32 * 0.021 * (a % 9) as f32 - 0.5 * (a % 5) as f32
            })
            .collect()
    }

    /// For 9, 16, 63, 64 and 300 rows and 5 weight rows of each format: every output of the
    /// many-row kernel has the bits the one-row kernel gives that row alone (a sequence's result
    /// does not depend on what its step holds), matches the scalar reference to rounding and the
    /// f32 dot of the dequantized weights within 1% of Σ|w·x|.
    #[test]
    #[cfg_attr(not(have_avx512_vnni), ignore = "this CPU lacks AVX-512 VNNI")]
    fn many_rows_give_each_rows_bits_alone_and_match_the_references() {
        assert!(available(), "the build saw AVX-512 VNNI in /proc/cpuinfo, the CPU denies it");
        for (dtype, k) in TYPES {
            assert!(supports(dtype));
            let n = 5;
            let w = layerstream_types::random::Rng::new(21).tensor(dtype, &[n, k]).unwrap();
            let rb = w.len() / n;
            let mut deq = vec![0f32; n * k];
            for (o, r) in deq.chunks_exact_mut(k).zip(w.chunks_exact(rb)) {
                dequant_row(dtype, r, o);
            }
            for m in [9, 16, 63, 64, 300] {
                let x = activations(m, k);
                let Acts::Lanes(lanes) = crate::cpu::int8::quantize(&x, k, m) else {
                    panic!("{m} rows were not laid out in lanes");
                };
                let mut got = vec![0f32; n * m];
                // SAFETY: available() holds; w holds n rows of rb bytes spanning k values.
                unsafe { dot_lanes(dtype, &w, rb, &lanes, &mut got) };
                for a in 0..m {
                    let row = &x[a * k..(a + 1) * k];
                    let xq = quantize_row(row);
                    let mut alone = vec![0f32; n];
                    dot_rows(dtype, &w, rb, std::slice::from_ref(&xq), &mut alone);
                    for j in 0..n {
                        let g = got[j * m + a];
                        assert_eq!(
                            g.to_bits(),
                            alone[j].to_bits(),
                            "{dtype} m={m} row {a} col {j}"
                        );
                        let reference = dot_scalar(dtype, &w[j * rb..(j + 1) * rb], &xq);
                        let wf = &deq[j * k..(j + 1) * k];
                        let scale: f32 = wf.iter().zip(row).map(|(p, q)| (p * q).abs()).sum();
                        let exact = f32_dot(wf, row);
                        // The reference adds the blocks in another order: rounding of Σ|w·x|.
                        assert!(
                            (g - reference).abs() <= 1e-5 * scale.max(1.0),
                            "{dtype} m={m}: {g} vs scalar {reference}"
                        );
                        assert!(
                            (g - exact).abs() <= 0.01 * scale.max(1e-3),
                            "{dtype}: {g} vs f32 {exact}"
                        );
                    }
                }
            }
        }
    }
}
