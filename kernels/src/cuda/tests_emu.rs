//! The quantized `.cu` kernels (fused dequantize-matvec, dequantize-to-f32/f16) run on the host under
//! `kernels/emu` — a thread per CUDA thread, real warp shuffles and block barriers — and are compared
//! with the CPU backend, so their arithmetic and indexing are checked on machines without a GPU (CI).
//! Skipped, saying why, where no C++20 compiler is installed.

use super::source::dtype_code;
use super::test_data::{rel, weight_bytes, Rng, DTYPES};
use crate::backend::Backend;
use crate::cpu::CpuBackend;
use crate::quant::dequant_row;
use half::f16;
use layerstream_model::DType;
use std::path::{Path, PathBuf};
use std::process::Command;

/// Builds `kernels/emu/quant_main.cpp` into `dir`; `None` (with the reason printed) when there is no
/// C++ compiler.
fn build_emulator(dir: &Path) -> Option<PathBuf> {
    let cxx = std::env::var("CXX").unwrap_or_else(|_| "c++".into());
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("emu/quant_main.cpp");
    let exe = dir.join("quant-emu");
    let out = match Command::new(&cxx).args(["-std=c++20", "-O1", "-pthread", "-Wall", "-Wno-unknown-pragmas", "-o"]).arg(&exe).arg(&src).output() {
        Ok(out) => out,
        Err(e) => {
            eprintln!("skipping the emulated CUDA kernel test: cannot run {cxx:?} ({e})");
            return None;
        }
    };
    assert!(out.status.success(), "{cxx} failed on {}:\n{}", src.display(), String::from_utf8_lossy(&out.stderr));
    Some(exe)
}

fn f32s(bytes: &[u8]) -> Vec<f32> {
    bytes.chunks_exact(4).map(|c| f32::from_le_bytes(c.try_into().unwrap())).collect()
}

/// Runs the emulated kernels on `n` rows of `k` random weights of `dtype` and `m` activation rows;
/// returns the worst relative errors of (matvec, dequant f32, dequant f16) against the CPU backend.
fn compare(exe: &Path, dir: &Path, dtype: DType, m: usize, n: usize, k: usize, rng: &mut Rng) -> (f64, f64, f64) {
    let w = weight_bytes(dtype, n, k, rng);
    let x = rng.vec(m * k);
    let (input, output) = (dir.join("in"), dir.join("out"));
    let mut bytes = w.clone();
    bytes.extend(x.iter().flat_map(|v| v.to_le_bytes()));
    std::fs::write(&input, bytes).unwrap();
    let status = Command::new(exe).args([dtype_code(dtype), m as i32, n as i32, k as i32].map(|v| v.to_string())).arg(&input).arg(&output).status().unwrap();
    assert!(status.success(), "quant-emu {dtype} m={m} n={n} k={k}: {status}");
    let out = std::fs::read(&output).unwrap();
    assert_eq!(out.len(), (m * n + n * k) * 4 + n * k * 2, "quant-emu output size");
    let (y, rest) = out.split_at(m * n * 4);
    let (d32, d16) = rest.split_at(n * k * 4);
    let d16: Vec<f32> = d16.chunks_exact(2).map(|c| f16::from_le_bytes([c[0], c[1]]).to_f32()).collect();

    let cw = CpuBackend.weight("w", dtype, &[n, k], &w).unwrap();
    let want_y = CpuBackend.matmul(&CpuBackend.from_host(&x, m, k).unwrap(), &cw).unwrap().data;
    let mut want_d = vec![0f32; n * k];
    let rb = dtype.row_bytes(k).unwrap();
    for (row, o) in w.chunks_exact(rb).zip(want_d.chunks_exact_mut(k)) {
        dequant_row(dtype, row, o);
    }
    let want_d16: Vec<f32> = want_d.iter().map(|v| f16::from_f32(*v).to_f32()).collect();
    (rel(&f32s(y), &want_y), rel(&f32s(d32), &want_d), rel(&d16, &want_d16))
}

#[test]
fn emulated_quant_kernels_match_cpu_for_every_dtype() {
    let dir = tempfile::tempdir().unwrap();
    let Some(exe) = build_emulator(dir.path()) else { return };
    let mut rng = Rng(23);
    for dtype in DTYPES {
        // Float formats also at a width that is not a multiple of 8 (the per-element tail paths).
        let widths: &[usize] = if dtype.block_elems() == 1 { &[512, 516] } else { &[512] };
        for &k in widths {
            for m in [1, 3, 8] {
                let (ey, e32, e16) = compare(&exe, dir.path(), dtype, m, 12, k, &mut rng);
                assert!(ey < 1e-5, "matvec {dtype} m={m} k={k}: relative error {ey:e}");
                assert!(e32 < 1e-6, "dequant_f32 {dtype} k={k}: relative error {e32:e}");
                assert!(e16 < 1e-6, "dequant_f16 {dtype} k={k}: relative error {e16:e}");
            }
        }
    }
}
