//! The host side: [`AgentClient`], one per VM, and [`ExecStream`], one per running command.
//!
//! Owns the host end of one connection: stream ids, routing of incoming frames to their
//! callers, credit for host->guest data, acks for guest->host exec events. It never retries a
//! request on its own and never outlives its connection: when the link dies every pending call
//! and every stream ends with [`RpcError::Disconnected`].
//!
//! Layout: this file has [`AgentClient`]'s request/reply and file calls; `connect` the
//! handshake and the reader/writer tasks; `streams` the per-connection state (stream ids,
//! frame routing, credit) and the guards that end a connection; `exec` running commands
//! ([`ExecRequest`], [`ExecStream`]).

mod connect;
mod exec;
mod streams;

pub use exec::{ExecEvent, ExecRequest, ExecStream};

use super::RpcError;
use super::msg::{
    Body, DirEntry, FileStat, Frame, Reply, Request, WalkCursor, WalkDelta, WalkEntry,
};
use std::sync::Arc;
use std::time::{Duration, Instant};
use streams::{Handle, OpenStream};

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

/// A walk answer: exactly one bincode value, nothing after it.
fn decode_walk<T: serde::de::DeserializeOwned>(bytes: &[u8]) -> Result<T, RpcError> {
    let cfg = bincode::config::standard();
    let (v, n): (T, usize) = bincode::serde::decode_from_slice(bytes, cfg)
        .map_err(|e| RpcError::Protocol(format!("bad walk answer: {e}")))?;
    if n != bytes.len() {
        return Err(RpcError::Protocol("trailing bytes in a walk answer".into()));
    }
    Ok(v)
}

fn unexpected(body: &Body) -> RpcError {
    let name = format!("{body:?}");
    RpcError::Protocol(name.chars().take(80).collect())
}

impl AgentClient {
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
        decode_walk(&bytes)
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
