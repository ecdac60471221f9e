//! `tryboxi mcp install` against the real harness CLIs, not only the command line it prints:
//! Claude Code (`claude mcp add` is run by the installer; `claude mcp list` then starts the
//! server and does the MCP handshake) and Codex (`codex mcp list` reads the table the installer
//! merged into its `config.toml`).
//!
//! The CLIs are the pinned npm packages `cargo xtask deps` puts in `_out/harness-clis/bin`
//! (`$TRYBOXI_ARTIFACTS/harness-clis/bin` when that is set), with the Node 22 Claude Code needs
//! when the machine's is older. HOME is a temporary directory, so the user's own configuration
//! is never read or written; no API key or login is needed for `mcp add/list`. No daemon and
//! no VM either: the server answers the handshake without one (tool calls then say how to
//! start it). Without the CLIs the test says so and returns, except under CI, where that is a
//! failure.

mod common;

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

use common::{BIN, skip_unless_ci, wait_bounded};

/// The directory with `claude` and `codex`, if `cargo xtask deps` installed them.
fn harness_clis() -> Option<PathBuf> {
    let out = std::env::var_os("TRYBOXI_ARTIFACTS")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/_out")));
    let bin = out.join("harness-clis/bin");
    if ["claude", "codex"].iter().all(|c| bin.join(c).exists()) {
        return Some(bin);
    }
    skip_unless_ci(&format!(
        "no Claude Code / Codex CLIs in {} (`cargo xtask deps` installs them)",
        bin.display()
    ));
    None
}

/// Between stdout and stderr in what [`Harness::run`] returns.
const STDERR: &str = "\n--- stderr ---\n";

/// Runs commands with HOME = a temporary directory and the CLIs first on PATH.
struct Harness {
    home: tempfile::TempDir,
    path: std::ffi::OsString,
}

impl Harness {
    fn new(clis: &Path) -> Harness {
        let system = std::env::var_os("PATH").unwrap_or_default();
        let path = std::env::join_paths(
            std::iter::once(clis.to_path_buf()).chain(std::env::split_paths(&system)),
        )
        .unwrap();
        Harness {
            home: tempfile::tempdir().unwrap(),
            path,
        }
    }

    /// `program args` in `cwd`; (success, stdout, [`STDERR`], stderr). Bounded: a CLI that hangs fails.
    fn run(&self, program: &str, args: &[&str], cwd: &Path) -> (bool, String) {
        let dir = tempfile::tempdir().unwrap();
        let (out, err) = (dir.path().join("out"), dir.path().join("err"));
        let mut child = Command::new(program)
            .args(args)
            .current_dir(cwd)
            .env("HOME", self.home.path())
            .env("PATH", &self.path)
            .env_remove("CODEX_HOME")
            .env_remove("ANTHROPIC_API_KEY")
            // Nothing a `mcp add/list` needs: no update checks, no telemetry.
            .env("DISABLE_AUTOUPDATER", "1")
            .env("CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC", "1")
            .stdin(Stdio::null())
            .stdout(std::fs::File::create(&out).unwrap())
            .stderr(std::fs::File::create(&err).unwrap())
            .spawn()
            .unwrap_or_else(|e| panic!("{program}: {e}"));
        let status = wait_bounded(&mut child, Duration::from_secs(120));
        let text = format!(
            "{}{STDERR}{}",
            std::fs::read_to_string(&out).unwrap(),
            std::fs::read_to_string(&err).unwrap()
        );
        (status.success(), text)
    }

    fn install(&self, harness: &str, scope: &[&str], cwd: &Path) -> String {
        let mut args = vec!["mcp", "install", harness];
        args.extend(scope);
        let (ok, text) = self.run(BIN, &args, cwd);
        assert!(
            ok,
            "tryboxi mcp install {harness} {scope:?} failed:\n{text}"
        );
        text
    }
}

/// The line `claude mcp list` prints for the `sandbox` server.
fn sandbox_line(list: &str) -> Option<&str> {
    list.lines().find(|l| l.starts_with("sandbox:"))
}

#[test]
fn claude_code_runs_the_installers_command_and_connects_to_the_server() {
    let Some(clis) = harness_clis() else { return };
    let h = Harness::new(&clis);
    let (ok, version) = h.run("claude", &["--version"], h.home.path());
    assert!(ok && version.contains("2.1.328"), "{version}");

    // User scope (`--global`): the installer runs `claude mcp add`, the CLI accepts it, and
    // `claude mcp list` starts `tryboxi mcp` and completes the handshake.
    let text = h.install("claude", &["--global"], h.home.path());
    assert!(
        text.contains("claude mcp add sandbox --scope user"),
        "{text}"
    );
    let repo = tempfile::tempdir().unwrap();
    let (ok, list) = h.run("claude", &["mcp", "list"], repo.path());
    assert!(ok, "{list}");
    let line = sandbox_line(&list).unwrap_or_else(|| panic!("no sandbox server: {list}"));
    assert!(line.contains(BIN), "{line}");
    assert!(line.contains("Connected"), "{line}");
    let (ok, get) = h.run("claude", &["mcp", "get", "sandbox"], repo.path());
    assert!(ok && get.contains("SANDBOX_CLIENT=claude"), "{get}");
    // A second install finds it registered and succeeds.
    let again = h.install("claude", &["--global"], h.home.path());
    assert!(again.contains("already registered"), "{again}");

    // Project scope (another HOME, so only the project's server is there): `.mcp.json` in the
    // repo, the server and its env in it, and Claude Code reads it from there.
    let h = Harness::new(&clis);
    let text = h.install(
        "claude",
        &["--project", &repo.path().display().to_string()],
        repo.path(),
    );
    let mcp: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(repo.path().join(".mcp.json")).expect(".mcp.json written"),
    )
    .unwrap();
    let server = &mcp["mcpServers"]["sandbox"];
    assert_eq!(server["command"].as_str(), Some(BIN), "{mcp}");
    assert_eq!(server["args"], serde_json::json!(["mcp"]), "{mcp}");
    assert_eq!(server["env"]["SANDBOX_CLIENT"], "claude", "{mcp}");
    let (ok, get) = h.run("claude", &["mcp", "get", "sandbox"], repo.path());
    assert!(ok && get.contains("Project config"), "{get}");
    // Claude Code asks the user once before it starts a project's servers.
    let (ok, list) = h.run("claude", &["mcp", "list"], repo.path());
    let line = sandbox_line(&list).unwrap_or_else(|| panic!("no sandbox server: {list}"));
    assert!(ok && line.contains("Pending approval"), "{line}");
    assert!(text.contains("approve"), "the installer says so: {text}");
}

#[test]
fn codex_lists_the_installed_server_enabled() {
    let Some(clis) = harness_clis() else { return };
    let h = Harness::new(&clis);
    let repo = tempfile::tempdir().unwrap();
    h.install(
        "codex",
        &["--project", &repo.path().display().to_string()],
        repo.path(),
    );
    let (ok, list) = h.run("codex", &["mcp", "list", "--json"], repo.path());
    assert!(ok, "{list}");
    // stdout is the JSON; Codex may warn on stderr (e.g. about a HOME under /tmp).
    let json = list.split_once(STDERR).map_or(list.as_str(), |(o, _)| o);
    let servers: Vec<serde_json::Value> =
        serde_json::from_str(json).unwrap_or_else(|e| panic!("{e}: {list}"));
    let s = servers
        .iter()
        .find(|s| s["name"] == "sandbox")
        .unwrap_or_else(|| panic!("no sandbox server: {list}"));
    assert_eq!(s["enabled"], true, "{s}");
    let (ok, table) = h.run("codex", &["mcp", "list"], repo.path());
    let line = table
        .lines()
        .find(|l| l.starts_with("sandbox "))
        .unwrap_or_else(|| panic!("{table}"));
    assert!(
        ok && line.contains(BIN) && line.contains("enabled"),
        "{line}"
    );
}
