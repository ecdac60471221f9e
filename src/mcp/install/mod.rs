//! `tryboxi mcp install cursor|claude|codex`: register the `sandbox` MCP server with an agent
//! harness and install the rules that tell the agent when to use it.
//!
//! Owns: the exact files the README promises (Cursor `.cursor/mcp.json`; Claude
//! `.claude/skills/sandbox/SKILL.md` + `claude mcp add`; Codex `~/.codex/config.toml` and
//! `AGENTS.md`). Must never: clobber a user's file (existing files are merged and a `.bak` copy
//! of the previous content is written first), or touch anything when the result would be
//! identical (a second install changes nothing). HOME comes from the environment the caller
//! passes in ([`Env`]), so tests run against temporary homes.

mod claude;
mod codex;
mod cursor;
mod files;

use std::path::{Path, PathBuf};

/// The rule texts (see `agent-rules/README.md`).
pub const SKILL: &str = include_str!("../../../agent-rules/SKILL.md");
pub const RULES: &str = include_str!("../../../agent-rules/sandbox-rules.md");

#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Harness {
    Cursor,
    Claude,
    Codex,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Scope {
    /// This repo only.
    Project(PathBuf),
    /// Every project of this user.
    Global,
}

/// How the harness starts the server.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ServerCommand {
    pub program: PathBuf,
    pub args: Vec<String>,
}

impl ServerCommand {
    /// The `sandbox-mcp` alias next to `exe` if there is one, else `exe mcp`; then `flags`.
    pub fn for_exe(exe: &Path, flags: Vec<String>) -> ServerCommand {
        let alias = exe.with_file_name("sandbox-mcp");
        let (program, mut args) = if alias.exists() {
            (alias, Vec::new())
        } else {
            (exe.to_path_buf(), vec!["mcp".to_owned()])
        };
        args.extend(flags);
        ServerCommand { program, args }
    }
}

/// The caller's environment, injected.
#[derive(Debug, Clone)]
pub struct Env {
    pub home: PathBuf,
    /// `$CODEX_HOME`, else `~/.codex`.
    pub codex_home: PathBuf,
    /// `$PATH`, to find the `claude` CLI.
    pub path: Option<std::ffi::OsString>,
}

impl Env {
    /// From this process's environment.
    pub fn from_process() -> Result<Env, InstallError> {
        let home = std::env::var_os("HOME")
            .filter(|h| !h.is_empty())
            .map(PathBuf::from)
            .ok_or(InstallError::NoHome)?;
        let codex_home = std::env::var_os("CODEX_HOME")
            .filter(|h| !h.is_empty())
            .map(PathBuf::from)
            .unwrap_or_else(|| home.join(".codex"));
        Ok(Env {
            home,
            codex_home,
            path: std::env::var_os("PATH"),
        })
    }

    /// An executable called `name` on `$PATH`.
    pub fn which(&self, name: &str) -> Option<PathBuf> {
        use std::os::unix::fs::PermissionsExt as _;
        let path = self.path.as_ref()?;
        std::env::split_paths(path).map(|d| d.join(name)).find(|p| {
            std::fs::metadata(p)
                .map(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
                .unwrap_or(false)
        })
    }
}

/// What an install did, for the user.
#[derive(Debug, Default)]
pub struct Report {
    /// Files created or changed.
    pub written: Vec<PathBuf>,
    /// Backups of the previous content.
    pub backups: Vec<PathBuf>,
    /// Files that already had the right content.
    pub unchanged: Vec<PathBuf>,
    /// Commands run (and their result).
    pub ran: Vec<String>,
    /// Commands the user must run.
    pub to_run: Vec<String>,
    /// What to do next in the harness.
    pub next: Vec<String>,
}

#[derive(Debug, thiserror::Error)]
pub enum InstallError {
    #[error("HOME is not set: cannot find the user's configuration directory")]
    NoHome,
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{path} is not valid {format} ({detail}); fix or move it, then install again")]
    Unparsable {
        path: PathBuf,
        format: &'static str,
        detail: String,
    },
    #[error("{path}: `{key}` must be a {expected}; fix it, then install again")]
    WrongShape {
        path: PathBuf,
        key: String,
        expected: &'static str,
    },
    #[error("the project directory {0} does not exist")]
    NoProject(PathBuf),
    #[error("`{command}` failed: {output}")]
    Command { command: String, output: String },
}

/// Install the server for `harness` in `scope`.
pub fn install(
    harness: Harness,
    scope: &Scope,
    cmd: &ServerCommand,
    env: &Env,
) -> Result<Report, InstallError> {
    if let Scope::Project(p) = scope
        && !p.is_dir()
    {
        return Err(InstallError::NoProject(p.clone()));
    }
    let mut report = Report::default();
    match harness {
        Harness::Cursor => cursor::install(scope, cmd, env, &mut report)?,
        Harness::Claude => claude::install(scope, cmd, env, &mut report)?,
        Harness::Codex => codex::install(scope, cmd, env, &mut report)?,
    }
    Ok(report)
}

/// What the installers' tests share.
#[cfg(test)]
mod testing {
    use super::{Env, ServerCommand};
    use std::path::Path;

    /// The server command the tests install.
    pub(super) fn cmd() -> ServerCommand {
        ServerCommand {
            program: "/opt/tryboxi/_out/bin/sandbox-mcp".into(),
            args: vec![],
        }
    }

    /// `home` as HOME (Codex's under `home/.codex`), no `$PATH`.
    pub(super) fn env(home: &Path) -> Env {
        Env {
            home: home.into(),
            codex_home: home.join(".codex"),
            path: None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn alias_next_to_the_binary_is_preferred() {
        let dir = tempfile::tempdir().unwrap();
        let exe = dir.path().join("tryboxi");
        std::fs::write(&exe, b"").unwrap();
        let c = ServerCommand::for_exe(&exe, vec!["--no-apply".into()]);
        assert_eq!(c.program, exe);
        assert_eq!(c.args, ["mcp", "--no-apply"]);
        std::os::unix::fs::symlink(&exe, dir.path().join("sandbox-mcp")).unwrap();
        let c = ServerCommand::for_exe(&exe, vec![]);
        assert_eq!(c.program, dir.path().join("sandbox-mcp"));
        assert!(c.args.is_empty());
    }

    #[test]
    fn missing_project_is_refused_before_writing() {
        let home = tempfile::tempdir().unwrap();
        let env = testing::env(home.path());
        let cmd = ServerCommand::for_exe(Path::new("/opt/tryboxi"), vec![]);
        let e = install(
            Harness::Cursor,
            &Scope::Project(home.path().join("nope")),
            &cmd,
            &env,
        )
        .unwrap_err();
        assert!(matches!(e, InstallError::NoProject(_)), "{e}");
        assert_eq!(std::fs::read_dir(home.path()).unwrap().count(), 0);
    }
}
