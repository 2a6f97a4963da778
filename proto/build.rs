//! Compiles the layerstream.v1 protos with a vendored protoc (no system protoc needed).

fn main() -> Result<(), Box<dyn std::error::Error>> {
    if std::env::var_os("PROTOC").is_none() {
        // SAFETY: build scripts are single-threaded; nothing else reads the environment concurrently.
        unsafe { std::env::set_var("PROTOC", protoc_bin_vendored::protoc_bin_path()?) };
    }
    let out = std::path::PathBuf::from(std::env::var("OUT_DIR")?);
    tonic_prost_build::configure()
        .file_descriptor_set_path(out.join("layerstream_descriptor.bin"))
        .compile_protos(
            &[
                "layerstream/v1/coordinator.proto",
                "layerstream/v1/worker.proto",
                "layerstream/v1/loader.proto",
            ],
            &["."],
        )?;
    println!("cargo:rerun-if-changed=layerstream");
    Ok(())
}
