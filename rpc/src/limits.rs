//! Bounds on what clients can hold open, shared by every TCP server (gRPC and HTTP): at most
//! `max` connections at once (one more is closed as it is accepted, so the ones already accepted
//! are never starved), at most half of them from one peer address (so one client holding
//! connections open cannot lock out the others), a connection that sends nothing within `first_byte` is closed, the process's
//! open-file limit raised to what the system allows, and a warning when connections near the cap.

use std::collections::HashMap;
use std::future::Future;
use std::io;
use std::net::IpAddr;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpStream;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

/// Raises this process's soft open-file limit to its hard limit; returns the soft limit now.
pub fn raise_fd_limit() -> u64 {
    let mut lim = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
    // SAFETY: getrlimit/setrlimit read and write the struct we own; no other preconditions.
    unsafe {
        if libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) != 0 {
            return 1024;
        }
        if lim.rlim_cur < lim.rlim_max {
            let raised = libc::rlimit { rlim_cur: lim.rlim_max, rlim_max: lim.rlim_max };
            if libc::setrlimit(libc::RLIMIT_NOFILE, &raised) == 0 {
                lim.rlim_cur = lim.rlim_max;
            }
        }
    }
    lim.rlim_cur
}

/// The connection gate of one listener.
#[derive(Clone)]
pub struct Gate {
    permits: Arc<Semaphore>,
    max: usize,
    first_byte: Duration,
    what: &'static str,
    /// When the last "near the cap" warning was logged (seconds since the Unix epoch).
    warned_at: Arc<AtomicU64>,
    /// Most connections one peer address may hold.
    per_peer: usize,
    /// Connections open per peer address.
    peers: Arc<Mutex<HashMap<IpAddr, usize>>>,
}

impl Gate {
    /// At most `max` connections of `what` ("HTTP", "gRPC") at once, held to the open-file limit
    /// (less a reserve for the process's own files); each must send its first byte within
    /// `first_byte`.
    pub fn new(what: &'static str, max: usize, first_byte: Duration) -> Self {
        let fds = raise_fd_limit().saturating_sub(256).max(16) as usize;
        let max = max.clamp(1, fds);
        Gate {
            permits: Arc::new(Semaphore::new(max)),
            max,
            first_byte,
            what,
            warned_at: Arc::default(),
            per_peer: max.div_ceil(2),
            peers: Arc::default(),
        }
    }

    /// The same gate letting one peer address hold at most `n` connections (default: half the
    /// cap; at least one, at most the cap).
    pub fn per_peer(mut self, n: usize) -> Self {
        self.per_peer = n.clamp(1, self.max);
        self
    }

    /// The connection cap in force.
    pub fn max(&self) -> usize {
        self.max
    }

    /// Admits `io` from `peer` (None: the cap, or the peer's share of it, is reached, and
    /// dropping `io` closes it).
    pub fn admit<T>(&self, io: T, peer: Option<IpAddr>) -> Option<Limited<T>> {
        let slot = match peer {
            Some(ip) => {
                let mut peers =
                    self.peers.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
                let held = peers.entry(ip).or_insert(0);
                if *held >= self.per_peer {
                    drop(peers);
                    self.warn(format!(
                        "{ip} holds {} connections (the most one peer may): refusing its new ones",
                        self.per_peer
                    ));
                    return None;
                }
                *held += 1;
                Some(PeerSlot { peers: self.peers.clone(), ip })
            }
            None => None,
        };
        let Ok(permit) = self.permits.clone().try_acquire_owned() else {
            self.warn(format!("{} connections open (the cap): refusing new ones", self.max));
            return None;
        };
        let open = self.max - self.permits.available_permits();
        if open * 10 >= self.max * 9 {
            self.warn(format!("{open} of at most {} connections open", self.max));
        }
        let first = Some(Box::pin(tokio::time::sleep(self.first_byte)));
        Some(Limited { io, _permit: permit, _peer: slot, first_byte: first })
    }

    /// Logs `msg` at most once a minute.
    fn warn(&self, msg: String) {
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_secs());
        let last = self.warned_at.load(Ordering::Relaxed);
        if now >= last + 60
            && self
                .warned_at
                .compare_exchange(last, now, Ordering::Relaxed, Ordering::Relaxed)
                .is_ok()
        {
            tracing::warn!(server = self.what, "{msg}");
        }
    }

    /// `listener`'s connections through this gate, Nagle off, as tonic's `serve_with_incoming`
    /// takes them.
    pub fn incoming(
        self,
        listener: tokio::net::TcpListener,
    ) -> impl tokio_stream::Stream<Item = io::Result<Limited<TcpStream>>> + Send + 'static {
        use tokio_stream::StreamExt;
        crate::transport::tcp_incoming(listener).filter_map(move |conn| match conn {
            Ok(s) => {
                let peer = s.peer_addr().ok().map(|a| a.ip());
                self.admit(s, peer).map(Ok)
            }
            Err(e) => Some(Err(e)),
        })
    }
}

/// An admitted connection: holds its place under the cap until it drops, and fails its reads when
/// the client has sent nothing by the first-byte deadline.
pub struct Limited<T> {
    io: T,
    _permit: OwnedSemaphorePermit,
    _peer: Option<PeerSlot>,
    /// Until the first byte arrives.
    first_byte: Option<Pin<Box<tokio::time::Sleep>>>,
}

/// One connection's place in its peer's share; given back when the connection drops.
struct PeerSlot {
    peers: Arc<Mutex<HashMap<IpAddr, usize>>>,
    ip: IpAddr,
}

impl Drop for PeerSlot {
    fn drop(&mut self) {
        let mut peers = self.peers.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        if let Some(n) = peers.get_mut(&self.ip) {
            *n -= 1;
            if *n == 0 {
                peers.remove(&self.ip);
            }
        }
    }
}

impl<T: AsyncRead + Unpin> AsyncRead for Limited<T> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let before = buf.filled().len();
        let me = &mut *self;
        match Pin::new(&mut me.io).poll_read(cx, buf) {
            Poll::Ready(Ok(())) if buf.filled().len() > before => {
                me.first_byte = None;
                Poll::Ready(Ok(()))
            }
            Poll::Pending => match me.first_byte.as_mut().map(|d| d.as_mut().poll(cx)) {
                Some(Poll::Ready(())) => Poll::Ready(Err(io::Error::new(
                    io::ErrorKind::TimedOut,
                    "the client sent nothing before the first-byte deadline",
                ))),
                _ => Poll::Pending,
            },
            other => other,
        }
    }
}

impl<T: AsyncWrite + Unpin> AsyncWrite for Limited<T> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.io).poll_write(cx, buf)
    }
    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.io).poll_flush(cx)
    }
    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.io).poll_shutdown(cx)
    }
    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.io).poll_write_vectored(cx, bufs)
    }
    fn is_write_vectored(&self) -> bool {
        self.io.is_write_vectored()
    }
}

impl<T: tonic::transport::server::Connected> tonic::transport::server::Connected for Limited<T> {
    type ConnectInfo = T::ConnectInfo;
    fn connect_info(&self) -> Self::ConnectInfo {
        self.io.connect_info()
    }
}

impl<T> Limited<T> {
    /// The connection inside.
    pub fn get_ref(&self) -> &T {
        &self.io
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    /// The cap refuses the connection past it and admits again once one closes; a connection
    /// that sends nothing is failed at the first-byte deadline, one that speaks is not.
    #[tokio::test]
    async fn the_gate_caps_and_times_out_silent_connections() {
        assert!(raise_fd_limit() >= 256);
        let gate = Gate::new("test", 2, Duration::from_millis(200));
        let (a, _ka) = tokio::io::duplex(64);
        let (b, mut kb) = tokio::io::duplex(64);
        let (c, _kc) = tokio::io::duplex(64);
        let mut a = gate.admit(a, None).expect("first");
        let mut b = gate.admit(b, None).expect("second");
        assert!(gate.admit(c, None).is_none(), "the third is over the cap");
        kb.write_all(b"hi").await.unwrap();
        let mut buf = [0u8; 2];
        b.read_exact(&mut buf).await.unwrap();
        let e = a.read(&mut buf).await.unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::TimedOut);
        drop(a);
        let (d, _kd) = tokio::io::duplex(64);
        assert!(gate.admit(d, None).is_some(), "a closed connection frees its place");
        // The one that spoke is past its deadline and still readable.
        tokio::time::sleep(Duration::from_millis(300)).await;
        kb.write_all(b"ok").await.unwrap();
        b.read_exact(&mut buf).await.unwrap();
        assert_eq!(&buf, b"ok");
    }

    /// One peer holding its share cannot lock out another; its places come back as it closes.
    #[tokio::test]
    async fn one_peer_cannot_take_every_place() {
        let gate = Gate::new("test", 4, Duration::from_secs(5));
        let (greedy, other): (IpAddr, IpAddr) =
            ("10.0.0.1".parse().unwrap(), "10.0.0.2".parse().unwrap());
        let mut held = Vec::new();
        for _ in 0..2 {
            held.push(gate.admit(tokio::io::duplex(8).0, Some(greedy)).expect("within its share"));
        }
        assert!(gate.admit(tokio::io::duplex(8).0, Some(greedy)).is_none(), "past half the cap");
        let o = gate.admit(tokio::io::duplex(8).0, Some(other)).expect("another peer gets in");
        held.pop();
        assert!(gate.admit(tokio::io::duplex(8).0, Some(greedy)).is_some(), "a place came back");
        drop(o);
        let one = Gate::new("test", 4, Duration::from_secs(5)).per_peer(1);
        let _x = one.admit(tokio::io::duplex(8).0, Some(other)).unwrap();
        assert!(one.admit(tokio::io::duplex(8).0, Some(other)).is_none());
    }
}
