//! Pause to disk and resume: a paused sandbox has no QEMU; its device state is
//! `paused/state.bin`, its RAM is its own RAM file (or is inside that state file for a VM that
//! ran on a borrowed mapping), its disk the overlay it was writing. `paused/pause.json` says
//! which files and why it was paused.
//!
//! A filesystem-only pause (`keep_memory: false`, E2B's `mode="filesystem"`) keeps the disk
//! alone: the guest syncs its file systems and powers off, and the next start boots afresh on
//! that disk (processes and memory are gone, files are as they were). A reboot
//! (`resume` with `reboot: true`, E2B's `memory: false` on connect) starts any paused sandbox
//! that way, dropping its memory state: the way back for a pause whose state a newer QEMU or
//! image set cannot load.
//!
//! Owns: the `ready <-> paused` transitions (user pause/resume, pause on daemon shutdown,
//! automatic idle pause, transparent resume on use) and the last-use clock behind idle pause.
//! Every transition runs under the sandbox's lifecycle lock (`locks.rs`); idle and pressure
//! pauses skip a sandbox whose lock is held (it is in use).

use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock, Weak};
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

use super::locks::{LifeGuard, to_the_end};
use super::vms::LiveVm;
use super::{SandboxRecord, Service, ServiceError};
use crate::api::{self, SandboxState};
use crate::config::ShutdownMode;
use crate::store::SANDBOXES;
use crate::vmm::qemu::Checkpoint;
use crate::vmm::{Accel, VmSpec, VmmDriver};

/// Directory (inside the sandbox directory) of a paused sandbox's state.
pub const PAUSE_DIR: &str = "paused";
const PAUSE_FILE: &str = "pause.json";

/// Why a sandbox was paused.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum PauseReason {
    /// `tryboxi pause`: stays paused until resumed or used.
    User,
    /// Daemon shutdown: the next daemon resumes it at start.
    Shutdown,
    /// Nothing used it for `idle_pause_secs`: resumed on first use.
    Idle,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub(super) struct PauseRecord {
    /// The VM's device state and memory; `None` after a filesystem-only pause.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(super) checkpoint: Option<Checkpoint>,
    /// The root layer a filesystem-only pause left (a memory pause's is its checkpoint's).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(super) disk_layer: Option<std::path::PathBuf>,
    pub(super) reason: PauseReason,
    pub(super) paused_at: String,
}

impl PauseRecord {
    /// The root layer the paused VM wrote last.
    pub(super) fn layer(&self) -> Option<&std::path::Path> {
        match &self.checkpoint {
            Some(cp) => Some(&cp.disk_layer),
            None => self.disk_layer.as_deref(),
        }
    }
}

/// How a paused sandbox starts again.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ResumeHow {
    /// From its memory state when it has one (processes carry on), else a boot on its disk.
    Memory,
    /// A boot on its disk, its memory state (if any) dropped.
    Reboot,
}

/// Per-sandbox lifecycle locks, last-use times, and a handle back to the service (for the
/// watchers of resumed VMs).
#[derive(Default)]
pub struct Lifecycle {
    pub(super) locks: super::locks::LifeLocks,
    last_used: Mutex<HashMap<String, Instant>>,
    me: OnceLock<Weak<Service>>,
    stopping: std::sync::atomic::AtomicBool,
    pub(super) golden: super::golden::GoldenState,
}

impl Lifecycle {
    /// Note that `id` was used now (idle pause counts from here).
    pub(super) fn touch(&self, id: &str) {
        let mut m = self.last_used.lock().unwrap_or_else(|p| p.into_inner());
        m.insert(id.to_owned(), Instant::now());
    }

    fn idle_for(&self, id: &str) -> Option<Duration> {
        let m = self.last_used.lock().unwrap_or_else(|p| p.into_inner());
        m.get(id).map(Instant::elapsed)
    }

    /// The sandbox is removed: its lock refuses new holders (the caller holds it).
    pub(super) fn forget(&self, id: &str) {
        self.locks.tombstone(id);
        self.last_used
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(id);
    }

    pub(super) fn shutting_down(&self) -> bool {
        self.stopping.load(std::sync::atomic::Ordering::Relaxed)
    }

    pub(super) fn set_shutting_down(&self) {
        self.stopping
            .store(true, std::sync::atomic::Ordering::Relaxed);
    }

    pub(super) fn service(&self) -> Option<Arc<Service>> {
        self.me.get().and_then(Weak::upgrade)
    }

    /// The service, not kept alive (for tasks that may outlive it); `None` before
    /// `start_lifecycle` (unit tests).
    pub(super) fn weak(&self) -> Option<Weak<Service>> {
        self.me.get().cloned()
    }
}

impl Service {
    /// Daemon start, after `recover`: remember the service for watchers, resume what the last
    /// shutdown paused (in the background), and start the idle-pause clock.
    pub fn start_lifecycle(self: &Arc<Self>) {
        let _ = self.life.me.set(Arc::downgrade(self));
        self.start_pool_upkeep();
        super::usage::spawn_sampler(self);
        if let Ok(recs) = self.store.list::<SandboxRecord>(SANDBOXES) {
            for rec in recs {
                let id = rec.api.id.clone();
                if rec.api.state == SandboxState::Paused
                    && read_pause(&rec).is_ok_and(|p| p.reason == PauseReason::Shutdown)
                {
                    let svc = self.clone();
                    tokio::spawn(async move {
                        if let Err(e) = svc.resume_sandbox(&id).await {
                            tracing::warn!(sandbox = %id, error = %e, "cannot resume after restart");
                        }
                    });
                } else if rec.api.state == SandboxState::Ready {
                    self.life.touch(&id);
                }
            }
        }
        if self.config.idle_pause_secs > 0 {
            let weak = Arc::downgrade(self);
            let idle = Duration::from_secs(self.config.idle_pause_secs);
            tokio::spawn(async move {
                let tick = (idle / 4).clamp(Duration::from_millis(200), Duration::from_secs(30));
                loop {
                    tokio::time::sleep(tick).await;
                    let Some(svc) = weak.upgrade() else { return };
                    svc.pause_idle(idle).await;
                }
            });
        }
    }

    /// Pause every ready sandbox nobody used for `idle` and that has no request in flight.
    async fn pause_idle(self: &Arc<Self>, idle: Duration) {
        let Ok(recs) = self.store.list::<SandboxRecord>(SANDBOXES) else {
            return;
        };
        for rec in recs {
            let id = &rec.api.id;
            if rec.api.state != SandboxState::Ready {
                continue;
            }
            let Some(vm) = self.vms.get(id) else { continue };
            // The live map, its watcher and `vm` here hold one reference each; more means an
            // exec or a workspace operation is using the VM right now.
            let busy = Arc::strong_count(&vm) > 3;
            drop(vm);
            let idle_for = self.life.idle_for(id);
            if busy || idle_for.is_some_and(|d| d < idle) {
                continue;
            }
            if idle_for.is_none() {
                // First seen now (e.g. created before the clock started): count from here.
                self.life.touch(id);
                continue;
            }
            match self.pause_if_free(id, PauseReason::Idle).await {
                Ok(Some(_)) => {
                    tracing::info!(sandbox = %id, idle_s = idle.as_secs(), "idle sandbox paused")
                }
                Ok(None) => tracing::debug!(sandbox = %id, "in use; not idle-paused"),
                Err(e) => tracing::warn!(sandbox = %id, error = %e, "idle pause failed"),
            }
        }
    }

    /// `POST /v1/sandboxes/{id}/pause`.
    pub async fn pause_sandbox(&self, id: &str) -> Result<api::Sandbox, ServiceError> {
        self.pause_sandbox_keeping(id, true).await
    }

    /// `POST /v1/sandboxes/{id}/pause` with `keep_memory`: `false` keeps the disk alone.
    pub async fn pause_sandbox_keeping(
        &self,
        id: &str,
        keep_memory: bool,
    ) -> Result<api::Sandbox, ServiceError> {
        match self.life.service() {
            Some(svc) => {
                let id = id.to_owned();
                to_the_end(async move { svc.pause_with(&id, PauseReason::User, keep_memory).await })
                    .await
            }
            None => self.pause_with(id, PauseReason::User, keep_memory).await,
        }
    }

    pub(super) async fn pause_with(
        &self,
        id: &str,
        reason: PauseReason,
        keep_memory: bool,
    ) -> Result<api::Sandbox, ServiceError> {
        let (g, rec) = self.hold(id).await?;
        self.pause_locked(&g, rec, reason, keep_memory).await
    }

    /// Idle and memory-pressure pauses: `None` (nothing done) when the sandbox's lifecycle
    /// lock is held, i.e. something is using or changing it right now.
    pub(super) async fn pause_if_free(
        &self,
        id: &str,
        reason: PauseReason,
    ) -> Result<Option<api::Sandbox>, ServiceError> {
        self.record(id)?;
        let Some(g) = self.life.locks.try_hold(id) else {
            return Ok(None);
        };
        let rec = self.record(id)?;
        self.pause_locked(&g, rec, reason, true).await.map(Some)
    }

    /// Pause `rec` to disk (`keep_memory: false`: its disk alone); the caller holds its
    /// lifecycle lock.
    async fn pause_locked(
        &self,
        held: &LifeGuard,
        mut rec: SandboxRecord,
        reason: PauseReason,
        keep_memory: bool,
    ) -> Result<api::Sandbox, ServiceError> {
        let id = rec.api.id.clone();
        let id = id.as_str();
        match rec.api.state {
            SandboxState::Ready => {}
            SandboxState::Paused => return Ok(rec.api),
            s => {
                return Err(ServiceError::Conflict(format!(
                    "sandbox `{id}` is {s}, not ready"
                )));
            }
        }
        if !keep_memory {
            return self.pause_disk_only(held, rec, reason).await;
        }
        let driver = self.driver()?;
        // What it writes is known up front (a small state file, or the whole RAM for a VM on
        // a borrowed mapping): a pause that cannot fit is refused with the VM still running.
        let what = format!("pausing {id}");
        self.ensure_room_for(
            &rec.dir,
            &what,
            super::diskroom::checkpoint_bytes(&rec, false),
        )?;
        // A user's or the shutdown's pause (the one an upgrade resumes) writes back what the
        // guest still holds, so that a later boot on the disk (`resume --reboot`, when an
        // upgrade cannot load the state) loses no file. Idle and memory-pressure pauses skip
        // it: the guest has been idle past its own writeback interval, and a pressure pause
        // must free memory now, not after a sync of up to 10 s.
        let t0 = Instant::now();
        if reason != PauseReason::Idle
            && let Some(vm) = self.vms.get(id)
        {
            super::reboot::guest_sync(&vm.agent, id).await;
        }
        // Out of the live map first, so its watcher takes the agent link closing as expected.
        let vm = self
            .vms
            .take(id)
            .ok_or_else(|| ServiceError::Conflict(format!("sandbox `{id}` has no running VM")))?;
        let dir = rec.dir.join(PAUSE_DIR);
        let cp = match driver.pause_to_disk(&vm.info, &dir).await {
            Ok(cp) => cp,
            Err(e) => {
                // The driver continued the VM if it could; give it back unless it died.
                let alive = driver.is_alive(&vm.info);
                if alive {
                    self.vms.insert(id, vm);
                    // A partial state file must not be taken for a pause later.
                    if let Err(rm) = crate::safefs::remove_under(&rec.dir, &dir) {
                        tracing::warn!(sandbox = %id, error = %rm, "cannot remove a failed pause's files");
                    }
                } else {
                    self.mark_failed(id, format!("pause failed and the VM is gone: {e}"));
                }
                return Err(ServiceError::of_write(
                    &rec.dir,
                    &what,
                    &format!("cannot pause sandbox `{id}`"),
                    &e.to_string(),
                ));
            }
        };
        let state_bytes = cp.state_bytes;
        let pr = PauseRecord {
            checkpoint: Some(cp),
            disk_layer: None,
            reason,
            paused_at: super::now_rfc3339(),
        };
        let extra = serde_json::json!({"state_bytes": state_bytes, "memory": true});
        let ms = self.record_paused(&mut rec, &pr, t0, extra)?;
        tracing::info!(sandbox = %id, ?reason, ms, state_bytes, "sandbox paused to disk");
        Ok(rec.api)
    }

    /// `rec`'s VM is gone and `pr` says what it left: write the pause file, mark the record
    /// paused, give its room back to the ledger, publish `sandbox.paused` (its details: the
    /// reason, the time since `t0` and `extra`'s fields). Returns that time in ms.
    pub(super) fn record_paused(
        &self,
        rec: &mut SandboxRecord,
        pr: &PauseRecord,
        t0: Instant,
        extra: serde_json::Value,
    ) -> Result<u64, ServiceError> {
        write_pause(rec, pr)?;
        rec.api.state = SandboxState::Paused;
        self.store.put(SANDBOXES, &rec.api.id, rec)?;
        self.ledger.release(&rec.api.id);
        let ms = t0.elapsed().as_millis() as u64;
        let mut details = serde_json::json!({"reason": pr.reason, "ms": ms});
        if let (Some(d), serde_json::Value::Object(more)) = (details.as_object_mut(), extra) {
            d.extend(more);
        }
        self.telemetry
            .events
            .publish("sandbox.paused", &rec.api.id, None, details);
        Ok(ms)
    }

    /// `POST /v1/sandboxes/{id}/resume`; also what using a paused sandbox does.
    pub async fn resume_sandbox(&self, id: &str) -> Result<api::Sandbox, ServiceError> {
        self.resume_sandbox_how(id, ResumeHow::Memory).await
    }

    /// `POST /v1/sandboxes/{id}/resume` with `reboot`: see [`ResumeHow`].
    pub async fn resume_sandbox_how(
        &self,
        id: &str,
        how: ResumeHow,
    ) -> Result<api::Sandbox, ServiceError> {
        match self.life.service() {
            Some(svc) => {
                let id = id.to_owned();
                to_the_end(async move { svc.resume_held(&id, how).await }).await
            }
            None => self.resume_held(id, how).await,
        }
    }

    async fn resume_held(&self, id: &str, how: ResumeHow) -> Result<api::Sandbox, ServiceError> {
        let (g, rec) = self.hold(id).await?;
        if rec.api.state == SandboxState::Ready && self.vms.get(id).is_some() {
            return Ok(rec.api);
        }
        self.resume_how(&g, rec, how).await.map(|r| r.api)
    }

    /// Resume the paused sandbox `rec` (from its memory state when it has one); the caller
    /// holds its lifecycle lock (a resume on use runs inside the operation that needs the
    /// VM, under the lock that operation took).
    pub(super) async fn resume_locked(
        &self,
        held: &LifeGuard,
        rec: SandboxRecord,
    ) -> Result<SandboxRecord, ServiceError> {
        self.resume_how(held, rec, ResumeHow::Memory).await
    }

    async fn resume_how(
        &self,
        _held: &LifeGuard,
        mut rec: SandboxRecord,
        how: ResumeHow,
    ) -> Result<SandboxRecord, ServiceError> {
        let id = rec.api.id.clone();
        let id = id.as_str();
        match rec.api.state {
            SandboxState::Paused => {}
            s => {
                return Err(ServiceError::Conflict(format!(
                    "sandbox `{id}` is {s}, not paused"
                )));
            }
        }
        let pr = read_pause(&rec)?;
        let driver = self.driver()?;
        let spec = self.spec_of(&rec)?;
        let reboot = how == ResumeHow::Reboot || pr.checkpoint.is_none();
        // A paused sandbox holds nothing in the ledger: it waits for room like a create.
        let reservation = self
            .ledger
            .reserve(
                id,
                super::scheduler::Resources::new(rec.api.vcpus, rec.api.memory_mib as u64),
            )
            .await?;
        self.ensure_network(id, &rec.dir)?;
        let t0 = Instant::now();
        let vm = match (&pr.checkpoint, reboot) {
            (Some(cp), false) => {
                let started = driver.resume_from_disk(&spec, cp).await.map_err(|e| {
                    ServiceError::of_write(
                        &rec.dir,
                        "the VM's RAM file",
                        &format!(
                            "cannot resume sandbox `{id}` from its memory state (`tryboxi \
                             resume --reboot {id}` boots it afresh on its disk: files kept, \
                             processes lost)"
                        ),
                        &e.to_string(),
                    )
                })?;
                let (info, agent) = super::snapshots::agent_or_kill(
                    &driver,
                    started,
                    "resumed",
                    self.agent_deadlines(),
                )
                .await?;
                super::guest_trust::sync_clock(&agent, &info.id);
                Arc::new(LiveVm { info, agent })
            }
            _ => {
                let layer = pr.layer().ok_or_else(|| {
                    ServiceError::Internal(format!("the pause state of `{id}` names no disk"))
                })?;
                Arc::new(self.boot_on_disk(&driver, &spec, layer).await?)
            }
        };
        self.vms.insert(id, vm.clone());
        match self.life.service() {
            Some(svc) => svc.watch(id.to_owned(), vm),
            None => tracing::warn!(sandbox = %id, "resumed without a watcher (no service handle)"),
        }
        // The state file is spent (the RAM file and overlay are the live ones now).
        if let Err(e) = crate::safefs::remove_under(&self.paths.root, &rec.dir.join(PAUSE_DIR)) {
            tracing::warn!(sandbox = %id, error = %e, "cannot delete the spent pause state");
        }
        rec.api.state = SandboxState::Ready;
        self.store.put(SANDBOXES, id, &rec)?;
        reservation.keep();
        self.life.touch(id);
        if reboot {
            // What ran is gone: its execs are not listed as running once this returns.
            self.wait_execs_gone(id).await;
        }
        let ms = t0.elapsed().as_millis() as u64;
        self.telemetry.events.publish(
            "sandbox.resumed",
            id,
            None,
            serde_json::json!({"ms": ms, "paused_for": pr.reason, "rebooted": reboot}),
        );
        tracing::info!(sandbox = %id, ms, rebooted = reboot, "sandbox resumed");
        Ok(rec)
    }

    /// Daemon shutdown with `shutdown = "pause"`: pause every running sandbox to disk.
    pub(super) async fn pause_all_for_shutdown(&self) {
        if self.config.shutdown != ShutdownMode::Pause {
            return;
        }
        let ids: Vec<String> = self
            .vms
            .live
            .lock()
            .map(|m| m.keys().cloned().collect())
            .unwrap_or_default();
        for id in ids {
            match self.pause_with(&id, PauseReason::Shutdown, true).await {
                Ok(_) => {}
                Err(e) => {
                    tracing::warn!(sandbox = %id, error = %e, "cannot pause on shutdown; leaving it running")
                }
            }
        }
    }

    /// What to start a sandbox's VM with (restore, resume, fork); the images are the current
    /// ones (a restored VM's memory already holds its kernel; its disk chain names its rootfs).
    pub(super) fn spec_of(&self, rec: &SandboxRecord) -> Result<VmSpec, ServiceError> {
        let images = self.images()?;
        let accel = match rec.api.accel.as_deref() {
            Some("kvm") => Accel::Kvm,
            _ => Accel::Tcg,
        };
        Ok(VmSpec {
            id: rec.api.id.clone(),
            dir: rec.dir.clone(),
            kernel: images.kernel,
            initramfs: images.initramfs,
            rootfs: images.rootfs,
            vcpus: rec.api.vcpus,
            memory_mib: rec.api.memory_mib,
            accel,
        })
    }
}

/// Before a snapshot is restored over a paused sandbox: if its pause state's RAM is the
/// sandbox's own RAM file (`mem.ram`, which the restore replaces), give that RAM a second name
/// inside the pause directory and point the pause record at it, so that a restore that fails
/// leaves a pause state that still resumes. A hard link: no copy, and at every instant the
/// record names a file that exists (a crash between the two steps leaves both names).
/// A pause state that cannot be read is not kept (a restore is then the way back).
pub(super) fn keep_paused_ram_apart(rec: &SandboxRecord) -> Result<(), ServiceError> {
    let mut pr = match read_pause(rec) {
        Ok(pr) => pr,
        Err(e) => {
            tracing::warn!(sandbox = %rec.api.id, error = %e, "unreadable pause state; restoring over it");
            return Ok(());
        }
    };
    let dir = rec.dir.join(PAUSE_DIR);
    let Some(ram) = pr.checkpoint.as_ref().and_then(|c| c.ram_file.clone()) else {
        return Ok(());
    };
    if ram.starts_with(&dir) {
        return Ok(());
    }
    let kept = dir.join("mem.ram");
    if !kept.exists() {
        std::fs::hard_link(&ram, &kept).map_err(|e| {
            ServiceError::Internal(format!(
                "cannot keep the paused RAM {} as {}: {e}",
                ram.display(),
                kept.display()
            ))
        })?;
    }
    if let Some(cp) = pr.checkpoint.as_mut() {
        cp.ram_file = Some(kept);
    }
    write_pause(rec, &pr)
}

/// The root layer a paused sandbox's VM wrote last (its pause checkpoint's frozen layer).
pub(super) fn paused_layer(rec: &SandboxRecord) -> Option<std::path::PathBuf> {
    read_pause(rec)
        .ok()
        .and_then(|p| p.layer().map(|l| l.to_path_buf()))
}

pub(super) fn read_pause(rec: &SandboxRecord) -> Result<PauseRecord, ServiceError> {
    let path = rec.dir.join(PAUSE_DIR).join(PAUSE_FILE);
    let data = std::fs::read(&path)
        .map_err(|e| ServiceError::Internal(format!("cannot read {}: {e}", path.display())))?;
    serde_json::from_slice(&data)
        .map_err(|e| ServiceError::Internal(format!("{} is not valid: {e}", path.display())))
}

fn write_pause(rec: &SandboxRecord, pr: &PauseRecord) -> Result<(), ServiceError> {
    let dir = rec.dir.join(PAUSE_DIR);
    let tmp = dir.join("pause.json.tmp");
    let data = serde_json::to_vec_pretty(pr)
        .map_err(|e| ServiceError::Internal(format!("cannot encode pause.json: {e}")))?;
    std::fs::write(&tmp, data)
        .and_then(|()| std::fs::rename(&tmp, dir.join(PAUSE_FILE)))
        .map_err(|e| ServiceError::Internal(format!("cannot write {}: {e}", tmp.display())))
}

/// Memory pressure pauses through the same path as `tryboxi pause` (reason `idle`: the next use
/// resumes it).
pub struct ServicePauser(pub std::sync::Weak<Service>);

#[async_trait::async_trait]
impl super::scheduler::Pauser for ServicePauser {
    async fn pause(&self, id: &str) -> Result<(), String> {
        let svc = self.0.upgrade().ok_or("the daemon is shutting down")?;
        match svc.pause_if_free(id, PauseReason::Idle).await {
            Ok(Some(_)) => Ok(()),
            Ok(None) => Err(format!("sandbox `{id}` is in use right now")),
            Err(e) => Err(e.to_string()),
        }
    }
}
