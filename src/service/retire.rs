//! Retire: end a sandbox without taking from others what they still use, and delete snapshots.
//!
//! E2B's kill ends a sandbox while its forks, and the sandboxes made from its snapshots, live
//! on, and its snapshots stay usable for new sandboxes (`Sandbox.create(snapshot_id)`). Here
//! all of those depend on files in the sandbox's directory (frozen disk layers, fork bases,
//! snapshot RAM files). So a kill of a sandbox that has dependents (see `fork.rs`, lineage) or
//! snapshots *retires* it: its VM stops, its network stack, host ports and scheduler
//! reservation go, its own RAM file is deleted, and its record stays in state `retired` with
//! its directory (and its network policy and secret bindings, which children inherit). A
//! retired sandbox is removed (reaped) as soon as it has neither dependents nor snapshots:
//! checked after every remove, snapshot delete and GC, and at daemon start.
//!
//! `DELETE /v1/sandboxes/{id}` (`tryboxi rm`) is unchanged: it removes the sandbox and its
//! snapshots at once, and refuses (409) while other sandboxes depend on its files.

use std::time::Duration;

use super::snapshots::SnapshotRecord;
use super::{SandboxRecord, Service, ServiceError};
use crate::api::{self, SandboxState};
use crate::store::{SANDBOXES, SNAPSHOTS};
use crate::vmm::VmmDriver;

impl Service {
    /// End sandbox `id` as E2B's kill does (see the module doc): removed when nothing needs
    /// its files, else retired.
    pub async fn retire_sandbox(&self, id: &str) -> Result<api::Sandbox, ServiceError> {
        match self.life.service() {
            Some(svc) => {
                let id = id.to_owned();
                super::locks::to_the_end(async move { svc.retire_held(&id).await }).await
            }
            None => self.retire_held(id).await,
        }
    }

    async fn retire_held(&self, id: &str) -> Result<api::Sandbox, ServiceError> {
        let (life, mut rec) = self.hold(id).await?;
        match rec.api.state {
            SandboxState::Retired => return Ok(rec.api),
            SandboxState::Removing => {
                return Err(ServiceError::Conflict(format!(
                    "sandbox `{id}` is being removed"
                )));
            }
            _ => {}
        }
        if !self.is_needed(&rec)? {
            drop(life);
            return self.remove_sandbox(id).await;
        }
        match self.vms.take(id) {
            Some(vm) => {
                let d = self.driver()?;
                d.stop(&vm.info, Duration::from_secs(2))
                    .await
                    .map_err(|e| ServiceError::Internal(format!("cannot stop the VM: {e}")))?;
            }
            // Paused or failed: make sure nothing of it still runs.
            None => self.kill_leftover(&rec.dir).await,
        }
        self.stop_network(id);
        self.close_ports(id);
        self.ledger.release(id);
        self.forget_walk(id);
        // The VM's own RAM (a running or paused VM's; never a snapshot's or a fork base's,
        // which live in their own directories) is of no use any more.
        let ram = crate::vmm::qemu::VmPaths::new(&rec.dir)
            .ram
            .path()
            .to_owned();
        if std::fs::symlink_metadata(&ram).is_ok_and(|m| m.is_file())
            && let Err(e) = std::fs::remove_file(&ram)
        {
            tracing::warn!(sandbox = %id, error = %e, "cannot delete a retired sandbox's RAM file");
        }
        rec.api.state = SandboxState::Retired;
        rec.api.ports.clear();
        rec.api.error = None;
        self.store.put(SANDBOXES, id, &rec)?;
        tracing::info!(sandbox = %id, "sandbox retired: its snapshots or other sandboxes use its files");
        self.telemetry.events.publish(
            "sandbox.retired",
            id,
            None,
            serde_json::json!({ "snapshots": self.snapshots_of(id)?.len() }),
        );
        Ok(rec.api)
    }

    /// Whether anything still needs `rec`'s directory: a snapshot of it, or another sandbox
    /// whose files depend on it.
    fn is_needed(&self, rec: &SandboxRecord) -> Result<bool, ServiceError> {
        Ok(!self.snapshots_of(&rec.api.id)?.is_empty() || !self.dependents(rec)?.is_empty())
    }

    /// Remove every retired sandbox that nothing needs any more (each under its lock; one
    /// whose state changed meanwhile is left alone). Goes round again while it removed one:
    /// a retired fork may have been all that kept its retired parent.
    pub(super) async fn reap_retired(&self) {
        loop {
            let Ok(recs) = self.store.list::<SandboxRecord>(SANDBOXES) else {
                return;
            };
            let mut removed = false;
            for rec in recs {
                if rec.api.state != SandboxState::Retired || self.is_needed(&rec).unwrap_or(true) {
                    continue;
                }
                let id = rec.api.id;
                match self.remove_retired(&id).await {
                    Ok(true) => {
                        removed = true;
                        tracing::info!(sandbox = %id, "retired sandbox removed: nothing uses it any more");
                    }
                    Ok(false) => {}
                    Err(e) => {
                        tracing::warn!(sandbox = %id, error = %e, "cannot remove a retired sandbox")
                    }
                }
            }
            if !removed {
                return;
            }
        }
    }

    /// Remove `id` if it is (still) retired and unneeded, under its lock.
    async fn remove_retired(&self, id: &str) -> Result<bool, ServiceError> {
        let (_life, rec) = self.hold(id).await?;
        if rec.api.state != SandboxState::Retired || self.is_needed(&rec)? {
            return Ok(false);
        }
        self.discard(id, &rec.dir).await;
        self.forget_walk(id);
        Ok(true)
    }

    /// After something that may have left a retired sandbox unneeded: reap in the background
    /// (the caller's locks are released by then).
    pub(super) fn reap_soon(&self) {
        if let Some(svc) = self.life.service() {
            tokio::spawn(async move { svc.reap_retired().await });
        }
    }

    /// `DELETE /v1/sandboxes/{id}/snapshots/{snapshot}` (id or name): its state and RAM files
    /// go. Sandboxes started from it run on (their QEMU maps the RAM file it had opened; a
    /// pause writes their RAM into their own state file). Its frozen disk layer stays: the
    /// sandbox's later layers back onto it.
    pub async fn delete_snapshot(
        &self,
        id: &str,
        snap: &str,
    ) -> Result<api::Snapshot, ServiceError> {
        let deleted = {
            let (_life, rec) = self.hold(id).await?;
            let s = self.find_snapshot(id, snap)?;
            let dir = s
                .checkpoint
                .state_file
                .parent()
                .map(std::path::Path::to_path_buf)
                .ok_or_else(|| ServiceError::Internal("a snapshot without a directory".into()))?;
            crate::safefs::remove_under(&rec.dir, &dir).map_err(|e| {
                ServiceError::Internal(format!("cannot delete snapshot `{}`: {e}", s.api.id))
            })?;
            self.store.delete(SNAPSHOTS, &s.api.id)?;
            tracing::info!(sandbox = %id, snapshot = %s.api.id, "snapshot deleted");
            s.api
        };
        self.reap_retired().await;
        Ok(deleted)
    }

    /// `id`'s snapshot with id or name `snap` (404 otherwise).
    pub(super) fn find_snapshot(
        &self,
        id: &str,
        snap: &str,
    ) -> Result<SnapshotRecord, ServiceError> {
        self.snapshots_of(id)?
            .into_iter()
            .find(|s| s.api.id == snap || s.api.name.as_deref() == Some(snap))
            .ok_or_else(|| {
                ServiceError::NotFound(format!("sandbox `{id}` has no snapshot `{snap}`"))
            })
    }

    /// Every snapshot, with the state of its sandbox (for faces that list snapshots across
    /// sandboxes).
    pub fn all_snapshots(&self) -> Result<Vec<(api::Snapshot, SandboxState)>, ServiceError> {
        let states: std::collections::HashMap<String, SandboxState> = self
            .store
            .list::<SandboxRecord>(SANDBOXES)?
            .into_iter()
            .map(|r| (r.api.id, r.api.state))
            .collect();
        let mut out: Vec<(api::Snapshot, SandboxState)> = self
            .store
            .list::<SnapshotRecord>(SNAPSHOTS)?
            .into_iter()
            .filter_map(|s| Some((states.get(&s.api.sandbox_id).copied()?, s.api)))
            .map(|(st, s)| (s, st))
            .collect();
        out.sort_by(|a, b| (&a.0.created_at, &a.0.id).cmp(&(&b.0.created_at, &b.0.id)));
        Ok(out)
    }
}

#[cfg(test)]
#[path = "retire_tests.rs"]
mod tests;
