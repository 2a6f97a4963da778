//! The CPU backend: f32 activations in `Vec`s, weights kept in their stored format and dequantized
//! on the fly, GEMM through the `gemm` crate, rayon across the cores.

mod attend;
mod attention;
mod gated;
mod head_screen;
pub mod heap;
pub mod int8;
#[cfg(target_arch = "x86_64")]
pub mod int8_amx;
#[cfg(target_arch = "x86_64")]
mod int8_avx2;
#[cfg(target_arch = "x86_64")]
mod int8_batch;
#[cfg(target_arch = "x86_64")]
mod int8_few;
mod int8_kq;
#[cfg(target_arch = "x86_64")]
mod int8_kq_avx2;
#[cfg(target_arch = "x86_64")]
pub mod int8_lanes;
#[cfg(target_arch = "x86_64")]
mod int8_quant;
#[cfg(target_arch = "x86_64")]
mod int8_regs;
#[cfg(target_arch = "x86_64")]
mod int8_units;
pub mod isa;
mod matmul;
mod pool;
pub mod rows;
mod rows_q8;
mod softmax8;
pub mod threads;

pub use attention::CpuKv;
pub use matmul::{gemm_f32, matmul};
pub use pool::Blob as CpuBlob;

use crate::backend::{AttnShape, Backend};
use crate::error::{ensure, Error, Result};
use crate::kv::{KvLayout, KvSeq};
use crate::quant::dequant_row;
use crate::rope::RopeTable;
use layerstream_types::DType;
use std::ops::Range;
use std::sync::Arc;

/// Activations on the CPU.
#[derive(Debug, Clone, PartialEq)]
pub struct CpuTensor {
    pub data: Vec<f32>,
    pub rows: usize,
    pub cols: usize,
}

/// A weight on the CPU: its stored bytes (a range of the layer file's blob it came from, shared, not
/// copied), or an f32 copy for float and 1-D tensors.
#[derive(Debug, Clone)]
pub struct CpuWeight {
    pub dtype: DType,
    pub rows: usize,
    pub cols: usize,
    raw: Option<(Arc<CpuBlob>, Range<usize>)>,
    f32: Option<Vec<f32>>,
    /// Each row's Σ|w| per 32 values, for a greedy head's screening (`head_screen`), computed on
    /// first use.
    norms: std::sync::OnceLock<head_screen::Norms>,
    /// Greedy steps left to skip the screen after one found a crowd of candidates.
    screen_skip: Arc<std::sync::atomic::AtomicU32>,
}

impl CpuWeight {
    /// The weight's bytes in their stored format, where it keeps them (not for the f32 copies of
    /// 1-D and f32 weights): where they lie, a file's own memory or a loader slot.
    pub fn stored(&self) -> Option<&[u8]> {
        self.raw.is_some().then(|| self.raw())
    }

    /// Dequantizes row `r`.
    pub fn row(&self, r: usize) -> Vec<f32> {
        if let Some(f) = &self.f32 {
            return f[r * self.cols..(r + 1) * self.cols].to_vec();
        }
        let raw = self.raw();
        let rb = raw.len() / self.rows;
        let mut out = vec![0f32; self.cols];
        dequant_row(self.dtype, &raw[r * rb..(r + 1) * rb], &mut out);
        out
    }

    /// The stored bytes (empty where the weight is held as f32).
    fn raw(&self) -> &[u8] {
        self.raw.as_ref().map_or(&[], |(buf, range)| &buf[range.clone()])
    }

    /// Checks `bytes` against `dtype` and `shape` and builds the weight; quantized bytes are kept as
    /// `owner`'s range when given (a blob), else copied.
    fn build(
        name: &str,
        dtype: DType,
        shape: &[usize],
        bytes: &[u8],
        owner: Option<(&Arc<CpuBlob>, Range<usize>)>,
    ) -> Result<CpuWeight> {
        let err = |msg: String| Error::Weight { name: name.into(), msg };
        let (rows, cols) = match shape {
            [c] => (1, *c),
            [r, c] => (*r, *c),
            _ => return Err(err(format!("expected 1 or 2 dimensions, got {shape:?}"))),
        };
        if dtype.tensor_bytes(shape) != Some(bytes.len()) {
            return Err(err(format!("{} bytes do not hold {dtype} {shape:?}", bytes.len())));
        }
        if dtype == DType::F32 || rows == 1 {
            let mut v = vec![0f32; rows * cols];
            let rb = bytes.len() / rows;
            for (r, o) in v.chunks_exact_mut(cols).enumerate() {
                dequant_row(dtype, &bytes[r * rb..(r + 1) * rb], o);
            }
            return Ok(CpuWeight {
                dtype,
                rows,
                cols,
                raw: None,
                f32: Some(v),
                norms: Default::default(),
                screen_skip: Default::default(),
            });
        }
        let raw = match owner {
            Some((buf, range)) => (Arc::clone(buf), range),
            None => (Arc::new(CpuBlob::owned(bytes)), 0..bytes.len()),
        };
        Ok(CpuWeight {
            dtype,
            rows,
            cols,
            raw: Some(raw),
            f32: None,
            norms: Default::default(),
            screen_skip: Default::default(),
        })
    }

    /// All values as f32 (for 1-D weights: norms, biases).
    fn values(&self) -> &[f32] {
        self.f32.as_deref().expect("1-D weights are stored as f32")
    }
}

/// The CPU device (it computes streamed layers where the loader put them: `map_blob`).
#[derive(Debug, Clone, Default)]
pub struct CpuBackend {}

impl Backend for CpuBackend {
    type Tensor = CpuTensor;
    type Weight = CpuWeight;
    type KvCache = CpuKv;
    type Blob = Arc<CpuBlob>;
    type Mark = std::time::Instant;

    fn name(&self) -> String {
        "cpu".into()
    }

    fn run_step<R: Send>(&self, f: impl FnOnce() -> R + Send) -> R {
        threads::in_pool(f)
    }

    fn upload_blob(&self, bytes: &[u8], streamed: bool) -> Result<(Arc<CpuBlob>, Option<f64>)> {
        // A streamed layer is mapped in place (`map_blob`); a copy asked for is an owned one.
        let _ = streamed;
        let blob = CpuBlob::owned(bytes);
        Ok((Arc::new(blob), None))
    }

    fn map_blob(&self, bytes: Arc<dyn crate::MappedBytes>) -> Option<Arc<CpuBlob>> {
        Some(Arc::new(CpuBlob::mapped(bytes)))
    }

    fn maps_host(&self) -> bool {
        true
    }

    fn stream_buffers(&self, _count: usize, _bytes: usize) -> Result<()> {
        // Streamed layers are computed where the loader put them (`map_blob`): no buffers to
        // allocate. (A streamed copy, should one be asked for, takes a fresh allocation.)
        Ok(())
    }

    fn weight_in(
        &self,
        blob: &Arc<CpuBlob>,
        name: &str,
        dtype: DType,
        shape: &[usize],
        range: Range<usize>,
    ) -> Result<CpuWeight> {
        let bytes = blob.get(range.clone()).ok_or_else(|| Error::Weight {
            name: name.into(),
            msg: format!("bytes {range:?} lie outside the file ({} bytes)", blob.len()),
        })?;
        CpuWeight::build(name, dtype, shape, bytes, Some((blob, range)))
    }

    fn mark(&self) -> Result<std::time::Instant> {
        Ok(std::time::Instant::now())
    }

    fn elapsed_ms(&self, start: &std::time::Instant, end: &std::time::Instant) -> Result<f64> {
        Ok(end.duration_since(*start).as_secs_f64() * 1e3)
    }

    fn weight(&self, name: &str, dtype: DType, shape: &[usize], bytes: &[u8]) -> Result<CpuWeight> {
        CpuWeight::build(name, dtype, shape, bytes, None)
    }

    fn from_host(&self, data: &[f32], rows: usize, cols: usize) -> Result<CpuTensor> {
        ensure(data.len() == rows * cols, "from_host", || {
            format!("{} values for {rows}x{cols}", data.len())
        })?;
        Ok(CpuTensor { data: data.to_vec(), rows, cols })
    }

    fn to_host(&self, t: &CpuTensor) -> Result<Vec<f32>> {
        Ok(t.data.clone())
    }

    fn dims(&self, t: &CpuTensor) -> (usize, usize) {
        (t.rows, t.cols)
    }

    fn rows(&self, t: &CpuTensor, start: usize, n: usize) -> Result<CpuTensor> {
        ensure(start + n <= t.rows, "rows", || {
            format!("rows {start}..{} of {}", start + n, t.rows)
        })?;
        Ok(CpuTensor {
            data: t.data[start * t.cols..(start + n) * t.cols].to_vec(),
            rows: n,
            cols: t.cols,
        })
    }

    fn gather_rows(&self, t: &CpuTensor, idx: &[usize]) -> Result<CpuTensor> {
        crate::host::check_gather(t.rows, idx)?;
        let c = t.cols;
        let data = idx.iter().flat_map(|&r| t.data[r * c..(r + 1) * c].iter().copied()).collect();
        Ok(CpuTensor { data, rows: idx.len(), cols: c })
    }

    fn add_rows_scaled(
        &self,
        acc: &mut CpuTensor,
        y: &CpuTensor,
        idx: &[usize],
        scale: &[f32],
    ) -> Result<()> {
        crate::host::check_add_rows((acc.rows, acc.cols), (y.rows, y.cols), idx, scale)?;
        crate::host::add_rows_scaled(&mut acc.data, &y.data, acc.cols, idx, scale);
        Ok(())
    }

    fn concat_rows(&self, parts: &[CpuTensor]) -> Result<CpuTensor> {
        let cols = parts.first().map_or(0, |p| p.cols);
        ensure(parts.iter().all(|p| p.cols == cols), "concat_rows", || "widths differ".into())?;
        let data: Vec<f32> = parts.iter().flat_map(|p| p.data.iter().copied()).collect();
        Ok(CpuTensor { rows: data.len() / cols.max(1), data, cols })
    }

    fn embedding(&self, table: &CpuWeight, ids: &[u32]) -> Result<CpuTensor> {
        let mut data = Vec::with_capacity(ids.len() * table.cols);
        for &id in ids {
            ensure((id as usize) < table.rows, "embedding", || {
                format!("token id {id} >= vocab {}", table.rows)
            })?;
            data.extend(table.row(id as usize));
        }
        Ok(CpuTensor { data, rows: ids.len(), cols: table.cols })
    }

    fn prepare_head(&self, w: &CpuWeight) {
        head_screen::prepare(w);
    }

    fn head_argmax(&self, x: &CpuTensor, w: &CpuWeight) -> Result<Vec<u32>> {
        ensure(x.cols == w.cols, "head_argmax", || {
            format!("x has {} columns, weight has {}", x.cols, w.cols)
        })?;
        match head_screen::argmax(w, &x.data, x.rows) {
            Some(t) => Ok(t),
            None => self.argmax_rows(&self.matmul(x, w, crate::Precision::F32)?),
        }
    }

    fn matmul(&self, x: &CpuTensor, w: &CpuWeight, p: crate::Precision) -> Result<CpuTensor> {
        ensure(x.cols == w.cols, "matmul", || {
            format!("x has {} columns, weight has {}", x.cols, w.cols)
        })?;
        let data = matmul::matmul(
            w.dtype,
            w.raw(),
            w.f32.as_deref(),
            (w.rows, w.cols),
            &x.data,
            x.rows,
            p,
        );
        Ok(CpuTensor { data, rows: x.rows, cols: w.rows })
    }

    fn add_bias(&self, x: &mut CpuTensor, bias: &CpuWeight) -> Result<()> {
        let b = bias.values();
        ensure(b.len() == x.cols, "add_bias", || format!("bias {} vs width {}", b.len(), x.cols))?;
        for row in x.data.chunks_exact_mut(x.cols) {
            row.iter_mut().zip(b).for_each(|(v, bi)| *v += bi);
        }
        Ok(())
    }

    fn rms_norm(&self, x: &CpuTensor, weight: &CpuWeight, eps: f32) -> Result<CpuTensor> {
        let w = weight.values();
        ensure(!w.is_empty() && x.cols.is_multiple_of(w.len()), "rms_norm", || {
            format!("weight {} vs width {}", w.len(), x.cols)
        })?;
        let mut out = x.clone();
        let norm = |part: &mut [f32]| {
            for g in part.chunks_exact_mut(w.len()) {
                let ms = g.iter().map(|v| v * v).sum::<f32>() / w.len() as f32;
                let r = 1.0 / (ms + eps).sqrt();
                g.iter_mut().zip(w).for_each(|(v, wi)| *v = wi * (*v * r));
            }
        };
        // Whole groups per task, each normalized as alone: the same bits split or not.
        let per = w.len() * (gated::SPLIT / w.len()).max(1);
        if out.data.len() > per {
            use rayon::prelude::*;
            out.data.par_chunks_mut(per).for_each(norm);
        } else {
            norm(&mut out.data);
        }
        Ok(out)
    }

    fn rope(&self, x: &mut CpuTensor, positions: &[usize], table: &RopeTable) -> Result<()> {
        let hd = table.head_dim;
        ensure(positions.len() == x.rows && x.cols.is_multiple_of(hd), "rope", || {
            format!("{} positions for {} rows", positions.len(), x.rows)
        })?;
        let half = hd / 2;
        let turn = |(row, &pos): (&mut [f32], &usize)| {
            let (cos, sin) = table.cos_sin(pos);
            for head in row.chunks_exact_mut(hd) {
                for i in 0..half {
                    let (a, b) = (head[i], head[i + half]);
                    head[i] = a * cos[i] - b * sin[i];
                    head[i + half] = b * cos[i] + a * sin[i];
                }
            }
        };
        // A prefill's rows across the pool (each row's angles and products as alone).
        if x.rows >= 16 {
            use rayon::prelude::*;
            x.data.par_chunks_exact_mut(x.cols).zip(positions).for_each(turn);
        } else {
            x.data.chunks_exact_mut(x.cols).zip(positions).for_each(turn);
        }
        Ok(())
    }

    fn silu_mul(&self, gate: &CpuTensor, up: &CpuTensor) -> Result<CpuTensor> {
        ensure(gate.data.len() == up.data.len(), "silu_mul", || {
            "gate and up differ in size".into()
        })?;
        let data = gated::gated(gated::Gate::Silu, &gate.data, &up.data);
        Ok(CpuTensor { data, rows: gate.rows, cols: gate.cols })
    }

    fn gelu_tanh_mul(&self, gate: &CpuTensor, up: &CpuTensor) -> Result<CpuTensor> {
        ensure(gate.data.len() == up.data.len(), "gelu_tanh_mul", || {
            "gate and up differ in size".into()
        })?;
        let data = gated::gated(gated::Gate::GeluTanh, &gate.data, &up.data);
        Ok(CpuTensor { data, rows: gate.rows, cols: gate.cols })
    }

    fn scale(&self, x: &mut CpuTensor, s: f32) -> Result<()> {
        x.data.iter_mut().for_each(|a| *a *= s);
        Ok(())
    }

    fn add(&self, x: &mut CpuTensor, y: &CpuTensor) -> Result<()> {
        ensure(x.data.len() == y.data.len(), "add", || "sizes differ".into())?;
        x.data.iter_mut().zip(&y.data).for_each(|(a, b)| *a += b);
        Ok(())
    }

    fn kv_cache(&self, shape: AttnShape, layout: KvLayout) -> Result<CpuKv> {
        Ok(CpuKv::new(layout, shape.n_kv_heads * shape.head_dim, shape.shared_kv))
    }

    fn kv_read(&self, cache: &CpuKv, block: u32) -> Result<Vec<u8>> {
        Ok(cache.read_block(block as usize))
    }

    fn kv_write(&self, cache: &mut CpuKv, block: u32, bytes: &[u8]) -> Result<()> {
        cache.write_block(block as usize, bytes).map_err(|msg| Error::Shape { op: "kv_write", msg })
    }

    fn attention(
        &self,
        q: &CpuTensor,
        k: &CpuTensor,
        v: &CpuTensor,
        cache: &mut CpuKv,
        seq: KvSeq<'_>,
        s: AttnShape,
        tree: Option<&[u64]>,
        sinks: Option<&[f32]>,
    ) -> Result<CpuTensor> {
        let (qd, _) =
            s.check((q.rows, q.cols), (k.rows, k.cols), (v.rows, v.cols), seq.tree(tree)?)?;
        s.check_sinks(sinks)?;
        seq.check(&cache.layout, q.rows)?;
        let data =
            attention::attention(&q.data, &k.data, &v.data, q.rows, cache, seq, s, (tree, sinks));
        Ok(CpuTensor { data, rows: q.rows, cols: qd })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn w(b: &CpuBackend, v: &[f32]) -> CpuWeight {
        let bytes: Vec<u8> = v.iter().flat_map(|x| x.to_le_bytes()).collect();
        b.weight("t", DType::F32, &[v.len()], &bytes).unwrap()
    }

    #[test]
    fn rms_norm_matches_reference_per_row_and_per_head() {
        let b = CpuBackend::default();
        let x = b.from_host(&[1.0, 2.0, 3.0, 4.0], 1, 4).unwrap();
        let out = b.rms_norm(&x, &w(&b, &[1.0, 1.0, 2.0, 2.0]), 0.0).unwrap();
        let r = (30.0f32 / 4.0).sqrt();
        assert!((out.data[2] - 2.0 * 3.0 / r).abs() < 1e-6);
        let per_head = b.rms_norm(&x, &w(&b, &[1.0, 1.0]), 0.0).unwrap();
        assert!((per_head.data[0] - 1.0 / (2.5f32).sqrt()).abs() < 1e-6);
        assert!((per_head.data[3] - 4.0 / (12.5f32).sqrt()).abs() < 1e-6);
    }

    #[test]
    fn rope_rotates_pairs_half_apart_and_keeps_norm() {
        let b = CpuBackend::default();
        let table = RopeTable { head_dim: 4, inv_freq: vec![1.0, 0.5], attn_factor: 1.0 };
        let mut x = b.from_host(&[1.0, 0.0, 0.0, 1.0], 1, 4).unwrap();
        b.rope(&mut x, &[2], &table).unwrap();
        let (c0, s0, c1, s1) = (2f32.cos(), 2f32.sin(), 1f32.cos(), 1f32.sin());
        let want = [c0, -s1, s0, c1];
        for (a, e) in x.data.iter().zip(want) {
            assert!((a - e).abs() < 1e-6, "{:?}", x.data);
        }
    }

    #[test]
    fn silu_mul_and_embedding() {
        let b = CpuBackend::default();
        let g = b.from_host(&[0.0, 1.0], 1, 2).unwrap();
        let u = b.from_host(&[3.0, 2.0], 1, 2).unwrap();
        let o = b.silu_mul(&g, &u).unwrap();
        assert_eq!(o.data[0], 0.0);
        assert!((o.data[1] - 2.0 / (1.0 + (-1f32).exp())).abs() < 1e-6);
        // GELU (tanh form): 0 at 0, ≈ x for large x, 0.841192 at 1 (PyTorch's value).
        let o = b.gelu_tanh_mul(&g, &u).unwrap();
        assert_eq!(o.data[0], 0.0);
        assert!((o.data[1] - 2.0 * 0.841_192).abs() < 1e-5, "{}", o.data[1]);
        let bytes: Vec<u8> = (0..6).flat_map(|i| (i as f32).to_le_bytes()).collect();
        let table = b.weight("e", DType::F32, &[3, 2], &bytes).unwrap();
        assert_eq!(b.embedding(&table, &[2, 0]).unwrap().data, vec![4.0, 5.0, 0.0, 1.0]);
        assert!(b.embedding(&table, &[3]).is_err());
    }
}
