//! The QEMU `microvm` driver.
//!
//! Owns: the QEMU command line, the per-VM files it creates in the VM's directory (see
//! [`VmPaths`] and docs/VMM.md), launching QEMU so that it outlives the daemon, stopping and
//! killing it (only after checking the process is really ours), and finding it again.
//! Never: deletes files (the caller removes the VM directory through `safefs`), writes the base
//! rootfs (each VM gets a qcow2 overlay), or talks to the guest agent.

use crate::oom::ResetOomScore as _;
use std::ffi::{OsStr, OsString};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};
use tokio::sync::watch;

use super::jail::{Jail, Prepared};
use super::pidfd::Pidfd;
use super::qmp::{QmpClient, QmpError};
use super::{VmInfo, VmSpec, VmmDriver, VmmError, jail};

/// Oldest QEMU we accept: `-netdev stream`, `file:` migration and microvm fixes arrived by 7.2.
pub const MIN_VERSION: QemuVersion = QemuVersion {
    major: 7,
    minor: 2,
    micro: 0,
};
/// Name of the virtio-serial port the guest agent opens (`/sys/class/virtio-ports/*/name`).
pub const AGENT_PORT_NAME: &str = "tryboxi.agent";
/// MAC address of the guest's NIC (locally administered; the same in every VM, since each VM
/// has its own private network).
pub const NIC_MAC: &str = "52:54:00:0a:00:0f";
/// How often QEMU retries connecting its NIC to the daemon's network socket (after a daemon
/// restart the new daemon listens again and QEMU comes back on its own).
const NET_RECONNECT_MS: u32 = 200;
/// `sun_path` holds 108 bytes including the terminating NUL.
const SUN_PATH_MAX: usize = 107;
const BOOT_TIMEOUT: Duration = Duration::from_secs(30);
const QMP_TIMEOUT: Duration = Duration::from_secs(5);
/// How long `kill` waits for the process to disappear after SIGKILL.
const KILL_WAIT: Duration = Duration::from_secs(10);
const LOG_TAIL: usize = 2048;
/// Default cap of each VM log (see [`QemuDriver::with_log_cap`]).
pub const DEFAULT_LOG_CAP: u64 = 1 << 20;

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
pub struct QemuVersion {
    pub major: u32,
    pub minor: u32,
    pub micro: u32,
}

impl std::fmt::Display for QemuVersion {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}.{}.{}", self.major, self.minor, self.micro)
    }
}

/// Parse the first line of `qemu-system-x86_64 --version`:
/// `QEMU emulator version 10.0.2 (Debian 1:10.0.2+ds-2+deb13u1~bpo12+1)`.
pub fn parse_version(output: &str) -> Option<QemuVersion> {
    let line = output.lines().next()?;
    let rest = line.split("version ").nth(1)?;
    let num = rest.split_whitespace().next()?;
    let mut parts = num.split('.').map(|p| {
        let digits: String = p.chars().take_while(char::is_ascii_digit).collect();
        digits.parse::<u32>().ok()
    });
    let major = parts.next()??;
    let minor = parts.next()??;
    let micro = parts.next().flatten().unwrap_or(0);
    Some(QemuVersion {
        major,
        minor,
        micro,
    })
}

/// Whether a `/proc/<pid>/cmdline` is a QEMU started by this driver for `dir`: argv[0] is a
/// `qemu-system-*` and the arguments hold `-pidfile <dir>/qemu.pid`. A zombie has an empty
/// cmdline and so never matches.
pub fn cmdline_matches(cmdline: &[u8], dir: &Path) -> bool {
    let mut args = cmdline.split(|&b| b == 0);
    let Some(argv0) = args.next() else {
        return false;
    };
    let name = Path::new(OsStr::from_bytes(argv0)).file_name();
    if !name.is_some_and(|n| n.as_bytes().starts_with(b"qemu-system")) {
        return false;
    }
    let pidfile = VmPaths::new(dir).pidfile;
    let want = pidfile.as_os_str().as_bytes();
    let args: Vec<&[u8]> = args.collect();
    args.windows(2).any(|w| w[0] == b"-pidfile" && w[1] == want)
}

fn proc_cmdline(pid: u32) -> Option<Vec<u8>> {
    std::fs::read(format!("/proc/{pid}/cmdline")).ok()
}

/// A pidfd for `vm`'s QEMU if it runs and is ours; the pidfd is opened before the check so
/// that whatever is signalled through it is the process that was checked.
fn our_process(vm: &VmInfo) -> Option<Pidfd> {
    let fd = Pidfd::open(vm.pid).ok()??;
    let cmd = proc_cmdline(fd.pid())?;
    cmdline_matches(&cmd, &vm.dir).then_some(fd)
}

/// The last `max` bytes of a log (read with a seek), for error messages.
fn tail(path: &Path, max: usize) -> String {
    logs::tail(path, max)
}

type Exited = watch::Receiver<Option<std::process::ExitStatus>>;

/// Exit statuses of the QEMUs this daemon started (by pid; the reaper thread fills them in),
/// and the pids it SIGKILLed itself: what tells a QEMU the kernel killed from one we stopped.
#[derive(Default)]
struct Exits {
    status: std::collections::HashMap<u32, Exited>,
    killed_by_us: std::collections::HashSet<u32>,
    /// The host's OOM kill count when each QEMU started ([`crate::oom::kill_count`]).
    oom_kills_at_start: std::collections::HashMap<u32, Option<u64>>,
}

fn exits() -> std::sync::MutexGuard<'static, Exits> {
    static EXITS: std::sync::LazyLock<std::sync::Mutex<Exits>> =
        std::sync::LazyLock::new(Default::default);
    EXITS.lock().unwrap_or_else(|p| p.into_inner())
}

/// Drop what is kept of `pid`'s exit: the driver itself ended it.
fn forget_exit(pid: u32) {
    let mut ex = exits();
    ex.status.remove(&pid);
    ex.killed_by_us.remove(&pid);
    ex.oom_kills_at_start.remove(&pid);
}

/// How a QEMU this daemon started ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum QemuExit {
    /// Killed by SIGKILL that tryboxi did not send: the kernel's OOM killer or another
    /// process, told apart by the host's OOM kill counter ([`crate::oom::sigkill_cause`]).
    KilledFromOutside(crate::oom::SigkillCause),
    /// Any other end (its status as text).
    Other(std::process::ExitStatus),
}

impl std::fmt::Display for QemuExit {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            QemuExit::KilledFromOutside(cause) => {
                write!(
                    f,
                    "QEMU was killed by a SIGKILL tryboxi did not send: {cause}"
                )
            }
            QemuExit::Other(st) => write!(f, "QEMU exited with {st}"),
        }
    }
}

fn io_err(path: &Path) -> impl FnOnce(std::io::Error) -> VmmError + '_ {
    move |source| VmmError::Io {
        path: path.to_owned(),
        source,
    }
}

fn abs(p: &Path) -> Result<PathBuf, VmmError> {
    std::fs::canonicalize(p).map_err(io_err(p))
}

/// `spec` in directory `dir` with absolute image paths (QEMU does not run in our cwd).
fn abs_spec(spec: &VmSpec, dir: PathBuf) -> Result<VmSpec, VmmError> {
    Ok(VmSpec {
        dir,
        kernel: abs(&spec.kernel)?,
        initramfs: abs(&spec.initramfs)?,
        rootfs: abs(&spec.rootfs)?,
        ..spec.clone()
    })
}

/// Write `vm.json` atomically (temp file + rename), so a crash never leaves half a file.
fn write_vm_json(paths: &VmPaths, info: &VmInfo) -> Result<(), VmmError> {
    let tmp = paths.dir.join("vm.json.tmp");
    let data = serde_json::to_vec_pretty(info)
        .map_err(|e| VmmError::Other(format!("cannot encode vm.json: {e}")))?;
    std::fs::write(&tmp, data).map_err(io_err(&tmp))?;
    std::fs::rename(&tmp, &paths.vm_json).map_err(io_err(&paths.vm_json))
}

impl From<QmpError> for VmmError {
    fn from(e: QmpError) -> Self {
        VmmError::Qmp(e.to_string())
    }
}

/// QEMU `microvm` behind [`VmmDriver`].
#[derive(Debug, Clone)]
pub struct QemuDriver {
    binary: PathBuf,
    version: QemuVersion,
    boot_timeout: Duration,
    /// Cap of each VM's `console.log` and `qemu.log` (see [`logs`]).
    log_cap: u64,
    followers: logs::Followers,
    /// The fences every QEMU of this driver starts in.
    jail: std::sync::Arc<Jail>,
    /// Reserve the blocks of a VM's own RAM file before QEMU maps it (see
    /// [`ramfile::preallocate`]).
    reserve_ram: bool,
    /// The disk budget of each writable root layer in bytes (see [`budget`]); `None`: none.
    disk_budget: Option<u64>,
    /// The data root, named on the discard keeper's command line (see [`discard::keeper`]).
    data_root: PathBuf,
}

impl QemuDriver {
    /// Check that `binary` runs and is QEMU >= 7.2.
    pub fn new(binary: impl Into<PathBuf>) -> Result<QemuDriver, VmmError> {
        let binary = binary.into();
        let out = std::process::Command::new(&binary)
            .reset_oom_score()
            .arg("--version")
            .stdin(Stdio::null())
            .output()
            .map_err(|source| VmmError::Spawn {
                binary: binary.display().to_string(),
                source,
            })?;
        let text = String::from_utf8_lossy(&out.stdout);
        let version = parse_version(&text).ok_or_else(|| {
            VmmError::Other(format!(
                "`{} --version` printed {:?}: not a QEMU version",
                binary.display(),
                text.trim()
            ))
        })?;
        if version < MIN_VERSION {
            return Err(VmmError::Other(format!(
                "{} is QEMU {version}; tryboxi needs QEMU {MIN_VERSION} or newer (on Debian 12: \
                 apt-get install -t bookworm-backports qemu-system-x86)",
                binary.display()
            )));
        }
        let jail = std::sync::Arc::new(Jail::detect(&binary));
        Ok(QemuDriver {
            binary,
            version,
            boot_timeout: BOOT_TIMEOUT,
            log_cap: DEFAULT_LOG_CAP,
            followers: logs::Followers::default(),
            jail,
            reserve_ram: true,
            disk_budget: None,
            data_root: PathBuf::from("-"),
        })
    }

    pub fn version(&self) -> QemuVersion {
        self.version
    }

    pub fn binary(&self) -> &Path {
        &self.binary
    }

    /// Cap in bytes of each VM's `console.log` and `qemu.log` (default 1 MiB; rotated to
    /// `<name>.1` past it).
    pub fn with_log_cap(mut self, bytes: u64) -> Self {
        self.log_cap = bytes.max(logs::MIN_CAP);
        self
    }

    /// The daemon's data root: the discard keeper names it on its command line (`ps` shows
    /// which daemon's QEMUs it serves).
    pub fn with_data_root(mut self, root: &Path) -> Self {
        self.data_root = root.to_owned();
        self
    }

    /// Whether a VM's own RAM file gets its blocks reserved before QEMU starts (default on): on
    /// a full filesystem a guest's first touch of a page would otherwise be a SIGBUS that kills
    /// its QEMU. Off, RAM files stay sparse until touched (less disk while VMs run).
    pub fn with_ram_reserve(mut self, on: bool) -> Self {
        self.reserve_ram = on;
        self
    }

    /// The disk budget in bytes of each sandbox's root disk: the writable layer a VM writes
    /// (at its start, and the new one after each checkpoint) gets what the sandbox's frozen
    /// layers below it leave of the budget, its file never grows past that, and a guest write
    /// that would need more is an I/O error in the guest (see [`budget`]). `None` (default):
    /// none.
    pub fn with_disk_budget(mut self, bytes: Option<u64>) -> Self {
        self.disk_budget = bytes;
        self
    }

    /// `paths` with its root layer sized for what the layers below it leave of the disk budget
    /// (see [`budget::layer_share`] and [`budget::cap_layer`]).
    fn budgeted(&self, paths: &VmPaths) -> Result<VmPaths, VmmError> {
        let mut p = paths.clone();
        let share = budget::layer_share(&p.disk, &p.dir, self.disk_budget);
        p.disk_cap = budget::cap_layer(&p.disk, share)?;
        Ok(p)
    }

    /// Reserve the blocks of `paths`' RAM file when the VM owns it (see
    /// [`Self::with_ram_reserve`]). Before the fences of a fresh file: the jail gives the file
    /// to the VM user as it finds it.
    fn reserve_owned_ram(&self, spec: &VmSpec, paths: &VmPaths) -> Result<(), VmmError> {
        match self.owned_ram_to_reserve(spec, paths) {
            Some((ram, size)) => reserve_or_release(&ram, size),
            None => Ok(()),
        }
    }

    /// The VM's own RAM file and its size when its blocks are to be reserved.
    fn owned_ram_to_reserve(&self, spec: &VmSpec, paths: &VmPaths) -> Option<(PathBuf, u64)> {
        match &paths.ram {
            RamBacking::Owned(ram) if self.reserve_ram => {
                Some((ram.clone(), u64::from(spec.memory_mib) << 20))
            }
            _ => None,
        }
    }

    /// How `vm`'s QEMU ended, if this daemon started it and it has exited (waiting up to
    /// `wait` for the reaper to see it); `None` for a QEMU started by an earlier daemon.
    pub async fn exit_of(&self, vm: &VmInfo, wait: Duration) -> Option<QemuExit> {
        let rx = exits().status.get(&vm.pid).cloned()?;
        let mut rx = rx;
        let st = tokio::time::timeout(wait, rx.wait_for(Option::is_some))
            .await
            .ok()?
            .ok()?
            .as_ref()
            .copied()?;
        let mut ex = exits();
        ex.status.remove(&vm.pid);
        let ours = ex.killed_by_us.remove(&vm.pid);
        let oom_before = ex.oom_kills_at_start.remove(&vm.pid).flatten();
        drop(ex);
        use std::os::unix::process::ExitStatusExt;
        Some(if st.signal() == Some(libc::SIGKILL) && !ours {
            let after = crate::oom::kill_count();
            QemuExit::KilledFromOutside(crate::oom::sigkill_cause(oom_before, after))
        } else {
            QemuExit::Other(st)
        })
    }

    /// The fences QEMU starts in (for `doctor` and the garbage collector).
    pub fn jail(&self) -> &Jail {
        &self.jail
    }

    /// How long `boot` waits for QMP and the agent socket (default 30 s).
    pub fn with_boot_timeout(mut self, t: Duration) -> Self {
        self.boot_timeout = t;
        self
    }

    /// Create the copy-on-write overlay over the base rootfs, unless the VM already has one
    /// (booting a stopped VM again keeps its disk).
    async fn create_overlay(&self, rootfs: &Path, disk: &Path) -> Result<(), VmmError> {
        if disk.exists() {
            return Ok(());
        }
        // A template is a qcow2 layer over the base rootfs; the base itself is raw ext4.
        let fmt = if rootfs.extension().is_some_and(|e| e == "qcow2") {
            "qcow2"
        } else {
            "raw"
        };
        self.qcow2_over(rootfs, fmt, disk).await
    }

    /// A copy-on-write layer `file` over `backing` (format `backing_fmt`), what `qemu-img
    /// create -f qcow2 -F <fmt> -b <backing> <file>` makes, written directly (see
    /// [`super::qcow2`]): no process on the create/restore/fork path.
    pub(crate) async fn qcow2_over(
        &self,
        backing: &Path,
        backing_fmt: &str,
        file: &Path,
    ) -> Result<(), VmmError> {
        super::qcow2::create_overlay(backing, backing_fmt, file).map_err(|e| {
            VmmError::Other(format!("cannot create the overlay {}: {e}", file.display()))
        })
    }

    /// Start QEMU in its own session (no controlling terminal, not in the daemon's process
    /// group) so that it survives the daemon, inside the fences `spec` gets (see `jail.rs`);
    /// a thread reaps it if it exits while we run and then removes its cgroup.
    pub(crate) fn spawn_detached(
        &self,
        spec: &VmSpec,
        paths: &VmPaths,
        incoming: Option<&Path>,
        args: &[OsString],
    ) -> Result<(u32, watch::Receiver<Option<std::process::ExitStatus>>), VmmError> {
        let mut args = args.to_vec();
        let ram_ro = jail::borrowed_ram_read_only(&mut args, paths, self.version);
        args::page_reporting_where_safe(&mut args, self.version);
        let t0 = std::time::Instant::now();
        let fence = std::sync::Arc::new(self.jail.prepare(spec, paths, incoming, ram_ro)?);
        let prepared_us = t0.elapsed().as_micros() as u64;
        // A VM that owns its reserved RAM file keeps the reserve when it discards memory.
        let trap = match &paths.ram {
            RamBacking::Owned(ram) if self.reserve_ram => match discard::DiscardTrap::new() {
                Ok(t) => Some((t, ram.clone())),
                Err(e) => {
                    tracing::warn!(vm = %spec.id, error = %e, "no discard trap: freed guest memory gives back its RAM reserve");
                    None
                }
            },
            _ => None,
        };
        let res = self.spawn_fenced(&args, &paths.dir, &paths.qemu_log, fence.clone(), trap);
        fence.launched();
        tracing::debug!(vm = %spec.id, prepared_us, spawned_us = t0.elapsed().as_micros() as u64, "QEMU process started in its fences");
        if res.is_err() {
            jail::cgroup::remove_dirs(&fence.cgroup_dirs());
        }
        res
    }

    fn spawn_fenced(
        &self,
        args: &[OsString],
        cwd: &Path,
        log: &Path,
        fence: std::sync::Arc<Prepared>,
        trap: Option<(discard::DiscardTrap, PathBuf)>,
    ) -> Result<(u32, watch::Receiver<Option<std::process::ExitStatus>>), VmmError> {
        let out = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(log)
            .map_err(io_err(log))?;
        let err = out.try_clone().map_err(io_err(log))?;
        let score = crate::oom::ChildScore::new(crate::oom::QEMU_OOM_SCORE_ADJ);
        let mut cmd = std::process::Command::new(&self.binary);
        cmd.args(args)
            .current_dir(cwd)
            .stdin(Stdio::null())
            .stdout(out)
            .stderr(err);
        let child_fence = fence.clone();
        let child_trap = trap.as_ref().map(|(t, _)| t.child_part());
        // SAFETY: the closure runs in the forked child before exec and only calls setsid(2),
        // prctl(2), open/write/close(2) (in `apply_in_child`), the system calls of
        // `Prepared::enter` and of `ChildEnd::install` (async-signal-safe, on data made before
        // the fork; nothing is allocated).
        unsafe {
            cmd.pre_exec(move || {
                // QEMU goes before the host's other processes (and the daemon) when memory
                // runs out; it would otherwise inherit the daemon's protection. Before the
                // fences: /proc is not visible inside QEMU's mount namespace.
                score.apply_in_child();
                if libc::setsid() < 0 {
                    return Err(std::io::Error::last_os_error());
                }
                // No transparent huge pages for QEMU (kept across exec): it asks for them on
                // its TCG code buffer, and every 2 MiB page it first writes is zeroed whole.
                // Measured on fork of 10 under TCG: ~10% of each child's CPU was that zeroing;
                // with 4 KiB pages the children took ~96 instead of ~110 ms CPU each and the
                // fork ~605 instead of ~650 ms. Guest RAM is a file mapping (no THP either way).
                if libc::prctl(libc::PR_SET_THP_DISABLE, 1, 0, 0, 0) < 0 {
                    return Err(std::io::Error::last_os_error());
                }
                child_fence.enter()?;
                // Last: the filter traps only fallocate, and none of the calls above.
                if let Some(t) = child_trap {
                    t.install();
                }
                Ok(())
            });
        }
        let oom_kills = crate::oom::kill_count();
        let mut child = cmd.spawn().map_err(|source| VmmError::Spawn {
            binary: self.binary.display().to_string(),
            source,
        })?;
        let pid = child.id();
        if let Some((trap, ram)) = trap {
            match trap.listener() {
                Ok(l) => {
                    if let Err(e) = discard::keeper::keep(l, pid, ram, &self.data_root) {
                        tracing::warn!(pid, error = %e, "cannot serve the discard trap: the guest's discards fail and its memory stays");
                    }
                }
                Err(why) => {
                    tracing::debug!(
                        pid,
                        why,
                        "no discard trap: freed guest memory gives back its RAM reserve"
                    )
                }
            }
        }
        let (tx, rx) = watch::channel(None);
        {
            let mut ex = exits();
            ex.status.insert(pid, rx.clone());
            ex.killed_by_us.remove(&pid);
            ex.oom_kills_at_start.insert(pid, oom_kills);
        }
        let p = VmPaths::new(cwd);
        self.followers.spawn(
            pid,
            cwd,
            (p.console_sock, p.console, p.qemu_log),
            self.log_cap,
        );
        std::thread::Builder::new()
            .name(format!("qemu-reaper-{pid}"))
            .stack_size(64 * 1024)
            .spawn(move || {
                let st = child.wait();
                if let Ok(st) = st {
                    tracing::debug!(pid, status = %st, "QEMU exited");
                    jail::cgroup::remove_dirs(&fence.cgroup_dirs());
                    let _ = tx.send(Some(st));
                }
            })
            .map_err(|e| VmmError::Other(format!("cannot start the reaper thread: {e}")))?;
        Ok((pid, rx))
    }

    /// Wait until QMP says `running` and the agent socket exists, or QEMU exits.
    async fn wait_ready(
        &self,
        paths: &VmPaths,
        exited: &mut watch::Receiver<Option<std::process::ExitStatus>>,
    ) -> Result<(), VmmError> {
        let deadline = tokio::time::Instant::now() + self.boot_timeout;
        let mut qmp: Option<QmpClient> = None;
        loop {
            if let Some(st) = *exited.borrow() {
                return Err(VmmError::BootFailed(format!(
                    "QEMU exited with {st}.\n--- qemu.log ---\n{}\n--- console.log ---\n{}",
                    tail(&paths.qemu_log, LOG_TAIL),
                    tail(&paths.console, LOG_TAIL)
                )));
            }
            if qmp.is_none() && paths.qmp.exists() {
                match QmpClient::connect(&paths.qmp, QMP_TIMEOUT).await {
                    Ok(c) => qmp = Some(c),
                    Err(e) => tracing::trace!(error = %e, "QMP not ready yet"),
                }
            }
            if let Some(c) = &qmp {
                match c.query_status().await {
                    Ok(s) if s.running && paths.agent.exists() => return Ok(()),
                    Ok(_) => {}
                    // QEMU died under us: the next turn reports it with the logs.
                    Err(QmpError::Disconnected) => qmp = None,
                    Err(e) => return Err(e.into()),
                }
            }
            // Poll again shortly, but wake at once if QEMU exits.
            let tick = Duration::from_millis(10);
            if let Ok(Err(_)) = tokio::time::timeout(tick, exited.changed()).await {
                // The reaper is gone without a status: fall back to plain polling.
                tokio::time::sleep(tick).await;
            }
            if tokio::time::Instant::now() >= deadline {
                return Err(VmmError::Timeout(
                    self.boot_timeout,
                    "QEMU's QMP to report running",
                ));
            }
        }
    }

    /// SIGKILL our process (if it is ours) and wait for it to disappear.
    async fn kill_and_wait(vm: &VmInfo) -> Result<(), VmmError> {
        let Some(p) = our_process(vm) else {
            return Ok(());
        };
        exits().killed_by_us.insert(vm.pid);
        p.signal(libc::SIGKILL)
            .map_err(|e| VmmError::Other(format!("cannot kill QEMU (pid {}): {e}", vm.pid)))?;
        match p.wait_exit(KILL_WAIT).await {
            Ok(true) => {
                forget_exit(vm.pid);
                Ok(())
            }
            Ok(false) => Err(VmmError::Timeout(KILL_WAIT, "QEMU to exit after SIGKILL")),
            Err(e) => Err(VmmError::Other(format!(
                "cannot wait for QEMU pid {}: {e}",
                vm.pid
            ))),
        }
    }

    /// Launch a fresh VM (kernel, initramfs, empty RAM, no state file) on the disk `paths`
    /// names and wait until QEMU runs it; a QEMU that does not get there is killed.
    pub(super) async fn launch_cold(
        &self,
        spec: &VmSpec,
        paths: &VmPaths,
    ) -> Result<VmInfo, VmmError> {
        let paths = self.budgeted(paths)?;
        let args = qemu_args(spec, &paths);
        let t0 = Instant::now();
        self.reserve_owned_ram(spec, &paths)?;
        let (pid, mut exited) = self.spawn_detached(spec, &paths, None, &args)?;
        let info = paths.info(spec, pid);
        let ready = match self.wait_ready(&paths, &mut exited).await {
            Ok(()) => write_vm_json(&paths, &info),
            Err(e) => Err(e),
        };
        if let Err(e) = ready {
            // Never leave a half-booted QEMU behind.
            if let Err(k) = Self::kill_and_wait(&info).await {
                tracing::error!(vm = %info.id, pid, error = %k, "cannot kill a failed QEMU");
            }
            return Err(e);
        }
        tracing::info!(
            vm = %info.id, pid, accel = %info.accel,
            qmp_ready_ms = t0.elapsed().as_millis() as u64,
            "QEMU running"
        );
        Ok(info)
    }

    /// Boot `spec`'s VM afresh (kernel, initramfs, empty RAM) on `disk`, the root layer a
    /// stopped VM of the same sandbox last wrote (a filesystem-only pause, a reboot of a
    /// paused sandbox): its files are as that guest left them (the guest synced them before it
    /// stopped), its memory and processes are not. The VM keeps its workspace base disk.
    pub async fn boot_on_disk(&self, spec: &VmSpec, disk: &Path) -> Result<VmInfo, VmmError> {
        let spec = abs_spec(spec, abs(&spec.dir)?)?;
        let paths = VmPaths::for_checkpoint_start(&spec, disk.to_path_buf(), None, None)?;
        ramfile::remove(paths.ram.path())?;
        self.launch_cold(&spec, &paths).await
    }
}

#[async_trait::async_trait]
impl VmmDriver for QemuDriver {
    fn name(&self) -> &'static str {
        "qemu-microvm"
    }

    fn forget(&self, dir: &Path) {
        self.jail.forget(dir);
    }

    async fn boot(&self, spec: &VmSpec) -> Result<VmInfo, VmmError> {
        check_id(&spec.id)?;
        let dir = abs(&spec.dir)?;
        let paths = VmPaths::new(&dir);
        paths.check_socket_lengths()?;
        let spec = abs_spec(spec, dir.clone())?;
        paths.clear_stale()?;
        // A cold boot starts from empty RAM (an old run's file would only take disk space).
        ramfile::remove(paths.ram.path())?;
        paths.ensure_transfer_disk()?;
        paths.ensure_workspace_disk(None)?;
        self.create_overlay(&spec.rootfs, &paths.disk).await?;
        self.launch_cold(&spec, &paths).await
    }

    async fn stop(&self, vm: &VmInfo, grace: Duration) -> Result<(), VmmError> {
        let Some(p) = our_process(vm) else {
            return Ok(());
        };
        let started = Instant::now();
        match QmpClient::connect(&vm.qmp_socket, grace.min(QMP_TIMEOUT)).await {
            Ok(c) => {
                let left = grace.saturating_sub(started.elapsed());
                match tokio::time::timeout(left, c.quit()).await {
                    Ok(Ok(())) => {}
                    Ok(Err(e)) => tracing::warn!(vm = %vm.id, error = %e, "QMP quit failed"),
                    Err(_) => tracing::warn!(vm = %vm.id, "QMP quit timed out"),
                }
            }
            Err(e) => tracing::warn!(vm = %vm.id, error = %e, "no QMP to ask QEMU to quit"),
        }
        let left = grace.saturating_sub(started.elapsed());
        if p.wait_exit(left).await.unwrap_or(false) {
            forget_exit(vm.pid);
            tracing::info!(vm = %vm.id, pid = vm.pid, "QEMU stopped");
            return Ok(());
        }
        tracing::warn!(vm = %vm.id, pid = vm.pid, ?grace, "QEMU did not quit in time; killing it");
        Self::kill_and_wait(vm).await
    }

    async fn kill(&self, vm: &VmInfo) -> Result<(), VmmError> {
        Self::kill_and_wait(vm).await
    }

    fn is_alive(&self, vm: &VmInfo) -> bool {
        proc_cmdline(vm.pid).is_some_and(|c| cmdline_matches(&c, &vm.dir))
    }

    async fn reattach(&self, dir: &Path) -> Result<Option<VmInfo>, VmmError> {
        let path = dir.join("vm.json");
        let data = match std::fs::read(&path) {
            Ok(d) => d,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
            Err(e) => return Err(io_err(&path)(e)),
        };
        let info: VmInfo = serde_json::from_slice(&data).map_err(|e| {
            VmmError::Other(format!("{} is not a valid vm.json: {e}", path.display()))
        })?;
        if !self.is_alive(&info) {
            return Ok(None);
        }
        let c = QmpClient::connect(&info.qmp_socket, QMP_TIMEOUT).await?;
        let st = c.query_status().await?;
        tracing::info!(vm = %info.id, pid = info.pid, status = %st.status, "reattached to QEMU");
        let p = VmPaths::new(&info.dir);
        self.followers.spawn(
            info.pid,
            &info.dir,
            (p.console_sock, p.console, p.qemu_log),
            self.log_cap,
        );
        Ok(Some(info))
    }
}

mod args;
pub(crate) mod budget;
mod clone;
pub mod discard;
mod fiemap;
pub mod logs;
pub mod ramfile;
mod snapshot;
#[cfg(test)]
mod tests;

use args::check_id;
pub(crate) use args::machine_args;
pub use args::{AGENT_CHARDEV, RAM_OBJECT, RamBacking, VmPaths, qemu_args};
#[cfg(test)]
use args::{BALLOON_DEVICE, BALLOON_DEVICE_NO_REPORTING};
pub use snapshot::{Checkpoint, RAM_FILE, Resumed};

/// The backing file of the qcow2 layer `layer` (see [`budget::backing_of`]).
pub fn layer_backing(layer: &Path) -> Option<PathBuf> {
    budget::backing_of(layer)
}

/// Reserve the blocks of the RAM file `ram` (`size` bytes, see [`ramfile::preallocate`]); on
/// failure give back what was reserved.
fn reserve_or_release(ram: &Path, size: u64) -> Result<(), VmmError> {
    ramfile::preallocate(ram, size).map(drop).inspect_err(|_| {
        ramfile::release_reserve(ram);
    })
}
