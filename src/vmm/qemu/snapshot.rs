//! Checkpoint and restore of a QEMU microvm.
//!
//! A checkpoint captures memory, device state and disk at one instant: the VM is paused, its
//! device state is written with `migrate` to `state.bin`, and while it is still paused
//! `blockdev-snapshot` freezes the active qcow2 layer (it becomes a read-only backing file)
//! under a fresh overlay the daemon made (a qcow2 header, sized for the disk budget:
//! `budget.rs`) and added with `blockdev-add`; then the VM continues. No disk data is copied.
//! A VM whose RAM is its own shared file ([`RamBacking::Owned`]) migrates with `x-ignore-shared`
//! (RAM stays out of `state.bin`, a few tens of KB) and the checkpoint copies the allocated part
//! of the RAM file to `mem.ram` next to it; a VM on a borrowed (private) mapping writes its RAM
//! into `state.bin` as before.
//! A restore starts a new QEMU with the same devices, a fresh overlay over the frozen layer, a
//! copy of the frozen RAM file and `-incoming file:state.bin`, and continues it once the
//! incoming migration is done.

use std::ffi::OsString;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

use super::{
    AGENT_CHARDEV, LOG_TAIL, QMP_TIMEOUT, QemuDriver, RAM_OBJECT, VmPaths, abs, abs_spec, budget,
    qemu_args, ramfile, tail, write_vm_json,
};
use crate::vmm::qmp::QmpClient;
use crate::vmm::{VmInfo, VmSpec, VmmError};

/// How long writing or loading a state file may take.
const MIGRATE_TIMEOUT: Duration = Duration::from_secs(120);

/// The files of one checkpoint: the state file and the frozen disk layer.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct Checkpoint {
    pub state_file: PathBuf,
    /// The qcow2 layer frozen at the checkpoint (its backing chain ends at the base rootfs).
    pub disk_layer: PathBuf,
    pub state_bytes: u64,
    /// The frozen RAM file, when RAM is not in the state file (it was saved with
    /// `x-ignore-shared`); `None`: the state file carries the RAM.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ram_file: Option<PathBuf>,
    /// The checkpointed VM's workspace base disk (the real file, symlinks resolved): written
    /// once, so the checkpoint references it instead of copying it. A VM started from the
    /// checkpoint in another directory (a fork child) attaches this file. `None` for pause
    /// checkpoints (the VM resumes with its own) and golden snapshots (clones get an empty one).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub workspace_disk: Option<PathBuf>,
    /// The disk alone (a filesystem-only snapshot): its state and RAM files were dropped, and a
    /// VM started from it boots afresh on a new overlay over [`Checkpoint::disk_layer`].
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub disk_only: bool,
}

/// A VM started from a checkpoint (restore, clone, resume from disk).
#[derive(Debug)]
pub struct Resumed {
    pub info: VmInfo,
    /// The host end of the agent's chardev socket, connected before the VM continued (see
    /// [`QemuDriver::start_incoming`]); `None` when QEMU had not taken the connection by then.
    /// The driver never speaks the agent protocol: the caller does, on this stream.
    pub agent: Option<std::os::unix::net::UnixStream>,
    /// The root layer the replaced VM wrote, asked of its QEMU just before the kill (a restore
    /// over a running VM); `None` when nothing was replaced or its QEMU did not say.
    pub replaced_layer: Option<PathBuf>,
}

/// How long a restore waits for QEMU to take the early agent connection before continuing
/// the VM anyway (the guest then sees its host leave and come back, which costs it a retry).
const EARLY_AGENT_WAIT: Duration = Duration::from_millis(200);

/// File name of a frozen RAM file inside a checkpoint directory.
pub const RAM_FILE: &str = "mem.ram";

impl QemuDriver {
    /// The root layer file the running VM `vm` writes (as its QEMU reports it).
    pub async fn active_layer(&self, vm: &VmInfo) -> Result<PathBuf, VmmError> {
        let qmp = QmpClient::connect(&vm.qmp_socket, QMP_TIMEOUT).await?;
        Ok(active_disk(&qmp).await?.0)
    }

    /// Checkpoint the running VM `vm` into `dest` (a new directory inside the VM's directory).
    /// `next_overlay` is the file the VM continues to write to afterwards. `with_ram: false`
    /// (a filesystem-only snapshot, whose memory is dropped at once) does not copy the RAM
    /// file: the checkpoint then has no `ram_file`, and its state file is not for loading.
    pub async fn checkpoint(
        &self,
        vm: &VmInfo,
        dest: &Path,
        next_overlay: &Path,
        with_ram: bool,
    ) -> Result<Checkpoint, VmmError> {
        std::fs::create_dir_all(dest).map_err(super::io_err(dest))?;
        let dest = abs(dest)?;
        // QEMU writes the state file there (as the sandbox's uid under a root daemon).
        self.jail.share_dir(&dest, &vm.dir)?;
        let next_overlay = absolute(next_overlay)?;
        let state = dest.join("state.bin");
        let qmp = QmpClient::connect(&vm.qmp_socket, QMP_TIMEOUT).await?;
        let (layer, node) = active_disk(&qmp).await?;
        // The frozen layer stays the sandbox's to count while the checkpoint keeps it.
        if let Err(e) = budget::mark_frozen_layer(&dest, &layer, &vm.dir) {
            discard_failed_checkpoint(&dest, None);
            return Err(e);
        }
        // The next layer is made here (QEMU writes it from the switch on): a qcow2 header over
        // the active layer, sized for what the layers below leave of the disk budget, and the
        // VM's to write.
        super::super::qcow2::create_overlay(&layer, "qcow2", &next_overlay)
            .map_err(|e| VmmError::Other(format!("cannot make {}: {e}", next_overlay.display())))?;
        let share = budget::layer_share(&next_overlay, &vm.dir, self.disk_budget);
        let next_cap = match budget::cap_layer(&next_overlay, share)
            .and_then(|cap| self.jail.give_file(&next_overlay, &vm.dir).map(|()| cap))
        {
            Ok(cap) => cap,
            Err(e) => {
                let _ = std::fs::remove_file(&next_overlay);
                return Err(e);
            }
        };
        let next_node = format!(
            "root{:x}",
            crate::vmm::jail::unix_nanos() & 0xffff_ffff_ffff
        );
        let ram = owned_ram(&qmp).await;
        let frozen_ram = dest.join(RAM_FILE);
        let t0 = Instant::now();
        qmp.stop().await?;
        let mut switched = false;
        let res = async {
            save_state(&qmp, &state, ram.is_some()).await?;
            qmp.execute(
                "blockdev-add",
                Some(budget::blockdev_add(&next_node, &next_overlay, next_cap)),
            )
            .await?;
            let snap = qmp
                .execute(
                    "blockdev-snapshot",
                    Some(serde_json::json!({ "node": node, "overlay": next_node })),
                )
                .await;
            if let Err(e) = snap {
                let del = serde_json::json!({ "node-name": next_node });
                let _ = qmp.execute("blockdev-del", Some(del)).await;
                return Err(e.into());
            }
            switched = true;
            if let Some(r) = ram.as_ref().filter(|_| with_ram) {
                let bytes = ramfile::copy_sparse_async(r, &frozen_ram).await?;
                tracing::debug!(vm = %vm.id, bytes, "RAM file frozen");
            }
            Ok::<(), VmmError>(())
        }
        .await;
        // Whatever happened, the VM must not stay paused.
        let cont = qmp.cont().await;
        if let Err(e) = res {
            discard_failed_checkpoint(&dest, (!switched).then_some(next_overlay.as_path()));
            return Err(e);
        }
        cont?;
        tracing::debug!(vm = %vm.id, paused_ms = t0.elapsed().as_millis() as u64, "checkpoint taken");
        let state_bytes = std::fs::metadata(&state)
            .map_err(super::io_err(&state))?
            .len();
        let workspace_disk =
            std::fs::canonicalize(vm.dir.join(crate::vmm::WORKSPACE_DISK_FILE)).ok();
        Ok(Checkpoint {
            state_file: state,
            disk_layer: layer,
            state_bytes,
            ram_file: ram.filter(|_| with_ram).map(|_| frozen_ram),
            workspace_disk,
            disk_only: false,
        })
    }

    /// Start `spec`'s VM from `cp`: a new overlay `overlay` over the checkpoint's frozen layer,
    /// memory and devices from its state file. Returns once the VM runs again. `replacing` is
    /// the VM of the same sandbox still running (a restore over a live VM): it is killed while
    /// the new files are made.
    ///
    /// Everything that does not depend on something else runs side by side: the VM's own copy
    /// of the frozen RAM (so later snapshots stay fast) fills a new file on a blocking thread
    /// from the start, while the old VM is killed and the overlay made, and while the new QEMU
    /// launches on that file; the state is loaded once the copy is done.
    pub async fn restore(
        &self,
        spec: &VmSpec,
        cp: &Checkpoint,
        overlay: &Path,
        replacing: Option<&VmInfo>,
    ) -> Result<Resumed, VmmError> {
        if cp.disk_only {
            return self.boot_over(spec, cp, overlay, replacing).await;
        }
        let t0 = Instant::now();
        let overlay = absolute(overlay)?;
        let ram_path = VmPaths::new(&abs(&spec.dir)?).ram.path().to_owned();
        // A state file that carries the RAM fills a fresh file QEMU makes.
        let filling = match &cp.ram_file {
            Some(r) => Some(ramfile::fill_in_place(r, &ram_path)?),
            None => {
                ramfile::remove(&ram_path)?;
                None
            }
        };
        // The VM being replaced gets its SIGKILL first (`join!` polls it first) and is waited for
        // alongside the start: the new VM shares nothing writable with it (a new RAM inode, a
        // new overlay, its sockets made afresh, the network stack serving the newest
        // connection), so the launch need not wait for the old QEMU to be gone.
        // The new RAM file's blocks are reserved once the old QEMU (and the RAM file it still
        // maps) is gone: both at once may not fit.
        let (gone_tx, gone_rx) = tokio::sync::oneshot::channel::<()>();
        let kill = async move {
            let (r, layer) = match replacing {
                Some(old) => {
                    let layer = self.layer_before_kill(old).await;
                    (Self::kill_and_wait(old).await, layer)
                }
                None => (Ok(()), None),
            };
            drop(gone_tx);
            (r, layer)
        };
        let start = async {
            let prepared = self
                .qcow2_over(&cp.disk_layer, "qcow2", &overlay)
                .await
                .and_then(|()| {
                    VmPaths::for_checkpoint_start(spec, overlay, None, cp.workspace_disk.as_deref())
                });
            let paths = match prepared {
                Ok(p) => p,
                Err(e) => {
                    // Let the copy end before the caller can try again on the same file.
                    if let Some(f) = filling {
                        let _ = f.wait().await;
                    }
                    return Err(e);
                }
            };
            tracing::debug!(vm = %spec.id, ms = t0.elapsed().as_millis() as u64, "restore: overlay made");
            let after = StartAfter {
                filling,
                old_gone: Some(gone_rx),
            };
            self.start_incoming(spec, &paths, &cp.state_file, cp.ram_file.is_some(), after)
                .await
        };
        match tokio::join!(kill, start) {
            ((Ok(()), layer), started) => started.map(|mut r| {
                r.replaced_layer = layer;
                r
            }),
            ((Err(e), _), Ok(started)) => {
                // Never two VMs of one sandbox: the old one would not go, so the new one goes.
                let _ = Self::kill_and_wait(&started.info).await;
                Err(e)
            }
            ((Err(_), _), Err(e)) => Err(e),
        }
    }

    /// The root layer `old` writes, asked of its QEMU just before it is killed (bounded: a
    /// QEMU that does not answer within [`QMP_TIMEOUT`] says nothing). Asked alongside the new
    /// VM's launch rather than before the restore begins.
    async fn layer_before_kill(&self, old: &VmInfo) -> Option<PathBuf> {
        match tokio::time::timeout(QMP_TIMEOUT, self.active_layer(old)).await {
            Ok(Ok(l)) => Some(l),
            _ => None,
        }
    }

    /// Start `spec`'s VM afresh (kernel, initramfs, empty RAM) on a new overlay `overlay` over
    /// the disk-only checkpoint `cp`'s frozen layer, with its workspace base disk; `replacing`
    /// (the sandbox's running VM) is killed first. The agent connects as after any boot.
    async fn boot_over(
        &self,
        spec: &VmSpec,
        cp: &Checkpoint,
        overlay: &Path,
        replacing: Option<&VmInfo>,
    ) -> Result<Resumed, VmmError> {
        let mut replaced_layer = None;
        if let Some(old) = replacing {
            replaced_layer = self.layer_before_kill(old).await;
            Self::kill_and_wait(old).await?;
        }
        let spec = abs_spec(spec, abs(&spec.dir)?)?;
        let overlay = absolute(overlay)?;
        self.qcow2_over(&cp.disk_layer, "qcow2", &overlay).await?;
        let paths =
            VmPaths::for_checkpoint_start(&spec, overlay, None, cp.workspace_disk.as_deref())?;
        ramfile::remove(paths.ram.path())?;
        let info = self.launch_cold(&spec, &paths).await?;
        Ok(Resumed {
            info,
            agent: None,
            replaced_layer,
        })
    }

    /// Launch `spec`'s VM with `paths` (disk in place; RAM in place or, with `filling`, being
    /// copied into place) from the state file `state`, wait until the incoming migration has
    /// loaded, continue it, write `vm.json`.
    ///
    /// Before the VM continues, the agent's chardev socket is connected (and QEMU seen to have
    /// taken the connection): the checkpointed VM had its host connected, and virtio-serial's
    /// post-load step tells the guest "host closed" when the new QEMU has no client at that
    /// point; the guest agent then sees its host come back only on its next look. Connected
    /// first, the port state matches and the agent reads the host's `Hello` at once.
    pub(super) async fn start_incoming(
        &self,
        spec: &VmSpec,
        paths: &VmPaths,
        state: &Path,
        ignore_shared: bool,
        after: StartAfter,
    ) -> Result<Resumed, VmmError> {
        let dir = paths.dir.clone();
        let spec = abs_spec(spec, dir.clone())?;
        let paths = &self.budgeted(paths)?;
        let mut args = qemu_args(&spec, paths);
        // `defer`: the migration capabilities must match the saving side's before loading
        // (QEMU 10 has no `-global` for `x-ignore-shared`).
        args.push(OsString::from("-incoming"));
        args.push(OsString::from("defer"));
        let t0 = Instant::now();
        let StartAfter { filling, old_gone } = after;
        if old_gone.is_none() {
            self.reserve_owned_ram(&spec, paths)?;
        }
        let (pid, exited) = self.spawn_detached(&spec, paths, Some(state), &args)?;
        let spawned_ms = t0.elapsed().as_millis() as u64;
        let info = paths.info(&spec, pid);
        // The RAM reserve made while the state loads (see below); waited for on every way out.
        let mut reserving: Option<tokio::task::JoinHandle<Result<(), VmmError>>> = None;
        let res = async {
            let qmp = connect_until(&paths.qmp, &exited, paths).await?;
            let launched_ms = t0.elapsed().as_millis() as u64;
            if let Some(f) = filling {
                let bytes = f.wait().await?;
                tracing::debug!(vm = %spec.id, spawned_ms, launched_ms, ram_ready_ms = t0.elapsed().as_millis() as u64, ram_copied_mib = bytes >> 20, "restore: QEMU up, RAM in place");
            }
            // Once the old VM is gone, its RAM file's blocks are free again: the new file's are
            // reserved on a blocking thread while QEMU loads the device state (which writes no
            // RAM: the RAM is in place), and waited for before the guest runs.
            reserving = match old_gone {
                Some(gone) => {
                    // Err only says the sender is dropped: the old VM is gone either way.
                    let _ = gone.await;
                    tracing::debug!(vm = %spec.id, gone_ms = t0.elapsed().as_millis() as u64, "restore: old VM gone");
                    self.owned_ram_to_reserve(&spec, paths).map(|(ram, size)| {
                        tokio::task::spawn_blocking(move || super::reserve_or_release(&ram, size))
                    })
                }
                None => None,
            };
            if ignore_shared {
                qmp.migrate_set_capabilities(&[("x-ignore-shared", true)])
                    .await?;
            }
            qmp.migrate_incoming(&format!("file:{}", state.display()))
                .await?;
            wait_incoming(&qmp, &exited, paths).await?;
            if let Some(r) = reserving.take() {
                r.await.map_err(|e| VmmError::Other(format!("RAM reserve: {e}")))??;
                tracing::debug!(vm = %spec.id, reserved_ms = t0.elapsed().as_millis() as u64, "restore: RAM reserved");
            }
            let agent = connect_agent_early(&qmp, &paths.agent).await;
            qmp.cont().await?;
            write_vm_json(paths, &info)?;
            Ok(agent)
        }
        .await;
        if let Some(r) = reserving {
            // A failed start: let the reserve end (or give itself back) before the caller
            // can try again on the same file.
            let _ = r.await;
        }
        let agent = match res {
            Ok(a) => a,
            Err(e) => {
                let e = why_it_ended(e, &exited, paths).await;
                let _ = Self::kill_and_wait(&info).await;
                return Err(e);
            }
        };
        tracing::info!(vm = %info.id, pid, restore_ms = t0.elapsed().as_millis() as u64, agent_early = agent.is_some(), "VM started from a state file");
        Ok(Resumed {
            info,
            agent,
            replaced_layer: None,
        })
    }
}

/// What a [`QemuDriver::start_incoming`] waits for before it loads the state: the RAM copy
/// into place, and (when it replaces a VM) the old QEMU's end, after which the new RAM file's
/// blocks are reserved (without it they are reserved before the launch).
#[derive(Default)]
pub(super) struct StartAfter {
    pub filling: Option<ramfile::Filling>,
    pub old_gone: Option<tokio::sync::oneshot::Receiver<()>>,
}

/// Remove what a checkpoint that failed (e.g. ran out of space) had written: its directory
/// (a partial state file, a partial RAM copy) and, when the VM did not switch to it, the new
/// overlay. When the switch happened the overlay is the VM's live disk and stays (the layer
/// below it is then an ordinary backing file of the chain).
fn discard_failed_checkpoint(dest: &Path, unused_overlay: Option<&Path>) {
    if let Err(e) = std::fs::remove_dir_all(dest)
        && e.kind() != std::io::ErrorKind::NotFound
    {
        tracing::warn!(dir = %dest.display(), error = %e, "cannot remove a failed checkpoint");
    }
    if let Some(o) = unused_overlay
        && let Err(e) = std::fs::remove_file(o)
        && e.kind() != std::io::ErrorKind::NotFound
    {
        tracing::warn!(file = %o.display(), error = %e, "cannot remove a failed checkpoint's overlay");
    }
}

/// Connect to the agent's chardev socket `sock` of a paused QEMU and wait (bounded) until
/// QEMU has accepted it: `query-chardev` names a socket chardev without a client
/// `disconnected:...`. `None` if either did not happen; the caller connects later as usual.
async fn connect_agent_early(
    qmp: &QmpClient,
    sock: &Path,
) -> Option<std::os::unix::net::UnixStream> {
    let stream = match std::os::unix::net::UnixStream::connect(sock) {
        Ok(s) => s,
        Err(e) => {
            tracing::debug!(error = %e, "no early agent connection");
            return None;
        }
    };
    let deadline = Instant::now() + EARLY_AGENT_WAIT;
    loop {
        let chardevs = qmp.execute("query-chardev", None).await.ok()?;
        let taken = chardevs
            .as_array()
            .into_iter()
            .flatten()
            .find(|c| c["label"] == AGENT_CHARDEV)
            .and_then(|c| c["filename"].as_str())
            .is_some_and(|f| !f.starts_with("disconnected:"));
        if taken {
            return Some(stream);
        }
        if Instant::now() > deadline {
            tracing::debug!("QEMU did not take the early agent connection");
            return None;
        }
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
}

/// The VM's own RAM file when its RAM is a shared file mapping (QMP `qom-get`); `None` for a
/// private mapping or a VM started before RAM files existed.
pub(super) async fn owned_ram(qmp: &QmpClient) -> Option<PathBuf> {
    let path = format!("/objects/{RAM_OBJECT}");
    let get = |prop: &'static str| {
        qmp.execute(
            "qom-get",
            Some(serde_json::json!({ "path": path, "property": prop })),
        )
    };
    let shared = get("share").await.ok()?.as_bool()?;
    if !shared {
        return None;
    }
    get("mem-path").await.ok()?.as_str().map(PathBuf::from)
}

/// Write the paused VM's device state (and its RAM unless `ignore_shared`) to `state`.
pub(super) async fn save_state(
    qmp: &QmpClient,
    state: &Path,
    ignore_shared: bool,
) -> Result<(), VmmError> {
    qmp.migrate_set_capabilities(&[("x-ignore-shared", ignore_shared)])
        .await?;
    qmp.migrate(&format!("file:{}", state.display())).await?;
    wait_migration(qmp, "completed").await
}

/// An absolute path for a file that need not exist yet.
pub(super) fn absolute(p: &Path) -> Result<PathBuf, VmmError> {
    std::path::absolute(p).map_err(super::io_err(p))
}

/// The file behind the `root` drive right now.
/// The root drive's active layer: its file and its node name.
pub(super) async fn active_disk(qmp: &QmpClient) -> Result<(PathBuf, String), VmmError> {
    let blocks = qmp.execute("query-block", None).await?;
    let inserted = blocks
        .as_array()
        .into_iter()
        .flatten()
        .find(|b| b["device"] == "root")
        .map(|b| &b["inserted"])
        .ok_or_else(|| VmmError::Qmp("query-block shows no `root` drive".into()))?;
    let file = inserted["file"]
        .as_str()
        .and_then(budget::layer_path)
        .ok_or_else(|| VmmError::Qmp(format!("query-block: no file in {inserted}")))?;
    let node = inserted["node-name"]
        .as_str()
        .ok_or_else(|| VmmError::Qmp(format!("query-block: no node name in {inserted}")))?;
    Ok((file, node.to_owned()))
}

async fn wait_migration(qmp: &QmpClient, want: &str) -> Result<(), VmmError> {
    let deadline = Instant::now() + MIGRATE_TIMEOUT;
    loop {
        let m = qmp.query_migrate().await?;
        match m["status"].as_str() {
            Some(s) if s == want => return Ok(()),
            Some("failed" | "cancelled") => {
                return Err(VmmError::Qmp(format!(
                    "migration {}: {}",
                    m["status"],
                    m["error-desc"].as_str().unwrap_or("no reason given")
                )));
            }
            _ => {}
        }
        if Instant::now() > deadline {
            return Err(VmmError::Timeout(
                MIGRATE_TIMEOUT,
                "the state file to be written",
            ));
        }
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
}

type Exited = tokio::sync::watch::Receiver<Option<std::process::ExitStatus>>;

fn exited_err(exited: &Exited, paths: &VmPaths) -> Option<VmmError> {
    exited.borrow().map(|st| {
        let log = tail(&paths.qemu_log, LOG_TAIL);
        let what = load_failure_hint(&log);
        VmmError::BootFailed(format!(
            "{what}QEMU exited with {st} during restore.\n--- qemu.log ---\n{log}"
        ))
    })
}

/// What QEMU's log says of a failed load, in a user's words (empty when it says nothing
/// known): a state file made by a VM with other devices or memory (another tryboxi or QEMU
/// version), or a load that failed otherwise.
fn load_failure_hint(log: &str) -> &'static str {
    let mismatch = [
        "Unknown savevm section",
        "Missing section footer",
        "Unknown ramblock",
    ]
    .iter()
    .any(|m| log.contains(m));
    if mismatch {
        "the saved state does not fit this VM: it was saved by a VM with other devices \
         (another tryboxi or QEMU version?), so it cannot be loaded. "
    } else if log.contains("load of migration failed") {
        "the saved state could not be loaded (damaged, or saved by a VM with other devices). "
    } else {
        ""
    }
}

/// The error of a start from a state file that failed: when QEMU exited (a failed load ends
/// the process; its QMP connection closing is often seen first), QEMU's own reason from its
/// log rather than "connection closed".
async fn why_it_ended(e: VmmError, exited: &Exited, paths: &VmPaths) -> VmmError {
    if matches!(e, VmmError::BootFailed(_)) {
        return e;
    }
    let mut rx = exited.clone();
    let _ = tokio::time::timeout(Duration::from_millis(500), rx.wait_for(Option::is_some)).await;
    exited_err(exited, paths).unwrap_or(e)
}

async fn connect_until(
    sock: &Path,
    exited: &Exited,
    paths: &VmPaths,
) -> Result<QmpClient, VmmError> {
    let deadline = Instant::now() + QMP_TIMEOUT * 6;
    loop {
        if let Some(e) = exited_err(exited, paths) {
            return Err(e);
        }
        if sock.exists()
            && let Ok(c) = QmpClient::connect(sock, QMP_TIMEOUT).await
        {
            return Ok(c);
        }
        if Instant::now() > deadline {
            return Err(VmmError::Timeout(
                QMP_TIMEOUT * 6,
                "QMP of the restoring QEMU",
            ));
        }
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
}

/// Wait until the incoming migration has loaded (status `paused`).
async fn wait_incoming(qmp: &QmpClient, exited: &Exited, paths: &VmPaths) -> Result<(), VmmError> {
    let deadline = Instant::now() + MIGRATE_TIMEOUT;
    loop {
        if let Some(e) = exited_err(exited, paths) {
            return Err(e);
        }
        let st = qmp.query_status().await?;
        if st.status == "paused" || st.status == "postmigrate" {
            return Ok(());
        }
        if st.running {
            return Ok(());
        }
        if Instant::now() > deadline {
            return Err(VmmError::Timeout(
                MIGRATE_TIMEOUT,
                "the state file to be loaded",
            ));
        }
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
}

#[cfg(test)]
mod hint_tests {
    use super::load_failure_hint;

    #[test]
    fn failed_loads_are_explained_from_qemus_log() {
        let other = "qemu-system-x86_64: Unknown savevm section or instance \
                     'virtio-mmio@00000000feb00600/virtio-rng' 0. Make sure that your current VM \
                     setup matches your saved VM setup\nqemu-system-x86_64: load of migration failed";
        assert!(load_failure_hint(other).starts_with("the saved state does not fit this VM"));
        let damaged = "qemu-system-x86_64: load of migration failed: Input/output error";
        assert!(load_failure_hint(damaged).starts_with("the saved state could not be loaded"));
        assert_eq!(
            load_failure_hint("qemu-system-x86_64: terminating on signal 9"),
            ""
        );
    }
}
