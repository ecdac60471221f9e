//! Live execs: every running command (detached or not) by id, with its guest pid, request
//! and control handle; attach (replay from the capped log, then live events), later stdin,
//! signals and pty resizes.
//!
//! One task per exec owns its `ExecStream` (`service/exec.rs`) and publishes each event here
//! through a broadcast channel: publishing never waits, so a slow subscriber never holds the
//! owner back; a subscriber that falls [`SUBSCRIBER_BACKLOG`] events behind is cut off with a
//! `lagged` error event (it can attach again with replay). The owner writes the output log
//! and publishes under one lock, so an attach sees each byte exactly once: in the replay
//! (the log up to the moment it subscribed) or live. The record leaves this registry when the
//! command ends; its store record (`EXECS`) and logs stay.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use tokio::sync::{broadcast, mpsc};
use zeroize::Zeroizing;

use super::exec::ExecRecord;
use super::vms::LiveVm;
use super::{Service, ServiceError};
use crate::api;
use crate::api::SandboxState;
use crate::rpc::{ExecControl, ExecStream};
use crate::store::EXECS;
use crate::telemetry::logs::{self, ExecLog, Stream};

/// Live execs per sandbox; one more is refused with 409.
pub const MAX_LIVE_PER_SANDBOX: usize = 64;
/// Events a subscriber may fall behind before it is cut off.
pub const SUBSCRIBER_BACKLOG: usize = 1024;
/// How long a broken agent link under an unchanged, ready VM is given before the exec is lost.
const LINK_GRACE: Duration = Duration::from_secs(5);
/// How often a paused exec's owner checks for its sandbox's resume.
const REATTACH_POLL: Duration = Duration::from_millis(250);
/// Replayed output is sent in events of at most this many bytes.
const REPLAY_CHUNK: usize = 64 * 1024;

/// One running exec.
pub struct LiveExec {
    pub info: api::ExecInfo,
    /// Stdin, signals, resizes (`None` only in unit tests, which have no VM; replaced when
    /// the owner re-attaches after a pause).
    control: Mutex<Option<ExecControl>>,
    hub: Mutex<Hub>,
    stdin: tokio::sync::Mutex<StdinState>,
    /// The output log the owner writes (`None`: no replay).
    log: Option<Arc<ExecLog>>,
}

struct Hub {
    tx: broadcast::Sender<api::ExecEvent>,
    /// The last event (`exit` or `error`) once the command ended.
    end: Option<api::ExecEvent>,
}

struct StdinState {
    open: bool,
    /// The end of the input so far, for the secret scan of a value split across inputs.
    carry: Zeroizing<Vec<u8>>,
}

impl LiveExec {
    pub fn new(
        info: api::ExecInfo,
        control: Option<ExecControl>,
        stdin_open: bool,
        stdin_so_far: &[u8],
        log: Option<Arc<ExecLog>>,
    ) -> Arc<LiveExec> {
        let (tx, _) = broadcast::channel(SUBSCRIBER_BACKLOG);
        Arc::new(LiveExec {
            info,
            control: Mutex::new(control),
            hub: Mutex::new(Hub { tx, end: None }),
            stdin: tokio::sync::Mutex::new(StdinState {
                open: stdin_open,
                carry: Zeroizing::new(stdin_so_far.to_vec()),
            }),
            log,
        })
    }

    fn hub(&self) -> std::sync::MutexGuard<'_, Hub> {
        self.hub.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Publish one event; `write` (the log write) runs under the same lock as the send.
    pub fn publish(&self, ev: api::ExecEvent, write: impl FnOnce()) {
        let hub = self.hub();
        write();
        // No subscriber is fine: the event is in the log.
        let _ = hub.tx.send(ev);
    }

    /// The command ended with `ev` (`exit` or `error`): sent to every subscriber and to every
    /// later attach.
    pub fn finish(&self, ev: api::ExecEvent) {
        let mut hub = self.hub();
        hub.end = Some(ev.clone());
        let _ = hub.tx.send(ev);
    }

    /// Subscribe: the live receiver (none once ended), the end event (once ended), and the
    /// stdout and stderr log lengths at this moment (what a replay covers).
    fn subscribe(
        &self,
    ) -> (
        Option<broadcast::Receiver<api::ExecEvent>>,
        Option<api::ExecEvent>,
        (u64, u64),
    ) {
        let hub = self.hub();
        let len = |s| {
            self.log
                .as_ref()
                .map_or(0, |l| l.read(s, u64::MAX, 0).next_offset)
        };
        let lens = (len(Stream::Stdout), len(Stream::Stderr));
        match &hub.end {
            Some(end) => (None, Some(end.clone()), lens),
            None => (Some(hub.tx.subscribe()), None, lens),
        }
    }

    fn control(&self) -> Result<ExecControl, ServiceError> {
        let c = self.control.lock().unwrap_or_else(|p| p.into_inner());
        c.clone().ok_or_else(|| {
            ServiceError::Conflict(format!("exec `{}` has no control channel", self.info.id))
        })
    }

    /// The owner re-attached to the command on a new agent link.
    pub fn set_control(&self, control: ExecControl) {
        *self.control.lock().unwrap_or_else(|p| p.into_inner()) = Some(control);
    }
}

/// The live execs of every sandbox.
#[derive(Default)]
pub struct LiveExecs {
    inner: Mutex<Inner>,
}

#[derive(Default)]
struct Inner {
    by_id: HashMap<String, Arc<LiveExec>>,
    /// Places taken by execs being started, per sandbox.
    starting: HashMap<String, usize>,
}

/// A place for one exec of a sandbox, taken before the command starts; given back when
/// dropped unfilled.
pub struct Slot<'a> {
    execs: &'a LiveExecs,
    sandbox: String,
    filled: bool,
}

impl Slot<'_> {
    /// The exec started: it is listed from now on.
    pub fn fill(mut self, live: Arc<LiveExec>) {
        let mut g = self.execs.lock();
        release(&mut g, &self.sandbox);
        g.by_id.insert(live.info.id.clone(), live);
        self.filled = true;
    }
}

impl Drop for Slot<'_> {
    fn drop(&mut self) {
        if !self.filled {
            release(&mut self.execs.lock(), &self.sandbox);
        }
    }
}

fn release(g: &mut Inner, sandbox: &str) {
    if let Some(n) = g.starting.get_mut(sandbox) {
        *n = n.saturating_sub(1);
        if *n == 0 {
            g.starting.remove(sandbox);
        }
    }
}

impl LiveExecs {
    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Take a place for a new exec of `sandbox`: 429 when it has `max` live or starting.
    pub fn reserve(&self, sandbox: &str, max: usize) -> Result<Slot<'_>, ServiceError> {
        let mut g = self.lock();
        let live = g
            .by_id
            .values()
            .filter(|e| e.info.sandbox_id == sandbox)
            .count();
        let starting = g.starting.get(sandbox).copied().unwrap_or(0);
        if live + starting >= max {
            return Err(ServiceError::Conflict(format!(
                "sandbox `{sandbox}` already runs {max} execs (the most it may); wait for one to \
                 end or signal one (`POST /v1/execs/{{id}}/signal`)"
            )));
        }
        *g.starting.entry(sandbox.to_owned()).or_default() += 1;
        Ok(Slot {
            execs: self,
            sandbox: sandbox.to_owned(),
            filled: false,
        })
    }

    pub fn get(&self, id: &str) -> Option<Arc<LiveExec>> {
        self.lock().by_id.get(id).cloned()
    }

    pub fn remove(&self, id: &str) {
        self.lock().by_id.remove(id);
    }

    /// A sandbox's live execs, oldest first.
    pub fn of_sandbox(&self, sandbox: &str) -> Vec<api::ExecInfo> {
        let mut v: Vec<api::ExecInfo> = self
            .lock()
            .by_id
            .values()
            .filter(|e| e.info.sandbox_id == sandbox)
            .map(|e| e.info.clone())
            .collect();
        v.sort_by(|a, b| a.started_at.cmp(&b.started_at).then(a.id.cmp(&b.id)));
        v
    }
}

/// Follow `live` on a new channel: `started`, the replay (when asked), then live events up to
/// the end. Never blocks the exec's owner.
pub fn follow(live: &Arc<LiveExec>, replay: bool) -> mpsc::Receiver<api::ExecEvent> {
    let (rx_live, end, lens) = live.subscribe();
    let (tx, rx) = mpsc::channel(64);
    let live = live.clone();
    tokio::spawn(async move {
        if tx.send(started(&live.info)).await.is_err() {
            return;
        }
        if replay && let Some(log) = &live.log {
            let read = |s, off| log.read(s, off, REPLAY_CHUNK).data;
            if !send_replay(&tx, read, lens).await {
                return;
            }
        }
        if let Some(end) = end {
            let _ = tx.send(end).await;
            return;
        }
        let Some(mut rx_live) = rx_live else { return };
        loop {
            let ev = tokio::select! {
                ev = rx_live.recv() => ev,
                _ = tx.closed() => return,
            };
            let (ev, last) = match ev {
                Ok(ev) => {
                    let last = matches!(
                        ev,
                        api::ExecEvent::Exit { .. } | api::ExecEvent::Error { .. }
                    );
                    (ev, last)
                }
                Err(broadcast::error::RecvError::Lagged(n)) => (
                    api::ExecEvent::Error {
                        code: "lagged".into(),
                        message: format!(
                            "this reader fell {n} events behind and was cut off; the command \
                             still runs: attach again with replay to read its output"
                        ),
                    },
                    true,
                ),
                Err(broadcast::error::RecvError::Closed) => (
                    api::ExecEvent::Error {
                        code: "exec_lost".into(),
                        message: "the exec's owner ended without a last event".into(),
                    },
                    true,
                ),
            };
            if tx.send(ev).await.is_err() || last {
                return;
            }
        }
    });
    rx
}

fn started(info: &api::ExecInfo) -> api::ExecEvent {
    api::ExecEvent::Started {
        exec_id: info.id.clone(),
        sandbox_id: info.sandbox_id.clone(),
        pid: info.pid,
    }
}

/// Send stdout up to `lens.0`, then stderr up to `lens.1` (the logs keep no interleaving per
/// stream; a pty exec has stdout only). `false` when the reader went away.
async fn send_replay(
    tx: &mpsc::Sender<api::ExecEvent>,
    read: impl Fn(Stream, u64) -> Vec<u8>,
    lens: (u64, u64),
) -> bool {
    for (stream, len) in [(Stream::Stdout, lens.0), (Stream::Stderr, lens.1)] {
        let mut off = 0;
        while off < len {
            let mut data = read(stream, off);
            if data.is_empty() {
                break;
            }
            data.truncate((len - off) as usize);
            off += data.len() as u64;
            let ev = api::ExecEvent::output(stream == Stream::Stderr, &data);
            if tx.send(ev).await.is_err() {
                return false;
            }
        }
    }
    true
}

impl Service {
    /// The live execs of a sandbox (404 for an unknown sandbox).
    pub fn list_execs(&self, sandbox_id: &str) -> Result<Vec<api::ExecInfo>, ServiceError> {
        self.record(sandbox_id)?;
        Ok(self.execs.of_sandbox(sandbox_id))
    }

    /// `GET /v1/execs/{id}`: the live exec, or the stored record of an ended one.
    pub fn get_exec(&self, exec_id: &str) -> Result<api::ExecInfo, ServiceError> {
        if let Some(live) = self.execs.get(exec_id) {
            return Ok(live.info.clone());
        }
        // Not live: ended, or lost with a daemon that stopped while it ran.
        let mut info = self.exec_record(exec_id)?.info();
        info.running = false;
        Ok(info)
    }

    fn exec_record(&self, exec_id: &str) -> Result<ExecRecord, ServiceError> {
        self.store
            .get(EXECS, exec_id)?
            .ok_or_else(|| ServiceError::NotFound(format!("no exec `{exec_id}`")))
    }

    /// The live exec, 409 for an ended one, 404 for an unknown one.
    fn live_exec(&self, exec_id: &str) -> Result<Arc<LiveExec>, ServiceError> {
        match self.execs.get(exec_id) {
            Some(l) => Ok(l),
            None => {
                self.exec_record(exec_id)?;
                Err(ServiceError::Conflict(format!(
                    "exec `{exec_id}` has ended"
                )))
            }
        }
    }

    /// Follow an exec: `started`, with `replay` the output so far (from the capped log), then
    /// live events to its end. For an ended exec: its replay, then its `exit` (or `error`).
    /// Going away never kills the command.
    pub async fn attach_exec(
        &self,
        exec_id: &str,
        replay: bool,
    ) -> Result<mpsc::Receiver<api::ExecEvent>, ServiceError> {
        if let Some(live) = self.execs.get(exec_id) {
            return Ok(follow(&live, replay));
        }
        let rec = self.exec_record(exec_id)?;
        let dir = self
            .paths
            .sandbox_dir(&rec.sandbox_id)
            .join("execs")
            .join(exec_id);
        let (tx, rx) = mpsc::channel(64);
        let info = rec.info();
        tokio::spawn(async move {
            if tx.send(started(&info)).await.is_err() {
                return;
            }
            if replay {
                let read = |s, off| {
                    logs::read_finished(&dir, s, off, REPLAY_CHUNK).map_or(Vec::new(), |c| c.data)
                };
                if !send_replay(&tx, read, (u64::MAX, u64::MAX)).await {
                    return;
                }
            }
            let _ = tx.send(rec.end_event()).await;
        });
        Ok(rx)
    }

    /// Write to a live exec's stdin (then close it with `close`); 409 when its stdin is closed
    /// or it ended; 403 when the input holds a stored secret's value.
    pub async fn exec_input(
        &self,
        exec_id: &str,
        data: &[u8],
        close: bool,
    ) -> Result<(), ServiceError> {
        if data.len() > api::MAX_STDIN_INPUT {
            return Err(ServiceError::BadRequest(format!(
                "at most {} bytes of input per request",
                api::MAX_STDIN_INPUT
            )));
        }
        let live = self.live_exec(exec_id)?;
        let mut st = live.stdin.lock().await;
        if !st.open {
            return Err(ServiceError::Conflict(format!(
                "the standard input of exec `{exec_id}` is closed (start it with `stdin_open`)"
            )));
        }
        self.refuse_stdin_value(&live.info.sandbox_id, &mut st.carry, data)?;
        let gone = |e: crate::rpc::RpcError| {
            ServiceError::Conflict(format!("exec `{exec_id}` takes no more input: {e}"))
        };
        if !data.is_empty() {
            live.control()?.write_stdin(data).await.map_err(gone)?;
        }
        if close {
            live.control()?.close_stdin().map_err(gone)?;
            st.open = false;
        }
        Ok(())
    }

    /// Send `signal` to a live exec's process group.
    pub async fn signal_exec(&self, exec_id: &str, signal: i32) -> Result<(), ServiceError> {
        if !(1..=64).contains(&signal) {
            return Err(ServiceError::BadRequest(format!(
                "signal must be 1..=64, got {signal}"
            )));
        }
        let live = self.live_exec(exec_id)?;
        tracing::info!(exec = %exec_id, signal, "signalling an exec");
        live.control()?
            .kill(signal)
            .map_err(|e| ServiceError::Conflict(format!("exec `{exec_id}` is gone: {e}")))
    }

    /// Resize a live pty exec's terminal; 409 for an exec without a pty.
    pub async fn resize_exec(
        &self,
        exec_id: &str,
        rows: u16,
        cols: u16,
    ) -> Result<(), ServiceError> {
        api::PtySize { rows, cols }
            .check()
            .map_err(ServiceError::BadRequest)?;
        let live = self.live_exec(exec_id)?;
        if !live.info.pty {
            return Err(ServiceError::Conflict(format!(
                "exec `{exec_id}` has no pty to resize"
            )));
        }
        live.control()?
            .resize(rows, cols)
            .map_err(|e| ServiceError::Conflict(format!("exec `{exec_id}` is gone: {e}")))
    }

    /// The live exec of `sandbox_id` whose guest pid is `pid`.
    // The E2B face names processes by pid.
    pub fn exec_by_pid(&self, sandbox_id: &str, pid: u32) -> Option<String> {
        self.execs
            .of_sandbox(sandbox_id)
            .into_iter()
            .find(|e| e.pid == Some(pid))
            .map(|e| e.id)
    }
}

/// After the agent link of a running exec broke: wait while its sandbox is being paused or
/// is paused, and once it runs again (a new VM in the live map), re-attach to the command
/// with the agent's `Resume` from `next_seq`. `None` (the exec is lost) when the sandbox
/// failed or went, its new agent does not know the exec (e.g. restored to a snapshot), or
/// the link broke for another reason (the VM stays the same for [`LINK_GRACE`]).
pub(super) async fn reattach_exec(
    svc: &Weak<Service>,
    sandbox: &str,
    old: &Weak<LiveVm>,
    guest_exec: u64,
    next_seq: u64,
) -> Option<(ExecStream, Arc<LiveVm>)> {
    let since = tokio::time::Instant::now();
    loop {
        // Not kept alive while waiting.
        let this = svc.upgrade()?;
        let rec = this.record(sandbox).ok()?;
        let vm = this.vms.get(sandbox);
        drop(this);
        let same = vm
            .as_ref()
            .is_some_and(|v| old.upgrade().is_some_and(|o| Arc::ptr_eq(v, &o)));
        match (rec.api.state, vm) {
            (SandboxState::Ready, Some(vm)) if !same => {
                return match vm.agent.resume(guest_exec, next_seq).await {
                    Ok(s) => Some((s, vm)),
                    Err(e) => {
                        tracing::info!(sandbox, guest_exec, error = %e, "cannot re-attach to an exec");
                        None
                    }
                };
            }
            (SandboxState::Paused, _) => {}
            // Pausing: the VM left the live map before the record says paused.
            (SandboxState::Ready, None) if since.elapsed() < LINK_GRACE * 12 => {}
            (SandboxState::Ready, Some(_)) if since.elapsed() < LINK_GRACE => {}
            _ => return None,
        }
        tokio::time::sleep(REATTACH_POLL).await;
    }
}

#[cfg(test)]
#[path = "execs_tests.rs"]
mod tests;
