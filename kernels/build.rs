//! Decides `have_gpu` (the CUDA driver is installed here) for the GPU kernel tests, which are
//! ignored where it is not (`build_gpu.rs`, shared with tests/build.rs), and `have_avx2` /
//! `have_avx512_vnni` (this CPU reports them) for the tests of the many-row 8-bit kernel, ignored
//! where it lacks AVX2 (and run for both instruction sets where it has AVX-512 VNNI).

include!("build_gpu.rs");

fn main() {
    println!("cargo::rerun-if-changed=build.rs");
    println!("cargo::rerun-if-changed=build_gpu.rs");
    emit_have_gpu();
    println!("cargo::rustc-check-cfg=cfg(have_avx2)");
    println!("cargo::rustc-check-cfg=cfg(have_avx512_vnni)");
    let cpu = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
    let has = |flags: &[&str]| flags.iter().all(|f| cpu.split_whitespace().any(|w| w == *f));
    let avx2 = ["avx2", "fma", "f16c"];
    if has(&avx2) {
        println!("cargo::rustc-cfg=have_avx2");
    }
    if has(&avx2) && has(&["avx512f", "avx512bw", "avx512vl", "avx512_vnni"]) {
        println!("cargo::rustc-cfg=have_avx512_vnni");
    }
}
