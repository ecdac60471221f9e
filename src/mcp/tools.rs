//! The tools the model sees: names, descriptions, argument types (their JSON schemas are
//! derived from these types, so schema and parsing cannot drift apart).

use rmcp::handler::server::common::schema_for_type;
use rmcp::model::{JsonObject, Tool, ToolAnnotations};
use schemars::JsonSchema;
use serde::Deserialize;
use serde::de::DeserializeOwned;

use super::ToolError;
use super::outputs::Stream;

/// `create`.
#[derive(Debug, Default, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct CreateArgs {
    /// Host directory (the repo) the sandbox works on, synced to /workspace in the VM.
    /// Default: the workspace this agent was started for. Only that workspace, folders below
    /// it and folders the user allowed (`--allow-workspace`) may be used.
    #[serde(default)]
    pub workspace: Option<String>,
    /// Boot a fresh sandbox even if this workspace already has one (default false: reuse).
    #[serde(default)]
    pub new: bool,
    /// Guest image template; `auto` picks one from the repo's files. Default: the user's choice.
    #[serde(default)]
    pub template: Option<String>,
    /// Paths never synced into this sandbox (glob patterns like `data/`, `*.bin`), on top of
    /// .gitignore and the user's sync.exclude. Only used when a new sandbox is created.
    #[serde(default)]
    pub exclude: Vec<String>,
}

/// `exec`.
#[derive(Debug, Default, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct ExecArgs {
    /// Shell command line, run by /bin/sh -c in the VM (pipes, &&, redirections work).
    pub cmd: String,
    /// Kill the command (its whole process group) after this many seconds.
    #[serde(default)]
    pub timeout_s: Option<f64>,
    /// Working directory in the VM (default /workspace, the synced repo).
    #[serde(default)]
    pub cwd: Option<String>,
    /// Sandbox to run in. Default: this workspace's sandbox (created if there is none).
    #[serde(default)]
    pub sandbox_id: Option<String>,
    /// Glob patterns the sync before this command leaves alone (not sent, not deleted in the
    /// VM), e.g. a huge data directory the command does not need.
    #[serde(default)]
    pub sync_exclude: Vec<String>,
    /// Start the command in the background and return at once with its `exec_id` (for dev
    /// servers, watchers, long jobs). It keeps running after this call, with no timeout unless
    /// `timeout_s` is given; read its output with `exec_output`, stop it with `stop_exec`.
    #[serde(default)]
    pub background: bool,
}

/// `rm` (and any tool that only needs a sandbox).
#[derive(Debug, Default, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct SandboxArgs {
    /// Sandbox id (`sbx_...`). Default: this workspace's sandbox.
    #[serde(default)]
    pub sandbox_id: Option<String>,
}

/// `list`.
#[derive(Debug, Default, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct ListArgs {}

/// `diff`.
#[derive(Debug, Default, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct DiffArgs {
    /// Sandbox id. Default: this workspace's sandbox.
    #[serde(default)]
    pub sandbox_id: Option<String>,
    /// Only list changed files with line counts, no patches.
    #[serde(default)]
    pub stat: bool,
    /// Limit to these paths (relative to the repo root).
    #[serde(default)]
    pub paths: Vec<String>,
}

/// `apply`.
#[derive(Debug, Default, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct ApplyArgs {
    /// Sandbox id. Default: this workspace's sandbox.
    #[serde(default)]
    pub sandbox_id: Option<String>,
    /// Only these paths (relative to the repo root); empty = every change.
    #[serde(default)]
    pub paths: Vec<String>,
    /// Overwrite host files that changed since the last sync (default false: they merge).
    #[serde(default)]
    pub force: bool,
}

/// `pull`.
#[derive(Debug, Default, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct PullArgs {
    /// Sandbox id. Default: this workspace's sandbox.
    #[serde(default)]
    pub sandbox_id: Option<String>,
    /// Files to copy back (relative to the repo root); at least one.
    pub paths: Vec<String>,
    /// Overwrite host files that changed since the last sync.
    #[serde(default)]
    pub force: bool,
}

/// `undo`.
#[derive(Debug, Default, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct UndoArgs {
    /// The `artifact_id` (`art_...`) an `apply` or `pull` returned.
    pub artifact_id: String,
    /// Undo even though the user changed some of those files since (their current content is
    /// backed up first). Only with the user's consent.
    #[serde(default)]
    pub force: bool,
}

/// `read_file`.
#[derive(Debug, Default, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct ReadFileArgs {
    /// Path in the VM; relative paths are under /workspace.
    pub path: String,
    /// Sandbox id. Default: this workspace's sandbox.
    #[serde(default)]
    pub sandbox_id: Option<String>,
}

/// `write_file`.
#[derive(Debug, Default, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct WriteFileArgs {
    /// Path in the VM; relative paths are under /workspace.
    pub path: String,
    /// The whole new content (UTF-8 text).
    pub content: String,
    /// Sandbox id. Default: this workspace's sandbox (created if there is none).
    #[serde(default)]
    pub sandbox_id: Option<String>,
}

/// `request_network_access`.
#[derive(Debug, Default, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct NetworkAccessArgs {
    /// Host to reach: `api.example.com`, `*.example.com`, an IP or CIDR, optionally `:PORT`
    /// (names work on ports 80 and 443).
    pub host: String,
    /// Why it is needed (shown to the user).
    pub reason: String,
    /// Sandbox id. Default: this workspace's sandbox.
    #[serde(default)]
    pub sandbox_id: Option<String>,
}

/// `expose_port`.
#[derive(Debug, Default, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct ExposePortArgs {
    /// The port a server inside the sandbox listens on (e.g. 3000).
    pub port: u16,
    /// The host port to use on 127.0.0.1 (at least 1024). Default: a free one.
    #[serde(default)]
    pub host_port: Option<u16>,
    /// Sandbox id. Default: this workspace's sandbox.
    #[serde(default)]
    pub sandbox_id: Option<String>,
}

/// `checkpoint`.
#[derive(Debug, Default, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct CheckpointArgs {
    /// A name to restore it by later (1-64 characters, unique in this sandbox), e.g.
    /// `before-upgrade`. Default: none (restore by the returned `checkpoint_id`).
    #[serde(default)]
    pub name: Option<String>,
    /// Sandbox id. Default: this workspace's sandbox (created if there is none).
    #[serde(default)]
    pub sandbox_id: Option<String>,
}

/// `restore`.
#[derive(Debug, Default, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct RestoreArgs {
    /// The checkpoint's name or `checkpoint_id` (`snap_...`), as `checkpoint` or
    /// `list_checkpoints` returned it.
    pub checkpoint: String,
    /// Sandbox id. Default: this workspace's sandbox.
    #[serde(default)]
    pub sandbox_id: Option<String>,
}

/// `fork`.
#[derive(Debug, Default, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct ForkArgs {
    /// How many copies (default 1, at most 4).
    #[serde(default)]
    pub count: Option<u32>,
    /// Sandbox to copy. Default: this workspace's sandbox.
    #[serde(default)]
    pub sandbox_id: Option<String>,
}

/// Most copies one `fork` call makes (each is a whole VM on the user's machine).
pub const MAX_FORKS: u32 = 4;

/// Which output of a background command `exec_output` reads.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize, JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum ExecStream {
    /// stdout and stderr interleaved as they came.
    #[default]
    Output,
    Stdout,
    Stderr,
}

impl ExecStream {
    pub fn as_str(self) -> &'static str {
        match self {
            ExecStream::Output => "output",
            ExecStream::Stdout => "stdout",
            ExecStream::Stderr => "stderr",
        }
    }
}

/// `exec_output`.
#[derive(Debug, Default, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct ExecOutputArgs {
    /// The `exec_id` (`exe_...`) a background `exec` returned.
    pub exec_id: String,
    /// Which output (default `output`: stdout and stderr interleaved).
    #[serde(default)]
    pub stream: ExecStream,
    /// Byte offset to read from (default 0); use the previous call's `next_offset`.
    #[serde(default)]
    pub offset: u64,
    /// If the command is still running and has nothing new, wait up to this many seconds for
    /// more (default 0, at most 30).
    #[serde(default)]
    pub wait_s: Option<f64>,
}

/// `stop_exec`.
#[derive(Debug, Default, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct StopExecArgs {
    /// The `exec_id` (`exe_...`) a background `exec` returned.
    pub exec_id: String,
    /// Signal to send to the command's process group: `TERM` (default), `INT`, `KILL`, ...
    #[serde(default)]
    pub signal: Option<String>,
}

/// `read_output`.
#[derive(Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct ReadOutputArgs {
    /// The `output_id` an `exec` result named.
    pub output_id: String,
    /// Which stream (default stdout).
    #[serde(default = "default_stream")]
    pub stream: Stream,
    /// Byte offset to start at (default 0); use the previous page's `next_offset`.
    #[serde(default)]
    pub offset: u64,
    /// Bytes to return (default 16384, at most 65536).
    #[serde(default = "default_page")]
    pub limit: u64,
}

fn default_stream() -> Stream {
    Stream::Stdout
}

fn default_page() -> u64 {
    16384
}

/// Parse a tool's arguments (absent = `{}`).
pub fn parse<T: DeserializeOwned>(tool: &str, args: Option<JsonObject>) -> Result<T, ToolError> {
    serde_json::from_value(serde_json::Value::Object(args.unwrap_or_default())).map_err(|e| {
        ToolError::InvalidArgs {
            tool: tool.to_owned(),
            message: e.to_string(),
        }
    })
}

/// Tools that change files on the host; absent with `--no-apply`.
pub const HOST_WRITING: &[&str] = &["apply", "pull", "undo"];

fn tool<T: JsonSchema + 'static>(name: &'static str, description: &'static str) -> Tool {
    Tool::new(name, description, schema_for_type::<T>())
}

fn annotated(t: Tool, read_only: bool, destructive: bool) -> Tool {
    t.with_annotations(
        ToolAnnotations::new()
            .read_only(read_only)
            .destructive(destructive)
            .open_world(false),
    )
}

/// Every tool, in the order the model sees them.
pub fn all(allow_apply: bool) -> Vec<Tool> {
    let mut tools = vec![
        annotated(
            tool::<CreateArgs>(
                "create",
                "Get a disposable Linux microVM (sandbox) for a workspace, with the repo synced \
                 to /workspace. Reuses the workspace's running sandbox unless `new` is true. \
                 Usually not needed: `exec` creates one on first use. Returns the sandbox \
                 (id, state, vcpus, memory).",
            ),
            false,
            false,
        ),
        annotated(
            tool::<ExecArgs>(
                "exec",
                "Run a shell command in the sandbox (the repo is synced in before each run) and \
                 return its stdout, stderr and exit code. Use it for tests, builds, installs and \
                 anything that could harm the host. Long output is cut to its head and tail; \
                 the full text stays available through `read_output` with the returned \
                 `output_id`. Default timeout set by the user; a timed-out command is killed. \
                 With `background: true` it returns at once with an `exec_id` and the command \
                 keeps running (dev servers, watchers): read it with `exec_output`, stop it \
                 with `stop_exec`.",
            ),
            false,
            false,
        ),
        annotated(
            tool::<ReadOutputArgs>(
                "read_output",
                "Page through the full stdout or stderr of an earlier `exec` whose output was \
                 cut. Returns `text` and `next_offset` (null at the end).",
            ),
            true,
            false,
        ),
        annotated(
            tool::<DiffArgs>(
                "diff",
                "Show what changed in the sandbox's /workspace compared with the host repo: \
                 files added, modified, deleted, with unified patches (or only counts with \
                 `stat`).",
            ),
            true,
            false,
        ),
    ];
    if allow_apply {
        tools.extend([
            annotated(
                tool::<ApplyArgs>(
                    "apply",
                    "Copy the sandbox's changes into the host repo (all, or `paths`). Files the \
                     user changed meanwhile are merged with conflict markers unless `force`. A \
                     backup is kept: returns an `artifact_id` for `undo`.",
                ),
                false,
                true,
            ),
            annotated(
                tool::<PullArgs>(
                    "pull",
                    "Copy selected files (`paths`) from the sandbox into the host repo, with a \
                     backup (`artifact_id` for `undo`). For generated files such as lockfiles \
                     or formatter output.",
                ),
                false,
                true,
            ),
            annotated(
                tool::<UndoArgs>(
                    "undo",
                    "Restore the host files an `apply` or `pull` changed, from its backup.",
                ),
                false,
                true,
            ),
        ]);
    }
    tools.extend([
        annotated(
            tool::<ReadFileArgs>(
                "read_file",
                "Read a file inside the sandbox (e.g. a build artifact or a log).",
            ),
            true,
            false,
        ),
        annotated(
            tool::<WriteFileArgs>(
                "write_file",
                "Write a file inside the sandbox only (the host repo is untouched until \
                 `apply`).",
            ),
            false,
            false,
        ),
        annotated(
            tool::<ListArgs>(
                "list",
                "List the sandboxes on folders this server may use: id, state, workspace, resources; marks this workspace's one.",
            ),
            true,
            false,
        ),
        annotated(
            tool::<NetworkAccessArgs>(
                "request_network_access",
                "Ask the user to allow the sandbox to reach a host its network policy blocks \
                 (connections fail fast and DNS says the name does not exist). This only \
                 records a request: the user approves or rejects it outside this session, and \
                 you cannot approve it yourself. `*`, bare TLDs and private or local addresses \
                 are refused outright.",
            ),
            false,
            false,
        ),
        annotated(
            tool::<ExecOutputArgs>(
                "exec_output",
                "Read the output of a background command (`exec` with `background: true`) \
                 from `offset`, and whether it is still running (with its exit code once it \
                 ended). Returns `text`, `next_offset` (pass it as `offset` next time), \
                 `running`, `exit_code`.",
            ),
            true,
            false,
        ),
        annotated(
            tool::<StopExecArgs>(
                "stop_exec",
                "Stop a background command: send its process group a signal (default TERM; \
                 use KILL if it ignores that). Returns whether it is still running.",
            ),
            false,
            true,
        ),
        annotated(
            tool::<ExposePortArgs>(
                "expose_port",
                "Make a server running inside the sandbox (e.g. a dev server on port 3000) \
                 reachable from the user's machine at a loopback URL (http://127.0.0.1:N), \
                 e.g. for the user to open in a browser. Returns the URL; calling it again \
                 for the same port returns the same URL. Start the server first with `exec` \
                 and `background: true` (e.g. `npm run dev -- --host 0.0.0.0`).",
            ),
            false,
            false,
        ),
        annotated(
            tool::<CheckpointArgs>(
                "checkpoint",
                "Save the sandbox's whole state (files, memory, running processes) so you can \
                 go back to it with `restore`, e.g. before a risky change such as upgrading \
                 dependencies or a migration. Takes a few seconds; the sandbox keeps running. \
                 Give it a `name`. The host repo is not part of it: after a `restore`, the \
                 next `exec` syncs the host's current files in again.",
            ),
            false,
            false,
        ),
        annotated(
            tool::<SandboxArgs>(
                "list_checkpoints",
                "List the sandbox's checkpoints, oldest first: `checkpoint_id`, `name`, \
                 `created_at`.",
            ),
            true,
            false,
        ),
        annotated(
            tool::<RestoreArgs>(
                "restore",
                "Put the sandbox back to a checkpoint (by name or id): files, memory and \
                 processes as they were then; everything done in the sandbox since is lost \
                 and running commands end. The host repo is untouched. Use it when an \
                 experiment failed.",
            ),
            false,
            true,
        ),
        annotated(
            tool::<ForkArgs>(
                "fork",
                "Make copies of the sandbox as it is now (files, memory, processes), each a \
                 new sandbox with its own id, e.g. to try several approaches side by side: \
                 pass a copy's `sandbox_id` to `exec` and the other tools. The original keeps \
                 running. `rm` the copies when done (the original cannot be removed while \
                 copies exist).",
            ),
            false,
            false,
        ),
        annotated(
            tool::<SandboxArgs>(
                "pause",
                "Pause the sandbox to disk (frees its memory and CPU; files and running \
                 processes are kept). The next tool that uses it resumes it by itself. Use it \
                 when you will not need the sandbox for a while but want to keep its state.",
            ),
            false,
            false,
        ),
        annotated(
            tool::<SandboxArgs>(
                "rm",
                "Remove a sandbox: its VM and everything in it (unapplied changes are lost). \
                 Default: this workspace's sandbox.",
            ),
            false,
            true,
        ),
    ]);
    tools
}

/// A schema as the wire carries it (for tests).
#[cfg(test)]
pub fn schema_of(t: &Tool) -> std::sync::Arc<JsonObject> {
    t.input_schema.clone()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_schema_is_an_object_with_described_properties() {
        for t in all(true) {
            let s = schema_of(&t);
            assert_eq!(
                s.get("type").and_then(|v| v.as_str()),
                Some("object"),
                "{}",
                t.name
            );
            let props = s.get("properties").and_then(|p| p.as_object());
            for (name, p) in props.into_iter().flatten() {
                assert!(
                    p.get("description").is_some(),
                    "{}.{name} has no description: {p}",
                    t.name
                );
            }
            assert!(
                t.description.as_deref().is_some_and(|d| d.len() > 30),
                "{}",
                t.name
            );
        }
    }

    #[test]
    fn exec_requires_cmd_only() {
        let t = all(true).into_iter().find(|t| t.name == "exec").unwrap();
        let required = schema_of(&t).get("required").cloned().unwrap();
        assert_eq!(required, serde_json::json!(["cmd"]));
    }

    #[test]
    fn no_apply_hides_host_writing_tools() {
        let names: Vec<_> = all(false).into_iter().map(|t| t.name).collect();
        for n in HOST_WRITING {
            assert!(!names.iter().any(|x| x == n), "{n} listed: {names:?}");
        }
        assert!(names.iter().any(|x| x == "diff"));
    }

    #[test]
    fn unknown_arguments_are_refused() {
        let mut o = JsonObject::new();
        o.insert("command".into(), "ls".into());
        let e = parse::<ExecArgs>("exec", Some(o)).unwrap_err();
        assert!(e.to_string().contains("command"), "{e}");
    }
}
