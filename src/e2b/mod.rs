//! The E2B face: people's E2B SDK code (Python `e2b`, `e2b-code-interpreter`, npm `e2b`) runs
//! unchanged against the local daemon after `E2B_API_URL`, `E2B_SANDBOX_URL` and
//! `E2B_API_KEY` point at it (`tryboxi serve --e2b 127.0.0.1:49982`, config key `e2b_listen`).
//!
//! One origin serves the control plane (REST/JSON, `X-API-KEY` = the daemon's token) and every
//! sandbox's envd (the Connect protocol with the JSON codec, `/files`, `/health`), told apart
//! by the `E2b-Sandbox-Id` / `E2b-Sandbox-Port` headers the SDK sends when `E2B_SANDBOX_URL` is
//! set. The wire protocol is `../shared/e2b/WIRE.md`.
//!
//! Owns: the listener (`listen.rs`: loopback with a loopback `Host` check, or TLS; connection
//! budget; header timeout), authentication (API key; per-sandbox envd and traffic tokens,
//! compared in constant time), routing, and the mapping of E2B requests and shapes onto the
//! service (`control.rs`, `process.rs`, `filesystem.rs`, `files.rs`). Never: business logic
//! (the service does it) or the per-sandbox records (`service::e2b`). The face sees, lists,
//! kills and times out only sandboxes it created.

mod connect;
mod control;
mod entry;
mod files;
mod filesystem;
#[cfg(test)]
mod fuzzing;
pub mod history;
pub mod idempotency;
pub mod listen;
mod metrics;
mod ports;
mod process;
mod proto;
mod snapshots;
pub(crate) mod upload;
mod watch;

use std::sync::Arc;

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper::header::{self, HeaderMap};
use hyper::{Request, Response, StatusCode};

use crate::daemon::response::Body;
use crate::service::Service;
use crate::service::e2b::E2bSandbox;

/// The envd version we speak (gates SDK features: see WIRE.md).
pub const ENVD_VERSION: &str = "0.5.7";
/// envd's port, as the SDK names it in `E2b-Sandbox-Port`.
pub const ENVD_PORT: u16 = 49983;
/// Largest control-plane or unary request body.
const MAX_JSON_BODY: usize = 1024 * 1024;
/// The user E2B code runs as, and its home (relative paths start there).
pub const DEFAULT_USER: &str = "user";

/// What every E2B request handler gets.
pub struct Face {
    pub svc: Arc<Service>,
    /// The daemon's API token (`tryboxi token`): the E2B API key.
    pub token: String,
    /// Directory watches (`filesystem.Filesystem/WatchDir` and the polled watchers).
    pub watchers: watch::Watchers,
    /// `Idempotency-Key`s of creates (see [`idempotency`]).
    pub idempotency: idempotency::Keys,
    /// Every sandbox's metrics samples (see [`history`]).
    pub history: Arc<history::History>,
}

impl Face {
    /// The face of `svc` with API key `token`, its metrics sampler started.
    pub fn start(svc: Arc<Service>, token: String) -> Arc<Face> {
        let face = Arc::new(Face {
            svc,
            token,
            watchers: Default::default(),
            idempotency: Default::default(),
            history: Default::default(),
        });
        history::spawn(&face);
        face
    }
}

/// An error in E2B's control-plane shape: `{"code": <http status>, "message": "..."}`.
#[derive(Debug)]
pub struct E2bError {
    pub status: StatusCode,
    pub message: String,
}

impl E2bError {
    pub fn new(status: StatusCode, message: impl Into<String>) -> Self {
        E2bError {
            status,
            message: message.into(),
        }
    }

    pub fn into_response(self) -> Response<Body> {
        json(
            self.status,
            &serde_json::json!({ "code": self.status.as_u16(), "message": self.message }),
        )
    }
}

impl From<crate::service::ServiceError> for E2bError {
    fn from(e: crate::service::ServiceError) -> Self {
        use crate::service::ServiceError as S;
        let status = match &e {
            S::NotFound(_) => StatusCode::NOT_FOUND,
            S::BadRequest(_) | S::Unprocessable(_) => StatusCode::BAD_REQUEST,
            S::Conflict(_) | S::NoWorkspace(_) => StatusCode::CONFLICT,
            S::PortNotOpen(_) => StatusCode::BAD_GATEWAY,
            S::Forbidden(_) => StatusCode::FORBIDDEN,
            S::Unavailable(_) => StatusCode::SERVICE_UNAVAILABLE,
            S::Busy(_) => StatusCode::TOO_MANY_REQUESTS,
            S::NoSpace(_) => StatusCode::INSUFFICIENT_STORAGE,
            S::Internal(_) => StatusCode::INTERNAL_SERVER_ERROR,
        };
        E2bError::new(status, e.to_string())
    }
}

pub fn json<T: serde::Serialize>(status: StatusCode, v: &T) -> Response<Body> {
    let bytes = serde_json::to_vec(v).unwrap_or_default();
    Response::builder()
        .status(status)
        .header(header::CONTENT_TYPE, "application/json")
        .body(Full::new(Bytes::from(bytes)).boxed())
        .unwrap_or_else(|_| Response::new(Full::new(Bytes::new()).boxed()))
}

pub fn empty(status: StatusCode) -> Response<Body> {
    let mut r = Response::new(Full::new(Bytes::new()).boxed());
    *r.status_mut() = status;
    r
}

/// A 502 in the shape the SDK reads: a body containing "was not found" becomes its
/// `SandboxNotRunningException` (a body with "port is not open" its unreachable error).
pub fn not_running(id: &str) -> Response<Body> {
    json(
        StatusCode::BAD_GATEWAY,
        &serde_json::json!({
            "code": 502,
            "message": format!("The sandbox {id} was not found or is not running"),
            "sandboxId": id,
        }),
    )
}

/// `a == b` in time independent of where they differ.
pub fn token_eq(a: &str, b: &str) -> bool {
    use subtle::ConstantTimeEq as _;
    a.len() == b.len() && bool::from(a.as_bytes().ct_eq(b.as_bytes()))
}

fn header_str<'a>(h: &'a HeaderMap, name: &str) -> Option<&'a str> {
    h.get(name).and_then(|v| v.to_str().ok())
}

impl From<crate::service::ServiceError> for connect::ConnectError {
    fn from(e: crate::service::ServiceError) -> Self {
        use crate::service::ServiceError as S;
        let code = match &e {
            S::NotFound(_) => connect::Code::NotFound,
            S::BadRequest(_) => connect::Code::InvalidArgument,
            S::Unprocessable(_) => connect::Code::FailedPrecondition,
            S::Conflict(_) => connect::Code::AlreadyExists,
            S::NoWorkspace(_) => connect::Code::FailedPrecondition,
            S::PortNotOpen(_) => connect::Code::Unavailable,
            S::Forbidden(_) => connect::Code::PermissionDenied,
            S::Unavailable(_) => connect::Code::Unavailable,
            S::Busy(_) | S::NoSpace(_) => connect::Code::ResourceExhausted,
            S::Internal(_) => connect::Code::Internal,
        };
        connect::ConnectError::new(code, e.to_string())
    }
}

/// A `200 application/connect+json` response whose envelopes arrive on `rx`.
pub fn connect_stream(
    rx: tokio::sync::mpsc::Receiver<Bytes>,
) -> hyper::Response<crate::daemon::response::Body> {
    use futures_util::StreamExt as _;
    use http_body_util::BodyExt as _;
    let stream = tokio_stream::wrappers::ReceiverStream::new(rx)
        .map(|b| Ok::<_, std::convert::Infallible>(hyper::body::Frame::data(b)));
    hyper::Response::builder()
        .header(hyper::header::CONTENT_TYPE, "application/connect+json")
        .body(http_body_util::BodyExt::boxed(
            http_body_util::StreamBody::new(stream),
        ))
        .unwrap_or_else(|_| hyper::Response::new(http_body_util::Full::new(Bytes::new()).boxed()))
}

/// A unary Connect error: the code's HTTP status and `{"code","message"}`.
pub fn connect_unary_error(e: &connect::ConnectError) -> Response<Body> {
    let status =
        StatusCode::from_u16(e.code.http_status()).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    json(status, &e.json())
}

/// A streaming answer that is only an end-of-stream error (Connect sends stream errors in a 200).
pub fn connect_stream_error(e: &connect::ConnectError) -> Response<Body> {
    let (tx, rx) = tokio::sync::mpsc::channel(1);
    let _ = tx.try_send(connect::end(Some(e)));
    connect_stream(rx)
}

/// Read a whole (small) body, bounded.
pub async fn read_body(body: Incoming, max: usize) -> Result<Bytes, E2bError> {
    match http_body_util::Limited::new(body, max).collect().await {
        Ok(c) => Ok(c.to_bytes()),
        Err(e) => Err(E2bError::new(
            StatusCode::PAYLOAD_TOO_LARGE,
            format!("cannot read the request body (at most {max} bytes): {e}"),
        )),
    }
}

/// Route one request: to a sandbox's envd (or another of its ports) when it names a sandbox,
/// else to the control plane.
pub async fn handle(req: Request<Incoming>, face: &Face) -> Response<Body> {
    let sandbox = header_str(req.headers(), "e2b-sandbox-id").map(str::to_owned);
    let Some(id) = sandbox else {
        return control::handle(req, face)
            .await
            .unwrap_or_else(E2bError::into_response);
    };
    let port = match header_str(req.headers(), "e2b-sandbox-port") {
        None => ENVD_PORT,
        Some(p) => match p.parse::<u16>() {
            Ok(p) => p,
            Err(_) => {
                return E2bError::new(StatusCode::BAD_REQUEST, "bad E2b-Sandbox-Port")
                    .into_response();
            }
        },
    };
    let rec = match face.svc.e2b_get(&id) {
        Ok(Some(r)) => r,
        Ok(None) => return not_running(&id),
        Err(e) => return E2bError::from(e).into_response(),
    };
    if port == ENVD_PORT {
        // Knowing a sandbox id is not enough: envd calls carry its access token.
        let given = header_str(req.headers(), "x-access-token").unwrap_or("");
        if !token_eq(given, &rec.envd_token) {
            return connect_unauthenticated();
        }
        return envd(req, face, &rec).await;
    }
    let given = header_str(req.headers(), "e2b-traffic-access-token").unwrap_or("");
    if !token_eq(given, &rec.traffic_token) {
        return E2bError::new(
            StatusCode::FORBIDDEN,
            "missing or wrong E2B-Traffic-Access-Token for this sandbox",
        )
        .into_response();
    }
    ports::proxy(req, face, &rec, port).await
}

fn connect_unauthenticated() -> Response<Body> {
    connect_unary_error(&connect::ConnectError::new(
        connect::Code::Unauthenticated,
        "missing or wrong X-Access-Token for this sandbox",
    ))
}

/// envd: `/health`, `/files`, and the Connect services.
async fn envd(req: Request<Incoming>, face: &Face, rec: &E2bSandbox) -> Response<Body> {
    let path = req.uri().path().to_owned();
    match (req.method().as_str(), path.as_str()) {
        ("GET", "/health") => match face.svc.get_sandbox(&rec.sandbox_id) {
            Ok(s) if s.state == crate::api::SandboxState::Ready => empty(StatusCode::NO_CONTENT),
            _ => not_running(&rec.sandbox_id),
        },
        (_, "/files") => files::handle(req, face, rec).await,
        ("POST", p) if p.starts_with("/process.Process/") => {
            process::handle(req, face, rec, &p["/process.Process/".len()..]).await
        }
        ("POST", p) if p.starts_with("/filesystem.Filesystem/") => {
            filesystem::handle(req, face, rec, &p["/filesystem.Filesystem/".len()..]).await
        }
        _ => json(
            StatusCode::NOT_FOUND,
            &connect::ConnectError::new(connect::Code::Unimplemented, format!("no route {path}"))
                .json(),
        ),
    }
}

/// The user a request acts as: `Authorization: Basic base64("<user>:")` when the SDK passes
/// one, else [`DEFAULT_USER`].
pub fn request_user(h: &HeaderMap) -> Result<String, connect::ConnectError> {
    use base64::Engine as _;
    let Some(v) = header_str(h, "authorization") else {
        return Ok(DEFAULT_USER.into());
    };
    let bad = || {
        connect::ConnectError::new(
            connect::Code::InvalidArgument,
            "Authorization must be `Basic base64(<user>:)`",
        )
    };
    let b64 = v.strip_prefix("Basic ").ok_or_else(bad)?;
    let raw = base64::engine::general_purpose::STANDARD
        .decode(b64.trim())
        .map_err(|_| bad())?;
    let s = String::from_utf8(raw).map_err(|_| bad())?;
    let user = s.split(':').next().unwrap_or("");
    if user.is_empty() {
        return Ok(DEFAULT_USER.into());
    }
    if user.len() > 32
        || !user
            .bytes()
            .all(|c| c.is_ascii_alphanumeric() || c == b'_' || c == b'-')
    {
        return Err(bad());
    }
    Ok(user.to_owned())
}

/// A guest path as E2B means it: relative paths start in the user's home.
pub fn guest_path(path: &str, home: &str) -> Result<String, connect::ConnectError> {
    if path.len() > proto::MAX_FIELD || path.contains('\0') {
        return Err(connect::ConnectError::new(
            connect::Code::InvalidArgument,
            "path is too long or holds a NUL byte",
        ));
    }
    let joined = if path.starts_with('/') {
        path.to_owned()
    } else if path.is_empty() {
        home.to_owned()
    } else {
        format!("{}/{path}", home.trim_end_matches('/'))
    };
    // Normalise `.` and `..` lexically, as envd does (the guest is the sandbox's own world).
    let mut parts: Vec<&str> = Vec::new();
    for c in joined.split('/') {
        match c {
            "" | "." => {}
            ".." => {
                parts.pop();
            }
            c => parts.push(c),
        }
    }
    Ok(format!("/{}", parts.join("/")))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn relative_paths_start_at_home_and_dots_are_resolved() {
        assert_eq!(guest_path("a/b", "/home/user").unwrap(), "/home/user/a/b");
        assert_eq!(guest_path("", "/home/user").unwrap(), "/home/user");
        assert_eq!(guest_path("/etc/../tmp/./x", "/h").unwrap(), "/tmp/x");
        assert_eq!(guest_path("../../..", "/home/user").unwrap(), "/");
        assert!(guest_path("a\0", "/h").is_err());
    }

    #[test]
    fn the_user_comes_from_basic_auth_or_defaults() {
        let mut h = HeaderMap::new();
        assert_eq!(request_user(&h).unwrap(), "user");
        h.insert("authorization", "Basic cm9vdDo=".parse().unwrap()); // root:
        assert_eq!(request_user(&h).unwrap(), "root");
        h.insert("authorization", "Basic Oi4uLzo=".parse().unwrap()); // :../:
        assert_eq!(request_user(&h).unwrap(), "user");
        h.insert("authorization", "Basic Li4vZXRjOg==".parse().unwrap()); // ../etc:
        assert!(request_user(&h).is_err());
        h.insert("authorization", "Bearer x".parse().unwrap());
        assert!(request_user(&h).is_err());
    }

    #[test]
    fn tokens_compare_whole() {
        assert!(token_eq("abc", "abc"));
        assert!(!token_eq("abc", "abd"));
        assert!(!token_eq("ab", "abc"));
        assert!(!token_eq("", "abc"));
    }
}
