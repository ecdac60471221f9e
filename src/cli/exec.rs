//! `tryboxi exec [OPTIONS] ID -- CMD...`: stdout to stdout, stderr to stderr, as they come;
//! exits with the command's exit code (128+N for signal N, 124 on timeout). With `-d` it
//! prints the exec id and returns, the command running on (`tryboxi attach`, `execs`, `kill`).
//! With `-i` standard input is streamed to the command as it comes; `-it` is an interactive
//! terminal session (`cli/interactive.rs`, as `tryboxi shell`).

use std::io::Read as _;

use crate::api;
use crate::error::TopError;

#[derive(Debug, clap::Args)]
pub struct Args {
    /// Kill the command (its whole process group) after this many seconds.
    #[arg(long, value_name = "SECS")]
    timeout: Option<f64>,
    /// Working directory inside the VM (default /workspace).
    #[arg(long)]
    cwd: Option<String>,
    /// Extra environment variables.
    #[arg(short = 'e', long = "env", value_name = "KEY=VALUE")]
    env: Vec<String>,
    /// Send this process's standard input to the command.
    #[arg(long)]
    stdin: bool,
    /// Run CMD as one shell string (`/bin/sh -c`) instead of an argv.
    #[arg(short = 'c', long = "shell")]
    shell: bool,
    /// The sync before the command leaves paths matching this `sync.exclude` pattern alone
    /// (not sent, not deleted in the VM). Repeatable.
    #[arg(long = "sync-exclude", value_name = "PATTERN")]
    sync_exclude: Vec<String>,
    /// Detach: print the exec id and return; the command keeps running.
    #[arg(short = 'd', long)]
    detach: bool,
    /// Run under a pseudo-terminal of this terminal's size (80x24 when not a terminal).
    /// Alone, input is not forwarded; with `-i` the local terminal goes into raw mode
    /// (Ctrl-C goes to the command, Ctrl-P Ctrl-Q detaches).
    #[arg(short = 't', long)]
    tty: bool,
    /// Keep standard input open and send it to the command as it is typed or read.
    #[arg(short = 'i', long, conflicts_with_all = ["stdin", "detach"])]
    interactive: bool,
    /// Run as this guest user (e.g. `user`; default root).
    #[arg(short = 'u', long)]
    user: Option<String>,
    /// A label listed with the exec (`tryboxi execs`).
    #[arg(long)]
    tag: Option<String>,
    /// Sandbox id.
    id: String,
    /// The command and its arguments (after `--`).
    #[arg(last = true, required = true)]
    cmd: Vec<String>,
}

pub async fn run(a: Args) -> Result<(), TopError> {
    let mut req = api::ExecRequest {
        timeout_s: a.timeout,
        cwd: a.cwd,
        sync_exclude: a.sync_exclude,
        detach: a.detach,
        user: a.user,
        tag: a.tag,
        pty: a.tty.then(terminal_size),
        env: terminal_env(a.tty && a.interactive),
        ..Default::default()
    };
    if a.shell {
        req.cmd = Some(a.cmd.join(" "));
    } else {
        req.argv = Some(a.cmd);
    }
    for kv in a.env {
        let (k, v) = kv
            .split_once('=')
            .ok_or_else(|| TopError::Usage(format!("--env wants KEY=VALUE, got `{kv}`")))?;
        req.env.insert(k.to_owned(), v.to_owned());
    }
    if a.stdin {
        let mut buf = Vec::new();
        std::io::stdin()
            .read_to_end(&mut buf)
            .map_err(|e| TopError::Other(e.into()))?;
        req.stdin_b64 = Some(api::b64::encode(&buf));
    }
    if a.interactive {
        return super::interactive::run(&a.id, req).await;
    }
    let mut events = super::client()?.exec(&a.id, &req).await?;
    if a.detach {
        return match events.next().await? {
            Some(api::ExecEvent::Started { exec_id, .. }) => {
                println!("{exec_id}");
                Ok(())
            }
            Some(api::ExecEvent::Error { code, message }) => Err(TopError::Api { code, message }),
            _ => Err(TopError::Other(anyhow::anyhow!(
                "the exec stream did not start with `started`"
            ))),
        };
    }
    follow(events).await
}

/// Write a command's events to stdout/stderr; its exit status becomes ours.
pub async fn follow(mut events: crate::client::ExecEvents) -> Result<(), TopError> {
    let mut out = std::io::stdout().lock();
    let mut err = std::io::stderr().lock();
    while let Some(ev) = events.next().await? {
        match ev {
            api::ExecEvent::Started { .. } => {}
            api::ExecEvent::Stdout { data, data_b64 } => copy(&mut out, &data, &data_b64)?,
            api::ExecEvent::Stderr { data, data_b64 } => copy(&mut err, &data, &data_b64)?,
            api::ExecEvent::Exit {
                exit_code,
                signal,
                timed_out,
                ..
            } => return exit_status(exit_code, signal, timed_out),
            api::ExecEvent::Error { code, message } => return Err(TopError::Api { code, message }),
        }
    }
    Err(TopError::Other(anyhow::anyhow!(
        "the exec stream ended without an exit status"
    )))
}

/// A command's end as our exit status: its code, 128+N for signal N, 124 for a timeout.
pub fn exit_status(
    exit_code: Option<i32>,
    signal: Option<i32>,
    timed_out: bool,
) -> Result<(), TopError> {
    if timed_out {
        eprintln!("tryboxi: command timed out and was killed");
        return Err(TopError::ExitStatus(124));
    }
    match (exit_code, signal) {
        (Some(0), _) => Ok(()),
        (Some(c), _) => Err(TopError::ExitStatus(c.clamp(1, 255) as u8)),
        (None, Some(s)) => Err(TopError::ExitStatus((128 + s).clamp(1, 255) as u8)),
        (None, None) => Err(TopError::ExitStatus(1)),
    }
}

/// Write one output chunk to `w` at once (the user sees output as it comes).
pub fn copy(
    w: &mut impl std::io::Write,
    data: &Option<String>,
    data_b64: &Option<String>,
) -> Result<(), TopError> {
    let b = api::ExecEvent::output_bytes(data, data_b64)
        .map_err(|m| TopError::Other(anyhow::anyhow!(m)))?;
    w.write_all(&b)
        .and_then(|_| w.flush())
        .map_err(|e| TopError::Other(e.into()))
}

/// The size of the terminal on stdout (or stdin), else 24x80.
fn terminal_size() -> api::PtySize {
    super::interactive::local_size().unwrap_or(api::PtySize { rows: 24, cols: 80 })
}

/// `TERM` for an interactive terminal session: the local one's, else `xterm-256color`.
pub fn terminal_env(interactive_tty: bool) -> std::collections::BTreeMap<String, String> {
    let mut env = std::collections::BTreeMap::new();
    if interactive_tty {
        let term = std::env::var("TERM")
            .ok()
            .filter(|t| !t.is_empty() && t.len() < 64 && t != "dumb")
            .unwrap_or_else(|| "xterm-256color".into());
        env.insert("TERM".into(), term);
    }
    env
}
