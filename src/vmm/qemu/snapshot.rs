//! Checkpoint and restore of a QEMU microvm.
//!
//! A checkpoint captures memory, device state and disk at one instant: the VM is paused, its
//! device state is written with `migrate` to `state.bin`, and while it is still paused
//! `blockdev-snapshot-sync` freezes the active qcow2 layer (it becomes a read-only backing
//! file) and puts a fresh overlay on top; then the VM continues. No disk data is copied.
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
    LOG_TAIL, QMP_TIMEOUT, QemuDriver, RAM_OBJECT, VmPaths, abs, abs_spec, qemu_args, ramfile,
    tail, write_vm_json,
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
}

/// File name of a frozen RAM file inside a checkpoint directory.
pub const RAM_FILE: &str = "mem.ram";

impl QemuDriver {
    /// Checkpoint the running VM `vm` into `dest` (a new directory inside the VM's directory).
    /// `next_overlay` is the file the VM continues to write to afterwards.
    pub async fn checkpoint(
        &self,
        vm: &VmInfo,
        dest: &Path,
        next_overlay: &Path,
    ) -> Result<Checkpoint, VmmError> {
        std::fs::create_dir_all(dest).map_err(super::io_err(dest))?;
        let dest = abs(dest)?;
        let next_overlay = absolute(next_overlay)?;
        let state = dest.join("state.bin");
        let qmp = QmpClient::connect(&vm.qmp_socket, QMP_TIMEOUT).await?;
        let layer = active_disk(&qmp).await?;
        let ram = owned_ram(&qmp).await;
        let frozen_ram = dest.join(RAM_FILE);
        let t0 = Instant::now();
        qmp.stop().await?;
        let res = async {
            save_state(&qmp, &state, ram.is_some()).await?;
            qmp.execute(
                "blockdev-snapshot-sync",
                Some(serde_json::json!({
                    "device": "root",
                    "snapshot-file": next_overlay,
                    "format": "qcow2",
                })),
            )
            .await?;
            if let Some(r) = &ram {
                let bytes = ramfile::copy_sparse_async(r, &frozen_ram).await?;
                tracing::debug!(vm = %vm.id, bytes, "RAM file frozen");
            }
            Ok::<(), VmmError>(())
        }
        .await;
        // Whatever happened, the VM must not stay paused.
        let cont = qmp.cont().await;
        res?;
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
            ram_file: ram.map(|_| frozen_ram),
            workspace_disk,
        })
    }

    /// Start `spec`'s VM from `cp`: a new overlay `overlay` over the checkpoint's frozen layer,
    /// memory and devices from its state file. Returns once the VM runs again.
    pub async fn restore(
        &self,
        spec: &VmSpec,
        cp: &Checkpoint,
        overlay: &Path,
    ) -> Result<VmInfo, VmmError> {
        let t0 = Instant::now();
        let paths = VmPaths::for_checkpoint_start(
            spec,
            absolute(overlay)?,
            None,
            cp.workspace_disk.as_deref(),
        )?;
        // The new overlay and the VM's own copy of the frozen RAM (so later snapshots stay
        // fast; a state file that carries the RAM fills a fresh file) are made side by side.
        let ram = async {
            match &cp.ram_file {
                Some(r) => ramfile::copy_sparse_async(r, paths.ram.path()).await,
                None => ramfile::remove(paths.ram.path()).map(|()| 0),
            }
        };
        let (disk, copied) =
            tokio::join!(self.qcow2_over(&cp.disk_layer, "qcow2", &paths.disk), ram);
        disk?;
        let copied = copied?;
        tracing::debug!(vm = %spec.id, ms = t0.elapsed().as_millis() as u64, ram_copied_mib = copied >> 20, "restore: disk overlay and RAM in place");
        self.start_incoming(spec, &paths, &cp.state_file, cp.ram_file.is_some())
            .await
    }

    /// Launch `spec`'s VM with `paths` (disk and RAM already in place) from the state file
    /// `state`, wait until the incoming migration has loaded, continue it, write `vm.json`.
    pub(super) async fn start_incoming(
        &self,
        spec: &VmSpec,
        paths: &VmPaths,
        state: &Path,
        ignore_shared: bool,
    ) -> Result<VmInfo, VmmError> {
        let dir = paths.dir.clone();
        let spec = abs_spec(spec, dir.clone())?;
        let mut args = qemu_args(&spec, paths);
        // `defer`: the migration capabilities must match the saving side's before loading
        // (QEMU 10 has no `-global` for `x-ignore-shared`).
        args.push(OsString::from("-incoming"));
        args.push(OsString::from("defer"));
        let t0 = Instant::now();
        let (pid, exited) = self.spawn_detached(&args, &dir, &paths.qemu_log)?;
        let info = paths.info(&spec, pid);
        let res = async {
            let qmp = connect_until(&paths.qmp, &exited, paths).await?;
            if ignore_shared {
                qmp.migrate_set_capabilities(&[("x-ignore-shared", true)])
                    .await?;
            }
            qmp.migrate_incoming(&format!("file:{}", state.display()))
                .await?;
            wait_incoming(&qmp, &exited, paths).await?;
            qmp.cont().await?;
            write_vm_json(paths, &info)
        }
        .await;
        if let Err(e) = res {
            let _ = Self::kill_and_wait(&info).await;
            return Err(e);
        }
        tracing::info!(vm = %info.id, pid, restore_ms = t0.elapsed().as_millis() as u64, "VM started from a state file");
        Ok(info)
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
pub(super) async fn active_disk(qmp: &QmpClient) -> Result<PathBuf, VmmError> {
    let blocks = qmp.execute("query-block", None).await?;
    blocks
        .as_array()
        .into_iter()
        .flatten()
        .find(|b| b["device"] == "root")
        .and_then(|b| b["inserted"]["file"].as_str())
        .map(PathBuf::from)
        .ok_or_else(|| VmmError::Qmp("query-block shows no `root` drive".into()))
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
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
}

type Exited = tokio::sync::watch::Receiver<Option<std::process::ExitStatus>>;

fn exited_err(exited: &Exited, paths: &VmPaths) -> Option<VmmError> {
    exited.borrow().map(|st| {
        VmmError::BootFailed(format!(
            "QEMU exited with {st} during restore.\n--- qemu.log ---\n{}",
            tail(&paths.qemu_log, LOG_TAIL)
        ))
    })
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
        tokio::time::sleep(Duration::from_millis(5)).await;
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
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
}
