//! Free space on the data root: how much there is, whether a big write fits, and how a write
//! that ran out of it is told apart from other failures.
//!
//! Owns: [`NoSpace`] (the error behind the API's `no_space` code), the free-space check done
//! before each big write (snapshot, pause, fork, first sync's base disk, apply backup: each
//! knows its size in advance, e.g. the guest RAM it copies) and before a create, and
//! recognising ENOSPC/EDQUOT in I/O errors and in QEMU's messages (a migration that ran out of
//! space reports it as text over QMP).
//! Never: deletes anything (the callers remove their partial files).

use std::path::{Path, PathBuf};

const MIB: u64 = 1 << 20;

/// A write that does not fit (or did not) on the filesystem of `path`.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{}", self.describe())]
pub struct NoSpace {
    /// A path on the filesystem that is full (the data root or a sandbox's directory).
    pub path: PathBuf,
    /// What was being written (`a snapshot of sbx_...`).
    pub what: String,
    /// Bytes the write needs (0 when it is not known, after an ENOSPC).
    pub need: u64,
    /// Bytes that must stay free after it.
    pub reserve: u64,
    /// Bytes free when the check was made (or after the failed write was cleaned up).
    pub free: u64,
    /// The failed write's own error, when it ran out of space (rather than being refused).
    pub detail: Option<String>,
}

impl NoSpace {
    fn describe(&self) -> String {
        let mut m = format!(
            "no space left on the filesystem of {}: {}",
            self.path.display(),
            self.what
        );
        if self.need > 0 {
            m.push_str(&format!(" needs about {} MiB and", self.need.div_ceil(MIB)));
        }
        if self.reserve > 0 {
            m.push_str(&format!(" {} MiB must stay free,", self.reserve / MIB));
        } else {
            m.push_str(" ran out of space,");
        }
        m.push_str(&format!(" {} MiB are free", self.free / MIB));
        if let Some(d) = &self.detail {
            m.push_str(&format!(" ({d})"));
        }
        m
    }
}

/// Bytes an unprivileged process may still write on the filesystem of `path` (the nearest
/// existing ancestor when `path` does not exist yet).
pub fn free_bytes(path: &Path) -> std::io::Result<u64> {
    let mut at = path;
    while !at.exists() {
        match at.parent() {
            Some(p) => at = p,
            None => break,
        }
    }
    let s = nix::sys::statvfs::statvfs(at).map_err(std::io::Error::from)?;
    Ok((s.blocks_available() as u64).saturating_mul(s.fragment_size() as u64))
}

/// Refuse a write of about `need` bytes on the filesystem of `path` unless `reserve` bytes
/// stay free after it. A filesystem whose free space cannot be read is not refused (the write
/// itself will say).
pub fn ensure_room(path: &Path, what: &str, need: u64, reserve: u64) -> Result<(), NoSpace> {
    let Ok(free) = free_bytes(path) else {
        return Ok(());
    };
    if free >= need.saturating_add(reserve) {
        return Ok(());
    }
    tracing::warn!(path = %path.display(), what, need, reserve, free, "refused: not enough free space");
    Err(NoSpace {
        path: path.to_owned(),
        what: what.to_owned(),
        need,
        reserve,
        free,
        detail: None,
    })
}

/// Whether an I/O error is the filesystem (or the user's quota) being full.
pub fn is_no_space(e: &std::io::Error) -> bool {
    matches!(e.raw_os_error(), Some(libc::ENOSPC) | Some(libc::EDQUOT))
        || e.kind() == std::io::ErrorKind::StorageFull
        || e.kind() == std::io::ErrorKind::QuotaExceeded
}

/// Whether an error's text says the filesystem was full: the strerror of ENOSPC/EDQUOT as
/// QEMU, qemu-img, mkfs and Rust's `io::Error` print it.
pub fn mentions_no_space(msg: &str) -> bool {
    let m = msg.to_ascii_lowercase();
    m.contains("no space left on device") || m.contains("disk quota exceeded")
}

/// If `err` (a failed write's message) says the filesystem of `path` was full, the
/// [`NoSpace`] to report (with the space free now); `None` for any other failure.
pub fn after_failure(path: &Path, what: &str, err: &str) -> Option<NoSpace> {
    if !mentions_no_space(err) {
        return None;
    }
    Some(NoSpace {
        path: path.to_owned(),
        what: what.to_owned(),
        need: 0,
        reserve: 0,
        free: free_bytes(path).unwrap_or(0),
        detail: Some(err.to_owned()),
    })
}

/// The [`NoSpace`] of a write to `path` that failed with `err` (an ENOSPC/EDQUOT, see
/// [`is_no_space`]), with the space free now.
pub fn after_io(path: &Path, what: &str, err: &std::io::Error) -> NoSpace {
    NoSpace {
        path: path.to_owned(),
        what: what.to_owned(),
        need: 0,
        reserve: 0,
        free: free_bytes(path).unwrap_or(0),
        detail: Some(err.to_string()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn enospc_and_edquot_are_no_space_and_other_errors_are_not() {
        assert!(is_no_space(&std::io::Error::from_raw_os_error(
            libc::ENOSPC
        )));
        assert!(is_no_space(&std::io::Error::from_raw_os_error(
            libc::EDQUOT
        )));
        assert!(!is_no_space(&std::io::Error::from_raw_os_error(libc::EIO)));
        assert!(!is_no_space(&std::io::Error::from_raw_os_error(
            libc::EACCES
        )));
        // The text of an ENOSPC as it reaches us from QEMU over QMP and from io::Error.
        let enospc = std::io::Error::from_raw_os_error(libc::ENOSPC).to_string();
        assert!(mentions_no_space(&enospc), "{enospc}");
        assert!(mentions_no_space(
            "QMP error: migration \"failed\": Unable to write to file: No space left on device"
        ));
        assert!(!mentions_no_space("migration failed: Input/output error"));
    }

    #[test]
    fn a_failure_that_is_not_about_space_is_not_mapped() {
        let dir = tempfile::tempdir().unwrap();
        assert!(after_failure(dir.path(), "x", "connection reset").is_none());
        let e = after_failure(
            dir.path(),
            "a snapshot of sbx_1",
            "cannot write state.bin: No space left on device (os error 28)",
        )
        .unwrap();
        let msg = e.to_string();
        assert!(
            msg.starts_with("no space left on the filesystem of "),
            "{msg}"
        );
        assert!(msg.contains("a snapshot of sbx_1"), "{msg}");
        assert!(msg.contains("MiB are free"), "{msg}");
        assert!(msg.contains("os error 28"), "{msg}");
    }

    #[test]
    fn a_write_bigger_than_the_free_space_is_refused_with_the_figures() {
        let dir = tempfile::tempdir().unwrap();
        let free = free_bytes(dir.path()).unwrap();
        assert!(free > 0);
        ensure_room(dir.path(), "small", 1, 0).unwrap();
        let e = ensure_room(dir.path(), "a snapshot", free, 64 * MIB).unwrap_err();
        assert_eq!(e.reserve, 64 * MIB);
        assert!(e.free >= free.saturating_sub(64 * MIB), "{e:?}");
        let msg = e.to_string();
        assert!(msg.contains("64 MiB must stay free"), "{msg}");
        // A path that does not exist yet is measured on its nearest existing parent.
        assert!(free_bytes(&dir.path().join("not/yet")).unwrap() > 0);
    }
}
