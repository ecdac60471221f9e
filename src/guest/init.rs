//! PID 1 duties before the agent serves: mounts, switch_root, hostname, loopback, network
//! (`net.rs`), power off.
//!
//! Owns the guest's early boot. Runs only as PID 1 inside a VM (never in tests, never on the
//! host) and touches no disk before the `tryboxi.probe` check. Loads nothing from the network.

use nix::mount::{MsFlags, mount};

use crate::rpc::msg::{ErrorKind, RemoteError};
use std::io::Write;
use std::path::Path;
use std::time::{Duration, Instant};

#[derive(Debug, thiserror::Error)]
pub enum InitError {
    #[error("mount {what} on {target}: {source}; check the guest kernel config")]
    Mount {
        what: String,
        target: String,
        source: nix::Error,
    },
    #[error("root disk {0} did not appear within 10 s; is the virtio-blk device attached?")]
    NoRoot(String),
    #[error("{0}: {1}")]
    Sys(&'static str, std::io::Error),
    #[error("the workspace overlay of this disk cannot be mounted again: {0}")]
    Workspace(String),
}

/// Options from the kernel command line.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Cmdline {
    pub hostname: String,
    pub port: String,
    pub probe: bool,
    pub root: String,
}

impl Cmdline {
    pub fn parse(s: &str) -> Self {
        let mut c = Cmdline {
            hostname: "sandbox".into(),
            port: "tryboxi.agent".into(),
            probe: false,
            root: "/dev/vda".into(),
        };
        for w in s.split_whitespace() {
            if let Some(v) = w.strip_prefix("tryboxi.hostname=") {
                c.hostname = v.into();
            } else if let Some(v) = w.strip_prefix("tryboxi.port=") {
                c.port = v.into();
            } else if let Some(v) = w.strip_prefix("tryboxi.root=") {
                c.root = v.into();
            } else if w == "tryboxi.probe=1" {
                c.probe = true;
            }
        }
        c
    }
}

/// Writes one line to the console (the VMM driver watches the serial log).
pub fn console(line: &str) {
    match std::fs::OpenOptions::new().write(true).open("/dev/console") {
        Ok(mut f) => {
            let _ = writeln!(f, "{line}");
        }
        Err(_) => eprintln!("{line}"),
    }
}

/// Syncs disks and ends the VM. A reboot, not a power-off: microvm without ACPI only halts on
/// power-off, while QEMU runs with `-no-reboot` (and the kernel with `reboot=t`), so a reboot
/// ends it.
pub fn power_off() -> ! {
    nix::unistd::sync();
    let _ = nix::sys::reboot::reboot(nix::sys::reboot::RebootMode::RB_AUTOBOOT);
    let _ = nix::sys::reboot::reboot(nix::sys::reboot::RebootMode::RB_POWER_OFF);
    loop {
        std::thread::sleep(Duration::from_secs(3600));
    }
}

fn mnt(
    src: &str,
    target: &str,
    fstype: Option<&str>,
    flags: MsFlags,
    data: Option<&str>,
) -> Result<(), InitError> {
    let _ = std::fs::create_dir_all(target);
    match mount(Some(src), target, fstype, flags, data) {
        Ok(()) | Err(nix::Error::EBUSY) => Ok(()),
        Err(e) => Err(InitError::Mount {
            what: fstype.unwrap_or(src).to_string(),
            target: target.into(),
            source: e,
        }),
    }
}

/// Mounts /proc (needed to read the command line) and returns the parsed command line.
pub fn proc_and_cmdline() -> Result<Cmdline, InitError> {
    let nodev = MsFlags::MS_NOSUID | MsFlags::MS_NODEV | MsFlags::MS_NOEXEC;
    mnt("proc", "/proc", Some("proc"), nodev, None)?;
    let s = std::fs::read_to_string("/proc/cmdline")
        .map_err(|e| InitError::Sys("read /proc/cmdline", e))?;
    Ok(Cmdline::parse(&s))
}

/// The root device named by `tryboxi.root=`, once it exists: a device path, or
/// `serial:NAME` for the virtio-blk disk whose `/sys/block/*/serial` is NAME (robust against
/// the order the kernel enumerates virtio-mmio devices in, which need not be the order of the
/// QEMU command line once there is more than one disk).
fn find_root(spec: &str) -> Option<String> {
    match spec.strip_prefix("serial:") {
        Some(serial) => block_dev_with_serial(Path::new("/sys/block"), serial)
            .map(|name| format!("/dev/{name}"))
            .filter(|dev| Path::new(dev).exists()),
        None => Path::new(spec).exists().then(|| spec.to_string()),
    }
}

/// The name (`vda`, ...) of the block device under `sys_block` whose `serial` is `serial`.
fn block_dev_with_serial(sys_block: &Path, serial: &str) -> Option<String> {
    std::fs::read_dir(sys_block)
        .ok()?
        .flatten()
        .find_map(|ent| {
            let s = std::fs::read_to_string(ent.path().join("serial")).ok()?;
            (s.trim() == serial).then(|| ent.file_name().to_string_lossy().into_owned())
        })
}

/// Mounts the root disk and switches into it, then sets up the rest of the system.
pub fn boot(cmd: &Cmdline) -> Result<(), InitError> {
    let nodev = MsFlags::MS_NOSUID | MsFlags::MS_NODEV | MsFlags::MS_NOEXEC;
    mnt("sysfs", "/sys", Some("sysfs"), nodev, None)?;
    mnt(
        "devtmpfs",
        "/dev",
        Some("devtmpfs"),
        MsFlags::MS_NOSUID,
        Some("mode=0755"),
    )?;

    let t0 = Instant::now();
    let root = loop {
        if let Some(dev) = find_root(&cmd.root) {
            break dev;
        }
        if t0.elapsed() > Duration::from_secs(10) {
            return Err(InitError::NoRoot(cmd.root.clone()));
        }
        std::thread::sleep(Duration::from_millis(10));
    };
    mnt(&root, "/newroot", Some("ext4"), MsFlags::empty(), None)?;
    for d in ["dev", "proc", "sys"] {
        let target = format!("/newroot/{d}");
        mnt(&format!("/{d}"), &target, None, MsFlags::MS_MOVE, None)?;
    }
    // The initramfs switch_root dance (the initramfs itself is not freed).
    std::env::set_current_dir("/newroot").map_err(|e| InitError::Sys("chdir /newroot", e))?;
    mnt(".", "/", None, MsFlags::MS_MOVE, None)?;
    nix::unistd::chroot(".").map_err(|e| InitError::Sys("chroot", e.into()))?;
    std::env::set_current_dir("/").map_err(|e| InitError::Sys("chdir /", e))?;

    mnt(
        "devpts",
        "/dev/pts",
        Some("devpts"),
        MsFlags::MS_NOSUID | MsFlags::MS_NOEXEC,
        Some("gid=5,mode=0620,ptmxmode=0666"),
    )?;
    if std::fs::symlink_metadata("/dev/ptmx").is_err() {
        let _ = std::os::unix::fs::symlink("pts/ptmx", "/dev/ptmx");
    }
    mnt(
        "tmpfs",
        "/dev/shm",
        Some("tmpfs"),
        MsFlags::MS_NOSUID | MsFlags::MS_NODEV,
        Some("mode=1777"),
    )?;
    mnt(
        "tmpfs",
        "/tmp",
        Some("tmpfs"),
        MsFlags::MS_NOSUID | MsFlags::MS_NODEV,
        Some("mode=1777"),
    )?;
    mnt(
        "tmpfs",
        "/run",
        Some("tmpfs"),
        MsFlags::MS_NOSUID | MsFlags::MS_NODEV,
        Some("mode=0755"),
    )?;
    if let Err(e) = mnt("cgroup2", "/sys/fs/cgroup", Some("cgroup2"), nodev, None) {
        tracing::warn!(error = %e, "no cgroup2");
    }
    if let Err(e) = nix::unistd::sethostname(&cmd.hostname) {
        tracing::warn!(error = %e, "sethostname");
    }
    if let Err(e) = loopback_up() {
        tracing::warn!(error = %e, "lo up");
    }
    if let Err(e) = super::net::configure() {
        // The sandbox still works, just without network.
        console(&format!("tryboxi: network setup failed: {e}"));
    }
    std::fs::create_dir_all("/workspace").map_err(|e| InitError::Sys("mkdir /workspace", e))?;
    // A boot on a disk whose workspace was an overlay on the base disk (a filesystem-only
    // pause, a reboot): mounted again before the host can look, or no boot at all.
    match super::wsbase::remount_after_boot() {
        Ok(true) => console("tryboxi: workspace overlay mounted again"),
        Ok(false) => {}
        Err(e) => return Err(InitError::Workspace(e.to_string())),
    }
    match std::fs::OpenOptions::new().write(true).open("/dev/urandom") {
        Ok(f) => {
            let _ = URANDOM.set(f);
        }
        Err(e) => tracing::warn!(error = %e, "open /dev/urandom"),
    }
    Ok(())
}

/// `/dev/urandom`, opened at boot and kept: a clone's [`set_identity`] then only writes to it.
/// Under TCG a clone translates every kernel path it runs for the first time; the open and
/// close of the device were about half of that request's ~10 ms of emulation.
static URANDOM: std::sync::OnceLock<std::fs::File> = std::sync::OnceLock::new();

/// Most bytes of a hostname (the kernel's `__NEW_UTS_LEN`).
const MAX_HOSTNAME: usize = 64;

/// Make a clone its own machine (`Request::SetIdentity`): its hostname, and fresh randomness
/// mixed into the kernel's pool (clones of one snapshot would otherwise share the pool's
/// state). Writing to `/dev/urandom` mixes without crediting entropy, as from a shell.
pub fn set_identity(hostname: &str, seed: &[u8]) -> Result<(), RemoteError> {
    check_hostname(hostname)?;
    nix::unistd::sethostname(hostname).map_err(|e| {
        RemoteError::from_io("sethostname", &std::io::Error::from_raw_os_error(e as i32))
    })?;
    match URANDOM.get() {
        Some(mut f) => f.write_all(seed),
        None => std::fs::OpenOptions::new()
            .write(true)
            .open("/dev/urandom")
            .and_then(|mut f| f.write_all(seed)),
    }
    .map_err(|e| RemoteError::from_io("/dev/urandom", &e))
}

/// Earliest and latest wall clock the host may set (2020-01-01 and 2200-01-01, Unix ms): a
/// value outside is a bug or a hostile host, not a clock.
const CLOCK_MIN_MS: u64 = 1_577_836_800_000;
const CLOCK_MAX_MS: u64 = 7_258_118_400_000;

/// Set `CLOCK_REALTIME` to `unix_ms` (`Request::SetClock`): a VM restored from a snapshot
/// otherwise keeps the snapshot's time, and certificates minted since look not yet valid.
pub fn set_clock(unix_ms: u64) -> Result<(), RemoteError> {
    if !(CLOCK_MIN_MS..=CLOCK_MAX_MS).contains(&unix_ms) {
        return Err(RemoteError::new(
            ErrorKind::InvalidRequest,
            format!("clock value {unix_ms} ms is outside 2020..2200"),
        ));
    }
    let ts = libc::timespec {
        // Both fit: bounded above to 2200 in ms, and the remainder is < 1e9 ns.
        tv_sec: (unix_ms / 1000) as libc::time_t,
        tv_nsec: ((unix_ms % 1000) * 1_000_000) as libc::c_long,
    };
    // SAFETY: `ts` is a valid, initialised timespec that outlives the call; the kernel only
    // reads it.
    let rc = unsafe { libc::clock_settime(libc::CLOCK_REALTIME, &ts) };
    if rc != 0 {
        return Err(RemoteError::from_io(
            "clock_settime",
            &std::io::Error::last_os_error(),
        ));
    }
    Ok(())
}

/// A hostname the host may set: 1-64 bytes of `[A-Za-z0-9_.-]`.
fn check_hostname(name: &str) -> Result<(), RemoteError> {
    let ok = !name.is_empty()
        && name.len() <= MAX_HOSTNAME
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.'));
    if ok {
        Ok(())
    } else {
        Err(RemoteError::new(
            ErrorKind::InvalidRequest,
            format!("not a valid hostname: {name:?}"),
        ))
    }
}

/// The environment every exec starts from.
pub fn default_env() -> Vec<(String, String)> {
    [
        (
            "PATH",
            "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
        ),
        ("HOME", "/root"),
        ("LANG", "C.UTF-8"),
        ("USER", "root"),
        ("SHELL", "/bin/bash"),
    ]
    .iter()
    .map(|(k, v)| (k.to_string(), v.to_string()))
    .collect()
}

fn loopback_up() -> std::io::Result<()> {
    // SAFETY: a plain datagram socket used only for the two ioctls below, closed at the end.
    let fd = unsafe { libc::socket(libc::AF_INET, libc::SOCK_DGRAM | libc::SOCK_CLOEXEC, 0) };
    if fd < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: ifreq is plain data; zeroed is a valid value.
    let mut ifr: libc::ifreq = unsafe { std::mem::zeroed() };
    for (i, b) in b"lo".iter().enumerate() {
        ifr.ifr_name[i] = *b as libc::c_char;
    }
    // SAFETY: SIOCGIFFLAGS/SIOCSIFFLAGS read and write the ifreq we own; fd is valid.
    let r = unsafe {
        if libc::ioctl(fd, libc::SIOCGIFFLAGS, &mut ifr) < 0 {
            -1
        } else {
            ifr.ifr_ifru.ifru_flags |= (libc::IFF_UP | libc::IFF_RUNNING) as libc::c_short;
            libc::ioctl(fd, libc::SIOCSIFFLAGS, &ifr)
        }
    };
    let err = std::io::Error::last_os_error();
    // SAFETY: fd is ours and closed once.
    unsafe { libc::close(fd) };
    if r < 0 { Err(err) } else { Ok(()) }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cmdline_options_are_parsed_with_defaults() {
        let c = Cmdline::parse("console=ttyS0 tryboxi.hostname=box1 tryboxi.probe=1");
        assert_eq!(c.hostname, "box1");
        assert!(c.probe);
        assert_eq!(c.port, "tryboxi.agent");
        assert_eq!(c.root, "/dev/vda");
        let d = Cmdline::parse("tryboxi.port=p2 tryboxi.root=/dev/vdb");
        assert_eq!(
            (d.port.as_str(), d.root.as_str(), d.probe),
            ("p2", "/dev/vdb", false)
        );
        assert_eq!(d.hostname, "sandbox");
    }

    #[test]
    fn root_by_serial_picks_the_disk_with_that_serial_whatever_its_name() {
        let t = tempfile::tempdir().unwrap();
        for (name, serial) in [("vda", "tryboxi-xfer\n"), ("vdb", "tryboxi-root\n")] {
            std::fs::create_dir(t.path().join(name)).unwrap();
            std::fs::write(t.path().join(name).join("serial"), serial).unwrap();
        }
        std::fs::create_dir(t.path().join("loop0")).unwrap();
        assert_eq!(
            block_dev_with_serial(t.path(), "tryboxi-root").as_deref(),
            Some("vdb")
        );
        assert_eq!(
            block_dev_with_serial(t.path(), "tryboxi-xfer").as_deref(),
            Some("vda")
        );
        assert_eq!(block_dev_with_serial(t.path(), "other"), None);
    }

    #[test]
    fn identity_hostnames_are_checked_before_anything_is_set() {
        for good in ["sbx_0123456789abcdef", "a", "box-1.local", &"x".repeat(64)] {
            assert!(check_hostname(good).is_ok(), "{good}");
        }
        for bad in ["", "a b", "a/b", "a\nb", "ü", &"x".repeat(65)] {
            let e = check_hostname(bad).unwrap_err();
            assert_eq!(e.kind, ErrorKind::InvalidRequest, "{bad}");
        }
    }

    /// Only refusals are tested here: a value in range would set the test host's clock.
    #[test]
    fn clock_values_outside_2020_to_2200_are_refused_before_any_syscall() {
        for bad in [0, CLOCK_MIN_MS - 1, CLOCK_MAX_MS + 1, u64::MAX] {
            let e = set_clock(bad).unwrap_err();
            assert_eq!(e.kind, ErrorKind::InvalidRequest, "{bad}");
        }
    }
}
