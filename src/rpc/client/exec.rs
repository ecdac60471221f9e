//! Running commands: [`ExecRequest`] in, [`ExecStream`] out ([`AgentClient::exec`],
//! [`AgentClient::resume`]). Consuming an event acknowledges it (the guest spools output until
//! then); stdin is `Data` under the stream's credit, closed by `DataEnd`.

use super::streams::OpenStream;
use super::{AgentClient, unexpected};
use crate::rpc::RpcError;
use crate::rpc::msg::{Body, ExecSpec, PtySize, Reply, Request, WireExecEvent};
use std::time::Duration;

/// What to run. `argv` is used unless `shell` is set (then `/bin/sh -c <shell>`).
#[derive(Debug, Clone, Default)]
pub struct ExecRequest {
    pub argv: Vec<String>,
    pub shell: Option<String>,
    pub env: Vec<(String, String)>,
    /// Default `/workspace`.
    pub cwd: Option<String>,
    /// Written to stdin right after the start.
    pub stdin: Option<Vec<u8>>,
    /// Leave stdin open after `stdin` for [`ExecStream::write_stdin`]; by default it is closed so
    /// a command that reads stdin sees EOF instead of hanging.
    pub keep_stdin_open: bool,
    /// Kill the whole process group after this long (the exit then says `timed_out`).
    pub timeout: Option<Duration>,
    pub pty: Option<PtySize>,
    /// Run as this guest user (see [`ExecSpec::user`]).
    pub user: Option<String>,
}

/// One event of a running command, in order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ExecEvent {
    Started {
        pid: u32,
    },
    Stdout(Vec<u8>),
    Stderr(Vec<u8>),
    Exit {
        code: Option<i32>,
        signal: Option<i32>,
        timed_out: bool,
    },
}

impl AgentClient {
    /// Starts a command; resolves once the guest has spawned it (or failed to).
    /// The returned stream yields `Started` first.
    pub async fn exec(&self, req: ExecRequest) -> Result<ExecStream, RpcError> {
        if req.argv.is_empty() && req.shell.is_none() {
            return Err(RpcError::Invalid(
                "exec needs argv or a shell string".into(),
            ));
        }
        let spec = ExecSpec {
            argv: req.argv,
            shell: req.shell,
            env: req.env,
            cwd: req.cwd,
            timeout_ms: req
                .timeout
                .map(|d| d.as_millis().min(u64::MAX as u128) as u64),
            pty: req.pty,
            user: req.user,
        };
        let mut s = self.open(false)?;
        s.send(Body::Request(Request::Exec(spec)))?;
        // The agent answers `Started` as soon as it has spawned the command: never wait
        // forever for it (a wedged agent must fail the exec, not hang its caller).
        let first = s.recv_within("exec").await?;
        let (exec_id, pid, cost) = match first {
            Body::Exec {
                seq: 1,
                event: ref ev @ WireExecEvent::Started { exec_id, pid },
            } => (exec_id, pid, ev.cost()),
            Body::Error(e) => return Err(RpcError::Remote(e)),
            other => return Err(unexpected(&other)),
        };
        s.ack(1, cost)?;
        let stream = ExecStream {
            s,
            exec_id,
            pid: Some(pid),
            next_seq: 2,
            pending: Some(ExecEvent::Started { pid }),
            done: false,
        };
        if let Some(bytes) = &req.stdin {
            stream.write_stdin(bytes).await?;
        }
        if !req.keep_stdin_open {
            stream.close_stdin().await?;
        }
        Ok(stream)
    }

    /// Re-attaches to an exec started on an earlier connection and replays its events from
    /// `from_seq` (normally [`ExecStream::next_seq`] of the stream that was cut off).
    pub async fn resume(&self, exec_id: u64, from_seq: u64) -> Result<ExecStream, RpcError> {
        let mut s = self.open(false)?;
        s.send(Body::Request(Request::Resume { exec_id, from_seq }))?;
        match s.recv_within("resume").await? {
            Body::Reply(Reply::Resumed) => {}
            Body::Error(e) => return Err(RpcError::Remote(e)),
            other => return Err(unexpected(&other)),
        }
        Ok(ExecStream {
            s,
            exec_id,
            pid: None,
            next_seq: from_seq,
            pending: None,
            done: false,
        })
    }
}

/// A running command. Events arrive in order; consuming one acknowledges it so the guest can
/// drop it from its spool. Keep [`exec_id`](Self::exec_id) and [`next_seq`](Self::next_seq) to
/// [`AgentClient::resume`] after a reconnect.
pub struct ExecStream {
    s: OpenStream,
    exec_id: u64,
    pid: Option<u32>,
    next_seq: u64,
    pending: Option<ExecEvent>,
    done: bool,
}

impl std::fmt::Debug for ExecStream {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ExecStream")
            .field("exec_id", &self.exec_id)
            .field("next_seq", &self.next_seq)
            .finish_non_exhaustive()
    }
}

impl ExecStream {
    /// The guest's id for this exec (stable across reconnects).
    pub fn exec_id(&self) -> u64 {
        self.exec_id
    }

    /// The guest pid of the command (unknown on a resumed stream until... never: it was in
    /// the `Started` event the earlier stream delivered).
    pub fn pid(&self) -> Option<u32> {
        self.pid
    }

    /// Sequence number of the next event this stream expects; pass it to `resume`.
    pub fn next_seq(&self) -> u64 {
        self.next_seq
    }

    /// The next event; `None` after `Exit` (or after an error was returned once).
    pub async fn next(&mut self) -> Option<Result<ExecEvent, RpcError>> {
        if let Some(ev) = self.pending.take() {
            return Some(Ok(ev));
        }
        loop {
            if self.done {
                return None;
            }
            let body = match self.s.recv().await {
                Ok(b) => b,
                Err(e) => {
                    self.done = true;
                    return Some(Err(e));
                }
            };
            match body {
                Body::Exec { seq, event } => {
                    // Acknowledge even duplicates so the guest's window moves on.
                    let _ = self.s.ack(seq, event.cost());
                    if seq < self.next_seq {
                        continue;
                    }
                    if seq != self.next_seq {
                        self.done = true;
                        return Some(Err(RpcError::Protocol(format!(
                            "exec {} skipped from seq {} to {seq}",
                            self.exec_id, self.next_seq
                        ))));
                    }
                    self.next_seq = seq + 1;
                    let ev = match event {
                        WireExecEvent::Started { pid, .. } => {
                            self.pid = Some(pid);
                            ExecEvent::Started { pid }
                        }
                        WireExecEvent::Stdout(b) => ExecEvent::Stdout(b),
                        WireExecEvent::Stderr(b) => ExecEvent::Stderr(b),
                        WireExecEvent::Exit {
                            code,
                            signal,
                            timed_out,
                        } => {
                            self.done = true;
                            ExecEvent::Exit {
                                code,
                                signal,
                                timed_out,
                            }
                        }
                    };
                    return Some(Ok(ev));
                }
                Body::Error(e) => {
                    self.done = true;
                    return Some(Err(RpcError::Remote(e)));
                }
                other => {
                    self.done = true;
                    return Some(Err(unexpected(&other)));
                }
            }
        }
    }

    /// Sends a signal to the command's whole process group.
    pub async fn kill(&self, sig: i32) -> Result<(), RpcError> {
        self.s.send_control(Body::Kill(sig))
    }

    /// Resizes the pty (no-op for a non-pty exec).
    #[cfg(test)]
    pub async fn resize(&self, rows: u16, cols: u16) -> Result<(), RpcError> {
        self.s.send(Body::Resize { rows, cols })
    }

    /// Writes to the command's stdin, waiting for flow-control credit (without a deadline: the
    /// command may not read its stdin for as long as it runs).
    pub async fn write_stdin(&self, data: &[u8]) -> Result<(), RpcError> {
        self.s
            .handle
            .shared
            .send_data(self.s.id, &self.s.credit, data, None)
            .await
    }

    /// Closes the command's stdin (EOF).
    pub async fn close_stdin(&self) -> Result<(), RpcError> {
        self.s.send(Body::DataEnd)
    }

    /// A handle that writes stdin, signals and resizes from another task while this stream's
    /// owner reads events. Frames sent after the stream is dropped go nowhere.
    pub fn control(&self) -> ExecControl {
        ExecControl {
            shared: self.s.handle.shared.clone(),
            id: self.s.id,
            credit: self.s.credit.clone(),
        }
    }
}

/// Stdin, signals and resizes of one running exec, usable beside its [`ExecStream`].
#[derive(Clone)]
pub struct ExecControl {
    shared: std::sync::Arc<super::streams::Shared>,
    id: u32,
    credit: std::sync::Arc<tokio::sync::Semaphore>,
}

impl std::fmt::Debug for ExecControl {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ExecControl")
            .field("stream", &self.id)
            .finish()
    }
}

impl ExecControl {
    fn frame(&self, body: Body, control: bool) -> Result<(), RpcError> {
        let shared = &self.shared;
        let frame = crate::rpc::msg::Frame {
            stream: self.id,
            body,
        };
        let sent = if control {
            shared.outbox.send_control(frame)
        } else {
            shared.outbox.send(frame)
        };
        sent.map_err(|_| shared.gone())
    }

    /// See [`ExecStream::write_stdin`].
    pub async fn write_stdin(&self, data: &[u8]) -> Result<(), RpcError> {
        self.shared
            .send_data(self.id, &self.credit, data, None)
            .await
    }

    /// See [`ExecStream::close_stdin`].
    pub fn close_stdin(&self) -> Result<(), RpcError> {
        self.frame(Body::DataEnd, false)
    }

    /// See [`ExecStream::kill`].
    pub fn kill(&self, sig: i32) -> Result<(), RpcError> {
        self.frame(Body::Kill(sig), true)
    }

    /// See [`ExecStream::resize`].
    pub fn resize(&self, rows: u16, cols: u16) -> Result<(), RpcError> {
        self.frame(Body::Resize { rows, cols }, false)
    }
}
