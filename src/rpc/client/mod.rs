//! The host side: [`AgentClient`], one per VM, and [`ExecStream`], one per running command.
//!
//! Owns the host end of one connection: stream ids, routing of incoming frames to their
//! callers, credit for host->guest data, acks for guest->host exec events. It never retries a
//! request on its own and never outlives its connection: when the link dies every pending call
//! and every stream ends with [`RpcError::Disconnected`] (or [`RpcError::Closed`] with the reason
//! when the host closed it: a guest that broke the protocol or missed a deadline).
//!
//! Everything the guest sends is bounded before it is kept: frames by the codec, each stream's
//! queue by its window (`streams`), collected answers by the caller's cap (`read_stream`), decoded
//! answers by [`MAX_ANSWER`]; every request has a deadline ([`Deadlines`]) except exec output and
//! exec stdin.
//!
//! Layout: this file has [`AgentClient`]'s request/reply and file calls; `connect` the
//! handshake and the reader/writer tasks; `streams` the per-connection state (stream ids,
//! frame routing, credit) and the guards that end a connection; `exec` running commands
//! ([`ExecRequest`], [`ExecStream`]).

mod connect;
mod exec;
mod streams;
mod watch;

#[cfg(test)]
mod hostile_tests;
#[cfg(test)]
mod watch_hostile_tests;

pub use exec::{ExecControl, ExecEvent, ExecRequest, ExecStream};
pub use streams::Deadlines;
pub use watch::DirWatch;

use super::RpcError;
use super::frame::{MAX_ANSWER, decode_answer};
use super::msg::{Body, DirEntry, FileStat, Frame, Reply, Request, WalkCursor, WalkDelta};
use std::sync::Arc;
use std::time::Duration;
use streams::{Handle, OpenStream};
use tokio::io::{AsyncWrite, AsyncWriteExt};

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

/// A file being read from the guest ([`AgentClient::read_file_chunks`]).
pub struct FileChunks {
    s: OpenStream,
    done: bool,
}

impl FileChunks {
    /// The next chunk of the file, `None` at its end. Credit for a chunk goes back as it is
    /// handed over: the guest sends at most a window ahead of what the caller took.
    pub async fn next(&mut self) -> Result<Option<Vec<u8>>, RpcError> {
        if self.done {
            return Ok(None);
        }
        match self.s.recv_within("read_file").await? {
            Body::Data(d) => {
                self.s.grant(d.len())?;
                Ok(Some(d))
            }
            Body::DataEnd => {
                self.done = true;
                Ok(None)
            }
            Body::Error(e) => Err(RpcError::Remote(e)),
            other => Err(unexpected(&other)),
        }
    }
}

/// A walk answer: exactly one bincode value, nothing after it, decoded within [`MAX_ANSWER`]
/// bytes whatever lengths it declares.
fn decode_walk<T: serde::de::DeserializeOwned>(bytes: &[u8]) -> Result<T, RpcError> {
    decode_answer(bytes).map_err(|e| RpcError::Protocol(format!("bad walk answer: {e}")))
}

/// A short name of a request for errors and logs (no paths: they can be long).
fn request_name(req: &Request) -> &'static str {
    match req {
        Request::Ping => "ping",
        Request::Shutdown => "shutdown",
        Request::Exec(_) => "exec",
        Request::Resume { .. } => "resume",
        Request::ReadFile { .. } => "read_file",
        Request::WriteFile { .. } => "write_file",
        Request::Stat { .. } => "stat",
        Request::List { .. } => "list",
        Request::Mkdir { .. } => "mkdir",
        Request::Remove { .. } => "remove",
        Request::Untar { .. } => "untar",
        Request::Walk { .. } => "walk",
        Request::WalkSince { .. } => "walk_since",
        Request::UntarDisk { .. } => "untar_disk",
        Request::MountBase { .. } => "mount_base",
        Request::SetIdentity { .. } => "set_identity",
        Request::SetClock { .. } => "set_clock",
        Request::Rename { .. } => "rename",
        Request::Chown { .. } => "chown",
        Request::WatchDir { .. } => "watch_dir",
    }
}

fn unexpected(body: &Body) -> RpcError {
    let name = format!("{body:?}");
    RpcError::Protocol(name.chars().take(80).collect())
}

impl AgentClient {
    /// The version string the guest agent reported in the handshake.
    #[cfg(test)]
    pub fn agent_version(&self) -> &str {
        &self.handle.agent_version
    }

    /// True once the connection is gone; every call then fails with `Disconnected` (or
    /// `Closed`, see [`Self::close_reason`]).
    pub fn is_closed(&self) -> bool {
        self.handle.shared.outbox.is_closed()
    }

    /// Why the host closed the connection, if it did: the guest broke the protocol (more data
    /// than its window, a bad frame) or missed a deadline. `None` while open or when the link
    /// simply ended (VM stopped).
    pub fn close_reason(&self) -> Option<String> {
        self.handle.shared.reason()
    }

    /// The deadlines of this connection's requests (shared by all clones).
    pub fn deadlines(&self) -> Deadlines {
        self.handle.shared.deadlines()
    }

    /// Sets the deadlines of this connection's requests, for every clone.
    pub fn set_deadlines(&self, d: Deadlines) {
        *self
            .handle
            .shared
            .deadlines
            .lock()
            .unwrap_or_else(|p| p.into_inner()) = d;
    }

    /// Resolves when the connection dies.
    pub async fn closed(&self) {
        self.handle.shared.outbox.closed().await
    }

    /// Opens a stream; with `cancel`, dropping it before its answer ended tells the agent to
    /// abandon the request (everything but execs).
    fn open(&self, cancel: bool) -> Result<OpenStream, RpcError> {
        let o = self.handle.shared.open()?;
        Ok(OpenStream {
            handle: self.handle.clone(),
            id: o.id,
            rx: o.rx,
            credit: o.credit,
            held: o.held,
            progress: o.progress,
            cancel,
            finished: false,
        })
    }

    /// Changes each time a request missed its deadline while the agent still answered a ping
    /// ([`RpcError::Slow`]); holds that error's text. The service records it as an event.
    pub fn slow_requests(&self) -> tokio::sync::watch::Receiver<Option<String>> {
        self.handle.shared.slow.subscribe()
    }

    async fn call(&self, req: Request) -> Result<Reply, RpcError> {
        let after = self.deadlines().reply;
        self.call_within(req, after).await
    }

    /// A request answered by one `Reply` or `Error` within `after`.
    async fn call_within(&self, req: Request, after: Duration) -> Result<Reply, RpcError> {
        let what = request_name(&req);
        let mut s = self.open(true)?;
        s.send(Body::Request(req))?;
        match s.recv_for(what, after).await? {
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
        let t = std::time::Instant::now();
        match self.call(Request::Ping).await? {
            Reply::Pong => Ok(t.elapsed()),
            other => Err(RpcError::Protocol(format!("{other:?}"))),
        }
    }

    /// Reads a whole file of at most `max` bytes ([`RpcError::TooLarge`] if it has more).
    pub async fn read_file(&self, path: &str, max: u64) -> Result<Vec<u8>, RpcError> {
        let mut out = Vec::new();
        self.read_stream(Request::ReadFile { path: path.into() }, max, &mut out)
            .await?;
        Ok(out)
    }

    /// Streams a file of at most `max` bytes into `w` (e.g. a file on the host's disk); returns
    /// its length. `w` may hold a partial file after an error.
    #[cfg(test)]
    pub async fn read_file_to<W: AsyncWrite + Unpin>(
        &self,
        path: &str,
        max: u64,
        w: &mut W,
    ) -> Result<u64, RpcError> {
        self.read_stream(Request::ReadFile { path: path.into() }, max, w)
            .await
    }

    /// Reads a file chunk by chunk, as it arrives: the caller decides where the bytes go and
    /// when to stop (dropping the [`FileChunks`] ends the read on the host's side).
    pub async fn read_file_chunks(&self, path: &str) -> Result<FileChunks, RpcError> {
        let s = self.open(true)?;
        s.send(Body::Request(Request::ReadFile { path: path.into() }))?;
        Ok(FileChunks { s, done: false })
    }

    /// A manifest of the tree under `path` (directories named in `skip` are left out).
    #[cfg(test)]
    pub async fn walk(
        &self,
        path: &str,
        skip: &[String],
    ) -> Result<Vec<super::msg::WalkEntry>, RpcError> {
        let mut bytes = Vec::new();
        let req = Request::Walk {
            path: path.into(),
            skip: skip.to_vec(),
        };
        self.read_stream(req, MAX_ANSWER as u64, &mut bytes).await?;
        decode_walk(&bytes)
    }

    /// Like [`Self::walk`], from the agent's inotify-kept walk: everything, or only what
    /// changed after `since` (see [`WalkDelta`]).
    pub async fn walk_since(
        &self,
        path: &str,
        skip: &[String],
        since: Option<WalkCursor>,
        stat_all: bool,
    ) -> Result<WalkDelta, RpcError> {
        let mut bytes = Vec::new();
        let req = Request::WalkSince {
            path: path.into(),
            skip: skip.to_vec(),
            since,
            stat_all,
        };
        self.read_stream(req, MAX_ANSWER as u64, &mut bytes).await?;
        decode_walk(&bytes)
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
        // The agent unpacks without a word until done: allow for the archive's size.
        let d = self.deadlines();
        let mib = u32::try_from(len.div_ceil(1 << 20)).unwrap_or(u32::MAX);
        let after = d.reply.saturating_add(d.per_mib.saturating_mul(mib));
        let req = Request::UntarDisk {
            dir: dir.into(),
            delete,
            serial: serial.into(),
            len,
        };
        match self.call_within(req, after).await? {
            Reply::Done => Ok(()),
            other => Err(RpcError::Protocol(format!("{other:?}"))),
        }
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

    /// Sets the guest's wall clock to `unix_ms` (see [`Request::SetClock`]): queues the request
    /// now and returns the wait for its answer, which the caller need not await before its
    /// next request. The outbox writes streams' first frames in the order they were queued,
    /// and the agent sets the clock before it reads the next frame, so every request queued
    /// after this call runs on the new time (saves a round trip on restore, resume and fork).
    pub fn set_clock_queued(
        &self,
        unix_ms: u64,
    ) -> Result<impl Future<Output = Result<(), RpcError>> + Send + 'static, RpcError> {
        let after = self.deadlines().reply;
        let mut s = self.open(true)?;
        s.send(Body::Request(Request::SetClock { unix_ms }))?;
        Ok(async move {
            match s.recv_for("set_clock", after).await? {
                Body::Reply(Reply::Done) => Ok(()),
                Body::Error(e) => Err(RpcError::Remote(e)),
                other => Err(unexpected(&other)),
            }
        })
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

    /// Sends `req`, then writes the `Data` it answers with into `w` until `DataEnd`: at most
    /// `max` bytes (more fails with [`RpcError::TooLarge`] and abandons the stream), each chunk
    /// within the reply deadline. Returns the byte count.
    async fn read_stream<W: AsyncWrite + Unpin>(
        &self,
        req: Request,
        max: u64,
        w: &mut W,
    ) -> Result<u64, RpcError> {
        let what = request_name(&req);
        let mut s = self.open(true)?;
        s.send(Body::Request(req))?;
        let mut total = 0u64;
        loop {
            match s.recv_within(what).await? {
                Body::Data(d) => {
                    total += d.len() as u64;
                    if total > max {
                        // Dropping the stream sends `Cancel`: the agent stops reading.
                        return Err(RpcError::TooLarge {
                            what: what.to_owned(),
                            max,
                        });
                    }
                    w.write_all(&d).await.map_err(RpcError::Store)?;
                    s.grant(d.len())?;
                }
                Body::DataEnd => {
                    w.flush().await.map_err(RpcError::Store)?;
                    return Ok(total);
                }
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

    /// Sends `req` followed by `data` as `Data` + `DataEnd`; waits for `Done`. Credit for each
    /// chunk, then the answer, must come within the reply deadline.
    async fn write_stream(&self, req: Request, data: &[u8]) -> Result<(), RpcError> {
        let what = request_name(&req);
        let mut s = self.open(true)?;
        s.send(Body::Request(req))?;
        let shared = self.handle.shared.clone();
        let (id, credit) = (s.id, s.credit.clone());
        let after = shared.deadlines().reply;
        let waiting = s.waiting(what, after);
        let send = async {
            shared.send_data(id, &credit, data, Some(waiting)).await?;
            shared
                .outbox
                .send(Frame {
                    stream: id,
                    body: Body::DataEnd,
                })
                .map_err(|_| shared.gone())
        };
        // The guest may refuse early (bad path); then stop sending and report that.
        let early = tokio::select! {
            r = send => { r?; None }
            b = s.recv() => Some(b?),
        };
        let sent = early.is_none();
        let answer = match early {
            Some(b) => b,
            None => s.recv_within(what).await?,
        };
        match answer {
            Body::Reply(Reply::Done) if sent => Ok(()),
            Body::Error(e) => Err(RpcError::Remote(e)),
            other => Err(unexpected(&other)),
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

    /// `rename(2)` inside the guest (see [`Request::Rename`]).
    pub async fn rename(&self, from: &str, to: &str) -> Result<(), RpcError> {
        self.call_done(Request::Rename {
            from: from.into(),
            to: to.into(),
        })
        .await
    }

    /// `lchown(2)` inside the guest (see [`Request::Chown`]).
    pub async fn chown(&self, path: &str, uid: u32, gid: u32) -> Result<(), RpcError> {
        self.call_done(Request::Chown {
            path: path.into(),
            uid,
            gid,
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

#[cfg(test)]
mod order_tests {
    use crate::rpc::hostile::{fake_guest, next_request, send};
    use crate::rpc::msg::{Body, Reply, Request};
    use std::time::Duration;

    /// A queued clock request reaches the agent before any request sent after it, although
    /// its answer is not awaited first (restore, resume and fork rely on it).
    #[tokio::test]
    async fn a_queued_clock_request_goes_out_before_later_requests() {
        let (c, mut g) = fake_guest().await;
        let answer = c.set_clock_queued(1_234).unwrap();
        let ping = tokio::spawn(async move { c.ping().await });
        let (s1, r1) = next_request(&mut g).await.unwrap();
        assert!(matches!(r1, Request::SetClock { unix_ms: 1_234 }), "{r1:?}");
        let (s2, r2) = next_request(&mut g).await.unwrap();
        assert!(matches!(r2, Request::Ping), "{r2:?}");
        // Answered out of order: each waiter still gets its own answer.
        send(&mut g, s2, Body::Reply(Reply::Pong)).await;
        send(&mut g, s1, Body::Reply(Reply::Done)).await;
        let t = Duration::from_secs(20);
        tokio::time::timeout(t, ping)
            .await
            .unwrap()
            .unwrap()
            .unwrap();
        tokio::time::timeout(t, answer).await.unwrap().unwrap();
    }
}
