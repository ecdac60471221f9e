//! QEMU's own mount namespace: only what it needs is visible, at the same paths.
//!
//! Owns: the plan of one QEMU's file system view (made before the fork: every path a C string,
//! every directory listed) and entering it in the forked child ([`Plan::enter`]): a new mount
//! namespace (inside a new user namespace when the daemon is not root), a small tmpfs as the
//! new root, the VM's directory bound read-write, each file QEMU reads outside it bound
//! read-only at its own path, the system directories (QEMU's binary, libraries and firmware)
//! and a few device nodes bound read-only, then `pivot_root` and the old root detached.
//! Paths stay the same, so QMP commands naming files in the VM's directory keep working.
//! Never: mounts anything in the daemon's namespace (the child's copy is made private first).

use crate::oom::ResetOomScore as _;
use std::ffi::CString;
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};

/// Name of the (empty) directory in a VM's directory the new root is built on.
pub const STAGE: &str = ".jail";
/// System directories bound read-only (or made the same symlink) when the host has them:
/// QEMU's binary, its libraries and its firmware/ROM files live there. None holds user data.
pub const SYSTEM_DIRS: &[&str] = &["/usr", "/bin", "/sbin", "/lib", "/lib64", "/lib32"];
/// Single system files bound read-only when present (the dynamic linker's cache).
pub const SYSTEM_FILES: &[&str] = &["/etc/ld.so.cache"];
/// Device nodes bound into `/dev` (read-write; `/dev/kvm` only for a KVM guest).
pub const DEVICES: &[&str] = &["/dev/null", "/dev/zero", "/dev/urandom", "/dev/random"];

#[derive(Debug)]
enum Step {
    Dir(CString),
    File(CString),
    Link {
        target: CString,
        at: CString,
    },
    Bind {
        src: CString,
        dst: CString,
        rec: bool,
        /// Remount flags (read-only, nosuid, ...); 0: leave the bind as it is.
        remount: libc::c_ulong,
    },
}

/// uid/gid maps of the user namespace an unprivileged daemon's QEMU gets (its own ids mapped
/// to themselves).
#[derive(Debug)]
struct IdMaps {
    uid_map: Vec<u8>,
    gid_map: Vec<u8>,
}

/// One QEMU's view, made before the fork.
#[derive(Debug)]
pub struct Plan {
    stage: CString,
    steps: Vec<Step>,
    put_old: CString,
    cwd: CString,
    userns: Option<IdMaps>,
}

fn cstr(p: &Path) -> Result<CString, String> {
    CString::new(p.as_os_str().as_bytes()).map_err(|_| format!("{}: NUL in path", p.display()))
}

/// `stage` + absolute `p`.
fn under(stage: &Path, p: &Path) -> PathBuf {
    stage.join(p.strip_prefix("/").unwrap_or(p))
}

/// Mount flags of the mount holding `p` that a bind in a user namespace must keep.
fn locked_flags(p: &Path) -> libc::c_ulong {
    let Ok(v) = nix::sys::statvfs::statvfs(p) else {
        return 0;
    };
    use nix::sys::statvfs::FsFlags;
    let f = v.flags();
    let mut out = 0;
    for (have, flag) in [
        (FsFlags::ST_NOSUID, libc::MS_NOSUID),
        (FsFlags::ST_NODEV, libc::MS_NODEV),
        (FsFlags::ST_NOEXEC, libc::MS_NOEXEC),
        (FsFlags::ST_NOATIME, libc::MS_NOATIME),
        (FsFlags::ST_NODIRATIME, libc::MS_NODIRATIME),
        (FsFlags::ST_RELATIME, libc::MS_RELATIME),
    ] {
        if f.contains(have) {
            out |= flag;
        }
    }
    out
}

/// What goes into one view.
#[derive(Debug, Default)]
pub struct View {
    /// The VM's directory (read-write).
    pub dir: PathBuf,
    /// Files QEMU reads: bound read-only where they are outside `dir` (and at their target
    /// when they are symlinks).
    pub reads: Vec<PathBuf>,
    /// Files QEMU writes outside `dir` (bound read-write).
    pub writes: Vec<PathBuf>,
    /// Directories bound read-only besides the system ones (QEMU's prefix when it is not
    /// under a system directory).
    pub extra_dirs: Vec<PathBuf>,
    /// Programs bound read-only and executable (QEMU as a wrapper script outside a prefix).
    pub programs: Vec<PathBuf>,
    pub kvm: bool,
    /// Build it inside a new user namespace (the daemon is not root).
    pub userns: bool,
}

impl Plan {
    pub fn new(v: &View) -> Result<Plan, String> {
        let stage = v.dir.join(STAGE);
        let mut dirs: std::collections::BTreeSet<PathBuf> = Default::default();
        let add_parents = |p: &Path, dirs: &mut std::collections::BTreeSet<PathBuf>| {
            for a in p.ancestors().skip(1) {
                if a != Path::new("/") {
                    dirs.insert(a.to_owned());
                }
            }
        };
        // Directory binds: (path, read-only).
        let mut dir_binds: Vec<(PathBuf, bool)> = Vec::new();
        let mut links: Vec<(PathBuf, PathBuf)> = Vec::new();
        for d in SYSTEM_DIRS {
            let p = Path::new(d);
            match std::fs::symlink_metadata(p) {
                Ok(m) if m.file_type().is_symlink() => {
                    let t = std::fs::read_link(p).map_err(|e| format!("{d}: {e}"))?;
                    links.push((p.to_owned(), t));
                }
                Ok(m) if m.is_dir() => dir_binds.push((p.to_owned(), true)),
                _ => {}
            }
        }
        for d in &v.extra_dirs {
            if !dir_binds.iter().any(|(b, _)| d.starts_with(b)) {
                dir_binds.push((d.clone(), true));
            }
        }
        dir_binds.push((v.dir.clone(), false));
        let covered = |p: &Path| dir_binds.iter().any(|(b, _)| p.starts_with(b));
        // File binds: (path, read-only).
        let mut file_binds: Vec<(PathBuf, bool)> = Vec::new();
        let add_file = |p: &Path, ro: bool, file_binds: &mut Vec<(PathBuf, bool)>| {
            if !covered(p) && !file_binds.iter().any(|(f, _)| f == p) {
                file_binds.push((p.to_owned(), ro));
            }
        };
        for f in SYSTEM_FILES {
            if Path::new(f).is_file() {
                add_file(Path::new(f), true, &mut file_binds);
            }
        }
        for r in &v.reads {
            if !r.exists() {
                continue;
            }
            add_file(r, true, &mut file_binds);
            if let Ok(real) = std::fs::canonicalize(r)
                && real != *r
            {
                add_file(&real, true, &mut file_binds);
            }
        }
        for w in &v.writes {
            if w.exists() {
                add_file(w, false, &mut file_binds);
            }
        }
        let programs: Vec<PathBuf> = v
            .programs
            .iter()
            .filter(|p| p.is_file() && !covered(p))
            .cloned()
            .collect();
        file_binds.retain(|(f, _)| !programs.contains(f));
        let mut devs: Vec<PathBuf> = DEVICES
            .iter()
            .map(PathBuf::from)
            .filter(|p| p.exists())
            .collect();
        if v.kvm {
            devs.push("/dev/kvm".into());
        }
        for p in dir_binds
            .iter()
            .chain(file_binds.iter())
            .map(|(p, _)| p)
            .chain(programs.iter())
        {
            add_parents(p, &mut dirs);
        }
        for (p, _) in &links {
            add_parents(p, &mut dirs);
        }
        dirs.insert("/dev".into());
        dirs.insert("/tmp".into());

        let s = |p: &Path| cstr(&under(&stage, p));
        let mut steps = Vec::new();
        for d in &dirs {
            // A bound directory and what lies under one come from the bind (made before it,
            // in the skeleton, they would be hidden, or their parent would not exist yet).
            if !dir_binds.iter().any(|(b, _)| d.starts_with(b)) {
                steps.push(Step::Dir(s(d)?));
            }
        }
        for (p, ro) in &dir_binds {
            steps.push(Step::Dir(s(p)?));
            let locked = locked_flags(p);
            let remount = if *ro {
                libc::MS_RDONLY | libc::MS_NOSUID | libc::MS_NODEV | locked
            } else {
                libc::MS_NOSUID | libc::MS_NODEV | locked
            };
            steps.push(Step::Bind {
                src: cstr(p)?,
                dst: s(p)?,
                rec: *ro,
                remount,
            });
        }
        for (p, t) in &links {
            steps.push(Step::Link {
                target: cstr(t)?,
                at: s(p)?,
            });
        }
        for (p, ro) in &file_binds {
            steps.push(Step::File(s(p)?));
            let locked = locked_flags(p);
            let remount = if *ro {
                libc::MS_RDONLY | libc::MS_NOSUID | libc::MS_NODEV | libc::MS_NOEXEC | locked
            } else {
                libc::MS_NOSUID | libc::MS_NODEV | libc::MS_NOEXEC | locked
            };
            steps.push(Step::Bind {
                src: cstr(p)?,
                dst: s(p)?,
                rec: false,
                remount,
            });
        }
        for p in &programs {
            steps.push(Step::File(s(p)?));
            steps.push(Step::Bind {
                src: cstr(p)?,
                dst: s(p)?,
                rec: false,
                remount: libc::MS_RDONLY | libc::MS_NOSUID | libc::MS_NODEV | locked_flags(p),
            });
        }
        for d in &devs {
            steps.push(Step::File(s(d)?));
            steps.push(Step::Bind {
                src: cstr(d)?,
                dst: s(d)?,
                rec: false,
                remount: 0,
            });
        }
        let userns = v.userns.then(|| {
            let uid = nix::unistd::geteuid().as_raw();
            let gid = nix::unistd::getegid().as_raw();
            IdMaps {
                uid_map: format!("{uid} {uid} 1\n").into_bytes(),
                gid_map: format!("{gid} {gid} 1\n").into_bytes(),
            }
        });
        Ok(Plan {
            stage: cstr(&stage)?,
            steps,
            put_old: cstr(&stage.join(".old"))?,
            cwd: cstr(&v.dir)?,
            userns,
        })
    }

    /// Enter the view. Runs in the forked child before exec: only system calls on the C
    /// strings made by [`Plan::new`]; nothing is allocated.
    pub fn enter(&self) -> std::io::Result<()> {
        let err = std::io::Error::last_os_error;
        // SAFETY (whole function): every pointer passed is a NUL-terminated C string or a
        // byte slice owned by `self`, alive across each call; the calls are async-signal-safe
        // system calls.
        unsafe {
            let flags = libc::CLONE_NEWNS
                | if self.userns.is_some() {
                    libc::CLONE_NEWUSER
                } else {
                    0
                };
            if libc::unshare(flags) < 0 {
                return Err(err());
            }
            if let Some(m) = &self.userns {
                write_proc(c"/proc/self/setgroups", b"deny")?;
                write_proc(c"/proc/self/uid_map", &m.uid_map)?;
                write_proc(c"/proc/self/gid_map", &m.gid_map)?;
            }
            // Nothing done here reaches the daemon's namespace.
            if libc::mount(
                std::ptr::null(),
                c"/".as_ptr(),
                std::ptr::null(),
                libc::MS_REC | libc::MS_PRIVATE,
                std::ptr::null(),
            ) < 0
            {
                return Err(err());
            }
            if libc::mount(
                c"tmpfs".as_ptr(),
                self.stage.as_ptr(),
                c"tmpfs".as_ptr(),
                libc::MS_NOSUID | libc::MS_NODEV | libc::MS_NOEXEC,
                c"mode=0755,size=1m".as_ptr().cast(),
            ) < 0
            {
                return Err(err());
            }
            for step in &self.steps {
                match step {
                    Step::Dir(p) => {
                        if libc::mkdir(p.as_ptr(), 0o755) < 0
                            && *libc::__errno_location() != libc::EEXIST
                        {
                            return Err(err());
                        }
                    }
                    Step::File(p) => {
                        let fd = libc::open(
                            p.as_ptr(),
                            libc::O_CREAT | libc::O_WRONLY | libc::O_CLOEXEC,
                            0o644,
                        );
                        if fd < 0 {
                            return Err(err());
                        }
                        libc::close(fd);
                    }
                    Step::Link { target, at } => {
                        if libc::symlink(target.as_ptr(), at.as_ptr()) < 0 {
                            return Err(err());
                        }
                    }
                    Step::Bind {
                        src,
                        dst,
                        rec,
                        remount,
                    } => {
                        let rec = if *rec { libc::MS_REC } else { 0 };
                        if libc::mount(
                            src.as_ptr(),
                            dst.as_ptr(),
                            std::ptr::null(),
                            libc::MS_BIND | rec,
                            std::ptr::null(),
                        ) < 0
                        {
                            return Err(err());
                        }
                        if *remount != 0
                            && libc::mount(
                                std::ptr::null(),
                                dst.as_ptr(),
                                std::ptr::null(),
                                libc::MS_BIND | libc::MS_REMOUNT | remount,
                                std::ptr::null(),
                            ) < 0
                        {
                            return Err(err());
                        }
                    }
                }
            }
            if libc::mkdir(self.put_old.as_ptr(), 0o700) < 0 {
                return Err(err());
            }
            if libc::syscall(
                libc::SYS_pivot_root,
                self.stage.as_ptr(),
                self.put_old.as_ptr(),
            ) < 0
            {
                return Err(err());
            }
            if libc::chdir(c"/".as_ptr()) < 0
                || libc::umount2(c"/.old".as_ptr(), libc::MNT_DETACH) < 0
                || libc::rmdir(c"/.old".as_ptr()) < 0
            {
                return Err(err());
            }
            // The skeleton itself is read-only: QEMU can write only its VM directory.
            if libc::mount(
                std::ptr::null(),
                c"/".as_ptr(),
                std::ptr::null(),
                libc::MS_REMOUNT
                    | libc::MS_RDONLY
                    | libc::MS_NOSUID
                    | libc::MS_NODEV
                    | libc::MS_NOEXEC,
                std::ptr::null(),
            ) < 0
            {
                return Err(err());
            }
            if libc::chdir(self.cwd.as_ptr()) < 0 {
                return Err(err());
            }
        }
        Ok(())
    }
}

/// Write `data` to a `/proc/self` file (the user namespace's maps).
///
/// # Safety
/// Async-signal-safe system calls only; `path` and `data` stay alive across them.
unsafe fn write_proc(path: &std::ffi::CStr, data: &[u8]) -> std::io::Result<()> {
    // SAFETY: see the function's contract.
    unsafe {
        let fd = libc::open(path.as_ptr(), libc::O_WRONLY | libc::O_CLOEXEC);
        if fd < 0 {
            return Err(std::io::Error::last_os_error());
        }
        let n = libc::write(fd, data.as_ptr().cast(), data.len());
        let e = std::io::Error::last_os_error();
        libc::close(fd);
        if n < 0 {
            return Err(e);
        }
    }
    Ok(())
}

/// Whether this (unprivileged) process may make a user namespace with a mount namespace in
/// it: tried in a short-lived child (`/bin/true`), the same calls a QEMU launch makes.
pub fn userns_allowed() -> Result<(), String> {
    use std::os::unix::process::CommandExt;
    let mut cmd = std::process::Command::new("true");
    cmd.reset_oom_score()
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null());
    // SAFETY: unshare(2) only, async-signal-safe.
    unsafe {
        cmd.pre_exec(|| {
            if libc::unshare(libc::CLONE_NEWUSER | libc::CLONE_NEWNS) < 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    match cmd.status() {
        Ok(s) if s.success() => Ok(()),
        Ok(s) => Err(format!("a test process in a user namespace ended with {s}")),
        Err(e) => Err(format!(
            "unprivileged user namespaces are not allowed here ({e}); see \
             /proc/sys/kernel/unprivileged_userns_clone and \
             kernel.apparmor_restrict_unprivileged_userns"
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn plan_paths(p: &Plan) -> Vec<String> {
        p.steps
            .iter()
            .filter_map(|s| match s {
                Step::Bind { dst, .. } => Some(dst.to_string_lossy().into_owned()),
                _ => None,
            })
            .collect()
    }

    #[test]
    fn the_view_binds_the_vm_dir_the_reads_outside_it_and_no_more() {
        let t = tempfile::tempdir().expect("tmp");
        let vm = t.path().join("sandboxes/a");
        let other = t.path().join("sandboxes/b");
        std::fs::create_dir_all(&vm).expect("vm");
        std::fs::create_dir_all(&other).expect("other");
        let ram = other.join("mem.ram");
        std::fs::write(&ram, b"").expect("ram");
        let inside = vm.join("disk.qcow2");
        std::fs::write(&inside, b"").expect("disk");
        // The workspace disk is a symlink in the VM dir to the parent's file.
        std::fs::write(other.join("wsbase.img"), b"").expect("wsbase");
        std::os::unix::fs::symlink(other.join("wsbase.img"), vm.join("wsbase.img")).expect("link");
        let plan = Plan::new(&View {
            dir: vm.clone(),
            reads: vec![ram.clone(), inside, vm.join("wsbase.img")],
            ..Default::default()
        })
        .expect("plan");
        let stage = vm.join(STAGE);
        let binds = plan_paths(&plan);
        let at = |p: &Path| under(&stage, p).display().to_string();
        assert!(binds.contains(&at(&vm)), "{binds:?}");
        assert!(binds.contains(&at(&ram)));
        assert!(binds.contains(&at(&other.join("wsbase.img"))));
        // Nothing else of the other sandbox, nothing inside the VM dir twice.
        let prefix = stage.display().to_string();
        assert_eq!(
            binds
                .iter()
                .filter(|b| b.trim_start_matches(&prefix).contains("sandboxes/"))
                .count(),
            3,
            "{binds:?}"
        );
        assert!(binds.contains(&at(Path::new("/usr"))));
        assert!(binds.contains(&at(Path::new("/dev/null"))));
        assert!(!binds.contains(&at(Path::new("/dev/kvm"))));
    }
}

/// The user-namespace path of an unprivileged daemon: an ordinary uid builds the view inside
/// a user namespace of its own and runs a program in it.
#[cfg(test)]
mod userns_tests {
    use super::*;

    #[test]
    fn an_ordinary_uid_builds_the_view_in_a_user_namespace() {
        use std::os::unix::fs::{PermissionsExt, chown};
        use std::os::unix::process::CommandExt;
        if !nix::unistd::geteuid().is_root() {
            println!("SKIPPED: this test drops from root to an ordinary uid");
            return;
        }
        if let Err(why) = std::fs::read_to_string("/proc/sys/user/max_user_namespaces")
            .map_err(|e| e.to_string())
            .and_then(|n| match n.trim() {
                "0" => Err("user.max_user_namespaces = 0".to_owned()),
                _ => Ok(()),
            })
        {
            println!("SKIPPED: no user namespaces here: {why}");
            return;
        }
        // An ordinary uid with no passwd entry, as an unprivileged daemon's user would be.
        let (uid, gid) = (2_100_000_007u32, 2_100_000_007u32);
        let t = tempfile::tempdir().expect("tmp");
        std::fs::set_permissions(t.path(), std::fs::Permissions::from_mode(0o755)).expect("chmod");
        let vm = t.path().join("vm");
        std::fs::create_dir_all(vm.join(STAGE)).expect("stage");
        for d in [vm.clone(), vm.join(STAGE)] {
            chown(&d, Some(uid), Some(gid)).expect("chown");
        }
        let mut plan = Plan::new(&View {
            dir: vm.clone(),
            userns: true,
            ..Default::default()
        })
        .expect("plan");
        // The maps the daemon would make as that uid (Plan::new takes the caller's ids).
        plan.userns = Some(IdMaps {
            uid_map: format!("{uid} {uid} 1\n").into_bytes(),
            gid_map: format!("{gid} {gid} 1\n").into_bytes(),
        });
        let plan = std::sync::Arc::new(plan);
        let run = |script: &str| {
            let p = plan.clone();
            let mut cmd = std::process::Command::new("/bin/sh");
            cmd.args(["-c", script]);
            // SAFETY: setgroups/setgid/setuid/prctl on integers, then `Plan::enter` (system
            // calls on strings made before the fork).
            unsafe {
                cmd.pre_exec(move || {
                    if libc::setgroups(0, std::ptr::null()) < 0
                        || libc::setgid(gid) < 0
                        || libc::setuid(uid) < 0
                        // A daemon started as this user is dumpable; one that dropped from
                        // root is not, and could not write its own uid_map.
                        || libc::prctl(libc::PR_SET_DUMPABLE, 1, 0, 0, 0) < 0
                    {
                        return Err(std::io::Error::last_os_error());
                    }
                    p.enter()
                });
            }
            cmd.output().expect("the view was not built")
        };
        let out = run(&format!(
            "id -u > {0}/seen && test ! -e /etc/passwd && test ! -e /proc/self && test ! -e {1}/x",
            vm.display(),
            t.path().join("elsewhere").display()
        ));
        assert!(out.status.success(), "{out:?}");
        assert_eq!(
            std::fs::read_to_string(vm.join("seen"))
                .expect("seen")
                .trim(),
            uid.to_string(),
            "the program ran as the ordinary uid, mapped to itself"
        );
        // Only the VM dir is writable.
        let out = run(&format!("echo x > {}/planted", t.path().display()));
        assert!(!out.status.success());
        assert!(!t.path().join("planted").exists());
    }
}
