//! The exec service: spawning commands, streaming their output through a bounded spool,
//! timeouts, signals, ptys.
//!
//! Owns every process it spawns (each in its own process group; a session of its own for a
//! pty, and outside the VM) and every byte of
//! their output until the host acknowledges it. Output is never dropped: when the spool is full
//! the pipes are simply not read (backpressure). It never waits for processes itself (that is
//! the reaper's job) and never speaks the wire format beyond queueing frames on an outbox.

use super::files::Owed;
use super::reaper::{Reaper, Status};
use crate::rpc::WINDOW;
use crate::rpc::frame::CHUNK;
use crate::rpc::msg::{Body, ErrorKind, ExecSpec, Frame, RemoteError, WireExecEvent};
use crate::rpc::outbox::Outbox;
use std::collections::{HashMap, VecDeque};
use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::process::CommandExt;
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::unix::pipe;
use tokio::sync::{Notify, mpsc, oneshot, watch};

/// Unacknowledged output kept per exec before its pipes stop being read.
pub const SPOOL_CAP: usize = 4 << 20;
/// After the main process exits, how long to keep reading pipes that a background process
/// still holds open.
const EXIT_GRACE: Duration = Duration::from_millis(250);

/// How commands are set up.
#[derive(Debug, Clone)]
pub struct ExecConfig {
    /// Working directory when the request names none.
    pub default_cwd: String,
    /// `Some`: children get exactly this environment (plus the request's); `None`: inherit ours.
    pub base_env: Option<Vec<(String, String)>>,
    /// Start pipe-only commands with `posix_spawn` (a `vfork`: no copy of the agent's page
    /// tables, no copy-on-write faults after) by entering their working directory in the agent
    /// itself for the moment of the spawn. Only for the agent as PID 1 in a VM, whose code uses
    /// absolute paths only; a process sharing its working directory with other code (tests)
    /// keeps `false`. See [`spawn_in_cwd`].
    pub spawn_in_cwd: bool,
}

/// Held while the agent's working directory is a command's (see [`ExecConfig::spawn_in_cwd`]).
static CWD_LOCK: Mutex<()> = Mutex::new(());

/// Spawn `cmd` (which names no working directory) with `cwd` as its working directory: the
/// agent enters `cwd`, spawns, and goes back to `/`, under [`CWD_LOCK`].
///
/// Why: Rust's standard library starts a command with `posix_spawn` (`vfork` semantics) unless
/// it needs work between fork and exec; a working directory is such work in a static binary
/// (glibc's `posix_spawn_file_actions_addchdir_np` is looked up dynamically, which fails), so
/// every exec would `fork` the agent. Under TCG a fork of the agent (copying its page tables,
/// then copy-on-write faults in both processes) is a large part of a short exec.
fn spawn_in_cwd(
    reaper: &Reaper,
    cmd: &mut Command,
    cwd: &str,
) -> std::io::Result<(std::process::Child, oneshot::Receiver<Status>)> {
    let _held = CWD_LOCK.lock().unwrap_or_else(|p| p.into_inner());
    std::env::set_current_dir(cwd)?;
    let res = reaper.spawn(cmd);
    if let Err(e) = std::env::set_current_dir("/") {
        tracing::warn!(error = %e, "cannot go back to / after a spawn");
    }
    res
}

/// `prog` resolved against `path` (a `PATH` value) like `execvp` does, when it names no
/// directory: the first regular file with an execute bit. `None` when it has a `/` or nothing
/// was found (the caller then lets `execvp` decide, and report).
pub(super) fn resolve_program(prog: &str, path: Option<&str>) -> Option<std::path::PathBuf> {
    use std::os::unix::fs::PermissionsExt;
    if prog.is_empty() || prog.contains('/') {
        return None;
    }
    path?
        .split(':')
        .map(|dir| std::path::Path::new(if dir.is_empty() { "." } else { dir }).join(prog))
        .find(|p| {
            p.is_absolute()
                && std::fs::metadata(p)
                    .is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
        })
}

pub struct ExecTable {
    cfg: ExecConfig,
    reaper: Arc<Reaper>,
    execs: Mutex<HashMap<u64, Arc<Exec>>>,
    next_id: AtomicU64,
}

enum StdinMsg {
    Data(Vec<u8>, Owed),
    End,
}

struct Attach {
    outbox: Arc<Outbox>,
    stream: u32,
    generation: u64,
}

#[derive(Default)]
struct State {
    /// Unacknowledged events; seqs are contiguous from `acked + 1` to `next_seq - 1`.
    spool: VecDeque<(u64, WireExecEvent)>,
    spool_bytes: usize,
    /// Cost of the events sent on the current attachment and not yet acknowledged.
    inflight: usize,
    next_seq: u64,
    acked: u64,
    send_next: u64,
    attach: Option<Attach>,
    generation: u64,
    exit_seq: Option<u64>,
}

/// One running (or finished but not yet fully acknowledged) command.
pub struct Exec {
    pub id: u64,
    pub pid: u32,
    st: Mutex<State>,
    changed: Notify,
    space: Notify,
    stdin: mpsc::UnboundedSender<StdinMsg>,
    pty: Option<OwnedFd>,
}

fn invalid(msg: impl Into<String>) -> RemoteError {
    RemoteError::new(ErrorKind::InvalidRequest, msg)
}

impl ExecTable {
    pub fn new(cfg: ExecConfig, reaper: Arc<Reaper>) -> Arc<Self> {
        Arc::new(Self {
            cfg,
            reaper,
            execs: Mutex::new(HashMap::new()),
            next_id: AtomicU64::new(first_exec_id()),
        })
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<u64, Arc<Exec>>> {
        self.execs.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub fn get(&self, id: u64) -> Option<Arc<Exec>> {
        self.lock().get(&id).cloned()
    }

    /// Number of execs still held (running, or with unacknowledged output).
    #[cfg(test)]
    pub fn len(&self) -> usize {
        self.lock().len()
    }

    /// Spawns the command; its `Started` event is already spooled (seq 1) when this returns.
    pub fn start(self: &Arc<Self>, spec: ExecSpec) -> Result<Arc<Exec>, RemoteError> {
        let argv = match &spec.shell {
            Some(s) => vec!["/bin/sh".to_string(), "-c".to_string(), s.clone()],
            None => spec.argv.clone(),
        };
        let Some((prog, args)) = argv.split_first() else {
            return Err(invalid("exec needs argv or a shell string"));
        };
        let cwd = spec
            .cwd
            .clone()
            .unwrap_or_else(|| self.cfg.default_cwd.clone());
        if !cwd.starts_with('/') {
            return Err(invalid(format!("cwd {cwd:?} is not an absolute path")));
        }
        // See `ExecConfig::spawn_in_cwd`. The program is looked up here: with a `PATH` of its
        // own in the environment, the standard library would fork to let `execvp` do it.
        let user = match &spec.user {
            Some(name) => {
                Some(super::users::lookup(std::path::Path::new("/"), name).map_err(invalid)?)
            }
            None => None,
        };
        let fast = self.cfg.spawn_in_cwd && spec.pty.is_none() && user.is_none();
        let path_var = spec
            .env
            .iter()
            .rev()
            .chain(self.cfg.base_env.iter().flatten())
            .find(|(k, _)| k == "PATH")
            .map(|(_, v)| v.as_str());
        let resolved = fast.then(|| resolve_program(prog, path_var)).flatten();
        let mut cmd = match &resolved {
            Some(exe) => {
                let mut c = Command::new(exe);
                c.arg0(prog);
                c
            }
            None => Command::new(prog),
        };
        cmd.args(args);
        if !fast {
            cmd.current_dir(&cwd);
        }
        if let Some(base) = &self.cfg.base_env {
            cmd.env_clear().envs(base.iter().map(|(k, v)| (k, v)));
        }
        if spec.pty.is_some() && !spec.env.iter().any(|(k, _)| k == "TERM") {
            cmd.env("TERM", "xterm-256color");
        }
        if let Some(u) = &user {
            cmd.env("HOME", &u.home)
                .env("USER", &u.name)
                .env("LOGNAME", &u.name);
        }
        cmd.envs(spec.env.iter().map(|(k, v)| (k, v)));

        let mut pty_master = None;
        if let Some(size) = spec.pty {
            let ws = nix::pty::Winsize {
                ws_row: size.rows,
                ws_col: size.cols,
                ws_xpixel: 0,
                ws_ypixel: 0,
            };
            let pty = nix::pty::openpty(&ws, None)
                .map_err(|e| RemoteError::new(ErrorKind::Io, format!("openpty: {e}")))?;
            let io = |e: std::io::Error| RemoteError::from_io("pty", &e);
            cmd.stdin(Stdio::from(pty.slave.try_clone().map_err(io)?))
                .stdout(Stdio::from(pty.slave.try_clone().map_err(io)?))
                .stderr(Stdio::from(pty.slave));
            // SAFETY: only async-signal-safe calls (setsid, ioctl) run between fork and exec.
            unsafe {
                cmd.pre_exec(|| {
                    if libc::setsid() < 0 {
                        return Err(std::io::Error::last_os_error());
                    }
                    if libc::ioctl(0, libc::TIOCSCTTY as _, 0) < 0 {
                        return Err(std::io::Error::last_os_error());
                    }
                    Ok(())
                });
            }
            pty_master = Some(pty.master);
        } else {
            cmd.stdin(Stdio::piped())
                .stdout(Stdio::piped())
                .stderr(Stdio::piped());
            if fast {
                // A process group of its own (signals reach everything it starts); no closure
                // runs between fork and exec, so `posix_spawn` can be used.
                cmd.process_group(0);
            } else {
                // SAFETY: setsid is async-signal-safe.
                unsafe {
                    cmd.pre_exec(|| {
                        if libc::setsid() < 0 {
                            return Err(std::io::Error::last_os_error());
                        }
                        Ok(())
                    });
                }
            }
        }

        if let Some(u) = user {
            let (uid, gid, groups) = (u.uid, u.gid, u.groups);
            // SAFETY: `drop_to` makes only async-signal-safe calls; `groups` was allocated
            // before the fork. Registered last: it runs after the session setup above.
            unsafe {
                cmd.pre_exec(move || super::users::drop_to(uid, gid, &groups));
            }
        }

        let spawned = if fast {
            spawn_in_cwd(&self.reaper, &mut cmd, &cwd)
        } else {
            self.reaper.spawn(&mut cmd)
        };
        let (mut child, exit_rx) =
            spawned.map_err(|e| RemoteError::from_io(&format!("spawn {prog} in {cwd}"), &e))?;
        // Close our copies of the pty slave so the master sees EIO when the session ends.
        drop(cmd);
        let pid = child.id();
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let (stdin_tx, stdin_rx) = mpsc::unbounded_channel();
        let (stop_tx, stop_rx) = watch::channel(false);
        let mut readers = Vec::new();
        let stdin_w;
        let resize_fd;
        let exec;
        let io = |e: std::io::Error| RemoteError::from_io("exec pipes", &e);
        if let Some(master) = pty_master {
            set_nonblocking(&master).map_err(io)?;
            let r = pipe::Receiver::from_owned_fd_unchecked(master.try_clone().map_err(io)?)
                .map_err(io)?;
            stdin_w = Some(
                pipe::Sender::from_owned_fd_unchecked(master.try_clone().map_err(io)?)
                    .map_err(io)?,
            );
            resize_fd = Some(master);
            exec = Exec::new(id, pid, stdin_tx, resize_fd);
            // `Started` must be seq 1: spool it before any reader task can push output.
            exec.push(WireExecEvent::Started { exec_id: id, pid });
            readers.push(tokio::spawn(read_output(exec.clone(), r, true, stop_rx)));
        } else {
            let take = |fd: Option<OwnedFd>| fd.ok_or_else(|| invalid("missing pipe"));
            let out = pipe::Receiver::from_owned_fd(take(child.stdout.take().map(Into::into))?)
                .map_err(io)?;
            let err = pipe::Receiver::from_owned_fd(take(child.stderr.take().map(Into::into))?)
                .map_err(io)?;
            stdin_w = Some(
                pipe::Sender::from_owned_fd(take(child.stdin.take().map(Into::into))?)
                    .map_err(io)?,
            );
            exec = Exec::new(id, pid, stdin_tx, None);
            // `Started` must be seq 1: spool it before any reader task can push output.
            exec.push(WireExecEvent::Started { exec_id: id, pid });
            readers.push(tokio::spawn(read_output(
                exec.clone(),
                out,
                true,
                stop_rx.clone(),
            )));
            readers.push(tokio::spawn(read_output(exec.clone(), err, false, stop_rx)));
        }
        drop(child);
        self.lock().insert(id, exec.clone());
        tracing::debug!(exec_id = id, pid, "exec started");
        tokio::spawn(feed_stdin(stdin_w, stdin_rx, spec.pty.is_some()));
        let timeout = spec.timeout_ms.map(Duration::from_millis);
        tokio::spawn(supervise(exec.clone(), exit_rx, timeout, readers, stop_tx));
        tokio::spawn(pump(exec.clone(), Arc::downgrade(self)));
        Ok(exec)
    }
}

fn set_nonblocking(fd: &OwnedFd) -> std::io::Result<()> {
    // SAFETY: F_GETFL/F_SETFL on a descriptor we own.
    unsafe {
        let fl = libc::fcntl(fd.as_raw_fd(), libc::F_GETFL);
        if fl < 0 || libc::fcntl(fd.as_raw_fd(), libc::F_SETFL, fl | libc::O_NONBLOCK) < 0 {
            return Err(std::io::Error::last_os_error());
        }
    }
    Ok(())
}

impl Exec {
    fn new(
        id: u64,
        pid: u32,
        stdin: mpsc::UnboundedSender<StdinMsg>,
        pty: Option<OwnedFd>,
    ) -> Arc<Self> {
        Arc::new(Self {
            id,
            pid,
            st: Mutex::new(State {
                next_seq: 1,
                send_next: 1,
                ..State::default()
            }),
            changed: Notify::new(),
            space: Notify::new(),
            stdin,
            pty,
        })
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.st.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn push(&self, ev: WireExecEvent) {
        let mut st = self.lock();
        let seq = st.next_seq;
        st.next_seq += 1;
        st.spool_bytes += ev.cost();
        if matches!(ev, WireExecEvent::Exit { .. }) {
            st.exit_seq = Some(seq);
        }
        st.spool.push_back((seq, ev));
        drop(st);
        self.changed.notify_one();
    }

    async fn wait_space(&self) {
        loop {
            let n = self.space.notified();
            tokio::pin!(n);
            n.as_mut().enable();
            if self.lock().spool_bytes < SPOOL_CAP {
                return;
            }
            n.await;
        }
    }

    fn ack_locked(st: &mut State, seq: u64) {
        let seq = seq.min(st.next_seq.saturating_sub(1));
        while let Some((s, ev)) = st.spool.front() {
            if *s > seq {
                break;
            }
            let cost = ev.cost();
            if *s < st.send_next {
                st.inflight = st.inflight.saturating_sub(cost);
            }
            st.spool_bytes -= cost;
            st.spool.pop_front();
        }
        st.acked = st.acked.max(seq);
        st.send_next = st.send_next.max(st.acked + 1);
    }

    /// The host consumed every event up to `seq`.
    pub fn ack(&self, seq: u64) {
        Self::ack_locked(&mut self.lock(), seq);
        self.space.notify_waiters();
        self.changed.notify_one();
    }

    /// Sends this exec's events from `from_seq` on `stream` of `outbox` (replacing any earlier
    /// attachment). Events before `from_seq` count as acknowledged.
    pub fn attach(
        &self,
        outbox: Arc<Outbox>,
        stream: u32,
        from_seq: u64,
    ) -> Result<(), RemoteError> {
        let mut st = self.lock();
        Self::check_locked(&st, self.id, from_seq)?;
        Self::ack_locked(&mut st, from_seq - 1);
        st.send_next = from_seq;
        st.inflight = 0;
        st.generation += 1;
        st.attach = Some(Attach {
            outbox,
            stream,
            generation: st.generation,
        });
        drop(st);
        self.space.notify_waiters();
        self.changed.notify_one();
        Ok(())
    }

    fn check_locked(st: &State, id: u64, from_seq: u64) -> Result<(), RemoteError> {
        if from_seq <= st.acked || from_seq > st.next_seq {
            return Err(invalid(format!(
                "exec {id} can replay from seq {} to {}, not {from_seq}",
                st.acked + 1,
                st.next_seq
            )));
        }
        Ok(())
    }

    /// Whether [`attach`](Self::attach) at `from_seq` would succeed now.
    pub fn check_resume(&self, from_seq: u64) -> Result<(), RemoteError> {
        Self::check_locked(&self.lock(), self.id, from_seq)
    }

    /// Sends `sig` to the exec's whole process group.
    pub fn kill(&self, sig: i32) {
        // SAFETY: kill(2) with a negative pid signals the process group the exec leads.
        let r = unsafe { libc::kill(-(self.pid as i32), sig) };
        if r < 0 {
            tracing::debug!(exec_id = self.id, sig, error = %std::io::Error::last_os_error(), "kill");
        }
    }

    pub fn resize(&self, rows: u16, cols: u16) {
        let Some(fd) = &self.pty else { return };
        let ws = libc::winsize {
            ws_row: rows,
            ws_col: cols,
            ws_xpixel: 0,
            ws_ypixel: 0,
        };
        // SAFETY: TIOCSWINSZ reads one winsize from the pointer; fd is our pty master.
        let r = unsafe { libc::ioctl(fd.as_raw_fd(), libc::TIOCSWINSZ, &ws) };
        if r < 0 {
            tracing::debug!(exec_id = self.id, error = %std::io::Error::last_os_error(), "resize");
        }
    }

    /// Stdin bytes from the host; the credit owed goes back once they are written.
    pub fn stdin_data(&self, data: Vec<u8>, owed: Owed) {
        if let Err(mpsc::error::SendError(StdinMsg::Data(_, owed))) =
            self.stdin.send(StdinMsg::Data(data, owed))
        {
            owed.give();
        }
    }

    pub fn stdin_end(&self) {
        let _ = self.stdin.send(StdinMsg::End);
    }

    /// Bytes of output (plus per-event overhead) held for the host right now.
    #[cfg(test)]
    pub fn spooled_bytes(&self) -> usize {
        self.lock().spool_bytes
    }

    /// True once the exit event has been acknowledged (the exec is gone from the table).
    pub fn finished(&self) -> bool {
        let st = self.lock();
        st.exit_seq.is_some_and(|s| st.acked >= s)
    }
}

enum Step {
    Send(Arc<Outbox>, Frame, u64),
    Wait,
    Done,
}

/// Moves spooled events onto the current attachment, at most [`WINDOW`] unacknowledged.
async fn pump(exec: Arc<Exec>, table: Weak<ExecTable>) {
    loop {
        let changed = exec.changed.notified();
        tokio::pin!(changed);
        changed.as_mut().enable();
        let step = {
            let mut st = exec.lock();
            if st.exit_seq.is_some_and(|s| st.acked >= s) {
                Step::Done
            } else if st.attach.as_ref().is_some_and(|a| a.outbox.is_closed()) {
                st.attach = None;
                Step::Wait
            } else if st.attach.is_some() && st.send_next < st.next_seq && st.inflight < WINDOW {
                let idx = (st.send_next - (st.acked + 1)) as usize;
                match st.spool.get(idx).cloned() {
                    Some((seq, event)) => {
                        st.inflight += event.cost();
                        st.send_next = seq + 1;
                        match &st.attach {
                            Some(a) => Step::Send(
                                a.outbox.clone(),
                                Frame {
                                    stream: a.stream,
                                    body: Body::Exec { seq, event },
                                },
                                a.generation,
                            ),
                            None => Step::Wait,
                        }
                    }
                    None => Step::Wait,
                }
            } else {
                Step::Wait
            }
        };
        match step {
            Step::Send(outbox, frame, generation) => {
                if outbox.send(frame).is_err() {
                    let mut st = exec.lock();
                    if st
                        .attach
                        .as_ref()
                        .is_some_and(|a| a.generation == generation)
                    {
                        st.attach = None;
                    }
                }
            }
            Step::Wait => changed.await,
            Step::Done => {
                if let Some(t) = table.upgrade() {
                    t.lock().remove(&exec.id);
                }
                tracing::debug!(exec_id = exec.id, "exec done");
                return;
            }
        }
    }
}

async fn read_output(
    exec: Arc<Exec>,
    mut rx: pipe::Receiver,
    stdout: bool,
    mut stop: watch::Receiver<bool>,
) {
    let mut buf = vec![0u8; CHUNK];
    let wrap = |b: &[u8]| {
        if stdout {
            WireExecEvent::Stdout(b.to_vec())
        } else {
            WireExecEvent::Stderr(b.to_vec())
        }
    };
    loop {
        exec.wait_space().await;
        tokio::select! {
            biased;
            r = rx.read(&mut buf) => match r {
                Ok(0) | Err(_) => return, // EOF; EIO on a pty master whose session ended
                Ok(n) => exec.push(wrap(&buf[..n])),
            },
            _ = async { let _ = stop.wait_for(|s| *s).await; } => {
                // A background process holds the pipe: take what is there, then stop.
                loop {
                    exec.wait_space().await;
                    match rx.try_read(&mut buf) {
                        Ok(n) if n > 0 => exec.push(wrap(&buf[..n])),
                        _ => return,
                    }
                }
            }
        }
    }
}

async fn feed_stdin(
    mut w: Option<pipe::Sender>,
    mut rx: mpsc::UnboundedReceiver<StdinMsg>,
    pty: bool,
) {
    while let Some(msg) = rx.recv().await {
        match msg {
            StdinMsg::Data(bytes, owed) => {
                if let Some(p) = &mut w
                    && p.write_all(&bytes).await.is_err()
                {
                    w = None; // the command closed its stdin; drop the rest
                }
                owed.give();
            }
            StdinMsg::End if !pty => w = None,
            StdinMsg::End => {}
        }
    }
}

async fn supervise(
    exec: Arc<Exec>,
    mut exit_rx: oneshot::Receiver<Status>,
    timeout: Option<Duration>,
    readers: Vec<tokio::task::JoinHandle<()>>,
    stop: watch::Sender<bool>,
) {
    let mut timed_out = false;
    let status = match timeout {
        Some(t) => tokio::select! {
            s = &mut exit_rx => s.ok(),
            _ = tokio::time::sleep(t) => {
                timed_out = true;
                exec.kill(libc::SIGKILL);
                exit_rx.await.ok()
            }
        },
        None => exit_rx.await.ok(),
    };
    if timed_out {
        // The leader is dead; make sure nothing of its group survives it either.
        exec.kill(libc::SIGKILL);
    }
    let mut all = futures_util::future::join_all(readers);
    if tokio::time::timeout(EXIT_GRACE, &mut all).await.is_err() {
        let _ = stop.send(true);
        all.await;
    }
    let (code, signal) = match status {
        Some(Status::Code(c)) => (Some(c), None),
        Some(Status::Signal(s)) => (None, Some(s)),
        None => (None, None),
    };
    tracing::debug!(exec_id = exec.id, ?code, ?signal, timed_out, "exec exited");
    exec.push(WireExecEvent::Exit {
        code,
        signal,
        timed_out,
    });
}

/// The first exec id of this agent's life: a random high half, so that ids from an earlier
/// boot of the same disk (a sandbox booted afresh after a filesystem-only pause or a reboot)
/// are never this agent's, and a host still holding one cannot re-attach to another command.
/// Clones and restores keep the base with the rest of the agent's memory (their execs are the
/// checkpoint's).
fn first_exec_id() -> u64 {
    let mut b = [0u8; 4];
    // Without randomness (never seen) the ids still start at 1, as before.
    let high = getrandom::fill(&mut b).map_or(0, |()| u64::from(u32::from_le_bytes(b)));
    (high << 32) | 1
}
