//! The MCP server proper: server info, the tool list and the tool calls. One sandbox per
//! workspace is remembered and reused (checked with the daemon before each use); a tool that
//! fails answers with `isError: true` and a sentence saying what to do.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use rmcp::model::{
    CallToolRequestParams, CallToolResponse, CallToolResult, ContentBlock, Implementation,
    ListToolsResult, PaginatedRequestParams, ServerCapabilities, ServerConfig, Tool,
};
use rmcp::service::RequestContext;
use rmcp::{ErrorData as McpError, RoleServer, ServerHandler};
use serde::Serialize;

use super::outputs::Outputs;
use super::tools::{self, parse};
use super::{Options, ToolError, background, exec, scope};
use crate::api;
use crate::client::Client;

/// Shown to the model at connect time (`instructions`).
const INSTRUCTIONS: &str = include_str!("../../agent-rules/instructions.md");
/// Largest diff text put into one result; narrow with `paths` beyond that.
const DIFF_SHOWN: usize = 48 << 10;

/// The `sandbox` MCP server. Cheap to clone (shared state).
#[derive(Clone)]
pub struct SandboxServer {
    pub(super) inner: Arc<Inner>,
}

pub(super) struct Inner {
    pub(super) opts: Options,
    pub(super) client: Client,
    tools: Vec<Tool>,
    /// workspace (canonical) -> its sandbox.
    by_workspace: Mutex<HashMap<PathBuf, String>>,
    /// Serialises find-or-create so two calls do not boot two VMs for one workspace.
    resolving: tokio::sync::Mutex<()>,
    outputs: Mutex<Outputs>,
}

impl SandboxServer {
    pub fn new(opts: Options) -> SandboxServer {
        SandboxServer {
            inner: Arc::new(Inner {
                client: Client::new(&opts.socket).with_face("mcp"),
                tools: tools::all(opts.allow_apply),
                opts,
                by_workspace: Mutex::new(HashMap::new()),
                resolving: tokio::sync::Mutex::new(()),
                outputs: Mutex::new(Outputs::default()),
            }),
        }
    }

    async fn call(
        &self,
        name: &str,
        args: Option<rmcp::model::JsonObject>,
        ctx: &RequestContext<RoleServer>,
    ) -> Result<CallToolResult, ToolError> {
        let me = &self.inner;
        if tools::HOST_WRITING.contains(&name) && !me.opts.allow_apply {
            let name = tools::HOST_WRITING
                .iter()
                .find(|n| **n == name)
                .copied()
                .unwrap_or("apply");
            return Err(ToolError::ApplyDisabled(name));
        }
        match name {
            "create" => {
                let a: tools::CreateArgs = parse(name, args)?;
                let ws = match &a.workspace {
                    Some(w) => scope::allowed_workspace(
                        &me.opts,
                        &workspace_path(Path::new(w), &me.opts.workspace),
                    )?,
                    None => me.opts.workspace.clone(),
                };
                let (sbx, reused) = if a.new {
                    (self.boot(&ws, a.template, a.exclude).await?, false)
                } else {
                    self.find_or_create(&ws, a.template, a.exclude).await?
                };
                let mut v =
                    serde_json::to_value(&sbx).map_err(|e| ToolError::Other(e.to_string()))?;
                v["reused"] = reused.into();
                if let Some(n) = &me.opts.network {
                    v["network_preset"] = n.clone().into();
                }
                Ok(json_result(&v))
            }
            "exec" => {
                let a: tools::ExecArgs = parse(name, args)?;
                let default_timeout = (!a.background).then_some(me.opts.exec_timeout_s);
                let mut req = exec::request(a.cmd, a.timeout_s, a.cwd, default_timeout)?;
                req.sync_exclude = a.sync_exclude;
                req.detach = a.background;
                let id = self.target_or_create(a.sandbox_id).await?;
                if a.background {
                    background::start(&me.client, &id, &req).await
                } else {
                    exec::run(&me.client, &id, &req, ctx, &me.outputs).await
                }
            }
            "read_output" => {
                let a: tools::ReadOutputArgs = parse(name, args)?;
                let page = me
                    .outputs
                    .lock()
                    .map_err(|_| ToolError::Other("output store poisoned".into()))?
                    .page(&a.output_id, a.stream, a.offset, a.limit.min(65536))?;
                Ok(json_result(&page))
            }
            "list" => {
                let _: tools::ListArgs = parse(name, args)?;
                let list =
                    me.client.list().await.map_err(|e| {
                        ToolError::from_client(e, "list", "GET /v1/sandboxes", None)
                    })?;
                let current = self.remembered(&me.opts.workspace);
                // Only the sandboxes on folders this server may use: others belong to other
                // clients of the daemon (and may hold the user's home or another repo).
                let rows: Vec<serde_json::Value> = list
                    .sandboxes
                    .iter()
                    .filter(|s| scope::allowed_sandbox(&me.opts, s).is_ok())
                    .map(|s| {
                        let mut v = serde_json::to_value(s).unwrap_or_default();
                        v["this_workspace"] = (current.as_deref() == Some(s.id.as_str())).into();
                        v
                    })
                    .collect();
                Ok(json_result(&serde_json::json!({ "sandboxes": rows })))
            }
            "rm" => {
                let a: tools::SandboxArgs = parse(name, args)?;
                let id = self.target(a.sandbox_id).await?;
                let s = me.client.remove(&id).await.map_err(|e| {
                    ToolError::from_client(e, "rm", "DELETE /v1/sandboxes/{id}", Some(&id))
                })?;
                self.forget(&id);
                Ok(json_result(&serde_json::json!({ "removed": s.id })))
            }
            "diff" => {
                let a: tools::DiffArgs = parse(name, args)?;
                let id = self.target(a.sandbox_id).await?;
                let report = me.client.diff(&id, a.stat, &a.paths).await.map_err(|e| {
                    ToolError::from_client(e, "diff", "GET /v1/sandboxes/{id}/diff", Some(&id))
                })?;
                Ok(diff_result(&report))
            }
            "apply" | "pull" => {
                let (sandbox_id, req) = if name == "apply" {
                    let a: tools::ApplyArgs = parse(name, args)?;
                    let req = api::ApplyRequest {
                        paths: a.paths,
                        force: a.force,
                    };
                    (a.sandbox_id, req)
                } else {
                    let a: tools::PullArgs = parse(name, args)?;
                    if a.paths.is_empty() {
                        return Err(ToolError::InvalidArgs {
                            tool: name.into(),
                            message: "`paths` needs at least one file".into(),
                        });
                    }
                    let req = api::ApplyRequest {
                        paths: a.paths,
                        force: a.force,
                    };
                    (a.sandbox_id, req)
                };
                let id = self.target(sandbox_id).await?;
                let report = if name == "apply" {
                    me.client.apply(&id, &req).await.map_err(|e| {
                        ToolError::from_client(
                            e,
                            "apply",
                            "POST /v1/sandboxes/{id}/apply",
                            Some(&id),
                        )
                    })?
                } else {
                    me.client.pull(&id, &req).await.map_err(|e| {
                        ToolError::from_client(e, "pull", "POST /v1/sandboxes/{id}/pull", Some(&id))
                    })?
                };
                Ok(json_result(&report))
            }
            "undo" => {
                let a: tools::UndoArgs = parse(name, args)?;
                // Only an apply made into one of this server's folders can be undone here.
                let within = scope::roots(&me.opts)
                    .iter()
                    .map(|r| r.display().to_string())
                    .collect();
                let report = me
                    .client
                    .undo(&a.artifact_id, a.force, within)
                    .await
                    .map_err(|e| {
                        ToolError::from_client(e, "undo", "POST /v1/artifacts/{art_id}/undo", None)
                    })?;
                Ok(json_result(&report))
            }
            "read_file" => {
                let a: tools::ReadFileArgs = parse(name, args)?;
                let id = self.target(a.sandbox_id).await?;
                let path = vm_path(&a.path);
                let f = me.client.read_file(&id, &path).await.map_err(|e| {
                    ToolError::from_client(
                        e,
                        "read_file",
                        "GET /v1/sandboxes/{id}/files",
                        Some(&id),
                    )
                })?;
                let text = match (&f.content, &f.content_b64) {
                    (Some(t), _) => t.clone(),
                    (None, Some(b)) => format!(
                        "[binary file, {} bytes of base64: {}...]",
                        b.len(),
                        b.chars().take(200).collect::<String>()
                    ),
                    (None, None) => String::new(),
                };
                let mut r = CallToolResult::success(vec![ContentBlock::text(text)]);
                r.structured_content = serde_json::to_value(&f).ok();
                Ok(r)
            }
            "write_file" => {
                let a: tools::WriteFileArgs = parse(name, args)?;
                let id = self.target_or_create(a.sandbox_id).await?;
                let file = api::FileContent {
                    path: vm_path(&a.path),
                    content: Some(a.content),
                    ..Default::default()
                };
                me.client.write_file(&id, &file).await.map_err(|e| {
                    ToolError::from_client(
                        e,
                        "write_file",
                        "PUT /v1/sandboxes/{id}/files",
                        Some(&id),
                    )
                })?;
                Ok(json_result(&serde_json::json!({
                    "written": file.path,
                    "bytes": file.content.as_ref().map_or(0, String::len),
                    "sandbox_id": id,
                })))
            }
            "expose_port" => {
                let a: tools::ExposePortArgs = parse(name, args)?;
                let id = self.target(a.sandbox_id).await?;
                let route = "GET /v1/sandboxes/{id}/ports";
                let list = (me.client.ports(&id).await)
                    .map_err(|e| ToolError::from_client(e, "expose_port", route, Some(&id)))?;
                let p = match list.ports.into_iter().find(|p| p.port == a.port) {
                    Some(p) => p,
                    None => {
                        let req = api::ExposePortRequest {
                            port: a.port,
                            host_port: a.host_port,
                        };
                        let route = "POST /v1/sandboxes/{id}/ports";
                        (me.client.expose_port(&id, &req).await).map_err(|e| {
                            ToolError::from_client(e, "expose_port", route, Some(&id))
                        })?
                    }
                };
                Ok(json_result(&serde_json::json!({
                    "url": p.url,
                    "port": p.port,
                    "host_port": p.host_port,
                    "error": p.error,
                    "sandbox_id": id,
                })))
            }
            "request_network_access" => {
                let a: tools::NetworkAccessArgs = parse(name, args)?;
                let id = self.target(a.sandbox_id).await?;
                let req = api::AccessRequestCreate {
                    host: a.host,
                    reason: Some(a.reason),
                };
                let r: api::AccessRequest = me
                    .client
                    .send(
                        hyper::Method::POST,
                        &format!("/v1/sandboxes/{id}/network/requests"),
                        Some(&req),
                    )
                    .await
                    .map_err(|e| {
                        ToolError::from_client(
                            e,
                            "request_network_access",
                            "POST /v1/sandboxes/{id}/network/requests",
                            Some(&id),
                        )
                    })?;
                Ok(json_result(&serde_json::json!({
                    "request_id": r.id,
                    "rule": r.rule,
                    "state": r.state,
                    "message": format!(
                        "Asked. The user decides with `tryboxi net approve {id} {}`; until then \
                         connections to it stay blocked. Do not retry in a loop: carry on with \
                         other work or tell the user what you need.",
                        r.id
                    ),
                })))
            }
            "exec_output" => self.exec_output(parse(name, args)?).await,
            "stop_exec" => self.stop_exec(parse(name, args)?).await,
            "checkpoint" => self.checkpoint(parse(name, args)?).await,
            "list_checkpoints" => self.list_checkpoints(parse(name, args)?).await,
            "restore" => self.restore(parse(name, args)?).await,
            "fork" => self.fork(parse(name, args)?).await,
            "pause" => self.pause(parse(name, args)?).await,
            other => Err(ToolError::UnknownTool(other.to_owned())),
        }
    }

    /// The sandbox a tool acts on: the given id (if its workspace is one this server may
    /// use), else this workspace's (which must exist).
    pub(super) async fn target(&self, id: Option<String>) -> Result<String, ToolError> {
        if let Some(id) = id {
            self.check_scope(&id).await?;
            return Ok(id);
        }
        let ws = &self.inner.opts.workspace;
        let _guard = self.inner.resolving.lock().await;
        match self.find(ws).await? {
            Some(s) => Ok(s.id),
            None => Err(ToolError::NoSandbox {
                workspace: ws.display().to_string(),
            }),
        }
    }

    /// The sandbox a tool acts on: the given id, else this workspace's, created if needed
    /// (default template, no extra excludes).
    pub(super) async fn target_or_create(&self, id: Option<String>) -> Result<String, ToolError> {
        match id {
            Some(id) => {
                self.check_scope(&id).await?;
                Ok(id)
            }
            None => Ok(self
                .find_or_create(&self.inner.opts.workspace, None, Vec::new())
                .await?
                .0
                .id),
        }
    }

    /// A sandbox named by the model must work on a folder this server may use (another
    /// sandbox of the daemon may hold the user's home or another repo).
    pub(super) async fn check_scope(&self, id: &str) -> Result<(), ToolError> {
        let s =
            self.inner.client.sandbox(id).await.map_err(|e| {
                ToolError::from_client(e, "exec", "GET /v1/sandboxes/{id}", Some(id))
            })?;
        scope::allowed_sandbox(&self.inner.opts, &s)
    }

    /// This workspace's ready sandbox, else a new one. `bool`: it was reused.
    async fn find_or_create(
        &self,
        ws: &Path,
        template: Option<String>,
        exclude: Vec<String>,
    ) -> Result<(api::Sandbox, bool), ToolError> {
        let _guard = self.inner.resolving.lock().await;
        if let Some(s) = self.find(ws).await? {
            return Ok((s, true));
        }
        Ok((self.boot(ws, template, exclude).await?, false))
    }

    /// The remembered sandbox of `ws` if it is still usable; else a usable one the daemon has
    /// for that workspace (e.g. from an earlier session), which is then remembered. Usable:
    /// ready, or paused (by `pause` or the daemon's idle pause; the next use resumes it).
    async fn find(&self, ws: &Path) -> Result<Option<api::Sandbox>, ToolError> {
        let client = &self.inner.client;
        if let Some(id) = self.remembered(ws) {
            match client.sandbox(&id).await {
                Ok(s) if usable(s.state) => return Ok(Some(s)),
                Ok(s) => {
                    tracing::info!(sandbox = %id, state = %s.state, "remembered sandbox unusable")
                }
                Err(e) => {
                    match ToolError::from_client(e, "exec", "GET /v1/sandboxes/{id}", Some(&id)) {
                        ToolError::UnknownSandbox { .. } => {
                            tracing::info!(sandbox = %id, "remembered sandbox is gone")
                        }
                        other => return Err(other),
                    }
                }
            }
            self.forget(&id);
        }
        let list = client
            .list()
            .await
            .map_err(|e| ToolError::from_client(e, "exec", "GET /v1/sandboxes", None))?;
        let ws_str = ws.display().to_string();
        let found = list
            .sandboxes
            .into_iter()
            .filter(|s| {
                usable(s.state) && s.workspace.as_ref().is_some_and(|w| w.host_path == ws_str)
            })
            .max_by(|a, b| a.created_at.cmp(&b.created_at));
        if let Some(s) = &found {
            self.remember(ws, &s.id);
        }
        Ok(found)
    }

    async fn boot(
        &self,
        ws: &Path,
        template: Option<String>,
        exclude: Vec<String>,
    ) -> Result<api::Sandbox, ToolError> {
        let o = &self.inner.opts;
        let req = api::CreateSandboxRequest {
            workspace: Some(api::WorkspaceSpec {
                host_path: ws.display().to_string(),
                exclude,
            }),
            template: Some(template.unwrap_or_else(|| o.template.clone())),
            vcpus: o.vcpus,
            memory_mib: o.memory_mib,
            network: o.network.as_ref().map(|n| api::NetworkSpec {
                policy: n.split(',').map(|s| s.trim().to_owned()).collect(),
            }),
            secrets: o.secrets.clone(),
        };
        tracing::info!(workspace = %ws.display(), "creating a sandbox");
        let s = self
            .inner
            .client
            .create(&req)
            .await
            .map_err(|e| ToolError::from_client(e, "create", "POST /v1/sandboxes", None))?;
        self.remember(ws, &s.id);
        Ok(s)
    }

    fn remembered(&self, ws: &Path) -> Option<String> {
        self.inner
            .by_workspace
            .lock()
            .ok()
            .and_then(|m| m.get(ws).cloned())
    }

    fn remember(&self, ws: &Path, id: &str) {
        if let Ok(mut m) = self.inner.by_workspace.lock() {
            m.insert(ws.to_path_buf(), id.to_owned());
        }
    }

    fn forget(&self, id: &str) {
        if let Ok(mut m) = self.inner.by_workspace.lock() {
            m.retain(|_, v| v != id);
        }
    }
}

impl ServerHandler for SandboxServer {
    fn get_info(&self) -> ServerConfig {
        ServerConfig::new(ServerCapabilities::builder().enable_tools().build())
            .with_server_info(
                Implementation::new("tryboxi", env!("CARGO_PKG_VERSION"))
                    .with_title("tryboxi sandbox"),
            )
            .with_instructions(INSTRUCTIONS)
    }

    async fn list_tools(
        &self,
        _request: Option<PaginatedRequestParams>,
        _context: RequestContext<RoleServer>,
    ) -> Result<ListToolsResult, McpError> {
        Ok(ListToolsResult::with_all_items(self.inner.tools.clone()))
    }

    fn get_tool(&self, name: &str) -> Option<Tool> {
        self.inner.tools.iter().find(|t| t.name == name).cloned()
    }

    async fn call_tool(
        &self,
        request: CallToolRequestParams,
        context: RequestContext<RoleServer>,
    ) -> Result<CallToolResponse, McpError> {
        let name = request.name.to_string();
        if self.get_tool(&name).is_none() && !tools::HOST_WRITING.contains(&name.as_str()) {
            return Err(McpError::invalid_params(
                format!("unknown tool `{name}`"),
                None,
            ));
        }
        let started = std::time::Instant::now();
        let result = match self.call(&name, request.arguments, &context).await {
            Ok(r) => r,
            Err(e) => {
                tracing::info!(tool = %name, error = %e, "tool failed");
                CallToolResult::error(vec![ContentBlock::text(e.to_string())])
            }
        };
        tracing::debug!(tool = %name, ms = started.elapsed().as_millis() as u64, "tool done");
        Ok(result.into())
    }
}

pub(super) fn json_result<T: Serialize>(v: &T) -> CallToolResult {
    let value = serde_json::to_value(v).unwrap_or_default();
    let text = serde_json::to_string_pretty(&value).unwrap_or_default();
    let mut r = CallToolResult::success(vec![ContentBlock::text(text)]);
    r.structured_content = Some(value);
    r
}

/// A diff as the model reads it: one header line per file, then its patch.
fn diff_result(report: &api::DiffReport) -> CallToolResult {
    let mut text = String::new();
    if report.files.is_empty() && report.refused.is_empty() && report.too_big.is_empty() {
        text.push_str("No changes in the sandbox's workspace.\n");
    }
    for p in &report.refused {
        text.push_str(&format!("refused (apply will not bring it back): {p}\n"));
    }
    for t in &report.too_big {
        text.push_str(&format!(
            "too big, not brought back (over sync.max_file_mib): {} ({} bytes)\n",
            t.path, t.size
        ));
    }
    for f in &report.files {
        let kind = serde_json::to_value(f.kind).unwrap_or_default();
        let kind = kind.as_str().unwrap_or("changed");
        let from = f
            .old_path
            .as_ref()
            .map(|p| format!(" (from {p})"))
            .unwrap_or_default();
        let bin = if f.binary { " binary" } else { "" };
        text.push_str(&format!(
            "{kind}: {}{from}{bin} +{} -{}\n",
            f.path, f.additions, f.deletions
        ));
        if let Some(p) = &f.patch {
            text.push_str(p);
            if !p.ends_with('\n') {
                text.push('\n');
            }
        }
    }
    if text.len() > DIFF_SHOWN {
        let (cut, _) = super::outputs::excerpt(text.as_bytes(), DIFF_SHOWN);
        text = format!("{cut}\n[diff cut: ask for `stat` or narrow with `paths`]\n");
    }
    let mut r = CallToolResult::success(vec![ContentBlock::text(text)]);
    r.structured_content = serde_json::to_value(report).ok();
    r
}

/// A sandbox the tools may use as this workspace's: a paused one resumes on use.
fn usable(state: api::SandboxState) -> bool {
    matches!(state, api::SandboxState::Ready | api::SandboxState::Paused)
}

/// A path in the VM: relative ones are under /workspace.
fn vm_path(p: &str) -> String {
    if p.starts_with('/') {
        p.to_owned()
    } else {
        format!("/workspace/{}", p.trim_start_matches("./"))
    }
}

/// A workspace as the daemon will record it: absolute, symlinks resolved when it exists.
pub fn workspace_path(p: &Path, base: &Path) -> PathBuf {
    let abs = if p.is_absolute() {
        p.to_path_buf()
    } else {
        base.join(p)
    };
    std::fs::canonicalize(&abs).unwrap_or(abs)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn relative_vm_paths_land_in_the_workspace() {
        assert_eq!(vm_path("src/main.rs"), "/workspace/src/main.rs");
        assert_eq!(vm_path("./a"), "/workspace/a");
        assert_eq!(vm_path("/etc/os-release"), "/etc/os-release");
    }

    #[test]
    fn empty_diff_says_so() {
        let r = diff_result(&api::DiffReport::default());
        let v = serde_json::to_value(&r).unwrap();
        assert!(
            v["content"][0]["text"]
                .as_str()
                .unwrap()
                .contains("No changes")
        );
    }
}
