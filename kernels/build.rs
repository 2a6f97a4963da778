//! Decides `have_gpu` (the CUDA driver is installed here) for the GPU kernel tests, which are
//! ignored where it is not (`build_gpu.rs`, shared with tests/build.rs).

include!("build_gpu.rs");

fn main() {
    println!("cargo::rerun-if-changed=build.rs");
    println!("cargo::rerun-if-changed=build_gpu.rs");
    emit_have_gpu();
}
