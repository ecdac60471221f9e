//! `tryboxi`: disposable Linux microVMs on your own machine, for AI coding agents.
//!
//! The crate is one static binary with many faces (daemon, CLI, MCP server, guest agent; see
//! `src/main.rs`), and this library, whose public part is the **Rust client of the daemon**:
//!
//! - [`client`]: [`client::Client`] talks to a running `tryboxi serve` over its unix socket (or
//!   over TCP with `TRYBOXI_URL` + `TRYBOXI_TOKEN`, TLS pinned by certificate fingerprint off
//!   loopback). The CLI and the MCP server use it themselves.
//! - [`api`]: the typed requests and responses of the daemon's HTTP/JSON API, shared with the
//!   daemon (`api/openapi.yaml` is the same contract).
//!
//! ```no_run
//! # async fn demo() -> Result<(), tryboxi::client::ClientError> {
//! use futures_util::StreamExt as _;
//! use tryboxi::{api, client::Client};
//!
//! let client = Client::discover()?;
//! let workspace = api::WorkspaceSpec {
//!     host_path: "/home/me/app".into(),
//!     ..Default::default()
//! };
//! let create = api::CreateSandboxRequest {
//!     workspace: Some(workspace),
//!     ..Default::default()
//! };
//! let sbx = client.create(&create).await?;
//! let req = api::ExecRequest { cmd: Some("cargo test".into()), ..Default::default() };
//! let mut events = client.exec(&sbx.id, &req).await?.into_stream();
//! while let Some(ev) = events.next().await {
//!     match ev? {
//!         api::ExecEvent::Stdout { data, data_b64 } => {
//!             let bytes = api::ExecEvent::output_bytes(&data, &data_b64).unwrap_or_default();
//!             print!("{}", String::from_utf8_lossy(&bytes));
//!         }
//!         api::ExecEvent::Exit { exit_code, .. } => println!("exit {exit_code:?}"),
//!         _ => {}
//!     }
//! }
//! client.remove(&sbx.id).await?;
//! # Ok(()) }
//! ```
//!
//! Everything else (the daemon, the VMM driver, the guest agent) is internal: it is reached
//! through [`run`], which `main` calls.

mod accounts;
pub mod api;
mod cli;
pub mod client;
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

/// The fuzz checks whose code needs the whole crate (the `http_router` target links the
/// library: the router reads the API types, ids and the service's query types). Only with
/// `--cfg fuzzing`, which cargo-fuzz sets; never in a normal build.
#[cfg(fuzzing)]
#[doc(hidden)]
pub mod fuzzing {
    pub use crate::daemon::router_fuzzing::http_router;
    pub use crate::e2b::upload::fuzzing::multipart as e2b_multipart;
}

use std::process::ExitCode;

/// The binary's entry point: by argv[0] (`sandboxd`, `sandboxctl`, `sandbox-mcp`, `init`) or
/// by subcommand. Every face returns an `error::TopError`, mapped to an exit code.
#[doc(hidden)]
pub fn run() -> ExitCode {
    let argv0 = std::env::args_os().next().unwrap_or_default();
    let name = std::path::Path::new(&argv0)
        .file_name()
        .map(|s| s.to_string_lossy().into_owned())
        .unwrap_or_default();
    // The guest agent: copied into the initramfs as /init, so it runs as PID 1.
    if name == "init" || std::process::id() == 1 {
        return guest::run();
    }
    // The daemon's helper that answers one QEMU's trapped discards, outliving the daemon.
    if name == vmm::DISCARD_KEEPER {
        return vmm::discard_keeper();
    }
    cli::run(&name)
}
