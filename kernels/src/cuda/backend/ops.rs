//! The CUDA backend's helpers beside its `Backend` methods: the GEMM path's precision, the fused
//! 8-bit matvec, cuBLAS GEMMs over dequantized weight chunks, gated element-wise kernels, column
//! copies and synchronous reads back to the host.

use super::*;

/// Precision of the GEMM path (prefill and large batches).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GemmPrecision {
    /// Weights dequantized to bf16, activations converted to bf16, f32 accumulation: f32's range, so
    /// no activation overflows (the default from compute capability 8.0, where cuBLAS has bf16 GEMMs).
    Bf16,
    /// As Bf16 with f16 (3 more mantissa bits, but values past ±65504 become infinite; the default
    /// before compute capability 8.0).
    F16,
    /// Everything in f32 (parity runs).
    F32,
}

impl GemmPrecision {
    /// From `LAYERSTREAM_CUDA_GEMM` (`bf16`, `f16` or `f32`); `None` when unset (the device's default).
    pub fn from_env() -> Result<Option<GemmPrecision>> {
        match std::env::var("LAYERSTREAM_CUDA_GEMM").as_deref() {
            Err(_) | Ok("") => Ok(None),
            Ok("bf16") => Ok(Some(GemmPrecision::Bf16)),
            Ok("f16") => Ok(Some(GemmPrecision::F16)),
            Ok("f32") => Ok(Some(GemmPrecision::F32)),
            Ok(other) => Err(Error::Device(format!(
                "LAYERSTREAM_CUDA_GEMM={other:?}: expected bf16, f16 or f32"
            ))),
        }
    }

    /// The default on a device of compute capability `sm` (major × 10 + minor).
    pub(super) fn default_for(sm: u32) -> GemmPrecision {
        if sm >= 80 {
            GemmPrecision::Bf16
        } else {
            GemmPrecision::F16
        }
    }
}

impl CudaBackend {
    /// `y = x · wᵀ` from 8-bit activations (`--int8-activations`): `x` quantized once to blocks of
    /// 32 bytes with their scales, then `matvec_q8_*` (kernels/cuda/int8.cu).
    pub(super) fn matvec_q8(&self, x: &CudaTensor, w: &CudaWeight, y: &CudaTensor) -> Result<()> {
        let values = x.rows * x.cols;
        let nblocks = values / 32;
        let q = DevBuf::ordered(&self.gpu, values)?;
        let d = DevBuf::ordered(&self.gpu, nblocks * 4)?;
        let ds = DevBuf::ordered(&self.gpu, nblocks * 4)?;
        self.gpu.launch(
            "quantize_q8",
            (blocks(values, 256), 1, 1),
            256,
            0,
            &[x.buf.ptr, q.ptr, d.ptr, ds.ptr, nblocks as u64],
        )?;
        let args = [
            w.ptr,
            w.row_bytes as u64,
            q.ptr,
            d.ptr,
            ds.ptr,
            y.buf.ptr,
            i(x.rows as i32),
            i(w.rows as i32),
            i(w.cols as i32),
        ];
        let name = format!("matvec_q8_{}", w.dtype.name());
        self.gpu.launch(&name, (blocks(w.rows * 32, 256), 1, 1), 256, 0, &args)
    }

    pub(super) fn dtod(&self, dst: u64, src: u64, bytes: usize) -> Result<()> {
        if bytes == 0 {
            return Ok(());
        }
        // SAFETY: both ranges lie inside live allocations used on the compute stream.
        unsafe { result::memcpy_dtod_async(dst, src, bytes, self.gpu.compute) }
            .map_err(derr("device copy"))
    }

    /// `y[.., r0..r0+nr] = x · a[nr, k]ᵀ` with `a` row-major of element type `ty` (cuBLAS is
    /// column-major: y is `[n, m]` with leading dimension n).
    #[allow(clippy::too_many_arguments)]
    pub(super) fn gemm(
        &self,
        a: u64,
        x: u64,
        ty: cublas::sys::cudaDataType,
        y: u64,
        nr: usize,
        m: usize,
        k: usize,
        ldy: usize,
    ) -> Result<()> {
        let (alpha, beta) = (1.0f32, 0.0f32);
        let h = layerstream_types::sync::lock(&self.gpu.blas);
        // SAFETY: `a` holds nr×k and `x` m×k elements of `ty`, `y` has room for m rows of ldy floats from
        // this offset; all live on the compute stream the handle is bound to.
        unsafe {
            cublas::result::gemm_ex(
                *h,
                cublas::sys::cublasOperation_t::CUBLAS_OP_T,
                cublas::sys::cublasOperation_t::CUBLAS_OP_N,
                nr as i32,
                m as i32,
                k as i32,
                &alpha as *const f32 as *const _,
                a as *const _,
                ty,
                k as i32,
                x as *const _,
                ty,
                k as i32,
                &beta as *const f32 as *const _,
                y as *mut _,
                cublas::sys::cudaDataType::CUDA_R_32F,
                ldy as i32,
                cublas::sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
                cublas::sys::cublasGemmAlgo_t::CUBLAS_GEMM_DFALT,
            )
        }
        .map_err(|e| Error::Device(format!("cuBLAS gemm_ex ({nr}x{m}x{k}): {e:?}")))
    }

    pub(super) fn matmul_gemm(&self, x: &CudaTensor, w: &CudaWeight, y: &CudaTensor) -> Result<()> {
        let (m, n, k) = (x.rows, w.rows, w.cols);
        use cublas::sys::cudaDataType::{CUDA_R_16BF, CUDA_R_16F, CUDA_R_32F};
        // (element bytes, cuBLAS type, weight dequantization kernel prefix, activation conversion)
        let (esize, ty, kernel, convert) = match self.precision {
            GemmPrecision::F32 if w.dtype == DType::F32 => {
                return self.gemm(w.ptr, x.buf.ptr, CUDA_R_32F, y.buf.ptr, n, m, k, n)
            }
            GemmPrecision::F32 => (4, CUDA_R_32F, "dequant_f32_", None),
            GemmPrecision::F16 => (2, CUDA_R_16F, "dequant_f16_", Some("to_f16")),
            GemmPrecision::Bf16 => (2, CUDA_R_16BF, "dequant_bf16_", Some("to_bf16")),
        };
        let xin = match convert {
            Some(to_half) => {
                let xh = DevBuf::ordered(&self.gpu, m * k * 2)?;
                self.gpu.launch(
                    to_half,
                    (blocks(m * k, 256), 1, 1),
                    256,
                    0,
                    &[x.buf.ptr, xh.ptr, (m * k) as u64],
                )?;
                Some(xh)
            }
            None => None,
        };
        let xptr = xin.as_ref().map_or(x.buf.ptr, |b| b.ptr);
        let chunk = (SCRATCH_ELEMS / k).clamp(1, n);
        let scratch = DevBuf::ordered(&self.gpu, chunk * k * esize)?;
        let name = format!("{kernel}{}", w.dtype.name());
        for r0 in (0..n).step_by(chunk) {
            let nr = chunk.min(n - r0);
            let src = w.ptr + (r0 * w.row_bytes) as u64;
            // One thread per run of 8 elements (the kernel strides over the rest when k % 8 != 0).
            self.gpu.launch(
                &name,
                (blocks((nr * k).div_ceil(8), 256), 1, 1),
                256,
                0,
                &[src, w.row_bytes as u64, scratch.ptr, nr as u64, i(k as i32)],
            )?;
            self.gemm(scratch.ptr, xptr, ty, y.buf.ptr + (r0 * 4) as u64, nr, m, k, n)?;
        }
        Ok(())
    }

    /// `kernel(gate) * up`, element-wise (`silu_mul`, `gelu_tanh_mul`, `relu2_mul`).
    pub(super) fn gated(
        &self,
        kernel: &'static str,
        gate: &CudaTensor,
        up: &CudaTensor,
    ) -> Result<CudaTensor> {
        self.gated_with(kernel, gate, up, &[])
    }

    /// Copies `dst.cols`-or-fewer columns: `src`'s from `src_off` into `dst`'s from `dst_off`, as
    /// many as fit both (`cols`: all of `dst`; `concat_cols`: all of `src`).
    pub(super) fn copy_cols(
        &self,
        src: &CudaTensor,
        src_off: usize,
        dst: &CudaTensor,
        dst_off: usize,
    ) -> Result<()> {
        let n = (src.cols - src_off).min(dst.cols - dst_off);
        if n == 0 || src.rows == 0 {
            return Ok(());
        }
        let args = [
            src.buf.ptr,
            i(src.cols as i32),
            i(src_off as i32),
            dst.buf.ptr,
            i(dst.cols as i32),
            i(dst_off as i32),
            i(src.rows as i32),
            i(n as i32),
        ];
        self.gpu.launch("copy_cols", (blocks(src.rows * n, 256), 1, 1), 256, 0, &args)
    }

    /// `gated` with the kernel's extra arguments after the element count.
    pub(super) fn gated_with(
        &self,
        kernel: &'static str,
        gate: &CudaTensor,
        up: &CudaTensor,
        extra: &[u64],
    ) -> Result<CudaTensor> {
        ensure(gate.rows == up.rows && gate.cols == up.cols, kernel, || {
            "gate and up differ in size".into()
        })?;
        self.gpu.bind()?;
        let out = self.tensor(gate.rows, gate.cols)?;
        let n = gate.rows * gate.cols;
        let mut args = vec![gate.buf.ptr, up.buf.ptr, out.buf.ptr, n as u64];
        args.extend_from_slice(extra);
        self.gpu.launch(kernel, (blocks(n, 256), 1, 1), 256, 0, &args)?;
        Ok(out)
    }

    /// Copies device memory at `src` into `dst` and waits for it (and all earlier compute work).
    pub(super) fn read<T: Copy>(&self, src: u64, dst: &mut [T]) -> Result<()> {
        if !dst.is_empty() {
            // SAFETY: `src` holds at least `dst`'s bytes; the stream is synchronised before `dst` is read.
            unsafe { result::memcpy_dtoh_async(dst, src, self.gpu.compute) }
                .map_err(derr("copying to the host"))?;
        }
        self.gpu.sync_compute()
    }

    #[allow(clippy::too_many_arguments)] // the `Backend::attention` arguments, passed on
    pub(super) fn attend(
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
        let (qd, kvd) =
            s.check((q.rows, q.cols), (k.rows, k.cols), (v.rows, v.cols), seq.tree(tree)?)?;
        s.check_sinks(sinks)?;
        ensure(s.head_dim <= ATTENTION_MAX_HEAD_DIM, "attention", || {
            format!("head_dim {} exceeds the CUDA kernel's {ATTENTION_MAX_HEAD_DIM}", s.head_dim)
        })?;
        let m = q.rows;
        seq.check(&cache.layout, m)?;
        self.gpu.bind()?;
        let out = self.tensor(m, qd)?;
        let Some(kp) = &cache.k else { return Ok(out) };
        // Shared keys and values (MLA): the kernel reads the values from the keys.
        let vp = cache.v.as_ref().unwrap_or(kp);
        if m == 0 {
            return Ok(out);
        }
        let used = (seq.start + m).div_ceil(cache.layout.block);
        let table = self.upload_small(&seq.table[..used])?;
        let (bs, stride, dt) =
            (i(cache.layout.block as i32), cache.stride as u64, i(dtype_code(cache.layout.dtype)));
        // Quantized pools hold each head rotated (kv::rotation): kv_store rotates, attention
        // rotates the query and the output back.
        let rot = i(crate::kv::rotation(cache.layout.dtype, s.head_dim) as i32);
        for (src, pool) in [(k, kp), (v, vp)].into_iter().take(if s.shared_kv { 1 } else { 2 }) {
            let args = [
                src.buf.ptr,
                pool.ptr,
                table.ptr,
                i(seq.start as i32),
                i(kvd as i32),
                bs,
                stride,
                dt,
                rot,
            ];
            self.gpu.launch("kv_store", (m as u32, 1, 1), 64, 0, &args)?;
        }
        let anc_buf = tree.map(|a| self.upload_small(a)).transpose()?;
        let sink_buf = sinks.map(|a| self.upload_small(a)).transpose()?;
        let args = [
            q.buf.ptr,
            kp.ptr,
            vp.ptr,
            table.ptr,
            bs,
            stride,
            dt,
            rot,
            out.buf.ptr,
            i(seq.start as i32),
            i(s.n_heads as i32),
            i(s.n_kv_heads as i32),
            i(s.head_dim as i32),
            f(s.scale),
            i(s.window as i32),
            anc_buf.as_ref().map_or(0, |b| b.ptr),
            sink_buf.as_ref().map_or(0, |b| b.ptr),
            i(seq.tree_from as i32),
        ];
        self.gpu.launch(
            "attention",
            (s.n_heads as u32, m as u32, 1),
            ATTENTION_THREADS,
            0,
            &args,
        )?;
        Ok(out)
    }

    pub(super) fn sample_on_device(
        &self,
        logits: &mut CudaTensor,
        jobs: &[Option<RowPick<'_>>],
    ) -> Result<Vec<Option<u32>>> {
        ensure(jobs.len() == logits.rows, "sample_rows", || {
            format!("{} jobs for {} rows", jobs.len(), logits.rows)
        })?;
        if jobs.is_empty() {
            return Ok(Vec::new());
        }
        // Per row (kernels/cuda/sample.cu): temperature, top-p, penalty, draw; top-k (-1: no job),
        // the row's span of `seen`.
        let (mut fp, mut ip, mut seen) = (Vec::new(), Vec::new(), Vec::<i32>::new());
        for job in jobs {
            match job {
                None => {
                    fp.extend([0.0f32, 1.0, 1.0, 0.0]);
                    ip.extend([-1i32, 0, 0]);
                }
                Some(j) => {
                    let p = &j.pick;
                    fp.extend([p.temperature, p.top_p, p.repetition_penalty, j.r]);
                    let top_k = i32::try_from(p.top_k).unwrap_or(i32::MAX);
                    let start = seen.len() as i32;
                    seen.extend(j.seen.iter().map(|&t| t as i32));
                    ip.extend([top_k, start, seen.len() as i32]);
                }
            }
        }
        self.gpu.bind()?;
        let (dfp, dip) = (self.upload_small(&fp)?, self.upload_small(&ip)?);
        let dseen = self.upload_small(if seen.is_empty() { &[0i32][..] } else { &seen })?;
        let out = DevBuf::ordered(&self.gpu, jobs.len() * 4)?;
        let args = [logits.buf.ptr, i(logits.cols as i32), dfp.ptr, dip.ptr, dseen.ptr, out.ptr];
        self.gpu.launch("sample_rows", (jobs.len() as u32, 1, 1), 256, 0, &args)?;
        let mut host = vec![0i32; jobs.len()];
        self.read(out.ptr, &mut host)?;
        host.iter()
            .enumerate()
            .map(|(r, &t)| match t {
                -2 => Err(Error::NonFinite(format!("row {r}: a logit is not finite"))),
                -1 => Ok(None),
                t => Ok(Some(t as u32)),
            })
            .collect()
    }

    pub(super) fn write_block(&self, cache: &mut CudaKv, block: u32, bytes: &[u8]) -> Result<()> {
        self.gpu.bind()?;
        let n = cache.layout.block * cache.stride;
        let bufs = cache.bufs();
        let size = bufs.len().max(1) * n;
        ensure((block as usize) < cache.layout.blocks && bytes.len() == size, "kv_write", || {
            format!(
                "{} bytes for block {block} of a pool of {} blocks of {size} bytes",
                bytes.len(),
                cache.layout.blocks,
            )
        })?;
        let at = (block as usize * n) as u64;
        for (buf, src) in bufs.iter().zip(bytes.chunks_exact(n.max(1))) {
            // SAFETY: `buf` holds `n` bytes at `at` inside the pool (block < blocks); pageable `src`
            // is staged by the driver before the call returns.
            unsafe { result::memcpy_htod_async(buf.ptr + at, src, self.gpu.compute) }
                .map_err(derr("copying to the device"))?;
        }
        if !bufs.is_empty() {
            self.gpu.sync_compute()?;
        }
        Ok(())
    }
}
