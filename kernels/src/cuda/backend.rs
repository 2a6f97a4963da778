//! The CUDA backend: f32 activations and KV caches in device memory on the compute stream, weights
//! kept in their stored format (quantized blocks too) and dequantized by the kernels, GEMMs through
//! cuBLAS. Layer files arrive in one copy each on the copy stream: into a fresh allocation (resident
//! layers) or into one of the streaming buffers allocated once and reused, ordered with events.

use super::driver::{derr, f, i, DevBuf, Event, Gpu};
use super::stream_pool::{Lease, StreamPool};
use crate::backend::{AttnShape, Backend, RowPick};
use crate::error::{ensure, Error, Result};
use crate::kv::{KvLayout, KvSeq};
use crate::rope::RopeTable;
use cudarc::cublas;
use cudarc::driver::result;
use layerstream_types::DType;
use std::any::Any;
use std::sync::Arc;

mod ops;
pub use ops::GemmPrecision;

/// Activation rows up to which `matmul` runs the fused dequantize-matvec kernel (MATVEC_ROWS in
/// quant.cu); above it, weights are dequantized in chunks and multiplied with cuBLAS.
const MATVEC_ROWS: usize = 8;
/// Elements of the dequantization scratch for the GEMM path (chunks of weight rows).
pub(super) const SCRATCH_ELEMS: usize = 32 << 20;
use super::ATTENTION_THREADS;
/// Largest head dimension the attention kernel takes (ATT_DIMS_PER_THREAD × ATTENTION_THREADS).
/// `ATT_DIMS_PER_THREAD` of attention.cu per thread: 640, room for MLA's 576-wide rows.
const ATTENTION_MAX_HEAD_DIM: usize = 5 * ATTENTION_THREADS as usize;
// The GEMM scratch (f32 at most) and 64 MiB for cuBLAS and the logits fit beside the activations.
const _: () = assert!(
    SCRATCH_ELEMS as u64 * 4 + super::ACTIVATION_RESERVE + (64 << 20) <= super::RUNTIME_RESERVE
);

/// A CUDA device as a `Backend`.
#[derive(Clone)]
pub struct CudaBackend {
    gpu: Arc<Gpu>,
    pool: Arc<StreamPool>,
    precision: GemmPrecision,
}

/// Activations `[rows, cols]` (f32) on the device.
pub struct CudaTensor {
    buf: DevBuf,
    rows: usize,
    cols: usize,
}

/// A weight on the device: a view of its file's bytes, in the stored format.
pub struct CudaWeight {
    dtype: DType,
    rows: usize,
    cols: usize,
    row_bytes: usize,
    ptr: u64,
    _keep: Arc<dyn Any + Send + Sync>,
}

/// A layer file on the device: its own allocation, or a leased streaming buffer.
#[derive(Clone)]
pub enum CudaBlob {
    Owned(Arc<DevBuf>),
    Streamed(Arc<Lease>),
}

impl CudaBlob {
    fn ptr_len(&self) -> (u64, usize) {
        match self {
            CudaBlob::Owned(b) => (b.ptr, b.bytes),
            CudaBlob::Streamed(l) => (l.ptr(), l.len()),
        }
    }
}

/// One layer's KV pool: keys and values of `layout.blocks` blocks, `stride` bytes per stored row,
/// allocated whole when the pool is made (its bytes are in the plan's budget).
pub struct CudaKv {
    k: Option<DevBuf>,
    /// `None` in an empty pool, or where the values are the keys (`AttnShape::shared_kv`).
    v: Option<DevBuf>,
    layout: KvLayout,
    stride: usize,
}

impl CudaKv {
    /// The stored buffers: keys, then values unless the values are the keys (empty: no pool).
    fn bufs(&self) -> Vec<&DevBuf> {
        self.k.iter().chain(&self.v).collect()
    }
}

use super::source::{dtype_code, matvec32_align, matvec_q8_supports};

fn blocks(n: usize, per: usize) -> u32 {
    n.div_ceil(per).clamp(1, 1 << 20) as u32
}

impl CudaBackend {
    /// Opens `cuda:ordinal` with the GEMM precision from the environment, else the device's default.
    pub fn new(ordinal: usize) -> Result<CudaBackend> {
        Self::open(ordinal, GemmPrecision::from_env()?)
    }

    /// Opens `cuda:ordinal` with an explicit GEMM precision.
    pub fn with_precision(ordinal: usize, precision: GemmPrecision) -> Result<CudaBackend> {
        Self::open(ordinal, Some(precision))
    }

    fn open(ordinal: usize, precision: Option<GemmPrecision>) -> Result<CudaBackend> {
        let gpu = Gpu::open(ordinal)?;
        let precision = precision.unwrap_or(GemmPrecision::default_for(gpu.sm));
        Ok(CudaBackend { pool: Arc::new(StreamPool::new(gpu.clone())), gpu, precision })
    }

    /// Device memory `(free, total)` from cuMemGetInfo.
    pub fn mem_info(&self) -> Result<(usize, usize)> {
        self.gpu.mem_info()
    }

    /// Bytes of host memory currently registered (pinned) for copies.
    pub fn registered_bytes(&self) -> usize {
        self.pool.registered_bytes()
    }

    fn tensor(&self, rows: usize, cols: usize) -> Result<CudaTensor> {
        Ok(CudaTensor { buf: DevBuf::ordered(&self.gpu, rows * cols * 4)?, rows, cols })
    }

    fn upload_small<T: Copy>(&self, data: &[T]) -> Result<DevBuf> {
        let buf = DevBuf::ordered(&self.gpu, std::mem::size_of_val(data))?;
        if !data.is_empty() {
            // SAFETY: `buf` holds exactly these bytes; pageable sources are staged by the driver before
            // the call returns, so `data` may go away afterwards.
            unsafe { result::memcpy_htod_async(buf.ptr, data, self.gpu.compute) }
                .map_err(derr("copying to the device"))?;
        }
        Ok(buf)
    }
}

impl Backend for CudaBackend {
    type Tensor = CudaTensor;
    type Weight = CudaWeight;
    type KvCache = CudaKv;
    type Blob = CudaBlob;
    type Mark = Event;

    fn name(&self) -> String {
        format!("cuda:{}", self.gpu.ordinal)
    }

    fn upload_blob(&self, bytes: &[u8], streamed: bool) -> Result<(CudaBlob, Option<f64>)> {
        if streamed {
            let (lease, ms) = self.pool.upload(bytes)?;
            return Ok((CudaBlob::Streamed(Arc::new(lease)), Some(ms)));
        }
        let buf = DevBuf::plain(&self.gpu, bytes.len())?;
        let ms = self.pool.copy_in(buf.ptr, bytes)?;
        Ok((CudaBlob::Owned(Arc::new(buf)), Some(ms)))
    }

    fn weight_in(
        &self,
        blob: &CudaBlob,
        name: &str,
        dtype: DType,
        shape: &[usize],
        range: std::ops::Range<usize>,
    ) -> Result<CudaWeight> {
        let err = |msg: String| Error::Weight { name: name.into(), msg };
        let (rows, cols) = match shape {
            [c] => (1, *c),
            [r, c] => (*r, *c),
            _ => return Err(err(format!("expected 1 or 2 dimensions, got {shape:?}"))),
        };
        let (base, len) = blob.ptr_len();
        if dtype.tensor_bytes(shape) != Some(range.len()) || range.end > len {
            return Err(err(format!(
                "bytes {range:?} of a {len}-byte file do not hold {dtype} {shape:?}"
            )));
        }
        let row_bytes = dtype.row_bytes(cols).expect("checked by tensor_bytes");
        let keep: Arc<dyn Any + Send + Sync> = match blob {
            CudaBlob::Owned(b) => b.clone(),
            CudaBlob::Streamed(l) => l.clone(),
        };
        Ok(CudaWeight { dtype, rows, cols, row_bytes, ptr: base + range.start as u64, _keep: keep })
    }

    fn stream_buffers(&self, count: usize, bytes: usize) -> Result<()> {
        self.pool.configure(count, bytes)
    }

    fn register_host(&self, bytes: &[u8]) -> Result<()> {
        self.pool.register(bytes)
    }

    fn unregister_host(&self, bytes: &[u8]) {
        self.pool.unregister(bytes)
    }

    fn mark(&self) -> Result<Event> {
        let e = Event::new(&self.gpu, true)?;
        e.record(self.gpu.compute)?;
        Ok(e)
    }

    fn elapsed_ms(&self, start: &Event, end: &Event) -> Result<f64> {
        start.elapsed_ms(end)
    }

    fn argmax_rows(&self, t: &CudaTensor) -> Result<Vec<u32>> {
        self.gpu.bind()?;
        let out = DevBuf::ordered(&self.gpu, t.rows * 4)?;
        if t.rows > 0 {
            self.gpu.launch(
                "argmax",
                (t.rows as u32, 1, 1),
                256,
                0,
                &[t.buf.ptr, out.ptr, i(t.cols as i32)],
            )?;
        }
        let mut host = vec![0u32; t.rows];
        self.read(out.ptr, &mut host)?;
        // The kernel leaves its initial index (past the row) where no value compares larger: NaNs.
        if let Some(r) = host.iter().position(|&id| id as usize >= t.cols) {
            return Err(Error::NonFinite(format!(
                "row {r} has no finite maximum (NaN activations; LAYERSTREAM_CUDA_GEMM=f32 tells a GEMM overflow from a broken model)"
            )));
        }
        Ok(host)
    }

    fn samples_on_device(&self) -> bool {
        true
    }

    fn sample_rows(
        &self,
        logits: &mut CudaTensor,
        jobs: &[Option<RowPick<'_>>],
    ) -> Result<Vec<Option<u32>>> {
        self.sample_on_device(logits, jobs)
    }

    fn weight(
        &self,
        name: &str,
        dtype: DType,
        shape: &[usize],
        bytes: &[u8],
    ) -> Result<CudaWeight> {
        let (blob, _) = self.upload_blob(bytes, false)?;
        self.weight_in(&blob, name, dtype, shape, 0..bytes.len())
    }

    fn from_host(&self, data: &[f32], rows: usize, cols: usize) -> Result<CudaTensor> {
        ensure(data.len() == rows * cols, "from_host", || {
            format!("{} values for {rows}x{cols}", data.len())
        })?;
        self.gpu.bind()?;
        Ok(CudaTensor { buf: self.upload_small(data)?, rows, cols })
    }

    fn to_host(&self, t: &CudaTensor) -> Result<Vec<f32>> {
        self.gpu.bind()?;
        let mut host = vec![0f32; t.rows * t.cols];
        self.read(t.buf.ptr, &mut host)?;
        Ok(host)
    }

    fn dims(&self, t: &CudaTensor) -> (usize, usize) {
        (t.rows, t.cols)
    }

    fn rows(&self, t: &CudaTensor, start: usize, n: usize) -> Result<CudaTensor> {
        ensure(start + n <= t.rows, "rows", || {
            format!("rows {start}..{} of {}", start + n, t.rows)
        })?;
        self.gpu.bind()?;
        let out = self.tensor(n, t.cols)?;
        self.dtod(out.buf.ptr, t.buf.ptr + (start * t.cols * 4) as u64, n * t.cols * 4)?;
        Ok(out)
    }

    fn cols(&self, t: &CudaTensor, start: usize, n: usize) -> Result<CudaTensor> {
        ensure(start + n <= t.cols, "cols", || {
            format!("columns {start}..{} of {}", start + n, t.cols)
        })?;
        self.gpu.bind()?;
        let out = self.tensor(t.rows, n)?;
        self.copy_cols(t, start, &out, 0)?;
        Ok(out)
    }

    fn concat_cols(&self, parts: &[&CudaTensor]) -> Result<CudaTensor> {
        let rows = parts.first().map_or(0, |p| p.rows);
        ensure(parts.iter().all(|p| p.rows == rows), "concat_cols", || "row counts differ".into())?;
        self.gpu.bind()?;
        let out = self.tensor(rows, parts.iter().map(|p| p.cols).sum())?;
        let mut off = 0;
        for p in parts {
            self.copy_cols(p, 0, &out, off)?;
            off += p.cols;
        }
        Ok(out)
    }

    fn gather_rows(&self, t: &CudaTensor, idx: &[usize]) -> Result<CudaTensor> {
        crate::host::check_gather(t.rows, idx)?;
        self.gpu.bind()?;
        let out = self.tensor(idx.len(), t.cols)?;
        if idx.is_empty() {
            return Ok(out);
        }
        let didx = self.upload_small(&idx.iter().map(|&r| r as i32).collect::<Vec<_>>())?;
        let args = [t.buf.ptr, didx.ptr, out.buf.ptr, i(idx.len() as i32), i(t.cols as i32)];
        self.gpu.launch("gather_rows", (idx.len() as u32, 1, 1), 256, 0, &args)?;
        Ok(out)
    }

    fn permute_cols(&self, t: &CudaTensor, perm: &[u32]) -> Result<CudaTensor> {
        crate::host::check_perm(t.cols, perm)?;
        self.gpu.bind()?;
        let out = self.tensor(t.rows, t.cols)?;
        if t.rows == 0 || t.cols == 0 {
            return Ok(out);
        }
        let dperm = self.upload_small(&perm.iter().map(|&p| p as i32).collect::<Vec<_>>())?;
        let args = [t.buf.ptr, dperm.ptr, out.buf.ptr, i(t.rows as i32), i(t.cols as i32)];
        self.gpu.launch("permute_cols", (t.rows as u32, 1, 1), 256, 0, &args)?;
        Ok(out)
    }

    fn add_rows_scaled(
        &self,
        acc: &mut CudaTensor,
        y: &CudaTensor,
        idx: &[usize],
        scale: &[f32],
    ) -> Result<()> {
        crate::host::check_add_rows((acc.rows, acc.cols), (y.rows, y.cols), idx, scale)?;
        if idx.is_empty() {
            return Ok(());
        }
        self.gpu.bind()?;
        let didx = self.upload_small(&idx.iter().map(|&r| r as i32).collect::<Vec<_>>())?;
        let dscale = self.upload_small(scale)?;
        let n = i(idx.len() as i32);
        let args = [acc.buf.ptr, y.buf.ptr, didx.ptr, dscale.ptr, n, i(acc.cols as i32)];
        self.gpu.launch("add_rows_scaled", (idx.len() as u32, 1, 1), 256, 0, &args)
    }

    fn concat_rows(&self, parts: &[CudaTensor]) -> Result<CudaTensor> {
        let cols = parts.first().map_or(0, |p| p.cols);
        ensure(parts.iter().all(|p| p.cols == cols), "concat_rows", || "widths differ".into())?;
        self.gpu.bind()?;
        let out = self.tensor(parts.iter().map(|p| p.rows).sum(), cols)?;
        let mut off = 0;
        for p in parts {
            self.dtod(out.buf.ptr + off as u64, p.buf.ptr, p.buf.bytes)?;
            off += p.buf.bytes;
        }
        Ok(out)
    }

    fn embedding(&self, table: &CudaWeight, ids: &[u32]) -> Result<CudaTensor> {
        for &id in ids {
            ensure((id as usize) < table.rows, "embedding", || {
                format!("token id {id} >= vocab {}", table.rows)
            })?;
        }
        self.gpu.bind()?;
        let out = self.tensor(ids.len(), table.cols)?;
        let dev_ids = self.upload_small(ids)?;
        if !ids.is_empty() {
            let args = [
                table.ptr,
                i(dtype_code(table.dtype)),
                table.row_bytes as u64,
                dev_ids.ptr,
                out.buf.ptr,
                i(table.cols as i32),
            ];
            self.gpu.launch("embedding", (ids.len() as u32, 1, 1), 256, 0, &args)?;
        }
        Ok(out)
    }

    fn matmul(&self, x: &CudaTensor, w: &CudaWeight, p: crate::Precision) -> Result<CudaTensor> {
        ensure(x.cols == w.cols, "matmul", || {
            format!("x has {} columns, weight has {}", x.cols, w.cols)
        })?;
        self.gpu.bind()?;
        let y = self.tensor(x.rows, w.rows)?;
        if x.rows == 0 {
            return Ok(y);
        }
        if x.rows <= MATVEC_ROWS {
            // The wide-load kernel where the width is whole units and the addresses allow its loads.
            let align = matvec32_align(w.dtype) as u64;
            let wide = super::WIDE_MATVEC.load(std::sync::atomic::Ordering::Relaxed)
                && w.cols.is_multiple_of(32)
                && (w.ptr | w.row_bytes as u64).is_multiple_of(align)
                && x.buf.ptr.is_multiple_of(16);
            if wide && matvec_q8_supports(w.dtype) && p == crate::Precision::Int8 {
                self.matvec_q8(x, w, &y)?;
                return Ok(y);
            }
            let kernel = if wide { "matvec32_" } else { "matvec_" };
            let args = [
                w.ptr,
                w.row_bytes as u64,
                x.buf.ptr,
                y.buf.ptr,
                i(x.rows as i32),
                i(w.rows as i32),
                i(w.cols as i32),
            ];
            self.gpu.launch(
                &format!("{kernel}{}", w.dtype.name()),
                (blocks(w.rows * 32, 256), 1, 1),
                256,
                0,
                &args,
            )?;
        } else {
            self.matmul_gemm(x, w, &y)?;
        }
        Ok(y)
    }

    fn add_bias(&self, x: &mut CudaTensor, bias: &CudaWeight) -> Result<()> {
        ensure(bias.rows == 1 && bias.cols == x.cols, "add_bias", || {
            format!("bias {} vs width {}", bias.cols, x.cols)
        })?;
        self.gpu.bind()?;
        let n = x.rows * x.cols;
        self.gpu.launch(
            "add_bias",
            (blocks(n, 256), 1, 1),
            256,
            0,
            &[x.buf.ptr, bias.ptr, i(dtype_code(bias.dtype)), n as u64, i(x.cols as i32)],
        )
    }

    fn rms_norm(&self, x: &CudaTensor, weight: &CudaWeight, eps: f32) -> Result<CudaTensor> {
        let g = weight.cols;
        ensure(weight.rows == 1 && g > 0 && x.cols.is_multiple_of(g), "rms_norm", || {
            format!("weight {g} vs width {}", x.cols)
        })?;
        self.gpu.bind()?;
        let out = self.tensor(x.rows, x.cols)?;
        let groups = x.rows * x.cols / g;
        if groups > 0 {
            let args = [
                x.buf.ptr,
                out.buf.ptr,
                weight.ptr,
                i(dtype_code(weight.dtype)),
                i(g as i32),
                f(eps),
            ];
            self.gpu.launch(
                "rms_norm",
                (groups as u32, 1, 1),
                if g >= 256 { 256 } else { 64 },
                0,
                &args,
            )?;
        }
        Ok(out)
    }

    fn rope(&self, x: &mut CudaTensor, positions: &[usize], table: &RopeTable) -> Result<()> {
        let hd = table.head_dim;
        ensure(positions.len() == x.rows && x.cols.is_multiple_of(hd), "rope", || {
            format!("{} positions for {} rows", positions.len(), x.rows)
        })?;
        self.gpu.bind()?;
        let pos: Vec<i32> = positions.iter().map(|&p| p as i32).collect();
        let (dpos, dfreq) = (self.upload_small(&pos)?, self.upload_small(&table.inv_freq)?);
        let total = x.rows * (x.cols / hd) * (hd / 2);
        if total == 0 {
            return Ok(());
        }
        let args = [
            x.buf.ptr,
            dpos.ptr,
            dfreq.ptr,
            i(x.rows as i32),
            i(x.cols as i32),
            i(hd as i32),
            f(table.attn_factor),
        ];
        self.gpu.launch("rope", (blocks(total, 256), 1, 1), 256, 0, &args)
    }

    fn silu_mul(&self, gate: &CudaTensor, up: &CudaTensor) -> Result<CudaTensor> {
        self.gated("silu_mul", gate, up)
    }

    fn gelu_tanh_mul(&self, gate: &CudaTensor, up: &CudaTensor) -> Result<CudaTensor> {
        self.gated("gelu_tanh_mul", gate, up)
    }

    fn swiglu_clamp_mul(
        &self,
        gate: &CudaTensor,
        up: &CudaTensor,
        alpha: f32,
        limit: f32,
    ) -> Result<CudaTensor> {
        self.gated_with("swiglu_clamp_mul", gate, up, &[f(alpha), f(limit)])
    }

    fn relu2_mul(&self, gate: &CudaTensor, up: &CudaTensor) -> Result<CudaTensor> {
        self.gated("relu2_mul", gate, up)
    }

    fn quant_rows_8bit(&self, x: &CudaTensor) -> Result<CudaTensor> {
        self.gpu.bind()?;
        let out = self.tensor(x.rows, x.cols)?;
        if x.rows > 0 && x.cols > 0 {
            let args = [x.buf.ptr, out.buf.ptr, i(x.cols as i32)];
            self.gpu.launch("quant_rows_8bit", (x.rows as u32, 1, 1), 256, 0, &args)?;
        }
        Ok(out)
    }

    fn add(&self, x: &mut CudaTensor, y: &CudaTensor) -> Result<()> {
        ensure(x.rows == y.rows && x.cols == y.cols, "add", || "sizes differ".into())?;
        self.gpu.bind()?;
        let n = x.rows * x.cols;
        self.gpu.launch("add", (blocks(n, 256), 1, 1), 256, 0, &[x.buf.ptr, y.buf.ptr, n as u64])
    }

    fn kv_cache(&self, shape: AttnShape, layout: KvLayout) -> Result<CudaKv> {
        self.gpu.bind()?;
        let stride = layout.row_stride(shape.n_kv_heads * shape.head_dim);
        let bytes = layout.positions() * stride;
        let (k, v) = match (bytes > 0, shape.shared_kv) {
            (false, _) => (None, None),
            (true, true) => (Some(DevBuf::ordered(&self.gpu, bytes)?), None),
            (true, false) => {
                (Some(DevBuf::ordered(&self.gpu, bytes)?), Some(DevBuf::ordered(&self.gpu, bytes)?))
            }
        };
        Ok(CudaKv { k, v, layout, stride })
    }

    fn kv_read(&self, cache: &CudaKv, block: u32) -> Result<Vec<u8>> {
        self.gpu.bind()?;
        let n = cache.layout.block * cache.stride;
        ensure((block as usize) < cache.layout.blocks, "kv_read", || {
            format!("block {block} of a pool of {}", cache.layout.blocks)
        })?;
        let bufs = cache.bufs();
        let mut out = vec![0u8; bufs.len().max(1) * n];
        let at = (block as usize * n) as u64;
        for (buf, o) in bufs.iter().zip(out.chunks_exact_mut(n.max(1))) {
            self.read(buf.ptr + at, o)?;
        }
        Ok(out)
    }

    fn kv_write(&self, cache: &mut CudaKv, block: u32, bytes: &[u8]) -> Result<()> {
        self.write_block(cache, block, bytes)
    }

    fn attention(
        &self,
        q: &CudaTensor,
        k: &CudaTensor,
        v: &CudaTensor,
        cache: &mut CudaKv,
        seq: KvSeq<'_>,
        s: AttnShape,
        tree: Option<&[u64]>,
        sinks: Option<&[f32]>,
    ) -> Result<CudaTensor> {
        self.attend(q, k, v, cache, seq, s, tree, sinks)
    }
}
