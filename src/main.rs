//! `tryboxi`: one static binary with many faces.
//!
//! Dispatch only: by argv[0] (`sandboxd`, `sandboxctl`, `sandbox-mcp`, `init`) or by
//! subcommand. Every face returns a [`error::TopError`] that is mapped to an exit code here.

mod api;
mod cli;
mod client;
mod config;
mod daemon;
mod diskspace;
mod doctor;
mod e2b;
mod error;
mod guest;
mod ids;
mod install;
mod mcp;
mod network;
mod oom;
mod rpc;
mod safefs;
mod secrets;
mod service;
mod store;
mod telemetry;
mod vmm;
mod workspace;

use std::process::ExitCode;

fn main() -> ExitCode {
    let argv0 = std::env::args_os().next().unwrap_or_default();
    let name = std::path::Path::new(&argv0)
        .file_name()
        .map(|s| s.to_string_lossy().into_owned())
        .unwrap_or_default();
    // The guest agent: copied into the initramfs as /init, so it runs as PID 1.
    if name == "init" || std::process::id() == 1 {
        return guest::run();
    }
    cli::run(&name)
}
