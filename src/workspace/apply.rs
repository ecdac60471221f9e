//! Bringing VM changes into the host repo: the safety checks, the decision per file (take the
//! VM's version, 3-way merge, or refuse), and the merge itself (`git merge-file` on temp files).
//!
//! Owns the rules of what may be written to the host. Produces a list of [`Op`]s; writing them
//! (with the backup first) is [`super::backup`]'s job. Never runs a git command other than
//! `git merge-file` on temporary files (no commit, checkout, reset, clean or index access) and
//! never plans anything under `.git/`.

use std::os::unix::fs::MetadataExt;
use std::path::{Component, Path};

use super::diff::{Change, VmItem, is_binary};
use super::manifest::{Base, Entry, Kind};
use super::rules::{Rules, is_git_path};
use super::{WorkspaceError, sha256};
use crate::api::ChangeKind;

/// What to do to one host path.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Action {
    Write { content: Vec<u8>, mode: u32 },
    Symlink { target: String },
    Delete,
}

#[derive(Debug, Clone)]
pub struct Op {
    pub path: String,
    pub action: Action,
}

/// Apply (merge when both sides changed) or pull (take the VM's version; refuse when the host
/// changed too unless `force`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    Apply,
    Pull { force: bool },
}

#[derive(Debug, Default)]
pub struct Plan {
    pub ops: Vec<Op>,
    pub applied: Vec<String>,
    pub conflicts: Vec<String>,
    pub refused: Vec<String>,
    /// Paths whose base becomes the VM's version (`Some`) or is dropped (`None`) once written.
    pub base_updates: Vec<(String, Option<VmItem>)>,
}

/// A path the host may be asked to write: relative, plain components, not under `.git/`.
pub fn check_path(rel: &str) -> Result<(), String> {
    if rel.is_empty() {
        return Err("empty path".into());
    }
    if rel.starts_with('/') {
        return Err("absolute paths are refused".into());
    }
    for seg in rel.split('/') {
        match seg {
            ".." => return Err("`..` in the path is refused".into()),
            "" | "." => return Err("not a plain relative path (empty or `.` component)".into()),
            s if s.contains('\0') => return Err("NUL byte in the path".into()),
            _ => {}
        }
    }
    if is_git_path(rel) {
        return Err(
            "anything under .git/ is never written by apply or pull (nor a `.git` at \
                    any depth, in any spelling)"
                .into(),
        );
    }
    Ok(())
}

/// A symlink from the VM may only point inside the repo, by a relative target.
pub fn check_symlink(rel: &str, target: &str) -> Result<(), String> {
    if target.starts_with('/') {
        return Err(format!(
            "symlink to `{target}` points outside the repo (absolute target)"
        ));
    }
    let mut depth: i64 = rel.matches('/').count() as i64; // directories above the link
    for c in Path::new(target).components() {
        match c {
            Component::ParentDir => depth -= 1,
            Component::Normal(_) => depth += 1,
            Component::CurDir => {}
            _ => {
                return Err(format!(
                    "symlink to `{target}` is not a plain relative path"
                ));
            }
        }
        if depth < 0 {
            return Err(format!("symlink to `{target}` escapes the repo"));
        }
    }
    Ok(())
}

/// Every existing parent of `rel` on the host must be a real directory (not a symlink, which
/// could lead outside the repo).
pub fn check_host_parents(root: &Path, rel: &str) -> Result<(), String> {
    let mut p = root.to_path_buf();
    let comps: Vec<&str> = rel.split('/').collect();
    for c in &comps[..comps.len().saturating_sub(1)] {
        p.push(c);
        match std::fs::symlink_metadata(&p) {
            Ok(md) if md.file_type().is_symlink() => {
                return Err(format!("parent `{}` is a symlink on the host", p.display()));
            }
            Ok(md) if !md.is_dir() => {
                return Err(format!(
                    "parent `{}` is not a directory on the host",
                    p.display()
                ));
            }
            Ok(_) => {}
            Err(_) => return Ok(()), // missing parents are created
        }
    }
    Ok(())
}

/// The host's current version of a path.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum HostState {
    Absent,
    File {
        content: Vec<u8>,
        mode: u32,
    },
    Symlink(String),
    /// A directory or a special file: never overwritten.
    Other,
}

pub fn host_state(root: &Path, rel: &str) -> Result<HostState, WorkspaceError> {
    let p = root.join(rel);
    let md = match std::fs::symlink_metadata(&p) {
        Ok(m) => m,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(HostState::Absent),
        Err(e) => return Err(WorkspaceError::io("stat", p)(e)),
    };
    let ft = md.file_type();
    if ft.is_symlink() {
        let t = std::fs::read_link(&p).map_err(WorkspaceError::io("read the symlink", &p))?;
        return Ok(HostState::Symlink(t.to_string_lossy().into_owned()));
    }
    if ft.is_file() {
        let content = std::fs::read(&p).map_err(WorkspaceError::io("read", &p))?;
        return Ok(HostState::File {
            content,
            mode: md.mode() & 0o7777,
        });
    }
    Ok(HostState::Other)
}

/// Did the host change `rel` since the base? (Content and symlink target count; mtime not.)
fn host_changed(base: Option<&Entry>, host: &HostState) -> bool {
    match (base, host) {
        (None, HostState::Absent) => false,
        (Some(b), HostState::File { content, .. }) if b.kind == Kind::File => {
            sha256(content) != b.sha256
        }
        (Some(b), HostState::Symlink(t)) if b.kind == Kind::Symlink => b.link.as_deref() != Some(t),
        _ => true,
    }
}

/// 3-way merge with `git merge-file` on temporary files. Returns the merged bytes and whether
/// conflict markers were left.
pub fn merge3(host: &[u8], base: &[u8], vm: &[u8]) -> Result<(Vec<u8>, bool), String> {
    let dir = tempfile::tempdir().map_err(|e| format!("cannot create a temp dir: {e}"))?;
    let (h, b, v) = (
        dir.path().join("host"),
        dir.path().join("base"),
        dir.path().join("vm"),
    );
    for (p, d) in [(&h, host), (&b, base), (&v, vm)] {
        std::fs::write(p, d).map_err(|e| format!("cannot write a merge temp file: {e}"))?;
    }
    let out = std::process::Command::new("git")
        .args([
            "merge-file",
            "-p",
            "-L",
            "host",
            "-L",
            "base",
            "-L",
            "sandbox",
        ])
        .arg(&h)
        .arg(&b)
        .arg(&v)
        .output()
        .map_err(|e| format!("cannot run `git merge-file` (is git installed?): {e}"))?;
    match out.status.code() {
        Some(0) => Ok((out.stdout, false)),
        Some(n) if (1..=127).contains(&n) => Ok((out.stdout, true)),
        _ => Err(format!(
            "`git merge-file` failed: {}",
            String::from_utf8_lossy(&out.stderr).trim()
        )),
    }
}

fn vm_action(v: &VmItem) -> Action {
    match v.kind {
        Kind::Symlink => Action::Symlink {
            target: v.link.clone().unwrap_or_default(),
        },
        _ => Action::Write {
            content: v.content.clone(),
            mode: v.mode,
        },
    }
}

/// Decide what to do with each change.
pub fn plan(
    root: &Path,
    base: &Base,
    changes: Vec<Change>,
    rules: &Rules,
    mode: Mode,
    max_bytes: u64,
) -> Result<Plan, WorkspaceError> {
    let mut plan = Plan::default();
    for c in changes {
        let refuse = |plan: &mut Plan, why: String| plan.refused.push(format!("{}: {why}", c.path));
        if let Err(why) = check_path(&c.path) {
            refuse(&mut plan, why);
            continue;
        }
        if mode == Mode::Apply && rules.is_secret(&c.path) {
            refuse(
                &mut plan,
                "a secret file; bring it over explicitly with `pull`".into(),
            );
            continue;
        }
        if let Err(why) = check_host_parents(root, &c.path) {
            refuse(&mut plan, why);
            continue;
        }
        if let Some(v) = &c.vm {
            if v.kind == Kind::Dir {
                continue;
            }
            if v.kind == Kind::Symlink
                && let Err(why) = check_symlink(&c.path, v.link.as_deref().unwrap_or(""))
            {
                refuse(&mut plan, why);
                continue;
            }
            if v.content.len() as u64 > max_bytes {
                refuse(
                    &mut plan,
                    format!(
                        "{} bytes is over the limit of {max_bytes} (sync.max_file_mib)",
                        v.content.len()
                    ),
                );
                continue;
            }
        }
        let host = host_state(root, &c.path)?;
        if host == HostState::Other {
            refuse(
                &mut plan,
                "the host has a directory or special file there".into(),
            );
            continue;
        }
        let changed_on_host = host_changed(c.base.as_ref(), &host);
        let force = matches!(mode, Mode::Pull { force: true });
        match &c.vm {
            None => {
                // Deleted in the VM.
                if changed_on_host && !force {
                    refuse(
                        &mut plan,
                        "deleted in the sandbox but changed on the host; kept the host's".into(),
                    );
                    continue;
                }
                if host != HostState::Absent {
                    plan.ops.push(Op {
                        path: c.path.clone(),
                        action: Action::Delete,
                    });
                }
                plan.applied.push(c.path.clone());
                plan.base_updates.push((c.path.clone(), None));
            }
            Some(v) => {
                let same_as_vm = match (&host, v.kind) {
                    (HostState::File { content, mode }, Kind::File) => {
                        *content == v.content && *mode == v.mode
                    }
                    (HostState::Symlink(t), Kind::Symlink) => v.link.as_deref() == Some(t),
                    _ => false,
                };
                if same_as_vm {
                    plan.applied.push(c.path.clone());
                } else if !changed_on_host || force {
                    plan.ops.push(Op {
                        path: c.path.clone(),
                        action: vm_action(v),
                    });
                    plan.applied.push(c.path.clone());
                } else if let (
                    Mode::Apply,
                    HostState::File {
                        content: hc,
                        mode: hm,
                    },
                    Kind::File,
                ) = (mode, &host, v.kind)
                {
                    let base_content = match &c.base {
                        Some(b) if b.kind == Kind::File => base.blob(&b.sha256)?,
                        _ => Vec::new(),
                    };
                    if is_binary(hc) || is_binary(&v.content) || is_binary(&base_content) {
                        refuse(&mut plan, "binary file changed on both the host and in the sandbox; kept the host's (use `pull --force` to take the sandbox's)".into());
                        continue;
                    }
                    match merge3(hc, &base_content, &v.content) {
                        Ok((merged, conflict)) => {
                            plan.ops.push(Op {
                                path: c.path.clone(),
                                action: Action::Write {
                                    content: merged,
                                    mode: if c.base.as_ref().is_some_and(|b| b.mode != v.mode) {
                                        v.mode
                                    } else {
                                        *hm
                                    },
                                },
                            });
                            if conflict {
                                plan.conflicts.push(c.path.clone());
                            } else {
                                plan.applied.push(c.path.clone());
                            }
                        }
                        Err(why) => {
                            refuse(&mut plan, why);
                            continue;
                        }
                    }
                } else {
                    let why = match mode {
                        Mode::Pull { .. } => {
                            "changed on the host since the last sync; use --force to overwrite"
                        }
                        Mode::Apply => {
                            "changed on both the host and in the sandbox and cannot be merged; kept the host's (use `pull --force` to take the sandbox's)"
                        }
                    };
                    refuse(&mut plan, why.into());
                    continue;
                }
                plan.base_updates.push((c.path.clone(), Some(v.clone())));
                // A rename also removes the old path (when the host did not change it).
                if c.kind == ChangeKind::Renamed
                    && let Some(old) = &c.old_path
                    && check_path(old).is_ok()
                    && check_host_parents(root, old).is_ok()
                {
                    let old_host = host_state(root, old)?;
                    if !host_changed(c.base.as_ref(), &old_host) || force {
                        if old_host != HostState::Absent {
                            plan.ops.push(Op {
                                path: old.clone(),
                                action: Action::Delete,
                            });
                        }
                        plan.base_updates.push((old.clone(), None));
                    } else {
                        plan.refused.push(format!(
                            "{old}: renamed in the sandbox but changed on the host; kept"
                        ));
                    }
                }
            }
        }
    }
    Ok(plan)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_unsafe_path_form_is_refused() {
        for p in [
            "",
            "/etc/passwd",
            "../x",
            "a/../../x",
            "a/./b",
            ".git/config",
            ".git/hooks/pre-commit",
            ".git",
        ] {
            assert!(check_path(p).is_err(), "{p:?} should be refused");
        }
        for p in [
            "a",
            "src/main.rs",
            ".github/workflows/ci.yml",
            ".gitignore",
            "a/.git-keep",
        ] {
            assert!(check_path(p).is_ok(), "{p:?} should be fine");
        }
    }

    #[test]
    fn symlinks_leaving_the_repo_are_refused() {
        assert!(check_symlink("link", "/etc/passwd").is_err());
        assert!(check_symlink("link", "../outside").is_err());
        assert!(check_symlink("a/b/link", "../../../x").is_err());
        assert!(check_symlink("a/link", "../../x").is_err());
        assert!(check_symlink("a/b/link", "../../x").is_ok());
        assert!(check_symlink("link", "src/main.rs").is_ok());
        assert!(check_symlink("a/link", "./b/../c").is_ok());
    }

    #[test]
    fn a_symlinked_parent_on_the_host_is_refused() {
        let d = tempfile::tempdir().unwrap();
        let out = tempfile::tempdir().unwrap();
        std::os::unix::fs::symlink(out.path(), d.path().join("evil")).unwrap();
        std::fs::create_dir(d.path().join("ok")).unwrap();
        assert!(check_host_parents(d.path(), "evil/x").is_err());
        assert!(check_host_parents(d.path(), "ok/x").is_ok());
        assert!(check_host_parents(d.path(), "new/dir/x").is_ok());
    }

    #[test]
    fn clean_merge_combines_both_sides() {
        let base = b"a\nb\nc\nd\ne\nf\ng\n";
        let host = b"A\nb\nc\nd\ne\nf\ng\n";
        let vm = b"a\nb\nc\nd\ne\nf\nG\n";
        let (m, conflict) = merge3(host, base, vm).unwrap();
        assert!(!conflict);
        assert_eq!(m, b"A\nb\nc\nd\ne\nf\nG\n");
    }

    #[test]
    fn conflicting_merge_leaves_markers_naming_both_sides() {
        let (m, conflict) = merge3(b"x = 1\n", b"x = 0\n", b"x = 2\n").unwrap();
        assert!(conflict);
        let s = String::from_utf8(m).unwrap();
        assert!(
            s.contains("<<<<<<< host") && s.contains(">>>>>>> sandbox"),
            "{s}"
        );
        assert!(s.contains("x = 1") && s.contains("x = 2"), "{s}");
    }
}
