//! Directory watches for the host (`WatchDir`): inotify events turned into envd's event kinds
//! and streamed as they happen.
//!
//! Owns the guest end of `WatchDir`: one inotify instance per watch, a watch on the directory
//! (and, when recursive, on each subdirectory down to [`WATCH_MAX_DEPTH`], at most
//! [`WATCH_MAX_DIRS`]; a directory created later is watched as it appears and what it already
//! holds is reported as created), the mapping of inotify masks onto [`WatchKind`] the way
//! envd's fsnotify does ([`kind_of`]), and a bounded queue of events waiting for the host's
//! credit ([`MAX_PENDING`]; past it events are counted as lost, never kept). A write raises
//! `IN_MODIFY` and later `IN_CLOSE_WRITE`: the close is reported only when no modify came
//! before it, and a burst of modifies of one file not yet sent is reported once. The agent's own
//! whole-file writes (`WriteFile`: a temporary file renamed over the target) are reported as a
//! create and a write of the target; the temporary name never shows.
//!
//! The watch ends when the host cancels it, the connection ends, or the watched directory is
//! removed or moved away (then with a `NotFound` error).

use std::collections::{HashMap, HashSet, VecDeque};
use std::os::fd::{AsFd, AsRawFd, RawFd};
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use nix::errno::Errno;
use nix::sys::inotify::{AddWatchFlags, InitFlags, Inotify, InotifyEvent, WatchDescriptor};
use tokio::io::unix::AsyncFd;
use tokio::sync::{Notify, Semaphore};

use super::files::{check_path, is_temp_name};
use crate::rpc::data_cost;
use crate::rpc::frame::{CHUNK, encode_answer};
use crate::rpc::msg::{
    Body, ErrorKind, Frame, RemoteError, WATCH_MAX_BATCH, WATCH_MAX_DEPTH, WATCH_MAX_DIRS,
    WATCH_MAX_NAME, WatchBatch, WatchEvent, WatchKind,
};
use crate::rpc::outbox::Outbox;

/// Events kept while the host gives no credit; more are counted in [`WatchBatch::lost`].
pub const MAX_PENDING: usize = 16_384;
/// Files remembered as modified and not yet closed (to skip their `IN_CLOSE_WRITE`).
const MAX_MODIFIED: usize = 4096;
/// `read(2)`s of the inotify fd per wakeup, so a flood cannot starve the sending.
const READS_PER_WAKEUP: usize = 64;

/// What a watched directory reports (the same as the walk's watches, see `watch.rs`).
fn mask() -> AddWatchFlags {
    super::watch::dir_mask()
}

/// envd's (fsnotify's) kind of an inotify event on an entry of a watched directory: `None` for
/// masks it does not report.
pub fn kind_of(m: AddWatchFlags) -> Option<WatchKind> {
    if m.intersects(AddWatchFlags::IN_CREATE | AddWatchFlags::IN_MOVED_TO) {
        Some(WatchKind::Create)
    } else if m.contains(AddWatchFlags::IN_DELETE) {
        Some(WatchKind::Remove)
    } else if m.contains(AddWatchFlags::IN_MOVED_FROM) {
        Some(WatchKind::Rename)
    } else if m.intersects(AddWatchFlags::IN_MODIFY | AddWatchFlags::IN_CLOSE_WRITE) {
        Some(WatchKind::Write)
    } else if m.contains(AddWatchFlags::IN_ATTRIB) {
        Some(WatchKind::Chmod)
    } else {
        None
    }
}

fn join(dir: &str, name: &str) -> String {
    if dir.is_empty() {
        name.to_owned()
    } else {
        format!("{dir}/{name}")
    }
}

/// Why a watch ended (sent to the host as its `Error`).
fn gone(root: &Path) -> RemoteError {
    RemoteError::new(
        ErrorKind::NotFound,
        format!(
            "{}: the watched directory was removed or moved",
            root.display()
        ),
    )
}

/// One directory watch.
pub struct DirWatch {
    ino: Inotify,
    root: PathBuf,
    recursive: bool,
    /// Watch -> (directory relative to the root, "" = the root; its depth).
    dirs: HashMap<WatchDescriptor, (String, usize)>,
    pending: VecDeque<WatchEvent>,
    lost: u64,
    /// Names with an `IN_MODIFY` and no `IN_CLOSE_WRITE` since.
    modified: HashSet<String>,
    /// Most directories watched ([`WATCH_MAX_DIRS`]; less in tests).
    max_dirs: usize,
    /// The cookie of the last move of one of the agent's own temporary files (a whole-file
    /// write about to land under its real name).
    temp_move: Option<u32>,
}

impl AsRawFd for DirWatch {
    fn as_raw_fd(&self) -> RawFd {
        self.ino.as_fd().as_raw_fd()
    }
}

impl DirWatch {
    /// Watches `root` (which must be a directory) and, with `recursive`, its tree.
    pub fn start(root: &str, recursive: bool) -> Result<DirWatch, RemoteError> {
        Self::start_with(root, recursive, WATCH_MAX_DIRS)
    }

    fn start_with(root: &str, recursive: bool, max_dirs: usize) -> Result<DirWatch, RemoteError> {
        let root = check_path(root)?;
        super::watch::raise_limits();
        let ino = Inotify::init(InitFlags::IN_NONBLOCK | InitFlags::IN_CLOEXEC)
            .map_err(|e| RemoteError::from_io("inotify_init", &e.into()))?;
        let mut w = DirWatch {
            ino,
            root,
            recursive,
            dirs: HashMap::new(),
            pending: VecDeque::new(),
            lost: 0,
            modified: HashSet::new(),
            max_dirs,
            temp_move: None,
        };
        // The root follows a symlink (as listing it would); nothing below it does.
        match w.ino.add_watch(&w.root, mask()) {
            Ok(wd) => {
                w.dirs.insert(wd, (String::new(), 0));
            }
            Err(Errno::ENOTDIR) => {
                return Err(RemoteError::new(
                    ErrorKind::InvalidRequest,
                    format!("{} is not a directory", w.root.display()),
                ));
            }
            Err(e) => {
                return Err(RemoteError::from_io(
                    &format!("watch {}", w.root.display()),
                    &e.into(),
                ));
            }
        }
        if recursive && !w.watch_below("", 0, false) {
            return Err(RemoteError::new(
                ErrorKind::Busy,
                format!(
                    "{}: more than {max_dirs} directories to watch: watch a smaller tree",
                    w.root.display()
                ),
            ));
        }
        Ok(w)
    }

    /// Watches the subdirectories of `rel` (at `depth`), down to [`WATCH_MAX_DEPTH`]; with
    /// `announce`, every entry found is queued as created (a directory that is new: what was
    /// made in it before its watch existed raised no event). False when the watch count cap was
    /// hit.
    fn watch_below(&mut self, rel: &str, depth: usize, announce: bool) -> bool {
        let Ok(rd) = std::fs::read_dir(self.root.join(rel)) else {
            return true; // gone already: its parent's event covers it
        };
        let mut names: Vec<_> = rd.flatten().collect();
        names.sort_by_key(|e| e.file_name());
        for e in names {
            let name = join(rel, &String::from_utf8_lossy(e.file_name().as_bytes()));
            if announce {
                self.push(name.clone(), WatchKind::Create);
            }
            if e.file_type().is_ok_and(|t| t.is_dir())
                && !self.watch_dir(&name, depth + 1, announce)
            {
                return false;
            }
        }
        true
    }

    /// Watches directory `rel` at `depth` and its tree; false when the cap was hit.
    fn watch_dir(&mut self, rel: &str, depth: usize, announce: bool) -> bool {
        if depth > WATCH_MAX_DEPTH {
            return true;
        }
        if self.dirs.len() >= self.max_dirs {
            return false;
        }
        match self
            .ino
            .add_watch(&self.root.join(rel), mask() | AddWatchFlags::IN_DONT_FOLLOW)
        {
            Ok(wd) => {
                self.dirs.insert(wd, (rel.to_owned(), depth));
            }
            Err(Errno::ENOSPC) => return false,
            Err(_) => return true, // gone or replaced by a file: its parent reports that
        }
        self.watch_below(rel, depth, announce)
    }

    /// Stops watching `rel` and everything under it (it moved: the watches would name stale
    /// paths).
    fn forget_tree(&mut self, rel: &str) {
        let prefix = format!("{rel}/");
        let stale: Vec<WatchDescriptor> = self
            .dirs
            .iter()
            .filter(|(_, (d, _))| d == rel || d.starts_with(&prefix))
            .map(|(wd, _)| *wd)
            .collect();
        for wd in stale {
            self.dirs.remove(&wd);
            let _ = self.ino.rm_watch(wd);
        }
    }

    fn push(&mut self, name: String, kind: WatchKind) {
        if name.len() > WATCH_MAX_NAME || self.pending.len() >= MAX_PENDING {
            self.lost += 1;
            return;
        }
        // A burst of the same change not yet sent is one event.
        if self
            .pending
            .back()
            .is_some_and(|l| l.kind == kind && l.name == name && kind == WatchKind::Write)
        {
            return;
        }
        self.pending.push_back(WatchEvent { name, kind });
    }

    /// Reads what the kernel queued (a bounded number of reads). `Ok(true)` when the queue is
    /// empty; `Err` when the watch is over (the root went away).
    pub fn drain(&mut self) -> Result<bool, RemoteError> {
        for _ in 0..READS_PER_WAKEUP {
            let evs = match self.ino.read_events() {
                Ok(evs) => evs,
                Err(Errno::EAGAIN) => return Ok(true),
                Err(Errno::EINTR) => continue,
                Err(e) => return Err(RemoteError::from_io("read inotify", &e.into())),
            };
            if evs.is_empty() {
                return Ok(true);
            }
            for ev in evs {
                self.event(ev)?;
            }
        }
        Ok(false)
    }

    fn event(&mut self, ev: InotifyEvent) -> Result<(), RemoteError> {
        let m = ev.mask;
        if m.contains(AddWatchFlags::IN_Q_OVERFLOW) {
            self.lost += 1;
            return Ok(());
        }
        let Some((dir, depth)) = self.dirs.get(&ev.wd).cloned() else {
            return Ok(()); // a watch already forgotten
        };
        if m.intersects(
            AddWatchFlags::IN_DELETE_SELF
                | AddWatchFlags::IN_MOVE_SELF
                | AddWatchFlags::IN_IGNORED
                | AddWatchFlags::IN_UNMOUNT,
        ) {
            if dir.is_empty() {
                return Err(gone(&self.root));
            }
            if m.contains(AddWatchFlags::IN_IGNORED) {
                self.dirs.remove(&ev.wd);
            }
            return Ok(()); // the parent's watch reports it
        }
        // Events on a watched directory itself come again, named, from its parent's watch.
        let Some(name) = ev.name.as_deref() else {
            return Ok(());
        };
        let base = String::from_utf8_lossy(name.as_bytes());
        // The agent's own whole-file writes go through a temporary file renamed over the real
        // one: report them as envd would a write in place (create and write of the real name).
        if is_temp_name(&base) {
            if m.contains(AddWatchFlags::IN_MOVED_FROM) {
                self.temp_move = Some(ev.cookie);
            }
            return Ok(());
        }
        let name = join(&dir, &base);
        let Some(kind) = kind_of(m) else {
            return Ok(());
        };
        if m.contains(AddWatchFlags::IN_MOVED_TO)
            && ev.cookie != 0
            && self.temp_move.take() == Some(ev.cookie)
        {
            self.push(name.clone(), WatchKind::Create);
            self.push(name, WatchKind::Write);
            return Ok(());
        }
        let is_dir = m.contains(AddWatchFlags::IN_ISDIR);
        if kind == WatchKind::Write {
            if m.contains(AddWatchFlags::IN_MODIFY) {
                if self.modified.len() >= MAX_MODIFIED {
                    self.modified.clear();
                }
                self.modified.insert(name.clone());
            } else if self.modified.remove(&name) {
                return Ok(()); // the close of a write already reported
            }
        }
        if matches!(kind, WatchKind::Remove | WatchKind::Rename) {
            self.modified.remove(&name);
        }
        self.push(name.clone(), kind);
        if self.recursive && is_dir {
            if m.contains(AddWatchFlags::IN_CREATE) {
                self.watch_dir(&name, depth + 1, true);
            } else if m.contains(AddWatchFlags::IN_MOVED_TO) {
                self.forget_tree(&name);
                self.watch_dir(&name, depth + 1, false);
            } else if m.contains(AddWatchFlags::IN_MOVED_FROM) {
                self.forget_tree(&name);
            }
        }
        Ok(())
    }

    /// The next batch to send: at most [`WATCH_MAX_BATCH`] events and about a [`CHUNK`] of
    /// names; `None` when there is nothing to say.
    pub fn take_batch(&mut self) -> Option<WatchBatch> {
        if self.pending.is_empty() && self.lost == 0 {
            return None;
        }
        let mut events = Vec::new();
        let mut bytes = 0;
        while events.len() < WATCH_MAX_BATCH && bytes < CHUNK {
            let Some(e) = self.pending.pop_front() else {
                break;
            };
            bytes += e.name.len() + 16;
            events.push(e);
        }
        Some(WatchBatch {
            events,
            lost: std::mem::take(&mut self.lost),
        })
    }

    /// Directories watched now.
    #[cfg(test)]
    pub fn watched(&self) -> usize {
        self.dirs.len()
    }
}

/// Watches being served now (`run`s in progress).
pub static RUNNING: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

/// Counts one `run` in [`RUNNING`] while it lives.
struct Running;

impl Running {
    fn new() -> Running {
        RUNNING.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        Running
    }
}

impl Drop for Running {
    fn drop(&mut self) {
        RUNNING.fetch_sub(1, std::sync::atomic::Ordering::SeqCst);
    }
}

fn send(outbox: &Outbox, stream: u32, body: Body) -> bool {
    outbox.send(Frame { stream, body }).is_ok()
}

/// Serves one `WatchDir` request until `stop` is notified (the host's `Cancel`, the connection's
/// end), the outbox closes or the directory goes away.
pub async fn run(
    path: String,
    recursive: bool,
    outbox: Arc<Outbox>,
    stream: u32,
    credit: Arc<Semaphore>,
    stop: Arc<Notify>,
) {
    let _running = Running::new();
    // Watching a big tree reads every directory of it.
    let started = tokio::task::spawn_blocking(move || DirWatch::start(&path, recursive))
        .await
        .unwrap_or_else(|e| Err(RemoteError::new(ErrorKind::Other, e.to_string())));
    let mut afd = match started.and_then(|w| {
        // SAFETY: the fd is the `Inotify` owned by `w`, which the `AsyncFd` owns: it stays open
        // and the same until the `AsyncFd` is dropped (`DirWatch` never replaces `ino`).
        unsafe { AsyncFd::register_with_interest(w, tokio::io::Interest::READABLE) }
            .map_err(|e| RemoteError::from_io("register inotify", &e.into()))
    }) {
        Ok(a) => a,
        Err(e) => {
            send(&outbox, stream, Body::Error(e));
            return;
        }
    };
    // The first, empty batch: the watch is in place.
    let mut ready = encode_answer(&WatchBatch::default()).ok();
    // Set when the watch is over: what was queued before goes out first (credit permitting).
    let mut ending: Option<RemoteError> = None;
    loop {
        let cost = ready.as_ref().map_or(0, |b| data_cost(b.len()) as u32);
        tokio::select! {
            () = stop.notified() => return,
            () = outbox.closed() => return,
            permit = credit.acquire_many(cost), if ready.is_some() => {
                let Ok(p) = permit else { return }; // cancelled
                p.forget();
                if let Some(b) = ready.take()
                    && !send(&outbox, stream, Body::Data(b))
                {
                    return;
                }
            }
            guard = afd.readable_mut(), if ending.is_none() => {
                let Ok(mut guard) = guard else { return };
                match guard.get_inner_mut().drain() {
                    Ok(true) => guard.clear_ready(),
                    Ok(false) => {}
                    Err(e) => {
                        tracing::debug!(error = %e, "directory watch over");
                        ending = Some(e);
                    }
                }
            }
        }
        if ready.is_none() {
            match afd.get_mut().take_batch().map(|b| encode_answer(&b)) {
                Some(Ok(b)) => ready = Some(b),
                Some(Err(e)) => {
                    let msg = format!("cannot encode watch events: {e}");
                    send(
                        &outbox,
                        stream,
                        Body::Error(RemoteError::new(ErrorKind::Other, msg)),
                    );
                    return;
                }
                None => {
                    if let Some(e) = ending.take() {
                        send(&outbox, stream, Body::Error(e));
                        return;
                    }
                }
            }
        }
    }
}

#[cfg(test)]
#[path = "dirwatch_tests.rs"]
mod tests;
