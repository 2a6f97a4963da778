//! Paged KV storage, common to every backend: how a pool of blocks stores keys and values
//! (`KvLayout`: dtype, positions per block, blocks), where a sequence's positions live
//! (`KvSeq`: its block table), and the row codecs (f32, f16, bf16, and GGML's q8_0 / q4_0 blocks
//! of 32, quantized as ggml-quants.c's reference functions do). Quantized pools store each head's
//! keys and values rotated by a normalized Walsh-Hadamard transform (`rotation`, as llama.cpp does
//! for its quantized caches): it spreads an outlier over its chunk, so the 4/8-bit blocks lose
//! less; scores are unchanged when the query is rotated the same way (the transform is
//! orthonormal), and the attention output is rotated back (it is its own inverse).

use crate::backend::AttnShape;
use crate::error::{Error, Result};
use half::{bf16, f16};
use layerstream_types::DType;

pub use layerstream_types::dtype::{parse_kv_dtype, KV_DTYPES};

/// How one layer's pool stores keys and values: `blocks` blocks of `block` positions each, every
/// position one row of keys and one of values in `dtype`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KvLayout {
    pub dtype: DType,
    pub block: usize,
    pub blocks: usize,
}

impl KvLayout {
    /// Checks the dtype and block size (a power of two) and that a row of keys (every kv head) is
    /// whole quantization blocks.
    pub fn new(dtype: DType, block: usize, blocks: usize, shape: AttnShape) -> Result<KvLayout> {
        let bad = |msg: String| Err(Error::Shape { op: "kv_layout", msg });
        if !KV_DTYPES.contains(&dtype) {
            return bad(format!("{} cannot store keys and values", dtype.name()));
        }
        if !block.is_power_of_two() {
            return bad(format!("a KV block of {block} positions: must be a power of two"));
        }
        let kv_dim = shape.n_kv_heads * shape.head_dim;
        if !kv_dim.is_multiple_of(dtype.block_elems()) {
            return bad(format!(
                "{} stores groups of {}: a row of {kv_dim} keys (kv heads × head_dim) is not a multiple",
                dtype.name(),
                dtype.block_elems(),
            ));
        }
        let layout = KvLayout { dtype, block, blocks };
        // Sizes come from an assignment: a pool whose bytes do not fit an address is an error here,
        // never a wrapped allocation later.
        let bytes =
            blocks.checked_mul(block).and_then(|p| p.checked_mul(layout.row_stride(kv_dim)));
        if bytes.is_none() {
            return bad(format!(
                "a KV pool of {blocks} blocks of {block} positions does not fit in memory"
            ));
        }
        Ok(layout)
    }

    /// Positions the pool holds.
    pub fn positions(&self) -> usize {
        self.blocks * self.block
    }

    /// Bytes between stored rows of `kv_dim` values (whole 4-byte words).
    pub fn row_stride(&self, kv_dim: usize) -> usize {
        self.dtype.row_bytes(kv_dim).unwrap_or(kv_dim.saturating_mul(4)).div_ceil(4) * 4
    }
}

/// One sequence's place in a pool: its block table (block `i` holds positions
/// `i * block .. (i + 1) * block`) and how many positions it had cached before this call; for a
/// token tree, the position its ancestor masks' bit 0 names (`tree_from` ≤ `start`: a tree whose
/// first rows were cached by an earlier call — a draft model growing its tree — else `start`).
#[derive(Debug, Clone, Copy)]
pub struct KvSeq<'a> {
    pub table: &'a [u32],
    pub start: usize,
    pub tree_from: usize,
}

impl<'a> KvSeq<'a> {
    /// New rows after `start` cached positions; a tree among the new rows only.
    pub fn new(table: &'a [u32], start: usize) -> Self {
        KvSeq { table, start, tree_from: start }
    }
}

impl KvSeq<'_> {
    /// A tree's rows cached before this call (`start − tree_from`), with its masks for `check`.
    pub fn tree<'t>(&self, masks: Option<&'t [u64]>) -> Result<Option<(&'t [u64], usize)>> {
        let Some(m) = masks else { return Ok(None) };
        let cached = self.start.checked_sub(self.tree_from);
        crate::error::ensure(cached.is_some(), "attention", || {
            format!("a tree from position {} after only {} cached", self.tree_from, self.start)
        })?;
        Ok(Some((m, cached.unwrap_or(0))))
    }

    /// Checks that the table covers `start + m` positions with blocks of the pool.
    pub fn check(&self, layout: &KvLayout, m: usize) -> Result<()> {
        let need = (self.start + m).div_ceil(layout.block);
        crate::error::ensure(
            self.table.len() >= need
                && self.table[..need].iter().all(|&b| (b as usize) < layout.blocks),
            "attention",
            || {
                format!(
                    "a block table of {} blocks ({:?}…) for positions up to {} in a pool of {} blocks of {}",
                    self.table.len(),
                    &self.table[..self.table.len().min(8)],
                    self.start + m,
                    layout.blocks,
                    layout.block
                )
            },
        )
    }

    /// The pool row of position `t` (block × block size + offset).
    pub fn slot(&self, t: usize, block: usize) -> usize {
        self.table[t / block] as usize * block + t % block
    }
}

/// The chunk size of the Hadamard rotation a pool of `dtype` applies to heads of `head_dim` (0:
/// none): for the 8/4-bit dtypes, the largest power of two dividing `head_dim`, at most 64.
pub fn rotation(dtype: DType, head_dim: usize) -> usize {
    if !dtype.is_quantized() || head_dim == 0 {
        return 0;
    }
    (head_dim & head_dim.wrapping_neg()).min(64)
}

/// Applies the normalized Walsh-Hadamard transform to every chunk of `n` values of `x` in place
/// (`n` a power of two; it is orthonormal and its own inverse).
pub fn hadamard(x: &mut [f32], n: usize) {
    if n < 2 {
        return;
    }
    let scale = 1.0 / (n as f32).sqrt();
    for c in x.chunks_exact_mut(n) {
        let mut h = 1;
        while h < n {
            for i in (0..n).step_by(2 * h) {
                for j in i..i + h {
                    let (a, b) = (c[j], c[j + h]);
                    (c[j], c[j + h]) = (a + b, a - b);
                }
            }
            h *= 2;
        }
        c.iter_mut().for_each(|v| *v *= scale);
    }
}

/// Stores `x` as one row of `dtype` at the start of `out`.
pub fn store_row(dtype: DType, x: &[f32], out: &mut [u8]) {
    match dtype {
        DType::F32 => x
            .iter()
            .zip(out.chunks_exact_mut(4))
            .for_each(|(v, o)| o.copy_from_slice(&v.to_le_bytes())),
        DType::F16 => x
            .iter()
            .zip(out.chunks_exact_mut(2))
            .for_each(|(v, o)| o.copy_from_slice(&f16::from_f32(*v).to_le_bytes())),
        DType::Bf16 => x
            .iter()
            .zip(out.chunks_exact_mut(2))
            .for_each(|(v, o)| o.copy_from_slice(&bf16::from_f32(*v).to_le_bytes())),
        DType::Q8_0 => {
            for (g, o) in x.chunks_exact(32).zip(out.chunks_exact_mut(34)) {
                let amax = g.iter().fold(0f32, |a, v| a.max(v.abs()));
                let d = amax / 127.0;
                let id = if d != 0.0 { 1.0 / d } else { 0.0 };
                o[..2].copy_from_slice(&f16::from_f32(d).to_le_bytes());
                for (q, v) in o[2..].iter_mut().zip(g) {
                    *q = (v * id).round() as i8 as u8;
                }
            }
        }
        DType::Q4_0 => {
            for (g, o) in x.chunks_exact(32).zip(out.chunks_exact_mut(18)) {
                // The value of largest magnitude, sign kept, maps to -8.
                let max = g.iter().fold(0f32, |m, &v| if v.abs() > m.abs() { v } else { m });
                let d = max / -8.0;
                let id = if d != 0.0 { 1.0 / d } else { 0.0 };
                o[..2].copy_from_slice(&f16::from_f32(d).to_le_bytes());
                let q = |v: f32| ((v * id + 8.5) as i32).clamp(0, 15) as u8;
                for j in 0..16 {
                    o[2 + j] = q(g[j]) | q(g[j + 16]) << 4;
                }
            }
        }
        other => unreachable!("KvLayout::new refuses {other:?}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::quant::dequant_row;

    /// The rotation is orthonormal and its own inverse: dot products are kept, twice is identity.
    #[test]
    fn hadamard_keeps_dots_and_undoes_itself() {
        let a: Vec<f32> = (0..128).map(|i| ((i * 13) % 7) as f32 - 3.0).collect();
        let b: Vec<f32> = (0..128).map(|i| ((i * 5) % 11) as f32 * 0.5).collect();
        let (mut ra, mut rb) = (a.clone(), b.clone());
        hadamard(&mut ra, 64);
        hadamard(&mut rb, 64);
        let dot = |x: &[f32], y: &[f32]| x.iter().zip(y).map(|(p, q)| p * q).sum::<f32>();
        assert!((dot(&a, &b) - dot(&ra, &rb)).abs() < 1e-3);
        hadamard(&mut ra, 64);
        assert!(ra.iter().zip(&a).all(|(x, y)| (x - y).abs() < 1e-5));
        assert_eq!((rotation(DType::Q4_0, 64), rotation(DType::Q8_0, 80)), (64, 16));
        assert_eq!((rotation(DType::F16, 64), rotation(DType::Q4_0, 256)), (0, 64));
    }

    /// A row with an outlier (what keys have) loses less through q4_0 and q8_0 rotated: the
    /// outlier no longer sets the scale of its whole block alone.
    #[test]
    fn rotation_lowers_the_error_of_an_outlier_row() {
        let mut x: Vec<f32> = (0..64).map(|i| ((i * 29) % 13) as f32 * 0.05 - 0.3).collect();
        x[5] = 9.0;
        for d in [DType::Q4_0, DType::Q8_0] {
            let err = |rot: usize| {
                let mut r = x.clone();
                hadamard(&mut r, rot);
                let mut bytes = vec![0u8; d.row_bytes(64).unwrap()];
                store_row(d, &r, &mut bytes);
                let mut y = vec![0f32; 64];
                crate::quant::dequant_row(d, &bytes, &mut y);
                hadamard(&mut y, rot);
                x.iter().zip(&y).map(|(a, b)| (a - b) * (a - b)).sum::<f32>()
            };
            assert!(err(64) < 0.5 * err(0), "{d:?}: rotated {} vs plain {}", err(64), err(0));
        }
    }

    /// Every dtype round-trips within its precision (f32 exactly); q4_0 keeps the largest value.
    #[test]
    fn rows_round_trip_within_their_precision() {
        let x: Vec<f32> = (0..64).map(|i| ((i * 37) % 23) as f32 * 0.17 - 1.9).collect();
        for (d, tol) in [
            (DType::F32, 0.0),
            (DType::F16, 1e-3),
            (DType::Bf16, 8e-3),
            (DType::Q8_0, 8e-3),
            (DType::Q4_0, 0.15),
        ] {
            let mut bytes = vec![0u8; d.row_bytes(64).unwrap()];
            store_row(d, &x, &mut bytes);
            let mut y = vec![0f32; 64];
            dequant_row(d, &bytes, &mut y);
            let worst = x.iter().zip(&y).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
            assert!(worst <= tol * 2.0, "{d:?}: {worst}");
        }
    }

    /// Layouts refuse what cannot be stored, naming it.
    #[test]
    fn layouts_name_what_is_wrong() {
        let s = AttnShape::new(4, 2, 64);
        assert!(KvLayout::new(DType::Q4_0, 16, 8, s).is_ok());
        let e = |r: Result<KvLayout>| r.unwrap_err().to_string();
        assert!(e(KvLayout::new(DType::F16, 12, 8, s)).contains("power of two"));
        assert!(e(KvLayout::new(DType::Q4K, 16, 8, s)).contains("q4_k"));
        assert!(e(KvLayout::new(DType::Q8_0, 16, 8, AttnShape::new(2, 1, 48)))
            .contains("a row of 48 keys"));
        assert!(e(KvLayout::new(DType::F32, 16, usize::MAX / 16, s)).contains("does not fit"));
        assert!(parse_kv_dtype("q5_0").unwrap_err().contains("f32, f16, bf16, q8_0, q4_0"));
        assert_eq!(parse_kv_dtype("bf16"), Ok(DType::Bf16));
    }

    /// A table that does not cover the positions, or names a block outside the pool, is refused.
    #[test]
    fn tables_must_cover_the_positions() {
        let l = KvLayout { dtype: DType::F32, block: 4, blocks: 3 };
        assert!(KvSeq::new(&[2, 0], 5).check(&l, 3).is_ok());
        assert!(KvSeq::new(&[2, 0], 5).check(&l, 4).is_err());
        assert!(KvSeq::new(&[3], 0).check(&l, 1).is_err());
        assert_eq!(KvSeq::new(&[2, 0], 0).slot(5, 4), 1);
    }
}
