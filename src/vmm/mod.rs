//! Virtual machine monitors: the driver trait and its implementations.
//!
//! Owns: launching, stopping and killing VMs, finding them again after a daemon restart,
//! and probing which acceleration (KVM or TCG) really works on this host.
//! Never: talks to the guest agent (that is `rpc`), deletes anything outside a VM's own
//! directory (deletes go through `safefs`), or knows about sandboxes, workspaces or the store.
//!
//! Files: `qemu.rs` (the QEMU `microvm` driver), `qmp.rs` (QMP client), `probe.rs` (KVM probe
//! and the `accel` setting), `images.rs` (guest image manifest), `pidfd.rs` (pid-reuse-proof
//! process handles), `jail.rs` (the fences around each QEMU). The design is written down in docs/VMM.md.

pub mod image_sets;
pub mod images;
pub mod jail;
mod pidfd;
pub mod probe;
pub mod qcow2;
pub mod qemu;
pub mod qmp;
pub mod tsc;

pub use images::Images;
pub use probe::{AccelSetting, probe_accel, resolve_accel};
pub use qemu::QemuDriver;
pub use qemu::discard::{KEEPER_NAME as DISCARD_KEEPER, keeper_main as discard_keeper};

use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::{Deserialize, Serialize};

/// Resolved acceleration for one VM.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Accel {
    Kvm,
    Tcg,
}

impl std::fmt::Display for Accel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.pad(match self {
            Accel::Kvm => "kvm",
            Accel::Tcg => "tcg",
        })
    }
}

/// What to boot. `dir` is the VM's private directory (created by the caller, inside the
/// data root); everything the driver creates for the VM lives in it.
#[derive(Debug, Clone)]
pub struct VmSpec {
    pub id: String,
    pub dir: PathBuf,
    pub kernel: PathBuf,
    pub initramfs: PathBuf,
    /// Base root filesystem (ext4, read-only to the VM: it gets a qcow2 overlay in `dir`).
    pub rootfs: PathBuf,
    pub vcpus: u32,
    pub memory_mib: u32,
    pub accel: Accel,
}

/// Kernel parameters of every guest's timer setup. `no_timer_check` skips the boot-time check
/// that the PIT's interrupt arrives through the IO-APIC: under TCG on a loaded host the vCPU
/// thread can miss the ticks of that short window, and the kernel then panics (`IO-APIC +
/// timer doesn't work!`, from `check_timer` during `start_kernel`). Seen once in CI (a guest
/// dying ~1.3 s into boot); the same panic and fix are known from QEMU-based CI elsewhere.
/// Harmless under KVM. The probe's command line (`probe::PROBE_CMDLINE`) carries it too.
pub const GUEST_TIMER_PARAMS: &str = "no_timer_check";

/// Kernel parameter for TCG guests: QEMU's emulated local APIC timer counts at a fixed 1 GHz
/// (`APIC_BUS_CYCLE_NS` = 1). Our kernel's patch `lapic_timer_hz`
/// (`guest-image/kernel/patches/`) takes it as known, so the boot neither calibrates the APIC
/// timer nor verifies it against the PIT. On a loaded host that verification fails at random
/// ("APIC timer disabled due to verification failure") and leaves the PIT as the guest's tick
/// device, which wakes an idle guest ~40 times a second (~1 % of a host core each). KVM
/// guests have the TSC-deadline timer and skip the calibration anyway. A kernel without the
/// patch passes the unknown parameter on to init's environment, where nothing reads it.
pub const TCG_LAPIC_PARAMS: &str = "lapic_timer_hz=1000000000";

/// The virtio serial of the root disk; the guest's init mounts the disk with this serial
/// (`tryboxi.root=serial:...`), not a fixed `/dev/vdX`, because the kernel need not enumerate
/// the virtio-mmio disks in command-line order.
pub const ROOT_DISK_SERIAL: &str = "tryboxi-root";
/// The transfer disk of every VM: a sparse raw file in the VM's directory, attached read-only
/// as a second virtio-blk device with serial [`TRANSFER_DISK_SERIAL`]. The host writes bulk
/// workspace data (a tar archive) at its start and the guest agent reads it from the device
/// (after dropping its page cache): far faster than the RPC channel. Its content has no meaning
/// between transfers, so checkpoints do not capture it.
pub const TRANSFER_DISK_FILE: &str = "xfer.img";
pub const TRANSFER_DISK_SERIAL: &str = "tryboxi-xfer";
/// Its fixed size: the largest archive one transfer can carry.
pub const TRANSFER_DISK_BYTES: u64 = 4 << 30;

/// The workspace base disk of every VM: a sparse raw file (`wsbase.img`) attached read-only as
/// a third virtio-blk device with serial [`WORKSPACE_DISK_SERIAL`]. Empty until the first big
/// sync, when the host writes an ext4 file system holding the synced tree into it (once: it is
/// never written again) and the guest mounts it as the lower layer of an overlayfs on
/// `/workspace`. Checkpoints reference it ([`qemu::Checkpoint::workspace_disk`]); fork children
/// attach their parent's file (their `wsbase.img` is a symlink to it).
pub const WORKSPACE_DISK_FILE: &str = "wsbase.img";
pub const WORKSPACE_DISK_SERIAL: &str = "tryboxi-wsbase";
/// Its fixed size (sparse: only the file system's blocks take space).
pub const WORKSPACE_DISK_BYTES: u64 = 16 << 30;

/// A running VM as the driver knows it; persisted as `vm.json` in the VM's directory.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct VmInfo {
    pub id: String,
    pub dir: PathBuf,
    pub pid: u32,
    pub accel: Accel,
    /// Host end of the guest agent channel (a unix socket; the daemon connects to it).
    pub agent_socket: PathBuf,
    pub qmp_socket: PathBuf,
    pub console_log: PathBuf,
}

#[derive(Debug, thiserror::Error)]
pub enum VmmError {
    #[error("cannot start the VMM `{binary}`: {source}")]
    Spawn {
        binary: String,
        #[source]
        source: std::io::Error,
    },
    #[error("the VM exited during boot: {0}")]
    BootFailed(String),
    #[error("QMP: {0}")]
    Qmp(String),
    #[error("timed out after {0:?} waiting for {1}")]
    Timeout(Duration, &'static str),
    #[error("I/O error on {path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    /// A fence around QEMU (cgroup, user, mount namespace) could not be set up; QEMU is not
    /// started without it (see `jail.rs`).
    #[error("cannot fence QEMU: {0}")]
    Fence(String),
    #[error("{0}")]
    Other(String),
}

/// A VMM backend. The first implementation is QEMU `microvm` (`qemu.rs`); a Firecracker
/// driver can be added behind the same trait.
#[async_trait::async_trait]
pub trait VmmDriver: Send + Sync {
    /// Short name for logs and `doctor` (`qemu-microvm`).
    fn name(&self) -> &'static str;
    /// Launch the VM. Returns once the VMM runs and its sockets exist (not when the guest
    /// agent answers: the caller waits for that over the agent channel).
    async fn boot(&self, spec: &VmSpec) -> Result<VmInfo, VmmError>;
    /// Ask the VM to stop, then kill it after `grace`. Idempotent.
    async fn stop(&self, vm: &VmInfo, grace: Duration) -> Result<(), VmmError>;
    /// Kill the VM at once. Idempotent.
    async fn kill(&self, vm: &VmInfo) -> Result<(), VmmError>;
    /// Whether the VMM process of `vm` still runs (and is really ours: no pid reuse).
    fn is_alive(&self, vm: &VmInfo) -> bool;
    /// After a daemon restart: the VM recorded in `dir`, if its VMM still runs.
    async fn reattach(&self, dir: &Path) -> Result<Option<VmInfo>, VmmError>;
    /// The VM directory `dir` is about to be deleted (its VM is gone): give back what the
    /// driver keeps for it outside it (QEMU: the per-sandbox uid claim). Idempotent.
    fn forget(&self, _dir: &Path) {}
}

#[cfg(test)]
mod testkit;
