//! The host side: [`AgentClient`], one per VM, and [`ExecStream`], one per running command.
//!
//! Owns the host end of one connection: stream ids, routing of incoming frames to their
//! callers, credit for host->guest data, acks for guest->host exec events. It never retries a
//! request on its own and never outlives its connection: when the link dies every pending call
//! and every stream ends with [`RpcError::Disconnected`].

use super::frame::{CHUNK, read_frame, seek_frame};
use super::msg::{
    Body, CONTROL_STREAM, DirEntry, ExecSpec, FileStat, Frame, PROTOCOL_VERSION, PtySize, Reply,
    Request, WalkCursor, WalkDelta, WalkEntry, WireExecEvent,
};
use super::outbox::Outbox;
use super::{RpcError, WINDOW};
use std::collections::HashMap;
use std::path::Path;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite};
use tokio::sync::{Semaphore, mpsc};

/// How long the agent may take to report that it spawned a command.
const EXEC_START_TIMEOUT: Duration = Duration::from_secs(60);

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

/// How long one connection attempt waits for the handshake before trying a new connection.
const HANDSHAKE_ATTEMPT: Duration = Duration::from_secs(5);

/// Largest `HelloAck` payload looked for (it holds two numbers and a short version string).
const MAX_HELLO_ACK: usize = 4096;

/// A fresh random nonce for one connection attempt. Unpredictability is not needed, only that
/// two attempts (of this daemon or an earlier one) practically never share a value, so a weak
/// fallback is fine if the OS has no entropy to give.
fn hello_nonce() -> u64 {
    getrandom::u64().unwrap_or_else(|_| {
        use std::hash::{BuildHasher, Hasher};
        let mut h = std::collections::hash_map::RandomState::new().build_hasher();
        h.write_u128(
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .unwrap_or_default()
                .as_nanos(),
        );
        h.write_u32(std::process::id());
        h.finish()
    })
}

type StreamTx = mpsc::UnboundedSender<Body>;

/// State shared by the client handles and the reader task.
struct Shared {
    outbox: Outbox,
    /// `None` once the connection is dead; dropping the senders ends every receiver.
    streams: Mutex<Option<HashMap<u32, StreamTx>>>,
    /// Credit for host->guest `Data`, per stream.
    credits: Mutex<HashMap<u32, Arc<Semaphore>>>,
    next_stream: AtomicU32,
}

impl Shared {
    fn lock_streams(&self) -> std::sync::MutexGuard<'_, Option<HashMap<u32, StreamTx>>> {
        self.streams.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn lock_credits(&self) -> std::sync::MutexGuard<'_, HashMap<u32, Arc<Semaphore>>> {
        self.credits.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn open(&self) -> Result<(u32, mpsc::UnboundedReceiver<Body>, Arc<Semaphore>), RpcError> {
        let mut g = self.lock_streams();
        let map = g.as_mut().ok_or(RpcError::Disconnected)?;
        let id = loop {
            let id = self.next_stream.fetch_add(1, Ordering::Relaxed);
            if id != CONTROL_STREAM && !map.contains_key(&id) {
                break id;
            }
        };
        let (tx, rx) = mpsc::unbounded_channel();
        map.insert(id, tx);
        let sem = Arc::new(Semaphore::new(WINDOW));
        self.lock_credits().insert(id, sem.clone());
        Ok((id, rx, sem))
    }

    fn close_stream(&self, id: u32) {
        if let Some(map) = self.lock_streams().as_mut() {
            map.remove(&id);
        }
        self.lock_credits().remove(&id);
    }

    /// Ends everything: called once when the link dies.
    fn kill(&self) {
        self.outbox.close();
        self.lock_streams().take();
        for (_, sem) in self.lock_credits().drain() {
            sem.close();
        }
    }

    fn dispatch(&self, frame: Frame) -> Result<(), RpcError> {
        if let Body::Credit(n) = frame.body {
            if let Some(sem) = self.lock_credits().get(&frame.stream) {
                if sem.available_permits() + n as usize > WINDOW {
                    return Err(RpcError::Protocol(format!(
                        "credit overflow on stream {}",
                        frame.stream
                    )));
                }
                sem.add_permits(n as usize);
            }
            return Ok(());
        }
        if let Some(map) = self.lock_streams().as_ref()
            && let Some(tx) = map.get(&frame.stream)
        {
            // The receiver may be gone (caller dropped); late frames are discarded.
            let _ = tx.send(frame.body);
        }
        Ok(())
    }

    async fn send_data(&self, stream: u32, sem: &Semaphore, data: &[u8]) -> Result<(), RpcError> {
        for chunk in data.chunks(CHUNK) {
            sem.acquire_many(chunk.len() as u32)
                .await
                .map_err(|_| RpcError::Disconnected)?
                .forget();
            self.outbox.send(Frame {
                stream,
                body: Body::Data(chunk.to_vec()),
            })?;
        }
        Ok(())
    }
}

/// Closes the connection when the last [`AgentClient`] or [`ExecStream`] is dropped.
struct Handle {
    shared: Arc<Shared>,
    agent_version: String,
    tasks: Vec<tokio::task::AbortHandle>,
}

impl Drop for Handle {
    fn drop(&mut self) {
        self.shared.kill();
        for t in &self.tasks {
            t.abort();
        }
    }
}

struct CloseOnDrop(Option<(Arc<Shared>, tokio::task::AbortHandle)>);

impl Drop for CloseOnDrop {
    fn drop(&mut self) {
        if let Some((shared, writer)) = self.0.take() {
            shared.kill();
            writer.abort();
        }
    }
}

/// A stream opened by one request; unregisters itself when dropped.
struct OpenStream {
    handle: Arc<Handle>,
    id: u32,
    rx: mpsc::UnboundedReceiver<Body>,
    credit: Arc<Semaphore>,
}

impl Drop for OpenStream {
    fn drop(&mut self) {
        self.handle.shared.close_stream(self.id);
    }
}

impl OpenStream {
    async fn recv(&mut self) -> Result<Body, RpcError> {
        self.rx.recv().await.ok_or(RpcError::Disconnected)
    }

    fn send(&self, body: Body) -> Result<(), RpcError> {
        Ok(self.handle.shared.outbox.send(Frame {
            stream: self.id,
            body,
        })?)
    }

    fn send_control(&self, body: Body) -> Result<(), RpcError> {
        Ok(self.handle.shared.outbox.send_control(Frame {
            stream: self.id,
            body,
        })?)
    }
}

/// The host's handle on one guest agent. Cheap to clone; all clones share one connection.
#[derive(Clone)]
pub struct AgentClient {
    handle: Arc<Handle>,
}

impl std::fmt::Debug for AgentClient {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AgentClient")
            .field("agent_version", &self.handle.agent_version)
            .finish_non_exhaustive()
    }
}

fn unexpected(body: &Body) -> RpcError {
    let name = format!("{body:?}");
    RpcError::Protocol(name.chars().take(80).collect())
}

impl AgentClient {
    /// Connects to the host end of the agent channel (QEMU's chardev unix socket), retrying
    /// until the guest agent answers the handshake or `timeout` passes.
    pub async fn connect_unix(path: &Path, timeout: Duration) -> Result<Self, RpcError> {
        let deadline = Instant::now() + timeout;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(RpcError::Timeout(timeout));
            }
            match tokio::net::UnixStream::connect(path).await {
                // A Hello can be lost (the agent was mid-reconnect, or read garbage first);
                // a fresh connection costs nothing, so do not wait on one for long.
                Ok(s) => match tokio::time::timeout(left.min(HANDSHAKE_ATTEMPT), Self::connect(s))
                    .await
                {
                    Ok(Ok(c)) => return Ok(c),
                    Ok(Err(
                        RpcError::Disconnected
                        | RpcError::Io(_)
                        | RpcError::Frame(_)
                        | RpcError::Protocol(_),
                    ))
                    | Err(_) => {}
                    Ok(Err(e)) => return Err(e),
                },
                Err(e) => {
                    tracing::trace!(path = %path.display(), error = %e, "agent socket not ready")
                }
            }
            tokio::time::sleep(Duration::from_millis(50).min(left)).await;
        }
    }

    /// Runs the handshake over `io` and starts the connection's reader and writer tasks.
    pub async fn connect<S>(io: S) -> Result<Self, RpcError>
    where
        S: AsyncRead + AsyncWrite + Send + Unpin + 'static,
    {
        let (mut rd, wr) = tokio::io::split(io);
        let shared = Arc::new(Shared {
            outbox: Outbox::new(),
            streams: Mutex::new(Some(HashMap::new())),
            credits: Mutex::new(HashMap::new()),
            next_stream: AtomicU32::new(1),
        });
        let w = shared.clone();
        let writer = tokio::spawn(async move {
            if let Err(e) = w.outbox.run_writer(wr).await {
                tracing::debug!(error = %e, "agent channel write failed");
            }
            w.kill();
        });
        let abort_writer = writer.abort_handle();
        // If the handshake fails or this future is dropped (a timeout), close the connection:
        // the writer task holds half of `io`, and a QEMU chardev accepts one client at a time.
        let mut guard = CloseOnDrop(Some((shared.clone(), abort_writer.clone())));
        let nonce = hello_nonce();
        let hello = Frame {
            stream: CONTROL_STREAM,
            body: Body::Hello {
                protocol: PROTOCOL_VERSION,
                version: env!("CARGO_PKG_VERSION").to_string(),
                nonce,
            },
        };
        // On a virtio port the byte stream outlives host connections: before the answer to this
        // Hello there can be frames the agent wrote for an earlier connection, a HelloAck for an
        // earlier (abandoned) attempt, even the tail of a half-written frame. Skip all of it, at
        // any byte offset, up to the HelloAck that echoes this connection's nonce; everything
        // after it belongs to this connection.
        let handshake = async {
            shared.outbox.send_control(hello)?;
            let found = seek_frame(
                &mut rd,
                MAX_HELLO_ACK,
                |f| matches!(f.body, Body::HelloAck { nonce: n, .. } if n == nonce),
            )
            .await?;
            let Some(found) = found else {
                return Err(RpcError::Disconnected);
            };
            if found.skipped > 0 {
                tracing::info!(
                    bytes = found.skipped,
                    "skipped what an earlier connection left on the agent channel"
                );
            }
            let rest = found.rest;
            let (protocol, version) = match found.frame.body {
                Body::HelloAck {
                    protocol, version, ..
                } => (protocol, version),
                other => return Err(unexpected(&other)),
            };
            if protocol != PROTOCOL_VERSION {
                return Err(RpcError::VersionMismatch {
                    ours: PROTOCOL_VERSION,
                    theirs: protocol,
                    agent_version: version,
                });
            }
            Ok((version, rest))
        };
        let (agent_version, rest) = handshake.await?;
        guard.0 = None;
        let mut rd = std::io::Cursor::new(rest).chain(rd);
        let r = shared.clone();
        let reader = tokio::spawn(async move {
            let res = loop {
                tokio::select! {
                    f = read_frame(&mut rd) => match f {
                        Ok(Some(frame)) => {
                            if let Err(e) = r.dispatch(frame) {
                                break Err(e);
                            }
                        }
                        Ok(None) => break Ok(()),
                        Err(e) => break Err(RpcError::from(e)),
                    },
                    _ = r.outbox.closed() => break Ok(()),
                }
            };
            if let Err(e) = res {
                tracing::warn!(error = %e, "agent connection failed");
            }
            r.kill();
        });
        tracing::debug!(agent_version = %agent_version, "guest agent connected");
        Ok(Self {
            handle: Arc::new(Handle {
                shared,
                agent_version,
                tasks: vec![abort_writer, reader.abort_handle()],
            }),
        })
    }

    /// The version string the guest agent reported in the handshake.
    pub fn agent_version(&self) -> &str {
        &self.handle.agent_version
    }

    /// True once the connection is gone; every call then fails with `Disconnected`.
    pub fn is_closed(&self) -> bool {
        self.handle.shared.outbox.is_closed()
    }

    /// Resolves when the connection dies.
    pub async fn closed(&self) {
        self.handle.shared.outbox.closed().await
    }

    fn open(&self) -> Result<OpenStream, RpcError> {
        let (id, rx, credit) = self.handle.shared.open()?;
        Ok(OpenStream {
            handle: self.handle.clone(),
            id,
            rx,
            credit,
        })
    }

    async fn call(&self, req: Request) -> Result<Reply, RpcError> {
        let mut s = self.open()?;
        s.send(Body::Request(req))?;
        match s.recv().await? {
            Body::Reply(r) => Ok(r),
            Body::Error(e) => Err(RpcError::Remote(e)),
            other => Err(unexpected(&other)),
        }
    }

    async fn call_done(&self, req: Request) -> Result<(), RpcError> {
        match self.call(req).await? {
            Reply::Done => Ok(()),
            other => Err(RpcError::Protocol(format!("{other:?}"))),
        }
    }

    /// Round trip time of a no-op request.
    pub async fn ping(&self) -> Result<Duration, RpcError> {
        let t = Instant::now();
        match self.call(Request::Ping).await? {
            Reply::Pong => Ok(t.elapsed()),
            other => Err(RpcError::Protocol(format!("{other:?}"))),
        }
    }

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
        };
        let mut s = self.open()?;
        s.send(Body::Request(Request::Exec(spec)))?;
        // The agent answers `Started` as soon as it has spawned the command: never wait
        // forever for it (a wedged channel must fail the exec, not hang its caller).
        let first = tokio::time::timeout(EXEC_START_TIMEOUT, s.recv())
            .await
            .map_err(|_| RpcError::Timeout(EXEC_START_TIMEOUT))??;
        let (exec_id, pid) = match first {
            Body::Exec {
                seq: 1,
                event: WireExecEvent::Started { exec_id, pid },
            } => (exec_id, pid),
            Body::Error(e) => return Err(RpcError::Remote(e)),
            other => return Err(unexpected(&other)),
        };
        s.send_control(Body::ExecAck { seq: 1 })?;
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
        let mut s = self.open()?;
        s.send(Body::Request(Request::Resume { exec_id, from_seq }))?;
        match s.recv().await? {
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

    /// Reads a whole file.
    pub async fn read_file(&self, path: &str) -> Result<Vec<u8>, RpcError> {
        self.read_stream(Request::ReadFile { path: path.into() })
            .await
    }

    /// A manifest of the tree under `path` (directories named in `skip` are left out).
    pub async fn walk(&self, path: &str, skip: &[String]) -> Result<Vec<WalkEntry>, RpcError> {
        let bytes = self
            .read_stream(Request::Walk {
                path: path.into(),
                skip: skip.to_vec(),
            })
            .await?;
        let cfg = bincode::config::standard();
        let (v, n): (Vec<WalkEntry>, usize) = bincode::serde::decode_from_slice(&bytes, cfg)
            .map_err(|e| RpcError::Protocol(format!("bad walk answer: {e}")))?;
        if n != bytes.len() {
            return Err(RpcError::Protocol("trailing bytes in a walk answer".into()));
        }
        Ok(v)
    }

    /// Like [`Self::walk`], from the agent's inotify-kept walk: everything, or only what
    /// changed after `since` (see [`WalkDelta`]).
    pub async fn walk_since(
        &self,
        path: &str,
        skip: &[String],
        since: Option<WalkCursor>,
    ) -> Result<WalkDelta, RpcError> {
        let bytes = self
            .read_stream(Request::WalkSince {
                path: path.into(),
                skip: skip.to_vec(),
                since,
            })
            .await?;
        let cfg = bincode::config::standard();
        let (v, n): (WalkDelta, usize) = bincode::serde::decode_from_slice(&bytes, cfg)
            .map_err(|e| RpcError::Protocol(format!("bad walk answer: {e}")))?;
        if n != bytes.len() {
            return Err(RpcError::Protocol("trailing bytes in a walk answer".into()));
        }
        Ok(v)
    }

    /// Removes `delete` (relative to `dir`), then unpacks the `len`-byte tar archive the host
    /// wrote at the start of the disk with serial `serial` into `dir`.
    pub async fn untar_disk(
        &self,
        dir: &str,
        delete: Vec<String>,
        serial: &str,
        len: u64,
    ) -> Result<(), RpcError> {
        self.call_done(Request::UntarDisk {
            dir: dir.into(),
            delete,
            serial: serial.into(),
            len,
        })
        .await
    }

    /// Mounts the file system the host wrote on the disk with serial `serial` as the read-only
    /// lower layer of an overlayfs on `dir` (which must be empty).
    pub async fn mount_base(&self, dir: &str, serial: &str) -> Result<(), RpcError> {
        self.call_done(Request::MountBase {
            dir: dir.into(),
            serial: serial.into(),
        })
        .await
    }

    /// Sets the guest's hostname and mixes `seed` into its random pool (see
    /// [`Request::SetIdentity`]).
    pub async fn set_identity(&self, hostname: &str, seed: &[u8]) -> Result<(), RpcError> {
        self.call_done(Request::SetIdentity {
            hostname: hostname.into(),
            seed: seed.to_vec(),
        })
        .await
    }

    /// Removes `delete` (relative to `dir`), then unpacks the tar archive `tar` into `dir`.
    pub async fn untar(&self, dir: &str, delete: Vec<String>, tar: &[u8]) -> Result<(), RpcError> {
        self.write_stream(
            Request::Untar {
                dir: dir.into(),
                delete,
            },
            tar,
        )
        .await
    }

    /// Sends `req`, then collects the `Data` it answers with until `DataEnd`.
    async fn read_stream(&self, req: Request) -> Result<Vec<u8>, RpcError> {
        let mut s = self.open()?;
        s.send(Body::Request(req))?;
        let mut out = Vec::new();
        loop {
            match s.recv().await? {
                Body::Data(d) => {
                    let n = d.len() as u32;
                    out.extend_from_slice(&d);
                    s.send_control(Body::Credit(n))?;
                }
                Body::DataEnd => return Ok(out),
                Body::Error(e) => return Err(RpcError::Remote(e)),
                other => return Err(unexpected(&other)),
            }
        }
    }

    /// Writes a whole file atomically (temp file + rename) with permission bits `mode`.
    pub async fn write_file(&self, path: &str, data: &[u8], mode: u32) -> Result<(), RpcError> {
        self.write_stream(
            Request::WriteFile {
                path: path.into(),
                mode,
            },
            data,
        )
        .await
    }

    /// Sends `req` followed by `data` as `Data` + `DataEnd`; waits for `Done`.
    async fn write_stream(&self, req: Request, data: &[u8]) -> Result<(), RpcError> {
        let mut s = self.open()?;
        s.send(Body::Request(req))?;
        let shared = self.handle.shared.clone();
        let (id, credit) = (s.id, s.credit.clone());
        let send = async {
            shared.send_data(id, &credit, data).await?;
            Ok::<_, RpcError>(shared.outbox.send(Frame {
                stream: id,
                body: Body::DataEnd,
            })?)
        };
        // The guest may refuse early (bad path); then stop sending and report that.
        let mut send = std::pin::pin!(send);
        let mut sent = false;
        loop {
            tokio::select! {
                r = &mut send, if !sent => { r?; sent = true; }
                b = s.rx.recv() => return match b.ok_or(RpcError::Disconnected)? {
                    Body::Reply(Reply::Done) if sent => Ok(()),
                    Body::Error(e) => Err(RpcError::Remote(e)),
                    other => Err(unexpected(&other)),
                },
            }
        }
    }

    pub async fn stat(&self, path: &str) -> Result<FileStat, RpcError> {
        match self.call(Request::Stat { path: path.into() }).await? {
            Reply::Stat(st) => Ok(st),
            other => Err(RpcError::Protocol(format!("{other:?}"))),
        }
    }

    pub async fn list(&self, path: &str) -> Result<Vec<DirEntry>, RpcError> {
        match self.call(Request::List { path: path.into() }).await? {
            Reply::List(l) => Ok(l),
            other => Err(RpcError::Protocol(format!("{other:?}"))),
        }
    }

    /// `mkdir -p` with permission bits `mode` for the directories it creates.
    pub async fn mkdir(&self, path: &str, mode: u32) -> Result<(), RpcError> {
        self.call_done(Request::Mkdir {
            path: path.into(),
            mode,
        })
        .await
    }

    pub async fn remove(&self, path: &str, recursive: bool) -> Result<(), RpcError> {
        self.call_done(Request::Remove {
            path: path.into(),
            recursive,
        })
        .await
    }

    /// Asks the guest to sync its disks and power off. The guest answers before it powers off;
    /// a connection that drops right after the request counts as success.
    pub async fn shutdown(&self) -> Result<(), RpcError> {
        match self.call_done(Request::Shutdown).await {
            Ok(()) | Err(RpcError::Disconnected) => Ok(()),
            Err(e) => Err(e),
        }
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
                    let _ = self.s.send_control(Body::ExecAck { seq });
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
    pub async fn resize(&self, rows: u16, cols: u16) -> Result<(), RpcError> {
        self.s.send(Body::Resize { rows, cols })
    }

    /// Writes to the command's stdin, waiting for flow-control credit.
    pub async fn write_stdin(&self, data: &[u8]) -> Result<(), RpcError> {
        self.s
            .handle
            .shared
            .send_data(self.s.id, &self.s.credit, data)
            .await
    }

    /// Closes the command's stdin (EOF).
    pub async fn close_stdin(&self) -> Result<(), RpcError> {
        self.s.send(Body::DataEnd)
    }
}
