//! The warm pool: VMs started from a golden snapshot ahead of time (`[pool] size` per golden
//! key), each with its own sandbox id and directory but no record until a create takes it.
//!
//! Owns: refilling the pool, handing a pool VM to a create, stopping pool VMs the scheduler
//! evicted, ending the pool at shutdown.
//!
//! When a pool is refilled: after a create took one of its VMs or started from its golden
//! snapshot, after the snapshot was built, and whenever the ledger gets room back
//! ([`Ledger::freed`](super::scheduler::Ledger::freed): rm, pause, a VM's end, a failed
//! create) for every key that had a pool in this daemon's run and is still current. Each
//! refill follows the same rules: one VM at a time while it fits now (below).
//!
//! Ledger rules (see `scheduler.rs`): a pool VM reserves its vCPUs and memory
//! ([`Holder::Pool`]) before it is started, and only when that fits right now with nobody
//! queued ([`Ledger::try_reserve`](super::scheduler::Ledger::try_reserve)), so a refill never
//! waits in, nor blocks, the create queue; one that finds waiters when it is ready gives its
//! room back at once. A create that takes a pool VM moves the reservation to the sandbox
//! ([`Ledger::claim_pool`](super::scheduler::Ledger::claim_pool)). A request that would have to
//! wait makes the ledger evict pool VMs; [`Service::start_pool_upkeep`] stops them.
//!
//! Whoever removes a [`PoolVm`] from the pool list (under its lock) owns it: it either claims
//! its reservation or stops it. A pool VM whose reservation was evicted while it was out of
//! the list (starting, or being taken) is stopped by the one holding it.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

use super::golden::lock;
use super::scheduler::{Holder, Resources};
use super::vms::LiveVm;
use super::{SandboxRecord, Service, ServiceError};
use crate::api::{self, SandboxState};
use crate::ids;
use crate::store::SANDBOXES;
use crate::vmm::{Images, VmSpec, VmmDriver};

/// A VM started from a golden snapshot ahead of time.
pub(super) struct PoolVm {
    id: String,
    dir: PathBuf,
    vm: LiveVm,
}

impl Service {
    /// Refill `key`'s warm pool up to `pool.size` in the background, while the host has room.
    pub(super) fn fill_pool(self: &Arc<Self>, key: &str, spec: &VmSpec) {
        let want = self.config.pool.size as usize;
        if want == 0 || self.life.shutting_down() {
            return;
        }
        lock(&self.life.golden.wanted).insert(key.to_owned(), spec.clone());
        {
            let mut filling = lock(&self.life.golden.filling);
            if let Some(again) = filling.get_mut(key) {
                // The running refill may have just given up for lack of room: once more.
                *again = true;
                return;
            }
            filling.insert(key.to_owned(), false);
        }
        let svc = self.clone();
        let key = key.to_owned();
        let spec = spec.clone();
        tokio::spawn(async move { while svc.fill_pool_round(&key, &spec, want).await {} });
    }

    /// One round of [`Service::fill_pool`]: start pool VMs until the pool is full or one does
    /// not fit. `true`: asked again meanwhile, go round once more; `false`: done (no longer
    /// filling). A round that failed (not merely out of room) does not go again: its own
    /// released reservation would ask for the next round, forever.
    async fn fill_pool_round(self: &Arc<Self>, key: &str, spec: &VmSpec, want: usize) -> bool {
        let mut failed = false;
        loop {
            let have = lock(&self.life.golden.pool).get(key).map_or(0, Vec::len);
            if have >= want || self.life.shutting_down() {
                break;
            }
            let Some(g) = self.golden(key) else { break };
            let id = ids::new_id(ids::SANDBOX);
            let need = Resources::new(spec.vcpus, u64::from(spec.memory_mib));
            let Some(reservation) = self.ledger.try_reserve(&id, need, Holder::Pool) else {
                tracing::info!(golden = %key, have, want, "no room on the host for a pool VM now; not refilling");
                break;
            };
            let dir = self.paths.sandbox_dir(&id);
            if let Err(e) = std::fs::create_dir_all(&dir) {
                tracing::warn!(error = %e, "cannot create a pool VM directory");
                failed = true;
                break;
            }
            let pspec = VmSpec {
                id: id.clone(),
                dir: dir.clone(),
                ..spec.clone()
            };
            let started = match self.start_clone(&pspec, &g.checkpoint, false).await {
                Ok(vm) => warm_up(&vm.agent).await.map(|()| vm),
                Err(e) => Err(e),
            };
            match started {
                Ok(vm) => {
                    reservation.keep();
                    let p = PoolVm { id, dir, vm };
                    if let Some(p) = self.park(key, p) {
                        tracing::info!(sandbox = %p.id, golden = %key, "a pool VM gives way: evicted while starting, or requests wait");
                        self.drop_pool_vm(&p.id, &p.dir).await;
                        break;
                    }
                }
                Err(e) => {
                    self.mark_broken(key, &e.to_string());
                    self.drop_pool_vm(&id, &dir).await;
                    failed = true;
                    break;
                }
            }
        }
        let mut filling = lock(&self.life.golden.filling);
        if filling.get(key) == Some(&true) && !failed && !self.life.shutting_down() {
            filling.insert(key.to_owned(), false);
            return true;
        }
        filling.remove(key);
        false
    }

    /// Room was given back to the ledger: refill every pool below its size (same rules as any
    /// refill: only what fits now). Keys whose images or shape changed since are forgotten.
    /// Not while the host is under memory pressure: the room may have been freed by pausing a
    /// sandbox for it (and pool VMs were evicted first).
    fn refill_pools(self: &Arc<Self>) {
        let limits = &self.config.limits;
        if limits.pressure_check_s > 0
            && super::pressure::want_to_free(super::pressure::Reading::now(), limits).is_some()
        {
            tracing::info!("room freed, but the host is under memory pressure: no pool refill");
            return;
        }
        let wanted: Vec<(String, VmSpec)> = lock(&self.life.golden.wanted)
            .iter()
            .map(|(k, s)| (k.clone(), s.clone()))
            .collect();
        let want = self.config.pool.size as usize;
        for (key, spec) in wanted {
            if self.key_of(&spec).as_deref() != Some(key.as_str()) {
                lock(&self.life.golden.wanted).remove(&key);
                continue;
            }
            if lock(&self.life.golden.pool).get(&key).map_or(0, Vec::len) < want {
                self.fill_pool(&key, &spec);
            }
        }
    }

    /// Put a started pool VM in the pool if it still holds its pool reservation and nobody
    /// waits for room; else hand it back (`Some`) to be stopped.
    fn park(&self, key: &str, p: PoolVm) -> Option<PoolVm> {
        let mut pool = lock(&self.life.golden.pool);
        // Checked under the pool lock: an eviction after this finds the VM in the list.
        if self.ledger.holder(&p.id) != Some(Holder::Pool)
            || self.ledger.has_waiters()
            || self.life.shutting_down()
        {
            return Some(p);
        }
        tracing::info!(golden = %key, sandbox = %p.id, "pool VM ready");
        pool.entry(key.to_owned()).or_default().push(p);
        None
    }

    /// Stop a pool VM that no create took: kill it, delete its directory, end its reservation.
    async fn drop_pool_vm(&self, id: &str, dir: &Path) {
        self.kill_leftover(dir).await;
        self.stop_network(id);
        self.forget_vm_dir(dir);
        if let Err(e) = crate::safefs::remove_under(&self.paths.root, dir) {
            tracing::error!(sandbox = %id, error = %e, "cannot delete a pool VM's directory");
        }
        self.ledger.release(id);
    }

    /// Stop the pool VMs the scheduler evicts (a request needed their room), and refill the
    /// pools when the ledger gets room back. Started once, by `start_lifecycle`; until then
    /// nothing is evicted and pools are refilled only after use.
    pub(super) fn start_pool_upkeep(self: &Arc<Self>) {
        let mut freed = self.ledger.freed();
        let weak = Arc::downgrade(self);
        tokio::spawn(async move {
            while freed.recv().await.is_some() {
                let Some(svc) = weak.upgrade() else { return };
                svc.refill_pools();
            }
        });
        let mut rx = self.ledger.evictions();
        let weak = Arc::downgrade(self);
        tokio::spawn(async move {
            while let Some(id) = rx.recv().await {
                let Some(svc) = weak.upgrade() else { return };
                let found = {
                    let mut pool = lock(&svc.life.golden.pool);
                    pool.values_mut().find_map(|v| {
                        let i = v.iter().position(|p| p.id == id)?;
                        Some(v.swap_remove(i))
                    })
                };
                // Not in the list: starting or being taken; its holder sees the eviction.
                if let Some(p) = found {
                    svc.drop_pool_vm(&p.id, &p.dir).await;
                    svc.telemetry.events.publish(
                        "pool.evicted",
                        "",
                        None,
                        serde_json::json!({"pool_vm": p.id}),
                    );
                }
            }
        });
    }

    /// `create` from the warm pool: a ready sandbox if a pool VM of this shape is waiting.
    /// Its reservation becomes the sandbox's: the create does not reserve (nor wait) again.
    pub(super) async fn create_from_pool(
        self: &Arc<Self>,
        (template, rootfs): (&str, &Path),
        images: &Images,
        (vcpus, memory_mib, accel): (u32, u32, crate::vmm::Accel),
        workspace: Option<(&Path, Vec<String>)>,
        (net_policy, secrets): (&crate::network::policy::Policy, &[String]),
    ) -> Option<Result<api::Sandbox, ServiceError>> {
        if !self.config.pool.golden || self.config.pool.size == 0 {
            return None;
        }
        let spec_like = VmSpec {
            id: "pool".into(),
            dir: self.paths.sandboxes_dir(),
            kernel: images.kernel.clone(),
            initramfs: images.initramfs.clone(),
            rootfs: rootfs.to_path_buf(),
            vcpus,
            memory_mib,
            accel,
        };
        let spec_like = &spec_like;
        let key = self.key_of(spec_like)?;
        let t0 = Instant::now();
        let pvm = loop {
            let p = lock(&self.life.golden.pool).get_mut(&key)?.pop()?;
            let driver = self.driver().ok()?;
            if p.vm.agent.is_closed() || !driver.is_alive(&p.vm.info) {
                tracing::warn!(sandbox = %p.id, "a pool VM died while waiting; dropping it");
            } else if self.ledger.claim_pool(&p.id, &p.id).is_some() {
                break p;
            } else {
                tracing::info!(sandbox = %p.id, "a pool VM was evicted as it was taken; dropping it");
            }
            self.drop_pool_vm(&p.id, &p.dir).await;
        };
        let id = pvm.id.clone();
        // Held until the sandbox is ready or discarded (as in a create).
        let _life = self.hold_new(&id).await;
        let mut rec = SandboxRecord::creating(
            &id,
            pvm.dir.clone(),
            workspace,
            template.to_owned(),
            (vcpus, memory_mib, accel),
        );
        // From here on the VM is a sandbox: a failure discards it (which releases).
        if let Err(e) = self.store.put(SANDBOXES, &id, &rec) {
            self.discard(&id, &rec.dir).await;
            return Some(Err(e.into()));
        }
        // Pool VMs wait without a network peer (QEMU's NIC keeps reconnecting): the stack starts
        // now, with this sandbox's policy.
        if let Err(e) = self
            .init_network(&id, net_policy.clone())
            .and_then(|()| self.init_secrets(&id, secrets))
            .and_then(|()| self.ensure_network(&id, &rec.dir))
        {
            self.discard(&id, &rec.dir).await;
            return Some(Err(e));
        }
        self.telemetry.sandbox_created(&rec.api, t0);
        let vm = Arc::new(pvm.vm);
        self.vms.insert(&id, vm.clone());
        self.watch(id.clone(), vm.clone());
        if rec.api.workspace.is_some()
            && let Err(e) = self.sync_locked(&rec, &vm, &[], Some(&id)).await
        {
            self.vms.take(&id);
            self.telemetry.sandbox_create_failed(&id, &e.to_string());
            self.discard(&id, &rec.dir).await;
            return Some(Err(e));
        }
        rec.api.state = SandboxState::Ready;
        if let Err(e) = self.store.put(SANDBOXES, &id, &rec) {
            return Some(Err(e.into()));
        }
        self.life.touch(&id);
        self.telemetry.sandbox_ready(&rec.api, t0);
        tracing::info!(sandbox = %id, golden = %key, ms = t0.elapsed().as_millis() as u64, "created from the warm pool");
        self.fill_pool(&key, spec_like);
        Some(Ok(rec.api))
    }

    /// Shutdown: let golden builds and pool fills in flight finish (bounded: their QEMUs must
    /// not outlive us), then end the pool VMs.
    pub(super) async fn drain_pool(&self) {
        self.life.set_shutting_down();
        let deadline = Instant::now() + std::time::Duration::from_secs(self.config.boot_timeout_s);
        while (!lock(&self.life.golden.building).is_empty()
            || !lock(&self.life.golden.filling).is_empty())
            && Instant::now() < deadline
        {
            tokio::time::sleep(std::time::Duration::from_millis(50)).await;
        }
        let all: Vec<PoolVm> = lock(&self.life.golden.pool)
            .drain()
            .flat_map(|(_, v)| v)
            .collect();
        for p in all {
            self.drop_pool_vm(&p.id, &p.dir).await;
        }
        let building: Vec<String> = lock(&self.life.golden.building).iter().cloned().collect();
        for key in building {
            self.kill_leftover(&self.golden_dir(&key).join("vm")).await;
        }
    }

    /// Pid and directory of every warm-pool VM.
    pub(super) fn pool_dirs(&self) -> Vec<(u32, std::path::PathBuf)> {
        lock(&self.life.golden.pool)
            .values()
            .flatten()
            .map(|p| (p.vm.info.pid, p.vm.info.dir.clone()))
            .collect()
    }

    /// Warm-pool VMs waiting, every key together: (id, QEMU pid), for the usage sampler.
    pub(super) fn pool_pids(&self) -> Vec<(String, u32)> {
        lock(&self.life.golden.pool)
            .values()
            .flatten()
            .map(|p| (p.id.clone(), p.vm.info.pid))
            .collect()
    }

    /// Warm-pool VMs waiting, every key together (the `tryboxi_pool_ready` gauge).
    pub(super) fn pool_ready(&self) -> usize {
        lock(&self.life.golden.pool).values().map(Vec::len).sum()
    }
}

/// Run one short command in a fresh pool VM before it waits to be taken. It is a new QEMU whose
/// TCG translation cache is empty; the exec path (agent, guest kernel spawn, the dynamic loader)
/// is what a create's first command needs, so it is translated here, ahead of time, instead of
/// in the user's first exec. A VM that cannot run `true` is not fit for the pool.
async fn warm_up(agent: &crate::rpc::AgentClient) -> Result<(), ServiceError> {
    let bad = |m: String| ServiceError::Internal(format!("pool VM warm-up failed: {m}"));
    let req = crate::rpc::ExecRequest {
        argv: vec!["true".into()],
        cwd: Some("/".into()),
        timeout: Some(std::time::Duration::from_secs(30)),
        ..Default::default()
    };
    let mut s = agent.exec(req).await.map_err(|e| bad(e.to_string()))?;
    while let Some(ev) = s.next().await {
        match ev.map_err(|e| bad(e.to_string()))? {
            crate::rpc::ExecEvent::Exit { code: Some(0), .. } => return Ok(()),
            crate::rpc::ExecEvent::Exit { code, signal, .. } => {
                return Err(bad(format!(
                    "`true` ended with {code:?} / signal {signal:?}"
                )));
            }
            _ => {}
        }
    }
    Err(bad("the exec ended without an exit status".into()))
}
