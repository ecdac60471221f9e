//! `tryboxi mcp` (argv[0] `sandbox-mcp`): the MCP stdio server, and
//! `tryboxi mcp install cursor|claude|codex (--project PATH | --global)`.
//!
//! The server flags are the user's choices (they also come from env, so a harness config can
//! set them); the model cannot change them. `install` writes the same flags into the harness
//! config, so `tryboxi mcp install codex --global --no-apply` gives Codex a server without
//! apply.

use std::path::PathBuf;

use crate::config::Paths;
use crate::error::TopError;
use crate::mcp::install::{self, Env, Harness, Scope, ServerCommand};

#[derive(Debug, clap::Args)]
#[command(args_conflicts_with_subcommands = true)]
pub struct Args {
    #[command(subcommand)]
    command: Option<McpCommand>,
    #[command(flatten)]
    server: ServerArgs,
}

#[derive(Debug, clap::Subcommand)]
enum McpCommand {
    /// Register the `sandbox` MCP server with Cursor, Claude Code or Codex, with its rules.
    Install(InstallArgs),
}

/// Server settings: flags, or the env variables named in `--help`.
#[derive(Debug, clap::Args)]
struct ServerArgs {
    /// Default workspace (the repo); default: the current directory. Cursor sets it to
    /// `${workspaceFolder}`.
    #[arg(long, env = "SANDBOX_WORKSPACE", value_name = "DIR")]
    workspace: Option<String>,
    /// Another folder the agent may use as a workspace (with everything below it); repeat for
    /// more. Without it the agent may only use the default workspace and folders below it.
    #[arg(long = "allow-workspace", value_name = "DIR")]
    allow_workspace: Vec<PathBuf>,
    /// Which harness runs the server (for logs).
    #[arg(long, env = "SANDBOX_CLIENT", value_name = "NAME")]
    client: Option<String>,
    #[command(flatten)]
    fixed: FixedArgs,
}

/// What the user fixes for the agent.
#[derive(Debug, Clone, clap::Args)]
struct FixedArgs {
    /// Template for new sandboxes (`auto` picks one from the repo's files).
    #[arg(long, env = "SANDBOX_TEMPLATE", value_name = "NAME")]
    template: Option<String>,
    /// vCPUs of new sandboxes (default: the daemon's).
    #[arg(long, env = "SANDBOX_VCPUS", value_name = "N")]
    vcpus: Option<u32>,
    /// Memory of new sandboxes in MiB (default: the daemon's).
    #[arg(long = "memory", env = "SANDBOX_MEMORY_MIB", value_name = "MIB")]
    memory_mib: Option<u32>,
    /// Network policy preset for new sandboxes (used once the daemon enforces network policy).
    #[arg(long, env = "SANDBOX_NETWORK", value_name = "PRESET")]
    network: Option<String>,
    /// Give new sandboxes this stored secret (`tryboxi secret set`) as `NAME=<placeholder>`;
    /// repeatable (env: comma-separated). The model cannot add or change them.
    #[arg(
        long = "secret",
        env = "SANDBOX_SECRETS",
        value_name = "NAME",
        value_delimiter = ','
    )]
    secrets: Vec<String>,
    /// Do not let the agent change host files: no `apply`, `pull` or `undo` tools.
    #[arg(long, env = "SANDBOX_NO_APPLY")]
    no_apply: bool,
    /// Default timeout of `exec` in seconds when the agent gives none.
    #[arg(long, env = "SANDBOX_EXEC_TIMEOUT", value_name = "SECS")]
    exec_timeout: Option<f64>,
}

impl FixedArgs {
    /// As command-line flags, for a harness config.
    fn to_flags(&self) -> Vec<String> {
        let mut f = Vec::new();
        let mut opt = |name: &str, v: Option<String>| {
            if let Some(v) = v {
                f.push(format!("--{name}"));
                f.push(v);
            }
        };
        opt("template", self.template.clone());
        opt("vcpus", self.vcpus.map(|v| v.to_string()));
        opt("memory", self.memory_mib.map(|v| v.to_string()));
        opt("network", self.network.clone());
        opt("exec-timeout", self.exec_timeout.map(|v| v.to_string()));
        for s in &self.secrets {
            f.push("--secret".into());
            f.push(s.clone());
        }
        if self.no_apply {
            f.push("--no-apply".into());
        }
        f
    }
}

#[derive(Debug, clap::Args)]
struct InstallArgs {
    /// Which agent harness.
    #[arg(value_enum)]
    harness: Harness,
    /// Install for this repo.
    #[arg(
        long,
        value_name = "PATH",
        required_unless_present = "global",
        conflicts_with = "global"
    )]
    project: Option<PathBuf>,
    /// Install for every project of this user.
    #[arg(long)]
    global: bool,
    /// Server settings written into the harness config. Env variables are not read here.
    #[command(flatten)]
    fixed: InstallFixed,
}

/// The same settings as [`FixedArgs`], without env fallbacks (the installing shell's env must
/// not leak into the config).
#[derive(Debug, clap::Args)]
struct InstallFixed {
    #[arg(long, value_name = "NAME")]
    template: Option<String>,
    #[arg(long, value_name = "N")]
    vcpus: Option<u32>,
    #[arg(long = "memory", value_name = "MIB")]
    memory_mib: Option<u32>,
    #[arg(long, value_name = "PRESET")]
    network: Option<String>,
    /// A stored secret new sandboxes get (repeatable).
    #[arg(long = "secret", value_name = "NAME")]
    secrets: Vec<String>,
    #[arg(long)]
    no_apply: bool,
    #[arg(long, value_name = "SECS")]
    exec_timeout: Option<f64>,
}

impl From<InstallFixed> for FixedArgs {
    fn from(i: InstallFixed) -> FixedArgs {
        FixedArgs {
            template: i.template,
            vcpus: i.vcpus,
            memory_mib: i.memory_mib,
            network: i.network,
            secrets: i.secrets,
            no_apply: i.no_apply,
            exec_timeout: i.exec_timeout,
        }
    }
}

pub fn run(a: Args) -> Result<(), TopError> {
    match a.command {
        Some(McpCommand::Install(i)) => run_install(i),
        None => serve(a.server),
    }
}

fn serve(a: ServerArgs) -> Result<(), TopError> {
    let paths = Paths::discover().map_err(|e| TopError::Usage(e.to_string()))?;
    let cwd = std::env::current_dir().map_err(|e| TopError::Other(e.into()))?;
    // A harness that does not expand `${workspaceFolder}` passes it literally: use the cwd.
    let workspace = match a
        .workspace
        .filter(|w| !w.trim().is_empty() && !w.contains("${"))
    {
        Some(w) => crate::mcp::workspace_path(std::path::Path::new(&w), &cwd),
        None => crate::mcp::workspace_path(&cwd, &cwd),
    };
    let mut opts = crate::mcp::Options::new(paths.socket(), workspace);
    for dir in a.allow_workspace {
        let abs = cwd.join(&dir);
        let resolved = abs
            .canonicalize()
            .map_err(|e| TopError::Usage(format!("--allow-workspace {}: {e}", dir.display())))?;
        if !resolved.is_dir() {
            return Err(TopError::Usage(format!(
                "--allow-workspace {}: not a directory",
                dir.display()
            )));
        }
        opts.allowed_workspaces.push(resolved);
    }
    opts.client_name = a.client;
    let f = a.fixed;
    if let Some(t) = f.template {
        opts.template = t;
    }
    opts.vcpus = f.vcpus;
    opts.memory_mib = f.memory_mib;
    opts.network = f.network;
    for s in &f.secrets {
        crate::secrets::store::check_name(s)
            .map_err(|e| TopError::Usage(format!("--secret: {e}")))?;
    }
    opts.secrets = f.secrets;
    opts.allow_apply = !f.no_apply;
    if let Some(t) = f.exec_timeout {
        if !(t.is_finite() && t > 0.0) {
            return Err(TopError::Usage(
                "--exec-timeout must be a positive number".into(),
            ));
        }
        opts.exec_timeout_s = t;
    }
    // Without colours: harnesses keep the server's stderr in their log files.
    super::init_logging(true);
    let rt = super::runtime()?;
    rt.block_on(crate::mcp::serve_stdio(opts))
        .map_err(|e| TopError::Other(e.into()))
}

fn run_install(i: InstallArgs) -> Result<(), TopError> {
    let scope = match i.project {
        Some(p) => Scope::Project(
            std::path::absolute(&p)
                .map_err(|e| TopError::Usage(format!("{}: {e}", p.display())))?,
        ),
        None => Scope::Global,
    };
    let exe = std::env::current_exe().map_err(|e| TopError::Other(e.into()))?;
    let fixed = FixedArgs::from(i.fixed);
    let cmd = ServerCommand::for_exe(&exe, fixed.to_flags());
    let env = Env::from_process().map_err(|e| TopError::Usage(e.to_string()))?;
    let r = install::install(i.harness, &scope, &cmd, &env).map_err(|e| match e {
        install::InstallError::NoProject(_) | install::InstallError::NoHome => {
            TopError::Usage(e.to_string())
        }
        e => TopError::Other(e.into()),
    })?;
    for p in &r.backups {
        println!("backup   {}", p.display());
    }
    for p in &r.written {
        println!("wrote    {}", p.display());
    }
    for p in &r.unchanged {
        println!("ok       {} (already up to date)", p.display());
    }
    for c in &r.ran {
        println!("ran      {c}");
    }
    if !r.to_run.is_empty() {
        println!("\n`claude` is not on your PATH; run this yourself:\n");
        for c in &r.to_run {
            println!("  {c}");
        }
        println!();
    }
    for n in &r.next {
        println!("next: {n}");
    }
    println!("The daemon must be running for the tools to work: `tryboxi serve`.");
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser as _;

    #[test]
    fn install_flags_become_server_args() {
        let cli = crate::cli::Cli::try_parse_from([
            "tryboxi",
            "mcp",
            "install",
            "codex",
            "--global",
            "--no-apply",
            "--memory",
            "2048",
            "--secret",
            "API_KEY",
            "--secret",
            "OTHER",
        ])
        .unwrap();
        let crate::cli::Command::Mcp(a) = cli.command else {
            panic!()
        };
        let Some(McpCommand::Install(i)) = a.command else {
            panic!()
        };
        assert!(i.global && i.project.is_none());
        let f = FixedArgs::from(i.fixed);
        assert_eq!(
            f.to_flags(),
            [
                "--memory",
                "2048",
                "--secret",
                "API_KEY",
                "--secret",
                "OTHER",
                "--no-apply"
            ]
        );
    }

    #[test]
    fn install_needs_exactly_one_scope() {
        for argv in [
            &["tryboxi", "mcp", "install", "cursor"][..],
            &[
                "tryboxi",
                "mcp",
                "install",
                "cursor",
                "--global",
                "--project",
                "/x",
            ][..],
        ] {
            assert!(crate::cli::Cli::try_parse_from(argv).is_err(), "{argv:?}");
        }
    }
}
