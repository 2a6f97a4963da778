//! Decides `have_gpu` (the CUDA driver is installed here) for the GPU kernel tests, which are
//! ignored where it is not (`build_gpu.rs`, shared with tests/build.rs), and `have_avx512_vnni`
//! (this CPU reports it) for the tests of the many-row 8-bit kernel, ignored where it does not.

include!("build_gpu.rs");

fn main() {
    println!("cargo::rerun-if-changed=build.rs");
    println!("cargo::rerun-if-changed=build_gpu.rs");
    emit_have_gpu();
    println!("cargo::rustc-check-cfg=cfg(have_avx512_vnni)");
    let cpu = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
    let flags = ["avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx2", "fma", "f16c"];
    if flags.iter().all(|f| cpu.split_whitespace().any(|w| w == *f)) {
        println!("cargo::rustc-cfg=have_avx512_vnni");
    }
}
