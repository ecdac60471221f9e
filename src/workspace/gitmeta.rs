//! Git metadata in the VM's tree: what apply must never bring back, because git on the host
//! would read it as a repository (its `config` can name `core.fsmonitor`, hooks, a pager: a
//! later `git status` on the host runs them).
//!
//! Owns the two tests git itself uses to find a repository in a work tree, made strict:
//! - a path component that is `.git` in any spelling a host file system may fold to `.git`
//!   (any case, trailing dots or spaces, an NTFS stream suffix `.git::$INDEX_ALLOCATION`, the
//!   8.3 short name `git~1`, HFS+ ignorable code points such as `.g\u{200c}it`), at any depth;
//!   a `.git` *file* (`gitdir: ../../evil`) counts like a directory;
//! - a bare-repository layout: a directory holding `HEAD` and either `objects` + `refs` or a
//!   `commondir` file (git's `is_git_directory`; `config` is not needed for git to use it).
//!
//! [`refuse`] moves such changes of a diff out of the changes into the refused list (one entry
//! per repository directory), so diff shows them and apply never plans them. The top-level
//! `.git/` is the repo's own metadata: it is left out of diffs silently (see
//! [`super::rules::Rules::keeps`]), never shown, never written. Pure: never touches a file.

use std::collections::{BTreeMap, BTreeSet};

use super::diff::Suspects;
use super::manifest::Manifest;
use crate::rpc::WalkEntry;

/// Why a path under a `.git` component is refused.
pub const DOTGIT_REASON: &str = "git metadata (a `.git` file or directory) below the repo root is never brought back: git on the host would read its config";
/// Why a path under a bare-repository layout is refused.
pub const BARE_REASON: &str = "looks like a bare git repository (HEAD with objects/ and refs/, or commondir): never brought back, git on the host would read its config";

/// Code points HFS+ ignores when comparing names (git's `is_hfs_dotgit` list).
fn hfs_ignorable(c: char) -> bool {
    matches!(c,
        '\u{200c}'..='\u{200f}' | '\u{202a}'..='\u{202e}' | '\u{206a}'..='\u{206f}' | '\u{feff}')
}

/// Whether one path component names a `.git` on some host file system.
pub fn is_dotgit_name(name: &str) -> bool {
    // Every such name folds to `.git` or `git~1`, so it holds an ASCII `g` or `G` (no other
    // code point lowercases to `g`): most names are ruled out here without allocating (a diff
    // asks this of every component of every path in the tree).
    if !name.bytes().any(|b| b.eq_ignore_ascii_case(&b'g')) {
        return false;
    }
    let folded: String = name
        .chars()
        .filter(|c| !hfs_ignorable(*c))
        .collect::<String>()
        .to_lowercase();
    // NTFS: `name:stream` is `name`; trailing dots and spaces are dropped.
    let head = folded.split(':').next().unwrap_or("");
    let head = head.trim_end_matches(['.', ' ']);
    head == ".git" || head == "git~1"
}

/// The prefix of `rel` up to and including its first `.git`-like component, if any.
pub fn dotgit_prefix(rel: &str) -> Option<&str> {
    let mut end = 0;
    for (i, seg) in rel.split('/').enumerate() {
        end += seg.len() + usize::from(i > 0);
        if is_dotgit_name(seg) {
            return Some(&rel[..end]);
        }
    }
    None
}

/// Names that make a directory a git directory, as bits. By length first: a diff asks this
/// of every path of the VM's tree and of the base.
fn layout_bit(name: &str) -> u8 {
    let (want, bit) = match name.len() {
        4 if name.as_bytes()[0].eq_ignore_ascii_case(&b'h') => ("head", 1),
        4 => ("refs", 4),
        7 => ("objects", 2),
        9 => ("commondir", 8),
        _ => return 0,
    };
    if name.eq_ignore_ascii_case(want) {
        bit
    } else {
        0
    }
}

fn is_layout(bits: u8) -> bool {
    bits & 1 != 0 && (bits & 6 == 6 || bits & 8 != 0)
}

/// Directories (relative, `""` for the root) that look like a bare repository in `paths`.
pub fn bare_layouts<'a>(paths: impl IntoIterator<Item = &'a str>) -> BTreeSet<String> {
    let mut bits: BTreeMap<&str, u8> = BTreeMap::new();
    for p in paths {
        let (dir, name) = p.rsplit_once('/').unwrap_or(("", p));
        let b = layout_bit(name);
        if b != 0 {
            *bits.entry(dir).or_default() |= b;
        }
    }
    bits.into_iter()
        .filter(|(_, b)| is_layout(*b))
        .map(|(d, _)| d.to_owned())
        .collect()
}

/// Why `rel` may not be brought back, as `(directory to report, reason)`; `layouts` from
/// [`bare_layouts`].
pub fn refusal<'a>(rel: &'a str, layouts: &'a BTreeSet<String>) -> Option<(&'a str, &'static str)> {
    if let Some(p) = dotgit_prefix(rel) {
        return Some((p, DOTGIT_REASON));
    }
    layouts
        .iter()
        .find(|d| d.is_empty() || rel == d.as_str() || rel.starts_with(&format!("{d}/")))
        .map(|d| (if d.is_empty() { "." } else { d.as_str() }, BARE_REASON))
}

/// Move the changes of `s` that would plant git metadata on the host into `s.refused`.
/// A bare layout counts when the VM's tree and the base together hold it (so a VM cannot get
/// `objects/` and `refs/` applied first and `HEAD` later).
pub fn refuse(s: &mut Suspects, base: &Manifest, walk: &[WalkEntry]) {
    let layouts = bare_layouts(
        walk.iter()
            .map(|w| w.path.as_str())
            .chain(base.entries.keys().map(String::as_str)),
    );
    let mut refused: BTreeMap<String, &'static str> = BTreeMap::new();
    let mut keep = |rel: &str| match refusal(rel, &layouts) {
        Some((dir, why)) => {
            refused.entry(dir.to_owned()).or_insert(why);
            false
        }
        None => true,
    };
    s.changed.retain(|w| keep(&w.path));
    s.deleted.retain(|p| keep(p));
    s.special.retain(|p| keep(p));
    s.refused
        .extend(refused.into_iter().map(|(d, why)| format!("{d}: {why}")));
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layout_names_match_in_any_case_and_nothing_else_does() {
        for (name, bit) in [
            ("HEAD", 1),
            ("head", 1),
            ("Head", 1),
            ("objects", 2),
            ("OBJECTS", 2),
            ("refs", 4),
            ("Refs", 4),
            ("commondir", 8),
            ("CommonDir", 8),
        ] {
            assert_eq!(layout_bit(name), bit, "{name}");
        }
        for name in [
            "", "HEADS", "hea", "ref", "refz", "hexd", "object", "objectsx", "commondi", "é€ab",
        ] {
            assert_eq!(layout_bit(name), 0, "{name}");
        }
    }

    #[test]
    fn every_spelling_of_dotgit_is_caught_at_any_depth() {
        for name in [
            ".git",
            ".GIT",
            ".Git",
            ".git.",
            ".git..",
            ".git ",
            ".git. .",
            ".git::$INDEX_ALLOCATION",
            ".git:stream",
            "git~1",
            "GIT~1",
            ".g\u{200c}it",
            "\u{feff}.git",
        ] {
            assert!(is_dotgit_name(name), "{name:?}");
            for rel in [
                name.to_owned(),
                format!("{name}/config"),
                format!("a/b/{name}"),
                format!("a/{name}/hooks/pre-commit"),
            ] {
                assert!(dotgit_prefix(&rel).is_some(), "{rel:?}");
                assert!(super::super::rules::is_git_path(&rel), "{rel:?}");
            }
        }
        for name in [
            ".gitignore",
            ".gitattributes",
            ".gitmodules",
            "git",
            ".github",
            "x.git",
            "git~2",
            ".git-x",
            // No `g` at all: ruled out before any folding.
            "main.rs",
            ".it",
            "it~1",
            "\u{200c}.\u{feff}it",
        ] {
            assert!(!is_dotgit_name(name), "{name:?}");
        }
        assert_eq!(dotgit_prefix("a/b/.GIT/x/y"), Some("a/b/.GIT"));
        assert_eq!(dotgit_prefix("sub/.git"), Some("sub/.git"));
        assert_eq!(dotgit_prefix("src/.gitignore"), None);
    }

    #[test]
    fn bare_layouts_need_head_and_objects_refs_or_commondir() {
        let l = bare_layouts([
            "evil/HEAD",
            "evil/objects",
            "evil/refs",
            "evil/config",
            "wt/HEAD",
            "wt/commondir",
            "half/HEAD",
            "half/objects",
            "docs/HEAD.md",
            "x/y/head",
            "x/y/OBJECTS",
            "x/y/refs",
        ]);
        assert_eq!(l.into_iter().collect::<Vec<_>>(), ["evil", "wt", "x/y"]);
        let root = bare_layouts(["HEAD", "objects", "refs", "src/a.rs"]);
        assert_eq!(root.into_iter().collect::<Vec<_>>(), [""]);
    }

    #[test]
    fn refusal_names_the_repository_directory() {
        let l = bare_layouts(["evil/HEAD", "evil/objects", "evil/refs"]);
        assert_eq!(refusal("evil/config", &l), Some(("evil", BARE_REASON)));
        assert_eq!(
            refusal("evil/objects/ab/cd", &l),
            Some(("evil", BARE_REASON))
        );
        assert_eq!(refusal("evilness/config", &l), None);
        assert_eq!(refusal("a/.git", &l), Some(("a/.git", DOTGIT_REASON)));
        assert_eq!(refusal("src/main.rs", &l), None);
    }
}

#[cfg(test)]
mod diff_tests {

    use super::super::diff::{classify, suspects};
    use super::super::manifest::{Entry, Manifest};
    use super::super::rules::{Ignores, Rules};
    use crate::config::SyncConfig;
    use crate::rpc::{FileKind, WalkEntry};

    fn we(path: &str, kind: FileKind) -> WalkEntry {
        WalkEntry {
            path: path.into(),
            kind,
            size: 5,
            mode: 0o644,
            mtime: 200,
            mtime_nsec: 0,
            link: None,
            base: false,
        }
    }

    /// A VM that plants git metadata: diff lists each repository directory once as refused,
    /// and none of it is a change apply could plan.
    #[test]
    fn diff_refuses_git_metadata_planted_by_the_vm() {
        let mut base = Manifest::default();
        for p in [
            "src/a.rs",
            "nested/.git",
            "half/objects",
            "half/objects/ab",
            "half/refs",
            "half/refs/heads/main",
        ] {
            base.entries
                .insert(p.into(), Entry::file(0o644, 1, 0, "x".into()));
        }
        let (f, d) = (FileKind::File, FileKind::Dir);
        let walk = vec![
            we(".git", d),
            we(".git/config", f),
            we(".git.", d),
            we(".git./config", f),
            we("evil", d),
            we("evil/HEAD", f),
            we("evil/config", f),
            we("evil/objects", d),
            we("evil/refs", d),
            we("half", d),
            we("half/HEAD", f),
            we("half/refs", d),
            we("src", d),
            we("src/a.rs", f),
            we("src/new.rs", f),
            we("sub", d),
            we("sub/.git", f),
            we("vendor", d),
            we("vendor/lib", d),
            we("vendor/lib/.GIT", d),
            we("vendor/lib/.GIT/config", f),
            we("wt", d),
            we("wt/GIT~1", f),
        ];
        let rules = Rules::new(&SyncConfig::default()).unwrap();
        let s = suspects(&base, &walk, &rules, &Ignores::default(), &[]);
        let refused: Vec<&str> = s
            .refused
            .iter()
            .map(|r| r.split(": ").next().unwrap())
            .collect();
        assert_eq!(
            refused,
            [
                ".git.",
                "evil",
                "half",
                "nested/.git",
                "sub/.git",
                "vendor/lib/.GIT",
                "wt/GIT~1"
            ],
            "{:#?}",
            s.refused
        );
        let changed: Vec<&str> = s.changed.iter().map(|w| w.path.as_str()).collect();
        assert_eq!(changed, ["src/a.rs", "src/new.rs"]);
        assert!(s.deleted.is_empty(), "{:?}", s.deleted);
        let d = tempfile::tempdir().unwrap();
        let (_spill, contents) = crate::workspace::spill::spilled_for_tests(
            d.path(),
            &[("src/a.rs", b"new a"), ("src/new.rs", b"fresh")],
        );
        let ch = classify(&base, s, contents);
        for c in &ch {
            assert!(c.path.starts_with("src/"), "{} would be applied", c.path);
        }
    }
}
