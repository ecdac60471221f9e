//! Where a path leads in the host repo as it will be after an apply: symlinks resolved one
//! component at a time, through both the host's existing links and the ones the apply creates.
//!
//! Owns the "stays inside the repo" rule for symlinks from a VM ([`After::check_link`]) and for
//! the parents of every path an apply writes ([`After::check_parents`]). A lexical check is not
//! enough: `d/l -> ..` followed by `d/m -> l/../..` climbs out only once `l` is followed.
//! Never writes; reads the host only with `lstat`/`readlink` below the root, never through a
//! symlink.

use std::collections::{HashMap, VecDeque};
use std::path::Path;

/// Links followed at most while resolving one target (Linux's own limit is 40).
pub const MAX_HOPS: usize = 40;

/// What the apply leaves at a path it touches.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Planned {
    Symlink(String),
    /// A regular file (written).
    File,
    /// Nothing (deleted).
    Absent,
}

/// The host repo as it will be after the apply: `planned` over what the host has now.
pub struct After<'a> {
    root: &'a Path,
    planned: HashMap<String, Planned>,
}

/// What one path holds in the repo after the apply, as far as resolving goes.
enum Node {
    Link(String),
    /// A directory, a file or nothing: resolving goes on lexically (a file or nothing has no
    /// children, so whatever lies below is absent, which is inside the repo).
    Plain,
}

impl<'a> After<'a> {
    pub fn new(root: &'a Path, planned: impl IntoIterator<Item = (String, Planned)>) -> Self {
        After {
            root,
            planned: planned.into_iter().collect(),
        }
    }

    /// The node at `rel`, whose every ancestor is known not to be a symlink.
    fn node(&self, rel: &str) -> Node {
        if let Some(p) = self.planned.get(rel) {
            return match p {
                Planned::Symlink(t) => Node::Link(t.clone()),
                _ => Node::Plain,
            };
        }
        // An ancestor the apply replaces by a file or removes hides what the host has below.
        if super::ancestors(rel)
            .take_while(|a| *a != rel)
            .any(|a| self.planned.contains_key(a))
        {
            return Node::Plain;
        }
        match std::fs::symlink_metadata(self.root.join(rel)) {
            Ok(md) if md.file_type().is_symlink() => {
                match std::fs::read_link(self.root.join(rel)) {
                    Ok(t) => Node::Link(t.to_string_lossy().into_owned()),
                    // Unreadable: treat as a link that cannot be shown to stay inside.
                    Err(_) => Node::Link("/".into()),
                }
            }
            _ => Node::Plain,
        }
    }

    /// Resolve `target` as a symlink at `link` would: `Err` with the reason when it leads out
    /// of the repo (an absolute target, a `..` above the root, through links old or new) or
    /// follows more than [`MAX_HOPS`] links.
    pub fn check_link(&self, link: &str, target: &str) -> Result<(), LinkError> {
        if target.is_empty() {
            return Err(LinkError::EmptyTarget);
        }
        if target.contains('\0') || target.len() > 4095 {
            return Err(LinkError::BadTarget);
        }
        if target.starts_with('/') {
            return Err(LinkError::Absolute(target.to_owned()));
        }
        let mut dir: Vec<String> = link.split('/').map(str::to_owned).collect();
        dir.pop();
        let mut todo: VecDeque<String> = target.split('/').map(str::to_owned).collect();
        let mut hops = 0usize;
        while let Some(c) = todo.pop_front() {
            match c.as_str() {
                "" | "." => {}
                ".." => {
                    if dir.pop().is_none() {
                        return Err(LinkError::Escapes(target.to_owned()));
                    }
                }
                name => {
                    dir.push(name.to_owned());
                    let here = dir.join("/");
                    if let Node::Link(t) = self.node(&here) {
                        hops += 1;
                        if hops > MAX_HOPS {
                            return Err(LinkError::TooManyHops(target.to_owned()));
                        }
                        if t.starts_with('/') {
                            return Err(LinkError::EscapesThrough {
                                target: target.to_owned(),
                                here,
                                to: t.clone(),
                            });
                        }
                        dir.pop();
                        for part in t.split('/').rev() {
                            todo.push_front(part.to_owned());
                        }
                    }
                }
            }
        }
        Ok(())
    }

    /// Every parent of `rel` must end up a directory: refused when the apply itself puts a
    /// symlink or a file at one (the write would go through the link, or fail half-way).
    pub fn check_parents(&self, rel: &str) -> Result<(), LinkError> {
        for a in super::ancestors(rel).take_while(|a| *a != rel) {
            match self.planned.get(a) {
                Some(Planned::Symlink(_)) => {
                    return Err(LinkError::ParentSymlink(a.to_owned()));
                }
                Some(Planned::File) => {
                    return Err(LinkError::ParentFile(a.to_owned()));
                }
                _ => {}
            }
        }
        Ok(())
    }
}

/// Why a planned symlink or write is refused (the text goes into the apply's `refused` list).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum LinkError {
    #[error("symlink with an empty target")]
    EmptyTarget,
    #[error("symlink target with a NUL byte or over 4095 bytes")]
    BadTarget,
    #[error("symlink to `{0}` points outside the repo (absolute target)")]
    Absolute(String),
    #[error("symlink to `{0}` escapes the repo")]
    Escapes(String),
    #[error("symlink to `{0}` follows more than {MAX_HOPS} links")]
    TooManyHops(String),
    #[error("symlink to `{target}` escapes the repo through `{here}` -> `{to}`")]
    EscapesThrough {
        target: String,
        here: String,
        to: String,
    },
    #[error("parent `{0}` is a symlink this apply would create")]
    ParentSymlink(String),
    #[error("parent `{0}` is a file this apply would write")]
    ParentFile(String),
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::symlink;

    fn link(p: &str, t: &str) -> (String, Planned) {
        (p.into(), Planned::Symlink(t.into()))
    }

    #[test]
    fn lexically_fine_links_that_climb_out_through_other_links_are_refused() {
        let d = tempfile::tempdir().unwrap();
        std::fs::create_dir(d.path().join("d")).unwrap();
        // The pair: `d/l -> ..` is the root (fine), `d/m -> l/../..` is above it.
        let a = After::new(d.path(), [link("d/l", ".."), link("d/m", "l/../..")]);
        assert!(a.check_link("d/l", "..").is_ok());
        let e = a.check_link("d/m", "l/../..").unwrap_err();
        assert!(e.to_string().contains("escapes the repo"), "{e}");
        // Through a chain of new links, and through a link the host already has.
        let a = After::new(
            d.path(),
            [link("a", "b"), link("b", "d/../c"), link("c", "..")],
        );
        assert!(a.check_link("x/y", "../a").is_err());
        symlink("/etc", d.path().join("hostlink")).unwrap();
        let a = After::new(d.path(), [link("d/n", "../hostlink/passwd")]);
        let e = a.check_link("d/n", "../hostlink/passwd").unwrap_err();
        assert!(e.to_string().contains("hostlink"), "{e}");
        // A host link the apply deletes is not followed; one it replaces by a file neither.
        let a = After::new(
            d.path(),
            [
                ("hostlink".to_string(), Planned::Absent),
                link("d/n", "../hostlink/passwd"),
            ],
        );
        assert!(a.check_link("d/n", "../hostlink/passwd").is_ok());
    }

    #[test]
    fn loops_hit_the_hop_limit_and_plain_links_pass() {
        let d = tempfile::tempdir().unwrap();
        let a = After::new(d.path(), [link("a", "b"), link("b", "a")]);
        let e = a.check_link("a", "b").unwrap_err();
        assert!(e.to_string().contains("more than 40 links"), "{e}");
        let a = After::new(d.path(), [link("s/t", "../u/v")]);
        assert!(a.check_link("s/t", "../u/v").is_ok());
        assert!(a.check_link("s/t", "./x/../../y").is_ok());
        assert!(a.check_link("t", "../x").is_err());
        assert!(a.check_link("t", "/etc/passwd").is_err());
        assert!(a.check_link("t", "").is_err());
        assert!(a.check_link("t", "a\0b").is_err());
        assert!(a.check_link("t", &"a/".repeat(3000)).is_err());
    }

    #[test]
    fn a_parent_the_apply_makes_a_link_or_a_file_is_refused() {
        let d = tempfile::tempdir().unwrap();
        let a = After::new(
            d.path(),
            [link("d", "sub"), ("f".to_string(), Planned::File)],
        );
        assert!(
            a.check_parents("d/x")
                .unwrap_err()
                .to_string()
                .contains("symlink")
        );
        assert!(
            a.check_parents("f/x")
                .unwrap_err()
                .to_string()
                .contains("file")
        );
        assert!(a.check_parents("d").is_ok());
        assert!(a.check_parents("sub/x").is_ok());
    }
}
