//! The daemon (`tryboxi serve`, argv[0] `sandboxd`): HTTP/1.1 + JSON on a unix socket in the
//! data root (and optionally TCP with a token, over TLS off loopback).
//!
//! Owns: the single-daemon lock, the listening sockets and their budgets (`listen`, `limits`:
//! connection caps per listener and per peer, a header-read timeout; the body-read deadline is
//! here), TLS (`tls`), access checks (`middleware`), request parsing into one
//! [`router::Action`], the response envelope, and graceful shutdown (a broadcast signal on
//! SIGINT/SIGTERM; in-flight requests get a grace period).
//! Never: business logic (that is `service`).

mod handlers;
pub(crate) mod keepalive;
pub(crate) mod limits;
mod listen;
mod middleware;
pub mod response;
pub mod router;
#[cfg(any(test, fuzzing))]
pub mod router_fuzzing;
pub mod tls;

#[cfg(test)]
pub use handlers::OPENAPI_YAML;

use std::fs::File;
use std::io::Write as _;
use std::os::unix::fs::{DirBuilderExt as _, OpenOptionsExt, PermissionsExt};
use std::path::PathBuf;
use std::sync::Arc;

use bytes::Bytes;
use http_body_util::{BodyExt, Limited};
use hyper::body::Incoming;
use hyper::{Request, Response};
use nix::fcntl::{Flock, FlockArg};
use tokio::net::{TcpListener, UnixListener};
use tokio::sync::broadcast;

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
    /// Serve the E2B-compatible API here (overrides `e2b_listen` in config.toml).
    pub e2b: Option<std::net::SocketAddr>,
}

/// Where a request came from, for access checks.
#[derive(Clone, Copy)]
enum Via {
    /// With the peer's uid (SO_PEERCRED).
    Unix {
        uid: u32,
    },
    /// `uid`: the client socket's owner when it is on this machine (a loopback peer, looked up
    /// with sock_diag: [`limits::tcp_peer`]); `None` for a remote client.
    Tcp {
        port: u16,
        uid: Option<u32>,
    },
    Tls {
        uid: Option<u32>,
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
    // The OOM killer takes a sandbox's QEMU before the daemon (see `oom.rs`).
    crate::oom::protect_daemon();
    crate::oom::spawn_heap_trim();
    let config = Config::load(&paths)?;
    check_tcp_listen(&config)?;
    // Checked when the config was parsed.
    let _ = crate::vmm::jail::user::set_uid_base(config.vm_uid_base);
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
    let gate = middleware::PeerGate {
        own_uid: nix::unistd::geteuid().as_raw(),
        allowed: config.api.allowed_uids.clone(),
        config_file: paths.config_file(),
    };
    set_access_modes(&paths, !gate.allowed.is_empty())?;
    let tls = match config.tcp_listen {
        Some(_) if config.tcp_tls => Some(tls::acceptor(tls::ensure_identity(&paths)?)?),
        _ => None,
    };
    let tcp = match config.tcp_listen {
        Some(addr) => Some(
            TcpListener::bind(addr)
                .await
                .map_err(io_err("cannot listen on", addr.to_string()))?,
        ),
        None => None,
    };

    let e2b_addr = opts.e2b.or(config.e2b_listen);
    let e2b = match e2b_addr {
        Some(addr) => {
            crate::e2b::listen::check_addr(addr, config.tcp_tls).map_err(DaemonError::Setup)?;
            let l = TcpListener::bind(addr)
                .await
                .map_err(io_err("cannot listen on", addr.to_string()))?;
            let tls = match addr.ip().is_loopback() {
                true => None,
                false => Some(tls::acceptor(tls::ensure_identity(&paths)?)?),
            };
            Some((l, tls))
        }
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
    // A proxy setting that cannot be honoured stops the start (its text never quotes a
    // password). The network side (`service::netpolicy`) reads the same setting.
    match crate::network::upstream_proxy::from_env(
        config.network.upstream_proxy.as_deref(),
        config.network.upstream_no_proxy.as_deref(),
    ) {
        Err(e) => return Err(DaemonError::Setup(e.to_string())),
        Ok(Some(p)) => {
            tracing::info!(proxy = %p.display(), source = %p.source, no_proxy_entries = p.no_proxy_len(), "guest egress goes through the upstream proxy (CONNECT by name)")
        }
        Ok(None) => {}
    }
    let svc = Arc::new(Service::new(
        paths.clone(),
        config,
        store,
        artifacts,
        exporter,
    ));
    if let Some(why) = svc.secret_store.broken() {
        return Err(DaemonError::Setup(format!(
            "{why}. Fix or move aside {} (it holds your secrets) and start again",
            svc.secret_store.path().display()
        )));
    }
    svc.recover().await;
    // Memory pressure watcher: pauses the idlest sandboxes to disk.
    crate::service::pressure::spawn(
        &svc,
        Arc::new(crate::service::ServicePauser(Arc::downgrade(&svc))),
    );
    svc.start_lifecycle();
    svc.start_e2b_deadlines();
    let shared = Arc::new(Shared {
        svc: svc.clone(),
        token,
    });
    let (shutdown_tx, _) = broadcast::channel::<()>(1);
    spawn_signal_handler(shutdown_tx.clone());
    tracing::info!(socket = %sock.display(), tcp = ?shared.svc.config.tcp_listen, tls = tls.is_some(), root = %paths.root.display(), "tryboxi daemon listening");

    if let Some((l, e2b_tls)) = e2b {
        let face = crate::e2b::Face::start(svc.clone(), shared.token.clone());
        let (cfg, tx) = (shared.svc.config.http.clone(), shutdown_tx.clone());
        tokio::spawn(async move { crate::e2b::listen::run(l, e2b_tls, &cfg, face, tx).await });
    }
    listen::run(
        listen::Listeners {
            unix,
            gate,
            tcp,
            tls,
        },
        &shared.svc.config.http,
        shared.clone(),
        shutdown_tx,
    )
    .await;
    svc.shutdown().await;
    let _ = crate::safefs::remove_under(&paths.root, &sock);
    tracing::info!("daemon stopped");
    Ok(())
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

/// The top-level directories of the data root, made ahead when other users may reach the
/// socket (see [`set_access_modes`]) so that none is ever made open to them later.
const SHARED_ROOT_DIRS: [fn(&Paths) -> PathBuf; 4] = [
    Paths::sandboxes_dir,
    Paths::golden_dir,
    Paths::cache_dir,
    Paths::artifacts_dir,
];

/// Modes of the data root and the socket. Only the daemon's user (and root): 0700 and 0600.
/// `shared` (`[api] allowed_uids` lists other users): the socket 0666 and the data root 0711,
/// so other users can reach the socket by its name and list nothing; every other entry of the
/// data root loses its group and other bits and the usual directories are made ahead (0700),
/// so nothing deeper is reachable whatever its own mode. Which uid may then talk is the
/// SO_PEERCRED gate's decision (`middleware::PeerGate`), which names the fix when it refuses.
fn set_access_modes(paths: &Paths, shared: bool) -> Result<(), DaemonError> {
    let chmod = |p: &std::path::Path, mode: u32| {
        std::fs::set_permissions(p, std::fs::Permissions::from_mode(mode))
            .map_err(io_err("cannot set the mode of", p))
    };
    let sock = paths.socket();
    if !shared {
        chmod(&paths.root, 0o700)?;
        return chmod(&sock, 0o600);
    }
    for dir in SHARED_ROOT_DIRS.map(|f| f(paths)) {
        match std::fs::DirBuilder::new().mode(0o700).create(&dir) {
            Err(e) if e.kind() != std::io::ErrorKind::AlreadyExists => {
                return Err(io_err("cannot create", &dir)(e));
            }
            _ => {}
        }
    }
    let entries = std::fs::read_dir(&paths.root).map_err(io_err("cannot read", &paths.root))?;
    for entry in entries.flatten() {
        let path = entry.path();
        let Ok(md) = std::fs::symlink_metadata(&path) else {
            continue;
        };
        if path == sock || md.file_type().is_symlink() {
            continue;
        }
        let mode = md.permissions().mode() & 0o7777;
        if mode & 0o077 != 0 {
            chmod(&path, mode & !0o077)?;
        }
    }
    chmod(&paths.root, 0o711)?;
    chmod(&sock, 0o666)?;
    tracing::info!(root = %paths.root.display(), "[api] allowed_uids is set: the socket is 0666 and the data root 0711");
    Ok(())
}

/// A TCP listener off loopback must be TLS: the token must never cross the network in plain
/// text.
pub(crate) fn check_tcp_listen(config: &Config) -> Result<(), DaemonError> {
    match config.tcp_listen {
        Some(addr) if !addr.ip().is_loopback() && !config.tcp_tls => {
            Err(DaemonError::Setup(format!(
                "tcp_listen = \"{addr}\" is not a loopback address and tcp_tls is off: the API \
                 token would cross the network in plain text. Set `tcp_tls = true` in \
                 config.toml (clients pin the certificate fingerprint `tryboxi token` prints) \
                 or listen on 127.0.0.1"
            )))
        }
        _ => Ok(()),
    }
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
    match via {
        Via::Unix { .. } => {}
        Via::Tcp { port, .. } => middleware::check_tcp(req.headers(), &shared.token, port)?,
        Via::Tls { .. } => middleware::check_tls(req.headers(), &shared.token)?,
    }
    let (parts, body) = req.into_parts();
    let limit = std::time::Duration::from_secs(shared.svc.config.http.body_timeout_s.max(1));
    let body: Bytes = tokio::time::timeout(limit, Limited::new(body, MAX_BODY).collect())
        .await
        .map_err(|_| {
            ApiError::new(
                hyper::StatusCode::REQUEST_TIMEOUT,
                "timeout",
                format!(
                    "the request body did not arrive within {} s ([http] body_timeout_s)",
                    limit.as_secs()
                ),
            )
        })?
        .map_err(|e| {
            ApiError::new(
                hyper::StatusCode::PAYLOAD_TOO_LARGE,
                "too_large",
                format!("request body: {e}"),
            )
        })?
        .to_bytes();
    let action = router::parse_request(&parts.method, &parts.uri, &parts.headers, &body)?;
    // A loopback TCP/TLS client is refused its own home folder like a unix-socket one.
    let caller_uid = match via {
        Via::Unix { uid } => Some(uid),
        Via::Tcp { uid, .. } | Via::Tls { uid } => uid,
    };
    handlers::handle(&shared.svc, action, caller_uid).await
}
