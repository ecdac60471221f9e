//! What changed in the VM since the sync base.
//!
//! Three steps so the VM round trips stay in the service: [`suspects`] compares the VM's
//! tree manifest (from the guest's `Walk`) with the base by stat and names the files worth
//! fetching (the service fetches them into a [`super::spill::Spill`], hashing as they arrive);
//! [`classify`] compares their hashes with the base (an mtime-only change is no change) and
//! finds renames by hash (one map lookup per deleted file); [`report`] renders the API view
//! (unified diffs via `similar`, one file in memory at a time, text over [`TEXT_DIFF_MAX`]
//! shown as binary). Never touches the host repo.

use std::borrow::Cow;
use std::collections::{BTreeMap, HashMap, HashSet, VecDeque};

use super::manifest::{Base, Entry, Kind, Manifest};
use super::rules::{Ignores, Rules};
use super::spill::Spilled;
use super::{WorkspaceError, sha256};

/// Files larger than this (either side) get no line diff: they are reported as binary, without
/// being read (a line diff of a huge text file takes time and memory out of proportion).
pub const TEXT_DIFF_MAX: u64 = 8 << 20;
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

/// Give each `base` entry of `walk` (a file the agent did not state: still the base disk's, as
/// the first sync wrote it) the VM stat `base` recorded for it. `Err(path)` for one it has no
/// record of, or a record of another kind: then the walk cannot be trusted without stats.
pub fn fill_base(walk: &mut [WalkEntry], base: &Manifest) -> Result<(), String> {
    for w in walk.iter_mut().filter(|w| w.base) {
        let e = base
            .entries
            .get(&w.path)
            .filter(|e| kind_of(w.kind) == Some(e.kind) && e.kind != Kind::Dir)
            .ok_or_else(|| w.path.clone())?;
        w.size = e.guest_size;
        w.mode = e.mode;
        w.mtime = e.guest_mtime;
        w.mtime_nsec = e.guest_nsec;
        w.link = e.link.clone();
        w.base = false;
    }
    Ok(())
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
    // Directories left out: everything under them is too (one lookup per ancestor).
    let mut dropped_dirs: HashSet<&str> = HashSet::new();
    for w in walk {
        let is_dir = w.kind == FileKind::Dir;
        // Most trees have no dropped directory: no lookup per path then.
        if !dropped_dirs.is_empty()
            && w.path
                .match_indices('/')
                .any(|(i, _)| dropped_dirs.contains(&w.path[..i]))
        {
            continue;
        }
        if !rules.keeps(ignores, &w.path, is_dir) {
            if is_dir {
                dropped_dirs.insert(&w.path);
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
    /// File content, once [`load_contents`] read it from `spill` (empty for symlinks, and for
    /// files until loaded: a diff never loads them all).
    pub content: Vec<u8>,
    /// Where the fetched file content is (files only).
    pub spill: Option<Spilled>,
    /// SHA-256 of the file content (empty for symlinks).
    pub sha256: String,
    pub link: Option<String>,
    pub walk: WalkEntry,
}

impl VmItem {
    /// Length of the file content (0 for symlinks).
    pub fn len(&self) -> u64 {
        self.spill
            .as_ref()
            .map_or(self.content.len() as u64, |s| s.len)
    }

    /// The file content: loaded, or read from the spill file.
    pub fn bytes(&self) -> Result<Cow<'_, [u8]>, WorkspaceError> {
        match &self.spill {
            Some(s) if self.content.len() as u64 != s.len => Ok(Cow::Owned(s.read()?)),
            _ => Ok(Cow::Borrowed(&self.content)),
        }
    }
}

/// Read the VM content of every change into memory (apply and pull work on it there); the
/// sum is bounded by the spill's budget (`sync.max_diff_mib`).
pub fn load_contents(changes: &mut [Change]) -> Result<(), WorkspaceError> {
    for v in changes.iter_mut().filter_map(|c| c.vm.as_mut()) {
        if let Some(s) = &v.spill {
            v.content = s.read()?;
        }
    }
    Ok(())
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

/// Compare fetched content with the base by hash; detect renames (a deleted path and an added
/// one with the same content; each deleted file takes the first such added path, by path
/// order). `contents` holds the fetched VM content of every suspect file. O(n log n): one
/// hash map of the added files' hashes, no content is read.
pub fn classify(
    base: &Manifest,
    s: Suspects,
    mut contents: HashMap<String, Spilled>,
) -> Vec<Change> {
    let empty = sha256(b"");
    let mut out: BTreeMap<String, Change> = BTreeMap::new();
    for w in s.changed {
        let Some(kind) = kind_of(w.kind) else {
            continue;
        };
        let spill = contents.remove(&w.path);
        let sha = match (kind, &spill) {
            (Kind::File, Some(sp)) => sp.sha256.clone(),
            (Kind::File, None) => empty.clone(),
            _ => String::new(),
        };
        let b = base.entries.get(&w.path).cloned();
        let ck = match &b {
            None => ChangeKind::Added,
            Some(b) if b.kind != kind => ChangeKind::Modified,
            Some(b) => {
                let same_content = match kind {
                    Kind::File => b.sha256 == sha,
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
                    content: Vec::new(),
                    spill,
                    sha256: sha,
                    link: w.link.clone(),
                    walk: w,
                }),
            },
        );
    }
    // Added files by content hash, in path order.
    let mut added: HashMap<&str, VecDeque<&str>> = HashMap::new();
    for c in out.values() {
        if let Some(v) = c.vm.as_ref().filter(|v| v.kind == Kind::File)
            && c.kind == ChangeKind::Added
        {
            added.entry(&v.sha256).or_default().push_back(&c.path);
        }
    }
    let mut renames: Vec<(String, String)> = Vec::new();
    let mut deleted: Vec<String> = Vec::new();
    for d in s.deleted {
        let Some(b) = base.entries.get(&d) else {
            continue;
        };
        let to = (b.kind == Kind::File)
            .then(|| added.get_mut(b.sha256.as_str()).and_then(|q| q.pop_front()))
            .flatten();
        match to {
            Some(to) => renames.push((to.to_owned(), d)),
            None => deleted.push(d),
        }
    }
    drop(added);
    for (to, from) in renames {
        let b = base.entries.get(&from).cloned();
        if let Some(c) = out.get_mut(&to) {
            c.kind = ChangeKind::Renamed;
            c.old_path = Some(from);
            c.base = b;
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
        // Over TEXT_DIFF_MAX on either side: binary, nothing read.
        let big = c
            .base
            .as_ref()
            .is_some_and(|b| b.kind == Kind::File && b.size.max(b.guest_size) > TEXT_DIFF_MAX)
            || c.vm
                .as_ref()
                .is_some_and(|v| v.kind == Kind::File && v.len() > TEXT_DIFF_MAX);
        // Same content as the base (a rename, a mode change): no line changes, and the base's
        // copy need not be read.
        let same = matches!((&c.base, &c.vm), (Some(b), Some(v))
            if b.kind == Kind::File && v.kind == Kind::File && b.sha256 == v.sha256);
        let none = || Cow::Borrowed(&b""[..]);
        let (old, new, binary): (Cow<[u8]>, Cow<[u8]>, bool) = if big {
            (none(), none(), true)
        } else if same {
            // Nothing to count: only whether the content is binary.
            let new = c.vm.as_ref().map(|v| v.bytes()).transpose()?;
            (none(), none(), new.is_some_and(|n| is_binary(&n)))
        } else {
            let old = match &c.base {
                Some(b) if b.kind == Kind::File => Cow::Owned(base.blob(&b.sha256)?),
                Some(b) => Cow::Owned(b.link.clone().unwrap_or_default().into_bytes()),
                None => none(),
            };
            let new = match &c.vm {
                Some(v) if v.kind == Kind::File => v.bytes()?,
                Some(v) => Cow::Owned(v.link.clone().unwrap_or_default().into_bytes()),
                None => none(),
            };
            let binary = is_binary(&old) || is_binary(&new);
            (old, new, binary)
        };
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
    use crate::workspace::spill::Spill;

    use crate::workspace::spill::spilled_for_tests as spilled;

    fn we(path: &str, kind: FileKind, size: u64, mtime: i64, nsec: u32) -> WalkEntry {
        WalkEntry {
            path: path.into(),
            kind,
            size,
            mode: 0o644,
            mtime,
            mtime_nsec: nsec,
            link: None,
            base: false,
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
    fn unstated_base_files_take_their_recorded_stat_and_unknown_ones_are_refused() {
        let (_d, _base, m) = setup();
        let unstated = |p: &str, kind| WalkEntry {
            mode: 0,
            base: true,
            ..we(p, kind, 0, 0, 0)
        };
        let mut walk = vec![
            unstated("b.txt", FileKind::File),
            we("a.txt", FileKind::File, 12, 200, 5),
        ];
        fill_base(&mut walk, &m).unwrap();
        let b = &walk[0];
        assert!(!b.base);
        assert_eq!((b.size, b.mode, b.mtime, b.mtime_nsec), (5, 0o644, 100, 0));
        // Filled in, an untouched base file is no change.
        let rules = Rules::new(&SyncConfig::default()).unwrap();
        let s = suspects(&m, &walk, &rules, &Ignores::default(), &[]);
        let names: Vec<&str> = s.changed.iter().map(|w| w.path.as_str()).collect();
        assert_eq!(names, ["a.txt"]);
        // No record, or a record of another kind: the walk must be done with stats.
        let mut walk = vec![unstated("nope.txt", FileKind::File)];
        assert_eq!(fill_base(&mut walk, &m), Err("nope.txt".into()));
        let mut walk = vec![unstated("b.txt", FileKind::Symlink)];
        assert_eq!(fill_base(&mut walk, &m), Err("b.txt".into()));
    }

    #[test]
    fn stat_equal_files_are_not_fetched_and_changes_are_classified() {
        let (d, base, m) = setup();
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
        let (_spill, contents) = spilled(
            d.path(),
            &[
                ("a.txt", b"one\nTWO\nthree\n"),
                ("new.txt", b"new\n"),
                ("renamed.txt", b"moved content\n"),
            ],
        );
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
        let (d, _base, m) = setup();
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
        let (_spill, contents) =
            spilled(d.path(), &[("a.txt", b"one\ntwo\n"), ("b.txt", b"keep\n")]);
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

    /// 5,000 files moved plus 5,000 deleted and 5,000 added with other content: every move is
    /// found as a rename, each deleted file pairs with at most one added file, and files with
    /// the same content pair in path order. (The old pairwise search hashed every added file
    /// once per deleted file: 25 million hashes here, minutes in a debug build.)
    #[test]
    fn renames_among_thousands_of_adds_and_deletes_pair_by_hash() {
        let d = tempfile::tempdir().unwrap();
        let spill = Spill::new(d.path(), u64::MAX).unwrap();
        let (n, mut m) = (5_000, Manifest::default());
        let (mut walk, mut contents) = (Vec::new(), HashMap::new());
        let mut put = |rel: String, content: String, walk: &mut Vec<WalkEntry>| {
            let mut w = spill.writer(&rel, u64::MAX);
            w.write(content.as_bytes()).unwrap();
            walk.push(we(&rel, FileKind::File, content.len() as u64, 300, 0));
            contents.insert(rel, w.finish().unwrap());
        };
        for i in 0..n {
            for (dir, what) in [("old", "moved"), ("gone", "deleted")] {
                let c = format!("{what} {i}\n");
                m.entries.insert(
                    format!("{dir}/{i:05}"),
                    Entry::file(0o644, c.len() as u64, 0, sha256(c.as_bytes())),
                );
            }
            put(format!("new/{i:05}"), format!("moved {i}\n"), &mut walk);
            put(format!("fresh/{i:05}"), format!("added {i}\n"), &mut walk);
        }
        // Two deleted files with one content, three added copies of it.
        let twin = sha256(b"twin\n");
        for p in ["t/a", "t/b"] {
            m.entries
                .insert(p.into(), Entry::file(0o644, 5, 0, twin.clone()));
        }
        for p in ["u/c", "u/a", "u/b"] {
            put(p.into(), "twin\n".into(), &mut walk);
        }
        walk.sort_by(|a, b| a.path.cmp(&b.path));
        let rules = Rules::new(&SyncConfig::default()).unwrap();
        let s = suspects(&m, &walk, &rules, &Ignores::default(), &[]);
        assert_eq!((s.changed.len(), s.deleted.len()), (2 * n + 3, 2 * n + 2));
        let ch = classify(&m, s, contents);
        let count = |k| ch.iter().filter(|c| c.kind == k).count();
        assert_eq!(count(ChangeKind::Renamed), n + 2);
        assert_eq!(count(ChangeKind::Deleted), n);
        assert_eq!(count(ChangeKind::Added), n + 1);
        for c in ch.iter().filter(|c| c.kind == ChangeKind::Renamed) {
            let from = c.old_path.as_deref().unwrap();
            if let Some(i) = c.path.strip_prefix("new/") {
                assert_eq!(from, format!("old/{i}"));
            }
        }
        let pairs: Vec<(&str, &str)> = ch
            .iter()
            .filter(|c| c.path.starts_with("u/"))
            .map(|c| (c.path.as_str(), c.old_path.as_deref().unwrap_or("-")))
            .collect();
        assert_eq!(pairs, [("u/a", "t/a"), ("u/b", "t/b"), ("u/c", "-")]);
    }

    #[test]
    fn text_over_the_line_diff_limit_is_reported_as_binary_without_reading_it() {
        let (d, base, m) = setup();
        let big = TEXT_DIFF_MAX as usize + 1;
        let (_spill, mut contents) =
            spilled(d.path(), &[("a.txt", "x\n".repeat(big / 2 + 1).as_bytes())]);
        let sp = contents.get_mut("a.txt").unwrap();
        let s = Suspects {
            changed: vec![we("a.txt", FileKind::File, sp.len, 400, 0)],
            ..Default::default()
        };
        let ch = classify(&m, s, contents);
        // Its spill file is gone: a report that read it would fail.
        let file = ch[0].vm.as_ref().unwrap().spill.as_ref().unwrap().file();
        std::fs::remove_file(file.expect("over 256 KiB: on disk")).unwrap();
        let r = report(&base, &ch, false).unwrap();
        assert!(r[0].binary && r[0].patch.is_none(), "{:?}", r[0]);
    }
}
