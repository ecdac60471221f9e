//! The unprivileged user QEMU runs as when the daemon is root: `tryboxi-vm`.
//!
//! Owns: finding or creating that system user (idempotent: looked up first, made with
//! `useradd --system` only when missing; a concurrent creation is fine), and handing QEMU the
//! files and directories it must write (ownership and mode changes, only inside a VM's
//! directory).
//! Never: changes a file outside a VM's directory except to let the VM user read it (group
//! read on a file the daemon owns), and never grants write access to a shared read-only image.

use crate::oom::ResetOomScore as _;
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::Path;

/// Name of the system user (and its group) every QEMU runs as under a root daemon.
pub const VM_USER: &str = "tryboxi-vm";

/// A resolved VM user.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct VmUser {
    pub uid: u32,
    pub gid: u32,
}

/// Look the user up (no side effects).
pub fn lookup() -> Option<VmUser> {
    let u = nix::unistd::User::from_name(VM_USER).ok()??;
    Some(VmUser {
        uid: u.uid.as_raw(),
        gid: u.gid.as_raw(),
    })
}

/// The user, made if missing (`useradd --system`, no home, no login shell, its own group).
pub fn ensure() -> Result<VmUser, String> {
    if let Some(u) = lookup() {
        return Ok(u);
    }
    let out = std::process::Command::new("useradd")
        .reset_oom_score()
        .args([
            "--system",
            "--user-group",
            "--no-create-home",
            "--home-dir",
            "/nonexistent",
            "--shell",
            "/usr/sbin/nologin",
            "--comment",
            "tryboxi VM processes",
            VM_USER,
        ])
        .stdin(std::process::Stdio::null())
        .output();
    // Exit 9: made by someone else meanwhile.
    match out {
        Ok(o) if o.status.success() || o.status.code() == Some(9) => {}
        Ok(o) => {
            return Err(format!(
                "cannot create the system user `{VM_USER}` QEMU runs as: useradd: {}",
                String::from_utf8_lossy(&o.stderr).trim()
            ));
        }
        Err(e) => {
            return Err(format!(
                "cannot create the system user `{VM_USER}` QEMU runs as (useradd: {e}); \
                 create it with `useradd --system --user-group {VM_USER}`"
            ));
        }
    }
    let u = lookup().ok_or_else(|| format!("`{VM_USER}` was created but cannot be looked up"))?;
    tracing::info!(
        user = VM_USER,
        uid = u.uid,
        gid = u.gid,
        "created the user QEMU runs as"
    );
    Ok(u)
}

fn chown(p: &Path, uid: Option<u32>, gid: Option<u32>) -> std::io::Result<()> {
    std::os::unix::fs::lchown(p, uid, gid)
}

/// A directory QEMU creates files in (the VM's directory, a checkpoint's directory): owned by
/// root, group the VM user, mode 1770. QEMU can make files there and change only its own
/// (sticky bit): the daemon's files in it stay the daemon's.
pub fn share_dir(dir: &Path, u: VmUser) -> std::io::Result<()> {
    chown(dir, Some(0), Some(u.gid))?;
    std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o1770))
}

/// A file the daemon made that QEMU writes (an overlay, the VM's own RAM file, the console
/// log, the NIC's socket): owned by the VM user. Missing files are fine (QEMU makes them).
pub fn give(file: &Path, u: VmUser) -> std::io::Result<()> {
    match chown(file, Some(u.uid), Some(u.gid)) {
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        r => r,
    }
}

/// Whether `u` may read `file` by its mode bits (root's read-everything does not count).
pub fn can_read(md: &std::fs::Metadata, u: VmUser) -> bool {
    let m = md.mode();
    (md.uid() == u.uid && m & 0o400 != 0) || (md.gid() == u.gid && m & 0o040 != 0) || m & 0o004 != 0
}

/// A file QEMU only reads (kernel, initramfs, base images, a borrowed RAM file, a frozen
/// layer): fine if the VM user can read it; a root-owned file the VM user cannot read gets the
/// VM user's group with group read (never write). Anything else is an error naming the file.
pub fn let_read(file: &Path, u: VmUser) -> Result<(), String> {
    let md = std::fs::metadata(file).map_err(|e| format!("{}: {e}", file.display()))?;
    if can_read(&md, u) {
        return Ok(());
    }
    if md.uid() == 0 && md.is_file() {
        let real = std::fs::canonicalize(file).map_err(|e| format!("{}: {e}", file.display()))?;
        chown(&real, None, Some(u.gid)).map_err(|e| format!("{}: {e}", real.display()))?;
        let mode = (md.mode() & 0o7777 & !0o020) | 0o040;
        std::fs::set_permissions(&real, std::fs::Permissions::from_mode(mode))
            .map_err(|e| format!("{}: {e}", real.display()))?;
        return Ok(());
    }
    Err(format!(
        "QEMU runs as `{VM_USER}`, which cannot read {} (owner uid {}, mode {:o}): make it \
         readable for that user",
        file.display(),
        md.uid(),
        md.mode() & 0o7777
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn read_access_follows_owner_group_and_other_bits() {
        let t = tempfile::tempdir().expect("tmp");
        let f = t.path().join("f");
        std::fs::write(&f, b"x").expect("write");
        let me = VmUser {
            uid: nix::unistd::geteuid().as_raw(),
            gid: nix::unistd::getegid().as_raw(),
        };
        let other = VmUser {
            uid: 4_000_000,
            gid: 4_000_000,
        };
        for (mode, mine, theirs) in [
            (0o600, true, false),
            (0o644, true, true),
            (0o040, true, false),
            (0o000, false, false),
        ] {
            std::fs::set_permissions(&f, std::fs::Permissions::from_mode(mode)).expect("chmod");
            let md = std::fs::metadata(&f).expect("md");
            assert_eq!(can_read(&md, me), mine, "mode {mode:o}");
            assert_eq!(can_read(&md, other), theirs, "mode {mode:o}");
        }
    }
}
