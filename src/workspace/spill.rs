//! Where a diff (and apply, pull) keeps the VM's changed files while it works: one spill
//! directory per operation inside the sandbox's directory of the data root, removed when the
//! operation ends (and, left by a killed daemon, at the sandbox's next diff), plus the byte
//! budget of the operation (`sync.max_diff_mib`) and the per-file limit (`sync.max_file_mib`).
//!
//! Owns: the spill files (named by a counter, never by the VM's path), their SHA-256 (computed
//! as the bytes arrive, so nothing is read twice to compare), and the limits: a VM that sends
//! more than it announced (a file that grew, or an agent that follows a symlink to
//! `/dev/zero`) is cut off at the limit with [`WorkspaceError::TooBig`]. Never holds a file's
//! content in memory beyond one chunk; never reads the host repo.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use sha2::Digest;

use super::WorkspaceError;

/// Name prefix of spill directories in a sandbox's directory.
pub const SPILL_PREFIX: &str = ".diff-spill-";

/// The spill directory of one operation and its byte budget. Removed when dropped.
pub struct Spill {
    dir: tempfile::TempDir,
    budget: Arc<Budget>,
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
    /// A fresh spill directory in `sandbox_dir`; spill directories left there by an earlier
    /// daemon are removed first (the caller holds the sandbox's workspace lock, so none is in
    /// use). `max_total`: the budget in bytes of every file of this operation together.
    pub fn new(sandbox_dir: &Path, max_total: u64) -> Result<Spill, WorkspaceError> {
        if let Ok(rd) = std::fs::read_dir(sandbox_dir) {
            for ent in rd.flatten() {
                if ent.file_name().to_string_lossy().starts_with(SPILL_PREFIX) {
                    let _ = crate::safefs::remove_under(sandbox_dir, &ent.path());
                }
            }
        }
        let dir = tempfile::Builder::new()
            .prefix(SPILL_PREFIX)
            .tempdir_in(sandbox_dir)
            .map_err(WorkspaceError::io(
                "create a spill directory in",
                sandbox_dir,
            ))?;
        Ok(Spill {
            dir,
            budget: Arc::new(Budget {
                used: AtomicU64::new(0),
                max: max_total,
            }),
            next: AtomicU64::new(0),
        })
    }

    #[cfg(test)]
    pub fn path(&self) -> &Path {
        self.dir.path()
    }

    /// Bytes taken so far.
    pub fn used(&self) -> u64 {
        self.budget.used.load(Ordering::Relaxed)
    }

    /// Refuse up front when `announced` bytes (the sizes the VM's walk gives) do not fit.
    pub fn check_announced(&self, announced: u64) -> Result<(), WorkspaceError> {
        if announced > self.budget.max {
            return Err(over_budget(
                self.budget.max,
                format_args!("{} MiB", announced.div_ceil(1 << 20)),
            ));
        }
        Ok(())
    }

    /// A new spill file for the VM's `rel`, at most `max_file` bytes.
    pub fn writer(&self, rel: &str, max_file: u64) -> Result<SpillWriter, WorkspaceError> {
        let n = self.next.fetch_add(1, Ordering::Relaxed);
        let path = self.dir.path().join(n.to_string());
        let file = std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .open(&path)
            .map_err(WorkspaceError::io("create the spill file", &path))?;
        Ok(SpillWriter {
            file: std::io::BufWriter::with_capacity(256 * 1024, file),
            path,
            rel: rel.to_owned(),
            hasher: sha2::Sha256::new(),
            len: 0,
            max_file,
            budget: self.budget.clone(),
        })
    }
}

/// One VM file being written to its spill file.
pub struct SpillWriter {
    file: std::io::BufWriter<std::fs::File>,
    path: PathBuf,
    rel: String,
    hasher: sha2::Sha256,
    len: u64,
    max_file: u64,
    budget: Arc<Budget>,
}

impl SpillWriter {
    /// Append `chunk`; [`WorkspaceError::TooBig`] once the file passes its limit or the
    /// operation its budget (nothing past the limit is written).
    pub fn write(&mut self, chunk: &[u8]) -> Result<(), WorkspaceError> {
        let n = chunk.len() as u64;
        if self.len.saturating_add(n) > self.max_file {
            return Err(WorkspaceError::TooBig(format!(
                "the VM's file {} is over sync.max_file_mib ({} MiB) (it grew while it was \
                 read, or is not a regular file); run the diff again",
                self.rel,
                self.max_file >> 20
            )));
        }
        if !self.budget.take(n) {
            return Err(over_budget(
                self.budget.max,
                "more than they were when listed",
            ));
        }
        self.file
            .write_all(chunk)
            .map_err(WorkspaceError::io("write the spill file", &self.path))?;
        self.hasher.update(chunk);
        self.len += n;
        Ok(())
    }

    /// The file as written.
    pub fn finish(self) -> Result<Spilled, WorkspaceError> {
        let path = self.path;
        self.file
            .into_inner()
            .map_err(|e| WorkspaceError::io("write the spill file", &path)(e.into_error()))?;
        Ok(Spilled {
            sha256: hex::encode(self.hasher.finalize()),
            len: self.len,
            path,
        })
    }
}

/// A VM file's content in the spill directory.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Spilled {
    pub path: PathBuf,
    pub len: u64,
    pub sha256: String,
}

impl Spilled {
    /// The whole content (callers check `len` against their limit first).
    pub fn read(&self) -> Result<Vec<u8>, WorkspaceError> {
        std::fs::read(&self.path).map_err(WorkspaceError::io("read the spill file", &self.path))
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
            let mut w = spill.writer(p, u64::MAX).unwrap();
            w.write(c).unwrap();
            (p.to_string(), w.finish().unwrap())
        })
        .collect();
    (spill, map)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn files_are_hashed_as_written_and_removed_with_the_spill() {
        let d = tempfile::tempdir().unwrap();
        let stale = d.path().join(format!("{SPILL_PREFIX}old"));
        std::fs::create_dir(&stale).unwrap();
        std::fs::write(stale.join("0"), b"left by a killed daemon").unwrap();
        let s = Spill::new(d.path(), 1 << 20).unwrap();
        assert!(!stale.exists(), "a stale spill directory is removed");
        let mut w = s.writer("a/b.txt", 100).unwrap();
        w.write(b"hello ").unwrap();
        w.write(b"world\n").unwrap();
        let f = w.finish().unwrap();
        assert_eq!(f.len, 12);
        assert_eq!(f.sha256, super::super::sha256(b"hello world\n"));
        assert_eq!(f.read().unwrap(), b"hello world\n");
        assert_eq!(s.used(), 12);
        let dir = s.path().to_owned();
        assert!(dir.starts_with(d.path()));
        drop(s);
        assert!(!dir.exists(), "the spill directory goes with the operation");
    }

    #[test]
    fn a_file_past_its_limit_or_the_budget_is_cut_off() {
        let d = tempfile::tempdir().unwrap();
        let s = Spill::new(d.path(), 100).unwrap();
        let e = s.check_announced(101).unwrap_err();
        assert!(matches!(e, WorkspaceError::TooBig(_)), "{e}");
        assert!(
            e.to_string().contains("are 1 MiB, over sync.max_diff_mib"),
            "{e}"
        );
        s.check_announced(100).unwrap();
        // A file that grows past its own limit (an endless /dev/zero).
        let mut w = s.writer("zero", 10).unwrap();
        w.write(&[0; 10]).unwrap();
        let e = w.write(&[0; 1]).unwrap_err().to_string();
        assert!(e.contains("zero") && e.contains("sync.max_file_mib"), "{e}");
        // Files that together pass the operation's budget.
        let mut a = s.writer("a", 1000).unwrap();
        let mut b = s.writer("b", 1000).unwrap();
        a.write(&[1; 60]).unwrap();
        let e = b.write(&[2; 60]).unwrap_err().to_string();
        assert!(e.contains("sync.max_diff_mib"), "{e}");
        assert!(s.used() <= 100);
        drop((a, b));
        let written: u64 = std::fs::read_dir(s.path())
            .unwrap()
            .map(|e| e.unwrap().metadata().unwrap().len())
            .sum();
        assert!(written <= 100, "{written} bytes on disk");
    }
}
