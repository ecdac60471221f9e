//! The E2B listener (`serve --e2b ADDR`, config `e2b_listen`): TCP, HTTP/1.1.
//!
//! Owns: binding (a non-loopback address only with `tcp_tls` on, reusing the daemon's TLS
//! identity: the API key never crosses the network in plain text), the `Host` check on loopback
//! (a web page cannot reach it through DNS rebinding), its own connection budget (the
//! `[http]` caps, per peer uid/IP), the header and idle deadlines (`daemon::keepalive`), and
//! draining at shutdown.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use hyper::Request;
use hyper::body::Incoming;
use hyper_util::rt::{TokioIo, TokioTimer};
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::net::TcpListener;
use tokio::sync::broadcast;
use tokio::task::JoinSet;

use super::Face;
use crate::config::HttpConfig;
use crate::daemon::keepalive::{self, Deadlines};
use crate::daemon::limits::{self, ConnLimiter};

/// Refuse an address that would put the API key on the network in plain text.
pub fn check_addr(addr: SocketAddr, tls: bool) -> Result<(), String> {
    if addr.ip().is_loopback() || tls {
        return Ok(());
    }
    Err(format!(
        "e2b_listen = {addr} is not a loopback address and tcp_tls is off: the E2B API key \
         would cross the network in plain text. Listen on 127.0.0.1, or turn tcp_tls on"
    ))
}

/// `Host` must name this machine by a loopback name (any port).
pub fn loopback_host(host: Option<&str>) -> bool {
    let Some(h) = host else { return false };
    let name = match h.strip_prefix('[') {
        Some(rest) => rest.split(']').next().unwrap_or(""),
        None => h.rsplit_once(':').map(|(n, _)| n).unwrap_or(h),
    };
    matches!(name, "localhost" | "::1")
        || name
            .parse::<std::net::Ipv4Addr>()
            .is_ok_and(|ip| ip.is_loopback())
}

pub async fn run(
    listener: TcpListener,
    tls: Option<tokio_rustls::TlsAcceptor>,
    cfg: &HttpConfig,
    face: Arc<Face>,
    shutdown_tx: broadcast::Sender<()>,
) {
    let budget = ConnLimiter::new(cfg.max_connections, cfg.max_connections_per_peer);
    let t = Deadlines::from_config(cfg);
    let Ok(local) = listener.local_addr() else {
        return;
    };
    let check_host = tls.is_none();
    let mut conns = JoinSet::new();
    let mut shutdown = shutdown_tx.subscribe();
    tracing::info!(addr = %local, tls = tls.is_some(), "E2B API listening");
    loop {
        tokio::select! {
            _ = shutdown.recv() => break,
            accepted = listener.accept() => match accepted {
                Ok((stream, peer)) => {
                    let Ok(permit) = budget.try_acquire(limits::tcp_peer(local, peer)) else {
                        if tls.is_none() {
                            let _ = stream.try_write(limits::REFUSED_RESPONSE);
                        }
                        continue;
                    };
                    let (face, rx, tls) = (face.clone(), shutdown_tx.subscribe(), tls.clone());
                    conns.spawn(async move {
                        let _permit = permit;
                        match tls {
                            None => connection(stream, t, check_host, face, rx).await,
                            Some(acceptor) => match tokio::time::timeout(t.header, acceptor.accept(stream)).await {
                                Ok(Ok(s)) => connection(s, t, false, face, rx).await,
                                _ => tracing::debug!(%peer, "E2B TLS handshake failed or timed out"),
                            },
                        }
                    });
                }
                Err(e) => {
                    tracing::warn!(error = %e, "E2B listener: accept failed");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
            },
            Some(_) = conns.join_next(), if !conns.is_empty() => {}
        }
    }
    drop(listener);
    let drain = async { while conns.join_next().await.is_some() {} };
    if tokio::time::timeout(Duration::from_secs(5), drain)
        .await
        .is_err()
    {
        conns.abort_all();
    }
}

async fn connection<S>(
    stream: S,
    t: Deadlines,
    check_host: bool,
    face: Arc<Face>,
    mut shutdown: broadcast::Receiver<()>,
) where
    S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    let (stream, phase) = keepalive::timed(stream, t);
    let svc = hyper::service::service_fn(move |req: Request<Incoming>| {
        let face = face.clone();
        let phase = phase.clone();
        async move {
            phase.request_started();
            let host = req
                .headers()
                .get(hyper::header::HOST)
                .and_then(|v| v.to_str().ok());
            if check_host && !loopback_host(host) {
                return Ok::<_, std::convert::Infallible>(
                    phase.response(
                        super::E2bError::new(
                            hyper::StatusCode::FORBIDDEN,
                            "the E2B API answers only requests addressed to localhost",
                        )
                        .into_response(),
                    ),
                );
            }
            Ok(phase.response(super::handle(req, &face).await))
        }
    });
    let mut b = hyper::server::conn::http1::Builder::new();
    // hyper's header timer is off: `keepalive` bounds the header and the idle wait apart.
    b.timer(TokioTimer::new()).header_read_timeout(None);
    let conn = b.serve_connection(TokioIo::new(stream), svc);
    tokio::pin!(conn);
    tokio::select! {
        res = conn.as_mut() => {
            if let Err(e) = res {
                tracing::debug!(error = %e, "E2B connection ended with an error");
            }
        }
        _ = shutdown.recv() => {
            conn.as_mut().graceful_shutdown();
            let _ = conn.await;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_loopback_hosts_pass() {
        for ok in [
            "localhost:49982",
            "127.0.0.1:49982",
            "127.0.0.1",
            "[::1]:49982",
            "localhost",
        ] {
            assert!(loopback_host(Some(ok)), "{ok}");
        }
        for bad in [
            "evil.example:49982",
            "10.0.0.1:49982",
            "localhost.evil.com",
            "",
        ] {
            assert!(!loopback_host(Some(bad)), "{bad}");
        }
        assert!(!loopback_host(None));
    }

    #[test]
    fn off_loopback_needs_tls() {
        assert!(check_addr("127.0.0.1:1".parse().unwrap(), false).is_ok());
        assert!(check_addr("0.0.0.0:1".parse().unwrap(), false).is_err());
        assert!(check_addr("0.0.0.0:1".parse().unwrap(), true).is_ok());
    }
}
