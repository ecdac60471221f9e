//! A walk of the workspace kept current by inotify, so a diff re-stats only what changed.
//!
//! Owns the guest end of `WalkSince`. The first request (or any after the cache was lost) walks
//! the whole tree, adding an inotify watch on every directory *before* reading it, so a change
//! made after that read is always queued as an event. Later requests drain the event queue and
//! re-stat only the paths named there (a new directory is walked and watched whole), and
//! answer with the entries changed and the paths removed since the caller's cursor.
//!
//! Falls back to a full walk whenever it cannot vouch for the cache: the event queue overflowed
//! (`IN_Q_OVERFLOW`), a watch could not be added (watch limit), a directory was moved (its
//! watches would name stale paths), the walked root went away, or the caller's cursor is from
//! another epoch (agent restarted) or from the future (the VM was restored from a snapshot).
//! Files with more than one hard link are re-stated on every request (a write through a link
//! outside the workspace raises no event here). Writes through a shared `mmap` raise no inotify
//! event at all: they are seen once anything else touches the file or the next full walk runs.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::ffi::OsStr;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};

use nix::errno::Errno;
use nix::sys::inotify::{AddWatchFlags, InitFlags, Inotify, WatchDescriptor};

use crate::rpc::msg::{FileKind, WalkCursor, WalkDelta, WalkEntry};

/// What a watched directory reports (this walk's watches and `dirwatch.rs`'s): every change
/// of an entry, and the directory's own removal or move.
pub(crate) fn dir_mask() -> AddWatchFlags {
    AddWatchFlags::IN_CREATE
        | AddWatchFlags::IN_DELETE
        | AddWatchFlags::IN_MODIFY
        | AddWatchFlags::IN_ATTRIB
        | AddWatchFlags::IN_CLOSE_WRITE
        | AddWatchFlags::IN_MOVED_FROM
        | AddWatchFlags::IN_MOVED_TO
        | AddWatchFlags::IN_DELETE_SELF
        | AddWatchFlags::IN_MOVE_SELF
        | AddWatchFlags::IN_ONLYDIR
}

/// What a directory watch of the walk reports (never through a symlink).
fn mask() -> AddWatchFlags {
    dir_mask() | AddWatchFlags::IN_DONT_FOLLOW
}

/// Entries stated by every walk of this agent so far: the progress a `WalkSince` reports
/// (`guest::progress`).
pub static SCANNED: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// The walk of one root, with the generation each entry last changed in.
pub struct WalkCache {
    root: PathBuf,
    skip: Vec<String>,
    ino: Inotify,
    /// Watch -> directory relative to the root ("" = the root).
    dirs: HashMap<WatchDescriptor, String>,
    entries: BTreeMap<String, (WalkEntry, u64)>,
    /// Paths removed, with the generation they went in.
    removed: BTreeMap<String, u64>,
    /// Files with more than one link: re-stated every time.
    linked: HashSet<String>,
    epoch: u64,
    generation: u64,
    /// While the first walk runs over the workspace overlay: its upper directory, so files
    /// still taken from the base disk are listed without a stat (see [`Self::upper_names`]).
    upper: Option<PathBuf>,
    /// Directories of that walk whose entries are all stated (their lower directory is
    /// elsewhere, or their upper one could not be read).
    stat_under: HashSet<String>,
    /// Whether this cache holds (or held) `base` entries.
    has_base: bool,
}

/// Why the cache cannot be trusted any more (a full walk follows).
struct Lost;

fn epoch() -> u64 {
    static N: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);
    let t = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos() as u64)
        .unwrap_or(0);
    // Not getrandom: it can block for minutes in a fresh VM. Unique per agent life is enough.
    t ^ N
        .fetch_add(1, std::sync::atomic::Ordering::Relaxed)
        .rotate_left(48)
}

fn join(dir: &str, name: &str) -> String {
    if dir.is_empty() {
        name.to_owned()
    } else {
        format!("{dir}/{name}")
    }
}

fn entry(rel: &str, abs: &Path, md: &std::fs::Metadata) -> WalkEntry {
    let kind = FileKind::of(md.file_type());
    let link = if kind == FileKind::Symlink {
        std::fs::read_link(abs)
            .ok()
            .map(|t| t.to_string_lossy().into_owned())
    } else {
        None
    };
    WalkEntry {
        path: rel.to_owned(),
        kind,
        size: md.len(),
        mode: md.mode() & 0o7777,
        mtime: md.mtime(),
        mtime_nsec: md.mtime_nsec() as u32,
        link,
        base: false,
    }
}

/// An entry for a file not stated (see [`WalkEntry::base`]).
fn base_entry(rel: &str, kind: FileKind) -> WalkEntry {
    WalkEntry::unstated(rel.to_owned(), kind)
}

/// Whether `path` (not followed) has the extended attribute `name`.
fn has_xattr(path: &Path, name: &std::ffi::CStr) -> bool {
    let Ok(p) = std::ffi::CString::new(path.as_os_str().as_bytes()) else {
        return false;
    };
    // SAFETY: both pointers are valid NUL-terminated strings for the call; a zero size with a
    // null buffer only asks for the value's length, nothing is written.
    let n = unsafe { libc::lgetxattr(p.as_ptr(), name.as_ptr(), std::ptr::null_mut(), 0) };
    n >= 0
}

/// Best effort: room for the watches and events of a big repo (the agent is PID 1 and root).
pub fn raise_limits() {
    if std::process::id() != 1 {
        return; // never change a host's limits from tests
    }
    for (f, v) in [
        ("/proc/sys/fs/inotify/max_user_watches", "524288"),
        ("/proc/sys/fs/inotify/max_queued_events", "262144"),
    ] {
        let _ = std::fs::write(f, v);
    }
}

impl WalkCache {
    /// Walk `root` whole, watching every directory. Unless `stat_all`, when `root` is the
    /// workspace overlay the files it still takes from the base disk are `base` entries.
    pub fn build(root: &Path, skip: &[String], stat_all: bool) -> std::io::Result<WalkCache> {
        let upper = if stat_all {
            None
        } else {
            super::wsbase::overlay_upper(root)
        };
        Self::build_over(root, skip, upper)
    }

    /// [`Self::build`] of an overlay whose upper directory is `upper` (`None`: state all).
    fn build_over(
        root: &Path,
        skip: &[String],
        upper: Option<PathBuf>,
    ) -> std::io::Result<WalkCache> {
        raise_limits();
        let ino = Inotify::init(InitFlags::IN_NONBLOCK | InitFlags::IN_CLOEXEC)?;
        let mut c = WalkCache {
            root: root.to_path_buf(),
            skip: skip.to_vec(),
            ino,
            dirs: HashMap::new(),
            entries: BTreeMap::new(),
            removed: BTreeMap::new(),
            linked: HashSet::new(),
            epoch: epoch(),
            generation: 1,
            upper,
            stat_under: HashSet::new(),
            has_base: false,
        };
        c.scan_dir("", 1).map_err(|e| match e {
            ScanError::Io(e) => e,
            ScanError::Lost => std::io::Error::other("cannot watch the tree (watch limit?)"),
        })?;
        c.upper = None;
        c.stat_under = HashSet::new();
        Ok(c)
    }

    /// For the first walk over the workspace overlay: the names directory `rel` has in the
    /// overlay's upper layer (every other name is a file still on the base disk, as the first
    /// sync wrote it), or `None` when all its entries must be stated: no overlay, or the
    /// directory's lower layer is not the base disk's directory of the same path (it or a
    /// parent was renamed, `trusted.overlay.redirect`, or replaced, `trusted.overlay.opaque`),
    /// or its upper directory cannot be read.
    fn upper_names(&mut self, rel: &str) -> Option<HashSet<std::ffi::OsString>> {
        let upper = self.upper.as_ref()?;
        let parent = rel.rsplit_once('/').map_or("", |(p, _)| p);
        if !rel.is_empty() && self.stat_under.contains(parent) {
            self.stat_under.insert(rel.to_owned());
            return None;
        }
        let dir = upper.join(rel);
        let names = match std::fs::symlink_metadata(&dir) {
            // Nothing of it was written in the VM.
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Some(HashSet::new()),
            Ok(md)
                if md.is_dir()
                    && !has_xattr(&dir, c"trusted.overlay.redirect")
                    && !has_xattr(&dir, c"trusted.overlay.opaque") =>
            {
                std::fs::read_dir(&dir)
                    .ok()
                    .map(|rd| rd.flatten().map(|e| e.file_name()).collect())
            }
            _ => None,
        };
        if names.is_none() {
            self.stat_under.insert(rel.to_owned());
        }
        names
    }

    pub fn same_root(&self, root: &Path, skip: &[String]) -> bool {
        self.root == root && self.skip == skip
    }

    pub fn cursor(&self) -> WalkCursor {
        WalkCursor {
            epoch: self.epoch,
            generation: self.generation,
        }
    }

    /// Watch directory `rel` and record everything under it with generation `generation`.
    fn scan_dir(&mut self, rel: &str, generation: u64) -> Result<(), ScanError> {
        let abs = self.root.join(rel);
        match self.ino.add_watch(&abs, mask()) {
            Ok(wd) => {
                self.dirs.insert(wd, rel.to_owned());
            }
            // Gone already: its parent's event covers it.
            Err(Errno::ENOENT) | Err(Errno::ENOTDIR) if !rel.is_empty() => return Ok(()),
            Err(_) => return Err(ScanError::Lost),
        }
        let rd = match std::fs::read_dir(&abs) {
            Ok(rd) => rd,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound && !rel.is_empty() => return Ok(()),
            Err(e) => return Err(ScanError::Io(e)),
        };
        let upper = self.upper_names(rel);
        let mut names: Vec<_> = rd
            .flatten()
            .map(|e| (e.file_name(), e.file_type().ok()))
            .collect();
        names.sort_by(|a, b| a.0.cmp(&b.0));
        for (name, ft) in names {
            let Some(s) = name.to_str().map(str::to_owned) else {
                continue;
            };
            let child = join(rel, &s);
            // A file the overlay still takes from the base disk: as the first sync wrote it
            // (its record is the host's); no stat, which is what a first walk of a big tree
            // spent its time on (cold inodes read from the emulated disk).
            let kind = ft.map(FileKind::of);
            if let (Some(up), Some(kind @ (FileKind::File | FileKind::Symlink))) = (&upper, kind)
                && !up.contains(&name)
            {
                SCANNED.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                self.has_base = true;
                self.entries
                    .insert(child.clone(), (base_entry(&child, kind), generation));
                continue;
            }
            self.restat(&child, generation)?;
        }
        Ok(())
    }

    /// Bring `rel` up to date: record its stat (if changed) or its removal, walking a directory
    /// that is new to the cache.
    fn restat(&mut self, rel: &str, generation: u64) -> Result<(), ScanError> {
        if self.skipped(rel) {
            return Ok(());
        }
        let abs = self.root.join(rel);
        let md = match std::fs::symlink_metadata(&abs) {
            Ok(md) => md,
            Err(_) => {
                self.remove_tree(rel, generation);
                return Ok(());
            }
        };
        let e = entry(rel, &abs, &md);
        let name = rel.rsplit('/').next().unwrap_or(rel);
        if e.kind == FileKind::Dir && self.skip.iter().any(|s| s == name) {
            // A skipped directory (e.g. `.git`) is left out, as by `Walk`.
            self.remove_tree(rel, generation);
            return Ok(());
        }
        SCANNED.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let was_dir = self.entries.get(rel).map(|(w, _)| w.kind == FileKind::Dir);
        if was_dir == Some(true) && e.kind != FileKind::Dir {
            self.remove_tree(rel, generation);
        }
        if e.kind == FileKind::File && md.nlink() > 1 {
            self.linked.insert(rel.to_owned());
        } else {
            self.linked.remove(rel);
        }
        let changed = self.entries.get(rel).is_none_or(|(old, _)| *old != e);
        let new_dir = e.kind == FileKind::Dir && was_dir != Some(true);
        if changed {
            self.removed.remove(rel);
            self.entries.insert(rel.to_owned(), (e, generation));
        }
        if new_dir {
            self.scan_dir(rel, generation)?;
        }
        Ok(())
    }

    /// Whether `rel` lies under a skipped directory.
    fn skipped(&self, rel: &str) -> bool {
        let mut parts: Vec<&str> = rel.split('/').collect();
        parts.pop();
        parts.iter().any(|p| self.skip.iter().any(|s| s == p))
    }

    /// `rel` and everything under it are gone.
    fn remove_tree(&mut self, rel: &str, generation: u64) {
        let prefix = format!("{rel}/");
        let mut gone: Vec<String> = self
            .entries
            .range(prefix.clone()..)
            .take_while(|(k, _)| k.starts_with(&prefix))
            .map(|(k, _)| k.clone())
            .collect();
        if self.entries.contains_key(rel) {
            gone.push(rel.to_owned());
        }
        for k in gone {
            self.entries.remove(&k);
            self.linked.remove(&k);
            self.removed.insert(k, generation);
        }
        // Their watches end by themselves (IN_IGNORED); forget the names now.
        self.dirs.retain(|_, d| d != rel && !d.starts_with(&prefix));
    }

    /// Drain the event queue and re-stat what it names. `Err` when the cache is lost.
    fn refresh(&mut self) -> Result<(), Lost> {
        let mut dirty: HashSet<String> = self.linked.clone();
        loop {
            let evs = match self.ino.read_events() {
                Ok(evs) => evs,
                Err(Errno::EAGAIN) => break,
                Err(Errno::EINTR) => continue,
                Err(_) => return Err(Lost),
            };
            if evs.is_empty() {
                break;
            }
            for ev in evs {
                let m = ev.mask;
                if m.contains(AddWatchFlags::IN_Q_OVERFLOW) {
                    return Err(Lost);
                }
                let Some(dir) = self.dirs.get(&ev.wd).cloned() else {
                    continue; // a watch already forgotten
                };
                if m.intersects(AddWatchFlags::IN_DELETE_SELF | AddWatchFlags::IN_MOVE_SELF) {
                    if dir.is_empty() {
                        return Err(Lost); // the root itself went away
                    }
                    dirty.insert(dir);
                    continue;
                }
                if m.contains(AddWatchFlags::IN_IGNORED) {
                    self.dirs.remove(&ev.wd);
                    continue;
                }
                let Some(name) = ev.name.as_deref() else {
                    // An event on the directory itself (e.g. its mode).
                    if !dir.is_empty() {
                        dirty.insert(dir);
                    }
                    continue;
                };
                let Ok(name) = std::str::from_utf8(OsStr::as_bytes(name)) else {
                    continue;
                };
                if m.contains(AddWatchFlags::IN_ISDIR)
                    && m.intersects(AddWatchFlags::IN_MOVED_FROM | AddWatchFlags::IN_MOVED_TO)
                {
                    // Watches under a moved directory would name its old path.
                    return Err(Lost);
                }
                dirty.insert(join(&dir, name));
                if !dir.is_empty() {
                    dirty.insert(dir); // its mtime changed too
                }
            }
        }
        if dirty.is_empty() {
            return Ok(());
        }
        let generation = self.generation + 1;
        let mut paths: Vec<String> = dirty.into_iter().collect();
        paths.sort(); // parents before children
        for p in paths {
            if self.restat(&p, generation).is_err() {
                return Err(Lost);
            }
        }
        self.generation = generation;
        Ok(())
    }

    /// The answer to `WalkSince`: everything when `since` is not a cursor of this cache, else
    /// what changed after it.
    fn since(&mut self, since: Option<WalkCursor>) -> Result<WalkDelta, Lost> {
        self.refresh()?;
        let cursor = self.cursor();
        match since {
            Some(c) if c.epoch == self.epoch && c.generation <= self.generation => Ok(WalkDelta {
                cursor,
                full: false,
                entries: self
                    .entries
                    .values()
                    .filter(|(_, g)| *g > c.generation)
                    .map(|(w, _)| w.clone())
                    .collect(),
                removed: self
                    .removed
                    .iter()
                    .filter(|(_, g)| **g > c.generation)
                    .map(|(p, _)| p.clone())
                    .collect(),
            }),
            _ => Ok(self.full()),
        }
    }

    fn full(&self) -> WalkDelta {
        WalkDelta {
            cursor: self.cursor(),
            full: true,
            entries: self.entries.values().map(|(w, _)| w.clone()).collect(),
            removed: Vec::new(),
        }
    }
}

enum ScanError {
    Io(std::io::Error),
    Lost,
}

impl From<Lost> for ScanError {
    fn from(_: Lost) -> Self {
        ScanError::Lost
    }
}

/// Answer a `WalkSince` from `slot` (the agent's one cache), rebuilding it when needed.
pub fn walk_since(
    slot: &mut Option<WalkCache>,
    root: &Path,
    skip: &[String],
    since: Option<WalkCursor>,
    stat_all: bool,
) -> std::io::Result<WalkDelta> {
    if let Some(c) = slot
        .as_mut()
        .filter(|c| c.same_root(root, skip) && !(stat_all && c.has_base))
    {
        match c.since(since) {
            Ok(d) => return Ok(d),
            Err(Lost) => tracing::warn!(root = %root.display(), "walk cache lost; walking again"),
        }
    }
    *slot = None;
    if !root.is_dir() {
        return Ok(WalkDelta {
            cursor: WalkCursor {
                epoch: 0,
                generation: 0,
            },
            full: true,
            entries: Vec::new(),
            removed: Vec::new(),
        });
    }
    let c = WalkCache::build(root, skip, stat_all)?;
    let d = c.full();
    *slot = Some(c);
    Ok(d)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    /// A host-side mirror: applies deltas the way the daemon does.
    struct Mirror {
        cursor: Option<WalkCursor>,
        map: BTreeMap<String, WalkEntry>,
        fulls: usize,
    }

    impl Mirror {
        fn new() -> Mirror {
            Mirror {
                cursor: None,
                map: BTreeMap::new(),
                fulls: 0,
            }
        }
        fn sync(&mut self, slot: &mut Option<WalkCache>, root: &Path) {
            let d = walk_since(slot, root, &[".git".into()], self.cursor, false).unwrap();
            if d.full {
                self.map.clear();
                self.fulls += 1;
            }
            for r in d.removed {
                self.map.remove(&r);
            }
            for e in d.entries {
                self.map.insert(e.path.clone(), e);
            }
            self.cursor = Some(d.cursor);
        }
    }

    /// What a plain full walk sees now.
    fn truth(root: &Path) -> BTreeMap<String, WalkEntry> {
        let mut slot = None;
        let d = walk_since(&mut slot, root, &[".git".into()], None, false).unwrap();
        d.entries.into_iter().map(|e| (e.path.clone(), e)).collect()
    }

    fn check(m: &mut Mirror, slot: &mut Option<WalkCache>, root: &Path, what: &str) {
        m.sync(slot, root);
        assert_eq!(m.map, truth(root), "after: {what}");
    }

    fn write(root: &Path, rel: &str, data: &str) {
        let p = root.join(rel);
        std::fs::create_dir_all(p.parent().unwrap()).unwrap();
        std::fs::write(p, data).unwrap();
    }

    #[test]
    fn deltas_follow_every_kind_of_change() {
        let d = tempfile::tempdir().unwrap();
        let root = d.path();
        for i in 0..5 {
            write(root, &format!("src/f{i}.rs"), "x");
        }
        write(root, "a/b/c/d/deep.txt", "deep");
        write(root, ".git/config", "[core]");
        let mut slot = None;
        let mut m = Mirror::new();
        check(&mut m, &mut slot, root, "first walk");
        assert_eq!(m.fulls, 1);
        assert!(!m.map.contains_key(".git/config") && !m.map.contains_key(".git"));

        // A process started before the changes below keeps writing into a file.
        let mut long = std::fs::OpenOptions::new()
            .append(true)
            .open(root.join("src/f0.rs"))
            .unwrap();

        // Nothing changed: an empty delta.
        let before = m.cursor;
        let delta = walk_since(&mut slot, root, &[".git".into()], before, false).unwrap();
        assert!(!delta.full && delta.entries.is_empty() && delta.removed.is_empty());

        write(root, "src/f1.rs", "edited, same dir");
        check(&mut m, &mut slot, root, "edit");
        write(root, "new/dir/tree/file.txt", "created in a new dir");
        check(&mut m, &mut slot, root, "create in a new dir");
        std::fs::remove_file(root.join("src/f2.rs")).unwrap();
        check(&mut m, &mut slot, root, "delete");
        std::fs::rename(root.join("src/f3.rs"), root.join("src/renamed.rs")).unwrap();
        check(&mut m, &mut slot, root, "rename");
        std::fs::set_permissions(
            root.join("src/f4.rs"),
            std::fs::Permissions::from_mode(0o755),
        )
        .unwrap();
        check(&mut m, &mut slot, root, "chmod");
        write(root, "a/b/c/d/deep.txt", "deeper change");
        check(&mut m, &mut slot, root, "deep change");
        std::io::Write::write_all(&mut long, b" appended later").unwrap();
        check(&mut m, &mut slot, root, "write by an older process");
        std::fs::remove_dir_all(root.join("a/b")).unwrap();
        check(&mut m, &mut slot, root, "delete a tree");
        write(root, "a/b", "a file where a directory was");
        check(&mut m, &mut slot, root, "dir replaced by a file");
        std::os::unix::fs::symlink("src/f1.rs", root.join("link")).unwrap();
        check(&mut m, &mut slot, root, "symlink");
        write(root, ".git/HEAD", "skipped");
        check(&mut m, &mut slot, root, "change under a skipped dir");
        assert_eq!(m.fulls, 1, "all of the above were deltas");

        // A moved directory is not trusted: a full walk, still right.
        std::fs::rename(root.join("new"), root.join("moved")).unwrap();
        check(&mut m, &mut slot, root, "directory moved");
        assert_eq!(m.fulls, 2);
        write(root, "moved/dir/tree/file.txt", "after the move");
        check(&mut m, &mut slot, root, "edit under the moved directory");
    }

    #[test]
    fn a_hard_linked_file_is_restated_every_time() {
        let ws = tempfile::tempdir().unwrap();
        let out = tempfile::tempdir().unwrap();
        write(ws.path(), "f.txt", "one");
        std::fs::hard_link(ws.path().join("f.txt"), out.path().join("other")).unwrap();
        let mut slot = None;
        let mut m = Mirror::new();
        check(&mut m, &mut slot, ws.path(), "first");
        // Written through the link outside the watched tree.
        std::fs::write(out.path().join("other"), "changed elsewhere").unwrap();
        check(
            &mut m,
            &mut slot,
            ws.path(),
            "write through an outside link",
        );
    }

    #[test]
    fn a_foreign_or_future_cursor_gets_a_full_walk() {
        let d = tempfile::tempdir().unwrap();
        write(d.path(), "x", "1");
        let mut slot = None;
        let first = walk_since(&mut slot, d.path(), &[], None, false).unwrap();
        let c = first.cursor;
        let future = WalkCursor {
            epoch: c.epoch,
            generation: c.generation + 5,
        };
        assert!(
            walk_since(&mut slot, d.path(), &[], Some(future), false)
                .unwrap()
                .full
        );
        let other = WalkCursor {
            epoch: c.epoch ^ 1,
            generation: c.generation,
        };
        assert!(
            walk_since(&mut slot, d.path(), &[], Some(other), false)
                .unwrap()
                .full
        );
        assert!(
            !walk_since(&mut slot, d.path(), &[], Some(c), false)
                .unwrap()
                .full
        );
    }

    /// A real overlayfs (needs root to mount): files untouched since the lower layer are
    /// listed unstated, everything written, renamed or replaced through the overlay is stated,
    /// and a later write to an unstated file is reported with its stat.
    #[test]
    fn the_first_walk_of_an_overlay_states_only_what_the_upper_layer_has() {
        if !nix::unistd::geteuid().is_root() {
            assert!(std::env::var_os("CI").is_none(), "needs root under CI");
            println!("skipped: mounting an overlayfs needs root");
            return;
        }
        let t = tempfile::tempdir().unwrap();
        let (lower, upper, work, merged) = (
            t.path().join("lower"),
            t.path().join("upper"),
            t.path().join("work"),
            t.path().join("merged"),
        );
        for d in [&upper, &work, &merged] {
            std::fs::create_dir_all(d).unwrap();
        }
        for (p, c) in [
            ("keep.txt", "k"),
            ("edit.txt", "e"),
            ("gone.txt", "g"),
            ("d/in.txt", "i"),
            ("moved/m.txt", "m"),
            ("replaced/old.txt", "o"),
            ("deep/x/y.txt", "y"),
        ] {
            let f = lower.join(p);
            std::fs::create_dir_all(f.parent().unwrap()).unwrap();
            std::fs::write(&f, c).unwrap();
        }
        std::os::unix::fs::symlink("keep.txt", lower.join("link")).unwrap();
        let opts = format!(
            "lowerdir={},upperdir={},workdir={},redirect_dir=on",
            lower.display(),
            upper.display(),
            work.display()
        );
        nix::mount::mount(
            Some("overlay"),
            &merged,
            Some("overlay"),
            nix::mount::MsFlags::empty(),
            Some(opts.as_str()),
        )
        .expect("mount overlay");
        struct Unmount(PathBuf);
        impl Drop for Unmount {
            fn drop(&mut self) {
                let _ = nix::mount::umount2(&self.0, nix::mount::MntFlags::MNT_DETACH);
            }
        }
        let _u = Unmount(merged.clone());
        std::fs::write(merged.join("edit.txt"), "edited").unwrap();
        std::fs::remove_file(merged.join("gone.txt")).unwrap();
        std::fs::write(merged.join("new.txt"), "n").unwrap();
        std::fs::rename(merged.join("moved"), merged.join("renamed")).unwrap();
        std::fs::remove_dir_all(merged.join("replaced")).unwrap();
        std::fs::create_dir(merged.join("replaced")).unwrap();
        std::fs::write(merged.join("replaced/fresh.txt"), "f").unwrap();
        // A directory written under, its other file untouched.
        std::fs::write(merged.join("deep/x/z.txt"), "z").unwrap();

        let mut c = WalkCache::build_over(&merged, &[], Some(upper.clone())).unwrap();
        let d = c.full();
        let got: BTreeMap<&str, bool> = d
            .entries
            .iter()
            .filter(|e| e.kind != FileKind::Dir)
            .map(|e| (e.path.as_str(), e.base))
            .collect();
        let want: BTreeMap<&str, bool> = [
            ("keep.txt", true),
            ("link", true),
            ("d/in.txt", true),
            ("deep/x/y.txt", true),
            ("deep/x/z.txt", false),
            ("edit.txt", false),
            ("new.txt", false),
            // Under a renamed directory the lower path differs: stated.
            ("renamed/m.txt", false),
            ("replaced/fresh.txt", false),
        ]
        .into_iter()
        .collect();
        assert_eq!(got, want);
        for e in d.entries.iter().filter(|e| e.base) {
            assert_eq!(
                (e.size, e.mode, e.mtime, &e.link),
                (0, 0, 0, &None),
                "{e:?}"
            );
        }
        let edit = d.entries.iter().find(|e| e.path == "edit.txt").unwrap();
        assert_eq!(edit.size, 6);
        // Later: a write to an unstated file comes back stated.
        std::fs::write(merged.join("keep.txt"), "kept no more").unwrap();
        let later = c.since(Some(d.cursor)).ok().unwrap();
        let k = later.entries.iter().find(|e| e.path == "keep.txt").unwrap();
        assert!(!k.base && k.size == 12, "{k:?}");
        // Asked to state all: the cache is rebuilt without unstated entries.
        let cursor = later.cursor;
        let mut slot = Some(c);
        let all = walk_since(&mut slot, &merged, &[], Some(cursor), true).unwrap();
        assert!(all.full && all.entries.iter().all(|e| !e.base), "{all:?}");
        let keep = all.entries.iter().find(|e| e.path == "keep.txt").unwrap();
        assert_eq!(keep.size, 12);
    }
}
