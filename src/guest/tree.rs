//! Workspace requests: unpack a tar stream into a directory (sync) and walk a tree into a
//! manifest (diff).
//!
//! Owns the guest end of workspace sync. Paths inside the archive and the delete list are
//! relative and may not contain `..` (the tar crate refuses entries that would land outside the
//! target; the delete list is checked here). It never follows a symlink while walking.

use crate::rpc::frame::CHUNK;
use crate::rpc::msg::{Body, ErrorKind, FileKind, Frame, RemoteError, Reply, WalkEntry};
use crate::rpc::outbox::Outbox;
use std::collections::HashSet;
use std::io::Read;
use std::os::unix::fs::MetadataExt;
use std::path::{Component, Path, PathBuf};
use std::sync::Arc;
use tokio::sync::{Semaphore, mpsc};

use super::files::{WriteMsg, check_path};
use super::progress::{Ticker, Work, remove_tree};
use std::sync::atomic::{AtomicU64, Ordering};

/// Blocking reader over the `Data` frames of a stream; grants credit as it consumes.
struct ChannelReader {
    rx: mpsc::UnboundedReceiver<WriteMsg>,
    buf: Vec<u8>,
    pos: usize,
    done: bool,
}

impl Read for ChannelReader {
    fn read(&mut self, out: &mut [u8]) -> std::io::Result<usize> {
        while self.pos == self.buf.len() {
            if self.done {
                return Ok(0);
            }
            match self.rx.blocking_recv() {
                Some(WriteMsg::Data(d, owed)) => {
                    owed.give();
                    self.buf = d;
                    self.pos = 0;
                }
                Some(WriteMsg::End) => self.done = true,
                None => {
                    return Err(std::io::Error::new(
                        std::io::ErrorKind::ConnectionAborted,
                        "the host went away mid-archive",
                    ));
                }
            }
        }
        let n = out.len().min(self.buf.len() - self.pos);
        out[..n].copy_from_slice(&self.buf[self.pos..self.pos + n]);
        self.pos += n;
        Ok(n)
    }
}

fn relative(rel: &str) -> Result<&Path, RemoteError> {
    let p = Path::new(rel);
    if rel.is_empty() || !p.components().all(|c| matches!(c, Component::Normal(_))) {
        return Err(RemoteError::new(
            ErrorKind::InvalidRequest,
            format!("{rel:?} is not a plain relative path"),
        ));
    }
    Ok(p)
}

/// Remove every existing parent of `rel` under `root` that is not a real directory.
fn clear_parents(root: &Path, rel: &Path) -> Result<(), RemoteError> {
    let mut p = root.to_path_buf();
    let comps: Vec<_> = rel.components().collect();
    for c in comps.iter().take(comps.len().saturating_sub(1)) {
        let Component::Normal(name) = c else {
            return Err(RemoteError::new(
                ErrorKind::InvalidRequest,
                format!("{} is not a plain relative path", rel.display()),
            ));
        };
        p.push(name);
        match std::fs::symlink_metadata(&p) {
            Ok(md) if !md.is_dir() => std::fs::remove_file(&p)
                .map_err(|e| RemoteError::from_io(&format!("replace {}", p.display()), &e))?,
            Ok(_) => {}
            Err(_) => return Ok(()),
        }
    }
    Ok(())
}

/// Removes `delete`, then unpacks the archive arriving on `rx` into `dir`.
pub async fn untar(
    dir: String,
    delete: Vec<String>,
    rx: mpsc::UnboundedReceiver<WriteMsg>,
    outbox: Arc<Outbox>,
    stream: u32,
) {
    let work = Work::default();
    let _ticker = Ticker::start(outbox.clone(), stream, work.clone());
    let res = tokio::task::spawn_blocking(move || {
        let reader = ChannelReader {
            rx,
            buf: Vec::new(),
            pos: 0,
            done: false,
        };
        unpack(&dir, &delete, reader, &work)
    })
    .await
    .unwrap_or_else(|e| Err(RemoteError::new(ErrorKind::Other, e.to_string())));
    let body = match res {
        Ok(()) => Body::Reply(Reply::Done),
        Err(e) => Body::Error(e),
    };
    let _ = outbox.send(Frame { stream, body });
}

// BLKFLSBUF: write back and drop the page cache of a block device.
nix::ioctl_none!(blkflsbuf, 0x12, 97);

/// The block device whose virtio serial is `serial` (`/sys/block/*/serial`).
pub(super) fn disk_by_serial(serial: &str) -> Result<PathBuf, RemoteError> {
    let rd =
        std::fs::read_dir("/sys/block").map_err(|e| RemoteError::from_io("list /sys/block", &e))?;
    for ent in rd.flatten() {
        let s = std::fs::read_to_string(ent.path().join("serial")).unwrap_or_default();
        if s.trim() == serial {
            return Ok(Path::new("/dev").join(ent.file_name()));
        }
    }
    Err(RemoteError::new(
        ErrorKind::NotFound,
        format!("no disk with serial {serial:?}"),
    ))
}

/// `UntarDisk`: removes `delete`, then unpacks the first `len` bytes of the transfer disk.
pub fn untar_disk(
    dir: &str,
    delete: &[String],
    serial: &str,
    len: u64,
    work: &AtomicU64,
) -> Result<(), RemoteError> {
    let dev = disk_by_serial(serial)?;
    let ctx = |e: std::io::Error| RemoteError::from_io(&format!("read {}", dev.display()), &e);
    let f = std::fs::File::open(&dev).map_err(ctx)?;
    // The host rewrote the disk behind the guest's back: nothing cached from before may be read.
    // SAFETY: BLKFLSBUF takes no argument; `f` is an open block device for the whole call.
    unsafe { blkflsbuf(std::os::fd::AsRawFd::as_raw_fd(&f)) }
        .map_err(|e| ctx(std::io::Error::from(e)))?;
    let reader = std::io::BufReader::with_capacity(1 << 20, f).take(len);
    unpack(dir, delete, reader, work)
}

/// Removes `delete` under `dir`, then unpacks the tar archive read from `reader` into it,
/// counting each entry deleted or unpacked in `work`.
fn unpack(
    dir: &str,
    delete: &[String],
    reader: impl Read,
    work: &AtomicU64,
) -> Result<(), RemoteError> {
    let root = check_path(dir)?;
    std::fs::create_dir_all(&root)
        .map_err(|e| RemoteError::from_io(&format!("mkdir {}", root.display()), &e))?;
    for rel in delete {
        let p = root.join(relative(rel)?);
        // One deleted directory can hold 100k files: count each (see `progress`).
        let r = match remove_tree(&p, work) {
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
            r => r,
        };
        r.map_err(|e| RemoteError::from_io(&format!("remove {}", p.display()), &e))?;
    }
    let mut ar = tar::Archive::new(reader);
    ar.set_preserve_permissions(true);
    ar.set_preserve_mtime(true);
    ar.set_overwrite(true);
    let entries = ar
        .entries()
        .map_err(|e| RemoteError::from_io("read archive", &e))?;
    // Parent directories already checked (or made) by this archive: checked once each.
    let mut ok_dirs: HashSet<PathBuf> = HashSet::new();
    for ent in entries {
        let mut ent = ent.map_err(|e| RemoteError::from_io("read archive", &e))?;
        let rel = ent.path().map(|p| p.to_path_buf()).unwrap_or_default();
        let rel_str = rel.to_string_lossy().into_owned();
        relative(&rel_str)?;
        let ctx = |e: std::io::Error| RemoteError::from_io(&format!("unpack {rel_str}"), &e);
        if let Some(parent) = rel.parent().filter(|p| !p.as_os_str().is_empty())
            && !ok_dirs.contains(parent)
        {
            // The host wins: a parent that is a symlink or a file in the VM (made by a
            // command there) is replaced by the host's directory, never written through.
            clear_parents(&root, &rel)?;
            std::fs::create_dir_all(root.join(parent)).map_err(ctx)?;
            for a in parent.ancestors().filter(|a| !a.as_os_str().is_empty()) {
                ok_dirs.insert(a.to_path_buf());
            }
        }
        // A file replacing a directory (or the reverse) must go first.
        let dst = root.join(&rel);
        let want_dir = ent.header().entry_type().is_dir();
        if let Ok(md) = std::fs::symlink_metadata(&dst)
            && md.is_dir() != want_dir
        {
            let _ = if md.is_dir() {
                std::fs::remove_dir_all(&dst)
            } else {
                std::fs::remove_file(&dst)
            };
        }
        ent.unpack(&dst).map_err(ctx)?;
        work.fetch_add(1, Ordering::Relaxed);
        if want_dir {
            ok_dirs.insert(rel);
        }
    }
    Ok(())
}

fn walk_into(
    root: &Path,
    dir: &Path,
    skip: &[String],
    out: &mut Vec<WalkEntry>,
    work: &AtomicU64,
) -> std::io::Result<()> {
    let mut ents: Vec<_> = std::fs::read_dir(dir)?.flatten().collect();
    ents.sort_by_key(|e| e.file_name());
    for ent in ents {
        let p = ent.path();
        let Ok(md) = std::fs::symlink_metadata(&p) else {
            continue; // removed while walking
        };
        let ft = md.file_type();
        let kind = FileKind::of(ft);
        let name = ent.file_name().to_string_lossy().into_owned();
        if kind == FileKind::Dir && skip.contains(&name) {
            continue;
        }
        let rel = p
            .strip_prefix(root)
            .map(|r| r.to_string_lossy().into_owned())
            .unwrap_or(name);
        let link = if kind == FileKind::Symlink {
            std::fs::read_link(&p)
                .ok()
                .map(|t| t.to_string_lossy().into_owned())
        } else {
            None
        };
        work.fetch_add(1, Ordering::Relaxed);
        out.push(WalkEntry {
            path: rel,
            kind,
            size: md.len(),
            mode: md.mode() & 0o7777,
            mtime: md.mtime(),
            mtime_nsec: md.mtime_nsec() as u32,
            link,
            base: false,
        });
        if kind == FileKind::Dir {
            walk_into(root, &p, skip, out, work)?;
        }
    }
    Ok(())
}

/// Answers `WalkSince` from the agent's walk cache (see [`super::watch`]) and streams the
/// encoded [`crate::rpc::msg::WalkDelta`] within the stream's credit.
/// The fields of a `WalkSince` request.
pub struct WalkSinceArgs {
    pub path: String,
    pub skip: Vec<String>,
    pub since: Option<crate::rpc::msg::WalkCursor>,
    pub stat_all: bool,
}

pub async fn walk_since(
    cache: Arc<std::sync::Mutex<Option<super::watch::WalkCache>>>,
    args: WalkSinceArgs,
    outbox: Arc<Outbox>,
    stream: u32,
    credit: Arc<Semaphore>,
) {
    let ticker = Ticker::watching(outbox.clone(), stream, || {
        super::watch::SCANNED.load(Ordering::Relaxed)
    });
    let res = tokio::task::spawn_blocking(move || {
        let WalkSinceArgs {
            path,
            skip,
            since,
            stat_all,
        } = args;
        let root: PathBuf = check_path(&path)?;
        let mut slot = cache.lock().unwrap_or_else(|p| p.into_inner());
        let d = super::watch::walk_since(&mut slot, &root, &skip, since, stat_all)
            .map_err(|e| RemoteError::from_io(&format!("walk {}", root.display()), &e))?;
        let n = d.entries.len() + d.removed.len();
        crate::rpc::frame::encode_answer(&d).map_err(|e| too_many(n, e))
    })
    .await
    .unwrap_or_else(|e| Err(RemoteError::new(ErrorKind::Other, e.to_string())));
    drop(ticker);
    send_bytes(res, outbox, stream, credit).await;
}

/// Walks `path` and streams the encoded manifest within the stream's credit.
pub async fn walk(
    path: String,
    skip: Vec<String>,
    outbox: Arc<Outbox>,
    stream: u32,
    credit: Arc<Semaphore>,
) {
    let work = Work::default();
    let ticker = Ticker::start(outbox.clone(), stream, work.clone());
    let res = tokio::task::spawn_blocking(move || {
        let root: PathBuf = check_path(&path)?;
        let mut out = Vec::new();
        if root.is_dir() {
            walk_into(&root, &root, &skip, &mut out, &work)
                .map_err(|e| RemoteError::from_io(&format!("walk {}", root.display()), &e))?;
        }
        crate::rpc::frame::encode_answer(&out).map_err(|e| too_many(out.len(), e))
    })
    .await
    .unwrap_or_else(|e| Err(RemoteError::new(ErrorKind::Other, e.to_string())));
    drop(ticker);
    send_bytes(res, outbox, stream, credit).await;
}

/// The error for a walk answer that does not encode within what the host accepts.
fn too_many(n: usize, e: crate::rpc::frame::FrameError) -> RemoteError {
    match e {
        crate::rpc::frame::FrameError::AnswerTooLarge(_) => RemoteError::new(
            ErrorKind::InvalidRequest,
            format!("the workspace has too many files for one walk: {n} ({e})"),
        ),
        e => RemoteError::new(ErrorKind::Other, e.to_string()),
    }
}

/// Streams an encoded answer (or its error) within the stream's credit.
async fn send_bytes(
    res: Result<Vec<u8>, RemoteError>,
    outbox: Arc<Outbox>,
    stream: u32,
    credit: Arc<Semaphore>,
) {
    let bytes = match res {
        Ok(b) => b,
        Err(e) => {
            let _ = outbox.send(Frame {
                stream,
                body: Body::Error(e),
            });
            return;
        }
    };
    for chunk in bytes.chunks(CHUNK) {
        match credit
            .acquire_many(crate::rpc::data_cost(chunk.len()) as u32)
            .await
        {
            Ok(p) => p.forget(),
            Err(_) => return,
        }
        if outbox
            .send(Frame {
                stream,
                body: Body::Data(chunk.to_vec()),
            })
            .is_err()
        {
            return;
        }
    }
    let _ = outbox.send(Frame {
        stream,
        body: Body::DataEnd,
    });
}
