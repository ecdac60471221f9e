//! Where a diff (and apply, pull) keeps the VM's changed files while it works: small files in
//! memory, within a process-wide budget; the rest in one spill directory per operation inside
//! the sandbox's directory of the data root, made on the first file that needs it and removed
//! when the operation ends (and, left by a killed daemon, at the sandbox's next diff); plus
//! the byte budget of the operation (`sync.max_diff_mib`) and the per-file limit
//! (`sync.max_file_mib`).
//!
//! Owns: the spill files (named by a counter, never by the VM's path), their SHA-256 (computed
//! as the bytes arrive, so nothing is read twice to compare), the in-memory budget
//! ([`MEM_FILE_MAX`] per file, [`MEM_TOTAL`] for the whole daemon: a one-file diff makes no
//! file, and memory stays bounded however many diffs run), and the limits: a VM that sends
//! more than it announced (a file that grew, or an agent that follows a symlink to
//! `/dev/zero`) is cut off at the limit with [`WorkspaceError::TooBig`]. Never holds more of a
//! file in memory than [`MEM_FILE_MAX`] plus one chunk; never reads the host repo.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, LazyLock, OnceLock};

use sha2::Digest;

use super::WorkspaceError;

/// Name prefix of spill directories in a sandbox's directory.
pub const SPILL_PREFIX: &str = ".diff-spill-";

/// Files at most this big stay in memory (while [`MEM_TOTAL`] has room).
pub const MEM_FILE_MAX: u64 = 256 * 1024;
/// What every operation of the daemon together keeps in memory; past it files go to disk.
pub const MEM_TOTAL: u64 = 16 << 20;

/// The daemon's in-memory budget.
static MEM: LazyLock<Arc<MemPool>> = LazyLock::new(|| Arc::new(MemPool::new(MEM_TOTAL)));

/// Bytes of VM files the daemon's operations hold in memory now (`tryboxi_diff_memory_bytes`).
pub fn memory_used() -> u64 {
    MEM.used()
}

/// Bytes of file content held in memory, against a cap.
#[derive(Debug)]
pub struct MemPool {
    used: AtomicU64,
    max: u64,
}

impl MemPool {
    pub fn new(max: u64) -> MemPool {
        MemPool {
            used: AtomicU64::new(0),
            max,
        }
    }

    fn take(&self, n: u64) -> bool {
        self.used
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |u| {
                u.checked_add(n).filter(|t| *t <= self.max)
            })
            .is_ok()
    }

    fn give(&self, n: u64) {
        self.used.fetch_sub(n, Ordering::Relaxed);
    }

    /// Bytes held now.
    pub fn used(&self) -> u64 {
        self.used.load(Ordering::Relaxed)
    }
}

/// File content in memory, its bytes counted in the pool until dropped.
struct MemBytes {
    data: Vec<u8>,
    pool: Arc<MemPool>,
}

impl Drop for MemBytes {
    fn drop(&mut self) {
        self.pool.give(self.data.len() as u64);
    }
}

/// The spill of one operation and its byte budget. Its directory is removed when dropped.
pub struct Spill(Arc<Inner>);

struct Inner {
    sandbox_dir: PathBuf,
    /// Made on the first file that does not stay in memory.
    dir: OnceLock<tempfile::TempDir>,
    budget: Budget,
    mem: Arc<MemPool>,
    next: AtomicU64,
}

/// Bytes all files of one operation may take together.
struct Budget {
    used: AtomicU64,
    max: u64,
}

impl Budget {
    /// Take `n` bytes; false (and nothing taken) once over `max`.
    fn take(&self, n: u64) -> bool {
        self.used
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |u| {
                u.checked_add(n).filter(|t| *t <= self.max)
            })
            .is_ok()
    }
}

/// The message of a diff over `sync.max_diff_mib`.
pub fn over_budget(max: u64, what: impl std::fmt::Display) -> WorkspaceError {
    WorkspaceError::TooBig(format!(
        "the VM's changed files are {what}, over sync.max_diff_mib ({} MiB); \
         diff, apply or pull fewer paths at once, or raise the limit",
        max >> 20
    ))
}

impl Spill {
    /// The spill of an operation in `sandbox_dir`, under the daemon's in-memory budget; spill
    /// directories left there by an earlier daemon are removed first (the caller holds the
    /// sandbox's workspace lock, so none is in use). `max_total`: the budget in bytes of every
    /// file of this operation together.
    pub fn new(sandbox_dir: &Path, max_total: u64) -> Result<Spill, WorkspaceError> {
        Spill::with_pool(sandbox_dir, max_total, MEM.clone())
    }

    /// [`Spill::new`] with its own in-memory budget.
    pub fn with_pool(
        sandbox_dir: &Path,
        max_total: u64,
        mem: Arc<MemPool>,
    ) -> Result<Spill, WorkspaceError> {
        if let Ok(rd) = std::fs::read_dir(sandbox_dir) {
            for ent in rd.flatten() {
                if ent.file_name().to_string_lossy().starts_with(SPILL_PREFIX) {
                    let _ = crate::safefs::remove_under(sandbox_dir, &ent.path());
                }
            }
        }
        Ok(Spill(Arc::new(Inner {
            sandbox_dir: sandbox_dir.to_path_buf(),
            dir: OnceLock::new(),
            budget: Budget {
                used: AtomicU64::new(0),
                max: max_total,
            },
            mem,
            next: AtomicU64::new(0),
        })))
    }

    /// The spill directory, if a file has needed it.
    #[cfg(test)]
    pub fn dir(&self) -> Option<&Path> {
        self.0.dir.get().map(|d| d.path())
    }

    /// Bytes taken so far.
    pub fn used(&self) -> u64 {
        self.0.budget.used.load(Ordering::Relaxed)
    }

    /// Refuse up front when `announced` bytes (the sizes the VM's walk gives) do not fit.
    pub fn check_announced(&self, announced: u64) -> Result<(), WorkspaceError> {
        if announced > self.0.budget.max {
            return Err(over_budget(
                self.0.budget.max,
                format_args!("{} MiB", announced.div_ceil(1 << 20)),
            ));
        }
        Ok(())
    }

    /// A new file for the VM's `rel`, at most `max_file` bytes. It starts in memory: nothing
    /// is created until it outgrows that.
    pub fn writer(&self, rel: &str, max_file: u64) -> SpillWriter {
        SpillWriter {
            sink: Sink::Mem(Vec::new()),
            rel: rel.to_owned(),
            hasher: sha2::Sha256::new(),
            len: 0,
            max_file,
            spill: self.0.clone(),
        }
    }
}

impl Inner {
    fn new_file(&self) -> Result<(std::fs::File, PathBuf), WorkspaceError> {
        let dir = match self.dir.get() {
            Some(d) => d,
            None => {
                let made = tempfile::Builder::new()
                    .prefix(SPILL_PREFIX)
                    .tempdir_in(&self.sandbox_dir)
                    .map_err(WorkspaceError::io(
                        "create a spill directory in",
                        &self.sandbox_dir,
                    ))?;
                // Writers of one operation may race here; the loser's directory is removed.
                let _ = self.dir.set(made);
                self.dir.get().expect("set above")
            }
        };
        let n = self.next.fetch_add(1, Ordering::Relaxed);
        let path = dir.path().join(n.to_string());
        let file = std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .open(&path)
            .map_err(WorkspaceError::io("create the spill file", &path))?;
        Ok((file, path))
    }
}

enum Sink {
    /// Its bytes are counted in the pool.
    Mem(Vec<u8>),
    File(std::io::BufWriter<std::fs::File>, PathBuf),
}

/// One VM file being received: in memory while it is small, then in its spill file.
pub struct SpillWriter {
    sink: Sink,
    rel: String,
    hasher: sha2::Sha256,
    len: u64,
    max_file: u64,
    spill: Arc<Inner>,
}

impl SpillWriter {
    /// The limits of the file and the operation for `n` more bytes (taken from the budget).
    fn admit(&self, n: u64) -> Result<(), WorkspaceError> {
        if self.len.saturating_add(n) > self.max_file {
            return Err(WorkspaceError::TooBig(format!(
                "the VM's file {} is over sync.max_file_mib ({} MiB) (it grew while it was \
                 read, or is not a regular file); run the diff again",
                self.rel,
                self.max_file >> 20
            )));
        }
        if !self.spill.budget.take(n) {
            return Err(over_budget(
                self.spill.budget.max,
                "more than they were when listed",
            ));
        }
        Ok(())
    }

    /// Append `chunk` in memory if the file stays small and the daemon's memory budget has
    /// room: `Ok(true)`. `Ok(false)`, with nothing written, when it needs the disk ([`write`]
    /// it then, off the async runtime). [`WorkspaceError::TooBig`] past a limit.
    ///
    /// [`write`]: SpillWriter::write
    pub fn write_in_memory(&mut self, chunk: &[u8]) -> Result<bool, WorkspaceError> {
        let n = chunk.len() as u64;
        if !matches!(self.sink, Sink::Mem(_))
            || self.len + n > MEM_FILE_MAX
            || !self.spill.mem.take(n)
        {
            return Ok(false);
        }
        if let Err(e) = self.admit(n) {
            self.spill.mem.give(n);
            return Err(e);
        }
        if let Sink::Mem(buf) = &mut self.sink {
            buf.extend_from_slice(chunk);
        }
        self.hasher.update(chunk);
        self.len += n;
        Ok(true)
    }

    /// Append `chunk` (to memory or the spill file, which it may create: blocking IO);
    /// [`WorkspaceError::TooBig`] once the file passes its limit or the operation its budget
    /// (nothing past the limit is kept).
    pub fn write(&mut self, chunk: &[u8]) -> Result<(), WorkspaceError> {
        if self.write_in_memory(chunk)? {
            return Ok(());
        }
        self.admit(chunk.len() as u64)?;
        if let Sink::Mem(buf) = &mut self.sink {
            let (file, path) = self.spill.new_file()?;
            let mut w = std::io::BufWriter::with_capacity(256 * 1024, file);
            w.write_all(buf)
                .map_err(WorkspaceError::io("write the spill file", &path))?;
            self.spill.mem.give(buf.len() as u64);
            *buf = Vec::new();
            self.sink = Sink::File(w, path);
        }
        let Sink::File(w, path) = &mut self.sink else {
            unreachable!("moved to a file above")
        };
        w.write_all(chunk)
            .map_err(WorkspaceError::io("write the spill file", &*path))?;
        self.hasher.update(chunk);
        self.len += chunk.len() as u64;
        Ok(())
    }

    /// The file as received (flushing a spill file: blocking IO if it is on disk).
    pub fn finish(mut self) -> Result<Spilled, WorkspaceError> {
        let sink = std::mem::replace(&mut self.sink, Sink::Mem(Vec::new()));
        let at = match sink {
            Sink::Mem(data) => At::Mem(Arc::new(MemBytes {
                data,
                pool: self.spill.mem.clone(),
            })),
            Sink::File(w, path) => {
                w.into_inner().map_err(|e| {
                    WorkspaceError::io("write the spill file", &path)(e.into_error())
                })?;
                At::File(path)
            }
        };
        Ok(Spilled {
            sha256: hex::encode(self.hasher.clone().finalize()),
            len: self.len,
            at,
        })
    }
}

impl Drop for SpillWriter {
    fn drop(&mut self) {
        // A writer dropped before `finish` (an error) gives its memory back.
        if let Sink::Mem(buf) = &self.sink {
            self.spill.mem.give(buf.len() as u64);
        }
    }
}

/// A VM file's content, in memory or in the spill directory.
#[derive(Clone)]
pub struct Spilled {
    pub len: u64,
    pub sha256: String,
    at: At,
}

#[derive(Clone)]
enum At {
    Mem(Arc<MemBytes>),
    File(PathBuf),
}

impl std::fmt::Debug for Spilled {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let at = match &self.at {
            At::Mem(_) => "memory".to_owned(),
            At::File(p) => p.display().to_string(),
        };
        f.debug_struct("Spilled")
            .field("len", &self.len)
            .field("sha256", &self.sha256)
            .field("at", &at)
            .finish()
    }
}

impl Spilled {
    /// The whole content (callers check `len` against their limit first).
    pub fn read(&self) -> Result<Vec<u8>, WorkspaceError> {
        match &self.at {
            At::Mem(m) => Ok(m.data.clone()),
            At::File(p) => std::fs::read(p).map_err(WorkspaceError::io("read the spill file", p)),
        }
    }

    /// Whether the content is on disk (a spill file) rather than in memory.
    #[cfg(test)]
    pub fn on_disk(&self) -> bool {
        self.file().is_some()
    }

    /// The spill file holding the content, if it is on disk.
    #[cfg(test)]
    pub fn file(&self) -> Option<&Path> {
        match &self.at {
            At::File(p) => Some(p),
            At::Mem(_) => None,
        }
    }
}

/// `items` (path, content) written to a spill in `dir`, as the service's fetch leaves them.
#[cfg(test)]
pub fn spilled_for_tests(
    dir: &Path,
    items: &[(&str, &[u8])],
) -> (Spill, std::collections::HashMap<String, Spilled>) {
    let spill = Spill::new(dir, u64::MAX).unwrap();
    let map = items
        .iter()
        .map(|(p, c)| {
            let mut w = spill.writer(p, u64::MAX);
            w.write(c).unwrap();
            (p.to_string(), w.finish().unwrap())
        })
        .collect();
    (spill, map)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pool(max: u64) -> Arc<MemPool> {
        Arc::new(MemPool::new(max))
    }

    #[test]
    fn small_files_stay_in_memory_and_make_no_directory() {
        let d = tempfile::tempdir().unwrap();
        let stale = d.path().join(format!("{SPILL_PREFIX}old"));
        std::fs::create_dir(&stale).unwrap();
        std::fs::write(stale.join("0"), b"left by a killed daemon").unwrap();
        let mem = pool(1 << 20);
        let s = Spill::with_pool(d.path(), 1 << 20, mem.clone()).unwrap();
        assert!(!stale.exists(), "a stale spill directory is removed");
        let mut w = s.writer("a/b.txt", 100);
        assert!(w.write_in_memory(b"hello ").unwrap());
        w.write(b"world\n").unwrap();
        let f = w.finish().unwrap();
        assert_eq!(f.len, 12);
        assert_eq!(f.sha256, super::super::sha256(b"hello world\n"));
        assert_eq!(f.read().unwrap(), b"hello world\n");
        assert!(!f.on_disk());
        assert_eq!(s.used(), 12);
        assert_eq!(mem.used(), 12);
        assert!(s.dir().is_none(), "nothing on disk for a small file");
        assert_eq!(std::fs::read_dir(d.path()).unwrap().count(), 0);
        drop(s);
        assert_eq!(mem.used(), 12, "held while the content is");
        drop(f);
        assert_eq!(mem.used(), 0, "given back with the content");
    }

    #[test]
    fn big_files_and_files_past_the_memory_budget_go_to_disk_and_leave_with_the_spill() {
        let d = tempfile::tempdir().unwrap();
        let mem = pool(MEM_FILE_MAX + 10);
        let s = Spill::with_pool(d.path(), u64::MAX, mem.clone()).unwrap();
        // Past the per-file size: moved to disk with what it had in memory.
        let mut big = s.writer("big", u64::MAX);
        let chunk = vec![7u8; 32 * 1024];
        let mut moved = false;
        for _ in 0..(MEM_FILE_MAX / chunk.len() as u64 + 2) {
            if !big.write_in_memory(&chunk).unwrap() {
                moved = true;
                big.write(&chunk).unwrap();
            }
        }
        assert!(moved, "a file past MEM_FILE_MAX does not stay in memory");
        assert_eq!(mem.used(), 0, "its memory is given back once on disk");
        let big = big.finish().unwrap();
        assert!(big.on_disk());
        let content = big.read().unwrap();
        assert_eq!(content.len() as u64, big.len);
        assert_eq!(big.sha256, super::super::sha256(&content));
        // The pool nearly spent by another file: a small one goes to disk.
        let mut hog = s.writer("hog", u64::MAX);
        hog.write(&vec![1u8; MEM_FILE_MAX as usize]).unwrap();
        let hog = hog.finish().unwrap();
        assert!(!hog.on_disk());
        let mut small = s.writer("small", u64::MAX);
        assert!(!small.write_in_memory(&[2u8; 100]).unwrap());
        small.write(&[2u8; 100]).unwrap();
        let small = small.finish().unwrap();
        assert!(small.on_disk());
        assert_eq!(small.read().unwrap(), vec![2u8; 100]);
        let dir = s.dir().unwrap().to_owned();
        assert!(dir.starts_with(d.path()));
        drop(s);
        assert!(!dir.exists(), "the spill directory goes with the operation");
        assert_eq!(mem.used(), MEM_FILE_MAX);
        drop(hog);
        assert_eq!(mem.used(), 0);
    }

    #[test]
    fn a_file_past_its_limit_or_the_budget_is_cut_off() {
        let d = tempfile::tempdir().unwrap();
        let mem = pool(1 << 20);
        let s = Spill::with_pool(d.path(), 100, mem.clone()).unwrap();
        let e = s.check_announced(101).unwrap_err();
        assert!(matches!(e, WorkspaceError::TooBig(_)), "{e}");
        assert!(
            e.to_string().contains("are 1 MiB, over sync.max_diff_mib"),
            "{e}"
        );
        s.check_announced(100).unwrap();
        // A file that grows past its own limit (an endless /dev/zero), in memory or not.
        let mut w = s.writer("zero", 10);
        w.write(&[0; 10]).unwrap();
        let e = w.write_in_memory(&[0; 1]).unwrap_err().to_string();
        assert!(e.contains("zero") && e.contains("sync.max_file_mib"), "{e}");
        let e = w.write(&[0; 1]).unwrap_err().to_string();
        assert!(e.contains("zero") && e.contains("sync.max_file_mib"), "{e}");
        // Files that together pass the operation's budget.
        let mut a = s.writer("a", 1000);
        let mut b = s.writer("b", 1000);
        a.write(&[1; 60]).unwrap();
        let e = b.write(&[2; 60]).unwrap_err().to_string();
        assert!(e.contains("sync.max_diff_mib"), "{e}");
        assert!(s.used() <= 100);
        drop((w, a, b));
        assert_eq!(mem.used(), 0, "writers that failed give their memory back");
    }
}
