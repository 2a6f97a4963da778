//! layerstream.v1 over gRPC: the generated coordinator, worker and loader services, and what every
//! server and client shares — TCP listening, Unix-socket connect, TLS, bearer tokens, health and
//! reflection. The messages themselves are `layerstream-proto`'s, re-exported in `v1`.

pub mod auth;
pub mod codec;
mod error;
pub mod handshake;
pub mod limits;
pub mod transport;

pub use error::Error;

/// The messages (from `layerstream-proto`) and the generated clients and servers.
pub mod v1 {
    pub use layerstream_proto::v1::*;
    tonic::include_proto!("layerstream.v1");
}

/// Encoded file descriptors, for gRPC reflection.
pub const FILE_DESCRIPTOR_SET: &[u8] =
    tonic::include_file_descriptor_set!("layerstream_descriptor");
