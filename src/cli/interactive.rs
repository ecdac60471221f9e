//! Interactive execs: `tryboxi shell ID`, `tryboxi exec -it ID -- CMD` and `tryboxi attach`
//! of a pty exec. Owns the local terminal while a session runs: raw mode (restored on every
//! way out), keystrokes forwarded as they come (`POST /v1/execs/{id}/stdin`, so Ctrl-C reaches
//! the guest's terminal as a byte and its line discipline signals the foreground job), window
//! size changes (SIGWINCH -> `POST /v1/execs/{id}/resize`) and the detach keys (Ctrl-P Ctrl-Q,
//! as in Docker): the command runs on, `tryboxi attach EXEC_ID` comes back to it.
//!
//! When standard input is not a terminal the same session runs without raw mode (input is
//! forwarded as it is read, and its end closes the command's standard input), so scripts and
//! tests can drive it.

use std::io::{IsTerminal as _, Read as _, Write as _};
use std::os::fd::AsFd as _;

use hyper::Method;
use nix::sys::termios::{self, SetArg, Termios};
use tokio::signal::unix::{SignalKind, signal};
use tokio::sync::mpsc;

use crate::api;
use crate::client::{Client, ExecEvents};
use crate::error::TopError;

/// Ctrl-P: the first detach key.
const DETACH_1: u8 = 0x10;
/// Ctrl-Q: the second detach key.
const DETACH_2: u8 = 0x11;
/// Input sent in one request at most (the daemon takes up to `api::MAX_STDIN_INPUT`).
const INPUT_BATCH: usize = 64 * 1024;

/// How a session ended when the command did not.
#[derive(Debug, PartialEq, Eq)]
enum Input {
    /// Bytes for the command.
    Bytes(Vec<u8>),
    /// Standard input ended (not a terminal): close the command's stdin.
    Eof,
    /// The detach keys were typed.
    Detach,
}

/// Finds the detach keys in a stream of input chunks (they may arrive split).
#[derive(Debug, Default)]
struct DetachScanner {
    /// A Ctrl-P was the last byte seen; held back until the next byte tells what it is.
    held: bool,
}

impl DetachScanner {
    /// The bytes to forward from `chunk`, and whether the detach keys were completed.
    fn feed(&mut self, chunk: &[u8]) -> (Vec<u8>, bool) {
        let mut out = Vec::with_capacity(chunk.len() + 1);
        for &b in chunk {
            if self.held {
                self.held = false;
                if b == DETACH_2 {
                    return (out, true);
                }
                out.push(DETACH_1);
            }
            if b == DETACH_1 {
                self.held = true;
            } else {
                out.push(b);
            }
        }
        (out, false)
    }
}

/// The local terminal in raw mode until dropped.
struct RawMode {
    saved: Termios,
}

impl RawMode {
    /// Raw mode on standard input when it is a terminal; `None` otherwise.
    fn enter() -> Result<Option<RawMode>, TopError> {
        let stdin = std::io::stdin();
        if !stdin.is_terminal() {
            return Ok(None);
        }
        let saved = termios::tcgetattr(stdin.as_fd()).map_err(os_err)?;
        let mut raw = saved.clone();
        termios::cfmakeraw(&mut raw);
        termios::tcsetattr(stdin.as_fd(), SetArg::TCSANOW, &raw).map_err(os_err)?;
        Ok(Some(RawMode { saved }))
    }
}

impl Drop for RawMode {
    fn drop(&mut self) {
        let _ = termios::tcsetattr(std::io::stdin().as_fd(), SetArg::TCSANOW, &self.saved);
    }
}

fn os_err(e: nix::Error) -> TopError {
    TopError::Other(anyhow::anyhow!("terminal: {e}"))
}

/// Read standard input on a thread of its own (it blocks) and hand the chunks on.
fn read_input(tx: mpsc::Sender<Input>) {
    std::thread::spawn(move || {
        let mut scanner = DetachScanner::default();
        let mut buf = vec![0u8; 16 * 1024];
        let mut stdin = std::io::stdin().lock();
        loop {
            match stdin.read(&mut buf) {
                Ok(0) | Err(_) => {
                    let _ = tx.blocking_send(Input::Eof);
                    return;
                }
                Ok(n) => {
                    let (bytes, detach) = scanner.feed(&buf[..n]);
                    if !bytes.is_empty() && tx.blocking_send(Input::Bytes(bytes)).is_err() {
                        return;
                    }
                    if detach {
                        let _ = tx.blocking_send(Input::Detach);
                        return;
                    }
                }
            }
        }
    });
}

/// The size of the local terminal, if there is one.
pub fn local_size() -> Option<api::PtySize> {
    for fd in [libc::STDOUT_FILENO, libc::STDIN_FILENO] {
        let mut ws = libc::winsize {
            ws_row: 0,
            ws_col: 0,
            ws_xpixel: 0,
            ws_ypixel: 0,
        };
        // SAFETY: TIOCGWINSZ writes one `winsize` into the struct we own.
        let r = unsafe { libc::ioctl(fd, libc::TIOCGWINSZ, &mut ws) };
        if r == 0 && ws.ws_row > 0 && ws.ws_col > 0 {
            let side = |n: u16| n.min(api::MAX_PTY_SIDE);
            return Some(api::PtySize {
                rows: side(ws.ws_row),
                cols: side(ws.ws_col),
            });
        }
    }
    None
}

async fn post<B: serde::Serialize>(
    client: &Client,
    exec_id: &str,
    what: &str,
    body: &B,
) -> Result<(), TopError> {
    let _: api::ExecInfo = client
        .send(
            Method::POST,
            &format!("/v1/execs/{exec_id}/{what}"),
            Some(body),
        )
        .await?;
    Ok(())
}

/// Forward input chunks in order, batching what has piled up; tell the session about detach.
async fn forward_input(
    client: Client,
    exec_id: String,
    mut rx: mpsc::Receiver<Input>,
    detached: tokio::sync::oneshot::Sender<()>,
) -> Result<(), TopError> {
    while let Some(first) = rx.recv().await {
        let mut bytes = Vec::new();
        let mut next = Some(first);
        let mut end = None;
        while let Some(input) = next.take() {
            match input {
                Input::Bytes(b) => bytes.extend_from_slice(&b),
                other => {
                    end = Some(other);
                    break;
                }
            }
            if bytes.len() < INPUT_BATCH {
                next = rx.try_recv().ok();
            }
        }
        if !bytes.is_empty() {
            let req = api::ExecStdinRequest {
                data_b64: Some(api::b64::encode(&bytes)),
                ..Default::default()
            };
            post(&client, &exec_id, "stdin", &req).await?;
        }
        match end {
            Some(Input::Eof) => {
                let req = api::ExecStdinRequest {
                    close: true,
                    ..Default::default()
                };
                // The command may have ended (and its stdin with it) already.
                let _ = post(&client, &exec_id, "stdin", &req).await;
                return Ok(());
            }
            Some(Input::Detach) => {
                let _ = detached.send(());
                return Ok(());
            }
            _ => {}
        }
    }
    Ok(())
}

/// Run the session: output to stdout as it comes, input and resizes to the exec, until the
/// command ends (its exit status becomes ours) or the detach keys are typed.
pub async fn session(
    client: Client,
    exec_id: String,
    pty: bool,
    mut events: ExecEvents,
) -> Result<(), TopError> {
    let raw = if pty { RawMode::enter()? } else { None };
    let (tx, rx) = mpsc::channel(64);
    read_input(tx);
    let (detach_tx, mut detach_rx) = tokio::sync::oneshot::channel();
    let mut input = tokio::spawn(forward_input(
        client.clone(),
        exec_id.clone(),
        rx,
        detach_tx,
    ));
    let mut winch = signal(SignalKind::window_change()).map_err(|e| TopError::Other(e.into()))?;
    let mut hangup = signal(SignalKind::hangup()).map_err(|e| TopError::Other(e.into()))?;
    if pty && let Some(size) = local_size() {
        // An attach from a terminal of another size: the command sees this one's.
        post(&client, &exec_id, "resize", &size).await?;
    }
    let mut input_done = false;
    let mut detach_gone = false;
    let mut out = std::io::stdout();
    let mut err = std::io::stderr();
    let result = loop {
        tokio::select! {
            ev = events.next() => {
                let ev = match ev? {
                    Some(ev) => ev,
                    None => break Err(TopError::Other(anyhow::anyhow!(
                        "the exec stream ended without an exit status"))),
                };
                match ev {
                    api::ExecEvent::Started { .. } => {}
                    api::ExecEvent::Stdout { data, data_b64 } => {
                        super::exec::copy(&mut out, &data, &data_b64)?
                    }
                    api::ExecEvent::Stderr { data, data_b64 } => {
                        super::exec::copy(&mut err, &data, &data_b64)?
                    }
                    api::ExecEvent::Exit { exit_code, signal, timed_out, .. } => {
                        break super::exec::exit_status(exit_code, signal, timed_out);
                    }
                    api::ExecEvent::Error { code, message } => {
                        break Err(TopError::Api { code, message });
                    }
                }
            }
            r = &mut detach_rx, if !detach_gone => {
                if r.is_err() {
                    // The input side ended without a detach (end of input).
                    detach_gone = true;
                    continue;
                }
                drop(raw);
                let _ = writeln!(err, "\ntryboxi: detached; the command runs on \
                    (`tryboxi attach {exec_id}` to come back, `tryboxi kill {exec_id}` to stop it)");
                return Ok(());
            }
            r = &mut input, if !input_done => {
                input_done = true;
                match r {
                    Ok(Ok(())) => {}
                    Ok(Err(e)) => break Err(e),
                    Err(e) => break Err(TopError::Other(e.into())),
                }
            }
            _ = winch.recv() => {
                if pty && let Some(size) = local_size() {
                    post(&client, &exec_id, "resize", &size).await?;
                }
            }
            _ = hangup.recv() => {
                // The local terminal went away: the command's terminal hangs up too.
                let sig = api::ExecSignalRequest { signal: api::SignalSpec::Number(libc::SIGHUP) };
                let _ = post(&client, &exec_id, "signal", &sig).await;
                break Err(TopError::ExitStatus(128 + libc::SIGHUP as u8));
            }
        }
    };
    input.abort();
    drop(raw);
    result
}

/// Start `req` (made interactive: stdin kept open; with a pty also detached, so the detach
/// keys leave it running) and run the session on it.
pub async fn run(id: &str, mut req: api::ExecRequest) -> Result<(), TopError> {
    req.stdin_open = true;
    let pty = req.pty.is_some();
    req.detach = pty;
    let client = super::client()?;
    let mut events = client.exec(id, &req).await?;
    let exec_id = match events.next().await? {
        Some(api::ExecEvent::Started { exec_id, .. }) => exec_id,
        Some(api::ExecEvent::Error { code, message }) => {
            return Err(TopError::Api { code, message });
        }
        _ => {
            return Err(TopError::Other(anyhow::anyhow!(
                "the exec stream did not start with `started`"
            )));
        }
    };
    session(client, exec_id, pty, events).await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn detach_keys_are_found_across_chunks_and_lone_ctrl_p_passes() {
        let mut s = DetachScanner::default();
        assert_eq!(s.feed(b"ls\r"), (b"ls\r".to_vec(), false));
        // Ctrl-P at a chunk's end is held back, then let through with what follows.
        assert_eq!(s.feed(b"a\x10"), (b"a".to_vec(), false));
        assert_eq!(s.feed(b"x"), (b"\x10x".to_vec(), false));
        // Split across two chunks.
        assert_eq!(s.feed(b"\x10"), (Vec::new(), false));
        assert_eq!(s.feed(b"\x11rest"), (Vec::new(), true));
        // In one chunk, with input before it.
        let mut s = DetachScanner::default();
        assert_eq!(s.feed(b"echo\x10\x11"), (b"echo".to_vec(), true));
        // Ctrl-P twice then Ctrl-Q: the first one is input.
        let mut s = DetachScanner::default();
        assert_eq!(s.feed(b"\x10\x10\x11"), (b"\x10".to_vec(), true));
        // Ctrl-C and Ctrl-D are plain input.
        let mut s = DetachScanner::default();
        assert_eq!(s.feed(b"\x03\x04"), (b"\x03\x04".to_vec(), false));
    }
}
