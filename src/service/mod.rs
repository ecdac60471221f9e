//! Use cases behind the API: create, list, get, remove sandboxes and run execs in them.
//!
//! Owns: the sandbox lifecycle (written down on [`crate::api::SandboxState`]), the records in the
//! store, and the map of live VMs with their agent connections.
//! Never: parses HTTP (that is `daemon`), builds QEMU command lines (that is `vmm`), or deletes
//! anything except through `safefs`.

mod exec;
pub mod netpolicy;
mod network;
mod observe;
mod sandboxes;
mod snapshots;
mod vms;
mod workspace;

use std::path::PathBuf;
use std::sync::Arc;

use serde::{Deserialize, Serialize};

use crate::api;
use crate::config::{Config, Paths};
use crate::store::{Store, StoreError};
use crate::telemetry::Telemetry;

pub use observe::{ExecOutput, OutputQuery};
pub use sandboxes::now_rfc3339;
pub use vms::Vms;

#[derive(Debug, thiserror::Error)]
pub enum ServiceError {
    #[error("{0}")]
    NotFound(String),
    #[error("{0}")]
    BadRequest(String),
    #[error("{0}")]
    Unprocessable(String),
    #[error("{0}")]
    Conflict(String),
    #[error("{0}")]
    Forbidden(String),
    #[error("{0}")]
    Unavailable(String),
    #[error("{0}")]
    Internal(String),
}

impl From<StoreError> for ServiceError {
    fn from(e: StoreError) -> Self {
        ServiceError::Internal(e.to_string())
    }
}

/// What the store keeps per sandbox: the API view plus what the daemon needs to find the VM.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct SandboxRecord {
    #[serde(flatten)]
    pub api: api::Sandbox,
    /// The VM's private directory.
    pub dir: PathBuf,
}

pub struct Service {
    pub paths: Paths,
    pub config: Config,
    pub store: Arc<Store>,
    /// Guest images directory (`serve --artifacts DIR` or `<data root>/artifacts`).
    pub artifacts: PathBuf,
    pub vms: Vms,
    /// Events, traces, metrics and exec output logs.
    pub telemetry: Arc<Telemetry>,
    /// One lock per sandbox: its sync, diff, apply and pull never overlap.
    /// Egress policy: live gates, settings, access requests.
    pub networks: netpolicy::Networks,
    pub ws_locks: std::sync::Mutex<std::collections::HashMap<String, Arc<tokio::sync::Mutex<()>>>>,
    /// Each sandbox's userspace network stack (`network.rs`).
    pub nets: network::Nets,
}

impl Service {
    pub fn new(
        paths: Paths,
        config: Config,
        store: Store,
        artifacts: PathBuf,
        trace_exporter: Option<Box<dyn crate::telemetry::traces::Exporter>>,
    ) -> Service {
        let store = Arc::new(store);
        let telemetry = Arc::new(Telemetry::new(
            store.clone(),
            config.exec_log_max_bytes,
            trace_exporter,
        ));
        let vms = Vms::new(
            &config.qemu_binary,
            std::time::Duration::from_secs(config.boot_timeout_s),
        );
        let networks = netpolicy::Networks::new(&config.network, telemetry.clone());
        Service {
            networks,
            paths,
            config,
            store,
            artifacts,
            vms,
            telemetry,
            ws_locks: Default::default(),
            nets: Default::default(),
        }
    }

    pub fn health(&self) -> Result<api::Health, ServiceError> {
        Ok(api::Health {
            status: "ok".into(),
            version: env!("CARGO_PKG_VERSION").into(),
            pid: std::process::id(),
            data_root: self.paths.root.display().to_string(),
            accel: self.accel_if_known().map(|a| a.to_string()),
            sandboxes: self
                .store
                .list::<SandboxRecord>(crate::store::SANDBOXES)?
                .len(),
        })
    }

    /// Graceful shutdown: VMs keep running and are found again by the next daemon's `recover`.
    pub async fn shutdown(&self) {
        let n = self.vms.live.lock().map(|m| m.len()).unwrap_or(0);
        if n > 0 {
            tracing::info!(
                running = n,
                "leaving running sandboxes up; the next daemon reattaches to them"
            );
        }
    }
}
