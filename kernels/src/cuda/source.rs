//! The CUDA kernels' source (`kernels/cuda/*.cu`, concatenated in order) and their NVRTC compilation,
//! cached on disk per source and GPU architecture so a worker compiles once per machine.

/// The kernel files, in the order they are concatenated.
pub const FILES: [(&str, &str); 6] = [
    ("common.cuh", include_str!("../../cuda/common.cuh")),
    ("quant.cu", include_str!("../../cuda/quant.cu")),
    ("ops.cu", include_str!("../../cuda/ops.cu")),
    ("attention.cu", include_str!("../../cuda/attention.cu")),
    ("sample.cu", include_str!("../../cuda/sample.cu")),
    ("int8.cu", include_str!("../../cuda/int8.cu")),
];

/// The whole translation unit NVRTC compiles.
pub fn source() -> String {
    FILES.iter().map(|(name, text)| format!("// ---- {name}\n{text}\n")).collect()
}

/// The `DT_*` code of common.cuh for a stored dtype (its index in `DType::ALL`). A dtype's kernels
/// are named by its `DType::name()` (`matvec_<name>`, `dequant_f32_<name>`, …: quant.cu's
/// `EVERY_DTYPE`).
pub fn dtype_code(d: layerstream_types::DType) -> i32 {
    use layerstream_types::DType;
    match d {
        DType::F32 => 0,
        DType::F16 => 1,
        DType::Bf16 => 2,
        DType::Q8_0 => 3,
        DType::Q4_0 => 4,
        DType::Q4_1 => 5,
        DType::Q4K => 6,
        DType::Q6K => 7,
        DType::Q5_0 => 8,
        DType::Q5_1 => 9,
        DType::Q2K => 10,
        DType::Q3K => 11,
        DType::Q5K => 12,
        DType::Iq4Nl => 13,
        DType::Iq4Xs => 14,
        DType::Tq1_0 => 15,
        DType::Tq2_0 => 16,
        DType::Fp8E4m3B128 => 17,
        DType::Int8B128 => 18,
        DType::Int4G128 => 19,
        DType::Mxfp4 => 20,
    }
}

/// The byte alignment `matvec32_*` needs of a weight's rows (its start and row length) for each
/// dtype, as its loads assume (quant.cu `unit32`): 16-byte blocks load 16 bytes at a time, Q4_1/Q5_1
/// words, the formats with 18-, 22-, 34- and 210-byte blocks halves; the rest byte by byte.
pub fn matvec32_align(d: layerstream_types::DType) -> usize {
    use layerstream_types::DType;
    match d {
        DType::F32 | DType::F16 | DType::Bf16 | DType::Q4K | DType::Q5K => 16,
        DType::Q4_1 | DType::Q5_1 => 4,
        DType::Q4_0 | DType::Q5_0 | DType::Q8_0 | DType::Q6K => 2,
        DType::Q2K | DType::Q3K | DType::Iq4Nl | DType::Iq4Xs | DType::Tq1_0 | DType::Tq2_0 => 2,
        // Their f32 scales are read byte by byte (quant.cu `ld_f`), MXFP4's is a byte: any alignment.
        DType::Fp8E4m3B128 | DType::Int8B128 | DType::Int4G128 | DType::Mxfp4 => 1,
    }
}

/// Weight formats with an 8-bit-activation matvec (`matvec_q8_*`, kernels/cuda/int8.cu).
pub fn matvec_q8_supports(d: layerstream_types::DType) -> bool {
    use layerstream_types::DType;
    matches!(d, DType::Q8_0 | DType::Q4_0 | DType::Q4_1 | DType::Q4K | DType::Q6K)
}

/// Every kernel entry point the backend loads.
pub fn kernel_names() -> Vec<String> {
    let mut v: Vec<String> = [
        "embedding",
        "rms_norm",
        "rope",
        "silu_mul",
        "gelu_tanh_mul",
        "relu2_mul",
        "swiglu_clamp_mul",
        "copy_cols",
        "quant_rows_8bit",
        "permute_cols",
        "gather_rows",
        "add_rows_scaled",
        "add",
        "add_bias",
        "to_f16",
        "to_bf16",
        "argmax",
        "attention",
        "kv_store",
        "sample_rows",
        "quantize_q8",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    for d in layerstream_types::DType::ALL.into_iter().filter(|&d| matvec_q8_supports(d)) {
        v.push(format!("matvec_q8_{}", d.name()));
    }
    for s in layerstream_types::DType::ALL.map(|d| d.name()) {
        v.extend([
            format!("matvec_{s}"),
            format!("matvec32_{s}"),
            format!("dequant_f32_{s}"),
            format!("dequant_f16_{s}"),
            format!("dequant_bf16_{s}"),
        ]);
    }
    v
}

#[cfg(feature = "cuda")]
/// Compiles the kernels for `arch` (e.g. "sm_90") with NVRTC, or reads the cached PTX from an earlier
/// compilation of the same source for the same architecture.
pub fn compile(arch: &str) -> crate::Result<String> {
    use std::hash::{Hash, Hasher};
    let src = source();
    let mut h = std::collections::hash_map::DefaultHasher::new();
    (src.as_str(), arch).hash(&mut h);
    let dir = layerstream_types::cache_dir().join("kernels");
    let path = dir.join(format!("{arch}-{:016x}.ptx", h.finish()));
    if let Ok(ptx) = std::fs::read_to_string(&path) {
        return Ok(ptx);
    }
    // SAFETY: only probes whether libnvrtc can be loaded (the compile call panics when it cannot).
    if !unsafe { cudarc::nvrtc::sys::is_culib_present() } {
        return Err(crate::Error::Device("NVRTC (libnvrtc.so) not found: install the CUDA toolkit or add its lib directory to LD_LIBRARY_PATH".into()));
    }
    let arch_static: &'static str = Box::leak(arch.to_owned().into_boxed_str());
    let opts = cudarc::nvrtc::CompileOptions {
        arch: Some(arch_static),
        options: vec!["--std=c++17".into()],
        ..Default::default()
    };
    let ptx = cudarc::nvrtc::compile_ptx_with_opts(&src, opts).map_err(|e| {
        crate::Error::Device(format!("NVRTC compiling the kernels for {arch}: {e}"))
    })?;
    let text = ptx.to_src();
    // The cache is an optimisation: a read-only home still works, it just compiles every time.
    if std::fs::create_dir_all(&dir).is_ok() {
        let tmp = dir.join(format!(
            ".{}.{}",
            path.file_name().and_then(|n| n.to_str()).unwrap_or("k"),
            std::process::id()
        ));
        if std::fs::write(&tmp, &text).is_ok() {
            let _ = std::fs::rename(&tmp, &path);
        }
    }
    Ok(text)
}

#[cfg(all(test, feature = "cuda"))]
mod tests {
    /// Compiles the kernels with NVRTC where the library exists (no GPU needed) and checks that every
    /// entry point the backend loads is in the PTX; skips with the reason elsewhere.
    #[test]
    fn kernels_compile_with_nvrtc_and_export_every_entry_point() {
        // SAFETY: only probes whether libnvrtc can be loaded.
        if !unsafe { cudarc::nvrtc::sys::is_culib_present() } {
            eprintln!("skipping NVRTC compile check: libnvrtc.so not found (set LD_LIBRARY_PATH to a CUDA toolkit's lib directory)");
            return;
        }
        let dir = std::env::temp_dir().join(format!("ls-nvrtc-{}", std::process::id()));
        std::env::set_var("LAYERSTREAM_CACHE", &dir);
        let ptx = super::compile("sm_90").expect("kernels compile");
        for name in super::kernel_names() {
            assert!(ptx.contains(&format!(".entry {name}(")), "kernel {name} missing from the PTX");
        }
        let cached = std::fs::read_dir(dir.join("kernels")).unwrap().count();
        assert_eq!(cached, 1, "the PTX is cached once");
        let _ = std::fs::remove_dir_all(&dir);
    }
}

#[cfg(test)]
mod order_tests {
    #[test]
    fn dtype_codes_follow_the_order_of_all() {
        for (i, d) in layerstream_types::DType::ALL.into_iter().enumerate() {
            assert_eq!(super::dtype_code(d), i as i32, "{d}");
        }
    }
}
