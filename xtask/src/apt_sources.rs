//! The Debian archive this machine's own apt configuration names, so the build (the
//! `bookworm-backports` source `deps` adds, the rootfs's `mmdebstrap`) fetches from the mirror
//! the machine's administrator chose and never from a host written into the project.
//!
//! Reads `/etc/apt/sources.list`, `/etc/apt/sources.list.d/*.list` (one-line style) and
//! `/etc/apt/sources.list.d/*.sources` (deb822), and picks the first `deb` entry whose suite is
//! the one asked for (exactly: `bookworm`, not `bookworm-security`) with the `main` component;
//! for a release the host does not use (the trixie guest on a bookworm host), the host's own
//! release archive.

use anyhow::{Result, bail};
use std::path::{Path, PathBuf};

/// One `deb` source: its URI and suites (components must include `main`).
#[derive(Debug, Clone, PartialEq, Eq)]
struct Source {
    uri: String,
    suites: Vec<String>,
}

/// The archive URI (e.g. `http://deb.debian.org/debian`, no trailing slash) the machine's apt
/// sources use for `suite`'s `main` component; when none names `suite` (a trixie guest built on
/// a bookworm host), the archive they use for the host's own Debian release, which carries
/// every release.
pub fn debian_mirror(suite: &str) -> Result<String> {
    let files = source_files(Path::new("/etc/apt"));
    let mut read = Vec::new();
    let mut sources = Vec::new();
    for f in &files {
        let Ok(text) = std::fs::read_to_string(f) else {
            continue;
        };
        read.push(f.display().to_string());
        sources.extend(if f.extension().is_some_and(|e| e == "sources") {
            parse_deb822(&text)
        } else {
            parse_one_line(&text)
        });
    }
    if let Some(uri) = pick(&sources, suite).or_else(|| pick_release_archive(&sources)) {
        return Ok(uri);
    }
    bail!(
        "no apt source for Debian `{suite}` (or any Debian release) main in {} (the build takes \
         its Debian mirror from the machine's apt configuration: add a `deb <mirror> {suite} \
         main` source)",
        if read.is_empty() {
            "/etc/apt (no source files found)".to_owned()
        } else {
            read.join(", ")
        }
    )
}

/// Debian release names a main archive serves (not `-security`, `-updates`, `-backports`).
const RELEASES: &[&str] = &[
    "buster",
    "bullseye",
    "bookworm",
    "trixie",
    "forky",
    "duke",
    "sid",
    "oldstable",
    "stable",
    "testing",
    "unstable",
];

/// The first source whose suites include a Debian release: the main archive (a security
/// archive serves only `-security` suites; third-party repositories use other names).
fn pick_release_archive(sources: &[Source]) -> Option<String> {
    sources
        .iter()
        .find(|s| s.suites.iter().any(|x| RELEASES.contains(&x.as_str())))
        .map(|s| s.uri.trim_end_matches('/').to_owned())
}

/// `sources.list` first, then `sources.list.d/` by name (apt's own order).
fn source_files(etc_apt: &Path) -> Vec<PathBuf> {
    let mut out = vec![etc_apt.join("sources.list")];
    let mut more: Vec<PathBuf> = std::fs::read_dir(etc_apt.join("sources.list.d"))
        .map(|rd| {
            rd.flatten()
                .map(|e| e.path())
                .filter(|p| p.extension().is_some_and(|e| e == "list" || e == "sources"))
                .collect()
        })
        .unwrap_or_default();
    more.sort();
    out.extend(more);
    out
}

fn pick(sources: &[Source], suite: &str) -> Option<String> {
    sources
        .iter()
        .find(|s| s.suites.iter().any(|x| x == suite))
        .map(|s| s.uri.trim_end_matches('/').to_owned())
}

/// `deb [options] URI SUITE COMPONENT...` lines; `deb-src` and comments ignored.
fn parse_one_line(text: &str) -> Vec<Source> {
    let mut out = Vec::new();
    for line in text.lines() {
        let line = line.split('#').next().unwrap_or("").trim();
        let Some(rest) = line.strip_prefix("deb ") else {
            continue;
        };
        let mut rest = rest.trim_start();
        if rest.starts_with('[') {
            match rest.find(']') {
                Some(i) => rest = rest[i + 1..].trim_start(),
                None => continue,
            }
        }
        let words: Vec<&str> = rest.split_whitespace().collect();
        if words.len() >= 3 && words[2..].contains(&"main") {
            out.push(Source {
                uri: words[0].to_owned(),
                suites: vec![words[1].to_owned()],
            });
        }
    }
    out
}

/// deb822 stanzas (blank-line separated) with `Types: deb`, `URIs`, `Suites`, `Components`,
/// skipping `Enabled: no`. A stanza with several URIs contributes each.
fn parse_deb822(text: &str) -> Vec<Source> {
    let mut out = Vec::new();
    for stanza in text.split("\n\n") {
        let field = |name: &str| -> Vec<String> {
            stanza
                .lines()
                .filter(|l| !l.trim_start().starts_with('#'))
                .find_map(|l| {
                    let (k, v) = l.split_once(':')?;
                    k.trim()
                        .eq_ignore_ascii_case(name)
                        .then(|| v.split_whitespace().map(str::to_owned).collect())
                })
                .unwrap_or_default()
        };
        let enabled = field("Enabled");
        if enabled
            .first()
            .is_some_and(|e| e.eq_ignore_ascii_case("no"))
        {
            continue;
        }
        if !field("Types").iter().any(|t| t == "deb")
            || !field("Components").contains(&"main".into())
        {
            continue;
        }
        let suites = field("Suites");
        for uri in field("URIs") {
            out.push(Source {
                uri,
                suites: suites.clone(),
            });
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_suite_itself_is_picked_not_its_security_or_backports_siblings() {
        let deb822 = "\
Types: deb
URIs: http://security.example/debian-security
Suites: bookworm-security
Components: main

Types: deb
# a comment: URIs: http://wrong.example/
URIs: http://mirror.example/debian/
Suites: bookworm bookworm-updates
Components: main contrib
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg
";
        let s = parse_deb822(deb822);
        assert_eq!(
            pick(&s, "bookworm").as_deref(),
            Some("http://mirror.example/debian")
        );
        assert_eq!(pick(&s, "trixie"), None);
    }

    #[test]
    fn another_release_falls_back_to_the_host_release_archive() {
        let deb822 = "\
Types: deb
URIs: https://deb.nodesource.example/node_20.x
Suites: nodistro
Components: main

Types: deb
URIs: http://security.example/debian-security
Suites: bookworm-security
Components: main

Types: deb
URIs: http://mirror.example/debian/
Suites: bookworm bookworm-updates
Components: main
";
        let s = parse_deb822(deb822);
        assert_eq!(pick(&s, "trixie"), None);
        assert_eq!(
            pick(&s, "trixie")
                .or_else(|| pick_release_archive(&s))
                .as_deref(),
            Some("http://mirror.example/debian")
        );
        // Only a third-party or security source: no Debian archive to fall back on.
        assert_eq!(pick_release_archive(&s[..2]), None);
    }

    #[test]
    fn disabled_stanzas_deb_src_and_other_components_are_ignored() {
        let deb822 = "\
Types: deb
URIs: http://off.example/debian
Suites: bookworm
Components: main
Enabled: no

Types: deb-src
URIs: http://src.example/debian
Suites: bookworm
Components: main

Types: deb
URIs: http://contrib.example/debian
Suites: bookworm
Components: contrib
";
        assert_eq!(pick(&parse_deb822(deb822), "bookworm"), None);
    }

    #[test]
    fn one_line_sources_with_options_and_comments() {
        let list = "\
# deb http://commented.example/debian bookworm main
deb-src http://src.example/debian bookworm main
deb [arch=amd64 signed-by=/k.gpg] http://one.example/debian bookworm main non-free
deb http://two.example/debian bookworm main
";
        let s = parse_one_line(list);
        assert_eq!(s.len(), 2);
        assert_eq!(
            pick(&s, "bookworm").as_deref(),
            Some("http://one.example/debian")
        );
    }

    #[test]
    fn files_are_read_in_apt_order() {
        let d = tempfile::tempdir().unwrap();
        std::fs::create_dir(d.path().join("sources.list.d")).unwrap();
        for f in ["b.sources", "a.list", "c.disabled", "z.list"] {
            std::fs::write(d.path().join("sources.list.d").join(f), "").unwrap();
        }
        let names: Vec<String> = source_files(d.path())
            .iter()
            .map(|p| p.file_name().unwrap().to_string_lossy().into_owned())
            .collect();
        assert_eq!(names, ["sources.list", "a.list", "b.sources", "z.list"]);
    }
}
