//! A feed-forward block's gated activation for the CPU backend — `silu(gate)·up` and
//! `gelu_tanh(gate)·up` — eight values at a time where the CPU has AVX2 and FMA, split across the
//! compute pool from `SPLIT` values on (a prefill's [512, 2048] is 64 tasks; a decode step's row is
//! one). Both are x·σ(z)·up: SiLU with z = x, GELU's tanh form with z = 2y since
//! 0.5·(1 + tanh y) = σ(2y) (no cancellation where tanh y nears −1), σ through `softmax8`'s
//! vector exp (within 2 ulp). Each output is a function of its own two inputs only, computed the
//! same way wherever it falls (a last part of fewer than eight values is padded to eight), so a
//! row's values do not depend on what else its step holds. Elsewhere the same form with libm's exp.

/// Which activation gates `up`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Gate {
    /// `gate·σ(gate)` (Llama, Qwen, SmolLM2…).
    Silu,
    /// GELU, tanh approximation (Gemma's GeGLU).
    GeluTanh,
}

/// Values per task of the compute pool (a multiple of eight); RMSNorm's tasks take about as many.
pub(super) const SPLIT: usize = 16 * 1024;

/// `act(gate[i])·up[i]` for every i (`gate` and `up` the same length).
pub(super) fn gated(kind: Gate, gate: &[f32], up: &[f32]) -> Vec<f32> {
    assert_eq!(gate.len(), up.len(), "gated: gate and up differ in length");
    let mut out = vec![0f32; gate.len()];
    if gate.len() <= SPLIT {
        part(kind, gate, up, &mut out);
    } else {
        use rayon::prelude::*;
        out.par_chunks_mut(SPLIT)
            .zip(gate.par_chunks(SPLIT).zip(up.par_chunks(SPLIT)))
            .for_each(|(o, (g, u))| part(kind, g, u, o));
    }
    out
}

/// One task's values.
fn part(kind: Gate, gate: &[f32], up: &[f32], out: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    if super::attend::vector() && std::is_x86_feature_detected!("avx2") {
        // SAFETY: the CPU has AVX2 and FMA (checked); the three slices have one length (`gated`).
        return unsafe { avx2::part(kind, gate, up, out) };
    }
    for ((o, &g), &u) in out.iter_mut().zip(gate).zip(up) {
        *o = scalar(kind, g) * u;
    }
}

/// The activation with libm's exp, in the vector path's form.
fn scalar(kind: Gate, x: f32) -> f32 {
    x / (1.0 + (-z(kind, x)).exp())
}

/// σ's argument: x for SiLU; 2y for GELU's tanh form, y = √(2/π)·(x + 0.044715·x³).
fn z(kind: Gate, x: f32) -> f32 {
    match kind {
        Gate::Silu => x,
        Gate::GeluTanh => TWO_K * (0.044715 * (x * x * x) + x),
    }
}

/// 2·√(2/π).
const TWO_K: f32 = 2.0 * 0.797_884_6;

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use super::{Gate, TWO_K};
    use crate::cpu::softmax8::avx2::exp;
    use std::arch::x86_64::*;

    /// `super::part`, eight values at a time.
    ///
    /// # Safety
    /// The CPU must support AVX2 and FMA; `gate`, `up` and `out` have one length.
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn part(kind: Gate, gate: &[f32], up: &[f32], out: &mut [f32]) {
        let n = gate.len();
        let whole = n - n % 8;
        let (g, u, o) = (gate.as_ptr(), up.as_ptr(), out.as_mut_ptr());
        for c in (0..whole).step_by(8) {
            let v = eight(kind, _mm256_loadu_ps(g.add(c)), _mm256_loadu_ps(u.add(c)));
            _mm256_storeu_ps(o.add(c), v);
        }
        if whole < n {
            let (mut gt, mut ut, mut ot) = ([0f32; 8], [0f32; 8], [0f32; 8]);
            gt[..n - whole].copy_from_slice(&gate[whole..]);
            ut[..n - whole].copy_from_slice(&up[whole..]);
            let v = eight(kind, _mm256_loadu_ps(gt.as_ptr()), _mm256_loadu_ps(ut.as_ptr()));
            _mm256_storeu_ps(ot.as_mut_ptr(), v);
            out[whole..].copy_from_slice(&ot[..n - whole]);
        }
    }

    /// x·σ(z)·u for eight values: z = x (SiLU) or 2·√(2/π)·(x + 0.044715·x³) (GELU, tanh form).
    #[inline(always)]
    unsafe fn eight(kind: Gate, x: __m256, u: __m256) -> __m256 {
        let z = match kind {
            Gate::Silu => x,
            Gate::GeluTanh => {
                let cube = _mm256_mul_ps(_mm256_mul_ps(x, x), x);
                let inner = _mm256_fmadd_ps(_mm256_set1_ps(0.044715), cube, x);
                _mm256_mul_ps(_mm256_set1_ps(TWO_K), inner)
            }
        };
        let e = exp(_mm256_sub_ps(_mm256_setzero_ps(), z));
        let s = _mm256_div_ps(x, _mm256_add_ps(_mm256_set1_ps(1.0), e));
        _mm256_mul_ps(s, u)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// σ in f64.
    fn sigma(z: f64) -> f64 {
        1.0 / (1.0 + (-z).exp())
    }

    /// The activation in f64, and how many ulp of f32 its computation in f32 may be off: a few
    /// for σ's exp, divide and products, plus GELU's z = 2y rounded in f32 (a relative error δ in
    /// z is z·δ in e^−z, so 3·|z| ulp more).
    fn exact(kind: Gate, x: f64) -> (f64, f64) {
        match kind {
            Gate::Silu => (x * sigma(x), 6.0),
            Gate::GeluTanh => {
                let y = (2.0 / std::f64::consts::PI).sqrt() * (x + 0.044715 * x * x * x);
                // 0.5·x·(1 + tanh y) as f64 writes it cancels to 0 below y ≈ −19; x·σ(2y) is
                // the same function without the cancellation.
                assert!(y.abs() > 10.0 || (0.5 * (1.0 + y.tanh()) - sigma(2.0 * y)).abs() < 1e-15);
                (x * sigma(2.0 * y), 6.0 + 6.0 * y.abs())
            }
        }
    }

    /// Over −90..90 (past where exp over- and underflows) and around 0, both activations are within
    /// their f32 computation's error of f64's value times up (or within 1e-30 where the value is
    /// that small), lengths that end mid-chunk give every value as a whole chunk does, and a split
    /// across the pool gives the bits of one task.
    #[test]
    fn gated_activations_match_f64_at_every_length() {
        let xs: Vec<f32> = (0..40_001)
            .map(|i| {
                let t = i as f32 / 40_000.0 * 2.0 - 1.0; // -1..1
                if i % 2 == 0 {
                    90.0 * t
                } else {
                    1e-3 * t * t * t
                }
            })
            .collect();
        let ups: Vec<f32> = (0..xs.len()).map(|i| 0.5 + (i % 7) as f32 * 0.25).collect();
        for kind in [Gate::Silu, Gate::GeluTanh] {
            let got = gated(kind, &xs, &ups);
            assert!(xs.len() > SPLIT, "the length must split across the pool");
            for ((&x, &u), &g) in xs.iter().zip(&ups).zip(&got) {
                let (want, ulps) = exact(kind, x as f64);
                let want = want * u as f64;
                let err = (g as f64 - want).abs();
                assert!(
                    err <= ulps * f32::EPSILON as f64 * want.abs() || err <= 1e-30,
                    "{kind:?}({x})·{u} = {g}, f64 says {want}"
                );
            }
            for n in [1, 7, 8, 9, 15, 17, 100] {
                let short = gated(kind, &xs[..n], &ups[..n]);
                assert_eq!(
                    short.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                    got[..n].iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                    "{kind:?}: {n} values"
                );
            }
            let mut one = vec![0f32; xs.len()];
            part(kind, &xs, &ups, &mut one);
            assert!(one.iter().zip(&got).all(|(a, b)| a.to_bits() == b.to_bits()), "{kind:?}");
        }
    }

    /// NaN in gives NaN out; GELU is 0 at 0 and ≈ x far above 0, SiLU(1) is σ(1).
    #[test]
    fn gated_activations_keep_nan_and_known_values() {
        let x = [f32::NAN, 0.0, 1.0, 20.0];
        let ones = [1.0; 4];
        for kind in [Gate::Silu, Gate::GeluTanh] {
            let o = gated(kind, &x, &ones);
            assert!(o[0].is_nan() && o[1] == 0.0 && (o[3] - 20.0).abs() < 1e-5, "{kind:?}: {o:?}");
        }
        assert!((gated(Gate::Silu, &x, &ones)[2] - 0.731_058_6).abs() < 1e-6);
        assert!((gated(Gate::GeluTanh, &x, &ones)[2] - 0.841_192).abs() < 1e-6);
    }
}
