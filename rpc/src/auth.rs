//! Bearer tokens on gRPC: the optional API key of the public job API and the shared secret of the
//! internal worker and loader APIs. Clients attach `authorization: Bearer <token>`; a server given a
//! token refuses every call of the guarded service without it (UNAUTHENTICATED), comparing in
//! constant time. Health and reflection stay open, so orchestrators can probe.

use std::sync::Arc;
use tonic::metadata::{Ascii, MetadataValue};
use tonic::service::interceptor::InterceptedService;
use tonic::service::Interceptor;
use tonic::transport::Channel;
use tonic::{Request, Status};

/// Environment variable of the internal secret (worker and loader APIs). `up` generates one and
/// hands it to its children through the environment (never on a command line, where `ps` shows it).
pub const INTERNAL_TOKEN_ENV: &str = "LAYERSTREAM_INTERNAL_TOKEN";

/// A client channel that attaches a bearer token (or nothing) to every call.
pub type Authed = InterceptedService<Channel, Bearer>;

/// Client side: attaches `authorization: Bearer <token>` when a token is set.
#[derive(Clone, Default)]
pub struct Bearer(Option<MetadataValue<Ascii>>);

/// A token must be printable ASCII without spaces (it travels in an HTTP/2 header).
fn check_token(t: &str) -> Result<(), String> {
    if t.is_empty() || !t.bytes().all(|b| b.is_ascii_graphic()) {
        return Err("a token must be non-empty printable ASCII without spaces".into());
    }
    Ok(())
}

/// An empty string means "no token" (an unset variable in compose files is often an empty one).
fn non_empty(token: Option<&str>) -> Option<&str> {
    token.map(str::trim).filter(|t| !t.is_empty())
}

impl Bearer {
    /// A client interceptor for `token` (`None` or empty: attaches nothing).
    pub fn new(token: Option<&str>) -> Result<Bearer, String> {
        let Some(t) = non_empty(token) else { return Ok(Bearer(None)) };
        check_token(t)?;
        let v = format!("Bearer {t}").parse().map_err(|_| "token is not a valid header value")?;
        Ok(Bearer(Some(v)))
    }

    /// `channel` with this token on every call.
    pub fn wrap(self, channel: Channel) -> Authed {
        InterceptedService::new(channel, self)
    }
}

impl Interceptor for Bearer {
    fn call(&mut self, mut r: Request<()>) -> Result<Request<()>, Status> {
        if let Some(v) = &self.0 {
            r.metadata_mut().insert("authorization", v.clone());
        }
        Ok(r)
    }
}

/// Server side: refuses calls whose `authorization` is not `Bearer <token>` for one of its tokens
/// when any is set. Each accepted call carries the index of the token it matched (`KeyIndex`, a
/// request extension): with several API keys, each is a tenant.
#[derive(Clone)]
pub struct RequireBearer {
    tokens: Arc<[Arc<[u8]>]>,
    /// What the token guards, for the error message ("API key", "internal token").
    what: &'static str,
}

/// Which of the server's tokens a call presented (a request extension).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KeyIndex(pub usize);

impl RequireBearer {
    /// A server interceptor for `token` (`None` or empty: lets every call through).
    pub fn new(token: Option<&str>, what: &'static str) -> Result<RequireBearer, String> {
        let keys: Vec<String> = non_empty(token).map(str::to_owned).into_iter().collect();
        Self::keys(&keys, what)
    }

    /// A server interceptor accepting any of `tokens` (none: lets every call through).
    pub fn keys(tokens: &[String], what: &'static str) -> Result<RequireBearer, String> {
        let mut out = Vec::with_capacity(tokens.len());
        for t in tokens {
            check_token(t)?;
            out.push(Arc::from(t.as_bytes()));
        }
        Ok(RequireBearer { tokens: out.into(), what })
    }

    /// Whether a token is required.
    pub fn enabled(&self) -> bool {
        !self.tokens.is_empty()
    }

    /// Whether `header` (an `authorization` value) carries a token. The scheme is
    /// case-insensitive (RFC 7235: `bearer`, `BEARER`), the token is not.
    pub fn accepts(&self, header: Option<&[u8]>) -> bool {
        !self.enabled() || self.key_of(header).is_some()
    }

    /// Which token `header` carries (None: none of them, or no tokens are set). Every token is
    /// compared in full, in constant time over its length: no early exit on a difference.
    pub fn key_of(&self, header: Option<&[u8]>) -> Option<usize> {
        let got = header.and_then(bearer_token)?;
        let mut found = None;
        for (k, want) in self.tokens.iter().enumerate() {
            let mut diff = (got.len() != want.len()) as u8;
            for (i, &w) in want.iter().enumerate() {
                diff |= w ^ got.get(i).copied().unwrap_or(0);
            }
            if diff == 0 && found.is_none() {
                found = Some(k);
            }
        }
        found
    }
}

/// The token of a `Bearer <token>` credential (scheme in any case, one or more spaces after it).
fn bearer_token(header: &[u8]) -> Option<&[u8]> {
    const SCHEME: &[u8] = b"bearer";
    let (scheme, rest) = header.split_at_checked(SCHEME.len())?;
    if !scheme.eq_ignore_ascii_case(SCHEME) || rest.first() != Some(&b' ') {
        return None;
    }
    Some(rest.trim_ascii_start())
}

impl Interceptor for RequireBearer {
    fn call(&mut self, mut r: Request<()>) -> Result<Request<()>, Status> {
        let header = r.metadata().get("authorization").map(|v| v.as_bytes());
        if !self.enabled() {
            return Ok(r);
        }
        if let Some(k) = self.key_of(header) {
            r.extensions_mut().insert(KeyIndex(k));
            Ok(r)
        } else if header.is_none() {
            let msg = format!("missing {}: send `authorization: Bearer <token>`", self.what);
            Err(crate::Error::Unauthenticated(msg).into())
        } else {
            Err(crate::Error::Unauthenticated(format!("wrong {}", self.what)).into())
        }
    }
}

/// The API keys a process runs with: `--api-key-file` (one key per line, `#` comments; secrets
/// stay out of `/proc/<pid>/cmdline`; several keys are several tenants), else `--api-key` /
/// `LAYERSTREAM_API_KEY`. A key given as a command-line argument is accepted with a warning naming
/// the safer ways.
pub fn api_keys(
    key: Option<&str>,
    file: Option<&std::path::Path>,
    argv: &[String],
) -> Result<Vec<String>, String> {
    if let Some(path) = file {
        let bad = |e: String| format!("--api-key-file {}: {e}", path.display());
        let text = std::fs::read_to_string(path).map_err(|e| bad(e.to_string()))?;
        let keys: Vec<String> = text
            .lines()
            .map(str::trim)
            .filter(|l| !l.is_empty() && !l.starts_with('#'))
            .map(str::to_owned)
            .collect();
        if keys.is_empty() {
            return Err(bad("holds no key".into()));
        }
        for k in &keys {
            check_token(k).map_err(bad)?;
        }
        return Ok(keys);
    }
    if argv.iter().any(|a| a == "--api-key" || a.starts_with("--api-key=")) {
        tracing::warn!(
            "--api-key on the command line is readable by every local user in /proc/<pid>/cmdline; \
             use --api-key-file or the LAYERSTREAM_API_KEY environment variable"
        );
    }
    Ok(non_empty(key).map(str::to_owned).into_iter().collect())
}

/// 128 random bits from the kernel, as 32 hex digits (job ids, generated secrets).
pub fn random_hex() -> String {
    use std::io::Read;
    let mut b = [0u8; 16];
    std::fs::File::open("/dev/urandom")
        .and_then(|mut f| f.read_exact(&mut b))
        .expect("reading /dev/urandom");
    b.iter().map(|x| format!("{x:02x}")).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_token_is_required_exactly_when_set() {
        let open = RequireBearer::new(None, "API key").unwrap();
        assert!(open.accepts(None) && !open.enabled());
        assert!(!RequireBearer::new(Some("  "), "x").unwrap().enabled(), "empty means unset");
        let g = RequireBearer::new(Some("s3cret"), "API key").unwrap();
        // RFC 7235: the scheme is case-insensitive.
        for ok in [&b"Bearer s3cret"[..], b"bearer s3cret", b"BEARER s3cret", b"Bearer  s3cret"] {
            assert!(g.accepts(Some(ok)), "{:?}", String::from_utf8_lossy(ok));
        }
        for bad in [
            &b"Bearer s3cre"[..],
            b"Bearer s3cret2",
            b"s3cret",
            b"Bearer ",
            b"Bearers3cret",
            b"Basic s3cret",
            b"Bearer S3CRET",
        ] {
            assert!(!g.accepts(Some(bad)), "{:?}", String::from_utf8_lossy(bad));
        }
        assert!(!g.accepts(None));
        assert!(RequireBearer::new(Some("has space"), "x").is_err());
    }

    #[test]
    fn the_client_attaches_what_the_server_checks() {
        let mut c = Bearer::new(Some("tok")).unwrap();
        let r = c.call(Request::new(())).unwrap();
        let mut s = RequireBearer::new(Some("tok"), "internal token").unwrap();
        assert!(s.call(r).is_ok());
        let e = s.call(Request::new(())).unwrap_err();
        assert_eq!(e.code(), tonic::Code::Unauthenticated);
        assert!(e.message().contains("missing internal token"), "{}", e.message());
        assert_eq!(random_hex().len(), 32);
        assert_ne!(random_hex(), random_hex());
    }

    /// A key file's lines are the keys (comments and blank lines skipped); a file that cannot be
    /// read or holds no valid token is an error naming it; without a file the flag or variable is
    /// used. Each key presented is told apart.
    #[test]
    fn api_keys_come_from_a_file_first() {
        let dir = tempfile::tempdir().unwrap();
        let f = dir.path().join("key");
        std::fs::write(&f, "# tenants\nsk-a\n\nsk-b\n").unwrap();
        let keys = api_keys(Some("sk-flag"), Some(&f), &[]).unwrap();
        assert_eq!(keys, ["sk-a", "sk-b"]);
        assert_eq!(api_keys(Some("sk-flag"), None, &[]).unwrap(), ["sk-flag"]);
        assert!(api_keys(Some("  "), None, &[]).unwrap().is_empty());
        let guard = RequireBearer::keys(&keys, "API key").unwrap();
        assert_eq!(guard.key_of(Some(b"Bearer sk-b")), Some(1));
        assert_eq!(guard.key_of(Some(b"Bearer sk-a")), Some(0));
        assert_eq!(guard.key_of(Some(b"Bearer sk-c")), None);
        assert!(!guard.accepts(None) && guard.accepts(Some(b"bearer sk-a")));
        std::fs::write(&f, "two words\n").unwrap();
        assert!(api_keys(None, Some(&f), &[]).unwrap_err().contains("printable ASCII"));
        std::fs::write(&f, "# nothing\n").unwrap();
        assert!(api_keys(None, Some(&f), &[]).unwrap_err().contains("holds no key"));
        let missing = dir.path().join("absent");
        assert!(api_keys(None, Some(&missing), &[]).unwrap_err().contains("absent"));
    }
}
