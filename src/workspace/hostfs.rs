//! Writes into the host repo that never go through a symlink: each parent directory is opened
//! one component at a time from the repo root with `O_DIRECTORY | O_NOFOLLOW` (made when
//! missing), and the file or link is created in that directory under a temp name, then renamed
//! over the path (`renameat`), so a reader sees the old version or the new one.
//!
//! Owns how apply, pull and undo write host files and symlinks. A parent that is a symlink or
//! not a directory fails the write, even one swapped in after the plan's checks.
//! Never follows a symlink below the root, never writes outside it, never deletes (deletes go
//! through `crate::safefs`).

use std::io::Write;
use std::os::fd::OwnedFd;
use std::path::Path;

use nix::errno::Errno;
use nix::fcntl::{OFlag, open, openat, renameat};
use nix::sys::stat::{Mode, fchmod, mkdirat};
use nix::unistd::{UnlinkatFlags, symlinkat, unlinkat};

use super::WorkspaceError;

const DIR_FLAGS: OFlag = OFlag::O_DIRECTORY
    .union(OFlag::O_NOFOLLOW)
    .union(OFlag::O_RDONLY)
    .union(OFlag::O_CLOEXEC);

fn io_err(what: &'static str, path: &Path, e: Errno) -> WorkspaceError {
    WorkspaceError::io(what, path)(std::io::Error::from(e))
}

/// The directory holding `rel` (opened without following any link, made when missing) and the
/// last component of `rel`.
fn parent_dir<'r>(root: &Path, rel: &'r str) -> Result<(OwnedFd, &'r str), WorkspaceError> {
    let parts: Vec<&str> = rel.split('/').collect();
    let Some((name, dirs)) = parts.split_last() else {
        return Err(WorkspaceError::Refused(format!("`{rel}`: empty path")));
    };
    if parts.iter().any(|p| matches!(*p, "" | "." | "..")) {
        return Err(WorkspaceError::Refused(format!(
            "`{rel}`: not a plain relative path"
        )));
    }
    // The root itself may be reached through a link (the user chose it); nothing below it is.
    let mut fd = open(root, DIR_FLAGS.difference(OFlag::O_NOFOLLOW), Mode::empty())
        .map_err(|e| io_err("open", root, e))?;
    let mut here = root.to_path_buf();
    for d in dirs {
        here.push(d);
        let next = match openat(&fd, *d, DIR_FLAGS, Mode::empty()) {
            Err(Errno::ENOENT) => {
                match mkdirat(&fd, *d, Mode::from_bits_truncate(0o777)) {
                    Ok(()) | Err(Errno::EEXIST) => {}
                    Err(e) => return Err(io_err("create", &here, e)),
                }
                openat(&fd, *d, DIR_FLAGS, Mode::empty())
            }
            r => r,
        };
        fd = match next {
            Ok(f) => f,
            Err(Errno::ELOOP | Errno::ENOTDIR) => {
                return Err(WorkspaceError::Refused(format!(
                    "{rel}: parent `{}` is a symlink or not a directory on the host; not written",
                    here.display()
                )));
            }
            Err(e) => return Err(io_err("open", &here, e)),
        };
    }
    Ok((fd, name))
}

/// A fresh name in the same directory (not derived from the target's: a 255-byte name must
/// still get a temp name that fits).
fn temp_name() -> String {
    let mut rnd = [0u8; 8];
    let _ = getrandom::fill(&mut rnd);
    format!(".tryboxi-{}", hex::encode(rnd))
}

/// Write `data` to `root/rel` with exactly `mode` (`& 0o7777`: undo restores the host's own
/// mode as it was; what an apply asks for is already cut to permission bits by the plan),
/// fsynced, atomically.
pub fn write_file(root: &Path, rel: &str, data: &[u8], mode: u32) -> Result<(), WorkspaceError> {
    let (dir, name) = parent_dir(root, rel)?;
    let tmp = temp_name();
    let res = (|| -> Result<(), Errno> {
        let fd = openat(
            &dir,
            tmp.as_str(),
            OFlag::O_WRONLY | OFlag::O_CREAT | OFlag::O_EXCL | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC,
            Mode::from_bits_truncate(0o600),
        )?;
        let mut f = std::fs::File::from(fd);
        let io = |e: std::io::Error| Errno::from_raw(e.raw_os_error().unwrap_or(libc::EIO));
        f.write_all(data).map_err(io)?;
        fchmod(&f, Mode::from_bits_truncate(mode & 0o7777))?;
        f.sync_all().map_err(io)?;
        renameat(&dir, tmp.as_str(), &dir, name)
    })();
    if res.is_err() {
        let _ = unlinkat(&dir, tmp.as_str(), UnlinkatFlags::NoRemoveDir);
    }
    res.map_err(|e| io_err("write", &root.join(rel), e))
}

/// Make `root/rel` a symlink to `target` (replacing a file or link there), atomically.
pub fn symlink(root: &Path, rel: &str, target: &str) -> Result<(), WorkspaceError> {
    let (dir, name) = parent_dir(root, rel)?;
    let tmp = temp_name();
    let res = symlinkat(target, &dir, tmp.as_str())
        .and_then(|()| renameat(&dir, tmp.as_str(), &dir, name));
    if res.is_err() {
        let _ = unlinkat(&dir, tmp.as_str(), UnlinkatFlags::NoRemoveDir);
    }
    res.map_err(|e| io_err("create the symlink", &root.join(rel), e))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    #[test]
    fn writes_make_missing_parents_and_set_the_exact_mode() {
        let d = tempfile::tempdir().unwrap();
        write_file(d.path(), "a/b/c.txt", b"hi", 0o640).unwrap();
        let md = std::fs::metadata(d.path().join("a/b/c.txt")).unwrap();
        assert_eq!(md.permissions().mode() & 0o7777, 0o640);
        // Replacing keeps no temp file behind.
        write_file(d.path(), "a/b/c.txt", b"again", 0o755).unwrap();
        let md = std::fs::metadata(d.path().join("a/b/c.txt")).unwrap();
        assert_eq!(md.permissions().mode() & 0o7777, 0o755);
        assert_eq!(std::fs::read(d.path().join("a/b/c.txt")).unwrap(), b"again");
        assert_eq!(std::fs::read_dir(d.path().join("a/b")).unwrap().count(), 1);
        let long = "n".repeat(255);
        write_file(d.path(), &long, b"long name", 0o644).unwrap();
        symlink(d.path(), "a/l", "b/c.txt").unwrap();
        symlink(d.path(), "a/l", "b").unwrap();
        assert_eq!(
            std::fs::read_link(d.path().join("a/l")).unwrap(),
            Path::new("b")
        );
    }

    #[test]
    fn nothing_is_written_through_a_symlinked_parent() {
        let d = tempfile::tempdir().unwrap();
        let out = tempfile::tempdir().unwrap();
        std::os::unix::fs::symlink(out.path(), d.path().join("evil")).unwrap();
        std::fs::write(d.path().join("file"), b"f").unwrap();
        for rel in ["evil/x", "evil/new/x"] {
            let e = write_file(d.path(), rel, b"x", 0o644).unwrap_err();
            assert!(e.to_string().contains("is a symlink"), "{e}");
            let e = symlink(d.path(), rel, "y").unwrap_err();
            assert!(e.to_string().contains("is a symlink"), "{e}");
        }
        assert!(write_file(d.path(), "file/x", b"x", 0o644).is_err());
        assert!(write_file(d.path(), "a/../x", b"x", 0o644).is_err());
        assert_eq!(std::fs::read_dir(out.path()).unwrap().count(), 0);
        // A root reached through a link is fine.
        let via = tempfile::tempdir().unwrap();
        std::os::unix::fs::symlink(d.path(), via.path().join("repo")).unwrap();
        write_file(&via.path().join("repo"), "ok/y", b"y", 0o644).unwrap();
        assert_eq!(std::fs::read(d.path().join("ok/y")).unwrap(), b"y");
    }
}
