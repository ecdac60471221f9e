//! Backups of apply/pull and their undo.
//!
//! Layout: `<data root>/artifacts/<art_id>/record.json` (the [`ArtifactRecord`], also kept in
//! the store's `artifacts` table) and `<data root>/artifacts/<art_id>/files/<n>` (the host's
//! content of entry `n` before the change). The record and every backup are written and synced
//! *before* the first host file changes, and each host write is atomic (temp + rename, through [`super::hostfs`]: never via a symlinked
//! parent), so a
//! daemon killed mid-apply leaves old or new content per file and `undo` still restores all.
//! Deletes go only through `crate::safefs::remove_under`.

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use super::WorkspaceError;
use super::apply::{Action, HostState, Op, check_host_parents, host_state};
use super::hostfs;
use super::manifest::write_atomic;
use crate::api::UndoReport;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ArtifactState {
    /// Backups taken; host writes may be partly done (a killed daemon leaves this).
    Applying,
    Applied,
    Undone,
}

/// What the host had at a path before apply/pull changed it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum Before {
    Absent,
    File {
        mode: u32,
        sha256: String,
        backup: String,
    },
    Symlink {
        target: String,
    },
}

/// What the host has at a path right after apply/pull wrote it (undo checks it is still so).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum After {
    Absent,
    File { mode: u32, sha256: String },
    Symlink { target: String },
}

impl Before {
    /// Whether the host holds exactly this (content and mode): undo would write what is there.
    fn matches(&self, host: &HostState) -> bool {
        match (self, host) {
            (Before::Absent, HostState::Absent) => true,
            (Before::File { mode, sha256, .. }, HostState::File { content, mode: m }) => {
                mode & 0o7777 == m & 0o7777 && *sha256 == super::sha256(content)
            }
            (Before::Symlink { target }, HostState::Symlink(t)) => target == t,
            _ => false,
        }
    }
}

impl After {
    fn of(action: &Action) -> After {
        match action {
            Action::Write { content, mode } => After::File {
                mode: *mode & 0o7777,
                sha256: super::sha256(content),
            },
            Action::Symlink { target } => After::Symlink {
                target: target.clone(),
            },
            Action::Delete => After::Absent,
        }
    }

    /// Whether the host still holds exactly this (content and mode; mtime does not count).
    fn matches(&self, host: &HostState) -> bool {
        match (self, host) {
            (After::Absent, HostState::Absent) => true,
            (After::File { mode, sha256 }, HostState::File { content, mode: m }) => {
                mode == m && *sha256 == super::sha256(content)
            }
            (After::Symlink { target }, HostState::Symlink(t)) => target == t,
            _ => false,
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct BackupEntry {
    pub path: String,
    pub before: Before,
    /// What the apply left there; `None` in records of older versions (undo then needs force).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub after: Option<After>,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ArtifactRecord {
    pub id: String,
    pub sandbox_id: String,
    /// `apply` or `pull`.
    pub kind: String,
    pub created_at: String,
    pub host_root: PathBuf,
    pub state: ArtifactState,
    pub entries: Vec<BackupEntry>,
    /// What a forced undo overwrote (host edits made after the apply), backed up under
    /// `undone/<n>` next to the apply's own backups.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub overwritten_by_undo: Vec<BackupEntry>,
}

/// Write the record next to the backups (synced) and through `persist` (the store).
fn save(
    dir: &Path,
    rec: &ArtifactRecord,
    persist: &mut dyn FnMut(&ArtifactRecord) -> Result<(), WorkspaceError>,
) -> Result<(), WorkspaceError> {
    let json = serde_json::to_vec_pretty(rec).map_err(|e| WorkspaceError::Store(e.to_string()))?;
    write_atomic(&dir.join("record.json"), &json, 0o600)?;
    persist(rec)
}

/// Back up every path `ops` touch, record it, then perform the ops. `rec` comes in with its
/// identity filled and no entries.
pub fn execute(
    root: &Path,
    dir: &Path,
    mut rec: ArtifactRecord,
    ops: &[Op],
    persist: &mut dyn FnMut(&ArtifactRecord) -> Result<(), WorkspaceError>,
) -> Result<ArtifactRecord, WorkspaceError> {
    // Until the record says `applying`, no host file has changed: a backup that fails (e.g.
    // the data root is full) removes what it wrote and leaves the host repo as it was.
    if let Err(e) = back_up(root, dir, &mut rec, ops, persist) {
        if let Some(parent) = dir.parent()
            && let Err(rm) = crate::safefs::remove_under(parent, dir)
        {
            tracing::warn!(dir = %dir.display(), error = %rm, "cannot remove a failed backup");
        }
        return Err(e);
    }
    let kill_after = kill_after_writes();
    for (n, op) in ops.iter().enumerate() {
        if kill_after == Some(n) {
            crash_for_test();
        }
        let p = root.join(&op.path);
        check_host_parents(root, &op.path).map_err(WorkspaceError::Refused)?;
        match &op.action {
            Action::Write { content, mode } => hostfs::write_file(root, &op.path, content, *mode)?,
            Action::Symlink { target } => hostfs::symlink(root, &op.path, target)?,
            Action::Delete => crate::safefs::remove_under(root, &p)
                .map_err(|e| WorkspaceError::Refused(e.to_string()))?,
        }
    }
    rec.state = ArtifactState::Applied;
    save(dir, &rec, persist)?;
    Ok(rec)
}

/// The first half of [`execute`]: back up what the host has at every path `ops` touch, then
/// record it (state `applying`). Writes only under `dir`.
fn back_up(
    root: &Path,
    dir: &Path,
    rec: &mut ArtifactRecord,
    ops: &[Op],
    persist: &mut dyn FnMut(&ArtifactRecord) -> Result<(), WorkspaceError>,
) -> Result<(), WorkspaceError> {
    std::fs::create_dir_all(dir.join("files")).map_err(WorkspaceError::io("create", dir))?;
    for (n, op) in ops.iter().enumerate() {
        let before = match host_state(root, &op.path)? {
            HostState::Absent => Before::Absent,
            HostState::Symlink(target) => Before::Symlink { target },
            HostState::File { content, mode } => {
                let name = n.to_string();
                write_atomic(&dir.join("files").join(&name), &content, 0o600)?;
                Before::File {
                    mode,
                    sha256: super::sha256(&content),
                    backup: name,
                }
            }
            HostState::Other => {
                return Err(WorkspaceError::Refused(format!(
                    "{}: the host has a directory or special file there",
                    op.path
                )));
            }
        };
        rec.entries.push(BackupEntry {
            path: op.path.clone(),
            before,
            after: Some(After::of(&op.action)),
        });
    }
    rec.state = ArtifactState::Applying;
    save(dir, rec, persist)
}

/// Crash-consistency test hook: with `TRYBOXI_TEST_KILL_AFTER_WRITES=N` in the daemon's
/// environment, an apply SIGKILLs the daemon after its first N host writes (backups and record
/// already on disk). Never set in normal use.
fn kill_after_writes() -> Option<usize> {
    std::env::var("TRYBOXI_TEST_KILL_AFTER_WRITES")
        .ok()
        .and_then(|v| v.parse().ok())
}

fn crash_for_test() {
    tracing::warn!("TRYBOXI_TEST_KILL_AFTER_WRITES reached: killing the daemon mid-apply");
    let _ = nix::sys::signal::kill(nix::unistd::getpid(), nix::sys::signal::Signal::SIGKILL);
}

/// Paths of `rec` the host changed after the apply wrote them (a record without the
/// after-state counts as changed: it cannot be checked). In a record left `Applying` (the
/// daemon was killed mid-apply) a path that still holds its before-state was never written: no
/// edit.
fn host_edits(
    root: &Path,
    rec: &ArtifactRecord,
) -> Result<Vec<(usize, HostState)>, WorkspaceError> {
    let mut out = Vec::new();
    for (n, e) in rec.entries.iter().enumerate() {
        check_host_parents(root, &e.path).map_err(WorkspaceError::Refused)?;
        let host = host_state(root, &e.path)?;
        let unwritten = rec.state == ArtifactState::Applying && e.before.matches(&host);
        if !e.after.as_ref().is_some_and(|a| a.matches(&host)) && !unwritten {
            out.push((n, host));
        }
    }
    Ok(out)
}

/// Restore what the artifact changed, byte for byte (content and mode), removing files it added.
///
/// A path the host changed after the apply (edited, deleted, recreated) is not silently
/// overwritten: without `force` nothing is changed and [`WorkspaceError::HostEdited`] names
/// them; with `force` their current content is first backed up under `undone/` in the
/// artifact's directory (listed in the record's `overwritten_by_undo` and the report).
pub fn undo(
    dir: &Path,
    mut rec: ArtifactRecord,
    force: bool,
    persist: &mut dyn FnMut(&ArtifactRecord) -> Result<(), WorkspaceError>,
) -> Result<UndoReport, WorkspaceError> {
    if rec.state == ArtifactState::Undone {
        return Err(WorkspaceError::AlreadyUndone(rec.id));
    }
    let root = rec.host_root.clone();
    let edits = host_edits(&root, &rec)?;
    if !edits.is_empty() && !force {
        let names: Vec<&str> = edits
            .iter()
            .map(|(n, _)| rec.entries[*n].path.as_str())
            .collect();
        return Err(WorkspaceError::HostEdited(format!(
            "undo of {} would overwrite host changes made after it was applied, in: {}; nothing \
             was changed (undo with force to overwrite them; their current content is backed up \
             first)",
            rec.id,
            names.join(", ")
        )));
    }
    let mut report = UndoReport {
        artifact_id: rec.id.clone(),
        restored: Vec::new(),
        removed: Vec::new(),
        overwritten: Vec::new(),
        overwritten_backup: None,
    };
    if !edits.is_empty() {
        let bdir = dir.join("undone");
        std::fs::create_dir_all(&bdir).map_err(WorkspaceError::io("create", &bdir))?;
        for (n, host) in edits {
            let path = rec.entries[n].path.clone();
            let before = match host {
                HostState::Absent => Before::Absent,
                HostState::Symlink(target) => Before::Symlink { target },
                HostState::File { content, mode } => {
                    let name = n.to_string();
                    write_atomic(&bdir.join(&name), &content, 0o600)?;
                    Before::File {
                        mode,
                        sha256: super::sha256(&content),
                        backup: name,
                    }
                }
                HostState::Other => {
                    return Err(WorkspaceError::Refused(format!(
                        "{path}: the host now has a directory or special file there; move it \
                         away and undo again"
                    )));
                }
            };
            report.overwritten.push(path.clone());
            rec.overwritten_by_undo.push(BackupEntry {
                path,
                before,
                after: None,
            });
        }
        // The backups of what is about to be overwritten are durable before the first write.
        save(dir, &rec, persist)?;
        report.overwritten_backup = Some(bdir.display().to_string());
    }
    for e in rec.entries.iter().rev() {
        check_host_parents(&root, &e.path).map_err(WorkspaceError::Refused)?;
        let p = root.join(&e.path);
        match &e.before {
            Before::Absent => {
                if std::fs::symlink_metadata(&p).is_ok() {
                    crate::safefs::remove_under(&root, &p)
                        .map_err(|e| WorkspaceError::Refused(e.to_string()))?;
                    report.removed.push(e.path.clone());
                }
            }
            Before::File {
                mode,
                sha256,
                backup,
            } => {
                let bp = dir.join("files").join(backup);
                let data =
                    std::fs::read(&bp).map_err(WorkspaceError::io("read the backup", &bp))?;
                if super::sha256(&data) != *sha256 {
                    return Err(WorkspaceError::Refused(format!(
                        "the backup of {} in {} is damaged (hash mismatch); nothing more restored",
                        e.path,
                        bp.display()
                    )));
                }
                if std::fs::symlink_metadata(&p).is_ok_and(|m| m.is_dir()) {
                    crate::safefs::remove_under(&root, &p)
                        .map_err(|e| WorkspaceError::Refused(e.to_string()))?;
                }
                hostfs::write_file(&root, &e.path, &data, *mode)?;
                report.restored.push(e.path.clone());
            }
            Before::Symlink { target } => {
                hostfs::symlink(&root, &e.path, target)?;
                report.restored.push(e.path.clone());
            }
        }
    }
    rec.state = ArtifactState::Undone;
    save(dir, &rec, persist)?;
    report.restored.reverse();
    report.removed.reverse();
    Ok(report)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    /// A host repo and an artifact directory (both temporary).
    fn dirs() -> (tempfile::TempDir, tempfile::TempDir) {
        (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap())
    }

    fn write_op(path: &str, content: &[u8], mode: u32) -> Op {
        Op {
            path: path.into(),
            action: Action::Write {
                content: content.to_vec(),
                mode,
            },
        }
    }

    /// `execute` of `ops` on `root` with no store to persist to.
    fn execute_quiet(
        root: &Path,
        art: &Path,
        ops: &[Op],
    ) -> Result<ArtifactRecord, WorkspaceError> {
        execute(root, art, rec(root), ops, &mut |_| Ok(()))
    }

    /// `undo` with no store to persist to.
    fn undo_quiet(
        art: &Path,
        r: ArtifactRecord,
        force: bool,
    ) -> Result<UndoReport, WorkspaceError> {
        undo(art, r, force, &mut |_| Ok(()))
    }

    fn rec(root: &Path) -> ArtifactRecord {
        ArtifactRecord {
            id: "art_test".into(),
            sandbox_id: "sbx_test".into(),
            kind: "apply".into(),
            created_at: "now".into(),
            host_root: root.to_path_buf(),
            state: ArtifactState::Applying,
            entries: vec![],
            overwritten_by_undo: vec![],
        }
    }

    #[test]
    fn apply_then_undo_restores_bytes_modes_and_removes_added_files() {
        let (repo, art) = dirs();
        let root = repo.path();
        std::fs::write(root.join("mod.sh"), b"old\x00bytes").unwrap();
        std::fs::set_permissions(root.join("mod.sh"), std::fs::Permissions::from_mode(0o750))
            .unwrap();
        std::fs::write(root.join("gone.txt"), b"bye").unwrap();
        let ops = vec![
            write_op("mod.sh", b"new", 0o644),
            write_op("new/dir/add.txt", b"added", 0o600),
            Op {
                path: "gone.txt".into(),
                action: Action::Delete,
            },
        ];
        let mut saved = Vec::new();
        let r = execute(root, art.path(), rec(root), &ops, &mut |r| {
            saved.push(r.state);
            Ok(())
        })
        .unwrap();
        assert_eq!(saved, [ArtifactState::Applying, ArtifactState::Applied]);
        assert_eq!(std::fs::read(root.join("mod.sh")).unwrap(), b"new");
        assert_eq!(
            std::fs::read(root.join("new/dir/add.txt")).unwrap(),
            b"added"
        );
        assert!(!root.join("gone.txt").exists());

        let rep = undo_quiet(art.path(), r.clone(), false).unwrap();
        assert_eq!(std::fs::read(root.join("mod.sh")).unwrap(), b"old\x00bytes");
        let mode = std::fs::metadata(root.join("mod.sh"))
            .unwrap()
            .permissions()
            .mode()
            & 0o7777;
        assert_eq!(mode, 0o750);
        assert_eq!(std::fs::read(root.join("gone.txt")).unwrap(), b"bye");
        assert!(!root.join("new/dir/add.txt").exists());
        assert_eq!(rep.restored, ["mod.sh", "gone.txt"]);
        assert_eq!(rep.removed, ["new/dir/add.txt"]);
        let mut r2 = r;
        r2.state = ArtifactState::Undone;
        assert!(matches!(
            undo_quiet(art.path(), r2, false),
            Err(WorkspaceError::AlreadyUndone(_))
        ));
    }

    #[test]
    fn a_damaged_backup_is_detected_not_restored() {
        let (repo, art) = dirs();
        let root = repo.path();
        std::fs::write(root.join("f"), b"orig").unwrap();
        let ops = vec![write_op("f", b"x", 0o644)];
        let r = execute_quiet(root, art.path(), &ops).unwrap();
        std::fs::write(art.path().join("files/0"), b"tampered").unwrap();
        assert!(undo_quiet(art.path(), r, false).is_err());
        assert_eq!(std::fs::read(root.join("f")).unwrap(), b"x");
    }

    fn one_write(root: &Path, art: &Path) -> ArtifactRecord {
        std::fs::write(root.join("a.txt"), b"before").unwrap();
        let ops = vec![
            write_op("a.txt", b"applied", 0o644),
            write_op("new.txt", b"added", 0o644),
        ];
        execute_quiet(root, art, &ops).unwrap()
    }

    #[test]
    fn undo_refuses_to_overwrite_host_edits_made_after_the_apply() {
        let (repo, art) = dirs();
        let root = repo.path();
        let r = one_write(root, art.path());
        // The user edits an applied file and a mode change elsewhere counts too.
        std::fs::write(root.join("a.txt"), b"my later edit").unwrap();
        let err = undo_quiet(art.path(), r.clone(), false).unwrap_err();
        let msg = err.to_string();
        assert!(matches!(err, WorkspaceError::HostEdited(_)), "{msg}");
        assert!(msg.contains("a.txt") && !msg.contains("new.txt"), "{msg}");
        // Nothing was touched.
        assert_eq!(std::fs::read(root.join("a.txt")).unwrap(), b"my later edit");
        assert_eq!(std::fs::read(root.join("new.txt")).unwrap(), b"added");

        // A deleted added file and a chmod are host edits as well.
        std::fs::write(root.join("a.txt"), b"applied").unwrap();
        std::fs::set_permissions(root.join("a.txt"), std::fs::Permissions::from_mode(0o600))
            .unwrap();
        std::fs::remove_file(root.join("new.txt")).unwrap();
        let msg = undo_quiet(art.path(), r.clone(), false)
            .unwrap_err()
            .to_string();
        assert!(msg.contains("a.txt") && msg.contains("new.txt"), "{msg}");
    }

    #[test]
    fn forced_undo_backs_up_the_host_edits_it_overwrites() {
        let (repo, art) = dirs();
        let root = repo.path();
        let r = one_write(root, art.path());
        std::fs::write(root.join("a.txt"), b"my later edit").unwrap();
        let mut saved = Vec::new();
        let rep = undo(art.path(), r, true, &mut |r| {
            saved.push(r.clone());
            Ok(())
        })
        .unwrap();
        assert_eq!(std::fs::read(root.join("a.txt")).unwrap(), b"before");
        assert!(!root.join("new.txt").exists());
        assert_eq!(rep.overwritten, ["a.txt"]);
        let bdir = PathBuf::from(rep.overwritten_backup.unwrap());
        let last = saved.last().unwrap();
        assert_eq!(last.state, ArtifactState::Undone);
        let Before::File { backup, sha256, .. } = &last.overwritten_by_undo[0].before else {
            panic!("{:?}", last.overwritten_by_undo);
        };
        let kept = std::fs::read(bdir.join(backup)).unwrap();
        assert_eq!(kept, b"my later edit");
        assert_eq!(super::super::sha256(&kept), *sha256);
        // The backup was recorded before the overwrite.
        assert_eq!(saved[0].state, ArtifactState::Applied);
        assert_eq!(saved[0].overwritten_by_undo.len(), 1);
    }

    #[test]
    fn paths_an_interrupted_apply_never_wrote_are_no_host_edits() {
        let (repo, art) = dirs();
        let root = repo.path();
        let mut r = one_write(root, art.path());
        // As if killed after the first write: new.txt not written yet.
        std::fs::remove_file(root.join("new.txt")).unwrap();
        r.state = ArtifactState::Applying;
        let rep = undo_quiet(art.path(), r.clone(), false).unwrap();
        assert!(rep.overwritten.is_empty(), "{:?}", rep.overwritten);
        assert_eq!(std::fs::read(root.join("a.txt")).unwrap(), b"before");
        // A real edit in an interrupted apply still needs force.
        let mut r = one_write(root, art.path());
        r.state = ArtifactState::Applying;
        std::fs::write(root.join("a.txt"), b"my later edit").unwrap();
        assert!(matches!(
            undo_quiet(art.path(), r, false),
            Err(WorkspaceError::HostEdited(_))
        ));
    }

    #[test]
    fn undo_without_host_edits_needs_no_force_and_old_records_do() {
        let (repo, art) = dirs();
        let root = repo.path();
        let mut r = one_write(root, art.path());
        for e in &mut r.entries {
            e.after = None; // as written by an older version
        }
        assert!(matches!(
            undo_quiet(art.path(), r.clone(), false),
            Err(WorkspaceError::HostEdited(_))
        ));
        let r = one_write(root, art.path());
        let rep = undo_quiet(art.path(), r, false).unwrap();
        assert!(rep.overwritten.is_empty() && rep.overwritten_backup.is_none());
        assert_eq!(std::fs::read(root.join("a.txt")).unwrap(), b"before");
    }
}

#[cfg(test)]
mod full_disk_tests {
    use super::*;

    fn rec(root: &Path) -> ArtifactRecord {
        ArtifactRecord {
            id: "art_full".into(),
            sandbox_id: "sbx_full".into(),
            kind: "apply".into(),
            created_at: "now".into(),
            host_root: root.to_path_buf(),
            state: ArtifactState::Applying,
            entries: vec![],
            overwritten_by_undo: vec![],
        }
    }

    fn write_op(path: &str, content: &[u8]) -> Op {
        Op {
            path: path.into(),
            action: Action::Write {
                content: content.to_vec(),
                mode: 0o644,
            },
        }
    }

    #[test]
    fn a_backup_that_cannot_be_recorded_removes_its_files_and_leaves_the_host_alone() {
        let repo = tempfile::tempdir().unwrap();
        let arts = tempfile::tempdir().unwrap();
        std::fs::write(repo.path().join("a.txt"), "host\n").unwrap();
        let dir = arts.path().join("art_full");
        let ops = [write_op("a.txt", b"vm\n"), write_op("new.txt", b"vm\n")];
        let err = execute(repo.path(), &dir, rec(repo.path()), &ops, &mut |_| {
            Err(WorkspaceError::Store(
                "No space left on device (os error 28)".into(),
            ))
        })
        .unwrap_err();
        assert!(matches!(err, WorkspaceError::Store(_)), "{err}");
        assert_eq!(
            std::fs::read_to_string(repo.path().join("a.txt")).unwrap(),
            "host\n"
        );
        assert!(!repo.path().join("new.txt").exists());
        assert!(!dir.exists(), "the partial backup is left behind");
    }

    /// A real ENOSPC: the artifacts directory is a 64 KiB tmpfs (root only).
    #[test]
    fn a_backup_that_runs_out_of_space_removes_its_files_and_leaves_the_host_alone() {
        if !nix::unistd::geteuid().is_root() {
            assert!(std::env::var_os("CI").is_none(), "needs root under CI");
            eprintln!("skipped: needs root to mount a size-limited tmpfs");
            return;
        }
        let repo = tempfile::tempdir().unwrap();
        let arts = tempfile::tempdir().unwrap();
        nix::mount::mount(
            Some("tmpfs"),
            arts.path(),
            Some("tmpfs"),
            nix::mount::MsFlags::empty(),
            Some("size=64k"),
        )
        .unwrap();
        struct Unmount<'a>(&'a Path);
        impl Drop for Unmount<'_> {
            fn drop(&mut self) {
                let _ = nix::mount::umount2(self.0, nix::mount::MntFlags::MNT_DETACH);
            }
        }
        let _u = Unmount(arts.path());
        let big = vec![7u8; 256 << 10];
        std::fs::write(repo.path().join("small.txt"), "host\n").unwrap();
        std::fs::write(repo.path().join("big.bin"), &big).unwrap();
        let dir = arts.path().join("art_full");
        let ops = [write_op("small.txt", b"vm\n"), write_op("big.bin", b"vm\n")];
        let err = execute(repo.path(), &dir, rec(repo.path()), &ops, &mut |_| Ok(())).unwrap_err();
        let WorkspaceError::Io { source, .. } = &err else {
            panic!("{err}")
        };
        assert!(crate::diskspace::is_no_space(source), "{err}");
        assert_eq!(std::fs::read(repo.path().join("big.bin")).unwrap(), big);
        assert_eq!(
            std::fs::read_to_string(repo.path().join("small.txt")).unwrap(),
            "host\n"
        );
        assert!(!dir.exists(), "the partial backup is left behind");
        assert!(crate::diskspace::free_bytes(arts.path()).unwrap() >= 32 << 10);
    }
}
