//! End to end for the MCP face: the official MCP Python SDK (`pip install mcp`, installed by
//! `cargo xtask deps`) drives `tryboxi mcp` as an agent harness would, against a real daemon
//! booting real VMs. The scenario itself is `tests/mcp/client.py`; this test supplies the
//! daemon, the workspace and the checks on its summary.
//!
//! Needs the guest images (`TRYBOXI_ARTIFACTS`, else `_out/`) and Python's `mcp` package
//! (`cargo xtask deps` puts it in the venv `_out/mcp-venv`).
//! Without them it skips with a message, except under CI, where that is a failure.

mod common;

use std::path::PathBuf;
use std::process::Command;

use common::{BIN, Daemon, SMALL_VMS, artifacts};

/// The Python with the MCP SDK: `$TRYBOXI_MCP_PYTHON`, else the venv `cargo xtask deps` makes
/// (`_out/mcp-venv`, or next to `TRYBOXI_ARTIFACTS`), else `python3` on PATH.
fn python_sdk() -> Option<PathBuf> {
    let mut candidates: Vec<PathBuf> = Vec::new();
    if let Some(p) = std::env::var_os("TRYBOXI_MCP_PYTHON") {
        candidates.push(p.into());
    }
    if let Some(a) = std::env::var_os("TRYBOXI_ARTIFACTS") {
        candidates.push(PathBuf::from(a).join("mcp-venv/bin/python3"));
    }
    candidates.push(concat!(env!("CARGO_MANIFEST_DIR"), "/_out/mcp-venv/bin/python3").into());
    candidates.push("python3".into());
    let found = candidates.into_iter().find(|py| {
        Command::new(py)
            .args(["-c", "import mcp.client, anyio"])
            .stderr(std::process::Stdio::null())
            .status()
            .is_ok_and(|s| s.success())
    });
    assert!(
        found.is_some() || std::env::var_os("CI").is_none(),
        "the MCP Python SDK is missing under CI: `cargo xtask deps` installs it"
    );
    if found.is_none() {
        eprintln!("skipped: no python3 with the MCP SDK (run `cargo xtask deps`)");
    }
    found
}

#[test]
fn python_sdk_drives_the_mcp_server_against_real_vms() {
    let Some(python) = python_sdk() else { return };
    let Some(art) = artifacts() else { return };
    let d = Daemon::start(Some(SMALL_VMS), &["--artifacts", art.to_str().unwrap()]);
    let ws = tempfile::tempdir().unwrap();
    std::fs::write(ws.path().join("marker.txt"), "synced from the host\n").unwrap();

    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/mcp/client.py");
    let out = Command::new(&python)
        .arg(script)
        .arg(BIN)
        .arg(d.root())
        .arg(ws.path())
        .output()
        .expect("run python3");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    // Whatever happened, leave no VM behind.
    let left = d.cli(&["ls", "--json"]);
    let list: serde_json::Value = serde_json::from_slice(&left.stdout).unwrap_or_default();
    for s in list["sandboxes"].as_array().into_iter().flatten() {
        if let Some(id) = s["id"].as_str() {
            d.cli(&["rm", id]);
        }
    }
    assert!(
        out.status.success(),
        "client.py failed ({}):\n--- stdout\n{stdout}\n--- stderr (client and server)\n{stderr}\n--- daemon\n{}",
        out.status,
        d.log_text()
    );
    let line = stdout
        .lines()
        .find_map(|l| l.strip_prefix("SUMMARY "))
        .unwrap_or_else(|| panic!("no summary in: {stdout}"));
    let s: serde_json::Value = serde_json::from_str(line).unwrap();
    eprintln!("summary: {s}");

    // The SDK's default connect probes `server/discover` and settles on the newest protocol.
    assert_eq!(s["protocol_version"], "2026-07-28", "{s}");
    assert_eq!(s["legacy_protocol_version"], "2025-11-25", "{s}");
    for t in [
        "create",
        "exec",
        "read_output",
        "diff",
        "apply",
        "pull",
        "undo",
        "read_file",
        "write_file",
        "list",
        "rm",
        "checkpoint",
        "list_checkpoints",
        "restore",
        "fork",
        "pause",
        "exec_output",
        "stop_exec",
        "expose_port",
    ] {
        assert!(
            s["tools"].as_array().unwrap().iter().any(|x| x == t),
            "{t}: {s}"
        );
    }
    assert!(s["sandbox_id"].as_str().unwrap().starts_with("sbx_"), "{s}");
    assert_eq!(s["cancel_killed"], true, "{s}");
    assert!(s["progress_notifications"].as_u64().unwrap() >= 2, "{s}");
    assert_eq!(s["paged_bytes"], 588_895, "{s}");
    assert!(s["workspace_routes"].is_boolean(), "{s}");
    assert_eq!(s["restored"], true, "{s}");
    assert!(s["forked"].as_str().unwrap().starts_with("sbx_"), "{s}");
    assert_eq!(s["paused_and_resumed"], true, "{s}");
    assert!(
        s["dev_server_url"]
            .as_str()
            .unwrap()
            .starts_with("http://127.0.0.1:"),
        "{s}"
    );
    assert_eq!(s["background_stopped"], true, "{s}");
    assert_eq!(
        list["sandboxes"].as_array().map_or(0, Vec::len),
        0,
        "the scenario removes its sandbox with the `rm` tool: {list}"
    );
}

/// `tryboxi mcp install` as a user runs it: HOME from the environment, `claude` not on PATH,
/// pre-existing files merged and backed up, a second run changes nothing.
#[test]
fn install_cli_writes_the_three_harness_configs_into_the_given_home() {
    let home = tempfile::tempdir().unwrap();
    let repo = tempfile::tempdir().unwrap();
    std::fs::create_dir_all(home.path().join(".codex")).unwrap();
    std::fs::write(home.path().join(".codex/config.toml"), "model = \"o4\"\n").unwrap();
    std::fs::write(repo.path().join("AGENTS.md"), "# Team rules\n").unwrap();
    let run = |harness: &str| {
        let out = Command::new(BIN)
            .args(["mcp", "install", harness, "--project"])
            .arg(repo.path())
            .arg("--no-apply")
            .env("HOME", home.path())
            .env_remove("CODEX_HOME")
            .env("PATH", "/nonexistent")
            .output()
            .unwrap();
        let text = String::from_utf8_lossy(&out.stdout).into_owned();
        assert!(
            out.status.success(),
            "{harness}: {text}{}",
            String::from_utf8_lossy(&out.stderr)
        );
        text
    };
    for h in ["cursor", "claude", "codex"] {
        run(h);
    }
    let cursor: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(repo.path().join(".cursor/mcp.json")).unwrap(),
    )
    .unwrap();
    let server = &cursor["mcpServers"]["sandbox"];
    assert_eq!(server["env"]["SANDBOX_WORKSPACE"], "${workspaceFolder}");
    assert_eq!(server["args"], serde_json::json!(["mcp", "--no-apply"]));
    assert_eq!(server["command"].as_str(), Some(BIN));
    assert!(
        repo.path()
            .join(".claude/skills/sandbox/SKILL.md")
            .is_file()
    );
    let codex = std::fs::read_to_string(home.path().join(".codex/config.toml")).unwrap();
    assert!(codex.starts_with("model = \"o4\"\n"), "{codex}");
    assert!(codex.contains("[mcp_servers.sandbox]") && codex.contains("tool_timeout_sec = 900"));
    assert_eq!(
        std::fs::read_to_string(home.path().join(".codex/config.toml.bak")).unwrap(),
        "model = \"o4\"\n"
    );
    let agents = std::fs::read_to_string(repo.path().join("AGENTS.md")).unwrap();
    assert!(agents.starts_with("# Team rules\n") && agents.contains("tryboxi:sandbox:begin"));

    let again = run("codex");
    assert!(
        !again.contains("wrote") && again.contains("already up to date"),
        "{again}"
    );
    let claude = run("claude");
    assert!(
        claude.contains("claude mcp add sandbox --scope project -e SANDBOX_CLIENT=claude --"),
        "{claude}"
    );
}
