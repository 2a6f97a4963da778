//! Every CUDA kernel against the CPU backend on fresh random inputs (ignored, saying why, where no
//! CUDA driver is installed). Errors are relative: ‖gpu − cpu‖ / ‖cpu‖.

use super::test_data::{rel, weight_bytes, Rng, DTYPES};
use super::{CudaBackend, GemmPrecision};
use crate::backend::{AttnShape, Backend};
use crate::cpu::CpuBackend;
use crate::rope::RopeTable;
use crate::Precision::F32;
use layerstream_types::{DType, RopeConfig, RopeScaling};

/// The GPU backend at GEMM precision `p`, or a failure naming why (these tests are ignored, at
/// build time, where no CUDA driver is installed: build.rs `have_gpu`).
fn gpu(p: GemmPrecision) -> CudaBackend {
    CudaBackend::with_precision(0, p)
        .unwrap_or_else(|e| panic!("the CUDA driver is installed but no GPU could be opened: {e}"))
}

#[test]
#[cfg_attr(not(have_gpu), ignore = "needs a GPU (no CUDA driver on this machine)")]
fn matmul_of_every_dtype_matches_cpu_on_the_matvec_and_gemm_paths() {
    for (prec, tol) in
        [(GemmPrecision::F32, 1e-5), (GemmPrecision::F16, 2e-3), (GemmPrecision::Bf16, 8e-3)]
    {
        let g = gpu(prec);
        let mut rng = Rng(prec as u64 + 11);
        let (n, k) = (300, 512);
        for dtype in DTYPES {
            let bytes = weight_bytes(dtype, n, k, &mut rng);
            let (wc, wg) = (
                CpuBackend::default().weight("w", dtype, &[n, k], &bytes).unwrap(),
                g.weight("w", dtype, &[n, k], &bytes).unwrap(),
            );
            for m in [1, 3, 8, 9, 40] {
                let x = rng.vec(m * k);
                let want = CpuBackend::default()
                    .matmul(&CpuBackend::default().from_host(&x, m, k).unwrap(), &wc, F32)
                    .unwrap()
                    .data;
                let got = g
                    .to_host(&g.matmul(&g.from_host(&x, m, k).unwrap(), &wg, F32).unwrap())
                    .unwrap();
                // The matvec path (m <= 8) is f32 whatever the GEMM precision.
                let t = if m <= 8 { 1e-5 } else { tol };
                let e = rel(&got, &want);
                assert!(e < t, "{dtype} m={m} {prec:?}: relative error {e:e}");
            }
        }
    }
}

/// A weight larger than the dequantization scratch is multiplied in chunks of rows; bf16 GEMMs keep
/// activations that f16 cannot hold (|x| > 65504) finite.
#[test]
#[cfg_attr(not(have_gpu), ignore = "needs a GPU (no CUDA driver on this machine)")]
fn gemm_in_scratch_chunks_and_bf16_range() {
    let c = CpuBackend::default();
    let mut rng = Rng(31);
    let k = 4096;
    let n = super::backend::SCRATCH_ELEMS / k + 300;
    let bytes = weight_bytes(DType::Q4K, n, k, &mut rng);
    let wc = c.weight("w", DType::Q4K, &[n, k], &bytes).unwrap();
    let m = 12;
    for (scale, precisions) in [
        (1.0f32, &[GemmPrecision::F32, GemmPrecision::Bf16][..]),
        (1e5, &[GemmPrecision::Bf16][..]),
    ] {
        let x: Vec<f32> = rng.vec(m * k).iter().map(|v| v * scale).collect();
        let want = c.matmul(&c.from_host(&x, m, k).unwrap(), &wc, F32).unwrap().data;
        for &p in precisions {
            let g = gpu(p);
            let got = g
                .to_host(
                    &g.matmul(
                        &g.from_host(&x, m, k).unwrap(),
                        &g.weight("w", DType::Q4K, &[n, k], &bytes).unwrap(),
                        F32,
                    )
                    .unwrap(),
                )
                .unwrap();
            let e = rel(&got, &want);
            let tol = if p == GemmPrecision::F32 { 1e-5 } else { 8e-3 };
            assert!(
                got.iter().all(|v| v.is_finite()) && e < tol,
                "{p:?} n={n} k={k} scale {scale}: relative error {e:e}"
            );
        }
    }
}

#[test]
#[cfg_attr(not(have_gpu), ignore = "needs a GPU (no CUDA driver on this machine)")]
fn norms_rope_activations_embedding_and_argmax_match_cpu() {
    let g = gpu(GemmPrecision::F32);
    let c = CpuBackend::default();
    let mut rng = Rng(5);
    let (rows, cols, hd) = (7, 256, 64);
    let x = rng.vec(rows * cols);
    let (xc, xg) = (c.from_host(&x, rows, cols).unwrap(), g.from_host(&x, rows, cols).unwrap());
    for (dtype, width) in [(DType::F32, cols), (DType::F32, hd), (DType::F16, cols)] {
        let w = weight_bytes(dtype, 1, width, &mut rng);
        let (wc, wg) = (
            c.weight("n", dtype, &[width], &w).unwrap(),
            g.weight("n", dtype, &[width], &w).unwrap(),
        );
        let e = rel(
            &g.to_host(&g.rms_norm(&xg, &wg, 1e-5).unwrap()).unwrap(),
            &c.rms_norm(&xc, &wc, 1e-5).unwrap().data,
        );
        assert!(e < 1e-6, "rms_norm {dtype} width {width}: {e:e}");
        let (mut bc, mut bg) =
            (c.from_host(&x, rows, cols).unwrap(), g.from_host(&x, rows, cols).unwrap());
        if width == cols {
            c.add_bias(&mut bc, &wc).unwrap();
            g.add_bias(&mut bg, &wg).unwrap();
            assert!(rel(&g.to_host(&bg).unwrap(), &bc.data) < 1e-7, "add_bias {dtype}");
        }
    }
    let scaled = RopeConfig {
        theta: 500000.0,
        scaling: Some(RopeScaling::Llama3 {
            factor: 8.0,
            low_freq_factor: 1.0,
            high_freq_factor: 4.0,
            original_max_position_embeddings: 8192.0,
        }),
    };
    let yarn = RopeConfig { theta: 150000.0, scaling: Some(crate::rope::gpt_oss_yarn()) };
    for cfg in [RopeConfig { theta: 10000.0, scaling: None }, scaled, yarn] {
        let table = RopeTable::new(&cfg, hd);
        let pos: Vec<usize> = (0..rows).map(|r| r * 997 + 3).collect();
        let (mut rc, mut rg) =
            (c.from_host(&x, rows, cols).unwrap(), g.from_host(&x, rows, cols).unwrap());
        c.rope(&mut rc, &pos, &table).unwrap();
        g.rope(&mut rg, &pos, &table).unwrap();
        let e = rel(&g.to_host(&rg).unwrap(), &rc.data);
        assert!(e < 1e-6, "rope {cfg:?}: {e:e}");
    }
    let y = rng.vec(rows * cols);
    let (yc, yg) = (c.from_host(&y, rows, cols).unwrap(), g.from_host(&y, rows, cols).unwrap());
    assert!(
        rel(
            &g.to_host(&g.silu_mul(&xg, &yg).unwrap()).unwrap(),
            &c.silu_mul(&xc, &yc).unwrap().data
        ) < 1e-6,
        "silu_mul"
    );
    // BitNet's squared-ReLU gate and BitLinear's 8-bit rows, a GPTQ act-order permutation.
    assert_eq!(
        g.to_host(&g.relu2_mul(&xg, &yg).unwrap()).unwrap(),
        c.relu2_mul(&xc, &yc).unwrap().data,
        "relu2_mul"
    );
    assert!(
        rel(
            &g.to_host(&g.swiglu_clamp_mul(&xg, &yg, 1.702, 7.0).unwrap()).unwrap(),
            &c.swiglu_clamp_mul(&xc, &yc, 1.702, 7.0).unwrap().data
        ) < 1e-6,
        "swiglu_clamp_mul"
    );
    assert_eq!(
        g.to_host(&g.concat_cols(&[&g.cols(&xg, 3, 17).unwrap(), &yg]).unwrap()).unwrap(),
        c.concat_cols(&[&c.cols(&xc, 3, 17).unwrap(), &yc]).unwrap().data,
        "cols, concat_cols"
    );
    assert_eq!(
        g.to_host(&g.quant_rows_8bit(&xg).unwrap()).unwrap(),
        c.quant_rows_8bit(&xc).unwrap().data,
        "quant_rows_8bit"
    );
    let perm: Vec<u32> = (0..cols as u32).rev().collect();
    assert_eq!(
        g.to_host(&g.permute_cols(&xg, &perm).unwrap()).unwrap(),
        c.permute_cols(&xc, &perm).unwrap().data,
        "permute_cols"
    );
    let (mut ac, mut ag) =
        (c.from_host(&x, rows, cols).unwrap(), g.from_host(&x, rows, cols).unwrap());
    c.add(&mut ac, &yc).unwrap();
    g.add(&mut ag, &yg).unwrap();
    assert_eq!(g.to_host(&ag).unwrap(), ac.data, "add");
    let got_rows = g
        .to_host(&g.concat_rows(&[g.rows(&xg, 5, 2).unwrap(), g.rows(&xg, 0, 1).unwrap()]).unwrap())
        .unwrap();
    assert_eq!(got_rows, [&x[5 * cols..7 * cols], &x[..cols]].concat(), "rows/concat_rows");
    // Mixture-of-experts rows: gathered, then added back scaled.
    let idx = [6usize, 1, 3];
    assert_eq!(
        g.to_host(&g.gather_rows(&xg, &idx).unwrap()).unwrap(),
        c.gather_rows(&xc, &idx).unwrap().data,
        "gather_rows"
    );
    let (e3c, e3g) = (c.rows(&yc, 0, 3).unwrap(), g.rows(&yg, 0, 3).unwrap());
    let (mut ac, mut ag) =
        (c.from_host(&x, rows, cols).unwrap(), g.from_host(&x, rows, cols).unwrap());
    c.add_rows_scaled(&mut ac, &e3c, &idx, &[0.5, 0.25, 2.0]).unwrap();
    g.add_rows_scaled(&mut ag, &e3g, &idx, &[0.5, 0.25, 2.0]).unwrap();
    // (The GPU may fuse the multiply-add: equal to rounding.)
    assert!(rel(&g.to_host(&ag).unwrap(), &ac.data) < 1e-6, "add_rows_scaled");
    for dtype in [DType::Q8_0, DType::Q4K, DType::F16] {
        let table = weight_bytes(dtype, 50, cols, &mut rng);
        let (tc, tg) = (
            c.weight("e", dtype, &[50, cols], &table).unwrap(),
            g.weight("e", dtype, &[50, cols], &table).unwrap(),
        );
        let ids = [49, 0, 7, 7];
        assert!(
            rel(
                &g.to_host(&g.embedding(&tg, &ids).unwrap()).unwrap(),
                &c.embedding(&tc, &ids).unwrap().data
            ) < 1e-7,
            "embedding {dtype}"
        );
        assert!(g.embedding(&tg, &[50]).is_err(), "out-of-vocab id must fail");
    }
    let mut logits = rng.vec(3 * 49152);
    logits[49152 + 40000] = 5.0;
    logits[2 * 49152 + 7] = 5.0;
    logits[2 * 49152 + 9] = 5.0; // tie: the first wins
    let lg = g.from_host(&logits, 3, 49152).unwrap();
    assert_eq!(
        g.argmax_rows(&lg).unwrap(),
        c.argmax_rows(&c.from_host(&logits, 3, 49152).unwrap()).unwrap()
    );
    assert_eq!(g.argmax_rows(&lg).unwrap()[1..], [40000, 7]);
    // A row of NaNs (what an overflowed activation leaves) is an error naming the row, not a token.
    let mut bad = logits.clone();
    bad[49152..2 * 49152].fill(f32::NAN);
    let e = g.argmax_rows(&g.from_host(&bad, 3, 49152).unwrap()).unwrap_err().to_string();
    assert!(e.contains("non-finite") && e.contains("row 1"), "{e}");
}

/// MLA's keys-only pools (`shared_kv`: the values are the keys' first columns) on the GPU equal
/// the CPU's, f32 and q8_0 (rotated), prefill then decode; a block read back holds keys only.
#[test]
#[cfg_attr(not(have_gpu), ignore = "needs a GPU (no CUDA driver on this machine)")]
fn shared_kv_attention_matches_cpu() {
    let g = gpu(GemmPrecision::F32);
    let c = CpuBackend::default();
    let s = AttnShape { shared_kv: true, ..AttnShape::new(8, 1, 576) };
    let (qd, kvd) = (8 * 576, 576);
    let mut rng = Rng(11);
    let table: Vec<u32> = (0..6).map(|b| (b * 5 + 1) % 7).collect();
    for dtype in [DType::F32, DType::Q8_0] {
        let layout = crate::KvLayout::new(dtype, 16, 7, s).unwrap();
        let (mut kc, mut kg) = (c.kv_cache(s, layout).unwrap(), g.kv_cache(s, layout).unwrap());
        let mut start = 0;
        for m in [70, 1, 1, 2] {
            let (q, k) = (rng.vec(m * qd), rng.vec(m * kvd));
            let seq = crate::KvSeq::new(&table, start);
            let ct = |d: &[f32], cols| c.from_host(d, m, cols).unwrap();
            let gt = |d: &[f32], cols| g.from_host(d, m, cols).unwrap();
            let (ck, gk) = (ct(&k, kvd), gt(&k, kvd));
            let want = c.attention(&ct(&q, qd), &ck, &ck, &mut kc, seq, s, None, None).unwrap();
            let got = g.attention(&gt(&q, qd), &gk, &gk, &mut kg, seq, s, None, None).unwrap();
            let e = rel(&g.to_host(&got).unwrap(), &want.data);
            assert!(e < 1e-5, "{dtype:?} shared-kv attention m={m} at {start}: {e:e}");
            start += m;
        }
        assert_eq!(
            g.kv_read(&kg, table[1]).unwrap().len(),
            c.kv_read(&kc, table[1]).unwrap().len()
        );
    }
}

/// Paged attention on the GPU equals the CPU's for every KV dtype: a 250-position prefill, then
/// single tokens across block boundaries, through a scrambled block table.
#[test]
#[cfg_attr(not(have_gpu), ignore = "needs a GPU (no CUDA driver on this machine)")]
fn paged_attention_prefill_then_decode_matches_cpu_for_every_kv_dtype() {
    let g = gpu(GemmPrecision::F32);
    let c = CpuBackend::default();
    let s = AttnShape::new(8, 2, 64);
    let (qd, kvd) = (512, 128);
    let mut rng = Rng(9);
    let table: Vec<u32> = (0..17).map(|b| (b * 5 + 2) % 19).collect();
    // gpt-oss's attention sinks on every other KV dtype.
    let sink_logits: Vec<f32> = (0..8).map(|h| h as f32 * 0.4 - 1.5).collect();
    for (n, dtype) in crate::kv::KV_DTYPES.into_iter().enumerate() {
        let sinks = (n % 2 == 1).then_some(&sink_logits[..]);
        let layout = crate::KvLayout::new(dtype, 16, 19, s).unwrap();
        let (mut kc, mut kg) = (c.kv_cache(s, layout).unwrap(), g.kv_cache(s, layout).unwrap());
        let mut start = 0;
        for m in [250, 1, 1, 1, 1, 1, 1, 1, 1, 3] {
            let (q, k, v) = (rng.vec(m * qd), rng.vec(m * kvd), rng.vec(m * kvd));
            let seq = crate::KvSeq::new(&table, start);
            let ct = |d: &[f32], cols| c.from_host(d, m, cols).unwrap();
            let gt = |d: &[f32], cols| g.from_host(d, m, cols).unwrap();
            let want = c
                .attention(&ct(&q, qd), &ct(&k, kvd), &ct(&v, kvd), &mut kc, seq, s, None, sinks)
                .unwrap();
            let got = g
                .attention(&gt(&q, qd), &gt(&k, kvd), &gt(&v, kvd), &mut kg, seq, s, None, sinks)
                .unwrap();
            let e = rel(&g.to_host(&got).unwrap(), &want.data);
            assert!(e < 1e-5, "{dtype:?} attention m={m} at {start}: {e:e}");
            start += m;
        }
        // A block read out of the GPU pool and written into an unused one reads back the same.
        let bytes = g.kv_read(&kg, table[3]).unwrap();
        g.kv_write(&mut kg, 11, &bytes).unwrap();
        assert_eq!(g.kv_read(&kg, 11).unwrap(), bytes, "{dtype:?}");
        if dtype == DType::F32 {
            assert_eq!(bytes, c.kv_read(&kc, table[3]).unwrap(), "the CPU stored the same rows");
        }
    }
}

/// Rows stored into a quantized pool on the GPU (rotated, then quantized in blocks of 32) hold the
/// CPU's bytes, block by block: a 37-row prefill then one row, for Q8_0 and Q4_0 (a mismatch names
/// the first differing byte: kv_store, not attention, is then at fault).
#[test]
#[cfg_attr(not(have_gpu), ignore = "needs a GPU (no CUDA driver on this machine)")]
fn quantized_kv_rows_stored_on_the_gpu_hold_the_cpu_bytes() {
    let g = gpu(GemmPrecision::F32);
    let c = CpuBackend::default();
    let s = AttnShape::new(4, 2, 64);
    let (qd, kvd) = (256, 128);
    let mut rng = Rng(23);
    let table: Vec<u32> = vec![2, 0, 3, 1];
    for dtype in [DType::Q8_0, DType::Q4_0] {
        let layout = crate::KvLayout::new(dtype, 16, 4, s).unwrap();
        let (mut kc, mut kg) = (c.kv_cache(s, layout).unwrap(), g.kv_cache(s, layout).unwrap());
        for (at, m) in [(0, 37), (37, 1)] {
            let (q, k, v) = (rng.vec(m * qd), rng.vec(m * kvd), rng.vec(m * kvd));
            let seq = crate::KvSeq::new(&table, at);
            let ct = |d: &[f32], cols| c.from_host(d, m, cols).unwrap();
            let gt = |d: &[f32], cols| g.from_host(d, m, cols).unwrap();
            c.attention(&ct(&q, qd), &ct(&k, kvd), &ct(&v, kvd), &mut kc, seq, s, None, None)
                .unwrap();
            g.attention(&gt(&q, qd), &gt(&k, kvd), &gt(&v, kvd), &mut kg, seq, s, None, None)
                .unwrap();
        }
        // The two full blocks (the third holds 6 rows; the rest of it was never written).
        for b in &table[..2] {
            let (want, got) = (c.kv_read(&kc, *b).unwrap(), g.kv_read(&kg, *b).unwrap());
            assert_eq!(got.len(), want.len(), "{dtype:?} block {b}: sizes");
            let diff: Vec<usize> = (0..got.len()).filter(|&i| got[i] != want[i]).collect();
            assert!(
                diff.is_empty(),
                "{dtype:?} block {b}: {} of {} bytes differ, the first at {:?} (gpu {:?} cpu {:?})",
                diff.len(),
                got.len(),
                diff.first(),
                diff.first().map(|&i| got[i]),
                diff.first().map(|&i| want[i])
            );
        }
    }
}

/// Speculative verification's tree masks on the GPU equal the CPU's for every KV dtype: a token tree
/// (0 → {1, 2}, 1 → {3, 5}, 2 → 4) after a cached prefix, then the same tree grown by a later call
/// (its first 3 rows cached, the last 3 new, masks over all six).
#[test]
#[cfg_attr(not(have_gpu), ignore = "needs a GPU (no CUDA driver on this machine)")]
fn tree_attention_matches_cpu_for_every_kv_dtype() {
    let g = gpu(GemmPrecision::F32);
    let c = CpuBackend::default();
    let parents = [None, Some(0), Some(0), Some(1), Some(2), Some(1)];
    let anc = super::test_data::ancestor_masks(&parents);
    let mut rng = Rng(17);
    let table: Vec<u32> = (0..6).map(|b| (b * 3 + 1) % 8).collect();
    for (hd, dtype) in [64, 64, 320, 64, 576].into_iter().zip(crate::kv::KV_DTYPES) {
        let s = AttnShape::new(4, 2, hd);
        let (qd, kvd) = (4 * hd, 2 * hd);
        let layout = crate::KvLayout::new(dtype, 16, 8, s).unwrap();
        let (mut kc, mut kg) = (c.kv_cache(s, layout).unwrap(), g.kv_cache(s, layout).unwrap());
        let start = 37;
        // (start, rows, masks): the prefix, the whole tree, then the tree's last 3 rows.
        for (at, m, tree) in
            [(0, start, None), (start, 6, Some(&anc[..])), (start + 3, 3, Some(&anc[3..]))]
        {
            let (q, k, v) = (rng.vec(m * qd), rng.vec(m * kvd), rng.vec(m * kvd));
            let seq = crate::KvSeq { table: &table, start: at, tree_from: start.min(at) };
            let ct = |d: &[f32], cols| c.from_host(d, m, cols).unwrap();
            let gt = |d: &[f32], cols| g.from_host(d, m, cols).unwrap();
            let want = c
                .attention(&ct(&q, qd), &ct(&k, kvd), &ct(&v, kvd), &mut kc, seq, s, tree, None)
                .unwrap();
            let got = g
                .attention(&gt(&q, qd), &gt(&k, kvd), &gt(&v, kvd), &mut kg, seq, s, tree, None)
                .unwrap();
            let e = rel(&g.to_host(&got).unwrap(), &want.data);
            assert!(e < 1e-5, "{dtype:?} head_dim {hd} tree attention at {at}, {m} rows: {e:e}");
        }
    }
}

#[test]
#[cfg_attr(not(have_gpu), ignore = "needs a GPU (no CUDA driver on this machine)")]
fn streamed_layers_reuse_buffers_and_equal_resident_weights() {
    let g = gpu(GemmPrecision::F32);
    let mut rng = Rng(3);
    let (n, k) = (64, 256);
    let per = DType::Q4K.tensor_bytes(&[n, k]).unwrap();
    g.stream_buffers(2, 2 * per).unwrap();
    let x = rng.vec(2 * k);
    let xg = g.from_host(&x, 2, k).unwrap();
    let mut file = vec![0u8; 2 * per];
    let before = g.mem_info().unwrap().0;
    for round in 0..6 {
        file = [weight_bytes(DType::Q4K, n, k, &mut rng), weight_bytes(DType::Q4K, n, k, &mut rng)]
            .concat();
        g.register_host(&file).unwrap();
        let (blob, ms) = g.upload_blob(&file, true).unwrap();
        assert!(ms.unwrap() >= 0.0);
        let w2 = g.weight_in(&blob, "second", DType::Q4K, &[n, k], per..2 * per).unwrap();
        assert!(g.weight_in(&blob, "bad", DType::Q4K, &[n, k], per..3 * per).is_err());
        let resident = g.weight("r", DType::Q4K, &[n, k], &file[per..]).unwrap();
        let (a, b) = (
            g.to_host(&g.matmul(&xg, &w2, F32).unwrap()).unwrap(),
            g.to_host(&g.matmul(&xg, &resident, F32).unwrap()).unwrap(),
        );
        assert_eq!(a, b, "round {round}: streamed and resident weights differ");
        g.unregister_host(&file);
    }
    drop(file);
    // Six uploads through two buffers allocated nothing new (the pool's memory was taken before).
    let after = g.mem_info().unwrap().0;
    assert!(
        before.abs_diff(after) < 64 << 20,
        "device memory moved by {} bytes",
        before.abs_diff(after)
    );
    assert_eq!(g.registered_bytes(), 0);
}

/// `sample_rows` on the GPU picks the host's token (`sampling::choose`) from the same draw: exactly,
/// or — the GPU's `expf` and sums in another order moving a cumulative boundary by rounding — the
/// host's token for a draw within 1e-4; a row with more candidates than the kernel sorts comes back
/// `None`, and the host then samples it from the penalised row.
#[test]
#[cfg_attr(not(have_gpu), ignore = "needs a GPU (no CUDA driver on this machine)")]
fn device_sampling_picks_the_host_token() {
    use crate::backend::RowPick;
    use crate::sampling::{choose, Pick};
    let g = gpu(GemmPrecision::F32);
    let mut rng = Rng(57);
    let cols = 32_000;
    let picks = [
        Pick { temperature: 0.0, top_k: 0, top_p: 1.0, repetition_penalty: 1.3 },
        Pick { temperature: 0.8, top_k: 0, top_p: 1.0, repetition_penalty: 1.0 },
        Pick { temperature: 0.7, top_k: 40, top_p: 1.0, repetition_penalty: 1.1 },
        Pick { temperature: 0.7, top_k: 40, top_p: 0.9, repetition_penalty: 1.0 },
        Pick { temperature: 1.0, top_k: 0, top_p: 0.9, repetition_penalty: 1.0 },
        Pick { temperature: 1.0, top_k: 0, top_p: 0.999, repetition_penalty: 1.0 },
    ];
    for round in 0..8 {
        let rows = picks.len();
        let x: Vec<f32> = (0..rows * cols).map(|_| rng.f() * 4.0).collect();
        let seen: Vec<Vec<u32>> = (0..rows)
            .map(|_| {
                let mut v: Vec<u32> = (0..30).map(|_| rng.u32() % cols as u32).collect();
                v.sort_unstable();
                v.dedup();
                v
            })
            .collect();
        let draws: Vec<f32> = (0..rows).map(|_| (rng.f() + 1.0) / 2.0 * 0.999).collect();
        let jobs: Vec<Option<RowPick>> = (0..rows)
            .map(|i| Some(RowPick { pick: picks[i], r: draws[i], seen: &seen[i] }))
            .collect();
        let mut t = g.from_host(&x, rows, cols).unwrap();
        let got = g.sample_rows(&mut t, &jobs).unwrap();
        let penalised = g.to_host(&t).unwrap();
        for i in 0..rows {
            let row = &x[i * cols..(i + 1) * cols];
            let host = |r: f32| choose(&mut row.to_vec(), &seen[i], &picks[i], r);
            match got[i] {
                Some(tok) => assert!(
                    [0.0, 1e-4, -1e-4].iter().any(|d| host(draws[i] + d) == tok),
                    "round {round}, {:?}: device {tok}, host {}",
                    picks[i],
                    host(draws[i])
                ),
                None => {
                    let mut p = penalised[i * cols..(i + 1) * cols].to_vec();
                    let tok = choose(&mut p, &[], &picks[i], draws[i]);
                    assert_eq!(tok, host(draws[i]), "round {round}: a handed-back row");
                }
            }
        }
    }
}
