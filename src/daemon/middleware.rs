//! Who may talk to the daemon.
//!
//! Unix socket: the peer's uid (SO_PEERCRED) must be the daemon's own uid, root, or listed in
//! `[api] allowed_uids`; anyone else gets one 403 `uid_not_allowed` naming their uid and that
//! key ([`PeerGate::refusal`]).
//! TCP: `Authorization: Bearer <token>` must match the token file, and the `Host` (and `Origin`,
//! when present) must name a loopback address, which stops DNS-rebinding attacks from browsers.
//! TLS (`tcp_tls`, the only way off loopback): the token, and an `Origin`, when present, that is
//! `https://` and the request's own `Host` (clients reach the daemon under any name of the
//! machine; a browser page cannot complete a handshake with the pinned self-signed certificate
//! unless its user accepted it, and still lacks the token).

use std::path::PathBuf;

use hyper::header::{AUTHORIZATION, HOST, ORIGIN};
use hyper::{HeaderMap, StatusCode};

use super::response::ApiError;

pub use crate::api::UID_NOT_ALLOWED;

/// Who may use the unix socket (SO_PEERCRED uid): root, the daemon's own uid, and the uids of
/// `[api] allowed_uids`.
#[derive(Debug, Clone)]
pub struct PeerGate {
    pub own_uid: u32,
    pub allowed: Vec<u32>,
    /// The config file to name in a refusal.
    pub config_file: PathBuf,
}

impl PeerGate {
    pub fn allows(&self, peer_uid: u32) -> bool {
        peer_uid == 0 || peer_uid == self.own_uid || self.allowed.contains(&peer_uid)
    }

    /// The answer to a peer [`PeerGate::allows`] refuses: its uid and the key that would let
    /// it in.
    pub fn refusal(&self, peer_uid: u32) -> ApiError {
        ApiError::new(
            StatusCode::FORBIDDEN,
            UID_NOT_ALLOWED,
            format!(
                "uid {peer_uid} may not use this daemon: add it to [api] allowed_uids in {}",
                self.config_file.display()
            ),
        )
    }
}

/// Checks for requests that arrived over TCP.
pub fn check_tcp(headers: &HeaderMap, token: &str, port: u16) -> Result<(), ApiError> {
    let host = headers
        .get(HOST)
        .and_then(|h| h.to_str().ok())
        .unwrap_or("");
    if !loopback_authority(host, port) {
        return Err(ApiError::forbidden(format!(
            "Host header `{host}` is not a loopback address of this daemon"
        )));
    }
    if let Some(origin) = headers.get(ORIGIN) {
        let origin = origin.to_str().unwrap_or("");
        let authority = origin.strip_prefix("http://").unwrap_or("\u{0}");
        if !loopback_authority(authority, port) {
            return Err(ApiError::forbidden(format!(
                "Origin `{origin}` is not allowed"
            )));
        }
    }
    check_token(headers, token)
}

/// Checks for requests that arrived over the TLS listener.
pub fn check_tls(headers: &HeaderMap, token: &str) -> Result<(), ApiError> {
    if let Some(origin) = headers.get(ORIGIN) {
        let origin = origin.to_str().unwrap_or("");
        let host = headers
            .get(HOST)
            .and_then(|h| h.to_str().ok())
            .unwrap_or("\u{0}");
        if !origin
            .strip_prefix("https://")
            .is_some_and(|a| a.eq_ignore_ascii_case(host))
        {
            return Err(ApiError::forbidden(format!(
                "Origin `{origin}` is not allowed"
            )));
        }
    }
    check_token(headers, token)
}

fn check_token(headers: &HeaderMap, token: &str) -> Result<(), ApiError> {
    let given = headers
        .get(AUTHORIZATION)
        .and_then(|h| h.to_str().ok())
        .and_then(|h| h.strip_prefix("Bearer "))
        .ok_or_else(|| {
            ApiError::unauthorized("missing `Authorization: Bearer <token>` (see `tryboxi token`)")
        })?;
    if !constant_time_eq(given.trim().as_bytes(), token.as_bytes()) {
        return Err(ApiError::unauthorized("invalid token"));
    }
    Ok(())
}

fn loopback_authority(authority: &str, port: u16) -> bool {
    let allowed = [
        format!("127.0.0.1:{port}"),
        format!("localhost:{port}"),
        format!("[::1]:{port}"),
    ];
    allowed.iter().any(|a| a.eq_ignore_ascii_case(authority))
}

fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    if a.len() != b.len() {
        return false;
    }
    a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

#[cfg(test)]
mod tests {
    use super::*;
    use hyper::header::HeaderValue;

    fn headers(pairs: &[(hyper::header::HeaderName, &str)]) -> HeaderMap {
        let mut h = HeaderMap::new();
        for (k, v) in pairs {
            h.insert(k.clone(), HeaderValue::from_str(v).unwrap());
        }
        h
    }

    #[test]
    fn tcp_needs_the_right_token() {
        let ok = headers(&[(HOST, "127.0.0.1:7070"), (AUTHORIZATION, "Bearer s3cret")]);
        assert!(check_tcp(&ok, "s3cret", 7070).is_ok());
        let wrong = headers(&[(HOST, "127.0.0.1:7070"), (AUTHORIZATION, "Bearer nope")]);
        assert_eq!(check_tcp(&wrong, "s3cret", 7070).unwrap_err().status, 401);
        let none = headers(&[(HOST, "127.0.0.1:7070")]);
        assert_eq!(check_tcp(&none, "s3cret", 7070).unwrap_err().status, 401);
    }

    #[test]
    fn rebinding_hosts_and_foreign_origins_are_refused() {
        let evil = headers(&[(HOST, "evil.example:7070"), (AUTHORIZATION, "Bearer t")]);
        assert_eq!(check_tcp(&evil, "t", 7070).unwrap_err().status, 403);
        let origin = headers(&[
            (HOST, "localhost:7070"),
            (ORIGIN, "http://evil.example"),
            (AUTHORIZATION, "Bearer t"),
        ]);
        assert_eq!(check_tcp(&origin, "t", 7070).unwrap_err().status, 403);
        let good_origin = headers(&[
            (HOST, "localhost:7070"),
            (ORIGIN, "http://localhost:7070"),
            (AUTHORIZATION, "Bearer t"),
        ]);
        assert!(check_tcp(&good_origin, "t", 7070).is_ok());
    }

    #[test]
    fn tls_needs_the_token_and_a_same_host_https_origin() {
        let ok = headers(&[(HOST, "build-box:7443"), (AUTHORIZATION, "Bearer t")]);
        assert!(check_tls(&ok, "t").is_ok());
        let none = headers(&[(HOST, "build-box:7443")]);
        assert_eq!(check_tls(&none, "t").unwrap_err().status, 401);
        let origin = headers(&[
            (HOST, "build-box:7443"),
            (ORIGIN, "https://evil.example"),
            (AUTHORIZATION, "Bearer t"),
        ]);
        assert_eq!(check_tls(&origin, "t").unwrap_err().status, 403);
        let same = headers(&[
            (HOST, "build-box:7443"),
            (ORIGIN, "https://build-box:7443"),
            (AUTHORIZATION, "Bearer t"),
        ]);
        assert!(check_tls(&same, "t").is_ok());
    }

    fn gate(own_uid: u32, allowed: &[u32]) -> PeerGate {
        PeerGate {
            own_uid,
            allowed: allowed.to_vec(),
            config_file: "/var/lib/tryboxi/config.toml".into(),
        }
    }

    #[test]
    fn peer_uid_rule() {
        let g = gate(1000, &[]);
        assert!(g.allows(1000));
        assert!(g.allows(0));
        assert!(!g.allows(1001));
    }

    #[test]
    fn a_root_daemon_lets_in_root_and_the_listed_uids_only() {
        let g = gate(0, &[1000, 1002]);
        assert!(g.allows(0));
        assert!(g.allows(1000) && g.allows(1002));
        assert!(!g.allows(1001) && !g.allows(u32::MAX));
        assert!(!gate(0, &[]).allows(1000));
    }

    #[test]
    fn the_refusal_names_the_uid_and_the_config_key() {
        let e = gate(0, &[1000]).refusal(1001);
        assert_eq!(e.status, 403);
        assert_eq!(e.code, UID_NOT_ALLOWED);
        assert_eq!(
            e.message,
            "uid 1001 may not use this daemon: add it to [api] allowed_uids in \
             /var/lib/tryboxi/config.toml"
        );
    }
}
