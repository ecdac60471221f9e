//! Bringing VM changes into the host repo: the safety checks, the decision per file (take the
//! VM's version, 3-way merge, or refuse), and the merge itself (`git merge-file` on temp files).
//!
//! Owns the rules of what may be written to the host. Produces a list of [`Op`]s; writing them
//! (with the backup first) is [`super::backup`]'s job. Never runs a git command other than
//! `git merge-file` on temporary files (no commit, checkout, reset, clean or index access) and
//! never plans anything under `.git/`.

use crate::oom::ResetOomScore as _;
use std::collections::{HashMap, HashSet};
use std::os::unix::fs::MetadataExt;
use std::path::Path;

use super::diff::{Change, VmItem, is_binary};
use super::links::{After, Planned};
use super::manifest::{Base, Entry, Kind};
use super::rules::{Rules, is_git_path};
use super::{WorkspaceError, sha256};
use crate::api::{ChangeKind, TooBigFile};

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

/// How to plan: apply or pull, the largest file brought back, the umask new host modes respect.
#[derive(Debug, Clone, Copy)]
pub struct PlanOpts {
    pub mode: Mode,
    pub max_bytes: u64,
    pub umask: u32,
}

#[derive(Debug, Default)]
pub struct Plan {
    pub ops: Vec<Op>,
    pub applied: Vec<String>,
    pub conflicts: Vec<String>,
    pub refused: Vec<String>,
    /// VM files over the size limit: not brought back, the host's copy untouched.
    pub too_big: Vec<TooBigFile>,
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
            s if s.len() > 255 => return Err("a path component over 255 bytes".into()),
            _ => {}
        }
    }
    if rel.len() > 4095 {
        return Err("a path over 4095 bytes".into());
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
        .reset_oom_score()
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

/// The umask of this process, read from `/proc/self/status` (calling `umask(2)` to read it
/// would change it for every thread meanwhile). 0o022 when it cannot be read.
pub fn process_umask() -> u32 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix("Umask:"))
                .and_then(|v| u32::from_str_radix(v.trim(), 8).ok())
        })
        .map_or(0o022, |m| m & 0o777)
}

/// The mode a host file gets when it takes the VM's version. Only the executable bit comes from
/// the VM: never setuid, setgid, sticky or the VM's read/write bits. A new file gets 0o755 or
/// 0o644 less `umask`; an existing one keeps its permission bits, with `x` added where it has
/// `r` (less `umask`) or taken away when the VM flipped the executable bit.
pub fn host_mode(vm_mode: u32, host: Option<u32>, umask: u32) -> u32 {
    let exec = vm_mode & 0o111 != 0;
    match host {
        None if exec => 0o777 & !umask,
        None => 0o666 & !umask,
        Some(h) => {
            let h = h & 0o777;
            match (h & 0o111 != 0, exec) {
                (false, true) => h | ((h & 0o444) >> 2 & !umask),
                (true, false) => h & !0o111,
                _ => h,
            }
        }
    }
}

fn vm_action(v: &VmItem, host: &HostState, umask: u32) -> Action {
    match v.kind {
        Kind::Symlink => Action::Symlink {
            target: v.link.clone().unwrap_or_default(),
        },
        _ => Action::Write {
            content: v.content.clone(),
            mode: host_mode(v.mode, host_file_mode(host), umask),
        },
    }
}

fn host_file_mode(host: &HostState) -> Option<u32> {
    match host {
        HostState::File { mode, .. } => Some(*mode),
        _ => None,
    }
}

/// Decide what to do with each change. `too_big` are the VM's files over the size limit (not
/// fetched): never written, and a deletion that may be their rename is kept back.
pub fn plan(
    root: &Path,
    base: &Base,
    changes: Vec<Change>,
    rules: &Rules,
    opts: PlanOpts,
    too_big: &[TooBigFile],
) -> Result<Plan, WorkspaceError> {
    let PlanOpts {
        mode,
        max_bytes,
        umask,
    } = opts;
    let mut plan = Plan::default();
    // New path -> old path of each rename taken (the old path's delete goes with it).
    let mut renames: HashMap<String, String> = HashMap::new();
    for c in changes {
        let refuse = |plan: &mut Plan, why: String| plan.refused.push(format!("{}: {why}", c.path));
        if let Err(why) = check_path(&c.path) {
            refuse(&mut plan, why);
            continue;
        }
        let is_dir =
            c.vm.as_ref()
                .map(|v| v.kind)
                .or(c.base.as_ref().map(|b| b.kind))
                == Some(Kind::Dir);
        if mode == Mode::Apply && rules.is_secret(&c.path, is_dir) {
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
            let size = v.walk.size.max(v.content.len() as u64);
            if v.kind == Kind::File && size > max_bytes {
                plan.too_big.push(TooBigFile {
                    path: c.path.clone(),
                    size,
                });
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
                if let Some(b) = c.base.as_ref().filter(|b| b.kind == Kind::File)
                    && let Some(t) = too_big.iter().find(|t| t.size == b.guest_size)
                {
                    refuse(
                        &mut plan,
                        format!(
                            "deleted in the sandbox, maybe renamed to `{}` (too big to compare); kept the host's",
                            t.path
                        ),
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
                        *content == v.content && *mode == host_mode(v.mode, Some(*mode), umask)
                    }
                    (HostState::Symlink(t), Kind::Symlink) => v.link.as_deref() == Some(t),
                    _ => false,
                };
                if same_as_vm {
                    plan.applied.push(c.path.clone());
                } else if !changed_on_host || force {
                    plan.ops.push(Op {
                        path: c.path.clone(),
                        action: vm_action(v, &host, umask),
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
                                        host_mode(v.mode, Some(*hm), umask)
                                    } else {
                                        *hm & 0o777
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
                        renames.insert(c.path.clone(), old.clone());
                    } else {
                        plan.refused.push(format!(
                            "{old}: renamed in the sandbox but changed on the host; kept"
                        ));
                    }
                }
            }
        }
    }
    refuse_escapes(root, &mut plan, &renames);
    Ok(plan)
}

/// What `ops` leave at each path they touch.
fn planned(ops: &[Op]) -> Vec<(String, Planned)> {
    ops.iter()
        .map(|op| {
            let p = match &op.action {
                Action::Write { .. } => Planned::File,
                Action::Symlink { target } => Planned::Symlink(target.clone()),
                Action::Delete => Planned::Absent,
            };
            (op.path.clone(), p)
        })
        .collect()
}

/// Take out of `plan` every symlink that would resolve outside the repo once the apply is done
/// (through the host's links and the ones the plan creates) and every write below a link or
/// file the plan creates; they become refused. Repeated until none is left, since taking one
/// out changes what the others resolve through.
fn refuse_escapes(root: &Path, plan: &mut Plan, renames: &HashMap<String, String>) {
    loop {
        let after = After::new(root, planned(&plan.ops));
        let bad: Vec<(String, String)> = plan
            .ops
            .iter()
            .filter_map(|op| {
                let r = match &op.action {
                    Action::Symlink { target } => after
                        .check_parents(&op.path)
                        .and_then(|()| after.check_link(&op.path, target)),
                    Action::Write { .. } => after.check_parents(&op.path),
                    Action::Delete => Ok(()),
                };
                r.err().map(|why| (op.path.clone(), why.to_string()))
            })
            .collect();
        if bad.is_empty() {
            return;
        }
        // One pass per round: a VM full of bad links costs O(n) per round, not O(n^2).
        let refused: HashSet<String> = bad.iter().map(|(p, _)| p.clone()).collect();
        let mut gone = refused.clone();
        gone.extend(refused.iter().filter_map(|p| renames.get(p).cloned()));
        plan.ops.retain(|o| !gone.contains(&o.path));
        plan.applied.retain(|p| !refused.contains(p));
        plan.conflicts.retain(|p| !refused.contains(p));
        plan.base_updates.retain(|(p, _)| !gone.contains(p));
        plan.refused
            .extend(bad.into_iter().map(|(path, why)| format!("{path}: {why}")));
    }
}

/// Changes an apply would refuse because a symlink leaves the repo (or a path lies below a
/// link or file the apply creates), `path: reason`, for the diff to show: as if every change
/// were taken.
pub fn link_refusals(root: &Path, changes: &[Change]) -> Vec<String> {
    let mut plan = Plan::default();
    for c in changes {
        if check_path(&c.path).is_err() {
            continue;
        }
        let action = match &c.vm {
            None => Action::Delete,
            Some(v) if v.kind == Kind::Symlink => Action::Symlink {
                target: v.link.clone().unwrap_or_default(),
            },
            Some(v) if v.kind == Kind::File => Action::Write {
                content: Vec::new(),
                mode: 0,
            },
            Some(_) => continue,
        };
        plan.ops.push(Op {
            path: c.path.clone(),
            action,
        });
    }
    refuse_escapes(root, &mut plan, &HashMap::new());
    plan.refused
}

#[cfg(test)]
#[path = "apply_tests.rs"]
mod tests;
