//! Use cases behind the API: create, list, get, remove sandboxes and run execs in them.
//!
//! Owns: the sandbox lifecycle (written down on [`crate::api::SandboxState`]), the records in the
//! store, and the map of live VMs with their agent connections.
//! Never: parses HTTP (that is `daemon`), builds QEMU command lines (that is `vmm`), or deletes
//! anything except through `safefs`.

mod sandboxes;

use std::path::PathBuf;

use serde::{Deserialize, Serialize};

use crate::api;
use crate::config::{Config, Paths};
use crate::store::{Store, StoreError};

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
    pub store: Store,
    /// Guest images directory (`serve --artifacts DIR` or `<data root>/artifacts`).
    pub artifacts: PathBuf,
}

impl Service {
    pub fn new(paths: Paths, config: Config, store: Store, artifacts: PathBuf) -> Service {
        Service {
            paths,
            config,
            store,
            artifacts,
        }
    }

    pub fn health(&self) -> Result<api::Health, ServiceError> {
        Ok(api::Health {
            status: "ok".into(),
            version: env!("CARGO_PKG_VERSION").into(),
            pid: std::process::id(),
            data_root: self.paths.root.display().to_string(),
            accel: None,
            sandboxes: self
                .store
                .list::<SandboxRecord>(crate::store::SANDBOXES)?
                .len(),
        })
    }
}

mod exec;

impl Service {
    /// At start-up: find VMs that survived a daemon restart, clean up after the dead ones.
    pub async fn recover(&self) {}

    /// Graceful shutdown hook.
    pub async fn shutdown(&self) {}

    pub async fn create_sandbox(
        &self,
        req: api::CreateSandboxRequest,
    ) -> Result<api::Sandbox, ServiceError> {
        self.validate_create(&req)?;
        let manifest = self.artifacts.join("images/manifest.json");
        if !manifest.exists() {
            return Err(ServiceError::Unavailable(format!(
                "no guest images at {}: run `cargo xtask images`, then `tryboxi install --artifacts _out` \
                 (or start the daemon with `tryboxi serve --artifacts _out`)",
                manifest.display()
            )));
        }
        Err(ServiceError::Unavailable(
            "booting VMs is not wired into this build yet".into(),
        ))
    }

    pub async fn remove_sandbox(&self, id: &str) -> Result<api::Sandbox, ServiceError> {
        let rec = self.record(id)?;
        self.store.delete(crate::store::SANDBOXES, id)?;
        Ok(rec.api)
    }
}
