//! The guest agent: PID 1 inside every VM.
//!
//! Owns everything that runs in the guest: early boot ([`init`], [`modules`]), the virtio-serial channel
//! ([`port`]), child reaping ([`reaper`]), commands ([`exec`]), files ([`files`]), workspace
//! sync and walks ([`tree`], [`watch`], [`wsbase`]), the RPC server ([`server`]) and the static network
//! setup ([`net`]). It shares nothing with the host side but `crate::rpc`, has no network
//! access and loads nothing from the network.
//!
//! Outside a VM (argv[0] `init` but not PID 1) it serves one connection on stdin/stdout,
//! which is handy for poking at it by hand; tests use [`server::serve`] directly.

pub mod dirwatch;
pub mod exec;
pub mod files;
pub mod init;
pub mod modules;
pub mod net;
pub mod port;
pub mod progress;
pub mod reaper;
pub mod server;
pub mod tree;
pub mod users;
pub mod watch;
pub mod wsbase;

#[cfg(test)]
mod deadline_tests;
#[cfg(test)]
mod reconnect_tests;
#[cfg(test)]
mod tests;
#[cfg(test)]
mod user_tests;
#[cfg(test)]
mod vm_tests;
#[cfg(test)]
mod window_tests;

use exec::ExecConfig;
use reaper::ReapMode;
use server::{AGENT_VERSION, Agent, ServeEnd, ShutdownMode};
use std::process::ExitCode;
use std::time::Duration;

pub fn run() -> ExitCode {
    let pid1 = std::process::id() == 1;
    let _ = tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_ansi(false)
        .with_max_level(if pid1 {
            tracing::Level::WARN
        } else {
            tracing::Level::INFO
        })
        .try_init();
    if pid1 {
        pid1_main()
    }
    let rt = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("tryboxi agent: cannot start the async runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    rt.block_on(async {
        let cfg = ExecConfig {
            default_cwd: "/".into(),
            base_env: None,
            spawn_in_cwd: false,
        };
        let agent = match Agent::new(cfg, ReapMode::OwnOnly, ShutdownMode::Return) {
            Ok(a) => a,
            Err(e) => {
                eprintln!("tryboxi agent: {e}");
                return ExitCode::FAILURE;
            }
        };
        let io = tokio::io::join(tokio::io::stdin(), tokio::io::stdout());
        match server::serve(agent, io).await {
            Ok(_) => ExitCode::SUCCESS,
            Err(e) => {
                eprintln!("tryboxi agent: {e}");
                ExitCode::FAILURE
            }
        }
    })
}

fn fail(msg: &str) -> ! {
    init::console(&format!("TRYBOXI_AGENT_FAILED {msg}"));
    init::power_off()
}

fn pid1_main() -> ! {
    let cmd = match init::proc_and_cmdline() {
        Ok(c) => c,
        Err(e) => fail(&e.to_string()),
    };
    if cmd.probe {
        init::console("TRYBOXI_PROBE_OK");
        init::power_off();
    }
    // A packaged kernel's virtio, overlay and netfilter drivers are modules in the initramfs.
    let cmdline = std::fs::read_to_string("/proc/cmdline").unwrap_or_default();
    modules::load_all(&cmdline);
    if let Err(e) = init::boot(&cmd) {
        fail(&e.to_string());
    }
    let rt = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => fail(&format!("async runtime: {e}")),
    };
    let msg = rt.block_on(serve_port(cmd));
    fail(&msg)
}

/// Serves host connections on the virtio-serial port forever; returns only on a fatal error.
async fn serve_port(cmd: init::Cmdline) -> String {
    let cfg = ExecConfig {
        default_cwd: "/workspace".into(),
        base_env: Some(init::default_env()),
        spawn_in_cwd: true,
    };
    let agent = match Agent::new(cfg, ReapMode::All, ShutdownMode::PowerOff) {
        Ok(a) => a,
        Err(e) => return format!("agent: {e}"),
    };
    let t0 = std::time::Instant::now();
    let path = loop {
        if let Some(p) = port::find(&cmd.port) {
            break p;
        }
        if t0.elapsed() > Duration::from_secs(10) {
            return format!("no virtio-serial port named {:?}", cmd.port);
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    let fd = loop {
        match port::open(&path) {
            Ok(fd) => break std::sync::Arc::new(fd),
            Err(e)
                if e.raw_os_error() == Some(libc::EBUSY)
                    && t0.elapsed() < Duration::from_secs(10) =>
            {
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            Err(e) => return format!("open {}: {e}", path.display()),
        }
    };
    init::console(&format!("TRYBOXI_AGENT_READY {AGENT_VERSION}"));
    let mut hello = None;
    loop {
        if hello.is_none() {
            let f = fd.clone();
            if tokio::task::spawn_blocking(move || port::wait_for_host(&f))
                .await
                .is_err()
            {
                return "port watcher failed".into();
            }
        }
        let io = match port::stream(&fd) {
            Ok(io) => io,
            Err(e) => return format!("port stream: {e}"),
        };
        match server::serve_from(agent.clone(), io, hello.take()).await {
            Ok(ServeEnd::Eof) => tracing::info!("host disconnected; waiting for it to come back"),
            Ok(ServeEnd::Rehello(f)) => hello = Some(f),
            Ok(ServeEnd::Shutdown) => init::power_off(),
            Err(e) => tracing::warn!(error = %e, "connection ended"),
        }
    }
}
