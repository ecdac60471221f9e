//! What of the host repo is synced: `.gitignore` rules (via the `ignore` crate), `sync.exclude`
//! globs and the secret patterns (with the user's allow-list).
//!
//! Owns the host-side scan ([`scan`]) and the path filter used for the VM's tree too
//! ([`Rules::keeps`]). Never reads file contents (hashing is `manifest`'s job).

use std::collections::BTreeMap;
use std::os::unix::fs::MetadataExt;
use std::path::Path;

use globset::{GlobSet, GlobSetBuilder};
use ignore::gitignore::{Gitignore, GitignoreBuilder};

use super::manifest::{Kind, Manifest};
use super::{WorkspaceError, ancestors};
use crate::config::SyncConfig;

/// Compiled sync rules.
#[derive(Debug, Clone)]
pub struct Rules {
    /// The `exclude` patterns as given (kept to build [`Rules::with_exclude`]).
    exclude_patterns: Vec<String>,
    exclude: GlobSet,
    /// Secret patterns written with a trailing `/`: that directory (or file) and everything
    /// below it.
    secrets: GlobSet,
    /// The other secret patterns: files (and symlinks) only, never a directory or what is in
    /// it (`id_*` must not take a directory `id_service/` with it).
    secret_files: GlobSet,
    allow: GlobSet,
}

/// Compiles `patterns` (a name without `/` matches at any depth). `any_case`: match letters in
/// either case (the secret patterns: `.ENV`, `ID_RSA` and `Credentials.json` are secrets too,
/// and a case-folding host file system serves them under either spelling).
fn globset(patterns: &[String], any_case: bool) -> Result<GlobSet, WorkspaceError> {
    let mut b = GlobSetBuilder::new();
    for p in patterns {
        let trimmed = p.trim_matches('/');
        if trimmed.is_empty() {
            continue;
        }
        let pat = if trimmed.contains('/') {
            trimmed.to_owned()
        } else {
            format!("**/{trimmed}")
        };
        let g = globset::GlobBuilder::new(&pat)
            .literal_separator(true)
            .case_insensitive(any_case)
            .build()
            .or_else(|_| {
                globset::GlobBuilder::new(&pat)
                    .case_insensitive(any_case)
                    .build()
            })
            .map_err(|e| WorkspaceError::Pattern {
                pattern: p.clone(),
                message: e.to_string(),
            })?;
        b.add(g);
    }
    b.build().map_err(|e| WorkspaceError::Pattern {
        pattern: patterns.join(", "),
        message: e.to_string(),
    })
}

/// The secret patterns meant for directories (written with a trailing `/`), or the others.
fn secret_patterns(all: &[String], dirs: bool) -> Vec<String> {
    all.iter()
        .filter(|p| p.trim_end().ends_with('/') == dirs)
        .cloned()
        .collect()
}

fn matches_any_ancestor(set: &GlobSet, rel: &str) -> bool {
    ancestors(rel).any(|a| set.is_match(a))
}

/// Paths one sync request leaves alone (`exclude` of an exec or sync request): neither sent
/// nor deleted in the VM, whatever the host has there.
#[derive(Debug, Clone, Default)]
pub struct Skip(Option<GlobSet>);

impl Skip {
    pub fn new(patterns: &[String]) -> Result<Skip, WorkspaceError> {
        if patterns.is_empty() {
            return Ok(Skip(None));
        }
        Ok(Skip(Some(globset(patterns, false)?)))
    }

    /// `rel` or one of its ancestors matches.
    pub fn skips(&self, rel: &str) -> bool {
        self.0
            .as_ref()
            .is_some_and(|s| matches_any_ancestor(s, rel))
    }
}

impl Rules {
    pub fn new(cfg: &SyncConfig) -> Result<Rules, WorkspaceError> {
        Ok(Rules {
            exclude_patterns: cfg.exclude.clone(),
            exclude: globset(&cfg.exclude, false)?,
            secrets: globset(&secret_patterns(&cfg.secrets, true), true)?,
            secret_files: globset(&secret_patterns(&cfg.secrets, false), true)?,
            allow: globset(&cfg.allow_secrets, false)?,
        })
    }

    /// These rules with more `exclude` patterns (a sandbox's own, or one request's).
    pub fn with_exclude(&self, more: &[String]) -> Result<Rules, WorkspaceError> {
        if more.is_empty() {
            return Ok(self.clone());
        }
        let mut all = self.exclude_patterns.clone();
        all.extend(more.iter().cloned());
        Ok(Rules {
            exclude: globset(&all, false)?,
            exclude_patterns: all,
            secrets: self.secrets.clone(),
            secret_files: self.secret_files.clone(),
            allow: self.allow.clone(),
        })
    }

    /// A secret the user has not allowed: `rel` or an ancestor matches a directory pattern
    /// (`.ssh/`), or `rel` is not a directory and matches a file pattern (`id_*`).
    pub fn is_secret(&self, rel: &str, is_dir: bool) -> bool {
        (matches_any_ancestor(&self.secrets, rel) || (!is_dir && self.secret_files.is_match(rel)))
            && !matches_any_ancestor(&self.allow, rel)
    }

    pub fn is_excluded(&self, rel: &str) -> bool {
        matches_any_ancestor(&self.exclude, rel)
    }

    /// Whether a path of the VM's tree takes part in diff/apply: not under the repo's own
    /// `.git/`, not excluded, not ignored by the `.gitignore` files of the sync base. Git
    /// metadata anywhere else is kept here so diff can show it as refused
    /// ([`super::gitmeta::refuse`]).
    pub fn keeps(&self, ignores: &Ignores, rel: &str, is_dir: bool) -> bool {
        !is_root_git(rel) && !self.is_excluded(rel) && !ignores.ignored(rel, is_dir)
    }
}

/// The repo's own `.git` or anything under it (exactly `.git`, at the root).
pub fn is_root_git(rel: &str) -> bool {
    rel == ".git" || rel.starts_with(".git/")
}

/// Whether any component of `rel` is a `.git` (any depth, any spelling a host file system
/// may fold to `.git`: see [`super::gitmeta::is_dotgit_name`]). Apply never writes these.
pub fn is_git_path(rel: &str) -> bool {
    super::gitmeta::dotgit_prefix(rel).is_some()
}

/// `.gitignore` matchers built from the sync base (what the VM was given), for filtering the
/// VM's tree the same way the host's was filtered.
#[derive(Default)]
pub struct Ignores {
    /// (directory relative to the root, "" for the root; matcher)
    sets: Vec<(String, Gitignore)>,
}

impl Ignores {
    /// `read` returns the content of a `.gitignore`/`info/exclude` from the base.
    pub fn from_base(base: &Manifest, mut read: impl FnMut(&str) -> Option<Vec<u8>>) -> Ignores {
        let mut sets = Vec::new();
        for (path, e) in &base.entries {
            let dir = if path == ".gitignore" || path == ".git/info/exclude" {
                ""
            } else if let Some(d) = path.strip_suffix("/.gitignore") {
                d
            } else {
                continue;
            };
            if e.kind != Kind::File {
                continue;
            }
            let Some(text) = read(path) else { continue };
            let mut b = GitignoreBuilder::new(Path::new("/").join(dir));
            for line in String::from_utf8_lossy(&text).lines() {
                let _ = b.add_line(None, line);
            }
            if let Ok(g) = b.build() {
                sets.push((dir.to_owned(), g));
            }
        }
        Ignores { sets }
    }

    pub fn ignored(&self, rel: &str, is_dir: bool) -> bool {
        let abs = Path::new("/").join(rel);
        self.sets.iter().any(|(dir, g)| {
            (dir.is_empty() || rel.starts_with(&format!("{dir}/")))
                && g.matched_path_or_any_parents(&abs, is_dir).is_ignore()
        })
    }
}

/// One host path as the scan saw it (no content yet).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HostEntry {
    pub kind: Kind,
    pub mode: u32,
    pub size: u64,
    /// Nanoseconds since the epoch.
    pub mtime_ns: i64,
    pub link: Option<String>,
}

impl HostEntry {
    pub fn from_metadata(md: &std::fs::Metadata, link: Option<String>) -> Option<HostEntry> {
        let ft = md.file_type();
        let kind = if ft.is_symlink() {
            Kind::Symlink
        } else if ft.is_dir() {
            Kind::Dir
        } else if ft.is_file() {
            Kind::File
        } else {
            return None;
        };
        Some(HostEntry {
            kind,
            mode: md.mode() & 0o7777,
            size: md.len(),
            mtime_ns: md.mtime() * 1_000_000_000 + md.mtime_nsec(),
            link,
        })
    }
}

impl HostEntry {
    /// [`HostEntry::from_metadata`] from an `lstat` result.
    fn from_stat(st: &nix::sys::stat::FileStat, link: Option<String>) -> Option<HostEntry> {
        let kind = match st.st_mode & libc::S_IFMT {
            libc::S_IFLNK => Kind::Symlink,
            libc::S_IFDIR => Kind::Dir,
            libc::S_IFREG => Kind::File,
            _ => return None,
        };
        Some(HostEntry {
            kind,
            mode: st.st_mode & 0o7777,
            size: st.st_size as u64,
            mtime_ns: st.st_mtime * 1_000_000_000 + st.st_mtime_nsec,
            link,
        })
    }
}

/// What a scan of the host repo found.
#[derive(Debug, Default)]
pub struct Scan {
    pub entries: BTreeMap<String, HostEntry>,
    /// Secret paths left out (a secret directory is one entry).
    pub secrets_skipped: Vec<String>,
}

/// Walk the host repo (not following symlinks), applying `.gitignore`, `.git/info/exclude`,
/// `sync.exclude` and the secret rules. Devices, FIFOs and sockets are skipped.
pub fn scan(root: &Path, rules: &Rules) -> Result<Scan, WorkspaceError> {
    let mut out = Scan::default();
    let walker = ignore::WalkBuilder::new(root)
        .hidden(false)
        .parents(false)
        .ignore(false)
        .git_global(false)
        .git_ignore(true)
        .git_exclude(true)
        .require_git(false)
        .follow_links(false)
        .build();
    let mut skip_dirs: Vec<String> = Vec::new();
    let mut at = AtDir::default();
    for ent in walker {
        let ent = ent.map_err(|e| WorkspaceError::Io {
            what: "scan",
            path: root.to_path_buf(),
            source: std::io::Error::other(e.to_string()),
        })?;
        let Ok(rel) = ent.path().strip_prefix(root) else {
            continue;
        };
        let Some(rel) = rel.to_str() else {
            tracing::warn!(path = %ent.path().display(), "skipping a path that is not UTF-8");
            continue;
        };
        if rel.is_empty() {
            continue;
        }
        if skip_dirs.iter().any(|d| rel.starts_with(&format!("{d}/"))) {
            continue;
        }
        let Some(st) = at.lstat(ent.path()) else {
            continue; // removed while scanning
        };
        let is_dir = st.st_mode & libc::S_IFMT == libc::S_IFDIR;
        let secret = rules.is_secret(rel, is_dir);
        if secret || rules.is_excluded(rel) {
            if secret {
                out.secrets_skipped.push(rel.to_owned());
            }
            if is_dir {
                skip_dirs.push(rel.to_owned());
            }
            continue;
        }
        let link = if st.st_mode & libc::S_IFMT == libc::S_IFLNK {
            at.readlink(ent.path())
        } else {
            None
        };
        if let Some(h) = HostEntry::from_stat(&st, link) {
            out.entries.insert(rel.to_owned(), h);
        }
    }
    Ok(out)
}

/// `lstat` and `readlink` of walked paths relative to an open descriptor of their directory
/// (the last one kept open): the kernel does not walk every path from the root again, which
/// is a good part of a scan of a big tree.
#[derive(Default)]
struct AtDir {
    dir: std::path::PathBuf,
    fd: Option<std::os::fd::OwnedFd>,
}

impl AtDir {
    /// The open directory of `path` and its file name; `None` if it cannot be opened.
    fn split<'p>(
        &mut self,
        path: &'p Path,
    ) -> Option<(&std::os::fd::OwnedFd, &'p std::ffi::OsStr)> {
        use nix::fcntl::OFlag;
        let (parent, name) = (path.parent()?, path.file_name()?);
        if self.fd.is_none() || self.dir != parent {
            let flags = OFlag::O_RDONLY | OFlag::O_DIRECTORY | OFlag::O_CLOEXEC;
            self.fd = Some(nix::fcntl::open(parent, flags, nix::sys::stat::Mode::empty()).ok()?);
            self.dir = parent.to_path_buf();
        }
        Some((self.fd.as_ref()?, name))
    }

    fn lstat(&mut self, path: &Path) -> Option<nix::sys::stat::FileStat> {
        let (fd, name) = self.split(path)?;
        nix::sys::stat::fstatat(fd, name, nix::fcntl::AtFlags::AT_SYMLINK_NOFOLLOW).ok()
    }

    fn readlink(&mut self, path: &Path) -> Option<String> {
        let (fd, name) = self.split(path)?;
        nix::fcntl::readlinkat(fd, name)
            .ok()
            .map(|t| t.to_string_lossy().into_owned())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rules(exclude: &[&str], allow: &[&str]) -> Rules {
        Rules::new(&SyncConfig {
            exclude: exclude.iter().map(|s| s.to_string()).collect(),
            allow_secrets: allow.iter().map(|s| s.to_string()).collect(),
            ..SyncConfig::default()
        })
        .unwrap()
    }

    #[test]
    fn default_secret_patterns_match_at_any_depth_and_cover_directories() {
        let r = rules(&[], &[]);
        for p in [
            ".env",
            ".env.local",
            "app/.env",
            "certs/server.pem",
            "a/b/tls.key",
            ".ssh/id_ed25519",
            "home/.aws/credentials",
            ".npmrc",
            ".netrc",
            ".docker/config.json",
            "id_rsa",
        ] {
            assert!(r.is_secret(p, false), "{p} should be a secret");
        }
        for p in [
            "src/main.rs",
            "environment.md",
            "keys.rs",
            "docker/config.json",
            "id.rs",
        ] {
            assert!(!r.is_secret(p, false), "{p} should not be a secret");
        }
    }

    #[test]
    fn more_excludes_and_skips_match_paths_and_whole_directories() {
        let r = rules(&["vendor"], &[]);
        let more = r
            .with_exclude(&["data/*.csv".into(), "big".into()])
            .unwrap();
        for p in ["vendor/x.c", "data/a.csv", "big", "x/big/y"] {
            assert!(more.is_excluded(p), "{p}");
        }
        assert!(!more.is_excluded("data/sub/a.csv") && !more.is_excluded("src/big.rs"));
        assert!(!r.is_excluded("big"), "the original rules are unchanged");
        assert!(r.with_exclude(&["[".into()]).is_err());
        let s = Skip::new(&["gen".into()]).unwrap();
        assert!(s.skips("gen") && s.skips("a/gen/b.txt") && !s.skips("generated"));
        assert!(!Skip::default().skips("anything"));
    }

    #[test]
    fn allow_list_lets_a_secret_through() {
        let r = rules(&[], &[".env.example"]);
        assert!(!r.is_secret(".env.example", false));
        assert!(r.is_secret(".env", false));
    }

    #[test]
    fn scan_applies_gitignore_excludes_and_secrets() {
        let d = tempfile::tempdir().unwrap();
        let root = d.path();
        for (p, c) in [
            (".gitignore", "target/\n*.log\n"),
            ("src/main.rs", "fn main() {}"),
            ("target/debug/big", "x"),
            ("run.log", "x"),
            (".env", "SECRET=1"),
            (".ssh/id_rsa", "k"),
            ("vendor/lib.c", "x"),
            ("sub/.gitignore", "gen.txt\n"),
            ("sub/gen.txt", "x"),
            ("sub/keep.txt", "x"),
            (".git/config", "[core]\n"),
        ] {
            let p = root.join(p);
            std::fs::create_dir_all(p.parent().unwrap()).unwrap();
            std::fs::write(p, c).unwrap();
        }
        std::os::unix::fs::symlink("src/main.rs", root.join("link")).unwrap();
        let s = scan(root, &rules(&["vendor"], &[])).unwrap();
        let names: Vec<&str> = s.entries.keys().map(|s| s.as_str()).collect();
        assert_eq!(
            names,
            [
                ".git",
                ".git/config",
                ".gitignore",
                "link",
                "src",
                "src/main.rs",
                "sub",
                "sub/.gitignore",
                "sub/keep.txt"
            ]
        );
        assert_eq!(s.secrets_skipped, [".env", ".ssh"]);
        assert_eq!(s.entries["link"].link.as_deref(), Some("src/main.rs"));
        // Stat'ed relative to their directory: the same as a plain lstat of the whole path.
        std::fs::set_permissions(
            root.join("sub/keep.txt"),
            std::os::unix::fs::PermissionsExt::from_mode(0o751),
        )
        .unwrap();
        let s = scan(root, &rules(&["vendor"], &[])).unwrap();
        for (rel, h) in &s.entries {
            let md = std::fs::symlink_metadata(root.join(rel)).unwrap();
            let link = h.link.clone();
            assert_eq!(
                Some(h),
                HostEntry::from_metadata(&md, link).as_ref(),
                "{rel}"
            );
        }
        assert_eq!(s.entries["sub/keep.txt"].mode, 0o751);
        assert_eq!(s.entries["src"].kind, Kind::Dir);
        assert_eq!(s.entries["link"].kind, Kind::Symlink);
    }

    #[test]
    fn ignores_from_the_base_filter_the_vm_tree() {
        use super::super::manifest::Entry;
        let mut m = Manifest::default();
        let f = Entry::file(0o644, 1, 0, "x".into());
        m.entries.insert(".gitignore".into(), f.clone());
        m.entries.insert("sub/.gitignore".into(), f);
        let ig = Ignores::from_base(&m, |p| {
            Some(if p == ".gitignore" {
                b"node_modules/\n*.o\n".to_vec()
            } else {
                b"out.txt\n".to_vec()
            })
        });
        assert!(ig.ignored("node_modules/x/y.js", false));
        assert!(ig.ignored("a/b.o", false));
        assert!(ig.ignored("sub/out.txt", false));
        assert!(!ig.ignored("out.txt", false));
        assert!(!ig.ignored("src/main.rs", false));
        let r = rules(&[], &[]);
        assert!(!r.keeps(&ig, ".git/config", false));
        assert!(r.keeps(&ig, "src/main.rs", false));
    }
}
