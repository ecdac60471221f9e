//! Filesystem-only pauses and boots on a sandbox's own disk.
//!
//! Owns: the `ready -> paused` transition that keeps the disk alone (`keep_memory: false`,
//! E2B's `mode="filesystem"`: the guest writes back its file systems and powers off, no state
//! file, no RAM file), and the cold boot of a paused sandbox on the root layer its VM wrote
//! last (after such a pause, or a resume with `reboot`). The boot keeps the sandbox's id,
//! hostname, disk, workspace base disk (the guest agent mounts the workspace overlay again at
//! boot: `guest::wsbase::remount_after_boot`), network stack and secrets; what ran in it is
//! gone.
//! Never: decides when to pause (pause.rs) or touches a running VM's disk.

use std::path::Path;
use std::time::{Duration, Instant};

use super::locks::LifeGuard;
use super::pause::{PAUSE_DIR, PauseReason, PauseRecord};
use super::vms::LiveVm;
use super::{SandboxRecord, Service, ServiceError};
use crate::api;
use crate::vmm::{QemuDriver, VmSpec, VmmDriver};

/// How long a guest asked to power off is given before its QEMU is told to quit.
const POWER_OFF_WAIT: Duration = Duration::from_secs(30);

impl Service {
    /// Pause `rec` keeping its disk alone; the caller holds its lifecycle lock and has seen
    /// it `ready`. Refused, with the VM still running, when its agent does not answer: only
    /// the guest can write back what its page cache holds.
    pub(super) async fn pause_disk_only(
        &self,
        _held: &LifeGuard,
        mut rec: SandboxRecord,
        reason: PauseReason,
    ) -> Result<api::Sandbox, ServiceError> {
        let id = rec.api.id.clone();
        let id = id.as_str();
        let driver = self.driver()?;
        // Out of the live map first, so its watcher takes the agent link closing as expected.
        let vm = self
            .vms
            .take(id)
            .ok_or_else(|| ServiceError::Conflict(format!("sandbox `{id}` has no running VM")))?;
        let t0 = Instant::now();
        let layer = match driver.active_layer(&vm.info).await {
            Ok(l) => l,
            Err(e) => {
                self.vms.insert(id, vm);
                return Err(ServiceError::Internal(format!(
                    "cannot pause sandbox `{id}`: its QEMU does not say which disk it writes: {e}"
                )));
            }
        };
        if let Err(e) = vm.agent.shutdown().await {
            self.vms.insert(id, vm);
            return Err(ServiceError::Unavailable(format!(
                "cannot pause sandbox `{id}` keeping its disk alone: its guest agent did not \
                 answer ({e}), and only the guest can write back its files; nothing was paused \
                 (a pause that keeps the memory does not need the agent)"
            )));
        }
        // The guest syncs, then powers off (QEMU exits); a guest that does not is stopped.
        let powered_off = wait_gone(&driver, &vm.info, POWER_OFF_WAIT).await;
        if !powered_off {
            tracing::warn!(sandbox = %id, "the guest did not power off; stopping its QEMU");
            if let Err(e) = driver.stop(&vm.info, Duration::from_secs(5)).await {
                self.mark_failed(
                    id,
                    format!("a filesystem-only pause could not stop the VM: {e}"),
                );
                return Err(ServiceError::Internal(format!(
                    "cannot pause sandbox `{id}`: its VM did not stop: {e}"
                )));
            }
        }
        // The next start boots on the disk from empty memory: the RAM file is only space.
        let ram = crate::vmm::qemu::VmPaths::new(&rec.dir)
            .ram
            .path()
            .to_owned();
        if let Err(e) = crate::vmm::qemu::ramfile::remove(&ram) {
            tracing::warn!(sandbox = %id, error = %e, "cannot delete the RAM file of a stopped VM");
        }
        let dir = rec.dir.join(PAUSE_DIR);
        std::fs::create_dir_all(&dir)
            .map_err(|e| ServiceError::Internal(format!("cannot create {}: {e}", dir.display())))?;
        let pr = PauseRecord {
            checkpoint: None,
            disk_layer: Some(layer),
            reason,
            paused_at: super::now_rfc3339(),
        };
        let extra = serde_json::json!({"state_bytes": 0, "memory": false,
                                       "guest_powered_off": powered_off});
        let ms = self.record_paused(&mut rec, &pr, t0, extra)?;
        tracing::info!(sandbox = %id, ?reason, ms, powered_off, "sandbox paused, its disk alone");
        Ok(rec.api)
    }

    /// Boot `spec`'s VM afresh on `layer` (a paused sandbox's last root layer) and wait for
    /// its agent.
    pub(super) async fn boot_on_disk(
        &self,
        driver: &QemuDriver,
        spec: &VmSpec,
        layer: &Path,
    ) -> Result<LiveVm, ServiceError> {
        let span = self.telemetry.traces.span(&spec.id, "vm.boot");
        let info = driver.boot_on_disk(spec, layer).await.map_err(|e| {
            ServiceError::of_write(
                &spec.dir,
                "the VM's RAM file",
                "the VM did not boot on its disk",
                &e.to_string(),
            )
        })?;
        drop(span);
        self.connect_booted(driver, info).await
    }
}

/// Make `cp` a disk-only checkpoint: delete its state and RAM files (the frozen layer and the
/// workspace base disk it names stay); a start from it boots afresh on that layer.
pub(super) fn drop_memory(cp: &mut crate::vmm::qemu::Checkpoint) -> Result<(), ServiceError> {
    for f in std::iter::once(&cp.state_file).chain(cp.ram_file.iter()) {
        match std::fs::remove_file(f) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => {
                return Err(ServiceError::Internal(format!(
                    "cannot delete {}: {e}",
                    f.display()
                )));
            }
        }
    }
    cp.ram_file = None;
    cp.state_bytes = 0;
    cp.disk_only = true;
    Ok(())
}

/// How long a pause waits for the guest's `sync` before it goes on without it.
const SYNC_WAIT: Duration = Duration::from_secs(10);

/// Ask the guest to write back its file systems (`sync`, as root, at most [`SYNC_WAIT`]): a
/// memory pause does this first, so that a later boot on the disk finds every file the guest
/// wrote. A guest that does not answer in time is paused anyway (its memory holds the data).
pub(super) async fn guest_sync(agent: &crate::rpc::AgentClient, id: &str) {
    let req = crate::rpc::ExecRequest {
        argv: vec!["sync".into()],
        cwd: Some("/".into()),
        timeout: Some(SYNC_WAIT),
        ..Default::default()
    };
    let run = async {
        let mut s = agent.exec(req).await.map_err(|e| e.to_string())?;
        while let Some(ev) = s.next().await {
            match ev.map_err(|e| e.to_string())? {
                crate::rpc::ExecEvent::Exit { code: Some(0), .. } => return Ok(()),
                crate::rpc::ExecEvent::Exit { code, signal, .. } => {
                    return Err(format!("`sync` ended with {code:?} / signal {signal:?}"));
                }
                _ => {}
            }
        }
        Err("the exec ended without an exit status".to_owned())
    };
    match tokio::time::timeout(SYNC_WAIT, run).await {
        Ok(Ok(())) => {}
        Ok(Err(e)) => {
            tracing::warn!(sandbox = %id, error = %e, "the guest's sync before a pause failed")
        }
        Err(_) => {
            tracing::warn!(sandbox = %id, "the guest's sync before a pause took over 10 s; pausing anyway")
        }
    }
}

/// Whether `vm`'s QEMU is gone within `wait`.
async fn wait_gone(driver: &QemuDriver, vm: &crate::vmm::VmInfo, wait: Duration) -> bool {
    let t0 = Instant::now();
    while driver.is_alive(vm) {
        if t0.elapsed() >= wait {
            return false;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    true
}

impl Service {
    /// After a boot afresh: wait (at most 5 s) until the execs that ran in the sandbox's old VM
    /// have ended as lost. Their owners find the new agent without them within a poll
    /// (`execs::reattach_exec`); a list right after the resume must not show them running.
    pub(super) async fn wait_execs_gone(&self, id: &str) {
        let t0 = Instant::now();
        while !self.execs.of_sandbox(id).is_empty() {
            if t0.elapsed() > Duration::from_secs(5) {
                tracing::warn!(sandbox = %id, "execs of the VM before the reboot are still listed");
                return;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// Whether the running VM of `id` has an agent that answers a ping within 5 s (E2B's
    /// `requireHealthyGuest`); `false` when it has no running VM.
    pub async fn guest_answers(&self, id: &str) -> bool {
        let Some(vm) = self.vms.get(id) else {
            return false;
        };
        matches!(
            tokio::time::timeout(Duration::from_secs(5), vm.agent.ping()).await,
            Ok(Ok(_))
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pause_records_of_both_kinds_read_back_and_older_ones_still_read() {
        // Written before filesystem-only pauses existed: a checkpoint, always.
        let old = r#"{"checkpoint":{"state_file":"/d/paused/state.bin",
            "disk_layer":"/d/disk.qcow2","state_bytes":5},"reason":"user","paused_at":"x"}"#;
        let r: PauseRecord = serde_json::from_str(old).unwrap();
        assert!(r.checkpoint.is_some());
        assert_eq!(r.layer(), Some(Path::new("/d/disk.qcow2")));

        let disk_only = PauseRecord {
            checkpoint: None,
            disk_layer: Some("/d/disk-r1.qcow2".into()),
            reason: PauseReason::Idle,
            paused_at: "y".into(),
        };
        let text = serde_json::to_string(&disk_only).unwrap();
        assert!(!text.contains("checkpoint"), "{text}");
        let back: PauseRecord = serde_json::from_str(&text).unwrap();
        assert!(back.checkpoint.is_none());
        assert_eq!(back.layer(), Some(Path::new("/d/disk-r1.qcow2")));
        // Neither a checkpoint nor a layer: nothing to start from, said as such.
        let none: PauseRecord =
            serde_json::from_str(r#"{"reason":"user","paused_at":"z"}"#).unwrap();
        assert_eq!(none.layer(), None);
    }
}
