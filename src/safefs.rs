//! The only code path that deletes files outside a temporary directory.
//!
//! Owns: [`remove_under`], a fenced delete. It resolves symlinks in the target's parent,
//! refuses anything that is not strictly inside the (resolved) root, and never follows a
//! symlink at the final component (the link itself is removed, not its target).
//! Never: deletes the root itself, or anything reached through a symlink that leaves the root.

use std::io;
use std::path::{Component, Path, PathBuf};

#[derive(Debug, thiserror::Error)]
pub enum SafeFsError {
    #[error("refusing to delete {path}: it is not inside {root}")]
    Outside { root: PathBuf, path: PathBuf },
    #[error("refusing to delete {0}: not a plain path (empty, `..` or the root itself)")]
    BadPath(PathBuf),
    #[error("cannot delete {path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
}

/// Delete `path` (a file, a symlink, or a directory tree) if and only if it lies strictly inside
/// `root` after resolving symlinks in its parent directories. A missing `path` is not an error.
pub fn remove_under(root: &Path, path: &Path) -> Result<(), SafeFsError> {
    let io_err = |p: &Path| {
        let p = p.to_path_buf();
        move |source| SafeFsError::Io { path: p, source }
    };
    if path.as_os_str().is_empty() || path.components().any(|c| matches!(c, Component::ParentDir)) {
        return Err(SafeFsError::BadPath(path.to_path_buf()));
    }
    let root = root.canonicalize().map_err(io_err(root))?;
    let path = if path.is_absolute() {
        path.to_path_buf()
    } else {
        root.join(path)
    };
    let (Some(parent), Some(name)) = (path.parent(), path.file_name()) else {
        return Err(SafeFsError::BadPath(path));
    };
    let parent = match parent.canonicalize() {
        Ok(p) => p,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(()),
        Err(e) => {
            return Err(SafeFsError::Io {
                path: parent.to_path_buf(),
                source: e,
            });
        }
    };
    if !parent.starts_with(&root) {
        return Err(SafeFsError::Outside { root, path });
    }
    let target = parent.join(name);
    if target == root {
        return Err(SafeFsError::BadPath(target));
    }
    let meta = match std::fs::symlink_metadata(&target) {
        Ok(m) => m,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(()),
        Err(e) => {
            return Err(SafeFsError::Io {
                path: target,
                source: e,
            });
        }
    };
    let res = if meta.is_dir() {
        // std's remove_dir_all does not follow symlinks inside the tree.
        std::fs::remove_dir_all(&target)
    } else {
        std::fs::remove_file(&target)
    };
    match res {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(SafeFsError::Io {
            path: target,
            source: e,
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::symlink;

    #[test]
    fn removes_a_tree_inside_the_root() {
        let root = tempfile::tempdir().unwrap();
        let d = root.path().join("a/b");
        std::fs::create_dir_all(&d).unwrap();
        std::fs::write(d.join("f"), b"x").unwrap();
        remove_under(root.path(), &root.path().join("a")).unwrap();
        assert!(!root.path().join("a").exists());
    }

    #[test]
    fn refuses_a_path_outside_the_root() {
        let root = tempfile::tempdir().unwrap();
        let other = tempfile::tempdir().unwrap();
        let f = other.path().join("keep");
        std::fs::write(&f, b"x").unwrap();
        let e = remove_under(root.path(), &f).unwrap_err();
        assert!(matches!(e, SafeFsError::Outside { .. }), "{e}");
        assert!(f.exists());
    }

    #[test]
    fn refuses_dotdot_and_the_root_itself() {
        let root = tempfile::tempdir().unwrap();
        assert!(matches!(
            remove_under(root.path(), &root.path().join("x/../..")),
            Err(SafeFsError::BadPath(_))
        ));
        assert!(remove_under(root.path(), root.path()).is_err());
        assert!(root.path().exists());
    }

    #[test]
    fn refuses_a_path_through_a_symlinked_parent_leaving_the_root() {
        let root = tempfile::tempdir().unwrap();
        let other = tempfile::tempdir().unwrap();
        std::fs::write(other.path().join("keep"), b"x").unwrap();
        symlink(other.path(), root.path().join("link")).unwrap();
        let e = remove_under(root.path(), &root.path().join("link/keep")).unwrap_err();
        assert!(matches!(e, SafeFsError::Outside { .. }), "{e}");
        assert!(other.path().join("keep").exists());
    }

    #[test]
    fn removes_a_symlink_not_its_target() {
        let root = tempfile::tempdir().unwrap();
        let other = tempfile::tempdir().unwrap();
        std::fs::write(other.path().join("keep"), b"x").unwrap();
        symlink(other.path(), root.path().join("link")).unwrap();
        remove_under(root.path(), &root.path().join("link")).unwrap();
        assert!(!root.path().join("link").exists());
        assert!(other.path().join("keep").exists());
    }

    #[test]
    fn missing_path_is_fine() {
        let root = tempfile::tempdir().unwrap();
        remove_under(root.path(), &root.path().join("nope/nothing")).unwrap();
    }
}
