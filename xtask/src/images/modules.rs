//! The modules a packaged kernel needs in the initramfs: the names in
//! `guest-image/kernel/packaged-modules`, found in the extracted package's
//! `lib/modules/<release>/`, plus their dependencies (each module's own `depends=` in its
//! `.modinfo`), written flat into one directory with `tryboxi.order` listing them dependencies
//! first. The guest agent loads that list in order (`src/guest/modules.rs`).
//!
//! A wanted name built into the kernel (`modules.builtin`) is skipped; a name that is neither
//! built in nor in the package fails the build. `.ko.xz` files are decompressed here (`xz`), so
//! the guest does no decompression.

use anyhow::{Context, Result, bail};
use std::collections::{BTreeMap, HashSet};
use std::path::{Path, PathBuf};
use std::process::Command;

/// The load-order file the guest reads (relative to its `/lib/modules`).
pub const ORDER_FILE: &str = "tryboxi.order";

pub fn list_path() -> PathBuf {
    crate::util::repo_root().join("guest-image/kernel/packaged-modules")
}

/// The wanted module names of the list file (comments and blank lines dropped).
pub fn wanted(list: &str) -> Vec<String> {
    list.lines()
        .map(|l| l.split('#').next().unwrap_or("").trim())
        .filter(|l| !l.is_empty())
        .map(normalize)
        .collect()
}

fn normalize(name: &str) -> String {
    name.replace('-', "_")
}

/// `depends=a,b` from a module's `.modinfo` strings (NUL separated, anywhere in the file).
pub fn depends_of(ko: &[u8]) -> Vec<String> {
    ko.split(|b| *b == 0)
        .find_map(|s| s.strip_prefix(b"depends="))
        .map(|d| {
            String::from_utf8_lossy(d)
                .split(',')
                .filter(|s| !s.is_empty())
                .map(normalize)
                .collect()
        })
        .unwrap_or_default()
}

/// Orders `wanted` and everything they depend on, dependencies first (depth-first, in the
/// order of the list). `deps` maps a module name to its dependencies; a name absent from it
/// and not in `builtin` is an error.
pub fn load_order(
    wanted: &[String],
    deps: &BTreeMap<String, Vec<String>>,
    builtin: &HashSet<String>,
) -> Result<Vec<String>> {
    fn visit(
        name: &str,
        deps: &BTreeMap<String, Vec<String>>,
        builtin: &HashSet<String>,
        seen: &mut HashSet<String>,
        out: &mut Vec<String>,
    ) -> Result<()> {
        if builtin.contains(name) || !seen.insert(name.to_owned()) {
            return Ok(());
        }
        let Some(ds) = deps.get(name) else {
            bail!("module {name} is neither built into the packaged kernel nor in its package");
        };
        for d in ds {
            visit(d, deps, builtin, seen, out)?;
        }
        out.push(name.to_owned());
        Ok(())
    }
    let (mut seen, mut out) = (HashSet::new(), Vec::new());
    for w in wanted {
        visit(w, deps, builtin, &mut seen, &mut out)?;
    }
    Ok(out)
}

/// Reads a module file, decompressing `.ko.xz`.
fn read_ko(path: &Path) -> Result<Vec<u8>> {
    if path.extension().is_some_and(|e| e == "xz") {
        let out = Command::new("xz")
            .arg("-dc")
            .arg(path)
            .output()
            .context("running xz -dc")?;
        if !out.status.success() {
            bail!("xz -dc {} failed", path.display());
        }
        Ok(out.stdout)
    } else {
        std::fs::read(path).with_context(|| format!("reading {}", path.display()))
    }
}

/// Writes the modules `list` asks for from `moddir` (`<pkg>/lib/modules/<release>`) into
/// `dest` (flat, `<name>.ko`) with `tryboxi.order`; returns the ordered names.
pub fn collect(moddir: &Path, list: &str, dest: &Path) -> Result<Vec<String>> {
    let mut files = BTreeMap::new();
    let mut stack = vec![moddir.join("kernel")];
    while let Some(dir) = stack.pop() {
        for e in std::fs::read_dir(&dir).with_context(|| format!("reading {}", dir.display()))? {
            let p = e?.path();
            if p.is_dir() {
                stack.push(p);
                continue;
            }
            let name = p.file_name().unwrap_or_default().to_string_lossy();
            if let Some(stem) = name
                .strip_suffix(".ko.xz")
                .or_else(|| name.strip_suffix(".ko"))
            {
                files.insert(normalize(stem), p.clone());
            }
        }
    }
    let builtin: HashSet<String> = std::fs::read_to_string(moddir.join("modules.builtin"))
        .unwrap_or_default()
        .lines()
        .filter_map(|l| {
            let f = l.rsplit('/').next()?;
            Some(normalize(f.strip_suffix(".ko").unwrap_or(f)))
        })
        .collect();
    // Read (and decompress) only what the closure of the wanted names reaches.
    let mut deps = BTreeMap::new();
    let mut bytes = BTreeMap::new();
    let mut todo = wanted(list);
    while let Some(n) = todo.pop() {
        if deps.contains_key(&n) || builtin.contains(&n) {
            continue;
        }
        let Some(path) = files.get(&n) else { continue };
        let ko = read_ko(path)?;
        let ds = depends_of(&ko);
        todo.extend(ds.iter().cloned());
        deps.insert(n.clone(), ds);
        bytes.insert(n, ko);
    }
    let order = load_order(&wanted(list), &deps, &builtin)?;
    std::fs::create_dir_all(dest)?;
    for n in &order {
        std::fs::write(dest.join(format!("{n}.ko")), &bytes[n])?;
    }
    let text: String = order.iter().map(|n| format!("{n}.ko\n")).collect();
    std::fs::write(dest.join(ORDER_FILE), text)?;
    Ok(order)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn modinfo_depends_are_read() {
        let ko = b"\x7fELF....\0license=GPL\0depends=virtio,virtio_ring\0name=virtio_mmio\0";
        assert_eq!(depends_of(ko), vec!["virtio", "virtio_ring"]);
        assert!(depends_of(b"\0depends=\0name=x\0").is_empty());
        assert!(depends_of(b"no modinfo").is_empty());
    }

    #[test]
    fn dependencies_come_first_builtins_are_skipped_and_missing_fails() {
        let deps: BTreeMap<String, Vec<String>> = [
            ("virtio_blk", vec!["virtio", "virtio_ring"]),
            ("virtio_net", vec!["virtio", "net_failover"]),
            ("net_failover", vec!["failover"]),
            ("failover", vec![]),
            ("virtio_ring", vec![]),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_owned(), v.into_iter().map(String::from).collect()))
        .collect();
        let builtin: HashSet<String> = ["virtio".to_owned()].into();
        let want = wanted("# c\nvirtio_blk\nvirtio-net # the NIC\n\nvirtio\n");
        assert_eq!(
            load_order(&want, &deps, &builtin).unwrap(),
            [
                "virtio_ring",
                "virtio_blk",
                "failover",
                "net_failover",
                "virtio_net"
            ]
        );
        let e = load_order(&["nope".into()], &deps, &builtin).unwrap_err();
        assert!(e.to_string().contains("nope"), "{e}");
    }

    #[test]
    fn shipped_list_names_the_boot_drivers() {
        let want = wanted(&std::fs::read_to_string(list_path()).unwrap());
        for m in [
            "virtio_mmio",
            "virtio_blk",
            "virtio_console",
            "virtio_net",
            "overlay",
        ] {
            assert!(want.iter().any(|w| w == m), "missing {m}");
        }
    }
}
