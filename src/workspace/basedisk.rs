//! The host side of the workspace base disk: the first big sync of a sandbox goes into the VM
//! as an ext4 image built natively on the host (`mke2fs -d`), which the guest mounts read-only
//! under an overlayfs on `/workspace`, instead of an archive the guest kernel unpacks file by
//! file (slow when the guest runs under TCG).
//!
//! Owns: staging (the sync's archive — the exact bytes, modes, mtimes and symlinks the normal
//! path would send, secrets and ignored paths already left out — unpacked into a temporary
//! directory) and writing the image into the VM's `wsbase.img` in place (QEMU has it open).
//! Never touches the host repo; the staging directory is a temporary directory the caller owns.

use crate::oom::ResetOomScore as _;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use super::WorkspaceError;

/// Why the base disk cannot be used (the caller logs it and falls back to the archive).
#[derive(Debug, thiserror::Error)]
pub enum BaseDiskError {
    #[error("the base disk {0} is missing, shared or already written")]
    NotBlank(PathBuf),
    #[error("`{0}` was not found (install e2fsprogs)")]
    NoTool(&'static str),
    #[error("{tool} failed ({status}): {stderr}")]
    Tool {
        tool: &'static str,
        status: String,
        stderr: String,
    },
    #[error(transparent)]
    Workspace(#[from] WorkspaceError),
}

/// Whether `img` is a VM's own, never written base disk: a regular file (not a symlink to a
/// parent's disk) with no block allocated.
pub fn is_blank(img: &Path) -> bool {
    std::fs::symlink_metadata(img).is_ok_and(|m| m.file_type().is_file() && m.blocks() == 0)
}

/// Where to stage an archive of `len` bytes: a tmpfs (`/dev/shm`) when it is one and has room
/// for it four times over (staging holds the files only until `mke2fs` has read them, and
/// creating thousands of files on a disk file system can take seconds of kernel time: measured
/// 16 s vs 0.6 s for 10,000 files / 100 MB on this host's ext4), else `fallback` (the
/// sandbox's directory). Archives over 2 GiB always go to `fallback`.
pub fn staging_parent(len: u64, fallback: &Path) -> PathBuf {
    let shm = Path::new("/dev/shm");
    let roomy = nix::sys::statfs::statfs(shm).is_ok_and(|fs| {
        fs.filesystem_type() == nix::sys::statfs::TMPFS_MAGIC
            && nix::sys::statvfs::statvfs(shm).is_ok_and(|v| {
                v.blocks_available().saturating_mul(v.fragment_size()) >= len.saturating_mul(4)
            })
    });
    if roomy && len <= 2 << 30 {
        shm.to_owned()
    } else {
        fallback.to_owned()
    }
}

/// Unpack `archive` (a sync archive of `sync::compute_keeping`) into the empty directory `dir`
/// with the modes and mtimes of its headers, as the guest agent would: the same result as
/// `tar::Archive::unpack`, with the files written by several threads (10,000 files / 100 MB:
/// ~130 ms on one thread, the largest part of a first sync after `mke2fs`).
///
/// Two passes over the archive's headers (file data is skipped by seeking): every directory
/// created plainly, and the files and symlinks split between the threads; then the directories'
/// modes, children before parents, as `Archive::unpack` applies them last (a read-only directory
/// would refuse its files).
pub fn stage(archive: &[u8], dir: &Path) -> Result<(), WorkspaceError> {
    let io = |e: std::io::Error| WorkspaceError::io("unpack the sync archive into", dir)(e);
    let dst = dir.canonicalize().map_err(io)?;
    let open = || {
        let mut ar = tar::Archive::new(std::io::Cursor::new(archive));
        ar.set_preserve_permissions(true);
        ar.set_preserve_mtime(true);
        ar.set_overwrite(true);
        ar
    };
    let mut ar = open();
    let mut dirs = Vec::new();
    let mut others = 0usize;
    for e in ar.entries_with_seek().map_err(io)? {
        let e = e.map_err(io)?;
        if e.header().entry_type() != tar::EntryType::Directory {
            others += 1;
            continue;
        }
        let rel = e.path().map_err(io)?;
        if !rel
            .components()
            .all(|c| matches!(c, std::path::Component::Normal(_)))
        {
            return Err(io(std::io::Error::other(format!(
                "unsafe path {} in the archive",
                rel.display()
            ))));
        }
        std::fs::create_dir_all(dst.join(&rel)).map_err(io)?;
        dirs.push(e);
    }
    let threads = if others < 256 {
        1
    } else {
        std::thread::available_parallelism().map_or(1, |n| n.get().clamp(1, 4))
    };
    std::thread::scope(|s| {
        let workers: Vec<_> = (0..threads)
            .map(|t| {
                let dst = &dst;
                s.spawn(move || -> std::io::Result<()> {
                    let mut ar = open();
                    let mut i = 0usize;
                    for e in ar.entries_with_seek()? {
                        let mut e = e?;
                        if e.header().entry_type() == tar::EntryType::Directory {
                            continue;
                        }
                        if i % threads == t {
                            e.unpack_in(dst)?;
                        }
                        i += 1;
                    }
                    Ok(())
                })
            })
            .collect();
        workers.into_iter().try_for_each(|w| {
            w.join()
                .unwrap_or_else(|_| Err(std::io::Error::other("a staging thread panicked")))
        })
    })
    .map_err(io)?;
    dirs.sort_by(|a, b| b.path_bytes().cmp(&a.path_bytes()));
    for mut d in dirs {
        d.unpack_in(&dst).map_err(io)?;
    }
    Ok(())
}

/// A tool of e2fsprogs: on `PATH`, else in the sbin directories (a user's `PATH` often lacks
/// them).
fn tool(name: &'static str) -> Result<PathBuf, BaseDiskError> {
    let path = std::env::var_os("PATH").unwrap_or_default();
    std::env::split_paths(&path)
        .chain(["/usr/sbin", "/sbin"].map(PathBuf::from))
        .map(|d| d.join(name))
        .find(|p| p.is_file())
        .ok_or(BaseDiskError::NoTool(name))
}

/// Whether the tools [`build`] runs are installed.
pub fn tools() -> Result<(), BaseDiskError> {
    tool("mke2fs").and(tool("debugfs")).map(|_| ())
}

fn run(tool_name: &'static str, cmd: &mut Command) -> Result<(), BaseDiskError> {
    let out = cmd
        .reset_oom_score()
        .stdin(Stdio::null())
        .output()
        .map_err(|_| BaseDiskError::NoTool(tool_name))?;
    if out.status.success() {
        return Ok(());
    }
    Err(BaseDiskError::Tool {
        tool: tool_name,
        status: out.status.to_string(),
        stderr: String::from_utf8_lossy(&out.stderr).trim().to_owned(),
    })
}

/// Write an ext4 file system holding the tree under `staging` into `img` (a blank base disk,
/// see [`is_blank`]), in place and at the file's size. The files are owned by root in the
/// image (as the agent's unpack would make them): a daemon that is not root runs `mke2fs` in
/// a user namespace where its uid is 0.
pub fn build(staging: &Path, img: &Path) -> Result<(), BaseDiskError> {
    if !is_blank(img) {
        return Err(BaseDiskError::NotBlank(img.to_owned()));
    }
    let mke2fs = tool("mke2fs")?;
    // SAFETY: geteuid has no preconditions and cannot fail.
    let root = unsafe { libc::geteuid() } == 0;
    let mut cmd = if root {
        Command::new(&mke2fs)
    } else {
        let mut c = Command::new("unshare");
        c.arg("--map-root-user").arg(&mke2fs);
        c
    };
    mke2fs_args(&mut cmd, staging, img);
    run("mke2fs", &mut cmd)?;
    finish(img)
}

/// Whether this host's `mke2fs` reads the sync archive itself (`-d` of a tar file: e2fsprogs
/// 1.47.1 or newer, with libarchive), so that [`build_from_tar`] can skip staging (10,000
/// files / 100 MB: ~90 ms of staging saved). False after a tar build failed once in this
/// process (libarchive missing, say): staging works everywhere.
pub fn reads_tar() -> bool {
    static VERSION_OK: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    !TAR_FAILED.load(std::sync::atomic::Ordering::Relaxed)
        && *VERSION_OK.get_or_init(|| {
            let Ok(mke2fs) = tool("mke2fs") else {
                return false;
            };
            Command::new(mke2fs)
                .reset_oom_score()
                .arg("-V")
                .stdin(Stdio::null())
                .output()
                .ok()
                .and_then(|o| e2fsprogs_version(&String::from_utf8_lossy(&o.stderr)))
                .is_some_and(|v| v >= (1, 47, 1))
        })
}

static TAR_FAILED: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// `(major, minor, patch)` from `mke2fs -V`'s first line, `mke2fs 1.47.2 (1-Jan-2025)`.
fn e2fsprogs_version(text: &str) -> Option<(u32, u32, u32)> {
    let word = text.lines().next()?.split_whitespace().nth(1)?;
    let mut it = word.split('.').map(|n| n.parse::<u32>().ok());
    Some((it.next()??, it.next()??, it.next().flatten().unwrap_or(0)))
}

/// Like [`build`], from the sync archive itself (see [`reads_tar`]): `mke2fs` reads it from a
/// memory file, or from an unnamed file in `spill` (the sandbox's directory) when the archive
/// is too big to hold in memory twice (the rule of [`staging_parent`]). Owners come from the archive's headers (root), so no user namespace is
/// needed. On failure the disk is made blank again (holes punched) for [`build`], and
/// [`reads_tar`] answers false from then on.
pub fn build_from_tar(archive: &[u8], img: &Path, spill: &Path) -> Result<(), BaseDiskError> {
    let res = build_from_tar_once(archive, img, spill);
    // A disk that was not blank says nothing about what `mke2fs` can read.
    if res
        .as_ref()
        .is_err_and(|e| !matches!(e, BaseDiskError::NotBlank(_)))
    {
        TAR_FAILED.store(true, std::sync::atomic::Ordering::Relaxed);
    }
    res
}

/// [`build_from_tar`] without marking `mke2fs` as unable to read archives.
fn build_from_tar_once(archive: &[u8], img: &Path, spill: &Path) -> Result<(), BaseDiskError> {
    let in_memory = staging_parent(archive.len() as u64, spill) == Path::new("/dev/shm");
    build_from_tar_in(
        archive,
        img,
        in_memory.then_some(spill).map_or(Some(spill), |_| None),
    )
}

/// The build of [`build_from_tar`]: the archive in a memory file (`spill` `None`) or an unnamed
/// file in `spill`.
fn build_from_tar_in(
    archive: &[u8],
    img: &Path,
    spill: Option<&Path>,
) -> Result<(), BaseDiskError> {
    if !is_blank(img) {
        return Err(BaseDiskError::NotBlank(img.to_owned()));
    }
    let mke2fs = tool("mke2fs")?;
    let io = |what: &'static str| {
        move |e: std::io::Error| BaseDiskError::Workspace(WorkspaceError::io(what, img)(e))
    };
    let mut f = if let Some(dir) = spill {
        tempfile::tempfile_in(dir).map_err(io("create a file for the archive of"))?
    } else {
        let mem = nix::sys::memfd::memfd_create(
            c"tryboxi-wsbase-archive",
            nix::sys::memfd::MFdFlags::MFD_CLOEXEC,
        )
        .map_err(|e| io("create a memory file for the archive of")(e.into()))?;
        std::fs::File::from(mem)
    };
    std::io::Write::write_all(&mut f, archive).map_err(io("copy the archive of"))?;
    let fd = std::os::fd::AsRawFd::as_raw_fd(&f);
    let mut cmd = Command::new(&mke2fs);
    mke2fs_args(&mut cmd, Path::new(&format!("/dev/fd/{fd}")), img);
    // SAFETY: the closure runs in the child between fork and exec and only calls fcntl(2)
    // (async-signal-safe) on a descriptor the parent keeps open until the child has exited;
    // it clears close-on-exec so that `mke2fs` inherits the memory file.
    unsafe {
        std::os::unix::process::CommandExt::pre_exec(&mut cmd, move || {
            if libc::fcntl(fd, libc::F_SETFD, 0) < 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    let res = run("mke2fs", &mut cmd).and_then(|()| finish(img));
    drop(f);
    if res.is_err() {
        blank(img).map_err(io("punch the failed image out of"))?;
    }
    res
}

/// The `mke2fs` arguments of both builds. No journal and no metadata checksums: the guest
/// mounts the image read-only and it is rebuilt from the host tree, never repaired (the
/// checksums cost ~120 ms of ~340 for 10,000 files / 100 MB on a 16 GiB image).
fn mke2fs_args(cmd: &mut Command, source: &Path, img: &Path) {
    cmd.args(["-q", "-F", "-t", "ext4", "-m", "0", "-L", "workspace"])
        .args(["-O", "^has_journal,^resize_inode,^metadata_csum"])
        .args(["-E", "nodiscard,lazy_itable_init=1,root_owner=0:0"])
        .arg("-d")
        .arg(source)
        .arg(img);
}

/// After `mke2fs`: no `lost+found` (it would show in the workspace), and write-back started.
fn finish(img: &Path) -> Result<(), BaseDiskError> {
    run(
        "debugfs",
        Command::new(tool("debugfs")?)
            .args(["-w", "-R", "rmdir lost+found"])
            .arg(img),
    )?;
    // Write-back starts now, while the guest mounts the image, rather than by the kernel's
    // flusher up to 30 s later in the middle of the first execs and syncs (measured: a one-file
    // delta sync of the 10,000-file bench tree took ~95 ms while ~100 MB of image were being
    // written back, ~67 ms after). Not waited for: durability is not needed (the image is
    // rebuilt from the host tree), and waiting cost the first sync ~0.6 s.
    start_write_back(img)
        .map_err(|e| BaseDiskError::Workspace(WorkspaceError::io("write back", img)(e)))
}

/// Make a written base disk blank again (see [`is_blank`]): every block deallocated, the size
/// kept (QEMU has the file open and the guest has not mounted it).
fn blank(img: &Path) -> std::io::Result<()> {
    let f = std::fs::OpenOptions::new().write(true).open(img)?;
    let len = f.metadata()?.len();
    nix::fcntl::fallocate(
        &f,
        nix::fcntl::FallocateFlags::FALLOC_FL_PUNCH_HOLE
            | nix::fcntl::FallocateFlags::FALLOC_FL_KEEP_SIZE,
        0,
        len as libc::off_t,
    )
    .map_err(std::io::Error::from)
}

/// Start writing `path`'s dirty pages to disk without waiting for them.
fn start_write_back(path: &Path) -> std::io::Result<()> {
    use std::os::fd::AsRawFd;
    let f = std::fs::File::open(path)?;
    // SAFETY: sync_file_range(2) on a descriptor we own; offset 0 and length 0 mean "to the
    // end of the file"; no memory is passed.
    let r = unsafe { libc::sync_file_range(f.as_raw_fd(), 0, 0, libc::SYNC_FILE_RANGE_WRITE) };
    if r < 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::SyncConfig;
    use crate::workspace::manifest::Base;
    use crate::workspace::rules::{Rules, scan};
    use crate::workspace::sync;
    use std::os::unix::fs::PermissionsExt;

    fn write(root: &Path, rel: &str, data: &[u8]) {
        let p = root.join(rel);
        std::fs::create_dir_all(p.parent().unwrap()).unwrap();
        std::fs::write(p, data).unwrap();
    }

    /// A repo with a secret, an ignored file, an executable, a symlink and `.git/config`.
    fn repo() -> tempfile::TempDir {
        let repo = tempfile::tempdir().unwrap();
        let r = repo.path();
        write(r, "src/main.rs", b"fn main() {}\n");
        write(r, "bin/run.sh", b"#!/bin/sh\necho hi\n");
        std::fs::set_permissions(r.join("bin/run.sh"), std::fs::Permissions::from_mode(0o755))
            .unwrap();
        write(r, ".env", b"TOKEN=secret\n");
        write(r, "keys/server.pem", b"-----BEGIN-----\n");
        write(r, ".gitignore", b"target/\n");
        write(r, "target/debug/app", b"binary");
        write(
            r,
            ".git/config",
            b"[core]\n\tbare = false\n[credential]\n\thelper = store\n",
        );
        std::os::unix::fs::symlink("src/main.rs", r.join("link")).unwrap();
        repo
    }

    fn staged() -> (tempfile::TempDir, tempfile::TempDir, sync::Delta) {
        let repo = repo();
        let data = tempfile::tempdir().unwrap();
        let rules = Rules::new(&SyncConfig::default()).unwrap();
        let s = scan(repo.path(), &rules).unwrap();
        let d = sync::compute(repo.path(), &s, &Base::new(data.path().join("ws"))).unwrap();
        let out = tempfile::tempdir().unwrap();
        stage(&d.archive, out.path()).unwrap();
        (repo, out, d)
    }

    #[test]
    fn staging_holds_exactly_what_the_sync_sends() {
        let (repo, out, d) = staged();
        let o = out.path();
        assert_eq!(
            std::fs::read(o.join("src/main.rs")).unwrap(),
            b"fn main() {}\n"
        );
        // Secrets and ignored paths never reach the staging directory.
        assert!(!o.join(".env").exists());
        assert!(!o.join("keys/server.pem").exists());
        assert!(!o.join("target").exists());
        // Modes, symlinks and the sanitized .git/config, as the manifest records them.
        let md = std::fs::metadata(o.join("bin/run.sh")).unwrap();
        assert_eq!(md.mode() & 0o7777, 0o755);
        assert_eq!(
            std::fs::read_link(o.join("link")).unwrap(),
            Path::new("src/main.rs")
        );
        let cfg = std::fs::read_to_string(o.join(".git/config")).unwrap();
        assert!(cfg.contains("bare = false") && !cfg.contains("helper"));
        // Every file of the manifest is there with the guest stat it records.
        for (rel, e) in &d.manifest.entries {
            let md = std::fs::symlink_metadata(o.join(rel)).unwrap();
            assert_eq!(md.mode() & 0o7777, e.mode, "{rel}");
            if e.kind == crate::workspace::manifest::Kind::File {
                assert_eq!(md.len(), e.guest_size, "{rel}");
                assert_eq!(md.mtime(), e.guest_mtime, "{rel}");
                assert_eq!(md.mtime_nsec() as u32, e.guest_nsec, "{rel}");
            }
        }
        drop(repo);
    }

    /// The threaded staging leaves exactly what `tar::Archive::unpack` leaves: contents, modes
    /// (a read-only directory too), file mtimes, symlinks; with enough files for threads.
    #[test]
    fn staging_equals_a_plain_unpack() {
        let repo = repo();
        let r = repo.path();
        for i in 0..600 {
            write(
                r,
                &format!("many/d{}/f{i}.txt", i % 7),
                format!("{i}\n").as_bytes(),
            );
        }
        write(r, "ro/inside.txt", b"x\n");
        std::fs::set_permissions(r.join("ro"), std::fs::Permissions::from_mode(0o555)).unwrap();
        std::os::unix::fs::symlink("../src/main.rs", r.join("many/d1/up")).unwrap();
        let data = tempfile::tempdir().unwrap();
        let rules = Rules::new(&SyncConfig::default()).unwrap();
        let s = scan(r, &rules).unwrap();
        let d = sync::compute(r, &s, &Base::new(data.path().join("ws"))).unwrap();
        let (ours, plain) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
        stage(&d.archive, ours.path()).unwrap();
        let mut ar = tar::Archive::new(&d.archive[..]);
        ar.set_preserve_permissions(true);
        ar.set_preserve_mtime(true);
        ar.set_overwrite(true);
        ar.unpack(plain.path()).unwrap();
        let (a, b) = (tree(ours.path()), tree(plain.path()));
        assert!(a.len() > 600, "{}", a.len());
        assert_eq!(a, b);
        for t in [ours.path(), plain.path()] {
            std::fs::set_permissions(t.join("ro"), std::fs::Permissions::from_mode(0o755)).unwrap();
        }
        std::fs::set_permissions(r.join("ro"), std::fs::Permissions::from_mode(0o755)).unwrap();
    }

    /// Every entry under `root`: path, mode, content or symlink target, mtime (files).
    fn tree(root: &Path) -> Vec<(PathBuf, u32, Vec<u8>, i64)> {
        let mut out = Vec::new();
        for p in walkdir(root) {
            let md = std::fs::symlink_metadata(&p).unwrap();
            let rel = p.strip_prefix(root).unwrap().to_owned();
            let (content, mtime) = if md.file_type().is_symlink() {
                let t = std::fs::read_link(&p).unwrap();
                (t.into_os_string().into_encoded_bytes(), 0)
            } else if md.is_file() {
                (std::fs::read(&p).unwrap(), md.mtime())
            } else {
                (Vec::new(), 0)
            };
            out.push((rel, md.mode(), content, mtime));
        }
        out.sort();
        out
    }

    fn walkdir(root: &Path) -> Vec<PathBuf> {
        let mut out = Vec::new();
        let mut todo = vec![root.to_owned()];
        while let Some(d) = todo.pop() {
            for e in std::fs::read_dir(&d).unwrap() {
                let p = e.unwrap().path();
                if std::fs::symlink_metadata(&p).unwrap().is_dir() {
                    todo.push(p.clone());
                }
                out.push(p);
            }
        }
        out
    }

    #[test]
    fn huge_archives_are_staged_next_to_the_sandbox() {
        let dir = Path::new("/data/sandboxes/sbx_1");
        assert_eq!(staging_parent(3 << 30, dir), dir);
        let small = staging_parent(1 << 20, dir);
        assert!(small == dir || small == Path::new("/dev/shm"), "{small:?}");
    }

    #[test]
    fn only_an_own_unwritten_file_is_blank() {
        let d = tempfile::tempdir().unwrap();
        let img = d.path().join("wsbase.img");
        assert!(!is_blank(&img));
        std::fs::File::create(&img)
            .unwrap()
            .set_len(1 << 30)
            .unwrap();
        assert!(is_blank(&img));
        let link = d.path().join("child.img");
        std::os::unix::fs::symlink(&img, &link).unwrap();
        assert!(!is_blank(&link));
        std::fs::write(&img, b"x").unwrap();
        assert!(!is_blank(&img));
    }

    /// Builds a real image when e2fsprogs is installed and reads it back with `debugfs`.
    #[test]
    fn the_image_holds_the_staged_tree_owned_by_root() {
        let (Ok(_), Ok(debugfs)) = (tool("mke2fs"), tool("debugfs")) else {
            eprintln!("e2fsprogs not installed: skipped");
            return;
        };
        let (_repo, out, _d) = staged();
        let dir = tempfile::tempdir().unwrap();
        let img = dir.path().join("wsbase.img");
        std::fs::File::create(&img)
            .unwrap()
            .set_len(64 << 20)
            .unwrap();
        build(out.path(), &img).unwrap();
        assert!(!is_blank(&img));
        // Write-once: a second build is refused.
        assert!(matches!(
            build(out.path(), &img),
            Err(BaseDiskError::NotBlank(_))
        ));
        let q = |req: &str| {
            let o = Command::new(&debugfs)
                .args(["-R", req])
                .arg(&img)
                .output()
                .unwrap();
            String::from_utf8_lossy(&o.stdout).into_owned()
        };
        let ls = q("ls -l /");
        assert!(!ls.contains("lost+found"), "{ls}");
        assert!(ls.contains("src") && ls.contains("link") && !ls.contains(".env"));
        let st = q("stat /bin/run.sh");
        assert!(st.contains("Mode:  0755"), "{st}");
        assert!(st.contains("User:     0   Group:     0"), "{st}");
        assert_eq!(q("cat /src/main.rs"), "fn main() {}\n");
    }

    #[test]
    fn e2fsprogs_versions_are_read_from_mke2fs_v() {
        let v = e2fsprogs_version(
            "mke2fs 1.47.2 (1-Jan-2025)\n\tUsing EXT2FS Library version 1.47.2\n",
        );
        assert_eq!(v, Some((1, 47, 2)));
        assert!(v.unwrap() >= (1, 47, 1));
        assert!(e2fsprogs_version("mke2fs 1.47.0 (5-Feb-2023)").unwrap() < (1, 47, 1));
        assert_eq!(e2fsprogs_version("mke2fs 1.46 (x)"), Some((1, 46, 0)));
        assert_eq!(e2fsprogs_version("mke2fs: command not found"), None);
        assert_eq!(e2fsprogs_version(""), None);
    }

    fn blank_img(dir: &Path) -> PathBuf {
        let img = dir.join("wsbase.img");
        std::fs::File::create(&img)
            .unwrap()
            .set_len(64 << 20)
            .unwrap();
        img
    }

    /// Every entry of an image as `debugfs rdump` gives it back (see [`tree`]).
    fn image_tree(debugfs: &Path, img: &Path) -> Vec<(PathBuf, u32, Vec<u8>, i64)> {
        let out = tempfile::tempdir().unwrap();
        let st = Command::new(debugfs)
            .args(["-R", &format!("rdump / {}", out.path().display())])
            .arg(img)
            .output()
            .unwrap();
        assert!(st.status.success(), "{st:?}");
        tree(out.path())
    }

    /// `debugfs`, when e2fsprogs is installed and its `mke2fs` reads archives (else the test
    /// says why it is skipped).
    fn tar_tools() -> Option<PathBuf> {
        let (Ok(_), Ok(debugfs)) = (tool("mke2fs"), tool("debugfs")) else {
            eprintln!("e2fsprogs not installed: skipped");
            return None;
        };
        if !reads_tar() {
            eprintln!("mke2fs older than 1.47.1 (cannot read a tar): skipped");
            return None;
        }
        Some(debugfs)
    }

    /// Two directories, each with a blank base disk.
    fn two_blank_disks() -> (tempfile::TempDir, tempfile::TempDir, PathBuf, PathBuf) {
        let (a, b) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
        let (img_a, img_b) = (blank_img(a.path()), blank_img(b.path()));
        (a, b, img_a, img_b)
    }

    /// Where `mke2fs` reads archives, the image built from the archive holds exactly what the
    /// image built from the staged archive holds.
    #[test]
    fn the_image_from_the_archive_equals_the_image_from_staging() {
        let Some(debugfs) = tar_tools() else { return };
        let (_repo, out, d) = staged();
        let (_a, b, img_a, img_b) = two_blank_disks();
        build(out.path(), &img_a).unwrap();
        build_from_tar(&d.archive, &img_b, b.path()).unwrap();
        let (ta, tb) = (image_tree(&debugfs, &img_a), image_tree(&debugfs, &img_b));
        assert!(ta.len() >= 6, "{ta:?}");
        assert!(!ta.iter().any(|e| e.0.starts_with("lost+found")), "{ta:?}");
        assert_eq!(ta, tb);
        let stat = |img: &Path| {
            let o = Command::new(&debugfs)
                .args(["-R", "stat /src/main.rs"])
                .arg(img)
                .output()
                .unwrap();
            String::from_utf8_lossy(&o.stdout).into_owned()
        };
        assert!(stat(&img_b).contains("User:     0   Group:     0"));
        // Write-once, as `build`.
        assert!(matches!(
            build_from_tar(&d.archive, &img_b, b.path()),
            Err(BaseDiskError::NotBlank(_))
        ));
    }

    /// An archive too big for memory goes to `mke2fs` through an unnamed file next to the
    /// disk: the same image.
    #[test]
    fn a_spilled_archive_builds_the_same_image() {
        let Some(debugfs) = tar_tools() else { return };
        let (_repo, _out, d) = staged();
        let (_a, b, img_a, img_b) = two_blank_disks();
        build_from_tar_in(&d.archive, &img_a, None).unwrap();
        build_from_tar_in(&d.archive, &img_b, Some(b.path())).unwrap();
        let ta = image_tree(&debugfs, &img_a);
        assert!(ta.len() >= 6, "{ta:?}");
        assert_eq!(ta, image_tree(&debugfs, &img_b));
        // Nothing named is left next to the disk.
        let names: Vec<_> = std::fs::read_dir(b.path())
            .unwrap()
            .flatten()
            .map(|e| e.file_name())
            .collect();
        assert_eq!(names, vec![std::ffi::OsString::from("wsbase.img")]);
    }

    /// A build from an archive `mke2fs` cannot read fails and leaves the disk blank again, so
    /// the staged build can still use it.
    #[test]
    fn a_failed_archive_build_leaves_the_disk_blank() {
        if tool("mke2fs").is_err() {
            eprintln!("e2fsprogs not installed: skipped");
            return;
        }
        let dir = tempfile::tempdir().unwrap();
        let img = blank_img(dir.path());
        let garbage = vec![0x5au8; 64 << 10];
        assert!(build_from_tar_once(&garbage, &img, dir.path()).is_err());
        assert!(
            is_blank(&img),
            "{:?}",
            std::fs::metadata(&img).unwrap().blocks()
        );
        assert_eq!(std::fs::metadata(&img).unwrap().len(), 64 << 20);
        let (_repo, out, _d) = staged();
        build(out.path(), &img).unwrap();
    }
}
