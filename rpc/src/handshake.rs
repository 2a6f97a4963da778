//! The start-up handshake every layerstream server keeps with whoever started it (`up`, `bench`,
//! the tests, a user's script): once it serves, it prints one line on stdout,
//! `LISTENING <addr>[ http=<url>]` — the gRPC address (`http://…`, `https://…` or `unix:<path>`)
//! and, for a coordinator serving HTTP, its HTTP address. Written and read only here.

use std::io::Write;

const WORD: &str = "LISTENING";
const HTTP: &str = "http=";

/// Where a started server listens.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Listening {
    /// The gRPC address.
    pub addr: String,
    /// The HTTP address (a coordinator with `--http-listen`).
    pub http: Option<String>,
}

impl Listening {
    /// A server listening at `addr` (no HTTP).
    pub fn new(addr: impl Into<String>) -> Self {
        Listening { addr: addr.into(), http: None }
    }

    /// The handshake line.
    pub fn line(&self) -> String {
        match &self.http {
            Some(h) => format!("{WORD} {} {HTTP}{h}", self.addr),
            None => format!("{WORD} {}", self.addr),
        }
    }

    /// Prints the handshake line on stdout, flushed at once (stdout may be a pipe). Inside a tokio
    /// runtime the SIGINT/SIGTERM handler is installed first (`transport::listen_for_shutdown`):
    /// a process that has said it is ready stops on a signal whenever it comes.
    pub fn announce(&self) {
        if tokio::runtime::Handle::try_current().is_ok() {
            crate::transport::listen_for_shutdown();
        }
        let mut out = std::io::stdout().lock();
        let _ = writeln!(out, "{}", self.line());
        let _ = out.flush();
    }

    /// Reads a handshake line (None: not one).
    pub fn parse(line: &str) -> Option<Listening> {
        let mut words = line.split_whitespace();
        if words.next()? != WORD {
            return None;
        }
        let addr = words.next()?.to_owned();
        let http = words.find_map(|w| w.strip_prefix(HTTP)).map(str::to_owned);
        Some(Listening { addr, http })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lines_read_back_as_written() {
        for l in [
            Listening::new("http://127.0.0.1:5"),
            Listening { addr: "https://[::1]:7".into(), http: Some("http://127.0.0.1:8".into()) },
            Listening::new("unix:/run/x.sock"),
        ] {
            assert_eq!(Listening::parse(&l.line()), Some(l.clone()));
        }
        assert_eq!(Listening::new("unix:/a").line(), "LISTENING unix:/a");
        assert_eq!(Listening::parse("listening at 5"), None);
        assert_eq!(Listening::parse("LISTENING"), None);
    }
}
