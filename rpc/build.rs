//! Generates the layerstream.v1 gRPC clients and servers (tonic) over the messages of
//! `layerstream-proto` (extern path: the messages are not generated twice), and the descriptor set
//! that reflection serves.

fn main() -> Result<(), Box<dyn std::error::Error>> {
    if std::env::var_os("PROTOC").is_none() {
        // SAFETY: build scripts are single-threaded; nothing else reads the environment concurrently.
        unsafe { std::env::set_var("PROTOC", protoc_bin_vendored::protoc_bin_path()?) };
    }
    let out = std::path::PathBuf::from(std::env::var("OUT_DIR")?);
    tonic_prost_build::configure()
        .extern_path(".layerstream.v1", "::layerstream_proto::v1")
        // prost's codec, with requests that do not decode blamed on the caller (codec.rs).
        .codec_path("crate::codec::ProtoCodec")
        .file_descriptor_set_path(out.join("layerstream_descriptor.bin"))
        .compile_protos(
            &[
                "../proto/layerstream/v1/coordinator.proto",
                "../proto/layerstream/v1/worker.proto",
                "../proto/layerstream/v1/loader.proto",
            ],
            &["../proto"],
        )?;
    println!("cargo:rerun-if-changed=../proto/layerstream");
    Ok(())
}
