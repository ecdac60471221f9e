//! The MCP face: `tryboxi mcp` (argv[0] `sandbox-mcp`), an MCP server over stdio for coding
//! agents (Cursor, Claude Code, Codex), and `tryboxi mcp install` for those harnesses.
//!
//! Owns: the protocol plumbing (the official `rmcp` SDK behind a small line shim, [`stdio`]),
//! the tools and what they tell the model ([`tools`], [`server`]; background commands in
//! [`background`], checkpoints, fork and pause in [`lifecycle`]), command output kept for
//! paging ([`outputs`]) and the harness configuration writers ([`install`]).
//!
//! Must never: talk to a VM or the store directly (every tool goes through
//! [`crate::client::Client`], i.e. the daemon's HTTP API), write anything to stdout that is not
//! a JSON-RPC message (logs go to stderr), or let the model choose what the user fixed with
//! flags (template default, vCPUs, memory, network preset, whether apply/pull are allowed,
//! which host folders may be a workspace).

mod background;
mod error;
mod exec;
pub mod install;
mod lifecycle;
mod outputs;
mod scope;
mod server;
mod stdio;
mod tools;

use std::path::PathBuf;

pub use error::ToolError;
pub use server::{SandboxServer, workspace_path};

/// What the user set for this server (flags or env of `tryboxi mcp`), not the model.
#[derive(Debug, Clone)]
pub struct Options {
    /// The daemon's API socket.
    pub socket: PathBuf,
    /// The default workspace (`SANDBOX_WORKSPACE`, else the server's working directory).
    pub workspace: PathBuf,
    /// More folders the model may use as a workspace (`--allow-workspace`); with `workspace`,
    /// each with everything below it and nothing else (see [`scope`]).
    pub allowed_workspaces: Vec<PathBuf>,
    /// Which harness started us (`SANDBOX_CLIENT`), for logs.
    pub client_name: Option<String>,
    /// Template for new sandboxes when the model does not name one.
    pub template: String,
    pub vcpus: Option<u32>,
    pub memory_mib: Option<u32>,
    /// Network policy for new sandboxes (presets and allow rules, comma-separated); sent with
    /// every create. `None`: the daemon's default.
    pub network: Option<String>,
    /// Stored secrets (by name) every sandbox this server creates gets as placeholders
    /// (`--secret`, set by the user; the model cannot name or change them).
    pub secrets: Vec<String>,
    /// Whether the agent may change host files (`apply`, `pull`, `undo`). Off: those tools are
    /// not listed and refuse when called.
    pub allow_apply: bool,
    /// Default exec timeout in seconds when the model gives none.
    pub exec_timeout_s: f64,
}

impl Options {
    /// Defaults for a workspace and socket (used by tests and as the base of the CLI flags).
    pub fn new(socket: PathBuf, workspace: PathBuf) -> Options {
        Options {
            socket,
            workspace,
            allowed_workspaces: Vec::new(),
            client_name: None,
            template: "auto".into(),
            vcpus: None,
            memory_mib: None,
            network: None,
            secrets: Vec::new(),
            allow_apply: true,
            exec_timeout_s: 600.0,
        }
    }
}

/// Serve MCP on this process's stdin/stdout until the client closes stdin.
pub async fn serve_stdio(opts: Options) -> Result<(), stdio::ServeError> {
    tracing::info!(
        workspace = %opts.workspace.display(),
        client = opts.client_name.as_deref().unwrap_or("-"),
        allow_apply = opts.allow_apply,
        "MCP server starting on stdio"
    );
    stdio::serve(
        SandboxServer::new(opts),
        tokio::io::stdin(),
        tokio::io::stdout(),
    )
    .await
}
