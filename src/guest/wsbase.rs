//! The guest end of the workspace base disk (`MountBase`): the host wrote an ext4 file system
//! holding the first sync's tree onto a read-only virtio-blk disk; the agent mounts it and puts
//! an overlayfs on the workspace directory with it as the lower layer, so the guest kernel
//! never creates those files one by one (slow under TCG).
//!
//! Owns the mount points [`LOWER`] (the disk, read-only) and [`STATE`] (`upper/` and `work/` of
//! the overlay, on the root disk so that VM-side changes are kept by snapshots like any other
//! file). Never touches a workspace that has content: it refuses, and the host falls back to
//! unpacking an archive.

use std::os::unix::fs::MetadataExt;
use std::path::Path;

use nix::mount::{MntFlags, MsFlags, mount, umount2};

use super::files::check_path;
use crate::rpc::msg::{ErrorKind, RemoteError};

/// Where the base disk is mounted (read-only).
pub const LOWER: &str = "/run/tryboxi/wsbase";
/// The overlay's upper and work directories live under this directory of the root disk.
pub const STATE: &str = "/var/lib/tryboxi/workspace";

/// The directory `mount_base` put the workspace overlay on, in this agent's life (a snapshot,
/// fork or pause keeps it with the agent's memory and the overlay with the disk).
static MOUNTED: std::sync::Mutex<Option<std::path::PathBuf>> = std::sync::Mutex::new(None);

/// The overlay's upper directory when `root` is the workspace overlay `mount_base` made: a
/// file under `root` with no entry there is still the base disk's, as the host wrote it.
pub fn overlay_upper(root: &Path) -> Option<std::path::PathBuf> {
    let m = MOUNTED.lock().unwrap_or_else(|p| p.into_inner());
    (m.as_deref() == Some(root)).then(|| Path::new(STATE).join("upper"))
}

fn refused(msg: String) -> RemoteError {
    RemoteError::new(ErrorKind::InvalidRequest, msg)
}

fn sys(what: &str, e: nix::Error) -> RemoteError {
    RemoteError::from_io(what, &std::io::Error::from(e))
}

/// Whether `dir` is a mount point (another device than its parent's).
fn is_mount(dir: &Path) -> bool {
    let parent = dir.parent().unwrap_or(Path::new("/"));
    match (std::fs::metadata(dir), std::fs::metadata(parent)) {
        (Ok(a), Ok(b)) => a.dev() != b.dev() || a.ino() == b.ino(),
        _ => false,
    }
}

/// `MountBase`: see the module doc and `rpc::msg::Request::MountBase`.
pub fn mount_base(dir: &str, serial: &str) -> Result<(), RemoteError> {
    let root = check_path(dir)?;
    std::fs::create_dir_all(&root)
        .map_err(|e| RemoteError::from_io(&format!("mkdir {}", root.display()), &e))?;
    if is_mount(&root) {
        return Err(refused(format!("{} is already a mount", root.display())));
    }
    let mut rd = std::fs::read_dir(&root)
        .map_err(|e| RemoteError::from_io(&format!("list {}", root.display()), &e))?;
    if rd.next().is_some() {
        return Err(refused(format!(
            "{} is not empty: its content would be hidden",
            root.display()
        )));
    }
    let dev = super::tree::disk_by_serial(serial)?;
    {
        let ctx = |e: std::io::Error| RemoteError::from_io(&format!("open {}", dev.display()), &e);
        let f = std::fs::File::open(&dev).map_err(ctx)?;
        // The kernel read the (then empty) disk at boot; the host has written it since.
        // SAFETY: BLKFLSBUF takes no argument; `f` is an open block device for the whole call.
        unsafe { super::tree::blkflsbuf(std::os::fd::AsRawFd::as_raw_fd(&f)) }
            .map_err(|e| ctx(std::io::Error::from(e)))?;
    }
    let upper = Path::new(STATE).join("upper");
    if std::fs::read_dir(&upper).is_ok_and(|mut r| r.next().is_some()) {
        return Err(refused(format!("{} is not empty", upper.display())));
    }
    mount_overlay(&root, &dev)?;
    // A cold boot on this disk (a filesystem-only pause, a reboot) mounts it again from here.
    let marker = Marker {
        dir: dir.to_owned(),
        serial: serial.to_owned(),
    };
    if let Err(e) = marker.write() {
        let _ = umount2(&root, MntFlags::MNT_DETACH);
        let _ = umount2(LOWER, MntFlags::MNT_DETACH);
        return Err(e);
    }
    *MOUNTED.lock().unwrap_or_else(|p| p.into_inner()) = Some(root);
    Ok(())
}

/// The base disk (read-only on [`LOWER`]) and the overlay on `root` with the upper and work
/// directories under [`STATE`] (made if missing; an upper directory with content is what a
/// remount after a cold boot finds).
fn mount_overlay(root: &Path, dev: &Path) -> Result<(), RemoteError> {
    let upper = Path::new(STATE).join("upper");
    let work = Path::new(STATE).join("work");
    for d in [Path::new(LOWER), &upper, &work] {
        std::fs::create_dir_all(d)
            .map_err(|e| RemoteError::from_io(&format!("mkdir {}", d.display()), &e))?;
    }
    let ro = MsFlags::MS_RDONLY | MsFlags::MS_NOSUID | MsFlags::MS_NODEV;
    mount(Some(dev), LOWER, Some("ext4"), ro, None::<&str>)
        .map_err(|e| sys(&format!("mount {} on {LOWER}", dev.display()), e))?;
    let opts = format!(
        "lowerdir={LOWER},upperdir={},workdir={}",
        upper.display(),
        work.display()
    );
    // redirect_dir lets the VM rename directories that came from the disk (else EXDEV, and
    // `mv` falls back to copying).
    let with_redirect = format!("{opts},redirect_dir=on");
    let r = mount(
        Some("overlay"),
        root,
        Some("overlay"),
        MsFlags::empty(),
        Some(with_redirect.as_str()),
    )
    .or_else(|_| {
        mount(
            Some("overlay"),
            root,
            Some("overlay"),
            MsFlags::empty(),
            Some(opts.as_str()),
        )
    });
    if let Err(e) = r {
        let _ = umount2(LOWER, MntFlags::MNT_DETACH);
        return Err(sys(&format!("mount overlay on {}", root.display()), e));
    }
    Ok(())
}

/// Where [`mount_base`] notes what it mounted, on the root disk beside the overlay's state.
const MARKER: &str = "/var/lib/tryboxi/workspace/mount";

/// What [`mount_base`] mounted: the workspace directory and the base disk's serial, one per
/// line (both checked again when read).
#[derive(Debug, PartialEq, Eq)]
struct Marker {
    dir: String,
    serial: String,
}

impl Marker {
    fn write(&self) -> Result<(), RemoteError> {
        use std::io::Write;
        let tmp = format!("{MARKER}.tmp");
        let ctx = |e: std::io::Error| RemoteError::from_io(&format!("write {MARKER}"), &e);
        let mut f = std::fs::File::create(&tmp).map_err(ctx)?;
        f.write_all(self.to_text().as_bytes()).map_err(ctx)?;
        f.sync_all().map_err(ctx)?;
        std::fs::rename(&tmp, MARKER).map_err(ctx)
    }

    fn to_text(&self) -> String {
        format!("{}\n{}\n", self.dir, self.serial)
    }

    /// `None` for anything but two non-empty lines of at most 4 KiB each.
    fn parse(text: &str) -> Option<Marker> {
        let mut lines = text.lines();
        let (dir, serial) = (lines.next()?, lines.next()?);
        let ok = |s: &str| !s.is_empty() && s.len() <= 4096;
        (ok(dir) && ok(serial) && lines.next().is_none()).then(|| Marker {
            dir: dir.to_owned(),
            serial: serial.to_owned(),
        })
    }
}

/// At boot (init, after the root disk is mounted): when this disk's workspace was an overlay
/// on the base disk (a marker left by [`mount_base`]), mount it again, so that a VM booted
/// afresh on a sandbox's disk (a filesystem-only pause, a reboot) sees its workspace as it
/// left it. `Ok(false)`: there was nothing to mount. An error leaves the workspace unmounted
/// and must stop the boot: the workspace would look empty, and a diff would report every
/// file deleted.
pub fn remount_after_boot() -> Result<bool, RemoteError> {
    // Two lines of at most 4 KiB each: read no more than that (and a byte to see it is over).
    let mut text = String::new();
    match std::fs::File::open(MARKER) {
        Ok(f) => {
            use std::io::Read;
            f.take(2 * 4097 + 1)
                .read_to_string(&mut text)
                .map_err(|e| RemoteError::from_io(&format!("read {MARKER}"), &e))?;
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(false),
        Err(e) => return Err(RemoteError::from_io(&format!("read {MARKER}"), &e)),
    }
    let m = Marker::parse(&text)
        .ok_or_else(|| refused(format!("{MARKER} is not a workspace mount note")))?;
    let root = check_path(&m.dir)?;
    std::fs::create_dir_all(&root)
        .map_err(|e| RemoteError::from_io(&format!("mkdir {}", root.display()), &e))?;
    // The disks appear as the kernel probes them; the root disk is there, this one may lag.
    let t0 = std::time::Instant::now();
    let dev = loop {
        match super::tree::disk_by_serial(&m.serial) {
            Ok(d) => break d,
            Err(e) if t0.elapsed() > std::time::Duration::from_secs(10) => return Err(e),
            Err(_) => std::thread::sleep(std::time::Duration::from_millis(10)),
        }
    };
    mount_overlay(&root, &dev)?;
    *MOUNTED.lock().unwrap_or_else(|p| p.into_inner()) = Some(root);
    Ok(true)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_mount_note_reads_back_what_was_written_and_nothing_else() {
        let m = Marker {
            dir: "/workspace".into(),
            serial: "tryboxi-wsbase".into(),
        };
        assert_eq!(Marker::parse(&m.to_text()), Some(m));
        for bad in [
            "",
            "/workspace\n",
            "/workspace\n\n",
            "\nserial\n",
            "/workspace\nserial\nextra\n",
        ] {
            assert_eq!(Marker::parse(bad), None, "{bad:?}");
        }
        let long = format!("/{}\nserial\n", "a".repeat(5000));
        assert_eq!(Marker::parse(&long), None);
    }
}
