//! Parses an HTTP request (method, path, JSON body) into one [`Action`]. No business logic:
//! everything after parsing happens in `handlers` and the service.

use hyper::Method;

use super::response::ApiError;
use crate::api;
use crate::ids;

/// Everything the API can be asked to do.
#[derive(Debug)]
pub enum Action {
    Health,
    OpenApi,
    CreateSandbox(api::CreateSandboxRequest),
    ListSandboxes,
    GetSandbox(String),
    DeleteSandbox(String),
    Exec(String, api::ExecRequest, StreamFormat),
    CreateSnapshot(String, api::SnapshotRequest),
    ListSnapshots(String),
    /// `DELETE /v1/sandboxes/{id}/snapshots/{snapshot}` (snapshot id or name, percent-decoded).
    DeleteSnapshot(String, String),
    Restore(String, api::RestoreRequest),
    Fork(String, api::ForkRequest),
    Pause(String, api::PauseRequest),
    Resume(String, api::ResumeRequest),
    /// `GET /v1/events`: server-sent events after a cursor, optionally for one sandbox.
    Events {
        /// After this event id; `None` (`?since=now`): only events from now on.
        since: Option<u64>,
        sandbox: Option<String>,
    },
    /// `GET /metrics`: Prometheus text format.
    Metrics,
    /// `GET /v1/traces/{id}`: a sandbox's or an exec's per-phase trace.
    Trace(String),
    /// `GET /v1/execs/{id}/output`: a piece of an exec's output log.
    ExecOutput(String, crate::service::OutputQuery),
    /// `GET /v1/sandboxes/{id}/execs`: the running execs.
    ListExecs(String),
    /// `GET /v1/execs/{id}`.
    GetExec(String),
    /// `POST /v1/execs/{id}/attach`: stream like `Exec`; leaving never kills the command.
    AttachExec(String, api::AttachRequest, StreamFormat),
    /// `POST /v1/execs/{id}/stdin`.
    ExecStdin(String, api::ExecStdinRequest),
    /// `POST /v1/execs/{id}/signal`.
    SignalExec(String, api::ExecSignalRequest),
    /// `POST /v1/execs/{id}/resize`.
    ResizeExec(String, api::PtySize),
    Sync(String, api::SyncRequest),
    Diff {
        id: String,
        stat: bool,
        paths: Vec<String>,
    },
    Apply(String, api::ApplyRequest),
    Pull(String, api::ApplyRequest),
    Undo(String, api::UndoRequest),
    ReadFile {
        id: String,
        path: String,
    },
    WriteFile {
        id: String,
        path: String,
        body: api::FileContent,
    },
    /// `GET /v1/templates`.
    ListTemplates,
    /// `POST /v1/gc`.
    Gc(api::GcRequest),
    GetNetwork(String),
    ChangeNetwork(String, api::NetworkRuleChange),
    NetworkSetup(String, api::NetworkSetupRequest),
    RequestAccess(String, api::AccessRequestCreate),
    ListAccessRequests(String),
    /// `PUT /v1/secrets/{name}`: the only request that carries a value.
    SetSecret(String, api::SetSecretRequest),
    ListSecrets,
    RemoveSecret(String),
    AddSandboxSecret(String, api::AddSandboxSecret),
    /// `GET`, `POST`, `DELETE /v1/sandboxes/{id}/git` (`DELETE` names the repo in `?repo=`).
    ListGit(String),
    AllowGit(String, api::GitAllowRequest),
    DenyGit {
        id: String,
        repo: String,
    },
    /// `GET`, `POST /v1/sandboxes/{id}/ports`, `DELETE /v1/sandboxes/{id}/ports/{port}`.
    ListPorts(String),
    ExposePort(String, api::ExposePortRequest),
    UnexposePort(String, u16),
    /// Approve (`true`) or reject a request; `face` is the caller's `x-tryboxi-face` header.
    DecideAccess {
        id: String,
        request: String,
        approve: bool,
        face: Option<String>,
    },
}

/// How a streamed response is framed: NDJSON by default, server-sent events when the client
/// sends `Accept: text/event-stream`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StreamFormat {
    Ndjson,
    Sse,
}

impl StreamFormat {
    pub fn from_accept(accept: Option<&str>) -> StreamFormat {
        match accept {
            Some(a) if a.contains("text/event-stream") => StreamFormat::Sse,
            _ => StreamFormat::Ndjson,
        }
    }
}

/// Every route the router knows, as `(method, OpenAPI path template)`. Tested against
/// `api/openapi.yaml` in both directions, and by the `http_router` fuzz check.
#[cfg(any(test, fuzzing))]
pub const ROUTES: &[(&str, &str)] = &[
    ("GET", "/v1/health"),
    ("GET", "/v1/openapi.yaml"),
    ("POST", "/v1/sandboxes"),
    ("GET", "/v1/sandboxes"),
    ("GET", "/v1/sandboxes/{id}"),
    ("DELETE", "/v1/sandboxes/{id}"),
    ("POST", "/v1/sandboxes/{id}/exec"),
    ("POST", "/v1/sandboxes/{id}/snapshots"),
    ("GET", "/v1/sandboxes/{id}/snapshots"),
    ("POST", "/v1/sandboxes/{id}/restore"),
    ("POST", "/v1/sandboxes/{id}/fork"),
    ("POST", "/v1/sandboxes/{id}/pause"),
    ("POST", "/v1/sandboxes/{id}/resume"),
    ("GET", "/v1/events"),
    ("GET", "/metrics"),
    ("GET", "/v1/traces/{id}"),
    ("GET", "/v1/execs/{id}/output"),
    ("GET", "/v1/sandboxes/{id}/execs"),
    ("GET", "/v1/execs/{id}"),
    ("POST", "/v1/execs/{id}/attach"),
    ("POST", "/v1/execs/{id}/stdin"),
    ("POST", "/v1/execs/{id}/signal"),
    ("POST", "/v1/execs/{id}/resize"),
    ("POST", "/v1/sandboxes/{id}/sync"),
    ("GET", "/v1/sandboxes/{id}/diff"),
    ("POST", "/v1/sandboxes/{id}/apply"),
    ("POST", "/v1/sandboxes/{id}/pull"),
    ("POST", "/v1/artifacts/{art_id}/undo"),
    ("GET", "/v1/sandboxes/{id}/files"),
    ("PUT", "/v1/sandboxes/{id}/files"),
    ("GET", "/v1/templates"),
    ("POST", "/v1/gc"),
    ("GET", "/v1/sandboxes/{id}/network"),
    ("PUT", "/v1/secrets/{name}"),
    ("GET", "/v1/secrets"),
    ("DELETE", "/v1/secrets/{name}"),
    ("POST", "/v1/sandboxes/{id}/secrets"),
    ("GET", "/v1/sandboxes/{id}/git"),
    ("POST", "/v1/sandboxes/{id}/git"),
    ("DELETE", "/v1/sandboxes/{id}/git"),
    ("GET", "/v1/sandboxes/{id}/ports"),
    ("POST", "/v1/sandboxes/{id}/ports"),
    ("DELETE", "/v1/sandboxes/{id}/ports/{port}"),
    ("POST", "/v1/sandboxes/{id}/network/rules"),
    ("POST", "/v1/sandboxes/{id}/network/setup"),
    ("GET", "/v1/sandboxes/{id}/network/requests"),
    ("POST", "/v1/sandboxes/{id}/network/requests"),
    (
        "POST",
        "/v1/sandboxes/{id}/network/requests/{req_id}/approve",
    ),
    (
        "POST",
        "/v1/sandboxes/{id}/network/requests/{req_id}/reject",
    ),
    ("DELETE", "/v1/sandboxes/{id}/snapshots/{snapshot}"),
];

/// Turn a full request (path with query, headers, body) into an action.
pub fn parse_request(
    method: &Method,
    uri: &hyper::Uri,
    headers: &hyper::HeaderMap,
    body: &[u8],
) -> Result<Action, ApiError> {
    let accept = headers
        .get(hyper::header::ACCEPT)
        .and_then(|v| v.to_str().ok());
    let format = StreamFormat::from_accept(accept);
    let query = uri.query().unwrap_or("");
    let segs: Vec<&str> = uri
        .path()
        .trim_end_matches('/')
        .split('/')
        .skip(1)
        .collect();
    match (method, segs.as_slice()) {
        (&Method::GET, ["v1", "events"]) => {
            let last_event_id = headers
                .get("last-event-id")
                .and_then(|v| v.to_str().ok())
                .map(|v| {
                    v.trim().parse::<u64>().map_err(|_| {
                        ApiError::bad_request(format!(
                            "Last-Event-ID must be an event id, got `{v}`"
                        ))
                    })
                })
                .transpose()?;
            let mut since = Some(last_event_id.unwrap_or(0));
            let mut sandbox = None;
            for (k, v) in query_pairs(query) {
                match k.as_str() {
                    // A reconnect's Last-Event-ID wins over the URL's starting point.
                    "since" if last_event_id.is_some() => {}
                    "since" if v == "now" => since = None,
                    "since" => since = Some(number(&k, &v)?),
                    "sandbox" => sandbox = Some(sandbox_id(&v)?),
                    _ => return Err(unknown_param(&k)),
                }
            }
            Ok(Action::Events { since, sandbox })
        }
        (&Method::GET, ["metrics"]) => Ok(Action::Metrics),
        (&Method::GET, ["v1", "traces", id]) => {
            if ids::is_valid(ids::SANDBOX, id) || ids::is_valid(ids::EXEC, id) {
                Ok(Action::Trace((*id).to_owned()))
            } else {
                Err(ApiError::not_found(format!("no sandbox or exec `{id}`")))
            }
        }
        (&Method::GET, ["v1", "execs", id, "output"]) => {
            if !ids::is_valid(ids::EXEC, id) {
                return Err(ApiError::not_found(format!("no exec `{id}`")));
            }
            let mut q = crate::service::OutputQuery::default();
            for (k, v) in query_pairs(query) {
                match k.as_str() {
                    "offset" => q.offset = number(&k, &v)?,
                    "stream" => {
                        q.stream = crate::telemetry::logs::Stream::parse(&v).ok_or_else(|| {
                            ApiError::bad_request(format!(
                                "stream must be stdout, stderr or output, got `{v}`"
                            ))
                        })?
                    }
                    "strip_ansi" => q.strip_ansi = boolean(&k, &v)?,
                    "wait_ms" => q.wait = std::time::Duration::from_millis(number(&k, &v)?),
                    "max_bytes" => q.max_bytes = number::<usize>(&k, &v)?,
                    _ => return Err(unknown_param(&k)),
                }
            }
            Ok(Action::ExecOutput((*id).to_owned(), q))
        }
        (
            &Method::POST,
            [
                "v1",
                "sandboxes",
                id,
                "network",
                "requests",
                req,
                verb @ ("approve" | "reject"),
            ],
        ) => {
            if !ids::is_valid(ids::REQUEST, req) {
                return Err(ApiError::not_found(format!("no request `{req}`")));
            }
            Ok(Action::DecideAccess {
                id: sandbox_id(id)?,
                request: (*req).to_owned(),
                approve: *verb == "approve",
                face: headers
                    .get(api::CLIENT_FACE_HEADER)
                    .and_then(|v| v.to_str().ok())
                    .map(str::to_owned),
            })
        }
        (
            _,
            [
                "v1",
                "sandboxes",
                _,
                "network",
                "requests",
                _,
                "approve" | "reject",
            ],
        ) => Err(ApiError::method_not_allowed(method)),
        (_, ["v1", "events" | "traces"])
        | (_, ["metrics"])
        | (_, ["v1", "traces", _])
        | (_, ["v1", "execs", _, "output"]) => Err(ApiError::method_not_allowed(method)),
        _ => parse(
            method,
            uri.path_and_query().map_or(uri.path(), |pq| pq.as_str()),
            format,
            body,
        ),
    }
}

/// `a=1&b=x%20y` -> pairs, percent-decoded (`+` is a space).
fn query_pairs(q: &str) -> Vec<(String, String)> {
    form_urlencoded::parse(q.as_bytes()).into_owned().collect()
}

fn number<T: std::str::FromStr>(k: &str, v: &str) -> Result<T, ApiError> {
    v.parse().map_err(|_| {
        ApiError::bad_request(format!("`{k}` must be a non-negative integer, got `{v}`"))
    })
}

fn boolean(k: &str, v: &str) -> Result<bool, ApiError> {
    match v {
        "" | "true" | "1" | "yes" => Ok(true),
        "false" | "0" | "no" => Ok(false),
        _ => Err(ApiError::bad_request(format!(
            "`{k}` must be true or false, got `{v}`"
        ))),
    }
}

fn unknown_param(k: &str) -> ApiError {
    ApiError::bad_request(format!("unknown query parameter `{k}`"))
}

/// Turn method + path (with an optional `?query`) + body into an action, or a 400/404/405 error.
pub fn parse(
    method: &Method,
    target: &str,
    format: StreamFormat,
    body: &[u8],
) -> Result<Action, ApiError> {
    let (path, query) = target.split_once('?').unwrap_or((target, ""));
    let q: Vec<(String, String)> = form_urlencoded::parse(query.as_bytes())
        .into_owned()
        .collect();
    let segs: Vec<&str> = path.trim_end_matches('/').split('/').skip(1).collect();
    match (method, segs.as_slice()) {
        (&Method::GET, ["v1", "health"]) => Ok(Action::Health),
        (&Method::GET, ["v1", "openapi.yaml"]) => Ok(Action::OpenApi),
        (&Method::POST, ["v1", "sandboxes"]) => Ok(Action::CreateSandbox(json(body)?)),
        (&Method::GET, ["v1", "sandboxes"]) => Ok(Action::ListSandboxes),
        (&Method::GET, ["v1", "sandboxes", id]) => Ok(Action::GetSandbox(sandbox_id(id)?)),
        (&Method::DELETE, ["v1", "sandboxes", id]) => Ok(Action::DeleteSandbox(sandbox_id(id)?)),
        (&Method::POST, ["v1", "sandboxes", id, "exec"]) => {
            Ok(Action::Exec(sandbox_id(id)?, json(body)?, format))
        }
        (&Method::GET, ["v1", "sandboxes", id, "execs"]) => Ok(Action::ListExecs(sandbox_id(id)?)),
        (&Method::GET, ["v1", "execs", id]) => Ok(Action::GetExec(exec_id(id)?)),
        (&Method::POST, ["v1", "execs", id, "attach"]) => Ok(Action::AttachExec(
            exec_id(id)?,
            json_or_default(body)?,
            format,
        )),
        (&Method::POST, ["v1", "execs", id, "stdin"]) => {
            Ok(Action::ExecStdin(exec_id(id)?, json(body)?))
        }
        (&Method::POST, ["v1", "execs", id, "signal"]) => {
            Ok(Action::SignalExec(exec_id(id)?, json(body)?))
        }
        (&Method::POST, ["v1", "execs", id, "resize"]) => {
            Ok(Action::ResizeExec(exec_id(id)?, json(body)?))
        }
        (_, ["v1", "execs", _])
        | (_, ["v1", "execs", _, "attach" | "stdin" | "signal" | "resize"]) => {
            Err(ApiError::method_not_allowed(method))
        }
        (&Method::POST, ["v1", "sandboxes", id, "snapshots"]) => {
            let req = if body.iter().all(u8::is_ascii_whitespace) {
                api::SnapshotRequest::default()
            } else {
                json(body)?
            };
            Ok(Action::CreateSnapshot(sandbox_id(id)?, req))
        }
        (&Method::GET, ["v1", "sandboxes", id, "snapshots"]) => {
            Ok(Action::ListSnapshots(sandbox_id(id)?))
        }
        (&Method::DELETE, ["v1", "sandboxes", id, "snapshots", snap]) => {
            Ok(Action::DeleteSnapshot(sandbox_id(id)?, snapshot_ref(snap)?))
        }
        (_, ["v1", "sandboxes", _, "snapshots", _]) => Err(ApiError::method_not_allowed(method)),
        (&Method::POST, ["v1", "sandboxes", id, "restore"]) => {
            Ok(Action::Restore(sandbox_id(id)?, json(body)?))
        }
        (&Method::POST, ["v1", "sandboxes", id, "fork"]) => {
            Ok(Action::Fork(sandbox_id(id)?, json_or_default(body)?))
        }
        (&Method::POST, ["v1", "sandboxes", id, "pause"]) => {
            Ok(Action::Pause(sandbox_id(id)?, json_or_default(body)?))
        }
        (&Method::POST, ["v1", "sandboxes", id, "resume"]) => {
            Ok(Action::Resume(sandbox_id(id)?, json_or_default(body)?))
        }
        (&Method::POST, ["v1", "sandboxes", id, "sync"]) => {
            Ok(Action::Sync(sandbox_id(id)?, json_or_default(body)?))
        }
        (&Method::GET, ["v1", "sandboxes", id, "diff"]) => Ok(Action::Diff {
            id: sandbox_id(id)?,
            stat: flag(&q, "stat")?,
            paths: all(&q, "path"),
        }),
        (&Method::POST, ["v1", "sandboxes", id, "apply"]) => {
            Ok(Action::Apply(sandbox_id(id)?, json_or_default(body)?))
        }
        (&Method::POST, ["v1", "sandboxes", id, "pull"]) => {
            Ok(Action::Pull(sandbox_id(id)?, json(body)?))
        }
        (&Method::POST, ["v1", "artifacts", art, "undo"]) => {
            if ids::is_valid(ids::ARTIFACT, art) {
                Ok(Action::Undo((*art).to_owned(), json_or_default(body)?))
            } else {
                Err(ApiError::not_found(format!("no artifact `{art}`")))
            }
        }
        (&Method::GET, ["v1", "sandboxes", id, "files"]) => Ok(Action::ReadFile {
            id: sandbox_id(id)?,
            path: one(&q, "path")?,
        }),
        (&Method::PUT, ["v1", "sandboxes", id, "files"]) => Ok(Action::WriteFile {
            id: sandbox_id(id)?,
            path: one(&q, "path")?,
            body: json(body)?,
        }),
        (&Method::PUT, ["v1", "secrets", name]) => {
            Ok(Action::SetSecret(secret_name(name)?, secret_json(body)?))
        }
        (&Method::GET, ["v1", "secrets"]) => Ok(Action::ListSecrets),
        (&Method::DELETE, ["v1", "secrets", name]) => Ok(Action::RemoveSecret(secret_name(name)?)),
        (&Method::POST, ["v1", "sandboxes", id, "secrets"]) => {
            Ok(Action::AddSandboxSecret(sandbox_id(id)?, json(body)?))
        }
        (&Method::GET, ["v1", "sandboxes", id, "git"]) => Ok(Action::ListGit(sandbox_id(id)?)),
        (&Method::POST, ["v1", "sandboxes", id, "git"]) => {
            Ok(Action::AllowGit(sandbox_id(id)?, json(body)?))
        }
        (&Method::DELETE, ["v1", "sandboxes", id, "git"]) => Ok(Action::DenyGit {
            id: sandbox_id(id)?,
            repo: one(&q, "repo")?,
        }),
        (&Method::GET, ["v1", "sandboxes", id, "ports"]) => Ok(Action::ListPorts(sandbox_id(id)?)),
        (&Method::POST, ["v1", "sandboxes", id, "ports"]) => {
            Ok(Action::ExposePort(sandbox_id(id)?, json(body)?))
        }
        (&Method::DELETE, ["v1", "sandboxes", id, "ports", port]) => Ok(Action::UnexposePort(
            sandbox_id(id)?,
            port.parse()
                .map_err(|_| ApiError::bad_request(format!("`{port}` is not a port number")))?,
        )),
        (_, ["v1", "sandboxes", _, "ports", _]) => Err(ApiError::method_not_allowed(method)),
        (_, ["v1", "secrets"]) | (_, ["v1", "secrets", _]) => {
            Err(ApiError::method_not_allowed(method))
        }
        (&Method::GET, ["v1", "templates"]) => Ok(Action::ListTemplates),
        (&Method::POST, ["v1", "gc"]) => Ok(Action::Gc(json_or_default(body)?)),
        (&Method::GET, ["v1", "sandboxes", id, "network"]) => {
            Ok(Action::GetNetwork(sandbox_id(id)?))
        }
        (&Method::POST, ["v1", "sandboxes", id, "network", "rules"]) => {
            Ok(Action::ChangeNetwork(sandbox_id(id)?, json(body)?))
        }
        (&Method::POST, ["v1", "sandboxes", id, "network", "setup"]) => {
            Ok(Action::NetworkSetup(sandbox_id(id)?, json(body)?))
        }
        (&Method::GET, ["v1", "sandboxes", id, "network", "requests"]) => {
            Ok(Action::ListAccessRequests(sandbox_id(id)?))
        }
        (&Method::POST, ["v1", "sandboxes", id, "network", "requests"]) => {
            Ok(Action::RequestAccess(sandbox_id(id)?, json(body)?))
        }
        (_, ["v1", "sandboxes", _, "network"])
        | (
            _,
            [
                "v1",
                "sandboxes",
                _,
                "network",
                "rules" | "setup" | "requests",
            ],
        ) => Err(ApiError::method_not_allowed(method)),
        (_, ["v1", "health" | "openapi.yaml" | "templates" | "gc"])
        | (_, ["v1", "sandboxes"])
        | (_, ["v1", "sandboxes", _])
        | (_, ["v1", "artifacts", _, "undo"])
        | (
            _,
            [
                "v1",
                "sandboxes",
                _,
                "exec" | "execs" | "sync" | "diff" | "apply" | "pull" | "files" | "snapshots"
                | "restore" | "fork" | "pause" | "resume" | "secrets" | "git" | "ports",
            ],
        ) => Err(ApiError::method_not_allowed(method)),
        _ => Err(ApiError::not_found(format!("no such API route: {path}"))),
    }
}

fn json<T: serde::de::DeserializeOwned>(body: &[u8]) -> Result<T, ApiError> {
    if body.iter().all(u8::is_ascii_whitespace) {
        return Err(ApiError::bad_request("the request needs a JSON body"));
    }
    serde_json::from_slice(body)
        .map_err(|e| ApiError::bad_request(format!("malformed JSON body: {e}")))
}

/// The body of a secret's set: serde's own error text is not used, as it may quote a piece
/// of the body (a value sent as a number, say); only where the body is wrong.
fn secret_json(body: &[u8]) -> Result<api::SetSecretRequest, ApiError> {
    if body.iter().all(u8::is_ascii_whitespace) {
        return Err(ApiError::bad_request("the request needs a JSON body"));
    }
    serde_json::from_slice(body).map_err(|e| {
        ApiError::bad_request(format!(
            "malformed secret body at line {} column {}: give {{\"value\": string, \"hosts\":              [string], \"headers\": [string], \"in_body\": bool}}",
            e.line(),
            e.column()
        ))
    })
}

/// A snapshot's id or name in a path, percent-decoded: 1-64 bytes of UTF-8 (400 otherwise).
fn snapshot_ref(seg: &str) -> Result<String, ApiError> {
    let s = percent_encoding::percent_decode_str(seg)
        .decode_utf8()
        .map_err(|_| ApiError::bad_request("the snapshot in the path is not UTF-8"))?;
    if s.is_empty() || s.len() > 64 || s.contains(['/', '\0']) {
        return Err(ApiError::bad_request(
            "a snapshot id or name is 1-64 bytes, without `/` or NUL",
        ));
    }
    Ok(s.into_owned())
}

/// A secret's name in a path: `[A-Z_][A-Z0-9_]{0,63}` (400 otherwise).
fn secret_name(name: &str) -> Result<String, ApiError> {
    crate::secrets::store::check_name(name).map_err(|e| ApiError::bad_request(e.to_string()))?;
    Ok(name.to_owned())
}

/// An optional JSON body (empty = the type's default).
fn json_or_default<T: serde::de::DeserializeOwned + Default>(body: &[u8]) -> Result<T, ApiError> {
    if body.iter().all(u8::is_ascii_whitespace) {
        return Ok(T::default());
    }
    json(body)
}

/// `?name=true|false|1|0` (absent = false).
fn flag(q: &[(String, String)], name: &str) -> Result<bool, ApiError> {
    match q
        .iter()
        .rev()
        .find(|(k, _)| k == name)
        .map(|(_, v)| v.as_str())
    {
        None | Some("false" | "0") => Ok(false),
        Some("true" | "1" | "") => Ok(true),
        Some(v) => Err(ApiError::bad_request(format!(
            "query parameter `{name}` must be true or false, got `{v}`"
        ))),
    }
}

/// Every value of a repeated query parameter.
fn all(q: &[(String, String)], name: &str) -> Vec<String> {
    q.iter()
        .filter(|(k, _)| k == name)
        .map(|(_, v)| v.clone())
        .collect()
}

/// A required, single query parameter.
fn one(q: &[(String, String)], name: &str) -> Result<String, ApiError> {
    match all(q, name).as_slice() {
        [v] => Ok(v.clone()),
        [] => Err(ApiError::bad_request(format!(
            "the query parameter `{name}` is required"
        ))),
        _ => Err(ApiError::bad_request(format!(
            "give the query parameter `{name}` once"
        ))),
    }
}

/// An exec id in a path (404 when it cannot be one).
fn exec_id(id: &str) -> Result<String, ApiError> {
    if ids::is_valid(ids::EXEC, id) {
        Ok(id.to_owned())
    } else {
        Err(ApiError::not_found(format!("no exec `{id}`")))
    }
}

/// A syntactically invalid id can never exist: answer 404 like any unknown sandbox.
fn sandbox_id(id: &str) -> Result<String, ApiError> {
    if ids::is_valid(ids::SANDBOX, id) {
        Ok(id.to_owned())
    } else {
        Err(ApiError::not_found(format!("no sandbox `{id}`")))
    }
}

#[cfg(test)]
#[path = "router_tests.rs"]
mod tests;
