//! Random inputs shared by the kernel tests (on a GPU and under host emulation): a small seeded
//! generator, valid quantized weight rows, and the relative error ‖got − want‖ / ‖want‖.

use crate::quant::tests::sanitize;
use layerstream_types::DType;

/// Every stored dtype the kernels handle.
pub(crate) const DTYPES: [DType; 21] = DType::ALL;

/// A linear congruential generator: deterministic, no dependency.
pub(crate) struct Rng(pub(crate) u64);

impl Rng {
    pub(crate) fn u32(&mut self) -> u32 {
        self.0 = self.0.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        (self.0 >> 33) as u32
    }
    /// Uniform in [-1, 1].
    pub(crate) fn f(&mut self) -> f32 {
        self.u32() as f32 / u32::MAX as f32 * 2.0 - 1.0
    }
    pub(crate) fn vec(&mut self, n: usize) -> Vec<f32> {
        (0..n).map(|_| self.f()).collect()
    }
}

/// ‖a − b‖ / ‖b‖; panics if `a` holds a NaN or infinity.
pub(crate) fn rel(a: &[f32], b: &[f32]) -> f64 {
    assert_eq!(a.len(), b.len());
    assert!(a.iter().all(|v| v.is_finite()), "non-finite kernel output");
    let num: f64 = a.iter().zip(b).map(|(x, y)| ((x - y) as f64).powi(2)).sum();
    let den: f64 = b.iter().map(|y| (*y as f64).powi(2)).sum();
    (num / den.max(1e-30)).sqrt()
}

/// `rows` random rows of `cols` elements stored as `dtype`, with valid (finite) scales.
pub(crate) fn weight_bytes(dtype: DType, rows: usize, cols: usize, rng: &mut Rng) -> Vec<u8> {
    let rb = dtype.row_bytes(cols).unwrap();
    let mut bytes: Vec<u8> = (0..rows * rb).map(|_| rng.u32() as u8).collect();
    for row in bytes.chunks_exact_mut(rb) {
        sanitize(dtype, row, &mut || rng.u32());
    }
    bytes
}

/// A token tree's ancestor masks (bit j of row i: row j is i or one of its ancestors) from each
/// row's parent.
pub(crate) fn ancestor_masks(parents: &[Option<usize>]) -> Vec<u64> {
    (0..parents.len())
        .map(|i| {
            let (mut a, mut n) = (0u64, Some(i));
            while let Some(x) = n {
                a |= 1 << x;
                n = parents[x];
            }
            a
        })
        .collect()
}
