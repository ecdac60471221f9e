//! What the E2B face keeps per sandbox it created (table `e2b_sandboxes`): its envd and traffic
//! access tokens, the template name the client used, metadata, env vars for every command, and
//! its deadline; and the deadline watcher that kills (or, with `auto_pause`, pauses) a sandbox
//! whose E2B `timeout` ran out, with an event.
//!
//! Owns: these records and the watcher. Never: the HTTP shapes of the E2B API (`src/e2b/`).
//! Sandboxes not created through the E2B face have no record and are invisible to it.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use super::{Service, ServiceError};
use crate::store::E2B_SANDBOXES;

/// How often the deadline watcher looks.
const WATCH_EVERY: Duration = Duration::from_secs(1);

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct E2bSandbox {
    pub sandbox_id: String,
    /// The template as the client named it (`base`, `code-interpreter-v1`, ...).
    pub template_id: String,
    /// Sent as `X-Access-Token` on every envd call.
    pub envd_token: String,
    /// Sent as `E2B-Traffic-Access-Token` on calls to other ports.
    pub traffic_token: String,
    #[serde(default)]
    pub metadata: BTreeMap<String, String>,
    /// Merged under each command's own env.
    #[serde(default)]
    pub env_vars: BTreeMap<String, String>,
    /// RFC 3339.
    pub started_at: String,
    /// Unix seconds after which the sandbox is killed (or paused).
    pub end_at: u64,
    #[serde(default)]
    pub auto_pause: bool,
    /// E2B's `autoPauseMemory`: `false` makes the timeout's pause keep the disk alone.
    #[serde(default = "yes")]
    pub auto_pause_memory: bool,
}

fn yes() -> bool {
    true
}

pub fn unix_now() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

/// A fresh access token: 32 random bytes, hex.
pub fn new_token() -> String {
    let mut b = [0u8; 32];
    getrandom::fill(&mut b).expect("the OS random source works");
    b.iter().map(|x| format!("{x:02x}")).collect()
}

impl Service {
    /// The running VM of `id`, for the E2B face's metrics; `None` when it has none (paused,
    /// starting, retired).
    /// `sbx` is the sandbox as the caller already read it (its size).
    pub fn e2b_vm(&self, sbx: &crate::api::Sandbox) -> Option<crate::e2b::history::VmRef> {
        let live = self.vms.live.lock().ok()?;
        let vm = live.get(&sbx.id)?;
        Some(crate::e2b::history::VmRef {
            pid: vm.info.pid,
            dir: vm.info.dir.clone(),
            vcpus: sbx.vcpus,
            memory_mib: sbx.memory_mib,
        })
    }

    pub fn e2b_put(&self, rec: &E2bSandbox) -> Result<(), ServiceError> {
        Ok(self.store.put(E2B_SANDBOXES, &rec.sandbox_id, rec)?)
    }

    /// The E2B record of a sandbox that still exists (a record whose sandbox was removed by
    /// another face is dropped here).
    pub fn e2b_get(&self, id: &str) -> Result<Option<E2bSandbox>, ServiceError> {
        let Some(rec) = self.store.get::<E2bSandbox>(E2B_SANDBOXES, id)? else {
            return Ok(None);
        };
        if self.get_sandbox(id).is_err() {
            let _ = self.store.delete(E2B_SANDBOXES, id);
            return Ok(None);
        }
        Ok(Some(rec))
    }

    /// Every E2B record whose sandbox still exists, with the sandbox.
    pub fn e2b_list(&self) -> Result<Vec<(E2bSandbox, crate::api::Sandbox)>, ServiceError> {
        let mut out = Vec::new();
        for rec in self.store.list::<E2bSandbox>(E2B_SANDBOXES)? {
            match self.get_sandbox(&rec.sandbox_id) {
                Ok(s) => out.push((rec, s)),
                Err(ServiceError::NotFound(_)) => {
                    let _ = self.store.delete(E2B_SANDBOXES, &rec.sandbox_id);
                }
                Err(e) => return Err(e),
            }
        }
        Ok(out)
    }

    pub fn e2b_forget(&self, id: &str) -> Result<(), ServiceError> {
        self.store.delete(E2B_SANDBOXES, id)?;
        Ok(())
    }

    /// The timeout's pause: the disk alone when the client asked (`autoPauseMemory: false`),
    /// else memory too; a guest whose agent does not answer (a disk-only pause needs it)
    /// gets the pause that keeps its memory instead, which loses nothing.
    async fn e2b_auto_pause(&self, rec: &E2bSandbox) -> Result<(), ServiceError> {
        let id = &rec.sandbox_id;
        if !rec.auto_pause_memory {
            match self.pause_sandbox_keeping(id, false).await {
                Err(ServiceError::Unavailable(why)) => {
                    tracing::warn!(sandbox = %id, why, "a disk-only auto-pause was refused; keeping the memory too");
                }
                r => return r.map(|_| ()),
            }
        }
        self.pause_sandbox(id).await.map(|_| ())
    }

    /// Kill (or pause, with `auto_pause`) every E2B sandbox whose deadline passed.
    pub async fn e2b_enforce_deadlines(&self, now: u64) {
        let Ok(recs) = self.store.list::<E2bSandbox>(E2B_SANDBOXES) else {
            return;
        };
        for rec in recs.into_iter().filter(|r| r.end_at <= now) {
            let id = rec.sandbox_id.clone();
            let paused = matches!(
                self.get_sandbox(&id).map(|s| s.state),
                Ok(crate::api::SandboxState::Paused)
            );
            if rec.auto_pause && paused {
                continue;
            }
            let (action, result) = if rec.auto_pause {
                ("paused", self.e2b_auto_pause(&rec).await)
            } else {
                // The record goes first: while the VM is being torn down (seconds under TCG)
                // its envd no longer answers, so the E2B face must already say "not found"
                // (an SDK that saw `is_running() == false` and then connects gets a 404, as
                // from E2B). A removal that fails puts the record back for the next tick.
                let _ = self.e2b_forget(&id);
                // Retired rather than removed while its snapshots or forks need its files.
                let r = self.retire_sandbox(&id).await.map(|_| ());
                if let Err(e) = &r
                    && !matches!(e, ServiceError::NotFound(_))
                {
                    let _ = self.e2b_put(&rec);
                }
                ("killed", r)
            };
            match result {
                Ok(()) => {
                    tracing::info!(sandbox = %id, action, "E2B timeout reached");
                    self.telemetry.events.publish(
                        "e2b.timeout",
                        &id,
                        None,
                        serde_json::json!({ "action": action }),
                    );
                }
                Err(ServiceError::NotFound(_)) => {
                    let _ = self.e2b_forget(&id);
                }
                Err(e) => {
                    tracing::warn!(sandbox = %id, error = %e, "cannot end an E2B sandbox past its timeout")
                }
            }
        }
    }

    /// The deadline watcher (runs for the daemon's life).
    pub fn start_e2b_deadlines(self: &Arc<Self>) {
        let svc = Arc::downgrade(self);
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(WATCH_EVERY);
            loop {
                tick.tick().await;
                let Some(svc) = svc.upgrade() else { return };
                svc.e2b_enforce_deadlines(unix_now()).await;
            }
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tokens_are_fresh_and_long() {
        let (a, b) = (new_token(), new_token());
        assert_ne!(a, b);
        assert_eq!(a.len(), 64);
        assert!(a.bytes().all(|c| c.is_ascii_hexdigit()));
    }

    #[tokio::test]
    async fn records_of_removed_sandboxes_disappear() {
        let dir = tempfile::tempdir().unwrap();
        let svc = crate::service::test_service(dir.path(), crate::config::Config::default());
        let rec = E2bSandbox {
            sandbox_id: "sbx_gone".into(),
            template_id: "base".into(),
            envd_token: new_token(),
            traffic_token: new_token(),
            metadata: BTreeMap::new(),
            env_vars: BTreeMap::new(),
            started_at: crate::service::now_rfc3339(),
            end_at: 0,
            auto_pause: false,
            auto_pause_memory: true,
        };
        svc.e2b_put(&rec).unwrap();
        assert!(svc.e2b_get("sbx_gone").unwrap().is_none());
        assert!(
            svc.store
                .get::<E2bSandbox>(E2B_SANDBOXES, "sbx_gone")
                .unwrap()
                .is_none()
        );
    }
}
