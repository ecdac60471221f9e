//! Real-QEMU tests of the fences: the process's cgroup and limits.

use std::path::{Path, PathBuf};
use std::time::Duration;

use super::cgroup::{self, Hierarchy, Limits};
use crate::vmm::testkit::{self, skip_unless};
use crate::vmm::{Accel, QemuDriver, VmInfo, VmSpec, VmmDriver};

pub(super) struct Fixture {
    pub driver: QemuDriver,
    pub dir: tempfile::TempDir,
    pub spec: VmSpec,
}

pub(super) fn fixture(id: &str) -> Result<Fixture, String> {
    let kernel = testkit::kernel()?;
    let initramfs = testkit::test_initramfs()?;
    let driver = testkit::driver()?;
    let dir = tempfile::Builder::new()
        .prefix("jail")
        .tempdir()
        .map_err(|e| e.to_string())?;
    let rootfs = testkit::fake_rootfs(dir.path());
    let vm_dir = dir.path().join("v");
    std::fs::create_dir(&vm_dir).map_err(|e| e.to_string())?;
    let spec = VmSpec {
        id: id.into(),
        dir: vm_dir,
        kernel,
        initramfs,
        rootfs,
        vcpus: 2,
        memory_mib: 192,
        accel: Accel::Tcg,
    };
    Ok(Fixture { driver, dir, spec })
}

/// `pid`'s cgroup directory for `ctl` (`""`: the v2 hierarchy), from `/proc/PID/cgroup`.
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
    // `parent` is `<mount>/<base>/tryboxi`; the QEMU's cgroup must be directly below it.
    let mount_dir = parent.parent().expect("parent of the tryboxi cgroup");
    let dir = Path::new("/sys/fs/cgroup").join(path.trim_start_matches('/'));
    let want_prefix = parent.display().to_string();
    let found = if dir.starts_with(parent) {
        dir
    } else {
        // The hierarchy is mounted elsewhere than /sys/fs/cgroup: resolve against its mount.
        let m = mount_dir.ancestors().last().unwrap_or(mount_dir).to_owned();
        m.join(path.trim_start_matches('/'))
    };
    assert!(
        found.starts_with(parent) && found != *parent,
        "QEMU (pid {pid}) is in the {ctl:?} cgroup {path}, not in one of its own under {want_prefix}"
    );
    found
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

async fn stop(f: &Fixture, vm: &VmInfo) {
    f.driver
        .stop(vm, Duration::from_secs(10))
        .await
        .expect("stop");
}

#[tokio::test]
async fn qemu_runs_in_its_own_cgroup_with_limits_from_the_vm_size() {
    let _serial = testkit::SERIAL.lock().await;
    let f = skip_unless!(fixture("jail-cgroup"));
    if !nix::unistd::geteuid().is_root() && std::env::var_os("CI").is_none() {
        println!("SKIPPED: the cgroup fence test needs root outside CI");
        return;
    }
    let h = cgroup::detect(true).expect("cgroup controllers on this host");
    let vm = f.driver.boot(&f.spec).await.expect("boot");
    let want = Limits::for_vm(2, 192, true);
    let dirs: Vec<PathBuf> = match &h {
        Hierarchy::V1 { .. } => {
            let mem = cgroup_dir_of(vm.pid, &h, "memory");
            let pids = cgroup_dir_of(vm.pid, &h, "pids");
            let cpu = cgroup_dir_of(vm.pid, &h, "cpu");
            assert_eq!(
                read(&mem.join("memory.limit_in_bytes")),
                want.memory_bytes.to_string()
            );
            assert_eq!(read(&pids.join("pids.max")), want.pids.to_string());
            assert_eq!(read(&cpu.join("cpu.cfs_quota_us")), "200000");
            assert_eq!(read(&cpu.join("cpu.cfs_period_us")), "100000");
            // Every QEMU thread is in it.
            let threads: u64 = read(&pids.join("pids.current")).parse().expect("pids");
            assert!(threads >= 3, "QEMU has {threads} tasks in its pids cgroup");
            vec![mem, pids, cpu]
        }
        Hierarchy::V2 { .. } => {
            let d = cgroup_dir_of(vm.pid, &h, "");
            assert_eq!(read(&d.join("memory.max")), want.memory_bytes.to_string());
            assert_eq!(read(&d.join("pids.max")), want.pids.to_string());
            assert_eq!(read(&d.join("cpu.max")), "200000 100000");
            vec![d]
        }
    };
    for d in &dirs {
        let name = d.file_name().unwrap().to_string_lossy().into_owned();
        assert!(name.starts_with("jail-cgroup."), "cgroup name {name}");
    }
    stop(&f, &vm).await;
    assert!(testkit::processes_mentioning(f.dir.path()).is_empty());
    assert!(gone(&dirs).await, "QEMU's cgroup outlived it: {dirs:?}");
}

#[tokio::test]
async fn empty_leftover_cgroups_are_swept_and_busy_ones_kept() {
    if !nix::unistd::geteuid().is_root() && std::env::var_os("CI").is_none() {
        println!("SKIPPED: making cgroups needs root outside CI");
        return;
    }
    let h = match cgroup::detect(true) {
        Ok(h) => h,
        Err(e) => {
            println!("SKIPPED: {e}");
            return;
        }
    };
    // A leftover of a QEMU that ended while no daemon ran, and one with a live process.
    let name = format!("sweep-test.{}", std::process::id());
    let left = cgroup::VmCgroup::create(&h, &name, Limits::for_vm(1, 64, false)).expect("make");
    let busy_name = format!("sweep-busy.{}", std::process::id());
    let busy =
        cgroup::VmCgroup::create(&h, &busy_name, Limits::for_vm(1, 64, false)).expect("make");
    let mut sleeper = {
        use std::os::unix::process::CommandExt;
        let b = std::sync::Arc::new(busy);
        let c = b.clone();
        let mut cmd = std::process::Command::new("sleep");
        cmd.arg("30");
        // SAFETY: `enter` only writes to descriptors opened before the fork.
        unsafe {
            cmd.pre_exec(move || c.enter());
        }
        (cmd.spawn().expect("sleep"), b)
    };
    let jail = super::Jail::detect();
    let removed = jail.sweep();
    assert!(removed >= 1, "the empty leftover was not swept");
    assert!(left.dirs().iter().all(|d| !d.exists()));
    assert!(
        sleeper.1.dirs().iter().all(|d| d.exists()),
        "a cgroup with a live process was removed"
    );
    sleeper.0.kill().expect("kill");
    sleeper.0.wait().expect("wait");
    cgroup::remove_dirs(sleeper.1.dirs());
}
