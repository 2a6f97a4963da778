// Whether this machine has the CUDA driver (shared by kernels/build.rs and tests/build.rs through
// `include!`): its library in the linker cache, or a GPU device node. Tests that need a GPU are
// built as ignored where it has none, so `cargo test` never counts them as passed.

/// Whether the CUDA driver is installed here.
fn have_gpu() -> bool {
    let cached = std::process::Command::new("ldconfig")
        .arg("-p")
        .output()
        .ok()
        .is_some_and(|o| String::from_utf8_lossy(&o.stdout).contains("libcuda.so.1"));
    cached || std::path::Path::new("/dev/nvidia0").exists()
}

/// Prints the `have_gpu` cfg (declared either way) and what makes the choice again.
fn emit_have_gpu() {
    println!("cargo::rerun-if-changed=/etc/ld.so.cache");
    println!("cargo::rustc-check-cfg=cfg(have_gpu)");
    if have_gpu() {
        println!("cargo::rustc-cfg=have_gpu");
    }
}
