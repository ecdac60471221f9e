//! Installed image sets: which one is current, and which older ones disk layers still use.
//!
//! Owns: the layout of `<artifacts>/`'s image sets. `tryboxi install` puts each set of guest
//! images in its own directory `images-<hash of its manifest>/` and names the current one in
//! the pointer file `images.current`; an artifacts directory without the pointer (a build's
//! `_out/`, or a data root installed before sets were versioned) has its one set in `images/`.
//!
//! Why: a sandbox's disk chain records the base rootfs (or template layer) by path. Replacing
//! the file at that path under a paused sandbox, a snapshot or a golden snapshot would put
//! another filesystem under its overlay. So a set's path never changes meaning: a new set goes
//! into a new directory, and an older one is removed only once no layer below the data root's
//! `sandboxes/` and `golden/` names a file in it (`tryboxi install` and `gc` prune).
//! Never: rewrites a layer's backing file name.

use std::path::{Path, PathBuf};

use sha2::{Digest, Sha256};

/// The file in an artifacts directory naming its current set.
pub const POINTER: &str = "images.current";
/// The unversioned set's directory (and the versioned ones' prefix).
pub const LEGACY: &str = "images";
/// Bound on the pointer file read.
const POINTER_MAX: u64 = 256;
/// How deep the layer scan looks below `sandboxes/` and `golden/`: layers live at
/// `sandboxes/<id>/`, `sandboxes/<id>/{snapshots,forks}/<id>/` and `golden/<key>/vm/`.
const SCAN_DEPTH: usize = 4;

#[derive(Debug, thiserror::Error)]
pub enum SetError {
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
}

fn io(path: &Path) -> impl FnOnce(std::io::Error) -> SetError + '_ {
    move |source| SetError::Io {
        path: path.to_owned(),
        source,
    }
}

/// The directory name of the set whose manifest is `manifest`.
pub fn set_name(manifest: &[u8]) -> String {
    let hex = hex::encode(Sha256::digest(manifest));
    format!("{LEGACY}-{}", &hex[..16])
}

/// Whether `name` is a set directory's name: `images` or `images-` + 16 lowercase hex digits.
pub fn is_set_name(name: &str) -> bool {
    name == LEGACY
        || name.strip_prefix("images-").is_some_and(|h| {
            h.len() == 16
                && h.bytes()
                    .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
        })
}

/// The current set's directory: the one the pointer names when it names a set directory
/// that exists, else `images/`.
pub fn current_dir(artifacts_dir: &Path) -> PathBuf {
    use std::io::Read as _;
    let mut name = String::new();
    let named = std::fs::File::open(artifacts_dir.join(POINTER))
        .and_then(|f| f.take(POINTER_MAX).read_to_string(&mut name))
        .is_ok();
    let name = name.trim();
    if named && is_set_name(name) && artifacts_dir.join(name).is_dir() {
        artifacts_dir.join(name)
    } else {
        artifacts_dir.join(LEGACY)
    }
}

/// Make `name` the current set (the pointer is replaced atomically and made durable).
pub fn switch_to(artifacts_dir: &Path, name: &str) -> Result<(), SetError> {
    use std::io::Write as _;
    let ptr = artifacts_dir.join(POINTER);
    let tmp = artifacts_dir.join(format!(".{POINTER}.{}", std::process::id()));
    let mut f = std::fs::File::create(&tmp).map_err(io(&tmp))?;
    f.write_all(format!("{name}\n").as_bytes())
        .and_then(|()| f.sync_all())
        .map_err(io(&tmp))?;
    std::fs::rename(&tmp, &ptr).map_err(io(&ptr))?;
    std::fs::File::open(artifacts_dir)
        .and_then(|d| d.sync_all())
        .map_err(io(artifacts_dir))
}

/// The set directories in `artifacts_dir` other than the current one (real directories only).
pub fn older_sets(artifacts_dir: &Path) -> Vec<PathBuf> {
    let current = current_dir(artifacts_dir);
    let Ok(rd) = std::fs::read_dir(artifacts_dir) else {
        return Vec::new();
    };
    let mut out: Vec<PathBuf> = rd
        .flatten()
        .filter(|e| e.file_type().is_ok_and(|t| t.is_dir()))
        .filter(|e| e.file_name().to_str().is_some_and(is_set_name))
        .map(|e| e.path())
        .filter(|p| *p != current)
        .collect();
    out.sort();
    out
}

/// A layer below `layer_roots` whose backing file is inside `set`, if any (the first found).
pub fn user_of(set: &Path, layer_roots: &[&Path]) -> Option<PathBuf> {
    let set = std::path::absolute(set).ok()?;
    let mut stack: Vec<(PathBuf, usize)> =
        layer_roots.iter().map(|r| (r.to_path_buf(), 0)).collect();
    while let Some((dir, depth)) = stack.pop() {
        let Ok(rd) = std::fs::read_dir(&dir) else {
            continue;
        };
        for e in rd.flatten() {
            let Ok(t) = e.file_type() else { continue };
            let path = e.path();
            if t.is_dir() {
                // The workspace bases hold the repo's files, never a disk layer.
                if depth < SCAN_DEPTH && e.file_name() != "workspace" {
                    stack.push((path, depth + 1));
                }
                continue;
            }
            if !t.is_file() {
                continue;
            }
            let Ok(Some(backing)) = super::qcow2::backing_file(&path) else {
                continue;
            };
            let backing = if backing.is_absolute() {
                backing
            } else {
                dir.join(backing)
            };
            if std::path::absolute(&backing).is_ok_and(|b| b.starts_with(&set)) {
                return Some(path);
            }
        }
    }
    None
}

/// What [`prune`] did with an older set.
#[derive(Debug)]
pub enum Pruned {
    /// Removed: no layer used it.
    Removed { set: PathBuf, bytes: u64 },
    /// Kept: this layer uses it.
    Kept { set: PathBuf, user: PathBuf },
    /// Could not be removed.
    Failed { set: PathBuf, error: String },
}

/// Remove each older set in `data_root/artifacts` that no layer below the data root's
/// `sandboxes/` and `golden/` uses (`dry_run`: only say which); `usage` measures a set's
/// bytes before it goes.
pub fn prune(data_root: &Path, dry_run: bool, usage: impl Fn(&Path) -> u64) -> Vec<Pruned> {
    let artifacts = data_root.join("artifacts");
    let (sandboxes, golden) = (data_root.join("sandboxes"), data_root.join("golden"));
    let mut out = Vec::new();
    for set in older_sets(&artifacts) {
        if let Some(user) = user_of(&set, &[&sandboxes, &golden]) {
            out.push(Pruned::Kept { set, user });
            continue;
        }
        let bytes = usage(&set);
        if dry_run {
            out.push(Pruned::Removed { set, bytes });
            continue;
        }
        match crate::safefs::remove_under(data_root, &set) {
            Ok(()) => out.push(Pruned::Removed { set, bytes }),
            Err(e) => out.push(Pruned::Failed {
                set,
                error: e.to_string(),
            }),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn set(artifacts: &Path, name: &str) -> PathBuf {
        let d = artifacts.join(name);
        std::fs::create_dir_all(&d).unwrap();
        std::fs::write(d.join("rootfs.ext4"), vec![0u8; 1 << 20]).unwrap();
        d
    }

    #[test]
    fn names_and_the_pointer() {
        let n = set_name(b"{}");
        assert!(is_set_name(&n), "{n}");
        assert!(is_set_name("images"));
        for bad in [
            "images-",
            "images-ABCDEF0123456789",
            "images-0123",
            "../x",
            "images-/",
        ] {
            assert!(!is_set_name(bad), "{bad}");
        }
        let t = tempfile::tempdir().unwrap();
        let a = t.path();
        // No pointer: `images/`.
        assert_eq!(current_dir(a), a.join("images"));
        set(a, &n);
        switch_to(a, &n).unwrap();
        assert_eq!(current_dir(a), a.join(&n));
        // A pointer naming something else, or a missing directory, falls back to `images/`.
        std::fs::write(a.join(POINTER), "../etc\n").unwrap();
        assert_eq!(current_dir(a), a.join("images"));
        std::fs::write(a.join(POINTER), "images-0123456789abcdef\n").unwrap();
        assert_eq!(current_dir(a), a.join("images"));
    }

    #[test]
    fn prune_keeps_a_set_a_layer_uses_and_removes_the_others() {
        let t = tempfile::tempdir().unwrap();
        let root = t.path();
        let a = root.join("artifacts");
        let legacy = set(&a, "images");
        let old = set(&a, "images-00000000000000aa");
        let cur = set(&a, "images-00000000000000bb");
        switch_to(&a, "images-00000000000000bb").unwrap();
        // A paused sandbox's layer over the old set's rootfs, a snapshot's (deeper) over the
        // current one; the workspace base is never read.
        let sbx = root.join("sandboxes/sbx_1");
        std::fs::create_dir_all(sbx.join("snapshots/snp_1")).unwrap();
        std::fs::create_dir_all(sbx.join("workspace")).unwrap();
        crate::vmm::qcow2::create_overlay(&old.join("rootfs.ext4"), "raw", &sbx.join("disk.qcow2"))
            .unwrap();
        crate::vmm::qcow2::create_overlay(
            &cur.join("rootfs.ext4"),
            "raw",
            &sbx.join("snapshots/snp_1/disk.qcow2"),
        )
        .unwrap();
        crate::vmm::qcow2::create_overlay(
            &legacy.join("rootfs.ext4"),
            "raw",
            &sbx.join("workspace/not-a-layer.qcow2"),
        )
        .unwrap();
        assert_eq!(older_sets(&a), vec![legacy.clone(), old.clone()]);

        let dry = prune(root, true, |_| 0);
        assert!(legacy.exists(), "a dry run removes nothing");
        assert!(
            matches!(&dry[0], Pruned::Removed { set, .. } if *set == legacy),
            "{dry:?}"
        );
        let done = prune(root, false, |_| 0);
        assert!(
            matches!(&done[1], Pruned::Kept { set, user } if *set == old && *user == sbx.join("disk.qcow2")),
            "{done:?}"
        );
        assert!(!legacy.exists() && old.exists() && cur.exists());
        // The sandbox gone, the old set goes too; the current one always stays.
        std::fs::remove_dir_all(&sbx).unwrap();
        prune(root, false, |_| 0);
        assert!(!old.exists() && cur.exists());
    }
}
