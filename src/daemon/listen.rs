//! The accept loop: who gets a connection and how long it may take to say what it wants.
//!
//! Owns: accepting on the unix socket and `tcp_listen`, each listener's connection budget
//! ([`limits::ConnLimiter`]; a refused connection gets a 503 and is closed), the TLS handshake
//! (bounded by the header timeout), the header and idle deadlines ([`keepalive`]: a request
//! header must be complete within `header_timeout_s` of opening or of its first byte, the next
//! request must begin within `idle_timeout_s` of a response ending; a response already
//! streaming, such as `GET /v1/events` or exec NDJSON, is never cut), backing off when accept
//! fails (out of descriptors), and draining connections at shutdown.
//! Never: what a request does (`dispatch`).

use std::sync::Arc;
use std::time::Duration;

use hyper::Request;
use hyper::body::Incoming;
use hyper_util::rt::{TokioIo, TokioTimer};
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::net::{TcpListener, UnixListener};
use tokio::sync::broadcast;
use tokio::task::JoinSet;

use super::keepalive::{self, Deadlines};
use super::limits::{self, ConnLimiter, ConnPermit, LimitHit, PeerKey};
use super::{Shared, Via, middleware};
use crate::config::HttpConfig;

/// Descriptors kept free for everything but client connections (QEMU, QMP, vsock, store,
/// logs...) when the connection caps are sized against `RLIMIT_NOFILE`.
const RESERVED_FDS: u64 = 512;

pub struct Listeners {
    pub unix: UnixListener,
    /// Who may use `unix`.
    pub gate: middleware::PeerGate,
    pub tcp: Option<TcpListener>,
    pub tls: Option<tokio_rustls::TlsAcceptor>,
}

/// Serve both listeners until `shutdown` fires, then drain (5 s grace).
pub async fn run(
    l: Listeners,
    cfg: &HttpConfig,
    shared: Arc<Shared>,
    shutdown_tx: broadcast::Sender<()>,
) {
    let listeners = 1 + usize::from(l.tcp.is_some());
    let max_total = cap_by_nofile(cfg.max_connections, listeners);
    let unix_budget = ConnLimiter::new(max_total, cfg.max_connections_per_peer);
    let tcp_budget = ConnLimiter::new(max_total, cfg.max_connections_per_peer);
    let t = Deadlines::from_config(cfg);
    let tcp_local = l.tcp.as_ref().and_then(|t| t.local_addr().ok());
    let mut conns = JoinSet::new();
    let mut shutdown = shutdown_tx.subscribe();
    let gate = Arc::new(l.gate.clone());
    loop {
        tokio::select! {
            _ = shutdown.recv() => break,
            accepted = l.unix.accept() => match accepted {
                Ok((stream, _)) => {
                    let uid = stream.peer_cred().map(|c| c.uid()).unwrap_or(u32::MAX);
                    let permit = match unix_budget.try_acquire(PeerKey::Uid(uid)) {
                        Ok(p) => p,
                        Err(hit) => {
                            turn_away(&hit, || stream.try_write(limits::REFUSED_RESPONSE));
                            continue;
                        }
                    };
                    if !gate.allows(uid) {
                        tracing::warn!(peer_uid = uid, "refused a unix-socket client of another user");
                        conns.spawn(refuse(stream, gate.clone(), uid, t, permit));
                        continue;
                    }
                    conns.spawn(connection(stream, Via::Unix { uid }, t, shared.clone(), shutdown_tx.subscribe(), permit));
                }
                Err(e) => accept_failed("the unix socket", e).await,
            },
            accepted = accept_tcp(l.tcp.as_ref()) => match accepted {
                Ok((stream, peer)) => {
                    let Some(local) = tcp_local else { continue };
                    let key = limits::tcp_peer(local, peer);
                    let uid = match key {
                        limits::PeerKey::Uid(u) => Some(u),
                        limits::PeerKey::Ip(_) => None,
                    };
                    let permit = match tcp_budget.try_acquire(key) {
                        Ok(p) => p,
                        Err(hit) => {
                            // A TLS client would read plain text as a broken handshake: it
                            // only sees the close.
                            let plain = l.tls.is_none();
                            turn_away(&hit, || match plain {
                                true => stream.try_write(limits::REFUSED_RESPONSE),
                                false => Ok(0),
                            });
                            continue;
                        }
                    };
                    let shared = shared.clone();
                    let rx = shutdown_tx.subscribe();
                    match l.tls.clone() {
                        None => {
                            conns.spawn(connection(stream, Via::Tcp { port: local.port(), uid }, t, shared, rx, permit));
                        }
                        Some(acceptor) => {
                            conns.spawn(async move {
                                match tokio::time::timeout(t.header, acceptor.accept(stream)).await {
                                    Ok(Ok(tls)) => connection(tls, Via::Tls { uid }, t, shared, rx, permit).await,
                                    Ok(Err(e)) => tracing::debug!(%peer, error = %e, "TLS handshake failed"),
                                    Err(_) => tracing::debug!(%peer, "TLS handshake timed out"),
                                }
                            });
                        }
                    }
                }
                Err(e) => accept_failed("TCP", e).await,
            },
            Some(_) = conns.join_next(), if !conns.is_empty() => {}
        }
    }
    tracing::info!("shutting down: draining connections");
    drop(l);
    let drain = async { while conns.join_next().await.is_some() {} };
    if tokio::time::timeout(Duration::from_secs(5), drain)
        .await
        .is_err()
    {
        tracing::warn!("connections still open after 5 s; closing them");
        conns.abort_all();
    }
}

/// Answer a connection over budget with the canned 503 (without waiting on the peer) and
/// close it.
fn turn_away(hit: &LimitHit, write: impl FnOnce() -> std::io::Result<usize>) {
    tracing::debug!(reason = %hit, "refused a connection");
    metrics::counter!("tryboxi_http_connections_refused_total").increment(1);
    let _ = write();
}

/// Accept failed (EMFILE, ENFILE, ENOBUFS...): log and back off briefly instead of spinning.
async fn accept_failed(on: &str, e: std::io::Error) {
    tracing::warn!(listener = on, error = %e, "accept failed");
    tokio::time::sleep(Duration::from_millis(100)).await;
}

async fn accept_tcp(
    l: Option<&TcpListener>,
) -> std::io::Result<(tokio::net::TcpStream, std::net::SocketAddr)> {
    match l {
        Some(l) => l.accept().await,
        None => std::future::pending().await,
    }
}

/// Raise the soft `RLIMIT_NOFILE` to the hard limit, and size each listener's cap so that all
/// of them together leave [`RESERVED_FDS`] free.
fn cap_by_nofile(wanted: usize, listeners: usize) -> usize {
    use nix::sys::resource::{Resource, getrlimit, setrlimit};
    let Ok((soft, hard)) = getrlimit(Resource::RLIMIT_NOFILE) else {
        return wanted;
    };
    let soft = if soft < hard && setrlimit(Resource::RLIMIT_NOFILE, hard, hard).is_ok() {
        hard
    } else {
        soft
    };
    let room = (soft.saturating_sub(RESERVED_FDS) / listeners as u64).max(16);
    if (wanted as u64) > room {
        tracing::warn!(
            max_connections = wanted,
            nofile = soft,
            using = room,
            "max_connections is more than the descriptor limit allows; using less"
        );
        return room as usize;
    }
    wanted
}

/// hyper's own header timer is off: [`keepalive`] bounds the header and the idle wait apart.
fn http1() -> hyper::server::conn::http1::Builder {
    let mut b = hyper::server::conn::http1::Builder::new();
    b.timer(TokioTimer::new()).header_read_timeout(None);
    b
}

/// Answer a peer the gate refuses with one 403 `uid_not_allowed` and close.
async fn refuse(
    stream: tokio::net::UnixStream,
    gate: Arc<middleware::PeerGate>,
    uid: u32,
    t: Deadlines,
    _permit: ConnPermit,
) {
    let (stream, _phase) = keepalive::timed(stream, t);
    let svc = hyper::service::service_fn(move |_req: Request<Incoming>| {
        let resp = gate.refusal(uid).into_response();
        async move { Ok::<_, std::convert::Infallible>(resp) }
    });
    let _ = http1()
        .keep_alive(false)
        .serve_connection(TokioIo::new(stream), svc)
        .await;
}

async fn connection<S>(
    stream: S,
    via: Via,
    t: Deadlines,
    shared: Arc<Shared>,
    mut shutdown: broadcast::Receiver<()>,
    _permit: ConnPermit,
) where
    S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    let (stream, phase) = keepalive::timed(stream, t);
    let svc = hyper::service::service_fn(move |req| {
        let shared = shared.clone();
        let phase = phase.clone();
        async move {
            phase.request_started();
            let resp = super::dispatch(req, via, &shared).await;
            Ok::<_, std::convert::Infallible>(phase.response(resp))
        }
    });
    let conn = http1().serve_connection(TokioIo::new(stream), svc);
    tokio::pin!(conn);
    tokio::select! {
        res = conn.as_mut() => {
            if let Err(e) = res {
                tracing::debug!(error = %e, "connection ended with an error");
            }
        }
        _ = shutdown.recv() => {
            conn.as_mut().graceful_shutdown();
            let _ = conn.await;
        }
    }
}
