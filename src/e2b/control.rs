//! E2B's control plane (REST/JSON, `X-API-KEY`): create, connect/resume, list, get, kill,
//! timeout, pause, snapshots, fork, metrics, mapped onto the service.
//!
//! Owns: the request/response shapes of these calls, their bounds, the mapping of `templateID`
//! onto our templates and of E2B's network options onto our egress policy (default: the
//! daemon's default allowlist, never the open internet; `network.allowOut` alone: those names
//! added; deny-all (`allow_internet_access: false` or `denyOut: ["0.0.0.0/0"]`): exactly
//! `allowOut`; what we cannot honour refused), list filters and paging. Errors in E2B's shape.

use std::collections::BTreeMap;

use hyper::body::Incoming;
use hyper::{Method, Request, Response, StatusCode};
use serde::Deserialize;
use serde_json::{Value, json};

use super::{E2bError, Face, read_body};
use crate::api;
use crate::daemon::response::Body;
use crate::service::e2b::{E2bSandbox, new_token, unix_now};

/// E2B's default sandbox timeout.
const DEFAULT_TIMEOUT_S: u64 = 300;
/// The longest timeout (E2B's own cap is 24 h).
const MAX_TIMEOUT_S: u64 = 24 * 3600;
const MAX_METADATA: usize = 64;
const MAX_ENV_VARS: usize = 256;
const MAX_KEY: usize = 256;
const MAX_META_VALUE: usize = 1024;
const MAX_ENV_VALUE: usize = 64 * 1024;
/// Most sandboxes one list page returns.
const MAX_PAGE: usize = 1000;
/// `clientID` of every sandbox (E2B names the cluster node; we have one).
const CLIENT_ID: &str = "local";

#[derive(Debug, Default, Deserialize)]
#[serde(default, rename_all = "camelCase")]
struct NetworkOpts {
    allow_out: Option<Vec<String>>,
    deny_out: Option<Vec<String>>,
    // `allowPublicTraffic`, `maskRequestHost` (ingress) and `dnsServers` are accepted and
    // need nothing here: ingress is loopback-only (`tryboxi port`), DNS is the daemon's.
    rules: Option<Value>,
    egress_proxy: Option<Value>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(default, rename_all = "camelCase")]
struct NewSandbox {
    #[serde(rename = "templateID")]
    template_id: Option<String>,
    timeout: Option<u64>,
    metadata: Option<BTreeMap<String, String>>,
    env_vars: Option<BTreeMap<String, String>>,
    auto_pause: Option<bool>,
    /// `false`: the timeout's pause keeps the disk alone (E2B's lifecycle `mode: filesystem`).
    auto_pause_memory: Option<bool>,
    #[serde(alias = "allow_internet_access")]
    allow_internet_access: Option<bool>,
    network: Option<NetworkOpts>,
    mcp: Option<Value>,
    volume_mounts: Option<Value>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(default)]
struct TimeoutBody {
    timeout: Option<u64>,
}

/// `POST /sandboxes/{id}/connect` (and `resume`): `memory: false` reboots a paused sandbox
/// on its disk (the SDK's `on_resume="reboot"`).
#[derive(Debug, Default, Deserialize)]
#[serde(default)]
struct ConnectBody {
    timeout: Option<u64>,
    memory: Option<bool>,
}

/// `POST /sandboxes/{id}/pause`: `memory: false` keeps the disk alone (`mode="filesystem"`);
/// `requireHealthyGuest` (`strict=True`) refuses the pause when the agent does not answer.
#[derive(Debug, Default, Deserialize)]
#[serde(default, rename_all = "camelCase")]
struct PauseBody {
    memory: Option<bool>,
    require_healthy_guest: Option<bool>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(default)]
struct ForkBody {
    timeout: Option<u64>,
    count: Option<u32>,
}

fn bad(msg: impl Into<String>) -> E2bError {
    E2bError::new(StatusCode::BAD_REQUEST, msg)
}

fn parse<T: serde::de::DeserializeOwned + Default>(body: &[u8]) -> Result<T, E2bError> {
    if body.iter().all(u8::is_ascii_whitespace) {
        return Ok(T::default());
    }
    serde_json::from_slice(body).map_err(|e| bad(format!("bad request body: {e}")))
}

pub async fn handle(req: Request<Incoming>, face: &Face) -> Result<Response<Body>, E2bError> {
    let key = req
        .headers()
        .get("x-api-key")
        .and_then(|v| v.to_str().ok())
        .unwrap_or("");
    if !super::token_eq(key.trim(), &face.token) {
        return Err(E2bError::new(
            StatusCode::UNAUTHORIZED,
            "Invalid API key: set E2B_API_KEY to the output of `tryboxi token`",
        ));
    }
    let idempotency_key = req
        .headers()
        .get("idempotency-key")
        .map(|v| v.to_str().map(str::to_owned))
        .transpose()
        .map_err(|_| bad("Idempotency-Key must be printable ASCII"))?;
    let method = req.method().clone();
    let path = req.uri().path().to_owned();
    let query = req.uri().query().unwrap_or("").to_owned();
    let path = path
        .strip_prefix("/v2")
        .or_else(|| path.strip_prefix("/v1"))
        .unwrap_or(&path)
        .to_owned();
    let parts: Vec<&str> = path.trim_matches('/').split('/').collect();
    let body = read_body(req.into_body(), super::MAX_JSON_BODY).await?;
    match (&method, parts.as_slice()) {
        (&Method::POST, ["sandboxes"]) => match idempotency_key {
            Some(k) => create_once(face, &k, parse(&body)?).await,
            None => create(face, parse(&body)?).await.map(|rec| created(&rec)),
        },
        (&Method::GET, ["sandboxes"]) => list(face, &query),
        (&Method::GET, ["sandboxes", id]) => {
            let (rec, sbx) = own(face, id)?;
            Ok(super::json(
                StatusCode::OK,
                &listed(&disk_sizes(face), &rec, &sbx),
            ))
        }
        (&Method::DELETE, ["sandboxes", id]) => {
            own(face, id)?;
            // Retired rather than removed while its snapshots or forks need its files.
            face.svc.retire_sandbox(id).await?;
            face.svc.e2b_forget(id)?;
            Ok(super::empty(StatusCode::NO_CONTENT))
        }
        (&Method::POST, ["sandboxes", id, "timeout"]) => {
            let (mut rec, _) = own(face, id)?;
            let t: TimeoutBody = parse(&body)?;
            let t = t.timeout.ok_or_else(|| bad("`timeout` is required"))?;
            rec.end_at = unix_now() + check_timeout(t)?;
            face.svc.e2b_put(&rec)?;
            Ok(super::empty(StatusCode::NO_CONTENT))
        }
        (&Method::POST, ["sandboxes", id, "pause"]) => {
            let (_, sbx) = own(face, id)?;
            if sbx.state == api::SandboxState::Paused {
                return Err(E2bError::new(
                    StatusCode::CONFLICT,
                    format!("sandbox {id} is already paused"),
                ));
            }
            let b: PauseBody = parse(&body)?;
            let keep_memory = b.memory.unwrap_or(true);
            if keep_memory
                && b.require_healthy_guest == Some(true)
                && !face.svc.guest_answers(id).await
            {
                return Err(E2bError::new(
                    StatusCode::SERVICE_UNAVAILABLE,
                    format!("the guest agent of sandbox {id} does not answer: not paused"),
                ));
            }
            face.svc.pause_sandbox_keeping(id, keep_memory).await?;
            Ok(super::empty(StatusCode::NO_CONTENT))
        }
        (&Method::POST, ["sandboxes", id, "connect" | "resume"]) => {
            let (mut rec, sbx) = own(face, id)?;
            let t: ConnectBody = parse(&body)?;
            let status = if sbx.state == api::SandboxState::Paused {
                let how = if t.memory == Some(false) {
                    crate::service::ResumeHow::Reboot
                } else {
                    crate::service::ResumeHow::Memory
                };
                face.svc.resume_sandbox_how(id, how).await?;
                StatusCode::CREATED
            } else {
                StatusCode::OK
            };
            let t = t.timeout.map(check_timeout).transpose()?;
            let end_at =
                end_after_connect(rec.end_at, unix_now(), status == StatusCode::CREATED, t);
            if end_at != rec.end_at {
                rec.end_at = end_at;
                face.svc.e2b_put(&rec)?;
            }
            Ok(super::json(status, &sandbox_json(&rec)))
        }
        (&Method::POST, ["sandboxes", id, "snapshots"]) => {
            own(face, id)?;
            super::snapshots::create(face, id, parse(&body)?).await
        }
        (&Method::GET, ["snapshots"]) => super::snapshots::list(face, &query),
        (&Method::DELETE, ["templates", id]) => super::snapshots::delete(face, id).await,
        (&Method::POST, ["sandboxes", id, "fork"]) => {
            let (rec, _) = own(face, id)?;
            let b: ForkBody = parse(&body)?;
            fork(face, &rec, b).await
        }
        (&Method::GET, ["sandboxes", id, "metrics"]) => {
            let (rec, sbx) = own(face, id)?;
            let list = super::metrics::list(face, &rec, &sbx, &query).await?;
            Ok(super::json(StatusCode::OK, &list))
        }
        _ => Err(E2bError::new(
            StatusCode::NOT_FOUND,
            format!("no E2B route {method} {path}"),
        )),
    }
}

/// The E2B record and sandbox of `id`, 404 when the face did not create it.
fn own(face: &Face, id: &str) -> Result<(E2bSandbox, api::Sandbox), E2bError> {
    let rec = face
        .svc
        .e2b_get(id)?
        .ok_or_else(|| E2bError::new(StatusCode::NOT_FOUND, format!("sandbox {id} not found")))?;
    let sbx = face.svc.get_sandbox(id)?;
    Ok((rec, sbx))
}

/// A sandbox's deadline after `connect` (E2B's rules): never earlier than it was; a resumed
/// sandbox gets at least `timeout` from now (E2B's default when none is given: else one
/// auto-paused at its deadline would be paused again by the next deadline tick).
fn end_after_connect(end_at: u64, now: u64, resumed: bool, timeout: Option<u64>) -> u64 {
    match (resumed, timeout) {
        (true, t) => end_at.max(now + t.unwrap_or(DEFAULT_TIMEOUT_S)),
        (false, Some(t)) => end_at.max(now + t),
        (false, None) => end_at,
    }
}

fn check_timeout(t: u64) -> Result<u64, E2bError> {
    if t == 0 || t > MAX_TIMEOUT_S {
        return Err(bad(format!(
            "`timeout` must be 1..={MAX_TIMEOUT_S} seconds, got {t}"
        )));
    }
    Ok(t)
}

fn check_map(
    what: &str,
    m: &BTreeMap<String, String>,
    max: usize,
    max_value: usize,
) -> Result<(), E2bError> {
    if m.len() > max {
        return Err(bad(format!(
            "at most {max} {what} entries, got {}",
            m.len()
        )));
    }
    for (k, v) in m {
        if k.is_empty()
            || k.len() > MAX_KEY
            || v.len() > max_value
            || k.contains('\0')
            || v.contains('\0')
        {
            return Err(bad(format!(
                "{what} key `{}` or its value is empty, too long (keys {MAX_KEY}, values \
                 {max_value} bytes) or holds a NUL byte",
                k.chars().take(64).collect::<String>()
            )));
        }
    }
    Ok(())
}

/// The name in an E2B template or snapshot reference `[namespace/]name[:tag]`: E2B
/// namespaces names by team and versions them by tag; this machine has one namespace and
/// no tags, so both are accepted and ignored (`e2b/base:latest` is `base`).
pub(super) fn bare_name(reference: &str) -> &str {
    let untagged = reference.split(':').next().unwrap_or(reference);
    untagged.rsplit('/').next().unwrap_or(untagged)
}

/// Our template for an E2B `templateID` (see [`bare_name`]): `base` is ours;
/// `code-interpreter-v1` is our `code-interpreter`; any of our template names works as is.
fn template_for(face: &Face, id: &str) -> Result<String, E2bError> {
    let want = bare_name(id);
    let ours: Vec<String> = face
        .svc
        .list_templates()?
        .templates
        .into_iter()
        .map(|t| t.name)
        .collect();
    let want = match want {
        "code-interpreter-v1" | "code-interpreter" => "code-interpreter",
        other => other,
    };
    if ours.iter().any(|t| t == want) {
        return Ok(want.to_owned());
    }
    Err(bad(format!(
        "template `{id}` is not available here (nor a snapshot); this machine has: {}",
        ours.join(", ")
    )))
}

/// An E2B template id that means our `code-interpreter` template (its sandboxes run the
/// interpreter server on [`super::ports::INTERPRETER_PORT`]).
pub fn is_interpreter(template_id: &str) -> bool {
    matches!(
        bare_name(template_id),
        "code-interpreter-v1" | "code-interpreter"
    )
}

/// Starts the code interpreter server (`/opt/tryboxi/interpreter/server.py`, installed by the
/// template) as a detached exec of `user` in its home; it opens its port once its default
/// kernel is ready, and the first request to the port waits for that
/// ([`super::ports::proxy`]). The exec runs until the sandbox goes (a fork or a snapshot
/// restore keeps it: it is in the VM's memory).
async fn start_interpreter(face: &Face, rec: &E2bSandbox) -> Result<(), E2bError> {
    let port = super::ports::INTERPRETER_PORT;
    if face
        .svc
        .connect_guest_port(&rec.sandbox_id, port)
        .await
        .is_ok()
    {
        // Cloned from the golden snapshot (`service/golden.rs`): the server and its kernel
        // run already, started before this sandbox had env vars; it reads them from a file.
        if !rec.env_vars.is_empty() {
            let env = serde_json::to_string(&rec.env_vars)
                .map_err(|e| crate::service::ServiceError::Internal(e.to_string()))?;
            let write = api::ExecRequest {
                argv: Some(vec![
                    "/bin/sh".into(),
                    "-c".into(),
                    "umask 077 && cat > /tmp/tryboxi-interpreter-env.json.new && \
                     mv /tmp/tryboxi-interpreter-env.json.new /tmp/tryboxi-interpreter-env.json"
                        .into(),
                ]),
                stdin: Some(env),
                user: Some("user".into()),
                timeout_s: Some(30.0),
                ..Default::default()
            };
            let mut events = face.svc.start_exec(&rec.sandbox_id, write).await?;
            let mut ok = false;
            while let Some(ev) = events.recv().await {
                ok = matches!(
                    ev,
                    api::ExecEvent::Exit {
                        exit_code: Some(0),
                        ..
                    }
                );
            }
            if !ok {
                return Err(crate::service::ServiceError::Internal(
                    "cannot hand the env vars to the code interpreter".into(),
                )
                .into());
            }
        }
        return Ok(());
    }
    let exec = api::ExecRequest {
        argv: Some(vec![
            "/usr/bin/python3".into(),
            "/opt/tryboxi/interpreter/server.py".into(),
        ]),
        env: rec.env_vars.clone(),
        cwd: Some("/home/user".into()),
        user: Some("user".into()),
        detach: true,
        // As long as the sandbox lives (the exec timeout must be finite: ~3 years).
        timeout_s: Some(1e8),
        tag: Some("e2b-code-interpreter".into()),
        ..Default::default()
    };
    // The receiver goes at once: a detached exec runs on without a follower.
    drop(face.svc.start_exec(&rec.sandbox_id, exec).await?);
    Ok(())
}

/// What E2B's "all traffic" selector (`ALL_TRAFFIC` in the SDKs) is.
const ALL_TRAFFIC: &str = "0.0.0.0/0";

/// E2B's network options as our policy (`None`: the daemon's default allowlist, `default`).
///
/// E2B allows everything unless told otherwise; our egress is an allowlist. So: no options
/// -> our default allowlist (never the open internet); `allowOut` alone -> those names added
/// to it; "deny all" (`allow_internet_access: false`, or `denyOut: ["0.0.0.0/0"]`, the SDKs'
/// `ALL_TRAFFIC`) -> exactly `allowOut`, or no egress at all. Anything we would have to ignore
/// and that changes where traffic may go (other `denyOut` entries, per-host `rules`, an
/// `egressProxy`) is refused rather than dropped.
fn policy_for(default: &[String], n: &NewSandbox) -> Result<Option<api::NetworkSpec>, E2bError> {
    let opts = n.network.as_ref();
    let present = |v: Option<&Value>| v.is_some_and(|v| !v.is_null() && v != &json!({}));
    if present(opts.and_then(|o| o.rules.as_ref())) {
        return Err(bad(
            "network.rules (per-host transforms) are not supported by tryboxi's E2B face; \
             store credentials with `tryboxi secret` instead",
        ));
    }
    if present(opts.and_then(|o| o.egress_proxy.as_ref())) {
        return Err(bad(
            "network.egressProxy is not supported; set the daemon's `[network] upstream_proxy`",
        ));
    }
    let deny = opts.and_then(|o| o.deny_out.as_ref());
    if let Some(deny) = deny
        && deny.iter().any(|d| d != ALL_TRAFFIC)
    {
        return Err(bad(
            "network.denyOut: only `0.0.0.0/0` (deny everything not allowed) is supported; \
             egress here is an allowlist, so list what to allow in allowOut",
        ));
    }
    let allow = opts.and_then(|o| o.allow_out.clone()).unwrap_or_default();
    if allow.len() > 256 {
        return Err(bad("network.allowOut: at most 256 entries"));
    }
    let deny_all = n.allow_internet_access == Some(false)
        || deny.is_some_and(|d| d.iter().any(|x| x == ALL_TRAFFIC));
    if deny_all {
        return Ok(Some(api::NetworkSpec {
            policy: if allow.is_empty() {
                vec!["none".into()]
            } else {
                allow
            },
        }));
    }
    if allow.is_empty() {
        return Ok(None);
    }
    let mut policy = default.to_vec();
    policy.extend(allow);
    Ok(Some(api::NetworkSpec { policy }))
}

fn created(rec: &E2bSandbox) -> Response<Body> {
    super::json(StatusCode::CREATED, &sandbox_json(rec))
}

/// A create with an `Idempotency-Key`: the first request with the key creates; one that
/// arrives meanwhile waits for it; every later one gets the same sandbox (201 again, as the
/// SDK expects), or a 409 once that sandbox is gone.
async fn create_once(face: &Face, key: &str, n: NewSandbox) -> Result<Response<Body>, E2bError> {
    let slot = face
        .idempotency
        .slot(key, std::time::Instant::now())
        .map_err(|e| match e {
            super::idempotency::KeyError::Length => bad(e.to_string()),
            super::idempotency::KeyError::Full => {
                E2bError::new(StatusCode::TOO_MANY_REQUESTS, e.to_string())
            }
        })?;
    let mut done = slot.lock().await;
    if let Some(id) = done.as_deref() {
        return match own(face, id) {
            Ok((rec, _)) => Ok(created(&rec)),
            Err(_) => Err(E2bError::new(
                StatusCode::CONFLICT,
                format!("the sandbox {id} created with this Idempotency-Key is gone"),
            )),
        };
    }
    let rec = create(face, n).await?;
    *done = Some(rec.sandbox_id.clone());
    Ok(created(&rec))
}

async fn create(face: &Face, n: NewSandbox) -> Result<E2bSandbox, E2bError> {
    let template_id = n.template_id.clone().unwrap_or_else(|| "base".into());
    if n.volume_mounts
        .as_ref()
        .is_some_and(|v| !v.is_null() && v != &json!([]))
    {
        return Err(bad("volumes are not supported by tryboxi's E2B face"));
    }
    if n.mcp.as_ref().is_some_and(|v| !v.is_null()) {
        return Err(bad(
            "the MCP gateway option is not supported; run `tryboxi mcp` instead",
        ));
    }
    let timeout = check_timeout(n.timeout.unwrap_or(DEFAULT_TIMEOUT_S))?;
    let metadata = n.metadata.clone().unwrap_or_default();
    check_map("metadata", &metadata, MAX_METADATA, MAX_META_VALUE)?;
    let env_vars = n.env_vars.clone().unwrap_or_default();
    check_map("envVars", &env_vars, MAX_ENV_VARS, MAX_ENV_VALUE)?;
    let sbx = match template_for(face, &template_id) {
        Ok(template) => {
            let network = policy_for(&face.svc.config.network.default_policy, &n)?;
            let req = api::CreateSandboxRequest {
                workspace: Default::default(),
                template: Some(template),
                vcpus: None,
                memory_mib: None,
                network,
                secrets: Vec::new(),
            };
            face.svc.create_sandbox(req, None).await?
        }
        Err(not_a_template) => {
            let Some(snap) = super::snapshots::resolve(face, &template_id)? else {
                return Err(not_a_template);
            };
            // The new sandbox is the snapshot's sandbox as it was: its egress policy too.
            if n.network.is_some() || n.allow_internet_access.is_some() {
                return Err(bad(
                    "a sandbox created from a snapshot keeps the snapshot's network policy; \
                     leave out network and allow_internet_access",
                ));
            }
            super::snapshots::start_from(face, &snap).await?
        }
    };
    let rec = E2bSandbox {
        sandbox_id: sbx.id.clone(),
        template_id,
        envd_token: new_token(),
        traffic_token: new_token(),
        metadata,
        env_vars,
        started_at: crate::service::now_rfc3339(),
        end_at: unix_now() + timeout,
        auto_pause: n.auto_pause.unwrap_or(false),
        auto_pause_memory: n.auto_pause_memory.unwrap_or(true),
    };
    if let Err(e) = face.svc.e2b_put(&rec) {
        let _ = face.svc.remove_sandbox(&sbx.id).await;
        return Err(e.into());
    }
    if is_interpreter(&rec.template_id)
        && let Err(e) = start_interpreter(face, &rec).await
    {
        let _ = face.svc.e2b_forget(&sbx.id);
        let _ = face.svc.remove_sandbox(&sbx.id).await;
        return Err(e);
    }
    tracing::info!(sandbox = %sbx.id, template = %rec.template_id, timeout, "E2B sandbox created");
    Ok(rec)
}

async fn fork(face: &Face, parent: &E2bSandbox, b: ForkBody) -> Result<Response<Body>, E2bError> {
    let timeout = check_timeout(b.timeout.unwrap_or(DEFAULT_TIMEOUT_S))?;
    let res = face
        .svc
        .fork_sandbox(
            &parent.sandbox_id,
            api::ForkRequest {
                count: Some(b.count.unwrap_or(1)),
                snapshot: None,
            },
        )
        .await?;
    let mut out = Vec::new();
    for child in res.sandboxes {
        let rec = E2bSandbox {
            sandbox_id: child.id.clone(),
            envd_token: new_token(),
            traffic_token: new_token(),
            started_at: crate::service::now_rfc3339(),
            end_at: unix_now() + timeout,
            ..parent.clone()
        };
        match face.svc.e2b_put(&rec) {
            Ok(()) => out.push(json!({ "sandbox": sandbox_json(&rec) })),
            Err(e) => out.push(json!({ "error": { "code": 500, "message": e.to_string() } })),
        }
    }
    for f in res.failed {
        out.push(json!({ "error": { "code": 500, "message": f } }));
    }
    Ok(super::json(StatusCode::CREATED, &out))
}

/// E2B's `Sandbox` (the answer to create, connect and fork).
fn sandbox_json(rec: &E2bSandbox) -> Value {
    json!({
        "templateID": rec.template_id,
        "sandboxID": rec.sandbox_id,
        "clientID": CLIENT_ID,
        "envdVersion": super::ENVD_VERSION,
        "envdAccessToken": rec.envd_token,
        "trafficAccessToken": rec.traffic_token,
        "domain": null,
    })
}

/// MiB of each template's disk image (E2B's `diskSizeMB`).
fn disk_sizes(face: &Face) -> BTreeMap<String, u64> {
    face.svc
        .list_templates()
        .map(|l| {
            l.templates
                .into_iter()
                .map(|t| (t.name, t.size.div_ceil(1 << 20)))
                .collect()
        })
        .unwrap_or_default()
}

/// E2B's `ListedSandbox` / `SandboxDetail`.
fn listed(disks: &BTreeMap<String, u64>, rec: &E2bSandbox, sbx: &api::Sandbox) -> Value {
    let state = state_name(sbx.state);
    json!({
        "templateID": rec.template_id,
        "sandboxID": rec.sandbox_id,
        "clientID": CLIENT_ID,
        "startedAt": rec.started_at,
        "endAt": crate::service::rfc3339(rec.end_at as i64),
        "cpuCount": sbx.vcpus,
        "memoryMB": sbx.memory_mib,
        "diskSizeMB": disks.get(&sbx.template).copied().unwrap_or(0),
        "metadata": rec.metadata,
        "state": state,
        "envdVersion": super::ENVD_VERSION,
    })
}

/// E2B's `state` of one of our sandboxes (a paused one is `paused`, anything else `running`).
fn state_name(s: api::SandboxState) -> &'static str {
    match s {
        api::SandboxState::Paused => "paused",
        _ => "running",
    }
}

/// A list request's filters and page.
struct ListQuery {
    /// Every pair must match the sandbox's metadata.
    metadata: Vec<(String, String)>,
    /// Empty: any state.
    states: Vec<String>,
    limit: usize,
    /// The `x-next-token` of the previous page.
    after: Option<String>,
    /// `template`: the template id the sandbox was created with (`code-interpreter-v1` and
    /// `code-interpreter` are one).
    template: Option<String>,
    /// `order=desc`: newest first.
    newest_first: bool,
    /// `startedAfter` (unix seconds): only sandboxes started at or after it.
    started_after: Option<u64>,
}

/// One page of `all` for `q`: oldest first (then by id, a stable order for paging; reversed
/// with `newest_first`), and the
/// token of the next page when more follow.
fn select<T>(
    all: Vec<(E2bSandbox, T)>,
    state: impl Fn(&T) -> &'static str,
    q: &ListQuery,
) -> (Vec<(E2bSandbox, T)>, Option<String>) {
    let key = |r: &E2bSandbox| format!("{}|{}", r.started_at, r.sandbox_id);
    let mut all: Vec<(E2bSandbox, T)> = all
        .into_iter()
        .filter(|(r, s)| {
            (q.states.is_empty() || q.states.iter().any(|w| w == state(s)))
                && q.metadata.iter().all(|(k, v)| r.metadata.get(k) == Some(v))
                && q.started_after.is_none_or(|t| {
                    crate::service::parse_rfc3339(&r.started_at).is_some_and(|s| s >= t)
                })
                && q.template.as_ref().is_none_or(|t| {
                    *t == r.template_id || (is_interpreter(t) && is_interpreter(&r.template_id))
                })
                && q.after.as_ref().is_none_or(|after| {
                    if q.newest_first {
                        key(r) < *after
                    } else {
                        key(r) > *after
                    }
                })
        })
        .collect();
    all.sort_by_key(|(r, _)| key(r));
    if q.newest_first {
        all.reverse();
    }
    let more = all.len() > q.limit;
    all.truncate(q.limit);
    let next = if more {
        all.last().map(|(r, _)| key(r))
    } else {
        None
    };
    (all, next)
}

/// Unix seconds of an RFC 3339 time with a zone (`2026-12-06T07:00:00.5+01:00`, `...Z`), as
/// the SDKs send `startedAfter`; fractions are dropped. `None` without a zone.
fn parse_instant(s: &str) -> Option<u64> {
    let local = crate::service::parse_rfc3339(&format!("{}Z", s.get(..19)?))?;
    let rest = s.get(19..)?;
    let rest = rest
        .strip_prefix('.')
        .map_or(rest, |r| r.trim_start_matches(|c: char| c.is_ascii_digit()));
    let offset: i64 = match rest.as_bytes() {
        [b'Z' | b'z'] => 0,
        [sign @ (b'+' | b'-'), h1, h2, b':', m1, m2] => {
            let d = |b: &u8| b.is_ascii_digit().then(|| i64::from(b - b'0'));
            let secs = (d(h1)? * 10 + d(h2)?) * 3600 + (d(m1)? * 10 + d(m2)?) * 60;
            if *sign == b'+' { secs } else { -secs }
        }
        _ => return None,
    };
    u64::try_from(i64::try_from(local).ok()? - offset).ok()
}

/// `GET /v2/sandboxes?metadata=<urlencoded k=v&...>&state=running,paused&limit=&nextToken=`.
fn list(face: &Face, query: &str) -> Result<Response<Body>, E2bError> {
    let mut want_meta: Vec<(String, String)> = Vec::new();
    let mut states: Vec<String> = Vec::new();
    let mut limit = MAX_PAGE;
    let mut after: Option<String> = None;
    let mut template: Option<String> = None;
    let mut newest_first = false;
    let mut started_after: Option<u64> = None;
    for (k, v) in form_urlencoded::parse(query.as_bytes()) {
        match k.as_ref() {
            "metadata" => want_meta.extend(
                form_urlencoded::parse(v.as_bytes()).map(|(a, b)| (a.into_owned(), b.into_owned())),
            ),
            "state" => states.extend(v.split(',').map(|s| s.trim().to_owned())),
            "limit" => {
                limit = v
                    .parse::<usize>()
                    .map_err(|_| bad("`limit` must be a number"))?
                    .clamp(1, MAX_PAGE)
            }
            "nextToken" => after = Some(v.into_owned()),
            "template" => template = Some(v.into_owned()),
            "order" => match v.as_ref() {
                "asc" => newest_first = false,
                "desc" => newest_first = true,
                _ => return Err(bad("`order` must be `asc` or `desc`")),
            },
            "startedAfter" => {
                started_after = Some(parse_instant(&v).ok_or_else(|| {
                    bad("`startedAfter` must be an RFC 3339 time with a zone (Z or +HH:MM)")
                })?)
            }
            _ => {}
        }
    }
    if want_meta.len() > MAX_METADATA {
        return Err(bad("too many metadata filters"));
    }
    let q = ListQuery {
        metadata: want_meta,
        states,
        limit,
        after,
        template,
        newest_first,
        started_after,
    };
    let (all, next) = select(
        face.svc.e2b_list()?,
        |s: &api::Sandbox| state_name(s.state),
        &q,
    );
    let disks = disk_sizes(face);
    let body: Vec<Value> = all.iter().map(|(r, s)| listed(&disks, r, s)).collect();
    let mut resp = super::json(StatusCode::OK, &body);
    if let Some(token) = next
        && let Ok(v) = hyper::header::HeaderValue::from_str(&token)
    {
        resp.headers_mut().insert("x-next-token", v);
    }
    Ok(resp)
}

#[cfg(test)]
#[path = "control_tests.rs"]
mod tests;
