//! File requests: read, atomic write, stat, list, mkdir -p, remove.
//!
//! Owns guest-path file access for the host. Paths are guest paths and must be absolute
//! (relative ones are refused: there is no meaningful cwd for the host). It never follows the
//! host's idea of safety beyond that: inside the VM the host is root.

use crate::rpc::frame::CHUNK;
use crate::rpc::msg::{Body, DirEntry, ErrorKind, FileKind, FileStat, Frame, RemoteError, Reply};
use crate::rpc::outbox::Outbox;
use crate::rpc::{WINDOW, data_cost};
use std::os::unix::fs::{DirBuilderExt, MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::sync::{Semaphore, mpsc};

/// Content of a file being written, as it arrives, with the credit owed for each chunk.
pub enum WriteMsg {
    Data(Vec<u8>, Owed),
    End,
}

/// Host->guest `Data` of one stream that the agent has received and not yet credited back. The
/// host may have at most [`WINDOW`] of it in flight; more is a broken host, and the agent ends
/// the connection instead of queueing it (`server::serve`).
#[derive(Default)]
pub struct Inflow(AtomicUsize);

impl Inflow {
    /// Counts a received `Data` frame of `len` bytes at its [`data_cost`] (so empty frames are
    /// not free): the credit owed for it, or `None` past the window.
    pub fn receive(
        self: &Arc<Self>,
        len: usize,
        outbox: &Arc<Outbox>,
        stream: u32,
    ) -> Option<Owed> {
        let n = data_cost(len);
        if self.0.fetch_add(n, Ordering::AcqRel) + n > WINDOW {
            return None;
        }
        Some(Owed {
            inflow: self.clone(),
            outbox: outbox.clone(),
            stream,
            n,
        })
    }
}

/// The credit owed for one received chunk, given back once the chunk is consumed.
pub struct Owed {
    inflow: Arc<Inflow>,
    outbox: Arc<Outbox>,
    stream: u32,
    n: usize,
}

impl Owed {
    pub fn give(self) {
        let _ = self
            .inflow
            .0
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |h| {
                Some(h.saturating_sub(self.n))
            });
        let _ = self.outbox.send_control(Frame {
            stream: self.stream,
            body: Body::Credit(self.n as u32),
        });
    }
}

fn unique_suffix() -> String {
    static COUNTER: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let n = COUNTER.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.subsec_nanos())
        .unwrap_or(0);
    format!("{}-{n}-{nanos:x}", std::process::id())
}

/// The name of the temporary file a write of `name` goes through (renamed over `name` when
/// complete).
pub fn temp_name(name: &str) -> String {
    format!(".{name}.tryboxi-{}", unique_suffix())
}

/// Whether `name` is one of [`temp_name`]'s (`.<name>.tryboxi-<pid>-<n>-<hex>`): directory
/// watches do not report them.
pub fn is_temp_name(name: &str) -> bool {
    let Some((head, tail)) = name.rsplit_once(".tryboxi-") else {
        return false;
    };
    let parts: Vec<&str> = tail.split('-').collect();
    head.len() > 1
        && head.starts_with('.')
        && parts.len() == 3
        && parts[..2]
            .iter()
            .all(|p| !p.is_empty() && p.bytes().all(|b| b.is_ascii_digit()))
        && !parts[2].is_empty()
        && parts[2].bytes().all(|b| b.is_ascii_hexdigit())
}

pub fn check_path(path: &str) -> Result<PathBuf, RemoteError> {
    if !path.starts_with('/') {
        return Err(RemoteError::new(
            ErrorKind::InvalidRequest,
            format!("path {path:?} is not absolute; guest paths must start with /"),
        ));
    }
    if path.contains('\0') {
        return Err(RemoteError::new(
            ErrorKind::InvalidRequest,
            "path contains a NUL byte",
        ));
    }
    Ok(PathBuf::from(path))
}

fn stat_of(p: &Path, md: &std::fs::Metadata) -> FileStat {
    let ft = md.file_type();
    let kind = FileKind::of(ft);
    let link = match kind {
        FileKind::Symlink => std::fs::read_link(p)
            .ok()
            .map(|t| t.to_string_lossy().into_owned()),
        _ => None,
    };
    FileStat {
        kind,
        size: md.len(),
        mode: md.mode() & 0o7777,
        mtime: md.mtime(),
        uid: md.uid(),
        gid: md.gid(),
        link,
    }
}

/// Answers stat/list/mkdir/remove (blocking file system calls; run on a blocking thread).
/// A recursive remove counts each entry it removes in `work` (its progress).
pub fn simple(
    req: crate::rpc::msg::Request,
    work: &std::sync::atomic::AtomicU64,
) -> Result<Reply, RemoteError> {
    use crate::rpc::msg::Request as R;
    let ctx = |what: &str, p: &Path| format!("{what} {}", p.display());
    match req {
        R::Stat { path } => {
            let p = check_path(&path)?;
            let md = std::fs::symlink_metadata(&p)
                .map_err(|e| RemoteError::from_io(&ctx("stat", &p), &e))?;
            Ok(Reply::Stat(stat_of(&p, &md)))
        }
        R::List { path } => {
            let p = check_path(&path)?;
            let rd =
                std::fs::read_dir(&p).map_err(|e| RemoteError::from_io(&ctx("list", &p), &e))?;
            let mut out = Vec::new();
            for ent in rd {
                let ent = ent.map_err(|e| RemoteError::from_io(&ctx("list", &p), &e))?;
                // An entry removed while listing is skipped, not an error.
                let path = ent.path();
                let Ok(md) = std::fs::symlink_metadata(&path) else {
                    continue;
                };
                out.push(DirEntry {
                    name: ent.file_name().to_string_lossy().into_owned(),
                    stat: stat_of(&path, &md),
                });
            }
            out.sort_by(|a, b| a.name.cmp(&b.name));
            Ok(Reply::List(out))
        }
        R::Mkdir { path, mode } => {
            let p = check_path(&path)?;
            std::fs::DirBuilder::new()
                .recursive(true)
                .mode(mode & 0o7777)
                .create(&p)
                .map_err(|e| RemoteError::from_io(&ctx("mkdir", &p), &e))?;
            Ok(Reply::Done)
        }
        R::Remove { path, recursive } => {
            let p = check_path(&path)?;
            if p == Path::new("/") {
                return Err(RemoteError::new(
                    ErrorKind::InvalidRequest,
                    "refusing to remove /",
                ));
            }
            let md = std::fs::symlink_metadata(&p)
                .map_err(|e| RemoteError::from_io(&ctx("remove", &p), &e))?;
            let r = if md.is_dir() {
                if recursive {
                    super::progress::remove_tree(&p, work)
                } else {
                    std::fs::remove_dir(&p)
                }
            } else {
                std::fs::remove_file(&p)
            };
            r.map_err(|e| RemoteError::from_io(&ctx("remove", &p), &e))?;
            Ok(Reply::Done)
        }
        R::Rename { from, to } => {
            let (f, t) = (check_path(&from)?, check_path(&to)?);
            if f == Path::new("/") || t == Path::new("/") {
                return Err(RemoteError::new(
                    ErrorKind::InvalidRequest,
                    "refusing to move /",
                ));
            }
            std::fs::rename(&f, &t).map_err(|e| RemoteError::from_io(&ctx("move", &f), &e))?;
            Ok(Reply::Done)
        }
        R::Chown { path, uid, gid } => {
            let p = check_path(&path)?;
            std::os::unix::fs::lchown(&p, Some(uid), Some(gid))
                .map_err(|e| RemoteError::from_io(&ctx("chown", &p), &e))?;
            Ok(Reply::Done)
        }
        other => Err(RemoteError::new(
            ErrorKind::Protocol,
            format!("not a file request: {other:?}"),
        )),
    }
}

/// Streams a regular file to the host as `Data` chunks within the stream's credit, then
/// `DataEnd`. A symlink at the last component is not followed and anything but a regular file
/// (a device such as `/dev/zero`, a FIFO) is refused: the host reads what the walk listed.
///
/// Ends quietly when the host cancels the stream (its semaphore is closed): the stream's task
/// ends then, even inside a read that blocks.
pub async fn read(path: String, outbox: Arc<Outbox>, stream: u32, credit: Arc<Semaphore>) {
    let cancelled = {
        let credit = credit.clone();
        async move {
            while !credit.is_closed() {
                tokio::time::sleep(std::time::Duration::from_millis(200)).await;
            }
        }
    };
    let work = async {
        let p = check_path(&path)?;
        let ctx = |e: std::io::Error| RemoteError::from_io(&format!("read {}", p.display()), &e);
        let mut f = tokio::fs::OpenOptions::new()
            .read(true)
            // O_NONBLOCK: opening a FIFO must not wait for a writer (regular files ignore it).
            .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK)
            .open(&p)
            .await
            .map_err(|e| {
                if e.raw_os_error() == Some(libc::ELOOP) {
                    RemoteError::new(
                        ErrorKind::InvalidRequest,
                        format!("read {}: a symlink (not followed)", p.display()),
                    )
                } else {
                    ctx(e)
                }
            })?;
        if !f.metadata().await.map_err(ctx)?.is_file() {
            return Err(RemoteError::new(
                ErrorKind::InvalidRequest,
                format!("read {}: not a regular file", p.display()),
            ));
        }
        let mut buf = vec![0u8; CHUNK];
        loop {
            let n = f.read(&mut buf).await.map_err(ctx)?;
            if n == 0 {
                break;
            }
            match credit.acquire_many(data_cost(n) as u32).await {
                Ok(permit) => permit.forget(),
                Err(_) => return Ok(()), // the connection is gone
            }
            if outbox
                .send(Frame {
                    stream,
                    body: Body::Data(buf[..n].to_vec()),
                })
                .is_err()
            {
                return Ok(());
            }
        }
        let _ = outbox.send(Frame {
            stream,
            body: Body::DataEnd,
        });
        Ok(())
    };
    let res = tokio::select! {
        r = work => r,
        () = cancelled => Ok(()),
    };
    if let Err(e) = res {
        let _ = outbox.send(Frame {
            stream,
            body: Body::Error(e),
        });
    }
}

/// Receives a file's content into a temporary file next to `path`, then renames it in place.
pub async fn write(
    path: String,
    mode: u32,
    mut rx: mpsc::UnboundedReceiver<WriteMsg>,
    outbox: Arc<Outbox>,
    stream: u32,
) {
    let mut tmp: Option<PathBuf> = None;
    let res: Result<bool, RemoteError> = async {
        let p = check_path(&path)?;
        let (Some(dir), Some(name)) = (p.parent(), p.file_name()) else {
            return Err(RemoteError::new(
                ErrorKind::InvalidRequest,
                format!("{path:?} names no file"),
            ));
        };
        // Not getrandom: in a fresh VM without a hardware RNG it blocks until the kernel's
        // entropy pool is ready, which under TCG can take minutes. Unique is enough here.
        let t = dir.join(temp_name(&name.to_string_lossy()));
        let ctx = |e: std::io::Error| RemoteError::from_io(&format!("write {}", p.display()), &e);
        let mut f = tokio::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(mode & 0o7777)
            .open(&t)
            .await
            .map_err(ctx)?;
        tmp = Some(t.clone());
        loop {
            match rx.recv().await {
                Some(WriteMsg::Data(d, owed)) => {
                    f.write_all(&d).await.map_err(ctx)?;
                    owed.give();
                }
                Some(WriteMsg::End) => break,
                None => return Ok(false), // connection gone: abandon
            }
        }
        f.flush().await.map_err(ctx)?;
        // The umask may have narrowed the mode at create time; set it exactly.
        f.set_permissions(std::fs::Permissions::from_mode(mode & 0o7777))
            .await
            .map_err(ctx)?;
        f.sync_all().await.map_err(ctx)?;
        drop(f);
        tokio::fs::rename(&t, &p).await.map_err(ctx)?;
        tmp = None;
        Ok(true)
    }
    .await;
    if let Some(t) = tmp {
        let _ = tokio::fs::remove_file(t).await;
    }
    let body = match res {
        Ok(true) => Body::Reply(Reply::Done),
        Ok(false) => return,
        Err(e) => Body::Error(e),
    };
    let _ = outbox.send(Frame { stream, body });
}
