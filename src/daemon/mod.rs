//! The daemon (`tryboxi serve`, argv[0] `sandboxd`): HTTP/1.1 + JSON on a unix socket in the
//! data root (and optionally TCP with a token).
//!
//! Owns: the single-daemon lock, the listening sockets, access checks (`middleware`), request
//! parsing into one [`router::Action`], the response envelope, and graceful shutdown (a
//! broadcast signal on SIGINT/SIGTERM; in-flight requests get a grace period).
//! Never: business logic (that is `service`).

mod handlers;
mod middleware;
pub mod response;
pub mod router;

#[cfg(test)]
pub use handlers::OPENAPI_YAML;

use std::fs::File;
use std::io::Write as _;
use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Limited};
use hyper::body::Incoming;
use hyper::{Request, Response};
use hyper_util::rt::TokioIo;
use nix::fcntl::{Flock, FlockArg};
use tokio::net::{TcpListener, UnixListener};
use tokio::sync::broadcast;
use tokio::task::JoinSet;

use crate::config::{Config, ConfigError, Paths};
use crate::service::Service;
use crate::store::{Store, StoreError};
use response::{ApiError, Body};

/// Largest request body accepted (JSON requests are small; file uploads use their own routes).
const MAX_BODY: usize = 16 * 1024 * 1024;

#[derive(Debug, thiserror::Error)]
pub enum DaemonError {
    #[error(transparent)]
    Config(#[from] ConfigError),
    #[error(transparent)]
    Store(#[from] StoreError),
    #[error("another tryboxi daemon (pid {pid}) already serves {root}; stop it first")]
    AlreadyRunning { pid: String, root: PathBuf },
    #[error("{what} {path}: {source}")]
    Io {
        what: &'static str,
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{0}")]
    Setup(String),
}

fn io_err(
    what: &'static str,
    path: impl Into<PathBuf>,
) -> impl FnOnce(std::io::Error) -> DaemonError {
    let path = path.into();
    move |source| DaemonError::Io { what, path, source }
}

pub struct ServeOptions {
    pub artifacts: Option<PathBuf>,
    /// Export traces over OTLP/HTTP here (overrides `otlp_endpoint` in config.toml).
    pub otlp_endpoint: Option<String>,
}

/// Where a request came from, for access checks.
#[derive(Clone, Copy)]
enum Via {
    /// With the peer's uid (SO_PEERCRED).
    Unix {
        uid: u32,
    },
    Tcp {
        port: u16,
    },
}

struct Shared {
    svc: Arc<Service>,
    token: String,
}

/// Run the daemon until SIGINT/SIGTERM.
pub async fn serve(opts: ServeOptions) -> Result<(), DaemonError> {
    let paths = Paths::discover()?;
    std::fs::create_dir_all(&paths.root)
        .map_err(io_err("cannot create the data root", &paths.root))?;
    std::fs::set_permissions(&paths.root, std::fs::Permissions::from_mode(0o700))
        .map_err(io_err("cannot restrict", &paths.root))?;
    let _lock = acquire_lock(&paths)?;
    let config = Config::load(&paths)?;
    let store = Store::open(&paths.store_file())?;
    let token = ensure_token(&paths)?;
    let artifacts = opts
        .artifacts
        .or_else(|| config.artifacts.clone())
        .unwrap_or_else(|| paths.artifacts_dir());
    let artifacts = std::path::absolute(&artifacts).unwrap_or(artifacts);

    // The lock is ours, so any socket file left behind is stale.
    let sock = paths.socket();
    crate::safefs::remove_under(&paths.root, &sock)
        .map_err(|e| DaemonError::Setup(e.to_string()))?;
    let unix = UnixListener::bind(&sock).map_err(io_err("cannot listen on", &sock))?;
    std::fs::set_permissions(&sock, std::fs::Permissions::from_mode(0o600))
        .map_err(io_err("cannot restrict", &sock))?;
    let tcp = match config.tcp_listen {
        Some(addr) => Some(
            TcpListener::bind(addr)
                .await
                .map_err(io_err("cannot listen on", addr.to_string()))?,
        ),
        None => None,
    };

    let otlp = opts.otlp_endpoint.or_else(|| config.otlp_endpoint.clone());
    let exporter = match otlp {
        Some(url) => Some(
            crate::telemetry::otlp::exporter(&url)
                .map_err(|e| DaemonError::Setup(e.to_string()))?,
        ),
        None => None,
    };
    let svc = Arc::new(Service::new(
        paths.clone(),
        config,
        store,
        artifacts,
        exporter,
    ));
    svc.recover().await;
    // Memory pressure watcher: pauses the idlest sandboxes to disk.
    crate::service::pressure::spawn(
        &svc,
        Arc::new(crate::service::ServicePauser(Arc::downgrade(&svc))),
    );
    svc.start_lifecycle();
    let shared = Arc::new(Shared {
        svc: svc.clone(),
        token,
    });
    let (shutdown_tx, _) = broadcast::channel::<()>(1);
    spawn_signal_handler(shutdown_tx.clone());
    tracing::info!(socket = %sock.display(), tcp = ?shared.svc.config.tcp_listen, root = %paths.root.display(), "tryboxi daemon listening");

    let mut conns = JoinSet::new();
    let mut shutdown = shutdown_tx.subscribe();
    let own_uid = nix::unistd::geteuid().as_raw();
    loop {
        tokio::select! {
            _ = shutdown.recv() => break,
            accepted = unix.accept() => match accepted {
                Ok((stream, _)) => {
                    let uid = stream.peer_cred().map(|c| c.uid()).unwrap_or(u32::MAX);
                    if !middleware::peer_allowed(uid, own_uid) {
                        tracing::warn!(peer_uid = uid, "refused a unix-socket client of another user");
                        conns.spawn(refuse(stream, uid));
                        continue;
                    }
                    conns.spawn(connection(stream, Via::Unix { uid }, shared.clone(), shutdown_tx.subscribe()));
                }
                Err(e) => tracing::warn!(error = %e, "accept failed on the unix socket"),
            },
            accepted = accept_tcp(tcp.as_ref()) => match accepted {
                Ok((stream, port)) => {
                    conns.spawn(connection(stream, Via::Tcp { port }, shared.clone(), shutdown_tx.subscribe()));
                }
                Err(e) => tracing::warn!(error = %e, "accept failed on TCP"),
            },
            Some(_) = conns.join_next(), if !conns.is_empty() => {}
        }
    }
    tracing::info!("shutting down: draining connections");
    drop(unix);
    let drain = async { while conns.join_next().await.is_some() {} };
    if tokio::time::timeout(Duration::from_secs(5), drain)
        .await
        .is_err()
    {
        tracing::warn!("connections still open after 5 s; closing them");
        conns.abort_all();
    }
    svc.shutdown().await;
    let _ = crate::safefs::remove_under(&paths.root, &sock);
    tracing::info!("daemon stopped");
    Ok(())
}

async fn accept_tcp(l: Option<&TcpListener>) -> std::io::Result<(tokio::net::TcpStream, u16)> {
    match l {
        Some(l) => {
            let (s, _) = l.accept().await?;
            let port = l.local_addr()?.port();
            Ok((s, port))
        }
        None => std::future::pending().await,
    }
}

fn spawn_signal_handler(tx: broadcast::Sender<()>) {
    use tokio::signal::unix::{SignalKind, signal};
    tokio::spawn(async move {
        let (Ok(mut int), Ok(mut term)) = (
            signal(SignalKind::interrupt()),
            signal(SignalKind::terminate()),
        ) else {
            tracing::error!("cannot install signal handlers");
            return;
        };
        tokio::select! {
            _ = int.recv() => tracing::info!("SIGINT received"),
            _ = term.recv() => tracing::info!("SIGTERM received"),
        }
        let _ = tx.send(());
    });
}

/// Hold an exclusive flock on `tryboxi.lock` (with our pid in it) for the daemon's lifetime.
fn acquire_lock(paths: &Paths) -> Result<Flock<File>, DaemonError> {
    let path = paths.lock_file();
    let file = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .mode(0o600)
        .open(&path)
        .map_err(io_err("cannot open", &path))?;
    match Flock::lock(file, FlockArg::LockExclusiveNonblock) {
        Ok(mut lock) => {
            lock.set_len(0).map_err(io_err("cannot write", &path))?;
            write!(lock, "{}", std::process::id()).map_err(io_err("cannot write", &path))?;
            Ok(lock)
        }
        Err((_, nix::errno::Errno::EWOULDBLOCK)) => Err(DaemonError::AlreadyRunning {
            pid: std::fs::read_to_string(&path)
                .unwrap_or_default()
                .trim()
                .to_owned(),
            root: paths.root.clone(),
        }),
        Err((_, e)) => Err(DaemonError::Io {
            what: "cannot lock",
            path,
            source: e.into(),
        }),
    }
}

/// The bearer token for TCP clients: created once (0600), then reused.
pub fn ensure_token(paths: &Paths) -> Result<String, DaemonError> {
    let path = paths.token_file();
    if let Ok(t) = std::fs::read_to_string(&path)
        && !t.trim().is_empty()
    {
        return Ok(t.trim().to_owned());
    }
    let token = crate::ids::new_id("tbx_") + &crate::ids::new_id("")[..16];
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(0o600)
        .open(&path)
        .map_err(io_err("cannot create", &path))?;
    f.write_all(token.as_bytes())
        .map_err(io_err("cannot write", &path))?;
    Ok(token)
}

/// Answer a refused peer with one 403 and close.
async fn refuse(stream: tokio::net::UnixStream, uid: u32) {
    let svc = hyper::service::service_fn(move |_req: Request<Incoming>| async move {
        Ok::<_, std::convert::Infallible>(
            ApiError::forbidden(format!(
                "uid {uid} may not use this daemon (only its owner and root)"
            ))
            .into_response(),
        )
    });
    let _ = hyper::server::conn::http1::Builder::new()
        .keep_alive(false)
        .serve_connection(TokioIo::new(stream), svc)
        .await;
}

async fn connection<S>(
    stream: S,
    via: Via,
    shared: Arc<Shared>,
    mut shutdown: broadcast::Receiver<()>,
) where
    S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
{
    let svc = hyper::service::service_fn(move |req| {
        let shared = shared.clone();
        async move { Ok::<_, std::convert::Infallible>(dispatch(req, via, &shared).await) }
    });
    let conn =
        hyper::server::conn::http1::Builder::new().serve_connection(TokioIo::new(stream), svc);
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

async fn dispatch(req: Request<Incoming>, via: Via, shared: &Shared) -> Response<Body> {
    let method = req.method().clone();
    let path = req.uri().path().to_owned();
    let started = std::time::Instant::now();
    let resp = match handle(req, via, shared).await {
        Ok(r) => r,
        Err(e) => e.into_response(),
    };
    tracing::info!(%method, %path, status = resp.status().as_u16(), ms = started.elapsed().as_millis() as u64, "request");
    resp
}

async fn handle(
    req: Request<Incoming>,
    via: Via,
    shared: &Shared,
) -> Result<Response<Body>, ApiError> {
    if let Via::Tcp { port } = via {
        middleware::check_tcp(req.headers(), &shared.token, port)?;
    }
    let (parts, body) = req.into_parts();
    let body: Bytes = Limited::new(body, MAX_BODY)
        .collect()
        .await
        .map_err(|e| {
            ApiError::new(
                hyper::StatusCode::PAYLOAD_TOO_LARGE,
                "too_large",
                format!("request body: {e}"),
            )
        })?
        .to_bytes();
    let action = router::parse_request(&parts.method, &parts.uri, &parts.headers, &body)?;
    let caller_uid = match via {
        Via::Unix { uid } => Some(uid),
        Via::Tcp { .. } => None,
    };
    handlers::handle(&shared.svc, action, caller_uid).await
}
