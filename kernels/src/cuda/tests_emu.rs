//! The `.cu` kernels run on the host under `kernels/emu` — a thread per CUDA thread, real warp
//! shuffles and block barriers, the launch shapes of `backend.rs` — and are compared with the CPU
//! backend, so their arithmetic, indexing and reductions are checked on machines without a GPU (CI):
//! every kernel — the quantized matvec and dequantize kernels of every dtype, attention, RMSNorm,
//! argmax, device sampling, the embedding gather, RoPE (default and llama3-scaled), SiLU·mul, the adds, the
//! mixture-of-experts row gather and scaled scatter-add, and f32→f16.
//! Skipped, saying why, where no C++20 compiler is installed.

use super::source::{dtype_code, matvec_q8_supports};
use super::test_data::{rel, weight_bytes, Rng, DTYPES};
use crate::backend::{AttnShape, Backend};
use crate::cpu::int8;
use crate::cpu::CpuBackend;
use crate::quant::dequant_row;
use crate::RopeTable;
use half::{bf16, f16};
use layerstream_types::DType;
use layerstream_types::{RopeConfig, RopeScaling};
use std::path::{Path, PathBuf};
use std::process::Command;

/// One emulator program built into a temporary directory.
struct Emu {
    dir: tempfile::TempDir,
    exe: PathBuf,
}

impl Emu {
    /// Builds `kernels/emu/<main>`; `None` (with the reason printed) when there is no C++ compiler.
    fn build(main: &str) -> Option<Emu> {
        let dir = tempfile::tempdir().unwrap();
        let cxx = std::env::var("CXX").unwrap_or_else(|_| "c++".into());
        let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("emu").join(main);
        let exe = dir.path().join("emu");
        let out = match Command::new(&cxx)
            .args(["-std=c++20", "-O1", "-pthread", "-Wall", "-Wno-unknown-pragmas", "-o"])
            .arg(&exe)
            .arg(&src)
            .output()
        {
            Ok(out) => out,
            Err(e) => {
                eprintln!("skipping the emulated CUDA kernel test: cannot run {cxx:?} ({e})");
                return None;
            }
        };
        assert!(
            out.status.success(),
            "{cxx} failed on {}:\n{}",
            src.display(),
            String::from_utf8_lossy(&out.stderr)
        );
        Some(Emu { dir, exe })
    }

    /// Runs the program with `args`, `input` as its input file; returns its output file.
    fn run(&self, args: &[String], input: &[u8]) -> Vec<u8> {
        let (inp, out) = (self.dir.path().join("in"), self.dir.path().join("out"));
        std::fs::write(&inp, input).unwrap();
        let status = Command::new(&self.exe).args(args).arg(&inp).arg(&out).status().unwrap();
        assert!(status.success(), "emulator {args:?}: {status}");
        std::fs::read(&out).unwrap()
    }
}

fn args<const N: usize>(first: &str, nums: [usize; N]) -> Vec<String> {
    std::iter::once(first.to_string()).chain(nums.iter().map(|v| v.to_string())).collect()
}

fn bytes_of(parts: &[&[f32]]) -> Vec<u8> {
    parts.iter().flat_map(|p| p.iter().flat_map(|v| v.to_le_bytes())).collect()
}

fn f32s(bytes: &[u8]) -> Vec<f32> {
    bytes.chunks_exact(4).map(|c| f32::from_le_bytes(c.try_into().unwrap())).collect()
}

#[test]
fn emulated_quant_kernels_match_cpu_for_every_dtype() {
    let Some(emu) = Emu::build("quant_main.cpp") else { return };
    let mut rng = Rng(23);
    let n = 12;
    for dtype in DTYPES {
        // Float formats also at a width that is not a multiple of 8 (the per-element tail paths).
        // 2048: several 32-weight units per lane in matvec32_*.
        let widths: &[usize] =
            if dtype.block_elems() == 1 { &[512, 516, 2048] } else { &[512, 2048] };
        for &k in widths {
            for m in [1, 3, 8] {
                let w = weight_bytes(dtype, n, k, &mut rng);
                let x = rng.vec(m * k);
                let mut input = w.clone();
                input.extend(bytes_of(&[&x]));
                let out = emu.run(&args(&dtype_code(dtype).to_string(), [m, n, k]), &input);
                assert_eq!(out.len(), (3 * m * n + n * k) * 4 + n * k * 4, "emulator output size");
                let (y, rest) = out.split_at(m * n * 4);
                let (y32, rest) = rest.split_at(m * n * 4);
                let (y8, rest) = rest.split_at(m * n * 4);
                let (d32, rest) = rest.split_at(n * k * 4);
                let (d16, dbf) = rest.split_at(n * k * 2);
                let d16: Vec<f32> = d16
                    .chunks_exact(2)
                    .map(|c| f16::from_le_bytes([c[0], c[1]]).to_f32())
                    .collect();
                let dbf: Vec<f32> = dbf
                    .chunks_exact(2)
                    .map(|c| bf16::from_le_bytes([c[0], c[1]]).to_f32())
                    .collect();

                let cw = CpuBackend::default().weight("w", dtype, &[n, k], &w).unwrap();
                let want_y = CpuBackend::default()
                    .matmul(
                        &CpuBackend::default().from_host(&x, m, k).unwrap(),
                        &cw,
                        crate::Precision::F32,
                    )
                    .unwrap()
                    .data;
                let mut want_d = vec![0f32; n * k];
                for (row, o) in
                    w.chunks_exact(dtype.row_bytes(k).unwrap()).zip(want_d.chunks_exact_mut(k))
                {
                    dequant_row(dtype, row, o);
                }
                let want_d16: Vec<f32> =
                    want_d.iter().map(|v| f16::from_f32(*v).to_f32()).collect();
                let want_dbf: Vec<f32> =
                    want_d.iter().map(|v| bf16::from_f32(*v).to_f32()).collect();
                let (ey, e32, e16, ebf) = (
                    rel(&f32s(y), &want_y),
                    rel(&f32s(d32), &want_d),
                    rel(&d16, &want_d16),
                    rel(&dbf, &want_dbf),
                );
                assert!(ey < 1e-5, "matvec {dtype} m={m} k={k}: relative error {ey:e}");
                if k % 32 == 0 {
                    let e = rel(&f32s(y32), &want_y);
                    assert!(e < 1e-5, "matvec32 {dtype} m={m} k={k}: relative error {e:e}");
                }
                if matvec_q8_supports(dtype) {
                    // The CPU's 8-bit reference: the same quantized activations, the same integers.
                    let rb = dtype.row_bytes(k).unwrap();
                    let xq: Vec<_> = x.chunks_exact(k).map(int8::quantize_row).collect();
                    let want8: Vec<f32> = xq
                        .iter()
                        .flat_map(|xr| {
                            w.chunks_exact(rb).map(|row| int8::dot_scalar(dtype, row, xr))
                        })
                        .collect();
                    let e = rel(&f32s(y8), &want8);
                    assert!(e < 1e-5, "matvec_q8 {dtype} m={m} k={k}: relative error {e:e}");
                } else {
                    assert!(f32s(y8).iter().all(|v| v.is_nan()), "{dtype}: no 8-bit kernel");
                }
                assert!(e32 < 1e-6, "dequant_f32 {dtype} k={k}: relative error {e32:e}");
                assert!(e16 < 1e-6, "dequant_f16 {dtype} k={k}: relative error {e16:e}");
                assert!(ebf < 1e-6, "dequant_bf16 {dtype} k={k}: relative error {ebf:e}");
            }
        }
    }
}

/// Attention of `m` new rows after `start` cached ones in a pool of `dtype` (blocks of 16, the
/// sequence's table scrambled), on the CPU and under the emulator (`kv_store` then `attention`):
/// their relative difference.
#[allow(clippy::too_many_arguments)]
fn paged(
    emu: &Emu,
    c: &CpuBackend,
    rng: &mut Rng,
    s: AttnShape,
    (start, m): (usize, usize),
    dtype: DType,
    scalar: usize,
    (tree, sinks): (Option<&[u64]>, Option<&[f32]>),
    tree_from: usize,
) -> f64 {
    let (qd, kvd, bs) = (s.n_heads * s.head_dim, s.n_kv_heads * s.head_dim, 16);
    let nb = (start + m).div_ceil(bs);
    let table: Vec<u32> = (0..nb as u32).map(|b| (b * 7 + 3) % (nb as u32 + 5)).collect();
    let layout = crate::KvLayout::new(dtype, bs, nb + 5, s).unwrap();
    let mut pool = c.kv_cache(s, layout).unwrap();
    let (pk, pv) = (rng.vec(start * kvd), rng.vec(start * kvd));
    let t = |d: &[f32], rows, cols| c.from_host(d, rows, cols).unwrap();
    if start > 0 {
        let seq = crate::KvSeq::new(&table, 0);
        let pq = rng.vec(start * qd);
        let (q, k, v) = (t(&pq, start, qd), t(&pk, start, kvd), t(&pv, start, kvd));
        c.attention(&q, &k, &v, &mut pool, seq, s, None, sinks).unwrap();
    }
    let (q, k, v) = (rng.vec(m * qd), rng.vec(m * kvd), rng.vec(m * kvd));
    let seq = crate::KvSeq { table: &table, start, tree_from };
    let (tq, tk, tv) = (t(&q, m, qd), t(&k, m, kvd), t(&v, m, kvd));
    let want = c.attention(&tq, &tk, &tv, &mut pool, seq, s, tree, sinks).unwrap().data;
    let mut input = bytes_of(&[&q, &pk, &k, &pv, &v]);
    input.extend(table.iter().flat_map(|b| b.to_le_bytes()));
    input.extend(tree.unwrap_or(&[]).iter().flat_map(|a| a.to_le_bytes()));
    input.extend(sinks.unwrap_or(&[]).iter().flat_map(|a| a.to_le_bytes()));
    let code = dtype_code(dtype) as usize;
    let nums = [start, m, s.n_heads, s.n_kv_heads, s.head_dim, super::ATTENTION_THREADS as usize];
    let more = [
        s.window,
        scalar,
        bs,
        code,
        nb,
        tree.is_some() as usize,
        sinks.is_some() as usize,
        tree_from,
    ];
    let all: Vec<usize> = nums.iter().chain(&more).copied().collect();
    let got = f32s(&emu.run(&args::<14>("attention", all.try_into().unwrap()), &input));
    rel(&got, &want)
}

#[test]
fn emulated_attention_rms_norm_and_argmax_match_cpu() {
    let Some(emu) = Emu::build("ops_main.cpp") else { return };
    let c = CpuBackend::default();
    let mut rng = Rng(31);
    // Attention: prefill after a cached prefix, decode, and contexts over several 128-position tiles
    // (the online softmax rescales); head_dim 64 (a dimension per thread, half the threads idle), 320
    // (three per thread, the last partly), 512 (four per thread) and 576 (DeepSeek-V3's MLA row: five
    // per thread, the most the backend accepts being 640).
    // Then sliding windows (Gemma: some rows see the whole context, some only its end) with a
    // score scale other than 1/√head_dim.
    // Every KV dtype, through a block table that is neither in order nor starting at 0.
    let dtypes = [DType::F32, DType::F16, DType::Bf16, DType::Q8_0, DType::Q4_0];
    for (n, (start, m, hd, window, scalar)) in [
        (0, 5, 64, 0, 64),
        (5, 3, 64, 0, 64),
        (17, 1, 64, 0, 64),
        (300, 2, 64, 0, 64),
        (130, 2, 320, 0, 320),
        (40, 1, 512, 0, 512),
        (33, 2, 576, 0, 192),
        (0, 9, 64, 4, 48),
        (150, 3, 64, 140, 48),
    ]
    .into_iter()
    .enumerate()
    {
        let s =
            AttnShape { window, scale: 1.0 / (scalar as f32).sqrt(), ..AttnShape::new(4, 2, hd) };
        // Every other case with gpt-oss's attention sinks (one logit per head).
        let sinks = [0.5f32, -2.0, 1.5, 0.0];
        let sinks = (n % 2 == 1).then_some(&sinks[..]);
        let e =
            paged(&emu, &c, &mut rng, s, (start, m), dtypes[n % 5], scalar, (None, sinks), start);
        assert!(e < 1e-5, "attention start={start} m={m} sinks {sinks:?}: relative error {e:e}");
    }
    // A token tree after a cached prefix: 0 → {1, 2}, 1 → {3, 5}, 2 → 4 (ancestor masks).
    let parents = [None, Some(0), Some(0), Some(1), Some(2), Some(1)];
    let anc = super::test_data::ancestor_masks(&parents);
    for (n, (start, hd)) in [(0, 64), (37, 64), (140, 320)].into_iter().enumerate() {
        let s = AttnShape::new(4, 2, hd);
        let t = (Some(&anc[..]), None);
        let e = paged(&emu, &c, &mut rng, s, (start, anc.len()), dtypes[4 - n], hd, t, start);
        assert!(e < 1e-5, "tree attention start={start}: relative error {e:e}");
        // The same tree grown by a later call (a draft model's): its first 3 rows cached from
        // `start − 3`, the last 3 new, masks over all six.
        let t = (Some(&anc[3..]), None);
        let e = paged(&emu, &c, &mut rng, s, (start + 3, 3), dtypes[n], hd, t, start);
        assert!(e < 1e-5, "tree grown after 3 cached rows, start={start}: relative error {e:e}");
    }
    // RMSNorm over whole rows (256 threads) and per head (64 threads).
    let (rows, cols) = (3, 512);
    let x = rng.vec(rows * cols);
    for g in [cols, 64] {
        let w = rng.vec(g);
        let cw = c.weight("n", DType::F32, &[g], &bytes_of(&[&w])).unwrap();
        let want = c.rms_norm(&c.from_host(&x, rows, cols).unwrap(), &cw, 1e-5).unwrap().data;
        let e =
            rel(&f32s(&emu.run(&args("rms_norm", [rows, cols, g]), &bytes_of(&[&x, &w]))), &want);
        assert!(e < 1e-6, "rms_norm group {g}: relative error {e:e}");
    }
    // Argmax: the lowest index among equal maxima, as the CPU sampler picks.
    let (rows, cols) = (4, 1000);
    let mut x = rng.vec(rows * cols);
    // Ties within one thread's stride (40, 296) and across threads (700).
    for c in [700, 296, 40] {
        x[2 * cols + c] = 5.0;
    }
    x[3 * cols + 999] = 9.0;
    let want = c.argmax_rows(&c.from_host(&x, rows, cols).unwrap()).unwrap();
    let got: Vec<u32> = emu
        .run(&args("argmax", [rows, cols]), &bytes_of(&[&x]))
        .chunks_exact(4)
        .map(|b| u32::from_le_bytes(b.try_into().unwrap()))
        .collect();
    assert_eq!(got, want);
    assert_eq!((want[2], want[3]), (40, 999));
}

#[test]
fn emulated_elementwise_kernels_match_cpu() {
    let Some(emu) = Emu::build("ops_main.cpp") else { return };
    let c = CpuBackend::default();
    let mut rng = Rng(37);
    // Embedding: rows of every stored dtype gathered by id (repeats, the first and the last row).
    let (vocab, cols, ids) = (7, 512, [3u32, 0, 6, 3]);
    for dtype in DTYPES {
        let table = weight_bytes(dtype, vocab, cols, &mut rng);
        let want =
            c.embedding(&c.weight("e", dtype, &[vocab, cols], &table).unwrap(), &ids).unwrap().data;
        let mut input = table;
        input.extend(ids.iter().flat_map(|i| i.to_le_bytes()));
        let got =
            f32s(&emu.run(
                &args("embedding", [dtype_code(dtype) as usize, vocab, cols, ids.len()]),
                &input,
            ));
        assert_eq!(got, want, "embedding of {dtype:?} rows");
    }
    // RoPE at positions up to 100k, default, llama3- and YaRN-scaled frequencies (3 heads of 64 a
    // row; YaRN's attention factor multiplies cos and sin).
    let llama3 = RopeScaling::Llama3 {
        factor: 8.0,
        low_freq_factor: 1.0,
        high_freq_factor: 4.0,
        original_max_position_embeddings: 8192.0,
    };
    for scaling in [None, Some(llama3), Some(crate::rope::gpt_oss_yarn())] {
        let table = RopeTable::new(&RopeConfig { theta: 500_000.0, scaling: scaling.clone() }, 64);
        let positions = [0usize, 1, 17, 8191, 100_000];
        let (rows, cols) = (positions.len(), 3 * 64);
        let x = rng.vec(rows * cols);
        let mut want = c.from_host(&x, rows, cols).unwrap();
        c.rope(&mut want, &positions, &table).unwrap();
        let mut input = bytes_of(&[&x]);
        input.extend(positions.iter().flat_map(|&p| (p as i32).to_le_bytes()));
        input.extend(bytes_of(&[&table.inv_freq, &[table.attn_factor]]));
        let e = rel(&f32s(&emu.run(&args("rope", [rows, cols, 64]), &input)), &want.data);
        assert!(e < 1e-6, "rope ({scaling:?}): relative error {e:e}");
    }
    // Element-wise over a length that leaves the last block partly idle.
    let (rows, cols) = (3, 300);
    let n = rows * cols;
    let (x, y) = (rng.vec(n).iter().map(|v| v * 8.0).collect::<Vec<_>>(), rng.vec(n));
    let t = |d: &[f32]| c.from_host(d, rows, cols).unwrap();
    let want = c.silu_mul(&t(&x), &t(&y)).unwrap().data;
    let e = rel(&f32s(&emu.run(&args("silu_mul", [n]), &bytes_of(&[&x, &y]))), &want);
    assert!(e < 1e-6, "silu_mul: relative error {e:e}");
    let want = c.gelu_tanh_mul(&t(&x), &t(&y)).unwrap().data;
    let e = rel(&f32s(&emu.run(&args("gelu_tanh_mul", [n]), &bytes_of(&[&x, &y]))), &want);
    assert!(e < 1e-6, "gelu_tanh_mul: relative error {e:e}");
    let want = c.relu2_mul(&t(&x), &t(&y)).unwrap().data;
    let got = f32s(&emu.run(&args("relu2_mul", [n]), &bytes_of(&[&x, &y])));
    assert_eq!(got, want, "relu2_mul");
    // gpt-oss's clamped SwiGLU over values on both sides of its limit (x spans ±8).
    let want = c.swiglu_clamp_mul(&t(&x), &t(&y), 1.702, 7.0).unwrap().data;
    let e = rel(&f32s(&emu.run(&args("swiglu_clamp_mul", [n]), &bytes_of(&[&x, &y]))), &want);
    assert!(e < 1e-6, "swiglu_clamp_mul: relative error {e:e}");
    // BitLinear's 8-bit rows: the same levels as the CPU's (each value a rounding of x·scale).
    let want = c.quant_rows_8bit(&t(&x)).unwrap().data;
    let got = f32s(&emu.run(&args("quant_rows_8bit", [rows, cols]), &bytes_of(&[&x])));
    assert_eq!(got, want, "quant_rows_8bit");
    // MLA's per-head column slices and their concatenation: a slice, then two parts side by side.
    let want = c.cols(&t(&x), 7, 40).unwrap().data;
    let zeros = vec![0f32; rows * 40];
    let got =
        f32s(&emu.run(&args("copy_cols", [rows, cols, 7, 40, 0, 40]), &bytes_of(&[&x, &zeros])));
    assert_eq!(got, want, "copy_cols as cols");
    let (a, b2) = (t(&x), c.from_host(&want, rows, 40).unwrap());
    let want = c.concat_cols(&[&a, &b2]).unwrap().data;
    let dst = vec![0f32; rows * (cols + 40)];
    let first = f32s(
        &emu.run(&args("copy_cols", [rows, cols, 0, cols + 40, 0, cols]), &bytes_of(&[&x, &dst])),
    );
    let got = f32s(&emu.run(
        &args("copy_cols", [rows, 40, 0, cols + 40, cols, 40]),
        &bytes_of(&[&b2.data, &first]),
    ));
    assert_eq!(got, want, "copy_cols as concat_cols");
    // A GPTQ act-order weight's input order: the columns reversed in pairs.
    let perm: Vec<u32> = (0..cols as u32).map(|j| (cols as u32 - 1 - j) ^ 1).collect();
    let want = c.permute_cols(&t(&x), &perm).unwrap().data;
    let mut input = bytes_of(&[&x]);
    input.extend(perm.iter().flat_map(|&p| (p as i32).to_le_bytes()));
    assert_eq!(f32s(&emu.run(&args("permute_cols", [rows, cols]), &input)), want, "permute_cols");
    // Mixture-of-experts rows: an expert's tokens gathered, its output added back scaled.
    let idx = [2usize, 0];
    let ids: Vec<u8> = idx.iter().flat_map(|&r| (r as i32).to_le_bytes()).collect();
    let want = c.gather_rows(&t(&x), &idx).unwrap().data;
    let mut input = bytes_of(&[&x]);
    input.extend(&ids);
    assert_eq!(f32s(&emu.run(&args("gather_rows", [rows, cols, 2]), &input)), want, "gather_rows");
    let (yy, sc) = (rng.vec(2 * cols), [0.25f32, 0.75]);
    let mut want = t(&x);
    c.add_rows_scaled(&mut want, &c.from_host(&yy, 2, cols).unwrap(), &idx, &sc).unwrap();
    let mut input = bytes_of(&[&x, &yy]);
    input.extend(&ids);
    input.extend(bytes_of(&[&sc]));
    let got = f32s(&emu.run(&args("add_rows_scaled", [rows, cols, 2]), &input));
    assert_eq!(got, want.data, "add_rows_scaled");
    let mut want = t(&x);
    c.add(&mut want, &t(&y)).unwrap();
    assert_eq!(f32s(&emu.run(&args("add", [n]), &bytes_of(&[&x, &y]))), want.data, "add");
    for dtype in [DType::F32, DType::F16, DType::Bf16] {
        let b = weight_bytes(dtype, 1, cols, &mut rng);
        let mut want = t(&x);
        c.add_bias(&mut want, &c.weight("b", dtype, &[cols], &b).unwrap()).unwrap();
        let mut input = bytes_of(&[&x]);
        input.extend(&b);
        let got =
            f32s(&emu.run(&args("add_bias", [dtype_code(dtype) as usize, rows, cols]), &input));
        assert_eq!(got, want.data, "add_bias of a {dtype:?} bias");
    }
    let want: Vec<u16> = x.iter().map(|&v| f16::from_f32(v).to_bits()).collect();
    let got: Vec<u16> = emu
        .run(&args("to_f16", [n]), &bytes_of(&[&x]))
        .chunks_exact(2)
        .map(|b| u16::from_le_bytes([b[0], b[1]]))
        .collect();
    assert_eq!(got, want, "to_f16 rounds to nearest even as half does");
    // bf16 keeps f32's range: huge values, infinities and NaNs included.
    let mut x = x;
    x.extend([
        3.0e38,
        -3.4e38,
        65520.0,
        1.0e30,
        f32::INFINITY,
        f32::NEG_INFINITY,
        f32::NAN,
        f32::from_bits(0x3f80_8000),
        f32::from_bits(0x3f81_8000),
    ]);
    let want: Vec<u16> = x.iter().map(|&v| bf16::from_f32(v).to_bits()).collect();
    let got: Vec<u16> = emu
        .run(&args("to_bf16", [x.len()]), &bytes_of(&[&x]))
        .chunks_exact(2)
        .map(|b| u16::from_le_bytes([b[0], b[1]]))
        .collect();
    assert_eq!(got, want, "to_bf16 rounds to nearest even (ties included) as half does");
}

/// Device sampling (`sample_rows`) picks what the host's `sampling::choose` picks from the same
/// logits, penalties and uniform draw — greedy, untruncated, top-k, top-p and both, over peaked
/// and flat distributions with ties — leaves the same penalised logits, skips a row with no job,
/// hands rows whose candidates exceed the kernel's cap back to the host (-1) and flags a NaN (-2).
#[test]
fn emulated_sampling_picks_what_the_host_picks() {
    use crate::sampling::{choose, Pick};
    let Some(emu) = Emu::build("ops_main.cpp") else { return };
    let mut rng = Rng(41);
    let cols = 3000;
    let pick = |temperature, top_k, top_p, repetition_penalty| Pick {
        temperature,
        top_k,
        top_p,
        repetition_penalty,
    };
    // (sharpness of the logits, pick, the kernel's answer when it is not the host's token).
    let cases: Vec<(f32, Option<Pick>, Option<i32>)> = vec![
        (6.0, Some(pick(0.0, 0, 1.0, 1.3)), None),
        (6.0, Some(pick(0.8, 0, 1.0, 1.0)), None),
        (1.0, Some(pick(1.2, 0, 1.0, 1.1)), None),
        (6.0, Some(pick(0.7, 40, 1.0, 1.0)), None),
        (6.0, Some(pick(0.7, 40, 0.9, 1.2)), None),
        (3.0, Some(pick(1.0, 0, 0.9, 1.0)), None),
        (12.0, Some(pick(0.6, 0, 0.5, 1.0)), None),
        (3.0, Some(pick(1.0, 1, 1.0, 1.0)), None),
        (3.0, Some(pick(1.0, 200, 0.3, 1.0)), None),
        (0.5, Some(pick(1.0, 0, 0.95, 1.0)), Some(-1)),
        (3.0, Some(pick(1.0, 2500, 1.0, 1.0)), Some(-1)),
        (3.0, None, Some(0)),
        (f32::NAN, Some(pick(1.0, 0, 0.9, 1.0)), Some(-2)),
    ];
    for round in 0..3 {
        let rows = cases.len();
        let mut x = Vec::with_capacity(rows * cols);
        let (mut fp, mut ip, mut seen) = (Vec::new(), Vec::new(), Vec::new());
        let mut want = Vec::new();
        for (sharp, p, special) in &cases {
            // Logits on 200 levels (many ties), scaled by `sharp`.
            let mut row: Vec<f32> =
                (0..cols).map(|_| (rng.u32() % 200) as f32 / 200.0 * sharp).collect();
            if sharp.is_nan() {
                row[7] = f32::NAN;
            }
            let ids: Vec<u32> = (0..20).map(|_| rng.u32() % cols as u32).collect::<Vec<_>>();
            let mut ids = ids;
            ids.sort_unstable();
            ids.dedup();
            let r = (rng.u32() as f64 / (u32::MAX as f64 + 1.0)) as f32;
            let p0 = p.unwrap_or(pick(0.0, 0, 1.0, 1.0));
            fp.extend([p0.temperature, p0.top_p, p0.repetition_penalty, r]);
            ip.extend([
                if p.is_some() { p0.top_k as i32 } else { -1 },
                seen.len() as i32,
                (seen.len() + ids.len()) as i32,
            ]);
            seen.extend(ids.iter().map(|&i| i as i32));
            let mut host = row.clone();
            let tok = match (p, special) {
                (Some(p), None) => choose(&mut host, &ids, p, r) as i32,
                (_, Some(s)) => *s,
                (None, None) => unreachable!(),
            };
            want.push((tok, host, special.is_none() || *special == Some(-1)));
            x.extend(row);
        }
        let mut input = bytes_of(&[&x, &fp]);
        input.extend(ip.iter().chain(&seen).flat_map(|v| v.to_le_bytes()));
        let out = emu.run(&args("sample", [rows, cols, seen.len()]), &input);
        let (tok, px) = out.split_at(rows * 4);
        let tok: Vec<i32> =
            tok.chunks_exact(4).map(|c| i32::from_le_bytes(c.try_into().unwrap())).collect();
        let px = f32s(px);
        for (i, ((t, host, penalised), got)) in want.iter().zip(&tok).enumerate() {
            assert_eq!(got, t, "round {round}, case {i} {:?}", cases[i]);
            if *penalised {
                // The same penalised logits the host sampled from (a handed-back row is sampled there).
                assert_eq!(&px[i * cols..(i + 1) * cols], &host[..], "round {round}, case {i}");
            }
        }
    }
}
