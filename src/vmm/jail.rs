//! The fences around each QEMU process (the idea of Firecracker's jailer, done in the driver).
//!
//! Owns: deciding which fences this host allows ([`Jail::detect`], reported by `doctor`),
//! preparing them for one launch before the fork ([`Jail::prepare`]) and entering them in the
//! forked child before exec ([`Prepared::enter`]), and removing what a launch left
//! ([`Prepared::release`], [`Jail::sweep`]).
//! The fences: a cgroup with memory, pids and CPU limits from the VM's size
//! (`jail/cgroup.rs`); under a root daemon a uid and gid of the sandbox's own (no other
//! sandbox's QEMU shares them) with one supplementary group, the shared read-only group
//! `tryboxi-vm` (`jail/user.rs`); its own mount namespace where only its VM directory,
//! the files it reads and the system directories are visible (`jail/mountns.rs`; inside a user
//! namespace when the daemon is not root and the host allows it); no new privileges
//! (`PR_SET_NO_NEW_PRIVS`) always.
//! Never: falls back to an unfenced QEMU when the daemon is root (an error says which fence
//! could not be set up); an unprivileged daemon goes without a fence the host does not allow,
//! and `doctor` says why.

pub mod cgroup;
pub mod mountns;
#[cfg(test)]
mod tests;
pub mod user;

use std::collections::BTreeSet;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::sync::{Mutex, OnceLock};

use super::qemu::{RamBacking, VmPaths};
use super::{Accel, VmSpec, VmmError};
use user::VmUser;

/// How old an empty QEMU cgroup must be before [`Jail::sweep`] removes it.
pub const SWEEP_GRACE: std::time::Duration = std::time::Duration::from_secs(60);

pub(crate) fn unix_nanos() -> u128 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos())
        .unwrap_or(0)
}

/// Names of cgroups made for launches not yet running: [`Jail::sweep`] leaves them alone.
static IN_FLIGHT: Mutex<BTreeSet<String>> = Mutex::new(BTreeSet::new());

fn in_flight() -> std::sync::MutexGuard<'static, BTreeSet<String>> {
    IN_FLIGHT.lock().unwrap_or_else(|p| p.into_inner())
}

/// Which fences this host allows for QEMU, found once per driver.
#[derive(Debug)]
pub struct Jail {
    is_root: bool,
    /// The cgroup controllers, or why there are none.
    cgroups: Result<cgroup::Hierarchy, String>,
    /// The VM user (root daemon only), found or made at the first launch.
    user: OnceLock<Result<VmUser, String>>,
    /// Whether QEMU gets its own mount namespace (always for a root daemon; for another one
    /// when unprivileged user namespaces are allowed), or why not.
    ns: Result<(), String>,
    /// Where QEMU is when it is not in a system directory (a QEMU installed in its own
    /// prefix, a wrapper script): bound read-only into the namespace.
    qemu_home: Option<QemuHome>,
}

/// The fences of this host as `doctor` shows them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FenceReport {
    /// `cgroup v1 (...)`, `cgroup v2 (...)` or why there is none.
    pub cgroup: Result<String, String>,
    /// The user QEMU runs as.
    pub user: Result<String, String>,
    /// QEMU's mount namespace, or why it has none.
    pub namespace: Result<String, String>,
}

impl Jail {
    /// Look at this host for QEMU `binary` (no side effects but a short test process that
    /// tries a user namespace when the daemon is not root).
    pub fn detect(binary: &Path) -> Jail {
        let is_root = nix::unistd::geteuid().is_root();
        Jail {
            is_root,
            cgroups: cgroup::detect(is_root).map_err(|e| e.to_string()),
            user: OnceLock::new(),
            ns: if is_root {
                Ok(())
            } else {
                mountns::userns_allowed()
            },
            qemu_home: qemu_home(binary),
        }
    }

    /// The user QEMU runs as under a root daemon (made on first use); `None` when the daemon
    /// is not root (QEMU keeps the daemon's user).
    fn vm_user(&self) -> Result<Option<VmUser>, VmmError> {
        if !self.is_root {
            return Ok(None);
        }
        self.user
            .get_or_init(user::ensure)
            .clone()
            .map(Some)
            .map_err(VmmError::Fence)
    }

    /// What `doctor` prints. Checks that a cgroup can really be made (and removes it).
    pub fn report(&self) -> FenceReport {
        let cgroup = match &self.cgroups {
            Ok(h) => {
                let name = format!("doctor.{}", std::process::id());
                match cgroup::VmCgroup::create(h, &name, cgroup::Limits::for_vm(1, 64, false)) {
                    Ok(cg) => {
                        cgroup::remove_dirs(cg.dirs());
                        let at: Vec<String> = h
                            .parents()
                            .iter()
                            .map(|p| p.display().to_string())
                            .collect();
                        Ok(format!("cgroup {} ({})", h.version(), at.join(", ")))
                    }
                    Err(e) => Err(e.to_string()),
                }
            }
            Err(e) => Err(e.clone()),
        };
        let user = if !self.is_root {
            let me = nix::unistd::geteuid();
            Ok(format!(
                "uid {me} (the daemon's own user: not root), no new privileges"
            ))
        } else {
            match user::lookup() {
                Some(u) => Ok(format!(
                    "a uid of each sandbox's own from {} (supplementary group `{}`, gid {}), no \
                     new privileges",
                    user::uid_base(),
                    user::VM_USER,
                    u.gid
                )),
                None if std::path::Path::new("/usr/sbin/useradd").exists() => Ok(format!(
                    "`{}` (made at the first VM start), no new privileges",
                    user::VM_USER
                )),
                None => Err(format!(
                    "no user `{}` and no useradd to make it",
                    user::VM_USER
                )),
            }
        };
        let namespace = match &self.ns {
            Ok(()) if self.is_root => Ok("own mount namespace (VM directory, images, system \
                                          directories)"
                .to_owned()),
            Ok(()) => Ok("own user + mount namespace (VM directory, images, system \
                          directories)"
                .to_owned()),
            Err(e) => Err(e.clone()),
        };
        FenceReport {
            cgroup,
            user,
            namespace,
        }
    }

    /// Make the fences of `spec`'s next QEMU with the files of `paths` (and the state file
    /// `incoming` of a start from a checkpoint). `Err` when a fence the daemon must have
    /// cannot be set up.
    pub(crate) fn prepare(
        &self,
        spec: &VmSpec,
        paths: &VmPaths,
        incoming: Option<&Path>,
        ram_read_only: bool,
    ) -> Result<Prepared, VmmError> {
        let needs = Needs::of(spec, paths, incoming, ram_read_only)?;
        let creds = match self.vm_user()? {
            Some(shared) => {
                let u = user::sandbox_ids(&needs.dir)
                    .map_err(|e| VmmError::Fence(format!("no uid of its own for QEMU: {e}")))?;
                Some(grant(&needs, u, shared.gid, spec.accel)?)
            }
            None => None,
        };
        let ns = self.prepare_ns(&needs, spec.accel)?;
        let cgroup = self.prepare_cgroup(spec)?;
        Ok(Prepared { cgroup, ns, creds })
    }

    /// The fences of the KVM probe's short QEMU in `dir` (a directory of its own, made by the
    /// caller), which reads `reads` (kernel, initramfs) and writes only files in `dir`: under
    /// a root daemon the uid of `tryboxi-vm` (no sandbox's QEMU runs as it), the shared group
    /// and the KVM group; the same mount namespace as a VM; no new privileges. No cgroup: it
    /// lives seconds and boots only the daemon's own images.
    pub(crate) fn prepare_probe(
        &self,
        dir: &Path,
        reads: &[PathBuf],
        accel: Accel,
    ) -> Result<Prepared, VmmError> {
        let needs = Needs {
            dir: dir.to_owned(),
            writes: Vec::new(),
            reads: reads.to_vec(),
        };
        let creds = match self.vm_user()? {
            Some(shared) => Some(grant(&needs, shared, shared.gid, accel)?),
            None => None,
        };
        let ns = self.prepare_ns(&needs, accel)?;
        Ok(Prepared {
            cgroup: None,
            ns,
            creds,
        })
    }

    fn prepare_ns(&self, needs: &Needs, accel: Accel) -> Result<Option<mountns::Plan>, VmmError> {
        if let Err(why) = &self.ns {
            tracing::debug!(reason = %why, "QEMU runs without its own mount namespace");
            return Ok(None);
        }
        let stage = needs.dir.join(mountns::STAGE);
        // An empty directory of the daemon's, never something QEMU left there.
        match std::fs::symlink_metadata(&stage) {
            Ok(m) if m.is_dir() && m.uid() == nix::unistd::geteuid().as_raw() => {}
            Ok(_) => {
                let _ = std::fs::remove_file(&stage);
                std::fs::create_dir(&stage)
                    .map_err(|e| VmmError::Fence(format!("{}: {e}", stage.display())))?;
            }
            Err(_) => std::fs::create_dir(&stage)
                .map_err(|e| VmmError::Fence(format!("{}: {e}", stage.display())))?,
        }
        let writes = needs
            .writes
            .iter()
            .filter(|w| !w.starts_with(&needs.dir))
            .cloned()
            .collect();
        let view = mountns::View {
            dir: needs.dir.clone(),
            reads: needs.reads.clone(),
            writes,
            extra_dirs: match &self.qemu_home {
                Some(QemuHome::Prefix(d)) => vec![d.clone()],
                _ => Vec::new(),
            },
            programs: match &self.qemu_home {
                Some(QemuHome::File(f)) => vec![f.clone()],
                _ => Vec::new(),
            },
            kvm: accel == Accel::Kvm,
            userns: !self.is_root,
        };
        mountns::Plan::new(&view)
            .map(Some)
            .map_err(|e| VmmError::Fence(format!("QEMU's mount namespace: {e}")))
    }

    /// The VM directory `dir` is about to be deleted: give back its per-sandbox uid claim
    /// (only a root daemon claims one). Idempotent; a failure is logged, never fatal.
    pub(crate) fn forget(&self, dir: &Path) {
        if self.is_root
            && let Err(e) = user::release_ids(dir)
        {
            tracing::warn!(dir = %dir.display(), error = %e, "cannot give back the VM's uid claim");
        }
    }

    /// A directory QEMU is to write into (a checkpoint's directory), made by the caller.
    pub(crate) fn share_dir(&self, dir: &Path, vm_dir: &Path) -> Result<(), VmmError> {
        if let Some(u) = self.vm_ids(vm_dir)? {
            user::share_dir(dir, u).map_err(|e| {
                VmmError::Fence(format!("cannot open {} to QEMU: {e}", dir.display()))
            })?;
        }
        Ok(())
    }

    /// A file the daemon made in the VM directory `vm_dir` for its running QEMU to write (the
    /// next root layer of a checkpoint): the VM's own user's.
    pub(crate) fn give_file(&self, file: &Path, vm_dir: &Path) -> Result<(), VmmError> {
        if let Some(u) = self.vm_ids(vm_dir)? {
            user::give(file, u).map_err(|e| {
                VmmError::Fence(format!("cannot give {} to QEMU: {e}", file.display()))
            })?;
        }
        Ok(())
    }

    /// The ids the QEMU of the VM directory `vm_dir` runs as, when it runs as its own user
    /// (a root daemon); `None` otherwise.
    fn vm_ids(&self, vm_dir: &Path) -> Result<Option<user::VmUser>, VmmError> {
        if self.vm_user()?.is_none() {
            return Ok(None);
        }
        user::sandbox_ids(vm_dir)
            .map(Some)
            .map_err(|e| VmmError::Fence(format!("no uid of its own for QEMU: {e}")))
    }

    fn prepare_cgroup(&self, spec: &VmSpec) -> Result<Option<Launch>, VmmError> {
        let h = match &self.cgroups {
            Ok(h) => h,
            Err(why) if self.is_root => {
                return Err(VmmError::Fence(format!(
                    "no cgroup for QEMU: {why} (QEMU would run without memory, pids and CPU \
                     limits)"
                )));
            }
            Err(why) => {
                tracing::debug!(reason = %why, "QEMU runs without a cgroup");
                return Ok(None);
            }
        };
        let name = format!("{}.{:x}", spec.id, unix_nanos());
        let limits = cgroup::Limits::for_vm(spec.vcpus, spec.memory_mib, spec.accel == Accel::Tcg);
        in_flight().insert(name.clone());
        match cgroup::VmCgroup::create(h, &name, limits) {
            Ok(cg) => Ok(Some(Launch { name, cg })),
            Err(e) => {
                in_flight().remove(&name);
                if self.is_root {
                    Err(VmmError::Fence(format!("cannot make QEMU's cgroup: {e}")))
                } else {
                    tracing::warn!(error = %e, "QEMU runs without a cgroup");
                    Ok(None)
                }
            }
        }
    }

    /// Remove empty cgroups of QEMUs that are gone (a VM that ended while no daemon ran, or
    /// whose daemon could not remove them). Returns how many went.
    pub fn sweep(&self) -> usize {
        if self.is_root {
            match user::sweep_claims() {
                Ok(0) => {}
                Ok(n) => tracing::info!(removed = n, "removed stale per-sandbox uid claims"),
                Err(e) => tracing::warn!(error = %e, "cannot sweep the per-sandbox uid claims"),
            }
        }
        let Ok(h) = &self.cgroups else {
            return 0;
        };
        let busy = in_flight().clone();
        let now = unix_nanos();
        // Only our names (`<vm id>.<hex nanos>`), made over a minute ago: another daemon on
        // this host may be between making a cgroup and moving its QEMU in.
        let n = cgroup::sweep(h, |name| {
            let made = name
                .rsplit_once('.')
                .and_then(|(_, hex)| u128::from_str_radix(hex, 16).ok());
            busy.contains(name)
                || made.is_none_or(|t| now.saturating_sub(t) < SWEEP_GRACE.as_nanos())
        });
        if n > 0 {
            tracing::info!(removed = n, "removed the cgroups of ended VMs");
        }
        n
    }
}

/// Hand a unix socket QEMU connects to (the VM's NIC, which the daemon's network stack
/// listens on) to the sandbox's uid when its VM directory already has one, else to the
/// shared group (mode 0660), so QEMU can connect (again, after a daemon restart). Nothing to
/// do when the daemon is not root.
pub fn give_socket(sock: &Path) -> std::io::Result<()> {
    use std::os::unix::fs::PermissionsExt;
    if !nix::unistd::geteuid().is_root() {
        return Ok(());
    }
    let Some(shared) = user::lookup() else {
        return Ok(());
    };
    std::os::unix::fs::lchown(sock, None, Some(shared.gid))?;
    std::fs::set_permissions(sock, std::fs::Permissions::from_mode(0o660))
}

/// Where QEMU `binary` lives when it is not under a system directory the namespace binds
/// anyway: its install prefix (`<prefix>/bin/qemu-system-*`: the prefix's directory, which
/// holds its firmware too), or else the file alone (a wrapper script somewhere: its folder
/// may hold anything, the daemon's data root among it).
fn qemu_home(binary: &Path) -> Option<QemuHome> {
    let found = if binary.components().count() > 1 {
        Some(binary.to_owned())
    } else {
        std::env::var_os("PATH").and_then(|path| {
            std::env::split_paths(&path)
                .map(|d| d.join(binary))
                .find(|p| p.is_file())
        })
    }?;
    let real = std::fs::canonicalize(found).ok()?;
    if mountns::SYSTEM_DIRS.iter().any(|d| real.starts_with(d)) {
        return None;
    }
    let bin = real.parent()?;
    match bin.parent() {
        Some(prefix) if bin.file_name() == Some(std::ffi::OsStr::new("bin")) => {
            Some(QemuHome::Prefix(prefix.to_owned()))
        }
        _ => Some(QemuHome::File(real)),
    }
}

/// Where a QEMU outside the system directories lives (see [`qemu_home`]).
#[derive(Debug, Clone, PartialEq, Eq)]
enum QemuHome {
    Prefix(PathBuf),
    File(PathBuf),
}

/// QEMU from which on a memory backend can open its file read-only and still give the guest
/// writable (private, copy-on-write) RAM: `readonly=on,rom=off` (the `rom` property, 8.2).
pub const READONLY_TEMPLATE_SINCE: super::qemu::QemuVersion = super::qemu::QemuVersion {
    major: 8,
    minor: 2,
    micro: 0,
};

/// A borrowed (frozen, shared with other clones) RAM file is opened read-only by QEMU when it
/// can: `readonly=on,rom=off` appended to the memory backend of `args`. A clone then cannot
/// write the file its siblings map (QEMU would otherwise open it read-write even though its
/// mapping is private). Returns whether it did.
pub(crate) fn borrowed_ram_read_only(
    args: &mut [std::ffi::OsString],
    paths: &VmPaths,
    version: super::qemu::QemuVersion,
) -> bool {
    if !matches!(paths.ram, RamBacking::Borrowed(_)) || version < READONLY_TEMPLATE_SINCE {
        return false;
    }
    let prefix = format!("memory-backend-file,id={},", super::qemu::RAM_OBJECT);
    for a in args.iter_mut() {
        if a.as_encoded_bytes().starts_with(prefix.as_bytes()) {
            a.push(",readonly=on,rom=off");
            return true;
        }
    }
    false
}

/// What one QEMU touches.
#[derive(Debug)]
struct Needs {
    /// The VM's directory: QEMU makes its sockets, pidfile, RAM file and new overlays there.
    dir: PathBuf,
    /// Files the daemon made that QEMU writes.
    writes: Vec<PathBuf>,
    /// Files QEMU only reads (kernel, initramfs, the disk's backing chain, a borrowed RAM
    /// file, the state file, the read-only disks).
    reads: Vec<PathBuf>,
}

/// The longest backing chain followed (a fork of a fork of ... is a few dozen deep).
const MAX_CHAIN: usize = 1024;

impl Needs {
    /// `ram_read_only`: a borrowed RAM file is opened read-only (see
    /// [`borrowed_ram_read_only`]); otherwise QEMU opens it read-write and must own it.
    fn of(
        spec: &VmSpec,
        paths: &VmPaths,
        incoming: Option<&Path>,
        ram_read_only: bool,
    ) -> Result<Needs, VmmError> {
        // The console log is the daemon's (it follows QEMU's console socket into it).
        let mut writes = vec![paths.disk.clone(), paths.net.clone()];
        let mut reads = vec![
            spec.kernel.clone(),
            spec.initramfs.clone(),
            paths.xfer.clone(),
            paths.wsbase.clone(),
        ];
        match &paths.ram {
            RamBacking::Owned(p) => writes.push(p.clone()),
            RamBacking::Borrowed(p) if ram_read_only => reads.push(p.clone()),
            RamBacking::Borrowed(p) => writes.push(p.clone()),
        }
        reads.extend(incoming.map(Path::to_owned));
        reads.extend(backing_chain(&paths.disk)?);
        Ok(Needs {
            dir: paths.dir.clone(),
            writes,
            reads,
        })
    }
}

/// The backing files of the qcow2 image `disk`, nearest first (empty for a missing or raw
/// image). Reads only each image's header and backing name.
fn backing_chain(disk: &Path) -> Result<Vec<PathBuf>, VmmError> {
    use std::os::unix::fs::FileExt;
    let mut chain = Vec::new();
    let mut cur = disk.to_owned();
    while chain.len() < MAX_CHAIN {
        let Ok(f) = std::fs::File::open(&cur) else {
            break;
        };
        let mut h = [0u8; 20];
        if f.read_exact_at(&mut h, 0).is_err() || h[0..4] != *b"QFI\xfb" {
            break;
        }
        let off = u64::from_be_bytes(h[8..16].try_into().expect("8 bytes"));
        let len = u32::from_be_bytes(h[16..20].try_into().expect("4 bytes")) as usize;
        if off == 0 || len == 0 {
            break;
        }
        if len > 1023 {
            return Err(VmmError::Fence(format!(
                "{}: backing file name of {len} bytes",
                cur.display()
            )));
        }
        let mut name = vec![0u8; len];
        f.read_exact_at(&mut name, off).map_err(|e| {
            VmmError::Fence(format!(
                "{}: cannot read its backing name: {e}",
                cur.display()
            ))
        })?;
        let name =
            PathBuf::from(<std::ffi::OsStr as std::os::unix::ffi::OsStrExt>::from_bytes(&name));
        let next = match cur.parent() {
            Some(d) if name.is_relative() => d.join(name),
            _ => name,
        };
        chain.push(next.clone());
        cur = next;
    }
    Ok(chain)
}

/// Give the VM user what it needs of `needs` and return the credentials QEMU takes.
fn grant(needs: &Needs, u: VmUser, shared: u32, accel: Accel) -> Result<Creds, VmmError> {
    let fence = |what: &Path, e: std::io::Error| {
        VmmError::Fence(format!("cannot open {} to QEMU: {e}", what.display()))
    };
    user::share_dir(&needs.dir, u).map_err(|e| fence(&needs.dir, e))?;
    for w in &needs.writes {
        user::give(w, u).map_err(|e| fence(w, e))?;
    }
    for r in &needs.reads {
        user::let_read(r, u, shared).map_err(VmmError::Fence)?;
    }
    let mut groups = vec![shared];
    if accel == Accel::Kvm {
        let md =
            std::fs::metadata("/dev/kvm").map_err(|e| VmmError::Fence(format!("/dev/kvm: {e}")))?;
        if md.mode() & 0o006 != 0o006 {
            if md.gid() == 0 || md.mode() & 0o060 != 0o060 {
                return Err(VmmError::Fence(format!(
                    "QEMU runs as uid {}, which cannot open /dev/kvm (mode {:o}, gid {}): give \
                     /dev/kvm to a `kvm` group (mode 0660), or set accel = \"tcg\"",
                    u.uid,
                    md.mode() & 0o777,
                    md.gid()
                )));
            }
            groups.push(md.gid());
        }
    }
    Ok(Creds {
        uid: u.uid,
        gid: u.gid,
        groups,
    })
}

/// Who QEMU becomes before exec.
#[derive(Debug)]
struct Creds {
    uid: u32,
    gid: u32,
    /// Supplementary groups: the shared read-only group, and the group of /dev/kvm for a KVM
    /// guest.
    groups: Vec<u32>,
}

#[derive(Debug)]
struct Launch {
    name: String,
    cg: cgroup::VmCgroup,
}

/// The fences of one launch, made before the fork.
#[derive(Debug)]
pub(crate) struct Prepared {
    cgroup: Option<Launch>,
    ns: Option<mountns::Plan>,
    creds: Option<Creds>,
}

impl Prepared {
    /// Enter the fences. Runs in the forked child before exec: only async-signal-safe system
    /// calls on data prepared before the fork.
    pub(crate) fn enter(&self) -> std::io::Result<()> {
        if let Some(l) = &self.cgroup {
            l.cg.enter()?;
        }
        if let Some(ns) = &self.ns {
            ns.enter()?;
        }
        if let Some(c) = &self.creds {
            // SAFETY: setgroups/setgid/setuid on plain integers and a vector allocated before
            // the fork; async-signal-safe. Groups first, then the group, then the user (after
            // setuid there is no privilege left to change the others).
            unsafe {
                if libc::setgroups(c.groups.len(), c.groups.as_ptr()) < 0
                    || libc::setgid(c.gid) < 0
                    || libc::setuid(c.uid) < 0
                {
                    return Err(std::io::Error::last_os_error());
                }
            }
        }
        // SAFETY: prctl with integer arguments; async-signal-safe. Kept across exec: nothing
        // QEMU runs can gain privileges (setuid binaries, file capabilities).
        if unsafe { libc::prctl(libc::PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) } < 0 {
            return Err(std::io::Error::last_os_error());
        }
        Ok(())
    }

    /// QEMU runs (or never started): the cgroup is no longer "in flight".
    pub(crate) fn launched(&self) {
        if let Some(l) = &self.cgroup {
            in_flight().remove(&l.name);
        }
    }

    /// The cgroup directories, to remove once QEMU has exited.
    pub(crate) fn cgroup_dirs(&self) -> Vec<PathBuf> {
        self.cgroup
            .as_ref()
            .map(|l| l.cg.dirs().to_vec())
            .unwrap_or_default()
    }
}
