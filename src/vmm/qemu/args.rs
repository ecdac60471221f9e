//! The QEMU command line of one VM and the files it names.
//!
//! Owns: [`VmPaths`] (every file the driver keeps in a VM's directory), how RAM is backed
//! ([`RamBacking`]), the kernel command line and [`qemu_args`], the whole argument list for a
//! spec. Pure functions: nothing here starts a process or touches a file.

use std::ffi::{OsStr, OsString};
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};

use super::{AGENT_PORT_NAME, NET_RECONNECT_MS, NIC_MAC, SUN_PATH_MAX, abs, io_err};
use crate::vmm::{Accel, VmInfo, VmSpec, VmmError};
/// Every file the driver keeps in a VM's directory.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VmPaths {
    pub dir: PathBuf,
    /// qcow2 overlay over the base rootfs: the VM's only writable disk.
    pub disk: PathBuf,
    /// The size `disk`'s file may reach (its disk budget, see [`super::budget`]); `None`: no
    /// cap. Set by the driver just before QEMU starts.
    pub disk_cap: Option<u64>,
    pub qmp: PathBuf,
    pub agent: PathBuf,
    /// The VM's NIC: QEMU connects here (`-netdev stream`); the daemon's network stack listens
    /// on it before QEMU starts. Never removed by the driver (the listener owns it).
    pub net: PathBuf,
    /// QEMU serves the guest serial console here; the daemon follows it into `console`.
    pub console_sock: PathBuf,
    /// Guest serial console (kernel messages, agent's early log), written by the daemon and
    /// kept to a cap (see [`super::logs`]).
    pub console: PathBuf,
    /// QEMU's own stdout/stderr.
    pub qemu_log: PathBuf,
    pub pidfile: PathBuf,
    /// The persisted [`VmInfo`].
    pub vm_json: PathBuf,
    /// Where the guest RAM lives (see [`RamBacking`]).
    pub ram: RamBacking,
    /// The transfer disk (see [`crate::vmm::TRANSFER_DISK_FILE`]).
    pub xfer: PathBuf,
    /// The workspace base disk (see [`crate::vmm::WORKSPACE_DISK_FILE`]).
    pub wsbase: PathBuf,
}

/// The file behind a VM's RAM (`-object memory-backend-file`). See docs/VMM.md, "Snapshots".
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RamBacking {
    /// The VM's own file `<dir>/mem.ram`, mapped shared: guest RAM *is* this file, so a
    /// migration with `x-ignore-shared` leaves RAM out of the state file (fast snapshot and
    /// pause), and a paused VM's RAM is already on disk.
    Owned(PathBuf),
    /// A frozen RAM file (a fork base or golden snapshot), mapped private: pages are shared
    /// copy-on-write with every other VM started from it. A migration must carry the RAM.
    Borrowed(PathBuf),
}

impl RamBacking {
    pub fn path(&self) -> &Path {
        match self {
            RamBacking::Owned(p) | RamBacking::Borrowed(p) => p,
        }
    }
}

/// Id of the agent channel's chardev (QMP `query-chardev` label).
pub const AGENT_CHARDEV: &str = "agent";

/// The balloon device, only ever used for free page reporting (never inflated: the daemon
/// does not take memory back from a guest that holds it).
pub const BALLOON_DEVICE: &str = "virtio-balloon-device,free-page-reporting=on";
/// [`BALLOON_DEVICE`] without reporting, for a QEMU that would punch a discarded page out of a
/// borrowed RAM file that other clones map (before 8.2 it cannot open that file read-only).
pub const BALLOON_DEVICE_NO_REPORTING: &str = "virtio-balloon-device,free-page-reporting=off";

/// Name of the memory backend object (QMP path `/objects/<name>`).
pub const RAM_OBJECT: &str = "ram0";

impl VmPaths {
    pub fn new(dir: &Path) -> VmPaths {
        VmPaths {
            dir: dir.to_owned(),
            disk: dir.join("disk.qcow2"),
            disk_cap: None,
            qmp: dir.join("qmp.sock"),
            agent: dir.join("agent.sock"),
            net: dir.join("net.sock"),
            console_sock: dir.join("tty.sock"),
            console: dir.join("console.log"),
            qemu_log: dir.join("qemu.log"),
            pidfile: dir.join("qemu.pid"),
            vm_json: dir.join("vm.json"),
            ram: RamBacking::Owned(dir.join("mem.ram")),
            xfer: dir.join(crate::vmm::TRANSFER_DISK_FILE),
            wsbase: dir.join(crate::vmm::WORKSPACE_DISK_FILE),
        }
    }

    /// Paths of `spec`'s VM about to start from a checkpoint (restore, clone, resume): `disk`
    /// is its active layer, `ram` replaces the VM's own RAM file when given; leftovers of an
    /// earlier run are cleared and the transfer disk is made. `wsbase` is the workspace base
    /// disk the checkpointed VM had (see [`VmPaths::ensure_workspace_disk`]).
    pub(super) fn for_checkpoint_start(
        spec: &VmSpec,
        disk: PathBuf,
        ram: Option<RamBacking>,
        wsbase: Option<&Path>,
    ) -> Result<VmPaths, VmmError> {
        check_id(&spec.id)?;
        let dir = abs(&spec.dir)?;
        let mut paths = VmPaths::new(&dir);
        paths.check_socket_lengths()?;
        paths.disk = disk;
        if let Some(ram) = ram {
            paths.ram = ram;
        }
        paths.clear_stale()?;
        paths.ensure_transfer_disk()?;
        paths.ensure_workspace_disk(wsbase)?;
        Ok(paths)
    }

    /// Give the VM its workspace base disk. `shared` is the file of the VM it is cloned from
    /// (a checkpoint's [`super::Checkpoint::workspace_disk`]): when that is another VM's file
    /// the VM's `wsbase.img` becomes a symlink to it (the guest's overlay lower layer lives
    /// there, and the file is never written again). Otherwise the VM keeps the file it has, or
    /// gets a new empty one (sparse, fixed size: the device's size is part of the VM state).
    pub(super) fn ensure_workspace_disk(&self, shared: Option<&Path>) -> Result<(), VmmError> {
        let own = std::fs::canonicalize(&self.wsbase).ok();
        if let Some(src) = shared
            && own.as_deref() != Some(src)
            && src.is_file()
        {
            match std::fs::remove_file(&self.wsbase) {
                Ok(()) => {}
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                Err(e) => return Err(io_err(&self.wsbase)(e)),
            }
            return std::os::unix::fs::symlink(src, &self.wsbase).map_err(io_err(&self.wsbase));
        }
        if own.is_some() {
            return Ok(());
        }
        let f = std::fs::OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(false)
            .open(&self.wsbase)
            .map_err(io_err(&self.wsbase))?;
        f.set_len(crate::vmm::WORKSPACE_DISK_BYTES)
            .map_err(io_err(&self.wsbase))
    }

    /// Make the transfer disk (sparse, fixed size) unless it is there: the device set of a VM
    /// (and of every VM restored from its checkpoints) always includes it.
    pub(super) fn ensure_transfer_disk(&self) -> Result<(), VmmError> {
        let f = std::fs::OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(false)
            .open(&self.xfer)
            .map_err(io_err(&self.xfer))?;
        let len = f.metadata().map_err(io_err(&self.xfer))?.len();
        if len != crate::vmm::TRANSFER_DISK_BYTES {
            f.set_len(crate::vmm::TRANSFER_DISK_BYTES)
                .map_err(io_err(&self.xfer))?;
        }
        Ok(())
    }

    /// Remove leftovers of an earlier run of this VM (they would fool the readiness checks).
    pub(super) fn clear_stale(&self) -> Result<(), VmmError> {
        for stale in [
            &self.qmp,
            &self.agent,
            &self.console_sock,
            &self.pidfile,
            &self.vm_json,
        ] {
            match std::fs::remove_file(stale) {
                Ok(()) => {}
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                Err(e) => return Err(io_err(stale)(e)),
            }
        }
        Ok(())
    }

    /// The [`VmInfo`] of `spec`'s VM running as `pid` with these paths.
    pub(super) fn info(&self, spec: &VmSpec, pid: u32) -> VmInfo {
        VmInfo {
            id: spec.id.clone(),
            dir: self.dir.clone(),
            pid,
            accel: spec.accel,
            agent_socket: self.agent.clone(),
            qmp_socket: self.qmp.clone(),
            console_log: self.console.clone(),
        }
    }

    /// Unix socket paths must fit `sun_path`; we refuse long ones rather than play tricks with
    /// symlinks or `/proc/self/fd` (both sides of each socket would need the trick).
    pub(super) fn check_socket_lengths(&self) -> Result<(), VmmError> {
        for p in [&self.qmp, &self.agent, &self.net, &self.console_sock] {
            let n = p.as_os_str().len();
            if n > SUN_PATH_MAX {
                return Err(VmmError::Other(format!(
                    "socket path {} is {n} bytes, more than the {SUN_PATH_MAX} a unix socket \
                     allows: choose a shorter data directory",
                    p.display()
                )));
            }
        }
        Ok(())
    }
}

/// QEMU splits option values at commas; a literal comma is written twice.
pub(super) fn opt_escape(p: &Path) -> OsString {
    let bytes = p.as_os_str().as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    for &b in bytes {
        out.push(b);
        if b == b',' {
            out.push(b',');
        }
    }
    OsStr::from_bytes(&out).to_owned()
}

pub(super) fn opt(prefix: &str, p: &Path, suffix: &str) -> OsString {
    let mut s = OsString::from(prefix);
    s.push(opt_escape(p));
    s.push(suffix);
    s
}

/// VM ids go onto the kernel command line: keep them to a safe alphabet.
pub(super) fn check_id(id: &str) -> Result<(), VmmError> {
    let ok = !id.is_empty()
        && id.len() <= 63
        && id
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_');
    if ok {
        Ok(())
    } else {
        Err(VmmError::Other(format!(
            "VM id {id:?} must be 1-63 characters of [A-Za-z0-9_-]"
        )))
    }
}

/// The kernel command line of a normal VM.
pub(super) fn kernel_cmdline(id: &str) -> String {
    format!(
        "console=ttyS0 reboot=t panic=-1 quiet {} tryboxi.root=serial:{} tryboxi.hostname={id}",
        crate::vmm::GUEST_TIMER_PARAMS,
        crate::vmm::ROOT_DISK_SERIAL
    )
}

/// [`kernel_cmdline`] plus, under TCG, the APIC timer's known rate
/// ([`crate::vmm::TCG_LAPIC_PARAMS`]) and the host's TSC rate, so that an idle guest stops
/// ticking (see [`crate::vmm::tsc`]).
pub(super) fn kernel_cmdline_for(spec: &VmSpec) -> String {
    let base = kernel_cmdline(&spec.id);
    match (spec.accel, crate::vmm::tsc::host_khz()) {
        (Accel::Tcg, Some(khz)) => format!(
            "{base} {} {}",
            crate::vmm::TCG_LAPIC_PARAMS,
            crate::vmm::tsc::kernel_params(khz)
        ),
        (Accel::Tcg, None) => format!("{base} {}", crate::vmm::TCG_LAPIC_PARAMS),
        _ => base,
    }
}

/// Machine, accelerator and CPU arguments shared by VMs and the KVM probe.
pub(crate) fn machine_args(accel: Accel, vcpus: u32, memory_mib: u32) -> Vec<OsString> {
    machine_args_with(accel, vcpus, memory_mib, "microvm,acpi=off")
}

pub(super) fn machine_args_with(
    accel: Accel,
    vcpus: u32,
    memory_mib: u32,
    machine: &str,
) -> Vec<OsString> {
    let (accel, cpu) = match accel {
        Accel::Kvm => ("kvm", "host"),
        Accel::Tcg => ("tcg", "max"),
    };
    [
        "-M",
        machine,
        "-accel",
        accel,
        "-cpu",
        cpu,
        "-smp",
        &vcpus.to_string(),
        "-m",
        &format!("{memory_mib}M"),
        "-nodefaults",
        "-no-user-config",
        "-display",
        "none",
        "-no-reboot",
        "-sandbox",
        "on,obsolete=deny,elevateprivileges=deny,spawn=deny,resourcecontrol=deny",
    ]
    .into_iter()
    .map(OsString::from)
    .collect()
}

/// The full QEMU argument list (without the binary) for `spec`; `paths` must be absolute.
pub fn qemu_args(spec: &VmSpec, paths: &VmPaths) -> Vec<OsString> {
    let machine = format!("microvm,acpi=off,memory-backend={RAM_OBJECT}");
    let mut a = machine_args_with(spec.accel, spec.vcpus, spec.memory_mib, &machine);
    let mut push = |items: &[&OsStr]| a.extend(items.iter().map(|s| s.to_os_string()));
    let share = match paths.ram {
        RamBacking::Owned(_) => "on",
        RamBacking::Borrowed(_) => "off",
    };
    push(&[
        "-object".as_ref(),
        &opt(
            &format!(
                "memory-backend-file,id={RAM_OBJECT},size={}M,mem-path=",
                spec.memory_mib
            ),
            paths.ram.path(),
            &format!(",share={share}"),
        ),
    ]);
    push(&[
        "-kernel".as_ref(),
        spec.kernel.as_os_str(),
        "-initrd".as_ref(),
        spec.initramfs.as_os_str(),
        "-append".as_ref(),
        kernel_cmdline_for(spec).as_ref(),
    ]);
    push(&[
        "-chardev".as_ref(),
        &opt(
            "socket,id=console,path=",
            &paths.console_sock,
            ",server=on,wait=off",
        ),
        "-serial".as_ref(),
        "chardev:console".as_ref(),
    ]);
    // With a disk budget the layer sits on a `raw` node of that size (budget.rs).
    let format = if paths.disk_cap.is_some() {
        ""
    } else {
        ",format=qcow2"
    };
    push(&[
        "-drive".as_ref(),
        &opt(
            &super::budget::drive_prefix(paths.disk_cap),
            &paths.disk,
            // A write the host cannot store (a full data root, the layer's budget) is an I/O
            // error in the guest; QEMU's default for ENOSPC would stop the whole VM until
            // someone resumes it.
            &format!(
                "{format},if=none,id=root,cache=unsafe,discard=unmap,werror=report,rerror=report"
            ),
        ),
        "-device".as_ref(),
        format!(
            "virtio-blk-device,drive=root,serial={}",
            crate::vmm::ROOT_DISK_SERIAL
        )
        .as_ref(),
    ]);
    // The transfer disk: the host writes bulk sync data into it, the guest only reads it.
    push(&[
        "-drive".as_ref(),
        &opt(
            "file=",
            &paths.xfer,
            ",format=raw,if=none,id=xfer,readonly=on",
        ),
        "-device".as_ref(),
        format!(
            "virtio-blk-device,drive=xfer,serial={}",
            crate::vmm::TRANSFER_DISK_SERIAL
        )
        .as_ref(),
    ]);
    // The workspace base disk: written once by the host, mounted read-only by the guest.
    push(&[
        "-drive".as_ref(),
        &opt(
            "file=",
            &paths.wsbase,
            ",format=raw,if=none,id=wsbase,readonly=on",
        ),
        "-device".as_ref(),
        format!(
            "virtio-blk-device,drive=wsbase,serial={}",
            crate::vmm::WORKSPACE_DISK_SERIAL
        )
        .as_ref(),
    ]);
    push(&[
        "-device".as_ref(),
        "virtio-serial-device,max_ports=2".as_ref(),
        "-chardev".as_ref(),
        &opt(
            &format!("socket,id={AGENT_CHARDEV},path="),
            &paths.agent,
            ",server=on,wait=off",
        ),
        "-device".as_ref(),
        format!("virtserialport,chardev={AGENT_CHARDEV},name={AGENT_PORT_NAME}").as_ref(),
    ]);
    push(&["-device".as_ref(), "virtio-rng-device".as_ref()]);
    // The NIC: Ethernet frames over a unix socket to the daemon's userspace network stack.
    // `guest_announce=off`: after a restore or fork QEMU would ask the guest to announce itself
    // (gratuitous ARP, IPv6 NA, MLD, a netlink notification): ~1,100 guest translation blocks
    // under TCG on the first reply, for a point-to-point link with no switch to tell. The stack
    // asks for the guest's MAC itself when a QEMU connects (`network/stack/engine.rs`).
    push(&[
        "-netdev".as_ref(),
        &opt(
            "stream,id=net0,server=off,addr.type=unix,addr.path=",
            &paths.net,
            &format!(",reconnect-ms={NET_RECONNECT_MS}"),
        ),
        "-device".as_ref(),
        format!("virtio-net-device,netdev=net0,mac={NIC_MAC},guest_announce=off").as_ref(),
    ]);
    // Free page reporting: the guest tells QEMU which (4 MiB) blocks it has free and QEMU
    // discards them, so memory a guest frees goes back to the host (docs/VMM.md, "Free page
    // reporting"). Last of the devices: the virtio-mmio slots of the others stay as they were.
    // [`BALLOON_DEVICE`] is rewritten to [`BALLOON_DEVICE_NO_REPORTING`] where discarding is
    // not safe (see `QemuDriver::spawn_detached`).
    push(&["-device".as_ref(), BALLOON_DEVICE.as_ref()]);
    push(&[
        "-chardev".as_ref(),
        &opt("socket,id=qmp,path=", &paths.qmp, ",server=on,wait=off"),
        "-mon".as_ref(),
        "chardev=qmp,mode=control".as_ref(),
    ]);
    push(&[
        "-pidfile".as_ref(),
        paths.pidfile.as_os_str(),
        "-msg".as_ref(),
        "timestamp=on".as_ref(),
    ]);
    a
}

/// Keep free page reporting only where a discard cannot reach a file other VMs map: QEMU
/// discards a reported page of a file-backed RAM block by punching a hole in the *file*, even
/// when its mapping is private. A clone's borrowed RAM file is the frozen fork base its
/// siblings map; from 8.2 QEMU opens it read-only (`readonly=on,rom=off`, see
/// `jail::borrowed_ram_read_only`) and refuses the discard, before that it would punch it.
/// So an older QEMU gets the device without reporting, for every VM alike (the device set of
/// a VM and of its clones must match for the migration stream to load). Returns whether
/// reporting stays on.
pub(super) fn page_reporting_where_safe(
    args: &mut [OsString],
    version: super::QemuVersion,
) -> bool {
    if version >= crate::vmm::jail::READONLY_TEMPLATE_SINCE {
        return args.iter().any(|a| a == BALLOON_DEVICE);
    }
    for a in args.iter_mut() {
        if a == BALLOON_DEVICE {
            *a = OsString::from(BALLOON_DEVICE_NO_REPORTING);
        }
    }
    false
}
