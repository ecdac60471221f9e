//! The initramfs: a gzip-compressed newc cpio whose `/init` is the static `tryboxi` binary
//! (the guest agent, PID 1), plus the mount points it needs and a `/dev/console` node so PID 1
//! has a console before devtmpfs is mounted. Written from Rust: no root, no mknod.
//!
//! With a packaged kernel, its modules (`lib/modules/*.ko` and the load order the agent reads,
//! see [`super::modules`]) come along.
//!
//! `/init` is the binary without its symbol table (`strip --strip-all` of a copy; the host's
//! binary keeps its symbols, and an address from the guest resolves against it): an initramfs
//! file lives in guest RAM for the VM's whole life, so every byte of it is in every sandbox's
//! memory and is written by every snapshot and copied by every restore and fork. 27.3 ->
//! 23.3 MB at the time of writing.
//!
//! Cache key = sha256(layout version, binary, modules). Deterministic: fixed inode numbers,
//! mtime 0.

use super::cache::{Begin, Cache, Entry};
use crate::util::{Step, recipe_key, sha256_file};
use anyhow::{Context, Result};
use flate2::{Compression, GzBuilder};
use std::io::Write;
use std::path::Path;

/// Bump when the layout below changes.
const LAYOUT_VERSION: &str = "initramfs-2-stripped-init";
pub const FILE: &str = "initramfs.cpio.gz";

const S_IFDIR: u32 = 0o040000;
const S_IFREG: u32 = 0o100000;
const S_IFCHR: u32 = 0o020000;

/// One archive member.
enum Node<'a> {
    Dir,
    File(&'a [u8]),
    /// Character device (major, minor).
    Char(u32, u32),
}

fn layout<'a>(init: &'a [u8], modules: &'a [(String, Vec<u8>)]) -> Vec<(String, u32, Node<'a>)> {
    let mut v: Vec<(String, u32, Node<'a>)> = vec![
        ("dev", 0o755, Node::Dir),
        ("dev/console", 0o600, Node::Char(5, 1)),
        ("proc", 0o555, Node::Dir),
        ("sys", 0o555, Node::Dir),
        ("newroot", 0o755, Node::Dir),
        ("init", 0o755, Node::File(init)),
    ]
    .into_iter()
    .map(|(n, p, node)| (n.to_owned(), p, node))
    .collect();
    if !modules.is_empty() {
        v.push(("lib".into(), 0o755, Node::Dir));
        v.push(("lib/modules".into(), 0o755, Node::Dir));
        for (name, data) in modules {
            v.push((format!("lib/modules/{name}"), 0o644, Node::File(data)));
        }
    }
    v
}

/// The files of a packaged kernel's modules directory, sorted by name.
fn read_modules(dir: Option<&Path>) -> Result<Vec<(String, Vec<u8>)>> {
    let Some(dir) = dir else {
        return Ok(Vec::new());
    };
    let mut out = Vec::new();
    for e in std::fs::read_dir(dir).with_context(|| format!("reading {}", dir.display()))? {
        let p = e?.path();
        let name = p
            .file_name()
            .unwrap_or_default()
            .to_string_lossy()
            .into_owned();
        out.push((name, std::fs::read(&p)?));
    }
    out.sort();
    Ok(out)
}

/// Writes the gzip-compressed newc archive for `init` into `out`.
pub fn write_archive<W: Write>(init: &[u8], modules: &[(String, Vec<u8>)], out: W) -> Result<W> {
    let mut gz = GzBuilder::new().mtime(0).write(out, Compression::best());
    for (ino, (name, perm, node)) in layout(init, modules).into_iter().enumerate() {
        let b = cpio::newc::Builder::new(&name)
            .ino(ino as u32 + 1)
            .uid(0)
            .gid(0)
            .mtime(0);
        let (b, data): (_, &[u8]) = match node {
            Node::Dir => (b.mode(S_IFDIR | perm).nlink(2), &[]),
            Node::File(d) => (b.mode(S_IFREG | perm), d),
            Node::Char(maj, min) => (b.mode(S_IFCHR | perm).rdev_major(maj).rdev_minor(min), &[]),
        };
        let len = u32::try_from(data.len()).context("file too large for a newc archive")?;
        let mut w = b.write(&mut gz, len);
        w.write_all(data)?;
        w.finish()?;
    }
    cpio::newc::trailer(&mut gz)?;
    Ok(gz.finish()?)
}

pub fn build(cache: &Cache, binary: &Path, modules: Option<&Path>) -> Result<Entry> {
    let init = std::fs::read(binary).with_context(|| {
        format!(
            "reading {} (run `cargo xtask dist` first)",
            binary.display()
        )
    })?;
    let mods = read_modules(modules)?;
    let mut parts: Vec<(&str, &[u8])> =
        vec![("layout", LAYOUT_VERSION.as_bytes()), ("init", &init)];
    for (name, data) in &mods {
        parts.push((name.as_str(), data.as_slice()));
    }
    let key = recipe_key(&parts);
    if let Some(e) = cache.lookup("initramfs", &key) {
        println!("==> initramfs: cached (built {})", e.meta.built_at);
        return Ok(e);
    }
    let step = Step::start("initramfs: newc cpio + gzip with /init = tryboxi");
    let pending = match cache.begin("initramfs", &key)? {
        Begin::Build(p) => p,
        Begin::Done(e) => return Ok(e),
    };
    let init = stripped(&init, &pending.dir)?;
    let path = pending.dir.join(FILE);
    let file = std::fs::File::create(&path)?;
    let file = write_archive(&init, &mods, std::io::BufWriter::new(file))?;
    file.into_inner().map_err(|e| e.into_error())?.sync_all()?;
    let sha = sha256_file(&path)?;
    let mut extra = serde_json::Map::new();
    extra.insert("init_sha256".into(), hex::encode(sha2_of(&init)).into());
    extra.insert("modules".into(), mods.len().into());
    let elapsed = step.elapsed();
    let entry = pending.commit(FILE, sha, elapsed, extra)?;
    step.done(&format!("{} bytes", entry.meta.size));
    Ok(entry)
}

/// `binary` without symbols or debug sections (`strip --strip-all`, binutils), by way of two
/// scratch files in `dir`.
fn stripped(binary: &[u8], dir: &Path) -> Result<Vec<u8>> {
    let (full, out) = (dir.join("init.full"), dir.join("init.stripped"));
    std::fs::write(&full, binary)?;
    let st = std::process::Command::new("strip")
        .arg("--strip-all")
        .arg("-o")
        .arg(&out)
        .arg(&full)
        .status()
        .context("running strip (binutils)")?;
    if !st.success() {
        anyhow::bail!("strip --strip-all failed on the guest agent's binary ({st})");
    }
    let s = std::fs::read(&out)?;
    std::fs::remove_file(&full)?;
    std::fs::remove_file(&out)?;
    Ok(s)
}

fn sha2_of(b: &[u8]) -> Vec<u8> {
    use sha2::Digest;
    sha2::Sha256::digest(b).to_vec()
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Read;

    fn unpack(gz: &[u8]) -> Vec<(String, u32, u32, u32, Vec<u8>)> {
        let mut raw = Vec::new();
        flate2::read::GzDecoder::new(gz)
            .read_to_end(&mut raw)
            .unwrap();
        let mut rest: &[u8] = &raw;
        let mut out = Vec::new();
        loop {
            let mut r = cpio::NewcReader::new(rest).unwrap();
            if r.entry().is_trailer() {
                break;
            }
            let e = r.entry();
            let meta = (
                e.name().to_string(),
                e.mode(),
                e.rdev_major(),
                e.rdev_minor(),
            );
            let mut data = Vec::new();
            r.read_to_end(&mut data).unwrap();
            out.push((meta.0, meta.1, meta.2, meta.3, data));
            rest = r.finish().unwrap();
        }
        out
    }

    #[test]
    fn archive_has_init_console_and_mount_points() {
        let init = b"\x7fELF pretend binary";
        let gz = write_archive(init, &[], Vec::new()).unwrap();
        let entries = unpack(&gz);
        let names: Vec<&str> = entries.iter().map(|e| e.0.as_str()).collect();
        assert_eq!(
            names,
            ["dev", "dev/console", "proc", "sys", "newroot", "init"]
        );
        let console = &entries[1];
        assert_eq!(console.1, S_IFCHR | 0o600);
        assert_eq!((console.2, console.3), (5, 1));
        let init_entry = &entries[5];
        assert_eq!(init_entry.1, S_IFREG | 0o755);
        assert_eq!(init_entry.4, init);
        assert_eq!(entries[4].1 & S_IFDIR, S_IFDIR);
    }

    #[test]
    fn modules_go_under_lib_modules_after_init() {
        let mods = vec![
            ("tryboxi.order".to_owned(), b"virtio_mmio.ko\n".to_vec()),
            ("virtio_mmio.ko".to_owned(), b"ko".to_vec()),
        ];
        let gz = write_archive(b"init", &mods, Vec::new()).unwrap();
        let entries = unpack(&gz);
        let names: Vec<&str> = entries.iter().map(|e| e.0.as_str()).collect();
        assert_eq!(
            &names[5..],
            [
                "init",
                "lib",
                "lib/modules",
                "lib/modules/tryboxi.order",
                "lib/modules/virtio_mmio.ko"
            ]
        );
        assert_eq!(entries[8].4, b"virtio_mmio.ko\n");
        // The guest reads the order file at this path.
        assert_eq!(
            format!("/{}", names[8]),
            format!("/lib/modules/{}", super::super::modules::ORDER_FILE)
        );
    }

    #[test]
    fn archive_is_deterministic_and_follows_the_binary() {
        let a = write_archive(b"one", &[], Vec::new()).unwrap();
        assert_eq!(a, write_archive(b"one", &[], Vec::new()).unwrap());
        assert_ne!(a, write_archive(b"two", &[], Vec::new()).unwrap());
    }
}
