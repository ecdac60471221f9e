//! Live VMs: booting a sandbox's VM, connecting its agent, watching it die, removing it, and
//! finding VMs again after a daemon restart.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use super::scheduler::Resources;
use super::{SandboxRecord, Service, ServiceError};
use crate::api::{self, SandboxState};
use crate::ids;
use crate::rpc::{AgentClient, Deadlines};
use crate::store::SANDBOXES;
use crate::vmm::{Accel, Images, QemuDriver, VmInfo, VmSpec, VmmDriver};

/// How long a dead VM's watcher waits for the reaper to report QEMU's exit status.
const EXIT_STATUS_WAIT: Duration = Duration::from_secs(2);

/// A sandbox whose VM runs and whose agent answers.
pub struct LiveVm {
    pub info: VmInfo,
    pub agent: AgentClient,
}

/// The VM side of the service: the driver, the resolved acceleration and the live VMs.
pub struct Vms {
    /// `Err` holds why no VMM is usable (e.g. QEMU missing); creating then answers 503.
    pub driver: Result<Arc<QemuDriver>, String>,
    pub accel: tokio::sync::OnceCell<Accel>,
    pub live: Mutex<HashMap<String, Arc<LiveVm>>>,
}

impl Vms {
    pub fn new(
        qemu_binary: &str,
        boot_timeout: Duration,
        log_cap: u64,
        reserve_ram: bool,
        disk_budget: Option<u64>,
        data_root: &std::path::Path,
    ) -> Vms {
        let driver = QemuDriver::new(qemu_binary)
            .map(|d| {
                Arc::new(
                    d.with_boot_timeout(boot_timeout)
                        .with_log_cap(log_cap)
                        .with_ram_reserve(reserve_ram)
                        .with_disk_budget(disk_budget)
                        .with_data_root(data_root),
                )
            })
            .map_err(|e| e.to_string());
        match &driver {
            Ok(d) => tracing::info!(driver = d.name(), version = %d.version(), "VMM ready"),
            Err(e) => tracing::warn!(
                error = %e,
                "no usable VMM; sandboxes cannot be created until it is installed"
            ),
        }
        Vms {
            driver,
            accel: tokio::sync::OnceCell::new(),
            live: Mutex::new(HashMap::new()),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, Arc<LiveVm>>> {
        self.live.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub fn get(&self, id: &str) -> Option<Arc<LiveVm>> {
        self.lock().get(id).cloned()
    }

    pub(super) fn insert(&self, id: &str, vm: Arc<LiveVm>) {
        self.lock().insert(id.to_owned(), vm);
    }

    pub(super) fn take(&self, id: &str) -> Option<Arc<LiveVm>> {
        self.lock().remove(id)
    }
}

impl Service {
    pub(super) fn driver(&self) -> Result<Arc<QemuDriver>, ServiceError> {
        self.vms.driver.clone().map_err(|e| {
            ServiceError::Unavailable(format!(
                "cannot run VMs: {e}. Install QEMU with `cargo xtask deps`"
            ))
        })
    }

    pub(super) fn images(&self) -> Result<Images, ServiceError> {
        Images::load(&self.artifacts).map_err(|e| {
            ServiceError::Unavailable(format!(
                "{e}. Build the guest images with `cargo xtask images`, then `tryboxi install --artifacts _out` \
                 (or start the daemon with `tryboxi serve --artifacts _out`)"
            ))
        })
    }

    async fn accel(&self, driver: &QemuDriver, images: &Images) -> Accel {
        let cache = self.paths.cache_dir();
        *self
            .vms
            .accel
            .get_or_init(|| {
                crate::vmm::resolve_accel(
                    self.config.accel,
                    driver,
                    &images.kernel,
                    &images.initramfs,
                    &cache,
                )
            })
            .await
    }

    /// The deadlines every agent connection of this service gets (`agent_timeout_s`).
    pub(super) fn agent_deadlines(&self) -> Deadlines {
        Deadlines {
            reply: Duration::from_secs(self.config.agent_timeout_s.max(1)),
            ..Deadlines::default()
        }
    }

    pub fn accel_if_known(&self) -> Option<Accel> {
        self.vms.accel.get().copied()
    }

    /// `POST /v1/sandboxes`: boot a VM and return once its agent answers. `caller_uid`: the
    /// unix-socket peer or loopback TCP client's uid (`None`: a remote client with the token);
    /// that user's home
    /// folder may not be the workspace.
    pub async fn create_sandbox(
        self: &Arc<Self>,
        req: api::CreateSandboxRequest,
        caller_uid: Option<u32>,
    ) -> Result<api::Sandbox, ServiceError> {
        let svc = self.clone();
        super::locks::to_the_end(async move { svc.create_held(req, caller_uid).await }).await
    }

    async fn create_held(
        self: &Arc<Self>,
        req: api::CreateSandboxRequest,
        caller_uid: Option<u32>,
    ) -> Result<api::Sandbox, ServiceError> {
        let t0 = std::time::Instant::now();
        let (vcpus, memory_mib, workspace) = self.validate_create(&req, caller_uid).await?;
        let exclude = req.workspace.as_ref().map(|w| w.exclude.clone());
        self.check_exclude(exclude.as_deref().unwrap_or_default())?;
        let net_policy = self.validate_network(req.network.as_ref())?;
        self.check_secret_names(&req.secrets)?;
        let need = Resources::new(vcpus, memory_mib as u64);
        // A nearly full data root: refused before anything is made (507 `no_space`).
        self.ensure_create_room()?;
        // Bigger than the host: refused before any work (503).
        self.ledger.group_ever_fits(need, 1, &[])?;
        let images = self.images()?;
        let driver = self.driver()?;
        let accel = self.accel(&driver, &images).await;
        let (template, rootfs) =
            super::templates::resolve(&images, req.template.as_deref(), workspace.as_deref())?;
        // A waiting pool VM of this shape already holds its vCPUs and memory in the ledger: the
        // sandbox takes the VM and its reservation, without reserving or queueing again.
        if let Some(done) = self
            .create_from_pool(
                (&template, &rootfs),
                &images,
                (vcpus, memory_mib, accel),
                workspace.as_deref().zip(exclude.clone()),
                (&net_policy, &req.secrets),
            )
            .await
        {
            return done;
        }
        let id = ids::new_id(ids::SANDBOX);
        // Held until the sandbox is ready or discarded: a remove of the `creating` record waits.
        let _life = self.hold_new(&id).await;
        // Waits in the host's queue when full (pool VMs are evicted first to make room);
        // released on drop unless the create succeeds.
        let reservation = self.ledger.reserve(&id, need).await?;
        let dir = self.paths.sandbox_dir(&id);
        std::fs::create_dir_all(&dir)
            .map_err(|e| ServiceError::Internal(format!("cannot create {}: {e}", dir.display())))?;
        let mut rec = SandboxRecord::creating(
            &id,
            dir.clone(),
            workspace.as_deref().zip(exclude),
            template,
            (vcpus, memory_mib, accel),
        );
        self.store.put(SANDBOXES, &id, &rec)?;
        self.init_network(&id, net_policy)?;
        self.init_secrets(&id, &req.secrets)?;
        self.telemetry.sandbox_created(&rec.api, t0);
        let spec = VmSpec {
            id: id.clone(),
            dir: dir.clone(),
            kernel: images.kernel.clone(),
            initramfs: images.initramfs.clone(),
            rootfs,
            vcpus,
            memory_mib,
            accel,
        };
        let started = std::time::Instant::now();
        // The NIC's socket must be listening before QEMU starts.
        let booted = match self.ensure_network(&id, &dir) {
            Ok(()) => self.boot_or_clone(&driver, &spec).await,
            Err(e) => Err(e),
        };
        match booted {
            Ok(vm) => {
                let boot_ms = started.elapsed().as_millis() as u64;
                let vm = Arc::new(vm);
                self.vms.insert(&id, vm.clone());
                self.watch(id.clone(), vm.clone());
                // The workspace goes in before anyone can exec.
                if rec.api.workspace.is_some()
                    && let Err(e) = self.sync_locked(&rec, &vm, &[], Some(&id)).await
                {
                    tracing::warn!(sandbox = %id, error = %e, "first workspace sync failed; cleaning up");
                    self.vms.take(&id);
                    self.telemetry.sandbox_create_failed(&id, &e.to_string());
                    self.discard(&id, &dir).await;
                    return Err(e);
                }
                tracing::info!(sandbox = %id, %accel, boot_ms, total_ms = started.elapsed().as_millis() as u64, "sandbox ready");
                rec.api.state = SandboxState::Ready;
                self.store.put(SANDBOXES, &id, &rec)?;
                reservation.keep();
                self.telemetry.sandbox_ready(&rec.api, started);
                Ok(rec.api)
            }
            Err(e) => {
                tracing::warn!(sandbox = %id, error = %e, "create failed; cleaning up");
                self.telemetry.sandbox_create_failed(&id, &e.to_string());
                self.discard(&id, &dir).await;
                Err(e)
            }
        }
    }

    pub(super) async fn boot(
        &self,
        driver: &QemuDriver,
        spec: &VmSpec,
    ) -> Result<LiveVm, ServiceError> {
        let span = self.telemetry.traces.span(&spec.id, "vm.boot");
        let info = driver.boot(spec).await.map_err(|e| {
            // Its RAM file's reserve is the first big write of a boot.
            ServiceError::of_write(
                &spec.dir,
                "the VM's RAM file",
                "the VM did not boot",
                &e.to_string(),
            )
        })?;
        drop(span);
        self.connect_booted(driver, info).await
    }

    /// Wait for the agent of the freshly booted VM `info` (a QEMU that stops first, or an
    /// agent that does not answer in `boot_timeout_s`, fails the boot and is killed).
    pub(super) async fn connect_booted(
        &self,
        driver: &QemuDriver,
        info: VmInfo,
    ) -> Result<LiveVm, ServiceError> {
        let _span = self.telemetry.traces.span(&info.id, "guest.connect");
        let timeout = Duration::from_secs(self.config.boot_timeout_s);
        let agent = tokio::select! {
            r = AgentClient::connect_unix(&info.agent_socket, timeout) => r,
            _ = wait_dead(driver, &info) => {
                // The whole story (a guest kernel panic's message comes before its trace) for
                // the daemon log: the VM's directory may be gone by the time anyone looks.
                tracing::error!(
                    sandbox = %info.id,
                    console = %tail_lines(&info.console_log, 80),
                    "the VM stopped during boot"
                );
                return Err(ServiceError::Internal(format!(
                    "the VM stopped before its agent answered; console: {}",
                    tail(&info.console_log)
                )));
            }
        };
        match agent {
            Ok(agent) => {
                agent.set_deadlines(self.agent_deadlines());
                super::guest_trust::sync_clock(&agent, &info.id);
                Ok(LiveVm { info, agent })
            }
            Err(e) => {
                let _ = driver.kill(&info).await;
                Err(ServiceError::Internal(format!(
                    "the guest agent did not answer: {e}; console: {}",
                    tail(&info.console_log)
                )))
            }
        }
    }

    /// Mark the sandbox failed when its VM dies or its agent link breaks without a remove (also
    /// when the host cut off an agent that broke the protocol or missed a request's deadline:
    /// the record's `error` then says which).
    pub(super) fn watch(self: &Arc<Self>, id: String, vm: Arc<LiveVm>) {
        let svc = Arc::downgrade(self);
        tokio::spawn(async move {
            // A request the agent was too slow for while it still answered a ping failed alone
            // (`RpcError::Slow`): the sandbox stays up; the event says what happened.
            let mut slow = vm.agent.slow_requests();
            loop {
                tokio::select! {
                    () = vm.agent.closed() => break,
                    r = slow.changed() => {
                        if r.is_err() {
                            vm.agent.closed().await;
                            break;
                        }
                        let msg = slow.borrow_and_update().clone();
                        if let (Some(msg), Some(svc)) = (msg, svc.upgrade()) {
                            tracing::warn!(sandbox = %id, reason = %msg, "guest agent slow");
                            svc.telemetry.events.publish(
                                "sandbox.agent_slow",
                                &id,
                                None,
                                serde_json::json!({ "error": msg }),
                            );
                        }
                    }
                }
            }
            let Some(svc) = svc.upgrade() else { return };
            // A remove, pause or restore takes the VM out of the map first; then this is
            // expected.
            let current = |svc: &Service| svc.vms.get(&id).is_some_and(|c| Arc::ptr_eq(&c, &vm));
            if !current(&svc) {
                return;
            }
            // Whoever holds the lock may be replacing this VM on purpose; once it is done the
            // map says whether this VM is still the sandbox's.
            let Some(_life) = svc.life.locks.hold(&id).await else {
                return;
            };
            if !current(&svc) {
                // Removed meanwhile: the lock entry this made is stale.
                if svc.record(&id).is_err() {
                    svc.life.locks.tombstone(&id);
                }
                return;
            }
            svc.vms.take(&id);
            let alive = svc.vms.driver.as_ref().is_ok_and(|d| d.is_alive(&vm.info));
            let exit = match (&svc.vms.driver, alive) {
                (Ok(d), false) => d.exit_of(&vm.info, EXIT_STATUS_WAIT).await,
                _ => None,
            };
            let why = if let Some(reason) = vm.agent.close_reason() {
                // The host cut a misbehaving agent off: it broke the protocol or missed a
                // deadline (`rpc::Deadlines`). The VM cannot be trusted to serve again.
                format!("the guest agent was cut off: {reason}")
            } else if alive {
                "the guest agent connection broke".to_owned()
            } else {
                let how = exit.map(|e| format!(": {e}")).unwrap_or_default();
                format!(
                    "the VM stopped unexpectedly{how}; console: {}",
                    tail(&vm.info.console_log)
                )
            };
            tracing::warn!(sandbox = %id, reason = %why, "sandbox failed");
            if let Ok(d) = &svc.vms.driver {
                let _ = d.kill(&vm.info).await;
            }
            svc.mark_failed(&id, why);
        });
    }

    pub(super) fn mark_failed(&self, id: &str, why: String) {
        if let Ok(Some(mut rec)) = self.store.get::<SandboxRecord>(SANDBOXES, id)
            && rec.api.state != SandboxState::Removing
        {
            rec.api.state = SandboxState::Failed;
            // No VM, no resources held.
            self.ledger.release(id);
            self.telemetry.sandbox_failed(id, &why);
            rec.api.error = Some(why);
            let _ = self.store.put(SANDBOXES, id, &rec);
        }
    }

    /// Kill the VM recorded in `dir`, if it still runs.
    pub(super) async fn kill_leftover(&self, dir: &Path) {
        if let Ok(d) = &self.vms.driver
            && let Ok(Some(info)) = d.reattach(dir).await
        {
            let _ = d.kill(&info).await;
        }
    }

    /// `dir`'s VM is gone and the directory is about to be deleted: the driver gives back
    /// what it holds for it outside the directory (the per-sandbox uid claim).
    pub(super) fn forget_vm_dir(&self, dir: &Path) {
        if let Ok(d) = &self.vms.driver {
            d.forget(dir);
        }
    }

    /// Kill whatever runs in `dir`, delete it (fenced) and forget the record.
    pub(super) async fn discard(&self, id: &str, dir: &Path) {
        self.kill_leftover(dir).await;
        self.stop_network(id);
        self.close_ports(id);
        self.forget_vm_dir(dir);
        if let Err(e) = crate::safefs::remove_under(&self.paths.root, dir) {
            tracing::error!(sandbox = %id, error = %e, "cannot delete the sandbox directory");
        }
        let _ = self.store.delete(SANDBOXES, id);
        self.ledger.release(id);
        self.forget_snapshots(id);
        self.life.forget(id);
        self.forget_network(id);
        self.forget_secrets(id);
        self.telemetry.sandbox_removed(id);
    }

    /// `DELETE /v1/sandboxes/{id}`: kill the VM, delete its directory and its record.
    /// Waits for the operation in flight on the sandbox (its lifecycle lock); callers queued
    /// behind the remove then find no sandbox.
    pub async fn remove_sandbox(&self, id: &str) -> Result<api::Sandbox, ServiceError> {
        let removed = match self.life.service() {
            Some(svc) => {
                let id = id.to_owned();
                super::locks::to_the_end(async move { svc.remove_held(&id).await }).await
            }
            None => self.remove_held(id).await,
        };
        if removed.is_ok() {
            // It may have been the last user of a retired sandbox's files.
            self.reap_soon();
        }
        removed
    }

    async fn remove_held(&self, id: &str) -> Result<api::Sandbox, ServiceError> {
        let (_life, mut rec) = self.hold(id).await?;
        self.check_no_dependents(&rec)?;
        rec.api.state = SandboxState::Removing;
        if let Err(e) = self.store.put(SANDBOXES, id, &rec) {
            // A full data root: removing is what frees it, so go on without the mark. A crash
            // before the record is deleted leaves a record whose VM and directory are gone:
            // the next start marks it failed and a second remove ends it.
            if !crate::diskspace::mentions_no_space(&e.to_string()) {
                return Err(e.into());
            }
            tracing::warn!(sandbox = %id, error = %e, "the data root is full; removing without the mark");
        }
        if let Some(vm) = self.vms.take(id)
            && let Ok(d) = &self.vms.driver
        {
            d.stop(&vm.info, Duration::from_secs(2))
                .await
                .map_err(|e| ServiceError::Internal(format!("cannot stop the VM: {e}")))?;
        }
        self.discard(id, &rec.dir).await;
        self.forget_walk(id);
        tracing::info!(sandbox = %id, "sandbox removed");
        Ok(rec.api)
    }

    /// Daemon start: reattach to VMs that outlived the previous daemon, fail the ones that did
    /// not, finish interrupted removes, and delete VM directories that have no record.
    pub async fn recover(self: &Arc<Self>) {
        // The interceptor and every exec read the published secrets.
        self.publish_all_secrets();
        let recs: Vec<SandboxRecord> = match self.store.list(SANDBOXES) {
            Ok(r) => r,
            Err(e) => {
                tracing::error!(error = %e, "cannot read sandboxes from the store");
                return;
            }
        };
        let known: Vec<PathBuf> = recs.iter().map(|r| r.dir.clone()).collect();
        for rec in recs {
            let id = rec.api.id.clone();
            match rec.api.state {
                SandboxState::Removing => self.discard(&id, &rec.dir).await,
                SandboxState::Creating => {
                    tracing::warn!(sandbox = %id, "daemon restarted during create; discarding");
                    self.discard(&id, &rec.dir).await;
                }
                SandboxState::Failed => {
                    // Make sure nothing of it still runs.
                    self.kill_leftover(&rec.dir).await;
                }
                SandboxState::Ready => {
                    // Its VM runs already: count it (a failed reattach releases it again).
                    self.ledger.adopt(
                        &id,
                        Resources::new(rec.api.vcpus, rec.api.memory_mib as u64),
                    );
                    self.reattach(&id, &rec.dir).await
                }
                // No QEMU: `start_lifecycle` resumes what a shutdown paused (and reserves).
                SandboxState::Paused => {}
                // No QEMU, nothing reserved: reaped below once nothing needs its files.
                SandboxState::Retired => self.kill_leftover(&rec.dir).await,
            }
        }
        self.rebind_ports().await;
        self.reap_retired().await;
        self.clean_incomplete_golden().await;
        // Cgroups of QEMUs that ended while no daemon ran (a running one is never removed).
        if let Ok(d) = &self.vms.driver {
            d.jail().sweep();
        }
        // Directories nobody owns (e.g. a crash between mkdir and the first store write).
        if let Ok(entries) = std::fs::read_dir(self.paths.sandboxes_dir()) {
            for e in entries.flatten() {
                let p = e.path();
                let name = e.file_name().to_string_lossy().into_owned();
                if !known.contains(&p) {
                    tracing::warn!(dir = %p.display(), "removing an orphaned sandbox directory");
                    self.discard(&name, &p).await;
                }
            }
        }
    }

    async fn reattach(self: &Arc<Self>, id: &str, dir: &Path) {
        let _life = self.hold_new(id).await;
        let Ok(d) = self.vms.driver.clone() else {
            self.mark_failed(id, "no VMM is usable after the daemon restart".into());
            return;
        };
        let info = match d.reattach(dir).await {
            Ok(Some(info)) => info,
            Ok(None) => {
                tracing::warn!(sandbox = %id, "its VM is gone after a daemon restart");
                self.mark_failed(id, "the VM stopped while the daemon was not running".into());
                return;
            }
            Err(e) => {
                self.mark_failed(id, format!("cannot reattach to the VM: {e}"));
                return;
            }
        };
        // QEMU keeps retrying its NIC's socket: listening again brings the network back.
        if let Err(e) = self.ensure_network(id, dir) {
            tracing::warn!(sandbox = %id, error = %e, "no network after the daemon restart");
        }
        match AgentClient::connect_unix(&info.agent_socket, Duration::from_secs(20)).await {
            Ok(agent) => {
                agent.set_deadlines(self.agent_deadlines());
                tracing::info!(sandbox = %id, pid = info.pid, "reattached to a running VM");
                let vm = Arc::new(LiveVm { info, agent });
                self.vms.insert(id, vm.clone());
                self.watch(id.to_owned(), vm);
            }
            Err(e) => {
                let _ = d.kill(&info).await;
                self.mark_failed(
                    id,
                    format!("the guest agent did not answer after the daemon restart: {e}"),
                );
            }
        }
    }
}

/// Resolves when the VMM process of `info` is gone (checked every 100 ms).
async fn wait_dead(driver: &QemuDriver, info: &VmInfo) {
    while driver.is_alive(info) {
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// How much of a log's end [`tail`] reads (with a seek, never the whole file).
const TAIL_BYTES: u64 = 4096;

/// The last lines of a log file, for error messages.
pub fn tail(path: &Path) -> String {
    tail_lines(path, 8)
}

/// The last `n` non-empty lines of the log at `path` (read from its last `TAIL_BYTES`, or
/// 160 bytes a line up to 64 KiB), joined with ` | `.
pub fn tail_lines(path: &Path, n: usize) -> String {
    let bytes = TAIL_BYTES.max(n as u64 * 160).min(64 << 10);
    let text = crate::vmm::qemu::logs::read_tail(path, bytes)
        .map(|b| String::from_utf8_lossy(&b).into_owned())
        .unwrap_or_default();
    let lines: Vec<&str> = text.lines().filter(|l| !l.trim().is_empty()).collect();
    let start = lines.len().saturating_sub(n);
    if lines.is_empty() {
        "(empty)".into()
    } else {
        lines[start..].join(" | ")
    }
}

#[cfg(test)]
#[path = "vms_tests.rs"]
mod tests;
