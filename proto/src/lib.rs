//! layerstream.v1: generated gRPC code for the coordinator, worker and loader services, plus what
//! every server shares: health + reflection, Unix-socket transport, tracing with OTLP export and W3C
//! trace context carried in gRPC metadata.

pub mod auth;
pub mod shm;
pub mod telemetry;
pub mod transport;

/// Generated messages and services.
pub mod v1 {
    tonic::include_proto!("layerstream.v1");
}

/// Encoded file descriptors, for gRPC reflection.
pub const FILE_DESCRIPTOR_SET: &[u8] =
    tonic::include_file_descriptor_set!("layerstream_descriptor");
