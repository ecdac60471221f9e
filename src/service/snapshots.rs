//! Snapshots of one sandbox: checkpoint (memory, device state and disk at one instant) and
//! restore. Files live in the sandbox's directory (`snapshots/<snap_id>/state.bin` and the
//! frozen `disk-*.qcow2` layers), so removing the sandbox removes its snapshots too.
//!
//! The workspace sync base (`workspace/manifest.json`) is saved with each snapshot and put back
//! by a restore, so diff and the next sync compare against what the restored VM has.
//!
//! After a restore the agent channel is reconnected at once; commands that were running on the
//! old connection end with an `error` event (their host side is gone), never a hang.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

use super::vms::LiveVm;
use super::{Service, ServiceError};
use crate::api::{self, SandboxState};
use crate::ids;
use crate::rpc::AgentClient;
use crate::store::{SANDBOXES, SNAPSHOTS};
use crate::vmm::qemu::{Checkpoint, Resumed};

/// How long the handshake on the early agent connection may take before a fresh connection
/// is tried (a fresh clone's agent answers within tens of ms even under TCG).
const EARLY_HANDSHAKE: Duration = Duration::from_secs(5);
use crate::vmm::{Accel, VmSpec, VmmDriver};
use crate::workspace::manifest::Base;

/// What the store keeps per snapshot.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct SnapshotRecord {
    #[serde(flatten)]
    pub api: api::Snapshot,
    pub checkpoint: Checkpoint,
    /// Digest of the CA additions the guest's trust bundle held when the snapshot was taken
    /// (`guest_trust`), when known: a restore with the same additions skips the first exec's
    /// look at the bundle.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub trust_digest: Option<String>,
}

impl Service {
    /// `POST /v1/sandboxes/{id}/snapshots`.
    pub async fn create_snapshot(
        &self,
        id: &str,
        req: api::SnapshotRequest,
    ) -> Result<api::Snapshot, ServiceError> {
        match self.life.service() {
            Some(svc) => {
                let id = id.to_owned();
                super::locks::to_the_end(async move { svc.snapshot_held(&id, req).await }).await
            }
            None => self.snapshot_held(id, req).await,
        }
    }

    async fn snapshot_held(
        &self,
        id: &str,
        req: api::SnapshotRequest,
    ) -> Result<api::Snapshot, ServiceError> {
        // Held throughout: the checkpoint and the sync base saved with it are of one instant
        // (no sync or apply moves the base in between, no pause or restore swaps the VM).
        let (_life, rec, vm) = self.hold_ready(id).await?;
        if let Some(name) = &req.name {
            if name.is_empty() || name.len() > 64 || name.starts_with(ids::SNAPSHOT) {
                return Err(ServiceError::BadRequest(format!(
                    "snapshot name must be 1-64 characters and not start with `{}`",
                    ids::SNAPSHOT
                )));
            }
            if self
                .snapshots_of(id)?
                .iter()
                .any(|s| s.api.name.as_deref() == Some(name))
            {
                return Err(ServiceError::Conflict(format!(
                    "sandbox `{id}` already has a snapshot named `{name}`"
                )));
            }
        }
        let driver = self.driver()?;
        let snap_id = ids::new_id(ids::SNAPSHOT);
        let dir = rec.dir.join("snapshots").join(&snap_id);
        let next = rec.dir.join(format!("disk-{snap_id}.qcow2"));
        // Its size is known before anything is written: a snapshot that cannot fit is refused
        // with the sandbox untouched.
        let what = format!("a snapshot of {id}");
        self.ensure_room_for(
            &rec.dir,
            &what,
            super::diskroom::checkpoint_bytes(&rec, true),
        )?;
        // Read before the checkpoint: a bundle recorded by then is in the frozen guest.
        let trust_digest = self.guest_trust.written_for(id, &vm);
        let t0 = Instant::now();
        if !req.keep_memory {
            // The disk alone: what the guest has not written back must be on it.
            super::reboot::guest_sync(&vm.agent, id).await;
        }
        let mut cp = driver
            .checkpoint(&vm.info, &dir, &next, req.keep_memory)
            .await
            .map_err(|e| {
                // The driver removed its partial files; the VM runs on.
                ServiceError::of_write(
                    &rec.dir,
                    &what,
                    &format!("cannot checkpoint sandbox `{id}`"),
                    &e.to_string(),
                )
            })?;
        // From here a failure leaves no half snapshot behind: its directory goes (the VM runs
        // on its new overlay, over the now frozen layer, as after any snapshot).
        let discard = |e: ServiceError| {
            if let Err(rm) = crate::safefs::remove_under(&rec.dir, &dir) {
                tracing::warn!(sandbox = %id, error = %rm, "cannot remove a failed snapshot's files");
            }
            e
        };
        // The workspace sync base goes with the snapshot (its blobs are write-once, so the
        // manifest is enough): after a restore, diff and sync compare against what the VM had.
        let base = Base::new(rec.dir.join("workspace"));
        if let Ok(m) = base.load() {
            Base::new(dir.join("workspace")).save(&m).map_err(|e| {
                discard(ServiceError::of_write(
                    &rec.dir,
                    &what,
                    "cannot save the sync base with the snapshot",
                    &e.to_string(),
                ))
            })?;
        }
        if !req.keep_memory {
            // The frozen layer is the snapshot (its RAM was not copied); the state goes too.
            super::reboot::drop_memory(&mut cp).map_err(&discard)?;
        }
        let snap = SnapshotRecord {
            api: api::Snapshot {
                id: snap_id.clone(),
                sandbox_id: id.to_owned(),
                name: req.name,
                created_at: super::now_rfc3339(),
                state_bytes: cp.state_bytes,
                duration_ms: t0.elapsed().as_millis() as u64,
                memory: !cp.disk_only,
            },
            checkpoint: cp,
            trust_digest,
        };
        self.store
            .put(SNAPSHOTS, &snap_id, &snap)
            .map_err(|e| discard(e.into()))?;
        tracing::info!(sandbox = %id, snapshot = %snap_id, ms = snap.api.duration_ms, bytes = snap.api.state_bytes, "snapshot taken");
        Ok(snap.api)
    }

    /// `GET /v1/sandboxes/{id}/snapshots`, oldest first.
    pub fn list_snapshots(&self, id: &str) -> Result<api::SnapshotList, ServiceError> {
        self.record(id)?;
        let mut snaps: Vec<api::Snapshot> =
            self.snapshots_of(id)?.into_iter().map(|s| s.api).collect();
        snaps.sort_by(|a, b| a.created_at.cmp(&b.created_at));
        Ok(api::SnapshotList { snapshots: snaps })
    }

    pub(super) fn snapshots_of(&self, id: &str) -> Result<Vec<SnapshotRecord>, ServiceError> {
        Ok(self
            .store
            .list::<SnapshotRecord>(SNAPSHOTS)?
            .into_iter()
            .filter(|s| s.api.sandbox_id == id)
            .collect())
    }

    /// Forget the snapshot records of a removed sandbox (its files went with its directory).
    pub(super) fn forget_snapshots(&self, id: &str) {
        if let Ok(snaps) = self.snapshots_of(id) {
            for s in snaps {
                let _ = self.store.delete(SNAPSHOTS, &s.api.id);
            }
        }
    }

    /// `POST /v1/sandboxes/{id}/restore`: replace the sandbox's VM by one started from the snapshot.
    pub async fn restore_snapshot(
        self: &Arc<Self>,
        id: &str,
        req: api::RestoreRequest,
    ) -> Result<api::Sandbox, ServiceError> {
        let (svc, id) = (self.clone(), id.to_owned());
        super::locks::to_the_end(async move { svc.restore_held(&id, req).await }).await
    }

    async fn restore_held(
        self: &Arc<Self>,
        id: &str,
        req: api::RestoreRequest,
    ) -> Result<api::Sandbox, ServiceError> {
        // Held throughout: a restore never overlaps an apply or sync (whose sync base it puts
        // back), a pause, or a remove.
        let (_life, mut rec) = self.hold(id).await?;
        if !matches!(
            rec.api.state,
            SandboxState::Ready | SandboxState::Failed | SandboxState::Paused
        ) {
            return Err(ServiceError::Conflict(format!(
                "sandbox `{id}` is {}",
                rec.api.state
            )));
        }
        let snap = self.find_snapshot(id, &req.snapshot)?;
        let images = self.images()?;
        let driver = self.driver()?;
        let rootfs = self.template_rootfs(&images, &rec.api.template)?;
        // A failed sandbox holds nothing; it needs its resources back first.
        let reservation = if self.ledger.holds(id) {
            None
        } else {
            Some(
                self.ledger
                    .reserve(
                        id,
                        super::scheduler::Resources::new(rec.api.vcpus, rec.api.memory_mib as u64),
                    )
                    .await?,
            )
        };
        let accel = match rec.api.accel.as_deref() {
            Some("kvm") => Accel::Kvm,
            _ => Accel::Tcg,
        };
        // Take the old VM out first, so its watcher does not mark the sandbox failed; the
        // driver kills it while it makes the new VM's files.
        let old = self.vms.take(id);
        if old.is_none() {
            self.kill_leftover(&rec.dir).await;
        }
        let spec = VmSpec {
            id: id.to_owned(),
            dir: rec.dir.clone(),
            kernel: images.kernel,
            initramfs: images.initramfs,
            rootfs,
            vcpus: rec.api.vcpus,
            memory_mib: rec.api.memory_mib,
            accel,
        };
        // The stack outlives the old QEMU; the new one connects to the same socket.
        self.ensure_network(id, &rec.dir)?;
        let overlay = rec.dir.join(format!("disk-{}.qcow2", ids::new_id("r")));
        // A paused sandbox whose restore fails stays paused, its pause state intact.
        let was_paused = old.is_none() && rec.api.state == SandboxState::Paused;
        if was_paused {
            super::pause::keep_paused_ram_apart(&rec)?;
        }
        // The layer the sandbox writes now: after the restore nothing refers to it (a running
        // VM's is asked of its QEMU by the driver, just before the kill).
        let paused_top = if was_paused {
            super::pause::paused_layer(&rec)
        } else {
            None
        };
        let t0 = Instant::now();
        // `reboot`: the snapshot's disk alone, booted afresh (its state files stay).
        let mut cp = snap.checkpoint.clone();
        cp.disk_only |= req.reboot;
        let restored = async {
            let mut started = driver
                .restore(&spec, &cp, &overlay, old.as_ref().map(|vm| &vm.info))
                .await
                .map_err(|e| {
                    let how = if cp.disk_only {
                        String::new()
                    } else {
                        format!(
                            " (`tryboxi restore --reboot {id} {}` boots afresh on its disk \
                             instead: files as the guest had written them back, no processes)",
                            snap.api.id
                        )
                    };
                    ServiceError::of_write(
                        &rec.dir,
                        "the VM's RAM file",
                        &format!("cannot restore `{}`{how}", snap.api.id),
                        &e.to_string(),
                    )
                })?;
            let vm_ms = t0.elapsed().as_millis() as u64;
            let replaced = started.replaced_layer.take();
            let (info, agent) =
                agent_or_kill(&driver, started, "restored", self.agent_deadlines()).await?;
            // The VM runs on the checkpoint's time until told the host's.
            super::guest_trust::sync_clock(&agent, &info.id);
            Ok::<_, ServiceError>((
                LiveVm { info, agent },
                vm_ms,
                t0.elapsed().as_millis() as u64,
                replaced,
            ))
        }
        .await;
        match restored {
            Ok((vm, vm_ms, agent_ms, replaced)) => {
                let saved = rec
                    .dir
                    .join("snapshots")
                    .join(&snap.api.id)
                    .join("workspace");
                if let Ok(m) = Base::new(saved).load() {
                    Base::new(rec.dir.join("workspace")).save(&m).map_err(|e| {
                        ServiceError::Internal(format!(
                            "cannot put back the snapshot's sync base: {e}"
                        ))
                    })?;
                }
                // A restore of a paused sandbox replaces its paused state.
                let paused = rec.dir.join(super::pause::PAUSE_DIR);
                if paused.exists()
                    && let Err(e) = crate::safefs::remove_under(&self.paths.root, &paused)
                {
                    tracing::warn!(sandbox = %id, error = %e, "cannot delete the old pause state");
                }
                if let Some(old_top) = replaced.or(paused_top) {
                    self.drop_abandoned_layer(&rec, &old_top, &overlay);
                }
                tracing::info!(sandbox = %id, snapshot = %snap.api.id, vm_ms, agent_ms, ms = t0.elapsed().as_millis() as u64, "sandbox restored");
                rec.api.state = SandboxState::Ready;
                rec.api.error = None;
                self.store.put(SANDBOXES, id, &rec)?;
                if let Some(r) = reservation {
                    r.keep();
                }
                let vm = Arc::new(vm);
                if let Some(d) = &snap.trust_digest {
                    self.guest_trust.carry_over(id, &vm, d.clone());
                }
                self.vms.insert(id, vm.clone());
                self.watch(id.to_owned(), vm);
                Ok(rec.api)
            }
            Err(e) => {
                // Whatever step failed, the VM that was replaced must not run on unowned.
                if let Some(old) = &old {
                    let _ = driver.kill(&old.info).await;
                }
                // Nothing refers to the new overlay.
                if overlay.exists()
                    && let Err(e) = crate::safefs::remove_under(&rec.dir, &overlay)
                {
                    tracing::warn!(sandbox = %id, error = %e, "cannot delete the failed restore's overlay");
                }
                if was_paused {
                    tracing::warn!(sandbox = %id, snapshot = %snap.api.id, error = %e, "restore failed; the sandbox stays paused");
                } else {
                    self.mark_failed(id, e.to_string());
                }
                Err(e)
            }
        }
    }

    /// Delete the root layer `old_top` a restore abandoned (the layer the replaced VM wrote):
    /// the restored VM writes `overlay` over the snapshot's chain, and nothing else refers to
    /// the old top, so keeping it would let restore after restore fill the host with layers
    /// no disk budget counts. Kept when it is not a `disk*.qcow2` in the sandbox's own
    /// directory, is a snapshot's frozen layer, or another layer there names it as backing
    /// (each checked: the path came from QEMU or a pause record).
    fn drop_abandoned_layer(&self, rec: &super::SandboxRecord, old_top: &Path, overlay: &Path) {
        // The snapshots' frozen layers are read here (the store); the file work (the layers'
        // headers, the unlink of a layer that may hold gigabytes) on a blocking thread after
        // the restore has answered: nothing the restored VM uses is touched.
        let frozen: Option<Vec<PathBuf>> = self.snapshots_of(&rec.api.id).ok().map(|snaps| {
            snaps
                .iter()
                .map(|s| s.checkpoint.disk_layer.clone())
                .collect()
        });
        let (id, dir) = (rec.api.id.clone(), rec.dir.clone());
        let (old_top, overlay) = (old_top.to_owned(), overlay.to_owned());
        tokio::task::spawn_blocking(move || {
            drop_layer_if_abandoned(&id, &dir, &old_top, &overlay, frozen.as_deref())
        });
    }
}

/// [`Service::drop_abandoned_layer`]'s file work; `frozen`: the snapshots' layers (`None`:
/// unknown, so the layer stays).
fn drop_layer_if_abandoned(
    id: &str,
    sandbox_dir: &Path,
    old_top: &Path,
    overlay: &Path,
    frozen: Option<&[PathBuf]>,
) {
    let canon = |p: &Path| std::fs::canonicalize(p).ok();
    let (Some(dir), Some(top)) = (canon(sandbox_dir), canon(old_top)) else {
        return;
    };
    let name = top.file_name().and_then(|n| n.to_str()).unwrap_or("");
    if top.parent() != Some(dir.as_path())
        || !name.starts_with("disk")
        || !name.ends_with(".qcow2")
        || canon(overlay).as_deref() == Some(top.as_path())
    {
        return;
    }
    let in_snapshot = frozen.is_none_or(|layers| {
        layers
            .iter()
            .any(|l| canon(l).as_deref() == Some(top.as_path()))
    });
    let backs_another = std::fs::read_dir(&dir).map_or(true, |rd| {
        rd.flatten().take(4096).any(|e| {
            let p = e.path();
            p != top
                && p.extension().is_some_and(|x| x == "qcow2")
                && crate::vmm::qemu::layer_backing(&p)
                    .and_then(|b| canon(&b))
                    .as_deref()
                    == Some(top.as_path())
        })
    });
    if in_snapshot || backs_another {
        return;
    }
    match crate::safefs::remove_under(sandbox_dir, &top) {
        Ok(()) => {
            tracing::info!(sandbox = %id, layer = %top.display(), "abandoned root layer deleted")
        }
        Err(e) => {
            tracing::warn!(sandbox = %id, error = %e, "cannot delete an abandoned root layer")
        }
    }
}

/// Connect to the agent of a VM started from a checkpoint (restore, clone, resume), on the
/// connection the driver made before the VM continued when there is one; a VM whose agent does
/// not answer is killed, never left running unowned. `what` names it in the error.
pub(super) async fn agent_or_kill(
    driver: &crate::vmm::QemuDriver,
    started: Resumed,
    what: &str,
    deadlines: crate::rpc::Deadlines,
) -> Result<(crate::vmm::VmInfo, AgentClient), ServiceError> {
    let (info, client) = connect_checkpointed(driver, started, what).await?;
    client.set_deadlines(deadlines);
    Ok((info, client))
}

async fn connect_checkpointed(
    driver: &crate::vmm::QemuDriver,
    started: Resumed,
    what: &str,
) -> Result<(crate::vmm::VmInfo, AgentClient), ServiceError> {
    let Resumed { info, agent, .. } = started;
    if let Some(early) = agent {
        let res = async {
            early.set_nonblocking(true)?;
            let s = tokio::net::UnixStream::from_std(early)?;
            tokio::time::timeout(EARLY_HANDSHAKE, AgentClient::connect(s))
                .await
                .map_err(|_| std::io::Error::from(std::io::ErrorKind::TimedOut))?
                .map_err(std::io::Error::other)
        }
        .await;
        match res {
            Ok(client) => return Ok((info, client)),
            Err(e) => {
                tracing::debug!(vm = %info.id, error = %e, "early agent connection failed; connecting again")
            }
        }
    }
    match AgentClient::connect_unix(&info.agent_socket, Duration::from_secs(30)).await {
        Ok(client) => Ok((info, client)),
        Err(e) => {
            let _ = driver.kill(&info).await;
            Err(ServiceError::Internal(format!(
                "the {what} guest agent did not answer: {e}"
            )))
        }
    }
}
