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

use common::{BIN, Daemon};

fn artifacts() -> Option<PathBuf> {
    let dir = std::env::var_os("TRYBOXI_ARTIFACTS")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/_out")));
    if dir.join("images/manifest.json").exists() {
        return Some(dir);
    }
    assert!(
        std::env::var_os("CI").is_none(),
        "no guest images at {} under CI: `cargo xtask ci` builds them",
        dir.display()
    );
    eprintln!(
        "skipped: no guest images at {} (run `cargo xtask images`)",
        dir.display()
    );
    None
}

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
    let cfg = "default_memory_mib = 512\ndefault_vcpus = 1\nboot_timeout_s = 180\n";
    let d = Daemon::start(Some(cfg), &["--artifacts", art.to_str().unwrap()]);
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
    assert_eq!(
        list["sandboxes"].as_array().map_or(0, Vec::len),
        0,
        "the scenario removes its sandbox with the `rm` tool: {list}"
    );
}
