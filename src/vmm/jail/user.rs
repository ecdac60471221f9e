//! The unprivileged ids QEMU runs as when the daemon is root.
//!
//! Owns: each sandbox's own numeric uid/gid ([`sandbox_ids`]: the base ([`uid_base`], the
//! config key `vm_uid_base`, default [`DEFAULT_UID_BASE`]) + an index, no
//! /etc/passwd entry, persisted in the VM's directory and claimed in a root-only registry so
//! two VM directories never get the same one); the shared read-only group `tryboxi-vm`
//! (finding or creating that system user and group: idempotent, `useradd --system` only when
//! missing), the one supplementary group every QEMU gets, through which it reads the files
//! the daemon lets it read; and handing QEMU the files and directories it must write
//! (ownership and mode changes, only inside a VM's directory).
//! Never: changes a file outside a VM's directory except to let the VM user read it (group
//! read on a file the daemon owns), and never grants write access to a shared read-only image.

use crate::oom::ResetOomScore as _;
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::Path;

/// Name of the system user whose group is the shared read-only group of every QEMU.
pub const VM_USER: &str = "tryboxi-vm";
/// Default first uid (and gid) of the per-sandbox ids: far above any id a distribution hands
/// out (and above the ranges Active Directory id mapping uses by default), below the 2^32-1
/// "no id". Hosts whose directory service hands out ids there set `vm_uid_base`.
pub const DEFAULT_UID_BASE: u32 = 2_000_000_000;
/// How many per-sandbox ids there are.
pub const UID_RANGE: u32 = 1 << 30;
/// The lowest base `vm_uid_base` may name: above the ids of local users, system users and
/// the usual subordinate-id ranges' start.
pub const MIN_UID_BASE: u32 = 1 << 20;

/// The base in use (set once from the configuration at start).
static BASE: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(DEFAULT_UID_BASE);

/// Whether `base` can be the first per-sandbox id: at least [`MIN_UID_BASE`], and its whole
/// range of [`UID_RANGE`] ids below 2^32-1 (`(uid_t)-1` means "no id").
pub fn check_uid_base(base: u32) -> Result<(), String> {
    let top = u64::from(base) + u64::from(UID_RANGE);
    if base < MIN_UID_BASE || top > u64::from(u32::MAX) {
        return Err(format!(
            "vm_uid_base = {base}: must be {MIN_UID_BASE}..={} (its {UID_RANGE} ids must stay              below 4294967295)",
            u32::MAX - UID_RANGE
        ));
    }
    Ok(())
}

/// Use `base` for new claims from now on (checked by [`check_uid_base`]).
pub fn set_uid_base(base: u32) -> Result<(), String> {
    check_uid_base(base)?;
    BASE.store(base, std::sync::atomic::Ordering::Relaxed);
    Ok(())
}

/// The first per-sandbox id in use.
pub fn uid_base() -> u32 {
    BASE.load(std::sync::atomic::Ordering::Relaxed)
}

/// Whether `uid` may be a per-sandbox id under any valid base (a VM directory keeps its id
/// when the base changes later, so a uid file is read by this, not by the current range).
fn any_base_range(uid: u32) -> bool {
    (MIN_UID_BASE..u32::MAX).contains(&uid)
}

/// Whether `uid` belongs to a sandbox: in the current range, or claimed in the registry (a
/// sandbox made under an earlier base).
fn is_sandbox_uid(uid: u32) -> bool {
    let base = uid_base();
    (base..base + UID_RANGE).contains(&uid)
        || (any_base_range(uid) && Path::new(UID_REGISTRY).join(uid.to_string()).is_file())
}
/// The root-only registry of claimed per-sandbox ids: one file per uid holding its VM
/// directory.
pub const UID_REGISTRY: &str = "/var/lib/tryboxi/vm-uids";
/// The file in a VM's directory holding its uid (written by the daemon, owned by root).
pub const UID_FILE: &str = ".vm-uid";

/// A resolved VM user.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct VmUser {
    pub uid: u32,
    pub gid: u32,
}

/// Look the user up (no side effects).
pub fn lookup() -> Option<VmUser> {
    // From the file, never NSS: see `accounts` (this lookup of a missing user crashed the
    // static binary in `libnss_systemd`). `useradd` writes the file.
    let u = crate::accounts::by_name(VM_USER)?;
    Some(VmUser {
        uid: u.uid,
        gid: u.gid,
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

/// The ids of the sandbox whose VM directory is `dir`: the ones in `dir/.vm-uid` when the
/// daemon wrote that file, else a new pair claimed in [`UID_REGISTRY`] and written there.
/// A claim whose VM directory is gone (or holds another uid) is taken over.
pub fn sandbox_ids(dir: &Path) -> Result<VmUser, String> {
    sandbox_ids_in(dir, Path::new(UID_REGISTRY), uid_base())
}

/// [`sandbox_ids`] with the registry `registry` and a new claim taken from `base`.
pub(crate) fn sandbox_ids_in(dir: &Path, registry: &Path, base: u32) -> Result<VmUser, String> {
    use std::io::Write as _;
    let err = |p: &Path, e: std::io::Error| format!("{}: {e}", p.display());
    let file = dir.join(UID_FILE);
    if let Some(uid) = read_uid_file(&file) {
        return Ok(VmUser { uid, gid: uid });
    }
    let dir = std::fs::canonicalize(dir).map_err(|e| err(dir, e))?;
    std::fs::create_dir_all(registry).map_err(|e| err(registry, e))?;
    std::fs::set_permissions(registry, std::fs::Permissions::from_mode(0o700))
        .map_err(|e| err(registry, e))?;
    // One claimer at a time on this host (daemons of several data roots share the registry):
    // two of them must not both take over the same stale claim.
    let _lock = lock_registry(registry)?;
    // Start from a hash of the directory (few collisions), then probe the next ones.
    let start = {
        use std::hash::{Hash, Hasher};
        let mut h = std::collections::hash_map::DefaultHasher::new();
        dir.hash(&mut h);
        crate::vmm::jail::unix_nanos().hash(&mut h);
        (h.finish() % u64::from(UID_RANGE)) as u32
    };
    let me = dir.as_os_str().as_encoded_bytes();
    for i in 0..UID_RANGE.min(4096) {
        let uid = base + (start + i) % UID_RANGE;
        let claim = registry.join(uid.to_string());
        let taken = match std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .open(&claim)
        {
            Ok(mut f) => {
                f.write_all(me).map_err(|e| err(&claim, e))?;
                false
            }
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {
                let owner = std::fs::read(&claim).map_err(|e| err(&claim, e))?;
                let owner = Path::new(
                    <std::ffi::OsStr as std::os::unix::ffi::OsStrExt>::from_bytes(&owner),
                );
                let alive = owner != dir && read_uid_file(&owner.join(UID_FILE)) == Some(uid);
                if !alive {
                    std::fs::write(&claim, me).map_err(|e| err(&claim, e))?;
                }
                alive
            }
            Err(e) => return Err(err(&claim, e)),
        };
        if taken {
            continue;
        }
        let tmp = dir.join(format!("{UID_FILE}.tmp"));
        std::fs::write(&tmp, uid.to_string()).map_err(|e| err(&tmp, e))?;
        std::fs::rename(&tmp, &file).map_err(|e| err(&file, e))?;
        tracing::info!(dir = %dir.display(), uid, "per-sandbox uid claimed for QEMU");
        return Ok(VmUser { uid, gid: uid });
    }
    Err(format!(
        "no free per-sandbox uid near {} in {}",
        base + start,
        registry.display()
    ))
}

/// Give back the claim of the VM directory `dir`, which is about to be deleted: its registry
/// entry goes when it still names `dir` (a claim taken over by another directory stays).
/// Idempotent; a directory without a uid file has nothing to give back.
pub fn release_ids(dir: &Path) -> Result<(), String> {
    release_ids_in(dir, Path::new(UID_REGISTRY))
}

pub(crate) fn release_ids_in(dir: &Path, registry: &Path) -> Result<(), String> {
    let Some(uid) = read_uid_file(&dir.join(UID_FILE)) else {
        return Ok(());
    };
    let err = |p: &Path, e: std::io::Error| format!("{}: {e}", p.display());
    let dir = std::fs::canonicalize(dir).map_err(|e| err(dir, e))?;
    if !registry.is_dir() {
        return Ok(());
    }
    let _lock = lock_registry(registry)?;
    let claim = registry.join(uid.to_string());
    match std::fs::read(&claim) {
        Ok(owner) if owner == dir.as_os_str().as_encoded_bytes() => {
            std::fs::remove_file(&claim).map_err(|e| err(&claim, e))?;
            tracing::debug!(dir = %dir.display(), uid, "per-sandbox uid given back");
            Ok(())
        }
        Ok(_) => Ok(()),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(err(&claim, e)),
    }
}

/// Remove the claims whose VM directory is gone or holds another uid (a sandbox deleted while
/// no daemon ran, or by an older daemon that never gave claims back). Returns how many.
pub fn sweep_claims() -> Result<usize, String> {
    sweep_claims_in(Path::new(UID_REGISTRY))
}

pub(crate) fn sweep_claims_in(registry: &Path) -> Result<usize, String> {
    if !registry.is_dir() {
        return Ok(0);
    }
    let _lock = lock_registry(registry)?;
    let rd = std::fs::read_dir(registry).map_err(|e| format!("{}: {e}", registry.display()))?;
    let mut removed = 0;
    for ent in rd.flatten() {
        let Some(uid) = ent.file_name().to_str().and_then(|n| n.parse::<u32>().ok()) else {
            continue;
        };
        let Ok(owner) = std::fs::read(ent.path()) else {
            continue;
        };
        let owner =
            Path::new(<std::ffi::OsStr as std::os::unix::ffi::OsStrExt>::from_bytes(&owner));
        if read_uid_file(&owner.join(UID_FILE)) != Some(uid)
            && std::fs::remove_file(ent.path()).is_ok()
        {
            removed += 1;
        }
    }
    Ok(removed)
}

/// An exclusive lock on the registry (`.lock` in it), held while claims are read and written.
fn lock_registry(registry: &Path) -> Result<nix::fcntl::Flock<std::fs::File>, String> {
    let path = registry.join(".lock");
    let f = std::fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(&path)
        .map_err(|e| format!("{}: {e}", path.display()))?;
    nix::fcntl::Flock::lock(f, nix::fcntl::FlockArg::LockExclusive)
        .map_err(|(_, e)| format!("{}: {e}", path.display()))
}

/// The uid in a daemon-written (root-owned, regular, in range) uid file.
fn read_uid_file(file: &Path) -> Option<u32> {
    let md = std::fs::symlink_metadata(file).ok()?;
    if !md.is_file() || md.uid() != nix::unistd::geteuid().as_raw() {
        return None;
    }
    let uid: u32 = std::fs::read_to_string(file).ok()?.trim().parse().ok()?;
    any_base_range(uid).then_some(uid)
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

/// Whether `u` (with the shared group `shared`) may read `file` by its mode bits (root's
/// read-everything does not count).
pub fn can_read(md: &std::fs::Metadata, u: VmUser, shared: u32) -> bool {
    let m = md.mode();
    (md.uid() == u.uid && m & 0o400 != 0)
        || ((md.gid() == u.gid || md.gid() == shared) && m & 0o040 != 0)
        || m & 0o004 != 0
}

/// A file QEMU only reads (kernel, initramfs, base images, a borrowed RAM file, a frozen
/// layer): fine if `u` can read it as its owner or through the shared group `shared`;
/// otherwise a root-owned file, or a file another sandbox's QEMU made (a frozen RAM file or
/// disk layer it no longer writes), becomes root's with the shared group and group read
/// (never write). Anything else is an error naming the file.
pub fn let_read(file: &Path, u: VmUser, shared: u32) -> Result<(), String> {
    let md = std::fs::metadata(file).map_err(|e| format!("{}: {e}", file.display()))?;
    // A file another sandbox's QEMU made stays writable by it until it is root's.
    let other_sandbox = md.uid() != u.uid && is_sandbox_uid(md.uid());
    if !other_sandbox && can_read(&md, u, shared) {
        return Ok(());
    }
    if (md.uid() == 0 || other_sandbox) && md.is_file() {
        let real = std::fs::canonicalize(file).map_err(|e| format!("{}: {e}", file.display()))?;
        chown(&real, Some(0), Some(shared)).map_err(|e| format!("{}: {e}", real.display()))?;
        let mode = (md.mode() & 0o7777 & !0o6022) | 0o040;
        std::fs::set_permissions(&real, std::fs::Permissions::from_mode(mode))
            .map_err(|e| format!("{}: {e}", real.display()))?;
        return Ok(());
    }
    Err(format!(
        "QEMU runs as uid {} with the group `{VM_USER}`, which cannot read {} (owner uid {}, \
         mode {:o}): make it readable for that group",
        u.uid,
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
            assert_eq!(can_read(&md, me, 4_000_001), mine, "mode {mode:o}");
            assert_eq!(can_read(&md, other, 4_000_001), theirs, "mode {mode:o}");
        }
    }
}

#[cfg(test)]
mod claim_tests {
    use super::*;

    #[test]
    fn a_deleted_sandbox_gives_its_uid_claim_back_and_stale_claims_are_swept() {
        let t = tempfile::tempdir().expect("tmp");
        let reg = t.path().join("reg");
        let (a, b) = (t.path().join("a"), t.path().join("b"));
        std::fs::create_dir(&a).expect("a");
        std::fs::create_dir(&b).expect("b");
        let ua = sandbox_ids_in(&a, &reg, DEFAULT_UID_BASE).expect("a's ids");
        let ub = sandbox_ids_in(&b, &reg, DEFAULT_UID_BASE).expect("b's ids");
        assert_ne!(ua.uid, ub.uid);
        assert!(reg.join(ua.uid.to_string()).is_file());
        // Idempotent, and only `a`'s claim goes.
        release_ids_in(&a, &reg).expect("release");
        release_ids_in(&a, &reg).expect("release again");
        assert!(!reg.join(ua.uid.to_string()).exists());
        assert!(reg.join(ub.uid.to_string()).is_file());
        // `b` deleted without a release (a daemon that was not running): swept; a live claim
        // stays.
        let c = t.path().join("c");
        std::fs::create_dir(&c).expect("c");
        let uc = sandbox_ids_in(&c, &reg, DEFAULT_UID_BASE).expect("c's ids");
        std::fs::remove_dir_all(&b).expect("rm b");
        assert_eq!(sweep_claims_in(&reg).expect("sweep"), 1);
        assert!(!reg.join(ub.uid.to_string()).exists());
        assert!(reg.join(uc.uid.to_string()).is_file());
        assert_eq!(sweep_claims_in(&reg).expect("sweep again"), 0);
    }

    #[test]
    fn concurrent_claimers_never_share_a_uid() {
        let t = tempfile::tempdir().expect("tmp");
        let reg = t.path().join("reg");
        let dirs: Vec<_> = (0..16)
            .map(|i| {
                let d = t.path().join(format!("d{i}"));
                std::fs::create_dir(&d).expect("dir");
                d
            })
            .collect();
        let uids: Vec<u32> = std::thread::scope(|s| {
            let hs: Vec<_> = dirs
                .iter()
                .map(|d| s.spawn(|| sandbox_ids_in(d, &reg, DEFAULT_UID_BASE).expect("ids").uid))
                .collect();
            hs.into_iter().map(|h| h.join().expect("join")).collect()
        });
        let mut u = uids.clone();
        u.sort_unstable();
        u.dedup();
        assert_eq!(u.len(), uids.len(), "{uids:?}");
    }

    #[test]
    fn the_uid_base_is_a_setting_and_a_directory_keeps_its_id_when_it_changes() {
        assert!(check_uid_base(DEFAULT_UID_BASE).is_ok());
        assert!(check_uid_base(MIN_UID_BASE).is_ok());
        assert!(check_uid_base(u32::MAX - UID_RANGE).is_ok());
        assert!(check_uid_base(1000).is_err());
        assert!(check_uid_base(u32::MAX - UID_RANGE + 1).is_err());
        let t = tempfile::tempdir().expect("tmp");
        let reg = t.path().join("reg");
        let a = t.path().join("a");
        std::fs::create_dir(&a).expect("a");
        let base = 300_000_000;
        let ua = sandbox_ids_in(&a, &reg, base).expect("a's ids");
        assert!((base..base + UID_RANGE).contains(&ua.uid), "{}", ua.uid);
        // Another base later: `a` keeps its id (its QEMU may still run as it), and its claim
        // is not swept as stale.
        assert_eq!(
            sandbox_ids_in(&a, &reg, DEFAULT_UID_BASE).expect("again"),
            ua
        );
        assert_eq!(sweep_claims_in(&reg).expect("sweep"), 0);
        let b = t.path().join("b");
        std::fs::create_dir(&b).expect("b");
        let ub = sandbox_ids_in(&b, &reg, DEFAULT_UID_BASE).expect("b's ids");
        assert!(ub.uid >= DEFAULT_UID_BASE, "{}", ub.uid);
    }
}
