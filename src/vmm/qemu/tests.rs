use std::time::Duration;

use super::*;
use crate::vmm::Accel;
use crate::vmm::testkit::{self, skip_unless};

fn spec(dir: &Path, id: &str) -> VmSpec {
    VmSpec {
        id: id.into(),
        dir: dir.to_owned(),
        kernel: "/k/vmlinuz".into(),
        initramfs: "/k/initramfs.cpio.gz".into(),
        rootfs: "/k/rootfs.ext4".into(),
        vcpus: 2,
        memory_mib: 512,
        accel: Accel::Tcg,
    }
}

fn args_str(args: &[OsString]) -> Vec<String> {
    args.iter()
        .map(|a| a.to_string_lossy().into_owned())
        .collect()
}

/// The value following `flag`, for every occurrence.
fn values_of<'a>(args: &'a [String], flag: &str) -> Vec<&'a str> {
    args.windows(2)
        .filter(|w| w[0] == flag)
        .map(|w| w[1].as_str())
        .collect()
}

#[test]
fn version_is_parsed_from_debian_and_plain_banners() {
    let v = parse_version(
        "QEMU emulator version 10.0.2 (Debian 1:10.0.2+ds-2+deb13u1~bpo12+1)\nCopyright (c) 2003-2025",
    );
    assert_eq!(
        v,
        Some(QemuVersion {
            major: 10,
            minor: 0,
            micro: 2
        })
    );
    assert_eq!(
        parse_version("QEMU emulator version 7.2.15"),
        Some(QemuVersion {
            major: 7,
            minor: 2,
            micro: 15
        })
    );
    assert_eq!(
        parse_version("QEMU emulator version 8.1.0-rc2"),
        Some(QemuVersion {
            major: 8,
            minor: 1,
            micro: 0
        })
    );
    assert_eq!(parse_version("bash: qemu: not found"), None);
    assert_eq!(parse_version(""), None);
}

#[test]
fn versions_older_than_7_2_are_below_the_minimum() {
    let v = |major, minor, micro| QemuVersion {
        major,
        minor,
        micro,
    };
    assert!(v(7, 1, 9) < MIN_VERSION);
    assert!(v(6, 2, 0) < MIN_VERSION);
    assert!(v(7, 2, 0) >= MIN_VERSION);
    assert!(v(10, 0, 2) >= MIN_VERSION);
}

#[test]
fn command_line_has_devices_sockets_and_accel() {
    let dir = Path::new("/data/vms/sbx_1");
    let paths = VmPaths::new(dir);
    let a = args_str(&qemu_args(&spec(dir, "sbx_1"), &paths));
    assert_eq!(values_of(&a, "-accel"), ["tcg"]);
    assert_eq!(values_of(&a, "-cpu"), ["max"]);
    assert_eq!(values_of(&a, "-smp"), ["2"]);
    assert_eq!(values_of(&a, "-m"), ["512M"]);
    assert!(values_of(&a, "-M")[0].starts_with("microvm,acpi=off"));
    assert!(a.iter().any(|s| s == "-no-reboot"));
    assert!(a.iter().any(|s| s == "-nodefaults"));
    assert_eq!(values_of(&a, "-kernel"), ["/k/vmlinuz"]);
    assert_eq!(values_of(&a, "-initrd"), ["/k/initramfs.cpio.gz"]);
    let append = values_of(&a, "-append")[0];
    assert!(append.contains("console=ttyS0"));
    assert!(append.contains("tryboxi.root=serial:tryboxi-root"));
    assert!(append.contains("tryboxi.hostname=sbx_1"));
    let drive = values_of(&a, "-drive")[0];
    assert!(drive.starts_with("file=/data/vms/sbx_1/disk.qcow2,format=qcow2,"));
    let chardevs = values_of(&a, "-chardev");
    assert!(
        chardevs.contains(&"socket,id=agent,path=/data/vms/sbx_1/agent.sock,server=on,wait=off")
    );
    assert!(chardevs.contains(&"socket,id=qmp,path=/data/vms/sbx_1/qmp.sock,server=on,wait=off"));
    assert!(
        chardevs.contains(&"socket,id=console,path=/data/vms/sbx_1/tty.sock,server=on,wait=off")
    );
    let devices = values_of(&a, "-device");
    assert!(devices.contains(&"virtio-blk-device,drive=root,serial=tryboxi-root"));
    assert!(devices.contains(&"virtio-blk-device,drive=xfer,serial=tryboxi-xfer"));
    assert!(devices.contains(&"virtio-blk-device,drive=wsbase,serial=tryboxi-wsbase"));
    assert!(
        values_of(&a, "-drive")
            .contains(&"file=/data/vms/sbx_1/wsbase.img,format=raw,if=none,id=wsbase,readonly=on")
    );
    assert!(devices.contains(&"virtserialport,chardev=agent,name=tryboxi.agent"));
    assert!(devices.contains(&"virtio-rng-device"));
    assert!(
        devices.contains(&"virtio-net-device,netdev=net0,mac=52:54:00:0a:00:0f,guest_announce=off")
    );
    assert_eq!(
        values_of(&a, "-netdev"),
        [
            "stream,id=net0,server=off,addr.type=unix,addr.path=/data/vms/sbx_1/net.sock,reconnect-ms=200"
        ]
    );
    assert_eq!(values_of(&a, "-pidfile"), ["/data/vms/sbx_1/qemu.pid"]);

    let kvm = VmSpec {
        accel: Accel::Kvm,
        ..spec(dir, "sbx_1")
    };
    let a = args_str(&qemu_args(&kvm, &paths));
    assert_eq!(values_of(&a, "-accel"), ["kvm"]);
    assert_eq!(values_of(&a, "-cpu"), ["host"]);
}

#[test]
fn commas_in_paths_are_doubled_in_option_values() {
    let dir = Path::new("/data/a,b");
    let a = args_str(&qemu_args(&spec(dir, "x"), &VmPaths::new(dir)));
    assert!(values_of(&a, "-drive")[0].starts_with("file=/data/a,,b/disk.qcow2,format"));
    // -pidfile is a plain argument, not an option string: no escaping there.
    assert_eq!(values_of(&a, "-pidfile"), ["/data/a,b/qemu.pid"]);
}

#[test]
fn long_socket_paths_and_odd_ids_are_refused() {
    let long = PathBuf::from(format!("/{}", "d".repeat(100)));
    assert!(VmPaths::new(&long).check_socket_lengths().is_err());
    assert!(
        VmPaths::new(Path::new("/tmp/vm"))
            .check_socket_lengths()
            .is_ok()
    );
    assert!(check_id("sbx_01H-x").is_ok());
    assert!(check_id("a b").is_err());
    assert!(check_id("x panic=1").is_err());
    assert!(check_id("").is_err());
}

#[test]
fn cmdline_guard_accepts_only_our_qemu_for_this_dir() {
    let dir = Path::new("/data/vms/sbx_1");
    let ours = b"/usr/bin/qemu-system-x86_64\0-M\0microvm\0-pidfile\0/data/vms/sbx_1/qemu.pid\0";
    assert!(cmdline_matches(ours, dir));
    // Same QEMU, another VM.
    assert!(!cmdline_matches(ours, Path::new("/data/vms/sbx_2")));
    // A prefix of the dir is not the dir.
    assert!(!cmdline_matches(ours, Path::new("/data/vms/sbx")));
    // The pid now belongs to something else that merely mentions the path.
    assert!(!cmdline_matches(
        b"vim\0-pidfile\0/data/vms/sbx_1/qemu.pid\0",
        dir
    ));
    // A zombie's cmdline is empty.
    assert!(!cmdline_matches(b"", dir));
}

#[tokio::test]
async fn reused_pid_is_not_alive_and_is_never_killed() {
    // A real process that is not QEMU stands at the recorded pid.
    let mut other = std::process::Command::new("sleep")
        .arg("30")
        .spawn()
        .expect("spawn sleep");
    let t = tempfile::tempdir().expect("tempdir");
    let vm = VmInfo {
        id: "x".into(),
        dir: t.path().to_owned(),
        pid: other.id(),
        accel: Accel::Tcg,
        agent_socket: t.path().join("agent.sock"),
        qmp_socket: t.path().join("qmp.sock"),
        console_log: t.path().join("console.log"),
    };
    let d = QemuDriver {
        binary: "qemu-system-x86_64".into(),
        version: MIN_VERSION,
        boot_timeout: BOOT_TIMEOUT,
        log_cap: DEFAULT_LOG_CAP,
        followers: Default::default(),
        jail: std::sync::Arc::new(crate::vmm::jail::Jail::detect(Path::new(
            "qemu-system-x86_64",
        ))),
        reserve_ram: true,
        disk_budget: None,
        data_root: t.path().to_owned(),
    };
    assert!(!d.is_alive(&vm));
    d.kill(&vm).await.expect("kill is a no-op");
    d.stop(&vm, Duration::from_millis(100))
        .await
        .expect("stop is a no-op");
    assert_eq!(
        other.try_wait().expect("try_wait"),
        None,
        "the stranger must survive"
    );
    other.kill().expect("kill sleep");
    other.wait().expect("reap");
}

#[test]
fn new_refuses_a_binary_that_is_not_qemu() {
    assert!(matches!(
        QemuDriver::new("/nonexistent/qemu"),
        Err(VmmError::Spawn { .. })
    ));
    // `true` runs but prints no version.
    assert!(matches!(QemuDriver::new("true"), Err(VmmError::Other(_))));
}

// ---- Real QEMU (TCG) tests: skip with a reason when no kernel is available. ----

struct Fixture {
    driver: QemuDriver,
    dir: tempfile::TempDir,
    spec: VmSpec,
}

fn fixture(id: &str) -> Result<Fixture, String> {
    let kernel = testkit::kernel()?;
    let initramfs = testkit::test_initramfs()?;
    let driver = testkit::driver()?;
    let dir = tempfile::Builder::new()
        .prefix("vm")
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
        vcpus: 1,
        memory_mib: 256,
        accel: Accel::Tcg,
    };
    Ok(Fixture { driver, dir, spec })
}

const GUEST: Duration = Duration::from_secs(60);

#[tokio::test]
async fn tcg_vm_boots_runs_and_stops_leaving_nothing_running() {
    let _serial = testkit::SERIAL.lock().await;
    let f = skip_unless!(fixture("boot-stop"));
    let base_before = std::fs::read(&f.spec.rootfs).expect("read base");
    let t0 = Instant::now();
    let vm = f.driver.boot(&f.spec).await.expect("boot");
    println!("QEMU launch -> QMP running: {:?}", t0.elapsed());
    assert!(f.driver.is_alive(&vm));
    assert!(vm.agent_socket.exists());

    let recorded: VmInfo =
        serde_json::from_slice(&std::fs::read(vm.dir.join("vm.json")).expect("vm.json"))
            .expect("parse vm.json");
    assert_eq!(recorded.pid, vm.pid);
    let pidfile = std::fs::read_to_string(vm.dir.join("qemu.pid")).expect("pidfile");
    assert_eq!(pidfile.trim(), vm.pid.to_string());

    // QEMU is in its own session, so it survives the daemon's terminal and process group.
    let sid = nix::unistd::getsid(Some(nix::unistd::Pid::from_raw(vm.pid as i32))).expect("getsid");
    assert_eq!(sid.as_raw(), vm.pid as i32);

    let c = QmpClient::connect(&vm.qmp_socket, QMP_TIMEOUT)
        .await
        .expect("qmp");
    assert_eq!(c.query_status().await.expect("status").status, "running");
    drop(c);
    assert!(
        testkit::wait_for_text(&vm.console_log, "TRYBOXI_TEST_READY", GUEST).await,
        "the guest init did not run: {}",
        tail(&vm.console_log, 2000)
    );
    println!(
        "QEMU launch -> guest /init on the console: {:?}",
        t0.elapsed()
    );

    let t1 = Instant::now();
    f.driver
        .stop(&vm, Duration::from_secs(10))
        .await
        .expect("stop");
    println!("stop (QMP quit -> exit): {:?}", t1.elapsed());
    assert!(!f.driver.is_alive(&vm));
    assert!(testkit::processes_mentioning(f.dir.path()).is_empty());
    f.driver
        .stop(&vm, Duration::from_secs(1))
        .await
        .expect("stop again");
    // The base was never written; the overlay is a qcow2 over it.
    assert_eq!(
        std::fs::read(&f.spec.rootfs).expect("read base"),
        base_before
    );
    let disk = std::fs::read(vm.dir.join("disk.qcow2")).expect("overlay");
    assert_eq!(&disk[..4], b"QFI\xfb");
}

#[tokio::test]
async fn kill_ends_the_vm_at_once_and_is_idempotent() {
    let _serial = testkit::SERIAL.lock().await;
    let f = skip_unless!(fixture("kill"));
    let vm = f.driver.boot(&f.spec).await.expect("boot");
    f.driver.kill(&vm).await.expect("kill");
    assert!(!f.driver.is_alive(&vm));
    f.driver.kill(&vm).await.expect("kill again");
    assert!(testkit::processes_mentioning(f.dir.path()).is_empty());
    // Files stay: deleting the VM dir is the caller's job.
    assert!(vm.dir.join("disk.qcow2").exists());
    assert!(vm.dir.join("vm.json").exists());
    assert!(
        f.driver
            .reattach(&vm.dir)
            .await
            .expect("reattach")
            .is_none()
    );
}

#[tokio::test]
async fn reattach_finds_the_vm_after_the_driver_is_dropped() {
    let _serial = testkit::SERIAL.lock().await;
    let f = skip_unless!(fixture("reattach"));
    let vm = f.driver.boot(&f.spec).await.expect("boot");
    let Fixture { driver, dir, spec } = f;
    drop(driver);
    let fresh = skip_unless!(testkit::driver());
    let found = fresh
        .reattach(&spec.dir)
        .await
        .expect("reattach")
        .expect("still running");
    assert_eq!(found.pid, vm.pid);
    assert_eq!(found.qmp_socket, vm.qmp_socket);
    fresh
        .stop(&found, Duration::from_secs(10))
        .await
        .expect("stop");
    assert!(fresh.reattach(&spec.dir).await.expect("reattach").is_none());
    assert!(testkit::processes_mentioning(dir.path()).is_empty());
}

#[tokio::test]
async fn qemu_failing_at_startup_is_boot_failed_with_its_log() {
    let _serial = testkit::SERIAL.lock().await;
    let mut f = skip_unless!(fixture("badkernel"));
    let bad = f.dir.path().join("garbage-kernel");
    std::fs::write(&bad, vec![0x5au8; 4096]).expect("write");
    f.spec.kernel = bad;
    match f.driver.boot(&f.spec).await {
        Err(VmmError::BootFailed(msg)) => {
            assert!(msg.contains("qemu.log"), "{msg}");
            println!("BootFailed as expected: {msg}");
        }
        other => panic!("expected BootFailed, got {other:?}"),
    }
    assert!(testkit::processes_mentioning(f.dir.path()).is_empty());
}

#[tokio::test]
async fn guest_panic_ends_qemu_and_nothing_is_left() {
    // `tryboxi.hostname=exit...` makes the test init exit: PID 1 dies, the kernel panics and
    // with panic=-1, reboot=t and -no-reboot QEMU exits by itself.
    let _serial = testkit::SERIAL.lock().await;
    let f = skip_unless!(fixture("exit-now"));
    match f.driver.boot(&f.spec).await {
        // QMP may well answer before the guest kernel reaches /init.
        Ok(vm) => {
            let p = our_process(&vm);
            if let Some(p) = p {
                assert!(
                    p.wait_exit(GUEST).await.expect("wait"),
                    "QEMU did not exit after the panic"
                );
            }
            assert!(!f.driver.is_alive(&vm));
            let console = tail(&vm.console_log, 4000);
            assert!(console.contains("TRYBOXI_TEST_EXIT"), "{console}");
        }
        Err(VmmError::BootFailed(msg)) => assert!(msg.contains("TRYBOXI_TEST_EXIT"), "{msg}"),
        Err(e) => panic!("unexpected error {e}"),
    }
    assert!(testkit::processes_mentioning(f.dir.path()).is_empty());
}

#[tokio::test]
async fn real_images_verify_and_boot_or_fail_cleanly() {
    // The real kernel + initramfs + rootfs from the image builder. Whether the guest agent
    // stays up depends on the initramfs of the day; either way QEMU must have run, the result
    // must be Ok or BootFailed, and nothing may be left running afterwards.
    let _serial = testkit::SERIAL.lock().await;
    let artifacts = skip_unless!(testkit::artifacts());
    let images =
        skip_unless!(crate::vmm::images::Images::load(&artifacts).map_err(|e| e.to_string()));
    images.verify(false).expect("sizes match the manifest");
    let driver = skip_unless!(testkit::driver());
    let dir = tempfile::Builder::new()
        .prefix("vm")
        .tempdir()
        .expect("tempdir");
    let spec = VmSpec {
        id: "real".into(),
        dir: dir.path().to_owned(),
        kernel: images.kernel.clone(),
        initramfs: images.initramfs.clone(),
        rootfs: images.rootfs.clone(),
        vcpus: 1,
        memory_mib: 512,
        accel: Accel::Tcg,
    };
    let t0 = Instant::now();
    match driver.boot(&spec).await {
        Ok(vm) => {
            println!("real images: QMP running after {:?}", t0.elapsed());
            // Give the guest time to reach its init (or to panic), then look at the console.
            if let Some(p) = our_process(&vm) {
                let exited = p.wait_exit(Duration::from_secs(20)).await.expect("wait");
                println!("real images: QEMU exited by itself within 20 s: {exited}");
            }
            println!("real images console tail:\n{}", tail(&vm.console_log, 1500));
            driver
                .stop(&vm, Duration::from_secs(10))
                .await
                .expect("stop");
            assert!(!driver.is_alive(&vm));
        }
        Err(VmmError::BootFailed(msg)) => println!("real images: BootFailed: {msg}"),
        Err(e) => panic!("boot with the real images failed unexpectedly: {e}"),
    }
    assert!(testkit::processes_mentioning(dir.path()).is_empty());
}

#[test]
fn ram_is_a_shared_file_for_own_vms_and_private_for_clones() {
    let dir = Path::new("/data/vms/sbx_1");
    let mut paths = VmPaths::new(dir);
    let a = args_str(&qemu_args(&spec(dir, "sbx_1"), &paths));
    assert_eq!(
        values_of(&a, "-M"),
        ["microvm,acpi=off,memory-backend=ram0"]
    );
    assert_eq!(
        values_of(&a, "-object"),
        ["memory-backend-file,id=ram0,size=512M,mem-path=/data/vms/sbx_1/mem.ram,share=on"]
    );
    paths.ram = RamBacking::Borrowed("/data/vms/sbx_0/forks/f,1/mem.ram".into());
    let a = args_str(&qemu_args(&spec(dir, "sbx_1"), &paths));
    assert_eq!(
        values_of(&a, "-object"),
        [
            "memory-backend-file,id=ram0,size=512M,mem-path=/data/vms/sbx_0/forks/f,,1/mem.ram,share=off"
        ]
    );
    // The KVM probe keeps plain RAM.
    let probe = args_str(&machine_args(Accel::Tcg, 1, 64));
    assert_eq!(values_of(&probe, "-M"), ["microvm,acpi=off"]);
}

#[test]
fn free_page_reporting_only_where_a_discard_cannot_punch_a_shared_file() {
    let dir = Path::new("/data/vms/sbx_1");
    let v = |major, minor| QemuVersion {
        major,
        minor,
        micro: 0,
    };
    let balloons = |args: &[OsString]| {
        values_of(&args_str(args), "-device")
            .into_iter()
            .filter(|d| d.starts_with("virtio-balloon-device"))
            .map(str::to_owned)
            .collect::<Vec<_>>()
    };
    // One balloon device, last of the devices, reporting on.
    let mut args = qemu_args(&spec(dir, "sbx_1"), &VmPaths::new(dir));
    assert_eq!(balloons(&args), [BALLOON_DEVICE]);
    let all = args_str(&args);
    assert_eq!(values_of(&all, "-device").last(), Some(&BALLOON_DEVICE));
    assert!(super::args::page_reporting_where_safe(&mut args, v(10, 0)));
    assert!(super::args::page_reporting_where_safe(&mut args, v(8, 2)));
    assert_eq!(balloons(&args), [BALLOON_DEVICE]);
    // A QEMU that opens a clone's borrowed RAM file read-write would punch it: the device
    // stays (same device set for every VM) but without reporting.
    assert!(!super::args::page_reporting_where_safe(&mut args, v(8, 1)));
    assert_eq!(balloons(&args), [BALLOON_DEVICE_NO_REPORTING]);
}

#[test]
fn tcg_guests_get_the_host_tsc_rate_and_apic_timer_rate_and_kvm_guests_do_not() {
    let dir = Path::new("/data/vms/sbx_1");
    let paths = VmPaths::new(dir);
    let tcg = args_str(&qemu_args(&spec(dir, "sbx_1"), &paths));
    let append = values_of(&tcg, "-append")[0];
    match crate::vmm::tsc::host_khz() {
        Some(khz) => assert!(
            append.ends_with(&format!(
                " lapic_timer_hz=1000000000 tsc_early_khz={khz} tsc=reliable"
            )),
            "{append}"
        ),
        None => {
            println!("no TSC rate measured on this host: TCG guests calibrate as before");
            assert!(!append.contains("tsc_early_khz"), "{append}");
            assert!(append.ends_with(" lapic_timer_hz=1000000000"), "{append}");
        }
    }
    let kvm = VmSpec {
        accel: Accel::Kvm,
        ..spec(dir, "sbx_1")
    };
    let a = args_str(&qemu_args(&kvm, &paths));
    assert!(!values_of(&a, "-append")[0].contains("tsc"), "{a:?}");
    assert!(!values_of(&a, "-append")[0].contains("lapic"), "{a:?}");
}

#[test]
fn every_guest_and_the_probe_skip_the_boot_timer_check() {
    // Without it a loaded TCG host can make the guest kernel panic in `check_timer`.
    let cmdline = super::args::kernel_cmdline("sbx_x");
    assert!(
        cmdline.split(' ').any(|p| p == "no_timer_check"),
        "{cmdline}"
    );
    assert!(
        crate::vmm::probe::PROBE_CMDLINE
            .split(' ')
            .any(|p| p == "no_timer_check")
    );
}
