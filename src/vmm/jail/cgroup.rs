//! Per-QEMU cgroups: memory, pids and CPU limits from a VM's size.
//!
//! Owns: finding the cgroup controllers (v2 when the unified hierarchy has `memory`, `pids` and
//! `cpu`; otherwise the v1 hierarchies of those three), making one cgroup per QEMU launch under
//! a `tryboxi` parent, writing its limits, and removing empty ones. The process is moved in by
//! writing `0` ("the writer") to files this module opens before the fork ([`VmCgroup::enter`]
//! runs in the child before exec), so QEMU never runs a single instruction outside its limits.
//! On v1 that file is `tasks` (the calling thread; the forked child has no other, and QEMU's
//! threads are born inside): the kernel moves the current thread without the global
//! threadgroup lock, whose write side waits for an RCU grace period. Through `cgroup.procs`
//! that took 5-18 ms per launch here (measured 0.04 ms through `tasks`), on every create,
//! restore and fork child. v2 has only `cgroup.procs` for a domain cgroup.
//! Never: kills anything (the kernel's OOM killer acts inside the cgroup when QEMU passes its
//! memory limit), or touches cgroups it did not make (only `<hierarchy>/tryboxi/*`).

use std::io::Write;
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};

/// What QEMU itself uses besides guest RAM, always: device emulation, block and network
/// buffers, the QMP and chardev machinery, libraries. Measured (TCG, 256 MiB guest): 54 MiB of
/// anonymous memory after boot, 68 MiB after `ls -R /usr` in the guest (this includes the part
/// of the translation cache filled so far); the rest is headroom for migration buffers and I/O
/// bursts.
pub const QEMU_OVERHEAD_MIB: u64 = 256;
/// Under TCG, QEMU's translation cache on top: 1 GiB by default (QEMU sizes it to 1/8 of host
/// memory, at most 1 GiB); it is anonymous memory filled as the guest runs new code.
pub const TCG_CACHE_MIB: u64 = 1024;
/// Threads QEMU may have besides one per vCPU: its block I/O thread pool tops out at 64
/// workers, plus the main loop, RCU, call-RCU, migration and chardev threads, with headroom.
/// QEMU's seccomp filter (`spawn=deny`) forbids fork and exec, so these are all threads.
pub const PIDS_BASE: u64 = 128;
/// CFS period; the quota is `vcpus + 1` periods: one host CPU per vCPU thread plus one for
/// QEMU's main loop, I/O and migration threads (a restore or fork loads its state there while
/// the vCPUs start; a quota of `vcpus` alone throttled that and slowed forks).
pub const CPU_PERIOD_US: u64 = 100_000;
/// Name of the parent cgroup of every QEMU's cgroup, in each hierarchy.
pub const PARENT: &str = "tryboxi";

/// The limits of one VM's QEMU.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    pub memory_bytes: u64,
    pub pids: u64,
    pub cpu_quota_us: u64,
    pub cpu_period_us: u64,
}

impl Limits {
    /// Memory: guest RAM + [`QEMU_OVERHEAD_MIB`] (+ [`TCG_CACHE_MIB`] under TCG); pids:
    /// [`PIDS_BASE`] + vCPUs; CPU: `vcpus + 1` full host CPUs.
    pub fn for_vm(vcpus: u32, memory_mib: u32, tcg: bool) -> Limits {
        let overhead = QEMU_OVERHEAD_MIB + if tcg { TCG_CACHE_MIB } else { 0 };
        let vcpus = u64::from(vcpus.max(1));
        Limits {
            memory_bytes: (u64::from(memory_mib) + overhead) << 20,
            pids: PIDS_BASE + vcpus,
            cpu_quota_us: (vcpus + 1) * CPU_PERIOD_US,
            cpu_period_us: CPU_PERIOD_US,
        }
    }
}

/// Where the controllers live.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Hierarchy {
    /// cgroup v2: the `tryboxi` parent in the unified hierarchy.
    V2 { parent: PathBuf },
    /// cgroup v1: the `tryboxi` parent in each controller's hierarchy.
    V1 {
        memory: PathBuf,
        pids: PathBuf,
        cpu: PathBuf,
    },
}

impl Hierarchy {
    /// `v1` or `v2`, for doctor.
    pub fn version(&self) -> &'static str {
        match self {
            Hierarchy::V2 { .. } => "v2",
            Hierarchy::V1 { .. } => "v1",
        }
    }

    /// The parent directories (one for v2, three for v1).
    pub fn parents(&self) -> Vec<&Path> {
        match self {
            Hierarchy::V2 { parent } => vec![parent],
            Hierarchy::V1 { memory, pids, cpu } => vec![memory, pids, cpu],
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum CgroupError {
    #[error("no cgroup hierarchy with the memory, pids and cpu controllers is mounted")]
    NoControllers,
    #[error("cgroup {path}: {source}")]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
}

fn io(path: &Path) -> impl FnOnce(std::io::Error) -> CgroupError + '_ {
    move |source| CgroupError::Io {
        path: path.to_owned(),
        source,
    }
}

/// One line of `/proc/self/mountinfo` that is a cgroup mount: (mount point, fs type, super
/// options).
fn cgroup_mounts(mountinfo: &str) -> Vec<(PathBuf, &str, &str)> {
    mountinfo
        .lines()
        .filter_map(|l| {
            let (pre, post) = l.split_once(" - ")?;
            let mnt = pre.split(' ').nth(4)?;
            let mut post = post.split(' ');
            let fstype = post.next()?;
            let _source = post.next()?;
            let opts = post.next().unwrap_or("");
            (fstype == "cgroup" || fstype == "cgroup2").then(|| (unescape(mnt), fstype, opts))
        })
        .collect()
}

/// mountinfo escapes space, tab, newline and backslash as `\ooo`.
fn unescape(s: &str) -> PathBuf {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'\\'
            && i + 3 < b.len()
            && let Ok(t) = std::str::from_utf8(&b[i + 1..i + 4])
            && let Ok(v) = u8::from_str_radix(t, 8)
        {
            out.push(v);
            i += 4;
            continue;
        }
        out.push(b[i]);
        i += 1;
    }
    PathBuf::from(std::ffi::OsString::from(
        <std::ffi::OsStr as std::os::unix::ffi::OsStrExt>::from_bytes(&out),
    ))
}

/// Pick the hierarchy from a mountinfo text. `v2_controllers` reads a unified mount's
/// `cgroup.controllers`; `base` is the cgroup path (inside the hierarchy) under which the
/// `tryboxi` parent goes (`/` for a root daemon).
pub fn choose(
    mountinfo: &str,
    v2_controllers: impl Fn(&Path) -> String,
    base: impl Fn(&str) -> PathBuf,
) -> Result<Hierarchy, CgroupError> {
    let mounts = cgroup_mounts(mountinfo);
    let want = ["memory", "pids", "cpu"];
    for (mnt, fstype, _) in &mounts {
        if *fstype == "cgroup2" {
            let have = v2_controllers(mnt);
            let have: Vec<&str> = have.split_whitespace().collect();
            if want.iter().all(|w| have.contains(w)) {
                return Ok(Hierarchy::V2 {
                    parent: mnt.join(rel(&base(""))).join(PARENT),
                });
            }
        }
    }
    let v1 = |ctl: &str| {
        mounts
            .iter()
            .find(|(_, fstype, opts)| *fstype == "cgroup" && opts.split(',').any(|o| o == ctl))
            .map(|(mnt, _, _)| mnt.join(rel(&base(ctl))).join(PARENT))
    };
    match (v1("memory"), v1("pids"), v1("cpu")) {
        (Some(memory), Some(pids), Some(cpu)) => Ok(Hierarchy::V1 { memory, pids, cpu }),
        _ => Err(CgroupError::NoControllers),
    }
}

fn rel(p: &Path) -> PathBuf {
    p.strip_prefix("/").unwrap_or(p).to_owned()
}

/// The controllers of this host. A root daemon puts its `tryboxi` parent at the top of each
/// hierarchy; any other daemon next to its own cgroup (the parent of the cgroup it runs in,
/// which a delegating service manager lets it write).
pub fn detect(is_root: bool) -> Result<Hierarchy, CgroupError> {
    let mountinfo =
        std::fs::read_to_string("/proc/self/mountinfo").map_err(io(Path::new("/proc/self")))?;
    let own = std::fs::read_to_string("/proc/self/cgroup").unwrap_or_default();
    choose(
        &mountinfo,
        |mnt| std::fs::read_to_string(mnt.join("cgroup.controllers")).unwrap_or_default(),
        |ctl| {
            if is_root {
                return PathBuf::from("/");
            }
            own_cgroup(&own, ctl)
                .and_then(|p| p.parent().map(Path::to_owned))
                .unwrap_or_else(|| PathBuf::from("/"))
        },
    )
}

/// This process's cgroup path for controller `ctl` (`""`: the v2 line `0::/path`) from
/// `/proc/self/cgroup`.
fn own_cgroup(text: &str, ctl: &str) -> Option<PathBuf> {
    text.lines().find_map(|l| {
        let mut p = l.splitn(3, ':');
        let _id = p.next()?;
        let ctls = p.next()?;
        let path = p.next()?;
        let hit = if ctl.is_empty() {
            ctls.is_empty()
        } else {
            ctls.split(',').any(|c| c == ctl)
        };
        hit.then(|| PathBuf::from(path))
    })
}

/// One QEMU's cgroup, made before the fork: its directories and their open `cgroup.procs`
/// (v2) or `tasks` (v1) files.
#[derive(Debug)]
pub struct VmCgroup {
    dirs: Vec<PathBuf>,
    procs: Vec<std::fs::File>,
}

impl VmCgroup {
    /// Make `name` under every parent of `h` with `limits` written.
    pub fn create(h: &Hierarchy, name: &str, limits: Limits) -> Result<VmCgroup, CgroupError> {
        let mut made = VmCgroup {
            dirs: Vec::new(),
            procs: Vec::new(),
        };
        // Dropped on error: what was made is removed again.
        let res = (|| {
            match h {
                Hierarchy::V2 { parent } => {
                    ensure_v2_parent(parent)?;
                    let d = made.mkdir(parent, name)?;
                    write(&d.join("memory.max"), &limits.memory_bytes.to_string())?;
                    // No swap for QEMU: its limit is the limit.
                    let _ = write(&d.join("memory.swap.max"), "0");
                    write(&d.join("pids.max"), &limits.pids.to_string())?;
                    write(
                        &d.join("cpu.max"),
                        &format!("{} {}", limits.cpu_quota_us, limits.cpu_period_us),
                    )?;
                }
                Hierarchy::V1 { memory, pids, cpu } => {
                    let d = made.mkdir(memory, name)?;
                    write(
                        &d.join("memory.limit_in_bytes"),
                        &limits.memory_bytes.to_string(),
                    )?;
                    let d = made.mkdir(pids, name)?;
                    write(&d.join("pids.max"), &limits.pids.to_string())?;
                    let d = made.mkdir(cpu, name)?;
                    write(
                        &d.join("cpu.cfs_period_us"),
                        &limits.cpu_period_us.to_string(),
                    )?;
                    write(
                        &d.join("cpu.cfs_quota_us"),
                        &limits.cpu_quota_us.to_string(),
                    )?;
                }
            }
            // See the module doc: the current thread alone, without the global lock, on v1.
            let file = match h {
                Hierarchy::V2 { .. } => "cgroup.procs",
                Hierarchy::V1 { .. } => "tasks",
            };
            for d in &made.dirs {
                let p = d.join(file);
                let f = std::fs::OpenOptions::new()
                    .write(true)
                    .open(&p)
                    .map_err(io(&p))?;
                made.procs.push(f);
            }
            Ok(())
        })();
        match res {
            Ok(()) => Ok(made),
            Err(e) => {
                remove_dirs(&made.dirs);
                Err(e)
            }
        }
    }

    fn mkdir(&mut self, parent: &Path, name: &str) -> Result<PathBuf, CgroupError> {
        match std::fs::create_dir(parent) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
            Err(e) => return Err(io(parent)(e)),
        }
        let d = parent.join(name);
        match std::fs::create_dir(&d) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
            Err(e) => return Err(io(&d)(e)),
        }
        self.dirs.push(d.clone());
        Ok(d)
    }

    /// The cgroup directories (one per hierarchy).
    pub fn dirs(&self) -> &[PathBuf] {
        &self.dirs
    }

    /// Move the calling process into the cgroup (on v1 its calling thread, the forked child's
    /// only one). Runs in the forked child before exec: only `write(2)` on descriptors opened
    /// before the fork (async-signal-safe, no allocation).
    pub fn enter(&self) -> std::io::Result<()> {
        for f in &self.procs {
            // SAFETY: `f` is an open descriptor owned by `self`; the buffer is a static byte.
            let n = unsafe { libc::write(f.as_raw_fd(), b"0".as_ptr().cast(), 1) };
            if n < 0 {
                return Err(std::io::Error::last_os_error());
            }
        }
        Ok(())
    }
}

/// v2: the parent must exist and pass the three controllers to its children (and the cgroup
/// above it must pass them to it).
fn ensure_v2_parent(parent: &Path) -> Result<(), CgroupError> {
    match std::fs::create_dir(parent) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
        Err(e) => return Err(io(parent)(e)),
    }
    for d in [parent.parent().unwrap_or(parent), parent] {
        let ctl = d.join("cgroup.subtree_control");
        let have = std::fs::read_to_string(&ctl).unwrap_or_default();
        for c in ["memory", "pids", "cpu"] {
            if !have.split_whitespace().any(|h| h == c) {
                write(&ctl, &format!("+{c}"))?;
            }
        }
    }
    Ok(())
}

fn write(path: &Path, value: &str) -> Result<(), CgroupError> {
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .open(path)
        .map_err(io(path))?;
    f.write_all(value.as_bytes()).map_err(io(path))
}

/// Remove cgroup directories (each must be empty: the kernel refuses otherwise, and that
/// refusal is left for a later sweep).
pub fn remove_dirs(dirs: &[PathBuf]) {
    for d in dirs {
        if let Err(e) = std::fs::remove_dir(d)
            && e.kind() != std::io::ErrorKind::NotFound
        {
            tracing::debug!(cgroup = %d.display(), error = %e, "cgroup not removed yet");
        }
    }
}

/// Remove every empty QEMU cgroup under the `tryboxi` parents (leftovers of VMs that ended
/// while no daemon watched them). A cgroup with a process in it is kept (the kernel refuses
/// `rmdir`); so is one named by `keep` (a launch in flight). Returns how many went.
pub fn sweep(h: &Hierarchy, keep: impl Fn(&str) -> bool) -> usize {
    let mut n = 0;
    for parent in h.parents() {
        let Ok(rd) = std::fs::read_dir(parent) else {
            continue;
        };
        for e in rd.flatten() {
            let name = e.file_name().to_string_lossy().into_owned();
            if !e.file_type().is_ok_and(|t| t.is_dir()) || keep(&name) {
                continue;
            }
            let empty = std::fs::read_to_string(e.path().join("cgroup.procs"))
                .is_ok_and(|s| s.trim().is_empty());
            if empty && std::fs::remove_dir(e.path()).is_ok() {
                n += 1;
            }
        }
    }
    n
}

#[cfg(test)]
mod tests {
    use super::*;

    const HYBRID: &str = "31 23 0:28 / /sys/fs/cgroup rw,relatime - tmpfs tmpfs rw,mode=755
32 31 0:29 / /sys/fs/cgroup/cpu rw,relatime - cgroup cgroup rw,cpu
33 31 0:30 / /sys/fs/cgroup/cpuacct rw,relatime - cgroup cgroup rw,cpuacct
35 31 0:32 / /sys/fs/cgroup/memory rw,relatime - cgroup cgroup rw,memory
39 31 0:36 / /sys/fs/cgroup/pids rw,relatime - cgroup cgroup rw,pids
41 31 0:38 / /sys/fs/cgroup/unified rw,relatime - cgroup2 cgroup2 rw
";
    const UNIFIED: &str = "30 23 0:26 / /sys/fs/cgroup rw,nosuid - cgroup2 cgroup2 rw,nsdelegate
";

    #[test]
    fn a_hybrid_host_without_v2_controllers_uses_the_v1_hierarchies() {
        let h = choose(HYBRID, |_| String::new(), |_| "/".into()).expect("v1");
        assert_eq!(
            h,
            Hierarchy::V1 {
                memory: "/sys/fs/cgroup/memory/tryboxi".into(),
                pids: "/sys/fs/cgroup/pids/tryboxi".into(),
                cpu: "/sys/fs/cgroup/cpu/tryboxi".into(),
            }
        );
        assert_eq!(h.version(), "v1");
    }

    #[test]
    fn a_unified_host_with_the_controllers_uses_v2_next_to_the_daemons_cgroup() {
        let h = choose(
            UNIFIED,
            |_| "cpuset cpu io memory pids".into(),
            |_| "/user.slice/user-1000.slice/user@1000.service/app.slice".into(),
        )
        .expect("v2");
        assert_eq!(
            h,
            Hierarchy::V2 {
                parent:
                    "/sys/fs/cgroup/user.slice/user-1000.slice/user@1000.service/app.slice/tryboxi"
                        .into()
            }
        );
        // v2 without the pids controller enabled and no v1 mounts: nothing to use.
        assert!(matches!(
            choose(UNIFIED, |_| "cpu memory".into(), |_| "/".into()),
            Err(CgroupError::NoControllers)
        ));
    }

    #[test]
    fn own_cgroup_is_read_per_controller() {
        let text =
            "9:name=systemd:/\n8:pids:/a\n4:memory:/process_api/x\n1:cpu,cpuacct:/c\n0::/u/v\n";
        assert_eq!(own_cgroup(text, "memory"), Some("/process_api/x".into()));
        assert_eq!(own_cgroup(text, "cpu"), Some("/c".into()));
        assert_eq!(own_cgroup(text, ""), Some("/u/v".into()));
    }

    #[test]
    fn limits_follow_the_vm_size() {
        let l = Limits::for_vm(2, 512, true);
        assert_eq!(
            l.memory_bytes,
            (512 + QEMU_OVERHEAD_MIB + TCG_CACHE_MIB) << 20
        );
        assert_eq!(l.pids, PIDS_BASE + 2);
        assert_eq!(l.cpu_quota_us, 300_000);
        assert_eq!(
            Limits::for_vm(1, 256, false).memory_bytes,
            (256 + 256) << 20
        );
    }

    #[test]
    fn mount_points_with_spaces_are_unescaped() {
        assert_eq!(unescape("/a\\040b"), PathBuf::from("/a b"));
        assert_eq!(unescape("/plain"), PathBuf::from("/plain"));
    }
}
