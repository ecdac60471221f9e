//! Fork: N new sandboxes that start from the current state of a running one.
//!
//! The parent is checkpointed into `<parent dir>/forks/<base>/` (device state, frozen RAM file,
//! and its disk layer frozen by `blockdev-snapshot`; the parent goes on running on a new
//! overlay). Each child is a clone of that checkpoint: a private copy-on-write mapping of the
//! frozen RAM file and its own qcow2 overlay over the frozen layer, its own id, directory,
//! agent channel and the parent's workspace sync base (manifest copied, blobs and packs
//! hard-linked). The children's disk chains and RAM files live in the parent's directory, so
//! the parent cannot be removed while a child exists (`lineage.json` in the child's directory
//! records this).
//!
//! Also here: what makes a clone its own machine (hostname, a fresh random seed), shared with
//! golden-snapshot creates.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

use serde::{Deserialize, Serialize};

use super::vms::LiveVm;
use super::{SandboxRecord, Service, ServiceError};
use crate::api::{self, SandboxState};
use crate::ids;
use crate::rpc::AgentClient;
use crate::store::SANDBOXES;
use crate::vmm::qemu::Checkpoint;
use crate::vmm::{VmSpec, VmmDriver};
use crate::workspace::manifest::Base;

/// Most children one fork request may ask for.
pub const MAX_FORK: u32 = 32;
const LINEAGE_FILE: &str = "lineage.json";

/// What a sandbox's files depend on outside its own directory.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
struct Lineage {
    /// Sandbox directories holding our RAM file and disk backing layers.
    depends_on: Vec<PathBuf>,
}

impl Service {
    /// `POST /v1/sandboxes/{id}/fork`.
    pub async fn fork_sandbox(
        self: &Arc<Self>,
        id: &str,
        req: api::ForkRequest,
    ) -> Result<api::ForkResult, ServiceError> {
        let (svc, id) = (self.clone(), id.to_owned());
        super::locks::to_the_end(async move { svc.fork_held(&id, req).await }).await
    }

    async fn fork_held(
        self: &Arc<Self>,
        id: &str,
        req: api::ForkRequest,
    ) -> Result<api::ForkResult, ServiceError> {
        let t0 = Instant::now();
        let count = req.count.unwrap_or(1);
        if count == 0 || count > MAX_FORK {
            return Err(ServiceError::BadRequest(format!(
                "count must be 1-{MAX_FORK}, got {count}"
            )));
        }
        // The parent's lock is held until every child has its record (and lineage): a remove
        // of the parent waits, then sees the children that depend on its files. Each child's
        // own lock is taken under it (parent before child, never the reverse).
        let (_life, parent, cp, saved_base, checkpoint_ms) = match &req.snapshot {
            // From a snapshot: the parent may be paused or retired (no VM is needed).
            Some(snap) => {
                let (life, parent) = self.hold(id).await?;
                if matches!(
                    parent.api.state,
                    SandboxState::Creating | SandboxState::Removing
                ) {
                    return Err(ServiceError::Conflict(format!(
                        "sandbox `{id}` is {}",
                        parent.api.state
                    )));
                }
                let s = self.find_snapshot(id, snap)?;
                self.children_fit(&parent, count)?;
                let dir = s
                    .checkpoint
                    .state_file
                    .parent()
                    .map(Path::to_path_buf)
                    .unwrap_or_default();
                (life, parent, s.checkpoint, dir.join("workspace"), 0)
            }
            None => {
                let (life, parent, vm) = self.hold_ready(id).await?;
                let (cp, saved_base) = self.fork_base(id, &parent, &vm, count).await?;
                let ms = t0.elapsed().as_millis() as u64;
                (life, parent, cp, saved_base, ms)
            }
        };
        let from = req.snapshot.as_deref();
        let kids = (0..count).map(|_| self.start_child(&parent, &cp, &saved_base, from));
        let results = futures_util::future::join_all(kids).await;
        let mut sandboxes = Vec::new();
        let mut errors = Vec::new();
        let mut all_busy = true;
        for r in results {
            match r {
                Ok(sb) => sandboxes.push(sb),
                Err(e) => {
                    all_busy &= matches!(e, ServiceError::Busy(_));
                    errors.push(e.to_string());
                }
            }
        }
        let duration_ms = t0.elapsed().as_millis() as u64;
        tracing::info!(parent = %id, children = sandboxes.len(), failed = errors.len(), checkpoint_ms, duration_ms, "sandbox forked");
        if sandboxes.is_empty() {
            let why = format!("no child could be started: {}", errors.join("; "));
            // A full host is a 429 as for a create, not a daemon error.
            return Err(if all_busy {
                ServiceError::Busy(why)
            } else {
                ServiceError::Internal(why)
            });
        }
        for e in &errors {
            tracing::warn!(parent = %id, error = %e, "a fork child failed");
        }
        Ok(api::ForkResult {
            parent: id.to_owned(),
            sandboxes,
            failed: errors,
            duration_ms,
        })
    }

    /// All `count` children together must be able to fit next to the parent; otherwise refuse
    /// now rather than queue children that can never start.
    fn children_fit(&self, parent: &SandboxRecord, count: u32) -> Result<(), ServiceError> {
        self.ledger
            .group_ever_fits(
                super::scheduler::Resources::new(parent.api.vcpus, parent.api.memory_mib as u64),
                count,
                &[parent.api.id.as_str()],
            )
            .map_err(|e| ServiceError::Unavailable(format!("a fork of {count} children: {e}")))
    }

    /// Checkpoint the running parent into a new fork base (see the module doc): the
    /// checkpoint and the sync base saved with it.
    async fn fork_base(
        &self,
        id: &str,
        parent: &SandboxRecord,
        vm: &LiveVm,
        count: u32,
    ) -> Result<(Checkpoint, PathBuf), ServiceError> {
        // Refused before the checkpoint when the children can never fit.
        self.children_fit(parent, count)?;
        let driver = self.driver()?;
        let base_id = ids::new_id("fork_");
        let base_dir = parent.dir.join("forks").join(&base_id);
        let next = parent.dir.join(format!("disk-{base_id}.qcow2"));
        // The fork base copies the parent's RAM, like a snapshot; refused up front when it
        // cannot fit (the parent runs on untouched).
        let what = format!("a fork of {id}");
        self.ensure_room_for(
            &parent.dir,
            &what,
            super::diskroom::checkpoint_bytes(parent, true),
        )?;
        let cp = driver
            .checkpoint(&vm.info, &base_dir, &next, true)
            .await
            .map_err(|e| {
                ServiceError::of_write(
                    &parent.dir,
                    &what,
                    &format!("cannot checkpoint `{id}`"),
                    &e.to_string(),
                )
            })?;
        // The parent's sync base goes with the fork base (the children's /workspace is the
        // parent's at this instant).
        let saved_base = base_dir.join("workspace");
        if let Ok(m) = Base::new(parent.dir.join("workspace")).load() {
            Base::new(saved_base.clone()).save(&m).map_err(|e| {
                // No child uses the fork base yet: it goes.
                if let Err(rm) = crate::safefs::remove_under(&parent.dir, &base_dir) {
                    tracing::warn!(sandbox = %id, error = %rm, "cannot remove a failed fork base");
                }
                ServiceError::of_write(
                    &parent.dir,
                    &what,
                    "cannot save the sync base with the fork",
                    &e.to_string(),
                )
            })?;
        }
        Ok((cp, saved_base))
    }

    /// One child of a fork: record, clone, identity, sync base, ready.
    async fn start_child(
        self: &Arc<Self>,
        parent: &SandboxRecord,
        cp: &Checkpoint,
        saved_base: &Path,
        snapshot: Option<&str>,
    ) -> Result<api::Sandbox, ServiceError> {
        let started = Instant::now();
        let id = ids::new_id(ids::SANDBOX);
        let _life = self.hold_new(&id).await;
        // Each child is a VM of its own in the host's ledger (waits or is refused like a create).
        let reservation = self
            .ledger
            .reserve(
                &id,
                super::scheduler::Resources::new(parent.api.vcpus, parent.api.memory_mib as u64),
            )
            .await?;
        let dir = self.paths.sandbox_dir(&id);
        std::fs::create_dir_all(&dir)
            .map_err(|e| ServiceError::Internal(format!("cannot create {}: {e}", dir.display())))?;
        let mut rec = parent.clone();
        rec.api.id = id.clone();
        rec.api.state = SandboxState::Creating;
        rec.api.created_at = super::now_rfc3339();
        rec.api.error = None;
        // The parent's host ports stay the parent's.
        rec.api.ports.clear();
        rec.dir = dir.clone();
        write_lineage(&dir, &parent.dir)?;
        self.store.put(SANDBOXES, &id, &rec)?;
        self.telemetry.sandbox_created(&rec.api, started);
        let res = async {
            let spec = self.spec_of(&rec)?;
            self.copy_network(&parent.api.id, &id)?;
            // Fresh placeholders: the parent's do not work in the child.
            self.fork_secrets(&parent.api.id, &id)?;
            self.ensure_network(&id, &dir)?;
            let vm = self.start_clone(&spec, cp, true).await?;
            if let Ok(m) = Base::new(saved_base.to_owned()).load() {
                // The manifest names contents kept in the parent's blobs and packs: the child
                // gets them too (hard links; they are write-once and named by their hash), or
                // its diff and apply cannot read its own base. The parent's lock is held.
                let ws = parent.dir.join("workspace");
                for sub in ["blobs", "packs"] {
                    link_tree(&ws.join(sub), &dir.join("workspace").join(sub)).map_err(|e| {
                        ServiceError::Internal(format!("cannot share the parent's sync base: {e}"))
                    })?;
                }
                Base::new(dir.join("workspace")).save(&m).map_err(|e| {
                    ServiceError::Internal(format!("cannot copy the parent's sync base: {e}"))
                })?;
            }
            Ok::<_, ServiceError>(vm)
        }
        .await;
        match res {
            Ok(vm) => {
                let vm = Arc::new(vm);
                self.vms.insert(&id, vm.clone());
                self.watch(id.clone(), vm);
                rec.api.state = SandboxState::Ready;
                self.store.put(SANDBOXES, &id, &rec)?;
                reservation.keep();
                self.life.touch(&id);
                self.telemetry.sandbox_ready(&rec.api, started);
                self.telemetry.events.publish(
                    "sandbox.forked",
                    &id,
                    None,
                    serde_json::json!({"parent": parent.api.id, "snapshot": snapshot}),
                );
                Ok(rec.api)
            }
            Err(e) => {
                self.telemetry.sandbox_create_failed(&id, &e.to_string());
                self.discard(&id, &dir).await;
                Err(e)
            }
        }
    }

    /// Start a VM from `cp`, connect its agent and make it its own machine. With `borrow` and
    /// a checkpoint that has a RAM file, the VM maps that file privately (pages shared with
    /// every clone); otherwise it gets its own RAM (a copy, or filled from the state file).
    pub(super) async fn start_clone(
        &self,
        spec: &VmSpec,
        cp: &Checkpoint,
        borrow: bool,
    ) -> Result<LiveVm, ServiceError> {
        let driver = self.driver()?;
        let overlay = spec.dir.join("disk.qcow2");
        let span = self
            .telemetry
            .traces
            .span(&spec.id, "vm.start_from_checkpoint");
        let started = if borrow && cp.ram_file.is_some() {
            driver.clone_vm(spec, cp, &overlay).await
        } else {
            driver.restore(spec, cp, &overlay, None).await
        }
        .map_err(|e| {
            ServiceError::of_write(
                &spec.dir,
                "the VM's RAM file",
                "cannot start the clone",
                &e.to_string(),
            )
        })?;
        drop(span);
        let span = self.telemetry.traces.span(&spec.id, "guest.connect");
        let (info, agent) =
            super::snapshots::agent_or_kill(&driver, started, "clone", self.agent_deadlines())
                .await?;
        drop(span);
        super::guest_trust::sync_clock(&agent, &spec.id);
        let span = self.telemetry.traces.span(&spec.id, "guest.identity");
        if let Err(e) = set_identity(&agent, &spec.id).await {
            let _ = driver.kill(&info).await;
            return Err(e);
        }
        drop(span);
        Ok(LiveVm { info, agent })
    }

    /// Refuse to remove a sandbox whose directory other sandboxes' files depend on.
    pub(super) fn check_no_dependents(&self, rec: &SandboxRecord) -> Result<(), ServiceError> {
        let deps = self.dependents(rec)?;
        if deps.is_empty() {
            Ok(())
        } else {
            Err(ServiceError::Conflict(format!(
                "sandbox `{}` has forks that use its memory and disk files: {}; remove them first",
                rec.api.id,
                deps.join(", ")
            )))
        }
    }

    /// The sandboxes (retired ones included) whose files depend on `rec`'s directory.
    pub(super) fn dependents(&self, rec: &SandboxRecord) -> Result<Vec<String>, ServiceError> {
        let recs: Vec<SandboxRecord> = self.store.list(SANDBOXES)?;
        Ok(recs
            .iter()
            .filter(|r| r.api.id != rec.api.id && r.api.state != SandboxState::Removing)
            .filter(|r| read_lineage(&r.dir).depends_on.contains(&rec.dir))
            .map(|r| r.api.id.clone())
            .collect())
    }
}

/// Hard-link every regular file under `from` to the same place under `to` (copied where a link
/// cannot be made); a missing `from` is an empty tree. Symlinks and other files are skipped.
fn link_tree(from: &Path, to: &Path) -> std::io::Result<()> {
    let rd = match std::fs::read_dir(from) {
        Ok(rd) => rd,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
        Err(e) => return Err(e),
    };
    std::fs::create_dir_all(to)?;
    for e in rd {
        let e = e?;
        let (src, dst) = (e.path(), to.join(e.file_name()));
        let ft = e.file_type()?;
        if ft.is_dir() {
            link_tree(&src, &dst)?;
        } else if ft.is_file() && !dst.exists() && std::fs::hard_link(&src, &dst).is_err() {
            std::fs::copy(&src, &dst)?;
        }
    }
    Ok(())
}

fn write_lineage(dir: &Path, parent_dir: &Path) -> Result<(), ServiceError> {
    let mut l = read_lineage(parent_dir);
    l.depends_on.push(parent_dir.to_owned());
    let path = dir.join(LINEAGE_FILE);
    let data = serde_json::to_vec_pretty(&l)
        .map_err(|e| ServiceError::Internal(format!("cannot encode lineage: {e}")))?;
    std::fs::write(&path, data)
        .map_err(|e| ServiceError::Internal(format!("cannot write {}: {e}", path.display())))
}

fn read_lineage(dir: &Path) -> Lineage {
    std::fs::read(dir.join(LINEAGE_FILE))
        .ok()
        .and_then(|d| serde_json::from_slice(&d).ok())
        .unwrap_or_default()
}

/// Make a clone its own machine: its hostname is its id, and its kernel's random pool gets
/// fresh bytes from the host (clones of one snapshot would otherwise share the pool's state).
pub(super) async fn set_identity(agent: &AgentClient, id: &str) -> Result<(), ServiceError> {
    let mut seed = [0u8; 32];
    getrandom::fill(&mut seed)
        .map_err(|e| ServiceError::Internal(format!("no host randomness: {e}")))?;
    // One RPC answered by the agent itself: no process to start, so it costs a clone (a QEMU
    // whose TCG translation cache is still empty) far less than a shell would.
    agent
        .set_identity(id, &seed)
        .await
        .map_err(|e| ServiceError::Internal(format!("cannot set the clone's identity: {e}")))
}
