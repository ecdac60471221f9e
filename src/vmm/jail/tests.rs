//! Tests of the fences on a real QEMU: its cgroup and limits, its user, its file system view.
//! QEMU starts paused (`-S`) without a guest kernel, so these need QEMU but no guest images;
//! what a fenced QEMU does with a running guest (snapshot, restore, fork, pause, reattach) is
//! covered by the VM tests (`tests/snapshot_e2e.rs`, `fork_e2e.rs`, `vm_e2e.rs`).

use std::ffi::OsString;
use std::path::{Path, PathBuf};
use std::time::Duration;

use super::cgroup::{self, Hierarchy, Limits};
use crate::vmm::qemu::{VmPaths, qemu_args};
use crate::vmm::testkit::{self, skip_unless};
use crate::vmm::{Accel, QemuDriver, VmInfo, VmSpec, VmmDriver};

struct Paused {
    driver: QemuDriver,
    dir: tempfile::TempDir,
    vm: VmInfo,
}

/// A fenced QEMU for a VM of 2 vCPUs and 192 MiB, started paused (no kernel: the guest never
/// runs), with QMP up. Its temp dir also holds a file of "another sandbox".
async fn start_paused(id: &str) -> Result<Paused, String> {
    let driver = testkit::driver()?;
    let dir = tempfile::Builder::new()
        .prefix("jail")
        .tempdir()
        .map_err(|e| e.to_string())?;
    let vm_dir = dir.path().join("v");
    std::fs::create_dir(&vm_dir).map_err(|e| e.to_string())?;
    std::fs::create_dir(dir.path().join("other")).map_err(|e| e.to_string())?;
    std::fs::write(dir.path().join("other/secret"), b"not for QEMU").map_err(|e| e.to_string())?;
    let kernel = dir.path().join("kernel");
    std::fs::write(&kernel, b"unused").map_err(|e| e.to_string())?;
    let rootfs = testkit::fake_rootfs(dir.path());
    let spec = VmSpec {
        id: id.into(),
        dir: vm_dir.clone(),
        kernel: kernel.clone(),
        initramfs: kernel,
        rootfs: rootfs.clone(),
        vcpus: 2,
        memory_mib: 192,
        accel: Accel::Tcg,
    };
    let paths = VmPaths::new(&vm_dir);
    for f in [&paths.xfer, &paths.wsbase] {
        std::fs::File::create(f)
            .and_then(|h| h.set_len(1 << 20))
            .map_err(|e| e.to_string())?;
    }
    crate::vmm::qcow2::create_overlay(&rootfs, "raw", &paths.disk).map_err(|e| e.to_string())?;
    // The VM's command line without the guest kernel, paused before the first instruction.
    let full = qemu_args(&spec, &paths);
    let mut args: Vec<OsString> = Vec::new();
    let mut it = full.into_iter();
    while let Some(a) = it.next() {
        if a == "-kernel" || a == "-initrd" || a == "-append" {
            it.next();
            continue;
        }
        args.push(a);
    }
    args.push("-S".into());
    let (pid, exited) = driver
        .spawn_detached(&spec, &paths, None, &args)
        .map_err(|e| format!("fenced QEMU did not start: {e}"))?;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    loop {
        if let Some(st) = *exited.borrow() {
            let log = std::fs::read_to_string(&paths.qemu_log).unwrap_or_default();
            panic!("fenced QEMU exited with {st}: {log}");
        }
        if paths.qmp.exists()
            && let Ok(c) =
                crate::vmm::qmp::QmpClient::connect(&paths.qmp, Duration::from_secs(5)).await
        {
            let st = c.query_status().await.expect("query-status");
            assert_eq!(st.status, "prelaunch");
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "fenced QEMU's QMP did not come up"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let vm = VmInfo {
        id: id.into(),
        dir: vm_dir,
        pid,
        accel: Accel::Tcg,
        agent_socket: paths.agent.clone(),
        qmp_socket: paths.qmp.clone(),
        console_log: paths.console.clone(),
    };
    Ok(Paused { driver, dir, vm })
}

impl Paused {
    async fn end(&self) {
        self.driver.kill(&self.vm).await.expect("kill");
        assert!(testkit::processes_mentioning(self.dir.path()).is_empty());
    }
}

/// A failed assertion must not leave the QEMU running.
impl Drop for Paused {
    fn drop(&mut self) {
        if self.driver.is_alive(&self.vm) {
            // SAFETY: kill(2) on the pid `is_alive` just proved to be this test's QEMU.
            unsafe {
                libc::kill(self.vm.pid as i32, libc::SIGKILL);
            }
        }
    }
}

fn root_only(what: &str) -> bool {
    if nix::unistd::geteuid().is_root() {
        return true;
    }
    println!("SKIPPED: {what} is the fence of a root daemon; this test runs as another user");
    false
}

/// `pid`'s cgroup directory for `ctl` (`""`: the v2 hierarchy), from `/proc/PID/cgroup`,
/// which must be a cgroup of its own below `tryboxi/`.
fn cgroup_dir_of(pid: u32, h: &Hierarchy, ctl: &str) -> PathBuf {
    let text = std::fs::read_to_string(format!("/proc/{pid}/cgroup")).expect("/proc/PID/cgroup");
    let path = text
        .lines()
        .find_map(|l| {
            let mut p = l.splitn(3, ':');
            let (_, ctls, path) = (p.next()?, p.next()?, p.next()?);
            let hit = if ctl.is_empty() {
                ctls.is_empty()
            } else {
                ctls.split(',').any(|c| c == ctl)
            };
            hit.then(|| path.to_owned())
        })
        .unwrap_or_else(|| panic!("no {ctl:?} line in /proc/{pid}/cgroup:\n{text}"));
    let parent = match h {
        Hierarchy::V2 { parent } => parent,
        Hierarchy::V1 { memory, pids, cpu } => match ctl {
            "memory" => memory,
            "pids" => pids,
            _ => cpu,
        },
    };
    // `parent` is `<mount>/tryboxi` (a root daemon's); the process's path is below `/tryboxi`.
    let mount = parent.parent().expect("mount of the hierarchy");
    let dir = mount.join(path.trim_start_matches('/'));
    assert!(
        dir.starts_with(parent) && dir != *parent,
        "QEMU (pid {pid}) is in the {ctl:?} cgroup {path}, not in one of its own under {}",
        parent.display()
    );
    dir
}

fn read(p: &Path) -> String {
    std::fs::read_to_string(p)
        .unwrap_or_else(|e| panic!("{}: {e}", p.display()))
        .trim()
        .to_owned()
}

async fn gone(dirs: &[PathBuf]) -> bool {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while dirs.iter().any(|d| d.exists()) {
        if tokio::time::Instant::now() > deadline {
            return false;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    true
}

#[tokio::test]
async fn qemu_runs_in_its_own_cgroup_with_limits_from_the_vm_size() {
    let _serial = testkit::SERIAL.lock().await;
    if !root_only("a cgroup at the top of the hierarchy") {
        return;
    }
    let h = cgroup::detect(true).expect("cgroup controllers on this host");
    let q = skip_unless!(start_paused("jail-cgroup").await);
    let pid = q.vm.pid;
    let want = Limits::for_vm(2, 192, true);
    let dirs: Vec<PathBuf> = match &h {
        Hierarchy::V1 { .. } => {
            let mem = cgroup_dir_of(pid, &h, "memory");
            let pids = cgroup_dir_of(pid, &h, "pids");
            let cpu = cgroup_dir_of(pid, &h, "cpu");
            assert_eq!(
                read(&mem.join("memory.limit_in_bytes")),
                want.memory_bytes.to_string()
            );
            assert_eq!(read(&pids.join("pids.max")), want.pids.to_string());
            assert_eq!(read(&cpu.join("cpu.cfs_quota_us")), "300000");
            assert_eq!(read(&cpu.join("cpu.cfs_period_us")), "100000");
            // Every QEMU thread is in it.
            let tasks: u64 = read(&pids.join("pids.current")).parse().expect("pids");
            assert!(tasks >= 2, "QEMU has {tasks} tasks in its pids cgroup");
            vec![mem, pids, cpu]
        }
        Hierarchy::V2 { .. } => {
            let d = cgroup_dir_of(pid, &h, "");
            assert_eq!(read(&d.join("memory.max")), want.memory_bytes.to_string());
            assert_eq!(read(&d.join("pids.max")), want.pids.to_string());
            assert_eq!(read(&d.join("cpu.max")), "300000 100000");
            vec![d]
        }
    };
    for d in &dirs {
        let name = d.file_name().expect("name").to_string_lossy().into_owned();
        assert!(name.starts_with("jail-cgroup."), "cgroup name {name}");
    }
    q.end().await;
    assert!(gone(&dirs).await, "QEMU's cgroup outlived it: {dirs:?}");
}

#[tokio::test]
async fn empty_leftover_cgroups_are_swept_and_busy_ones_kept() {
    if !root_only("making cgroups at the top of the hierarchy") {
        return;
    }
    let h = cgroup::detect(true).expect("cgroup controllers on this host");
    // A leftover of a QEMU that ended while no daemon ran, and one with a live process.
    // Names as launches make them (`<id>.<hex nanos>`): two minutes old, and just made.
    let old = super::unix_nanos() - 120_000_000_000;
    let pid = std::process::id();
    let make = |name: String| {
        cgroup::VmCgroup::create(&h, &name, Limits::for_vm(1, 64, false)).expect("make")
    };
    let left = make(format!("sweep-left-{pid}.{old:x}"));
    let young = make(format!("sweep-young-{pid}.{:x}", super::unix_nanos()));
    let busy = std::sync::Arc::new(make(format!("sweep-busy-{pid}.{old:x}")));
    let mut sleeper = {
        use std::os::unix::process::CommandExt;
        let c = busy.clone();
        let mut cmd = std::process::Command::new("sleep");
        cmd.arg("30");
        // SAFETY: `enter` only writes to descriptors opened before the fork.
        unsafe {
            cmd.pre_exec(move || c.enter());
        }
        cmd.spawn().expect("sleep")
    };
    let jail = super::Jail::detect(Path::new("qemu-system-x86_64"));
    assert!(jail.sweep() >= 1, "the empty leftover was not swept");
    assert!(left.dirs().iter().all(|d| !d.exists()));
    assert!(
        young.dirs().iter().all(|d| d.exists()),
        "a cgroup made a moment ago (another daemon's launch in flight) was removed"
    );
    cgroup::remove_dirs(young.dirs());
    assert!(
        busy.dirs().iter().all(|d| d.exists()),
        "a cgroup with a live process was removed"
    );
    sleeper.kill().expect("kill");
    sleeper.wait().expect("wait");
    cgroup::remove_dirs(busy.dirs());
}

/// The `Key:` line of `/proc/PID/status`, its fields.
fn status_field(pid: u32, key: &str) -> Vec<String> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/status")).expect("status");
    text.lines()
        .find_map(|l| l.strip_prefix(&format!("{key}:")))
        .unwrap_or_else(|| panic!("no {key} in /proc/{pid}/status"))
        .split_whitespace()
        .map(str::to_owned)
        .collect()
}

#[tokio::test]
async fn qemu_of_a_root_daemon_runs_as_its_sandboxs_uid_with_only_the_shared_group() {
    let _serial = testkit::SERIAL.lock().await;
    if !root_only("the per-sandbox uid") {
        return;
    }
    let q = skip_unless!(start_paused("jail-user").await);
    let pid = q.vm.pid;
    let shared = super::user::lookup().expect("the tryboxi-vm group exists after a launch");
    let u = super::user::sandbox_ids(&q.vm.dir).expect("the VM dir's uid");
    assert!(u.uid >= super::user::uid_base() && u.uid != shared.uid);
    let uid = u.uid.to_string();
    let gid = u.gid.to_string();
    assert_eq!(
        status_field(pid, "Uid"),
        [uid.clone(), uid.clone(), uid.clone(), uid],
        "QEMU's real, effective, saved and fs uid"
    );
    assert_eq!(
        status_field(pid, "Gid"),
        [gid.clone(), gid.clone(), gid.clone(), gid]
    );
    assert_eq!(
        status_field(pid, "Groups"),
        [shared.gid.to_string()],
        "supplementary groups"
    );
    assert_eq!(status_field(pid, "NoNewPrivs"), ["1"]);
    assert_eq!(status_field(pid, "CapEff"), ["0000000000000000"]);
    // What QEMU made in its directory is its uid's; the directory is root's, shared with
    // the sandbox's own group, sticky.
    let md = std::fs::metadata(q.vm.dir.join("mem.ram")).expect("mem.ram");
    assert_eq!(std::os::unix::fs::MetadataExt::uid(&md), u.uid);
    let md = std::fs::metadata(&q.vm.dir).expect("dir");
    assert_eq!(std::os::unix::fs::MetadataExt::uid(&md), 0);
    assert_eq!(std::os::unix::fs::MetadataExt::gid(&md), u.gid);
    assert_eq!(std::os::unix::fs::MetadataExt::mode(&md) & 0o7777, 0o1770);
    q.end().await;
}

/// Run `sh -c script` as `uid`/`gid` with the supplementary groups `groups` (what an escaped
/// QEMU of that uid could do on the host side of its namespace); whether it succeeded.
fn runs_as(uid: u32, gid: u32, groups: Vec<u32>, script: &str) -> bool {
    use std::os::unix::process::CommandExt;
    let mut cmd = std::process::Command::new("/bin/sh");
    cmd.args(["-c", script])
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null());
    // SAFETY: setgroups/setgid/setuid on integers and a vector made before the fork.
    unsafe {
        cmd.pre_exec(move || {
            if libc::setgroups(groups.len(), groups.as_ptr()) < 0
                || libc::setgid(gid) < 0
                || libc::setuid(uid) < 0
            {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    cmd.status().expect("sh").success()
}

#[tokio::test]
async fn two_sandboxes_qemus_cannot_signal_or_read_each_other() {
    let _serial = testkit::SERIAL.lock().await;
    if !root_only("the per-sandbox uid") {
        return;
    }
    let a = skip_unless!(start_paused("jail-uid-a").await);
    let b = skip_unless!(start_paused("jail-uid-b").await);
    // The temp dirs are root's 0700: open them so that only the fences below stand between
    // the two (a data root is 0755 up to its sandboxes).
    for q in [&a, &b] {
        std::fs::set_permissions(
            q.dir.path(),
            std::os::unix::fs::PermissionsExt::from_mode(0o755),
        )
        .expect("chmod");
    }
    let uid_of = |pid: u32| -> u32 { status_field(pid, "Uid")[0].parse().expect("uid") };
    let (ua, ub) = (uid_of(a.vm.pid), uid_of(b.vm.pid));
    assert_ne!(ua, ub, "two sandboxes' QEMUs share a uid");
    let shared = super::user::lookup().expect("shared group").gid;
    // B's QEMU (its uid, its group, the shared group) against A's.
    let as_b = |script: String| runs_as(ub, ub, vec![shared], &script);
    let ram = a.vm.dir.join("mem.ram");
    let disk = a.vm.dir.join("disk.qcow2");
    // The checks themselves work: root passes them all, B passes them on its own files.
    assert!(runs_as(0, 0, vec![], &format!("kill -0 {}", a.vm.pid)));
    assert!(
        as_b(format!("kill -0 {}", b.vm.pid)),
        "B cannot signal itself"
    );
    assert!(as_b(format!(
        "head -c1 {} >/dev/null",
        b.vm.dir.join("mem.ram").display()
    )));
    assert!(
        !as_b(format!("kill -0 {}", a.vm.pid)),
        "B's uid can signal A's QEMU"
    );
    for f in [&ram, &disk] {
        assert!(
            !as_b(format!("head -c1 {} >/dev/null", f.display())),
            "B's uid can read {}",
            f.display()
        );
        assert!(
            !as_b(format!(": >> {}", f.display())),
            "B's uid can write {}",
            f.display()
        );
    }
    assert!(!as_b(format!("head -c1 /proc/{}/mem", a.vm.pid)));
    b.end().await;
    a.end().await;
}

#[tokio::test]
async fn qemu_sees_only_its_vm_dir_its_images_and_system_files() {
    let _serial = testkit::SERIAL.lock().await;
    let q = skip_unless!(start_paused("jail-ns").await);
    let jail = super::Jail::detect(Path::new("qemu-system-x86_64"));
    if let Err(why) = &jail.ns {
        println!("SKIPPED: no mount namespace for QEMU here: {why}");
        q.end().await;
        return;
    }
    let root = PathBuf::from(format!("/proc/{}/root", q.vm.pid));
    let inside = |p: &Path| root.join(p.strip_prefix("/").expect("absolute"));
    // Its own directory, at the same path, with QEMU's sockets in it.
    assert!(inside(&q.vm.qmp_socket).exists());
    assert!(inside(&q.vm.dir.join("disk.qcow2")).exists());
    // The files it reads outside it: the base image of its disk, its kernel.
    assert!(inside(&q.dir.path().join("base.raw")).exists());
    assert!(inside(&q.dir.path().join("kernel")).exists());
    // Nothing else: not another sandbox's files, not the homes, not /etc or /proc.
    assert!(q.dir.path().join("other/secret").exists());
    assert!(!inside(&q.dir.path().join("other")).exists());
    for hidden in [
        "/root",
        "/home",
        "/etc/passwd",
        "/etc/shadow",
        "/proc",
        "/sys",
        "/var",
    ] {
        assert!(
            !inside(Path::new(hidden)).exists(),
            "{hidden} is visible to QEMU"
        );
    }
    let mut top: Vec<String> = std::fs::read_dir(&root)
        .expect("read QEMU's root")
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .collect();
    top.sort();
    for name in &top {
        assert!(
            [
                "bin", "dev", "etc", "lib", "lib32", "lib64", "sbin", "tmp", "usr"
            ]
            .contains(&name.as_str()),
            "unexpected /{name} in QEMU's root: {top:?}"
        );
    }
    let mut devs: Vec<String> = std::fs::read_dir(root.join("dev"))
        .expect("dev")
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .collect();
    devs.sort();
    assert_eq!(devs, ["null", "random", "urandom", "zero"]);
    // The skeleton is read-only; the VM dir is writable only where QEMU owns files.
    q.end().await;
}

#[test]
fn a_borrowed_ram_file_is_opened_read_only_from_qemu_8_2() {
    use crate::vmm::qemu::{QemuVersion, RamBacking};
    let dir = Path::new("/data/sandboxes/c");
    let spec = VmSpec {
        id: "c".into(),
        dir: dir.into(),
        kernel: "/k".into(),
        initramfs: "/i".into(),
        rootfs: "/r".into(),
        vcpus: 1,
        memory_mib: 256,
        accel: Accel::Tcg,
    };
    let mut paths = VmPaths::new(dir);
    let v = |major, minor| QemuVersion {
        major,
        minor,
        micro: 0,
    };
    let backend = |args: &[OsString]| {
        args.iter()
            .map(|a| a.to_string_lossy().into_owned())
            .find(|a| a.starts_with("memory-backend-file"))
            .expect("memory backend")
    };
    // The VM's own RAM file is shared and written: left as it is.
    let mut args = qemu_args(&spec, &paths);
    assert!(!super::borrowed_ram_read_only(&mut args, &paths, v(10, 0)));
    assert!(backend(&args).ends_with("share=on"));
    paths.ram = RamBacking::Borrowed("/data/sandboxes/p/forks/f/mem.ram".into());
    let mut args = qemu_args(&spec, &paths);
    assert!(!super::borrowed_ram_read_only(&mut args, &paths, v(8, 1)));
    assert!(backend(&args).ends_with("share=off"));
    assert!(super::borrowed_ram_read_only(&mut args, &paths, v(8, 2)));
    assert!(backend(&args).ends_with("share=off,readonly=on,rom=off"));
}

/// QEMU configured as a wrapper script in a folder that also holds the VM directories (the
/// folder is bound read-only, the VM dir read-write under it): the view is built and the
/// wrapper runs inside it. The skeleton once made the VM dir's parents before the folder's
/// bind hid them (`mkdir`: ENOENT, so the VM did not start).
#[test]
fn a_qemu_wrapper_beside_the_vm_dirs_runs_in_its_view() {
    use std::os::unix::process::CommandExt;
    if !root_only("building a mount namespace") {
        return;
    }
    let t = tempfile::tempdir().expect("tmp");
    let vm = t.path().join("sandboxes/a");
    std::fs::create_dir_all(&vm).expect("vm");
    let wrapper = t.path().join("qemu-wrapper");
    std::fs::write(&wrapper, "#!/bin/sh\necho inside > \"$1/seen\"\n").expect("wrapper");
    std::fs::set_permissions(
        &wrapper,
        std::os::unix::fs::PermissionsExt::from_mode(0o755),
    )
    .expect("chmod");
    let real = std::fs::canonicalize(&wrapper).expect("canonical");
    assert_eq!(
        super::qemu_home(&wrapper),
        Some(super::QemuHome::File(real)),
        "a wrapper outside a bin/ folder is bound alone, never its folder"
    );
    let prefix = t.path().join("opt/qemu");
    std::fs::create_dir_all(prefix.join("bin")).expect("prefix");
    std::fs::copy(&wrapper, prefix.join("bin/qemu-system-x86_64")).expect("copy");
    assert_eq!(
        super::qemu_home(&prefix.join("bin/qemu-system-x86_64")),
        Some(super::QemuHome::Prefix(
            std::fs::canonicalize(&prefix).expect("canonical")
        ))
    );
    let plan = super::mountns::Plan::new(&super::mountns::View {
        dir: vm.clone(),
        programs: vec![wrapper.clone()],
        ..Default::default()
    })
    .expect("plan");
    std::fs::create_dir_all(vm.join(super::mountns::STAGE)).expect("stage");
    let plan = std::sync::Arc::new(plan);
    let mut cmd = std::process::Command::new(&wrapper);
    cmd.arg(&vm);
    let p = plan.clone();
    // SAFETY: `enter` makes only system calls on strings built before the fork.
    unsafe {
        cmd.pre_exec(move || p.enter());
    }
    let out = cmd.output().expect("the wrapper did not start in its view");
    assert!(out.status.success(), "{out:?}");
    assert_eq!(read(&vm.join("seen")), "inside");
    // Its folder is read-only in there: only the VM dir is writable.
    let mut cmd = std::process::Command::new("/bin/sh");
    cmd.args(["-c", &format!("echo x > {}/planted", t.path().display())]);
    // SAFETY: as above.
    unsafe {
        cmd.pre_exec(move || plan.enter());
    }
    assert!(!cmd.status().expect("sh").success());
    assert!(!t.path().join("planted").exists());
}
