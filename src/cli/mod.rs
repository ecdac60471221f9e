//! The command line: argument parsing and one file per command. Talks to the daemon only
//! through `client`.

use std::process::ExitCode;

use clap::{Parser, Subcommand};

use crate::error::TopError;

#[derive(Debug, Parser)]
#[command(name = "tryboxi", version, about = "Disposable Linux microVMs on your own machine, for AI agents")]
pub struct Cli {
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Run the daemon (also: argv[0] `sandboxd`).
    Serve,
    /// Install guest images into the data root.
    Install,
    /// Create a sandbox for a workspace; prints its id first on the line.
    Create,
    /// Run a command in a sandbox.
    Exec,
    /// List sandboxes.
    Ls,
    /// Remove a sandbox.
    Rm,
    /// Show what changed inside a sandbox.
    Diff,
    /// Bring a sandbox's changes into the host repo (with a backup).
    Apply,
    /// Copy selected files from a sandbox (with a backup).
    Pull,
    /// Restore what an apply or pull changed.
    Undo,
    /// Follow the daemon's events.
    Events,
    /// Per-phase waterfall of a sandbox or exec.
    Trace,
    /// Check the host.
    Doctor,
    /// MCP stdio server (also: argv[0] `sandbox-mcp`).
    Mcp,
    /// Print the API token for TCP clients.
    Token,
    /// Print the version.
    Version,
}

pub fn run(argv0: &str) -> ExitCode {
    let _ = argv0;
    let cli = Cli::parse();
    let res: Result<(), TopError> = match cli.command {
        Command::Version => {
            println!("tryboxi {}", env!("CARGO_PKG_VERSION"));
            Ok(())
        }
        _ => Err(TopError::NotImplemented("this command")),
    };
    match res {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("tryboxi: {e}");
            e.exit_code()
        }
    }
}
