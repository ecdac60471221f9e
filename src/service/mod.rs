//! Use cases behind the API: create, list, get, remove sandboxes and run execs in them.
//!
//! Owns: the sandbox lifecycle (written down on [`crate::api::SandboxState`]), the records in the
//! store, and the map of live VMs with their agent connections.
//! Never: parses HTTP (that is `daemon`), builds QEMU command lines (that is `vmm`), or deletes
//! anything except through `safefs`.

mod diskroom;
pub mod e2b;
mod exec;
pub mod execs;
mod fork;
mod gc;
pub use gc::disk_usage;
mod git;
mod golden;
mod guest_trust;
mod locks;
pub mod netpolicy;
mod network;
#[cfg(test)]
mod noworkspace_tests;
mod observe;
mod pause;
mod pool;
mod ports;
pub mod pressure;
mod reboot;
mod retire;
mod sandboxes;
pub mod scheduler;
mod secrets;
mod snapshots;
pub mod templates;
pub mod usage;
pub mod vmfs;
mod vms;
#[cfg(test)]
mod walk_hostile_tests;
mod workspace;
mod workspace_apply;
mod workspace_fetch;
pub mod wsguard;

use std::path::{Path, PathBuf};
use std::sync::Arc;

use serde::{Deserialize, Serialize};

use crate::api;
use crate::config::{Config, Paths};
use crate::store::{Store, StoreError};
use crate::telemetry::Telemetry;

pub use gc::parse_rfc3339;
pub use observe::OutputQuery;
pub use pause::{ResumeHow, ServicePauser};
pub use sandboxes::{now_rfc3339, rfc3339};
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
    /// A workspace operation (sync, diff, apply, pull, undo) on a sandbox created without a
    /// host workspace (409 `no_workspace`).
    #[error("sandbox {0} has no host workspace")]
    NoWorkspace(String),
    /// A connection to a guest port was refused or not answered (502 `port_not_open`; the
    /// message keeps the phrase "port is not open", which the E2B SDK looks for).
    #[error("{0}")]
    PortNotOpen(String),
    #[error("{0}")]
    Forbidden(String),
    #[error("{0}")]
    Unavailable(String),
    /// The host is full and the request could not be queued or waited too long (429).
    #[error("{0}")]
    Busy(String),
    /// The data root's filesystem is (nearly) full: the operation was refused before it wrote
    /// anything, or ran out of space and removed what it had written (507 `no_space`).
    #[error("{0}")]
    NoSpace(String),
    #[error("{0}")]
    Internal(String),
}

impl From<crate::diskspace::NoSpace> for ServiceError {
    fn from(e: crate::diskspace::NoSpace) -> Self {
        ServiceError::NoSpace(e.to_string())
    }
}

impl ServiceError {
    /// The error of a big write under `at` that failed with `err`: [`ServiceError::NoSpace`]
    /// (naming the filesystem and what is free now) when it ran out of space, else
    /// [`ServiceError::Internal`] with `context: err`.
    pub(crate) fn of_write(at: &Path, what: &str, context: &str, err: &str) -> ServiceError {
        match crate::diskspace::after_failure(at, what, err) {
            Some(ns) => ns.into(),
            None => ServiceError::Internal(format!("{context}: {err}")),
        }
    }
}

impl From<scheduler::SchedError> for ServiceError {
    fn from(e: scheduler::SchedError) -> Self {
        match e {
            scheduler::SchedError::TooBig { .. } => ServiceError::Unavailable(e.to_string()),
            scheduler::SchedError::Duplicate(_) => ServiceError::Conflict(e.to_string()),
            _ => ServiceError::Busy(e.to_string()),
        }
    }
}

impl From<StoreError> for ServiceError {
    fn from(e: StoreError) -> Self {
        let msg = e.to_string();
        if crate::diskspace::mentions_no_space(&msg) {
            return ServiceError::NoSpace(format!("the store cannot be written: {msg}"));
        }
        ServiceError::Internal(msg)
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

impl SandboxRecord {
    /// The record of a sandbox being created now (state `creating`), VM in `dir`.
    pub(super) fn creating(
        id: &str,
        dir: PathBuf,
        workspace: Option<(&Path, Vec<String>)>,
        template: String,
        (vcpus, memory_mib, accel): (u32, u32, crate::vmm::Accel),
    ) -> SandboxRecord {
        SandboxRecord {
            api: api::Sandbox {
                id: id.to_owned(),
                state: api::SandboxState::Creating,
                workspace: workspace.map(|(path, exclude)| api::WorkspaceSpec {
                    host_path: path.display().to_string(),
                    exclude,
                }),
                template,
                vcpus,
                memory_mib,
                accel: Some(accel.to_string()),
                created_at: now_rfc3339(),
                error: None,
                ports: Vec::new(),
            },
            dir,
        }
    }
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
    /// vCPUs and memory reserved by sandboxes on this host (`scheduler.rs`).
    pub ledger: Arc<scheduler::Ledger>,
    /// One lock per sandbox: its sync, diff, apply and pull never overlap.
    /// Egress policy: live gates, settings, access requests.
    pub networks: netpolicy::Networks,
    pub ws_locks: std::sync::Mutex<std::collections::HashMap<String, Arc<tokio::sync::Mutex<()>>>>,
    /// Pause/resume, idle clock, golden snapshots and the warm pool.
    pub life: pause::Lifecycle,
    /// Per sandbox: the last workspace walk the agent sent and its cursor (see `WalkSince`).
    pub walks: workspace::WalkMirrors,
    /// The sync bases (manifests) last read or written, so big ones are not parsed each sync.
    pub manifests: Arc<crate::workspace::manifest::ManifestCache>,
    /// The sync rules of `[sync]`, compiled once (every exec, sync and diff uses them; the
    /// case-insensitive secret globs cost milliseconds to compile).
    pub sync_rules: std::sync::OnceLock<crate::workspace::rules::Rules>,
    /// Each sandbox's userspace network stack (`network.rs`).
    pub nets: network::Nets,
    /// Host listeners of exposed ports.
    ports: ports::PortListeners,
    /// The host's stored secrets (`<data root>/secrets.json`; values never leave the host).
    pub secret_store: crate::secrets::store::SecretStore,
    /// Each sandbox's live secrets (bindings with values), read by the egress interceptor per
    /// flow.
    pub secrets: crate::secrets::Registry,
    /// The host's CAs every guest trusts, and per sandbox: the VM and the certificates its
    /// guest trust bundle was last written for.
    pub guest_trust: guest_trust::GuestTrust,
    /// Running execs (`execs.rs`).
    pub execs: Arc<execs::LiveExecs>,
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
            &config.telemetry,
            trace_exporter,
        ));
        let vms = Vms::new(
            &config.qemu_binary,
            std::time::Duration::from_secs(config.boot_timeout_s),
            config.telemetry.vm_log_max_bytes,
            config.limits.reserve_ram_on_disk,
            config.limits.disk_budget(),
            &paths.root,
        );
        let limits = &config.limits;
        let ledger = scheduler::Ledger::new(
            scheduler::Policy::from_limits(limits),
            Arc::new(usage::ProcHost),
            std::time::Duration::from_secs(limits.queue_timeout_s),
            limits.max_queue,
        );
        let networks = netpolicy::Networks::new(&config.network, telemetry.clone());
        let secret_store = crate::secrets::store::SecretStore::open(&paths.secrets_file());
        if let Some(why) = secret_store.broken() {
            tracing::error!(error = %why, "the secret store cannot be read");
        }
        let guest_trust = guest_trust::GuestTrust::new(&config.network);
        Service {
            guest_trust,
            secret_store,
            secrets: Default::default(),
            ledger,
            networks,
            paths,
            config,
            store,
            artifacts,
            vms,
            telemetry,
            ws_locks: Default::default(),
            life: Default::default(),
            walks: Default::default(),
            manifests: Default::default(),
            sync_rules: Default::default(),
            nets: Default::default(),
            ports: Default::default(),
            execs: Default::default(),
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
            capacity: Some(self.capacity()),
        })
    }

    /// The scheduler's ledger, for `GET /v1/health`.
    pub fn capacity(&self) -> api::Capacity {
        let v = self.ledger.view();
        let p = v.policy;
        api::Capacity {
            max_vcpus: p.vcpus,
            host_cpus: p.host_cpus,
            vcpu_overcommit: f64::from(p.vcpus) / f64::from(p.host_cpus.max(1)),
            max_memory_mib: p.memory_cap,
            reserved_vcpus: v.used.vcpus,
            reserved_memory_mib: v.used.memory_mib,
            memory: api::MemoryUse {
                total_mib: v.host.total_mib,
                available_mib: v.host.available_mib,
                reserve_mib: p.mem.reserve_mib,
                headroom_mib: p.mem.headroom_mib,
                new_vm_mib: p.mem.new_vm_mib,
                used_mib: v.mem.used_mib,
                counted_mib: v.mem.counted_mib,
                room_mib: v.mem.room_mib,
            },
            cpu: api::CpuPressure {
                source: if v.host.cpu_some_avg60.is_some() {
                    "psi"
                } else {
                    "none"
                }
                .into(),
                some_avg60: v.host.cpu_some_avg60,
                limit: p.mem.cpu_psi_limit,
                saturated: p.mem.cpu_saturated(v.host.cpu_some_avg60),
            },
            queued: v.queued,
            waited: v.waited,
            waited_cpu: v.waited_cpu,
            reservations: v
                .held
                .into_iter()
                .map(|h| api::LedgerEntry {
                    id: h.id,
                    holder: h.who.as_str().to_owned(),
                    vcpus: h.r.vcpus,
                    memory_mib: h.r.memory_mib,
                    used_mib: h.used_mib,
                    counted_mib: h.counted_mib,
                })
                .collect(),
        }
    }

    /// Every running QEMU the sampler measures: ready sandboxes' and warm-pool VMs' (id, pid).
    pub(crate) fn vm_pids(&self) -> Vec<(String, u32)> {
        let mut out: Vec<(String, u32)> = self
            .vms
            .live
            .lock()
            .map(|m| m.iter().map(|(id, vm)| (id.clone(), vm.info.pid)).collect())
            .unwrap_or_default();
        out.extend(self.pool_pids());
        out
    }

    /// The own RAM files (`<vm dir>/mem.ram`) of every running QEMU, with its pid, when RAM is
    /// reserved on disk (`reserve_ram_on_disk`); empty otherwise. A clone on a borrowed file
    /// has no such file (see [`usage::rereserve_ram`]).
    pub(crate) fn own_ram_files(&self) -> Vec<(u32, PathBuf)> {
        if !self.config.limits.reserve_ram_on_disk {
            return Vec::new();
        }
        let ram = |dir: &Path| dir.join(crate::vmm::qemu::RAM_FILE);
        let mut out: Vec<(u32, PathBuf)> = self
            .vms
            .live
            .lock()
            .map(|m| {
                m.values()
                    .map(|vm| (vm.info.pid, ram(&vm.info.dir)))
                    .collect()
            })
            .unwrap_or_default();
        out.extend(self.pool_dirs().into_iter().map(|(pid, d)| (pid, ram(&d))));
        out
    }

    /// Graceful shutdown: the warm pool ends; with `shutdown = "pause"` running sandboxes are
    /// paused to disk (the next daemon resumes them), with `"leave"` VMs keep running and are
    /// found again by the next daemon's `recover`.
    pub async fn shutdown(&self) {
        self.drain_pool().await;
        self.pause_all_for_shutdown().await;
        let n = self.vms.live.lock().map(|m| m.len()).unwrap_or(0);
        if n > 0 {
            tracing::info!(
                running = n,
                "leaving running sandboxes up; the next daemon reattaches to them"
            );
        }
    }
}

/// A service over an in-memory store with its data root in `dir`, for the service's unit tests.
#[cfg(test)]
pub(crate) fn test_service(dir: &Path, config: Config) -> Arc<Service> {
    Arc::new(Service::new(
        Paths {
            root: dir.to_path_buf(),
        },
        config,
        Store::in_memory(),
        dir.join("artifacts"),
        None,
    ))
}

/// A `ready` sandbox record (no VM) in `svc`'s store, its directory under `dir`; its id.
#[cfg(test)]
pub(crate) fn test_sandbox(svc: &Service, dir: &Path) -> String {
    let id = crate::ids::new_id(crate::ids::SANDBOX);
    let rec = SandboxRecord {
        api: api::Sandbox {
            id: id.clone(),
            state: api::SandboxState::Ready,
            workspace: Some(api::WorkspaceSpec {
                host_path: "/tmp".into(),
                exclude: Vec::new(),
            }),
            template: "auto".into(),
            vcpus: 1,
            memory_mib: 256,
            accel: None,
            created_at: now_rfc3339(),
            error: None,
            ports: Vec::new(),
        },
        dir: dir.join("sandboxes").join(&id),
    };
    svc.store
        .put(crate::store::SANDBOXES, &id, &rec)
        .expect("store the test sandbox");
    id
}
