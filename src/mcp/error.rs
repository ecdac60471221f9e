//! Why a tool call failed, worded for the model (and the user reading over its shoulder).
//!
//! A tool failure is a *result* with `isError: true` (the model reads it and can react), never
//! a JSON-RPC error and never a crash of the server.

use crate::client::ClientError;

#[derive(Debug, thiserror::Error)]
pub enum ToolError {
    #[error(
        "The tryboxi daemon is not running (nothing answers on {socket}). Ask the user to start \
         it with `tryboxi serve` (as root: `sudo tryboxi serve`), then call this tool again."
    )]
    DaemonDown { socket: String },
    #[error(
        "Unknown sandbox `{id}`: it was removed or never existed. Call `list` to see the \
         sandboxes, or `create` for a new one."
    )]
    UnknownSandbox { id: String },
    #[error(
        "`{tool}` is not available: the running tryboxi daemon does not serve {route} yet \
         (it is older than this MCP server). Ask the user to update and restart the daemon."
    )]
    RouteMissing { tool: &'static str, route: String },
    #[error(
        "No sandbox for workspace {workspace} yet. Call `create` (or `exec`, which creates one) \
         first, or pass `sandbox_id`."
    )]
    NoSandbox { workspace: String },
    #[error(
        "`{0}` is turned off by the user for this agent (the MCP server runs with --no-apply): \
         changes stay in the sandbox. Tell the user what `diff` shows; they can apply it with \
         `tryboxi apply`."
    )]
    ApplyDisabled(&'static str),
    #[error(
        "Workspace `{path}` may not be used by this agent: {why}. This MCP server works in \
         {allowed} and folders below. Use one of those; if the user wants another folder, they \
         add it to the server with `--allow-workspace DIR`."
    )]
    WorkspaceNotAllowed {
        path: String,
        why: String,
        allowed: String,
    },
    #[error("Invalid arguments for `{tool}`: {message}")]
    InvalidArgs { tool: String, message: String },
    #[error("Unknown tool `{0}`.")]
    UnknownTool(String),
    #[error("The daemon answered with an error: {code}: {message}")]
    Api { code: String, message: String },
    #[error(
        "The command could not finish ({code}: {message}). If the sandbox failed, `rm` it; the \
         next `exec` creates a new one."
    )]
    ExecFailed { code: String, message: String },
    /// The daemon refuses this MCP server's uid: the daemon's message as it is.
    #[error("{0}. Ask the user to do that and restart the daemon, then call this tool again.")]
    NotAllowed(String),
    #[error("Talking to the daemon failed: {0}")]
    Daemon(String),
    #[error("{0}")]
    Other(String),
}

impl ToolError {
    /// Map a client error for `tool`, which used `route` of sandbox `id` (if any).
    pub fn from_client(e: ClientError, tool: &'static str, route: &str, id: Option<&str>) -> Self {
        match e {
            ClientError::Unreachable { socket, .. } => ToolError::DaemonDown {
                socket: socket.display().to_string(),
            },
            ClientError::Api { code, message, .. } => {
                if message.starts_with("no such API route") {
                    ToolError::RouteMissing {
                        tool,
                        route: route.to_owned(),
                    }
                } else if code == "not_found"
                    && let Some(id) = id
                    && message.starts_with(&format!("no sandbox `{id}`"))
                {
                    ToolError::UnknownSandbox { id: id.to_owned() }
                } else {
                    ToolError::Api { code, message }
                }
            }
            ClientError::NotAllowed(m) => ToolError::NotAllowed(m),
            ClientError::Protocol(m) => ToolError::Daemon(m),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use hyper::StatusCode;

    fn api(code: &str, message: &str) -> ClientError {
        ClientError::Api {
            status: StatusCode::NOT_FOUND,
            code: code.into(),
            message: message.into(),
        }
    }

    #[test]
    fn missing_route_is_named_with_the_tool() {
        let e = ToolError::from_client(
            api("not_found", "no such API route: /v1/sandboxes/sbx_1/diff"),
            "diff",
            "GET /v1/sandboxes/{id}/diff",
            Some("sbx_1"),
        );
        assert!(
            matches!(e, ToolError::RouteMissing { tool: "diff", .. }),
            "{e}"
        );
        assert!(e.to_string().contains("restart the daemon"), "{e}");
    }

    #[test]
    fn unknown_sandbox_says_what_to_do() {
        let e = ToolError::from_client(
            api("not_found", "no sandbox `sbx_9`"),
            "exec",
            "POST /v1/sandboxes/{id}/exec",
            Some("sbx_9"),
        );
        assert!(matches!(e, ToolError::UnknownSandbox { .. }), "{e}");
        assert!(e.to_string().contains("`list`"), "{e}");
    }

    #[test]
    fn a_missing_snapshot_of_a_known_sandbox_is_not_an_unknown_sandbox() {
        let e = ToolError::from_client(
            api("not_found", "sandbox `sbx_9` has no snapshot `nope`"),
            "restore",
            "POST /v1/sandboxes/{id}/restore",
            Some("sbx_9"),
        );
        assert!(matches!(e, ToolError::Api { .. }), "{e}");
        assert!(e.to_string().contains("no snapshot `nope`"), "{e}");
    }

    #[test]
    fn a_refused_uid_gets_the_daemons_message_as_it_is() {
        let msg =
            "uid 1001 may not use this daemon: add it to [api] allowed_uids in /x/config.toml";
        let e = ToolError::from_client(
            ClientError::NotAllowed(msg.into()),
            "list",
            "GET /v1/sandboxes",
            None,
        );
        assert!(e.to_string().starts_with(msg), "{e}");
    }

    #[test]
    fn unreachable_daemon_tells_how_to_start_it() {
        let e = ToolError::from_client(
            ClientError::Unreachable {
                socket: "/x/tryboxi.sock".into(),
                source: std::io::ErrorKind::NotFound.into(),
            },
            "list",
            "GET /v1/sandboxes",
            None,
        );
        assert!(e.to_string().contains("tryboxi serve"), "{e}");
    }
}
