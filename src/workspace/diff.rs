//! What changed in the VM since the sync base.
//!
//! Three steps so the VM round trips stay in the service: [`suspects`] compares the VM's
//! tree manifest (from the guest's `Walk`) with the base by stat and names the files worth
//! fetching; [`classify`] compares their fetched content with the base (an mtime-only change
//! is no change) and finds renames; [`report`] renders the API view (unified diffs via
//! `similar`). Never touches the host repo.

use std::collections::{BTreeMap, HashMap};

use super::manifest::{Base, Entry, Kind, Manifest};
use super::rules::{Ignores, Rules};
use super::{WorkspaceError, sha256};
use crate::api::{ChangeKind, FileChange};
use crate::rpc::{FileKind, WalkEntry};

/// Paths of the VM worth a closer look.
#[derive(Debug, Default)]
pub struct Suspects {
    /// Files and symlinks that are new or whose stat differs from the base.
    pub changed: Vec<WalkEntry>,
    /// Files and symlinks of the base that the VM no longer has.
    pub deleted: Vec<String>,
    /// Devices, FIFOs and sockets (never brought back).
    pub special: Vec<String>,
    /// Changes never brought back, as `path: reason` (git metadata: see [`super::gitmeta`]).
    pub refused: Vec<String>,
}

/// Whether `rel` is selected by `paths` (empty = everything): equal to one or under one.
pub fn selected(paths: &[String], rel: &str) -> bool {
    paths.is_empty()
        || paths.iter().any(|p| {
            let p = p.trim_matches('/');
            p.is_empty() || rel == p || rel.starts_with(&format!("{p}/"))
        })
}

pub fn kind_of(k: FileKind) -> Option<Kind> {
    match k {
        FileKind::File => Some(Kind::File),
        FileKind::Dir => Some(Kind::Dir),
        FileKind::Symlink => Some(Kind::Symlink),
        FileKind::Other => None,
    }
}

/// Compare the VM's tree with the base by stat only.
pub fn suspects(
    base: &Manifest,
    walk: &[WalkEntry],
    rules: &Rules,
    ignores: &Ignores,
    paths: &[String],
) -> Suspects {
    let mut s = Suspects::default();
    let mut seen: HashMap<&str, ()> = HashMap::new();
    let mut dropped_dirs: Vec<&str> = Vec::new();
    for w in walk {
        let is_dir = w.kind == FileKind::Dir;
        if dropped_dirs
            .iter()
            .any(|d| w.path.starts_with(&format!("{d}/")))
        {
            continue;
        }
        if !rules.keeps(ignores, &w.path, is_dir) {
            if is_dir {
                dropped_dirs.push(&w.path);
            }
            continue;
        }
        seen.insert(&w.path, ());
        if is_dir || !selected(paths, &w.path) {
            continue;
        }
        let Some(kind) = kind_of(w.kind) else {
            s.special.push(w.path.clone());
            continue;
        };
        let same = base.entries.get(&w.path).is_some_and(|b| {
            b.kind == kind
                && b.mode == w.mode
                && match kind {
                    Kind::Symlink => b.link == w.link,
                    _ => {
                        b.guest_size == w.size
                            && b.guest_mtime == w.mtime
                            && b.guest_nsec == w.mtime_nsec
                    }
                }
        });
        if !same {
            s.changed.push(w.clone());
        }
    }
    for (rel, e) in &base.entries {
        if e.kind != Kind::Dir
            && !seen.contains_key(rel.as_str())
            && selected(paths, rel)
            && rules.keeps(ignores, rel, false)
        {
            s.deleted.push(rel.clone());
        }
    }
    super::gitmeta::refuse(&mut s, base, walk);
    s
}

/// The VM's side of a change.
#[derive(Debug, Clone)]
pub struct VmItem {
    pub kind: Kind,
    pub mode: u32,
    /// File content (empty for symlinks).
    pub content: Vec<u8>,
    pub link: Option<String>,
    pub walk: WalkEntry,
}

/// One change of the VM against the base, with everything apply needs.
#[derive(Debug, Clone)]
pub struct Change {
    pub path: String,
    pub kind: ChangeKind,
    pub old_path: Option<String>,
    pub base: Option<Entry>,
    /// `None` for a deletion.
    pub vm: Option<VmItem>,
}

/// Compare fetched content with the base; detect renames (a deleted path and an added one with
/// the same content). `contents` holds the VM content of every suspect file.
pub fn classify(
    base: &Manifest,
    s: Suspects,
    mut contents: HashMap<String, Vec<u8>>,
) -> Vec<Change> {
    let mut out: BTreeMap<String, Change> = BTreeMap::new();
    for w in s.changed {
        let Some(kind) = kind_of(w.kind) else {
            continue;
        };
        let content = contents.remove(&w.path).unwrap_or_default();
        let b = base.entries.get(&w.path).cloned();
        let ck = match &b {
            None => ChangeKind::Added,
            Some(b) if b.kind != kind => ChangeKind::Modified,
            Some(b) => {
                let same_content = match kind {
                    Kind::File => b.sha256 == sha256(&content),
                    _ => b.link == w.link,
                };
                match (same_content, b.mode == w.mode) {
                    (true, true) => continue,
                    (true, false) => ChangeKind::ModeChanged,
                    _ => ChangeKind::Modified,
                }
            }
        };
        out.insert(
            w.path.clone(),
            Change {
                path: w.path.clone(),
                kind: ck,
                old_path: None,
                base: b,
                vm: Some(VmItem {
                    kind,
                    mode: w.mode,
                    content,
                    link: w.link.clone(),
                    walk: w,
                }),
            },
        );
    }
    let mut deleted: Vec<String> = Vec::new();
    for d in s.deleted {
        let Some(b) = base.entries.get(&d) else {
            continue;
        };
        // A rename: an added file with exactly the deleted file's content.
        let renamed_to = out
            .values()
            .find(|c| {
                c.kind == ChangeKind::Added
                    && b.kind == Kind::File
                    && c.vm
                        .as_ref()
                        .is_some_and(|v| v.kind == Kind::File && sha256(&v.content) == b.sha256)
            })
            .map(|c| c.path.clone());
        match renamed_to {
            Some(to) => {
                if let Some(c) = out.get_mut(&to) {
                    c.kind = ChangeKind::Renamed;
                    c.old_path = Some(d.clone());
                    c.base = Some(b.clone());
                }
            }
            None => deleted.push(d),
        }
    }
    for d in deleted {
        out.insert(
            d.clone(),
            Change {
                base: base.entries.get(&d).cloned(),
                path: d,
                kind: ChangeKind::Deleted,
                old_path: None,
                vm: None,
            },
        );
    }
    out.into_values().collect()
}

/// Take the suspect files over `max` bytes out of `s`: they are not fetched, and listed as too
/// big instead of as changes (an unread file must never look empty to apply).
pub fn take_too_big(s: &mut Suspects, max: u64) -> Vec<crate::api::TooBigFile> {
    let mut out = Vec::new();
    s.changed.retain(|w| {
        let big = w.kind == FileKind::File && w.size > max;
        if big {
            out.push(crate::api::TooBigFile {
                path: w.path.clone(),
                size: w.size,
            });
        }
        !big
    });
    out
}

/// Binary: not UTF-8 or holds a NUL byte.
pub fn is_binary(data: &[u8]) -> bool {
    data.contains(&0) || std::str::from_utf8(data).is_err()
}

/// The API view: counts always, a unified diff for text unless `stat`.
pub fn report(
    base: &Base,
    changes: &[Change],
    stat: bool,
) -> Result<Vec<FileChange>, WorkspaceError> {
    let mut out = Vec::new();
    for c in changes {
        let old: Vec<u8> = match &c.base {
            Some(b) if b.kind == Kind::File => base.blob(&b.sha256)?,
            Some(b) => b.link.clone().unwrap_or_default().into_bytes(),
            None => Vec::new(),
        };
        let new: Vec<u8> = match &c.vm {
            Some(v) if v.kind == Kind::File => v.content.clone(),
            Some(v) => v.link.clone().unwrap_or_default().into_bytes(),
            None => Vec::new(),
        };
        let binary = is_binary(&old) || is_binary(&new);
        let mut fc = FileChange {
            path: c.path.clone(),
            kind: c.kind,
            old_path: c.old_path.clone(),
            binary,
            additions: 0,
            deletions: 0,
            old_mode: c.base.as_ref().map(|b| b.mode),
            new_mode: c.vm.as_ref().map(|v| v.mode),
            patch: None,
        };
        if !binary {
            let (o, n) = (String::from_utf8_lossy(&old), String::from_utf8_lossy(&new));
            let td = similar::TextDiff::from_lines(o.as_ref(), n.as_ref());
            for ch in td.iter_all_changes() {
                match ch.tag() {
                    similar::ChangeTag::Insert => fc.additions += 1,
                    similar::ChangeTag::Delete => fc.deletions += 1,
                    similar::ChangeTag::Equal => {}
                }
            }
            if !stat && (fc.additions + fc.deletions) > 0 {
                let from = c.old_path.as_deref().unwrap_or(&c.path);
                let a = if c.base.is_some() {
                    format!("a/{from}")
                } else {
                    "/dev/null".into()
                };
                let b = if c.vm.is_some() {
                    format!("b/{}", c.path)
                } else {
                    "/dev/null".into()
                };
                fc.patch = Some(
                    td.unified_diff()
                        .context_radius(3)
                        .header(&a, &b)
                        .to_string(),
                );
            }
        }
        out.push(fc);
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::SyncConfig;

    fn we(path: &str, kind: FileKind, size: u64, mtime: i64, nsec: u32) -> WalkEntry {
        WalkEntry {
            path: path.into(),
            kind,
            size,
            mode: 0o644,
            mtime,
            mtime_nsec: nsec,
            link: None,
        }
    }

    fn setup() -> (tempfile::TempDir, Base, Manifest) {
        let d = tempfile::tempdir().unwrap();
        let base = Base::new(d.path().join("ws"));
        let mut m = Manifest::default();
        for (p, c) in [
            ("a.txt", "one\ntwo\n"),
            ("b.txt", "keep\n"),
            ("c.bin", "x"),
            ("mv.txt", "moved content\n"),
        ] {
            let sha = base.put_blob(c.as_bytes()).unwrap();
            m.entries.insert(
                p.into(),
                Entry::file(0o644, c.len() as u64, 100_000_000_000, sha),
            );
        }
        (d, base, m)
    }

    #[test]
    fn stat_equal_files_are_not_fetched_and_changes_are_classified() {
        let (_d, base, m) = setup();
        let rules = Rules::new(&SyncConfig::default()).unwrap();
        let walk = vec![
            we("a.txt", FileKind::File, 12, 200, 5),       // modified
            we("b.txt", FileKind::File, 5, 100, 0),        // untouched: same stat
            we("new.txt", FileKind::File, 4, 200, 7),      // added
            we("renamed.txt", FileKind::File, 14, 200, 1), // mv.txt renamed
            we("fifo", FileKind::Other, 0, 200, 0),
            we(".git", FileKind::Dir, 0, 200, 0),
            we(".git/config", FileKind::File, 3, 200, 0),
        ];
        let mut m = m;
        // The walk skips `.git`: its base entries are not deletions.
        m.entries
            .insert(".git/HEAD".into(), Entry::file(0o644, 1, 0, "x".into()));
        let s = suspects(&m, &walk, &rules, &Ignores::default(), &[]);
        let names: Vec<&str> = s.changed.iter().map(|w| w.path.as_str()).collect();
        assert_eq!(names, ["a.txt", "new.txt", "renamed.txt"]);
        assert_eq!(s.deleted, ["c.bin", "mv.txt"]);
        assert_eq!(s.special, ["fifo"]);
        let contents = HashMap::from([
            ("a.txt".to_string(), b"one\nTWO\nthree\n".to_vec()),
            ("new.txt".to_string(), b"new\n".to_vec()),
            ("renamed.txt".to_string(), b"moved content\n".to_vec()),
        ]);
        let ch = classify(&m, s, contents);
        let kinds: Vec<(&str, ChangeKind)> = ch.iter().map(|c| (c.path.as_str(), c.kind)).collect();
        assert_eq!(
            kinds,
            [
                ("a.txt", ChangeKind::Modified),
                ("c.bin", ChangeKind::Deleted),
                ("new.txt", ChangeKind::Added),
                ("renamed.txt", ChangeKind::Renamed),
            ]
        );
        assert_eq!(ch[3].old_path.as_deref(), Some("mv.txt"));
        let r = report(&base, &ch, false).unwrap();
        assert_eq!((r[0].additions, r[0].deletions), (2, 1));
        let p = r[0].patch.as_deref().unwrap();
        assert!(
            p.contains("--- a/a.txt") && p.contains("+TWO") && p.contains("-two"),
            "{p}"
        );
        assert!(report(&base, &ch, true).unwrap()[0].patch.is_none());
    }

    #[test]
    fn touched_but_identical_file_is_no_change_and_mode_change_is_reported() {
        let (_d, _base, m) = setup();
        let rules = Rules::new(&SyncConfig::default()).unwrap();
        let mut exec = we("b.txt", FileKind::File, 5, 300, 1);
        exec.mode = 0o755;
        let walk = vec![we("a.txt", FileKind::File, 8, 300, 1), exec];
        let s = suspects(
            &m,
            &walk,
            &rules,
            &Ignores::default(),
            &["a.txt".into(), "b.txt".into()],
        );
        let contents = HashMap::from([
            ("a.txt".to_string(), b"one\ntwo\n".to_vec()),
            ("b.txt".to_string(), b"keep\n".to_vec()),
        ]);
        let ch = classify(&m, s, contents);
        assert_eq!(ch.len(), 1);
        assert_eq!(
            (ch[0].path.as_str(), ch[0].kind),
            ("b.txt", ChangeKind::ModeChanged)
        );
    }

    #[test]
    fn binary_content_is_flagged_without_a_patch() {
        assert!(is_binary(b"a\0b"));
        assert!(is_binary(&[0xff, 0xfe]));
        assert!(!is_binary("héllo\n".as_bytes()));
    }
}
