//! Per-sandbox lifecycle locks: the one lock every operation that starts, stops, replaces or
//! uses a sandbox's VM takes first (the order is written down in ARCHITECTURE.md, "Lock order").
//!
//! Owns: the lock table, the guard type that proves a caller holds a sandbox's lock
//! ([`LifeGuard`]), and the tombstone that makes a removed sandbox's lock refuse new holders
//! (whoever was queued behind a remove gets "no sandbox", never a deleted record to write back).
//! Never: decides what an operation does under the lock (that is each use case).

use std::collections::HashMap;
use std::future::Future;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use super::vms::LiveVm;
use super::{SandboxRecord, Service, ServiceError};
use crate::api::SandboxState;

/// One sandbox's lifecycle lock. `gone` is set (under the lock) when the sandbox is removed.
#[derive(Default)]
struct LifeLock {
    mutex: Arc<tokio::sync::Mutex<()>>,
    gone: AtomicBool,
}

/// Held while a caller owns a sandbox's lifecycle (see [`Service::hold`]). Functions that need
/// the caller to hold it take `&LifeGuard` (they never take the lock again: no self-deadlock).
pub(super) struct LifeGuard {
    _guard: tokio::sync::OwnedMutexGuard<()>,
}

/// Sandbox id -> its lifecycle lock.
#[derive(Default)]
pub(super) struct LifeLocks(Mutex<HashMap<String, Arc<LifeLock>>>);

impl LifeLocks {
    fn entry(&self, id: &str) -> Arc<LifeLock> {
        let mut m = self.0.lock().unwrap_or_else(|p| p.into_inner());
        m.entry(id.to_owned()).or_default().clone()
    }

    /// Wait for `id`'s lock; `None` when the sandbox was removed meanwhile.
    pub(super) async fn hold(&self, id: &str) -> Option<LifeGuard> {
        let l = self.entry(id);
        let g = l.mutex.clone().lock_owned().await;
        (!l.gone.load(Ordering::Acquire)).then_some(LifeGuard { _guard: g })
    }

    /// `id`'s lock if nobody holds it now (idle and pressure pause: a sandbox whose lock is
    /// held is in use, so it is not idle).
    pub(super) fn try_hold(&self, id: &str) -> Option<LifeGuard> {
        let l = self.entry(id);
        let g = l.mutex.clone().try_lock_owned().ok()?;
        (!l.gone.load(Ordering::Acquire)).then_some(LifeGuard { _guard: g })
    }

    /// The sandbox is gone: callers queued for its lock get `None`, and the entry is dropped.
    /// Called by its remover, which holds the lock.
    pub(super) fn tombstone(&self, id: &str) {
        let mut m = self.0.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(l) = m.remove(id) {
            l.gone.store(true, Ordering::Release);
        }
    }

    /// How many sandboxes have an entry (tests: entries do not pile up for unknown ids).
    #[cfg(test)]
    pub(super) fn len(&self) -> usize {
        self.0.lock().unwrap_or_else(|p| p.into_inner()).len()
    }
}

/// Run a lifecycle operation on its own task and wait for it. The caller may go away (an HTTP
/// client that disconnects drops the request's future) without cutting the operation in half,
/// which could leave a QEMU that no record tracks, or a record that names a VM that is gone.
pub(super) async fn to_the_end<T: Send + 'static>(
    f: impl Future<Output = Result<T, ServiceError>> + Send + 'static,
) -> Result<T, ServiceError> {
    tokio::spawn(f)
        .await
        .map_err(|e| ServiceError::Internal(format!("a lifecycle task failed: {e}")))?
}

impl Service {
    /// Take `id`'s lifecycle lock and read its record under it. 404 when there is no such
    /// sandbox, including one removed while this caller waited.
    pub(super) async fn hold(&self, id: &str) -> Result<(LifeGuard, SandboxRecord), ServiceError> {
        // Unknown ids get no lock entry.
        self.record(id)?;
        let gone = || ServiceError::NotFound(format!("no sandbox `{id}` (it was removed)"));
        let g = self.life.locks.hold(id).await.ok_or_else(gone)?;
        match self.record(id) {
            Ok(rec) => Ok((g, rec)),
            Err(e) => {
                // Removed between the look-up and the lock: the entry made here is stale.
                self.life.locks.tombstone(id);
                Err(e)
            }
        }
    }

    /// The lock of a sandbox being made now (create, fork child, pool claim): taken before its
    /// record is first written, so nothing else can act on it until it is ready or discarded.
    pub(super) async fn hold_new(&self, id: &str) -> LifeGuard {
        match self.life.locks.hold(id).await {
            Some(g) => g,
            // A fresh id is never tombstoned; if it were, a fresh entry is made below.
            None => {
                self.life.locks.tombstone(id);
                Box::pin(self.hold_new(id)).await
            }
        }
    }

    /// Hold a sandbox that must be ready, resuming it (under the same lock) when it is paused;
    /// resets its idle clock. The guard goes back to the caller, who keeps it while it uses
    /// the VM in ways that must not overlap a pause, restore or remove.
    pub(super) async fn hold_ready(
        &self,
        id: &str,
    ) -> Result<(LifeGuard, SandboxRecord, Arc<LiveVm>), ServiceError> {
        let (mut g, mut rec) = self.hold(id).await?;
        if rec.api.state == SandboxState::Paused {
            tracing::info!(sandbox = %id, "resuming a paused sandbox on use");
            // The resume finishes (and then lets go of the lock) even if our caller goes away.
            let (g2, resumed) = match self.life.service() {
                Some(svc) => tokio::spawn(async move {
                    let r = svc.resume_locked(&g, rec).await;
                    (g, r)
                })
                .await
                .map_err(|e| ServiceError::Internal(format!("a resume task failed: {e}")))?,
                None => {
                    let r = self.resume_locked(&g, rec).await;
                    (g, r)
                }
            };
            g = g2;
            rec = resumed?;
        }
        self.life.touch(id);
        if rec.api.state != SandboxState::Ready {
            let why = rec
                .api
                .error
                .clone()
                .map(|e| format!(": {e}"))
                .unwrap_or_default();
            return Err(ServiceError::Conflict(format!(
                "sandbox `{id}` is {}{why}",
                rec.api.state
            )));
        }
        let vm = self
            .vms
            .get(id)
            .ok_or_else(|| ServiceError::Conflict(format!("sandbox `{id}` has no running VM")))?;
        Ok((g, rec, vm))
    }
}

#[cfg(test)]
#[path = "locks_tests.rs"]
mod tests;
