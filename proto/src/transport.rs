//! gRPC plumbing shared by the servers: Unix-socket listen/connect (the loader's control socket),
//! and the standard health + reflection services so grpcurl works on every server.

use std::path::{Path, PathBuf};
use tonic::transport::{Channel, Endpoint};

/// A channel to a gRPC server on a Unix socket.
pub async fn connect_uds(path: &Path) -> Result<Channel, tonic::transport::Error> {
    let path: PathBuf = path.into();
    Endpoint::from_static("http://[::1]:1")
        .connect_with_connector(tower::service_fn(move |_: tonic::transport::Uri| {
            let p = path.clone();
            async move { Ok::<_, std::io::Error>(hyper_util::rt::TokioIo::new(tokio::net::UnixStream::connect(p).await?)) }
        }))
        .await
}

/// A lazily-connecting channel to `addr` ("http://host:port").
pub fn channel(addr: &str) -> Result<Channel, tonic::transport::Error> {
    Ok(Endpoint::from_shared(addr.to_owned())?
        .connect_timeout(std::time::Duration::from_secs(5))
        .tcp_nodelay(true)
        .connect_lazy())
}

/// The gRPC reflection service over layerstream.v1 (and health).
pub fn reflection() -> tonic_reflection::server::v1::ServerReflectionServer<impl tonic_reflection::server::v1::ServerReflection> {
    tonic_reflection::server::Builder::configure()
        .register_encoded_file_descriptor_set(crate::FILE_DESCRIPTOR_SET)
        .register_encoded_file_descriptor_set(tonic_health::pb::FILE_DESCRIPTOR_SET)
        .build_v1()
        .expect("embedded descriptor sets are valid")
}

/// A health service reporting `S` (and the whole server, "") as serving.
pub async fn health<S: tonic::server::NamedService>() -> tonic_health::pb::health_server::HealthServer<impl tonic_health::pb::health_server::Health> {
    let (reporter, service) = tonic_health::server::health_reporter();
    reporter.set_serving::<S>().await;
    service
}

/// Waits for SIGINT or SIGTERM.
pub async fn shutdown_signal() {
    use tokio::signal::unix::{signal, SignalKind};
    let mut term = signal(SignalKind::terminate()).expect("SIGTERM handler");
    tokio::select! {
        _ = tokio::signal::ctrl_c() => {}
        _ = term.recv() => {}
    }
}
