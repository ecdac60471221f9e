//! Workspace test helpers: CLI calls that must succeed, shell in the VM, host trees.

use std::collections::BTreeMap;
use std::os::unix::fs::PermissionsExt;
use std::path::Path;

use super::{Daemon, sh};

pub fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

pub fn cli_ok(d: &Daemon, args: &[&str]) -> String {
    let o = d.cli(args);
    assert!(
        o.status.success(),
        "{args:?} failed ({}): {}{}\n{}",
        o.status,
        text(&o.stdout),
        text(&o.stderr),
        d.log_text()
    );
    text(&o.stdout)
}

pub fn sh_ok(d: &Daemon, id: &str, script: &str) -> String {
    let o = sh(d, id, script);
    assert!(
        o.status.success(),
        "`{script}` failed: {}{}",
        text(&o.stdout),
        text(&o.stderr)
    );
    text(&o.stdout)
}

pub fn write(root: &Path, rel: &str, data: &str) {
    let p = root.join(rel);
    std::fs::create_dir_all(p.parent().unwrap()).unwrap();
    std::fs::write(p, data).unwrap();
}

/// Every file/symlink of a tree (outside .git): path -> (mode, bytes or link target).
pub fn tree(root: &Path) -> BTreeMap<String, (u32, Vec<u8>)> {
    let mut out = BTreeMap::new();
    let mut stack = vec![root.to_path_buf()];
    while let Some(dir) = stack.pop() {
        for e in std::fs::read_dir(&dir).unwrap() {
            let e = e.unwrap();
            let p = e.path();
            let rel = p.strip_prefix(root).unwrap().to_string_lossy().into_owned();
            if rel == ".git" {
                continue;
            }
            let md = std::fs::symlink_metadata(&p).unwrap();
            if md.is_dir() {
                stack.push(p);
            } else if md.file_type().is_symlink() {
                let t = std::fs::read_link(&p).unwrap();
                out.insert(rel, (0, t.to_string_lossy().as_bytes().to_vec()));
            } else {
                out.insert(
                    rel,
                    (md.permissions().mode() & 0o7777, std::fs::read(&p).unwrap()),
                );
            }
        }
    }
    out
}

pub struct Rm<'a>(pub &'a Daemon, pub String);
impl Drop for Rm<'_> {
    fn drop(&mut self) {
        let _ = self.0.cli(&["rm", &self.1]);
    }
}
