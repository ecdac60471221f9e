//! Workspace use cases: sync (before every exec and at create) and diff; apply, pull and undo
//! are in `workspace_apply.rs`, single VM files in `vmfs.rs`.
//!
//! Owns the order of operations and the per-sandbox workspace lock (sync, diff and apply of
//! one sandbox never overlap). The file logic lives in `crate::workspace`; this module moves
//! bytes between it and the VM's agent and records backups in the store.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

use super::vms::LiveVm;
use super::workspace_fetch as fetch;
use super::{SandboxRecord, Service, ServiceError};
use crate::api;
use crate::rpc::{FileKind, RpcError, WalkCursor, WalkEntry};
use crate::workspace::apply;
use crate::workspace::diff::{self, Change};
use crate::workspace::manifest::{Base, Manifest};
use crate::workspace::rules::{self, Ignores, Rules, Skip};
use crate::workspace::spill::Spill;
use crate::workspace::{GUEST_ROOT, WorkspaceError, basedisk, sync};

/// Archives from this size on go through the VM's transfer disk instead of the RPC channel.
const DISK_TRANSFER_MIN: u64 = 1 << 20;
/// Suspects (changed + deleted) a diff classifies on the async task (pure memory work, tens
/// of microseconds); more go to a blocking thread.
const INLINE_CLASSIFY: usize = 256;

impl From<WorkspaceError> for ServiceError {
    fn from(e: WorkspaceError) -> Self {
        // A full data root (an apply backup, a first sync's files): 507 `no_space`.
        if let WorkspaceError::Io { what, path, source } = &e
            && crate::diskspace::is_no_space(source)
        {
            let what = format!("{what} {}", path.display());
            return crate::diskspace::after_io(path, &what, source).into();
        }
        if let WorkspaceError::Store(m) = &e
            && crate::diskspace::mentions_no_space(m)
        {
            return ServiceError::NoSpace(e.to_string());
        }
        match e {
            WorkspaceError::NoArtifact(_) => ServiceError::NotFound(e.to_string()),
            WorkspaceError::AlreadyUndone(_) | WorkspaceError::HostEdited(_) => {
                ServiceError::Conflict(e.to_string())
            }
            WorkspaceError::Refused(_) => ServiceError::BadRequest(e.to_string()),
            WorkspaceError::TooBig(_) => ServiceError::Unprocessable(e.to_string()),
            WorkspaceError::CorruptBase(..) | WorkspaceError::Store(_) => {
                ServiceError::Internal(e.to_string())
            }
            WorkspaceError::Io { .. } | WorkspaceError::Pattern { .. } => {
                ServiceError::Unprocessable(e.to_string())
            }
        }
    }
}

pub(super) fn agent_err(e: RpcError) -> ServiceError {
    match e {
        RpcError::Remote(r) => ServiceError::Unprocessable(format!("the sandbox refused: {r}")),
        e => ServiceError::Unavailable(format!("cannot reach the sandbox's agent: {e}")),
    }
}

pub(super) async fn blocking<T: Send + 'static>(
    f: impl FnOnce() -> Result<T, WorkspaceError> + Send + 'static,
) -> Result<T, ServiceError> {
    tokio::task::spawn_blocking(f)
        .await
        .map_err(|e| ServiceError::Internal(format!("workspace task failed: {e}")))?
        .map_err(ServiceError::from)
}

pub(super) fn guest_path(rel: &str) -> String {
    format!("{GUEST_ROOT}/{rel}")
}

/// The host's copy of a VM's workspace walk: which QEMU it came from (a restored or rebooted VM
/// is another process, so its copy is not reused), the agent's cursor and the entries by path.
struct WalkMirror {
    vm_pid: u32,
    cursor: WalkCursor,
    entries: BTreeMap<String, WalkEntry>,
}

/// Sandbox id -> [`WalkMirror`].
#[derive(Default)]
pub struct WalkMirrors(std::sync::Mutex<HashMap<String, WalkMirror>>);

/// The changes of a VM against its base, plus what diff/apply need around them.
pub(super) struct Changes {
    pub(super) base: Base,
    pub(super) manifest: Arc<Manifest>,
    pub(super) changes: Vec<Change>,
    special: Vec<String>,
    /// Never brought back, `path: reason` (git metadata).
    refused: Vec<String>,
    /// VM files over `sync.max_file_mib`: not fetched, never brought back.
    pub(super) too_big: Vec<api::TooBigFile>,
    /// Where the VM content of `changes` is; removed when this is dropped.
    _spill: Arc<Spill>,
}

impl Changes {
    /// What apply refuses whatever the host has: git metadata, devices, FIFOs, sockets.
    pub(super) fn refused(&self) -> impl Iterator<Item = String> + '_ {
        self.refused.iter().cloned().chain(
            self.special.iter().map(|p| {
                format!("{p}: a device, FIFO or socket; only files and symlinks come back")
            }),
        )
    }
}

impl Service {
    pub(super) fn ws_lock(&self, id: &str) -> Arc<tokio::sync::Mutex<()>> {
        let mut m = self.ws_locks.lock().unwrap_or_else(|p| p.into_inner());
        m.entry(id.to_owned()).or_default().clone()
    }

    /// The sync rules of a sandbox: the config's plus the `exclude` given at create.
    pub(super) fn rules(&self, rec: &SandboxRecord) -> Result<Rules, ServiceError> {
        let exclude = rec
            .api
            .workspace
            .as_ref()
            .map_or(&[][..], |w| &w.exclude[..]);
        let base = match self.sync_rules.get() {
            Some(r) => r,
            None => {
                let r = Rules::new(&self.config.sync)?;
                self.sync_rules.get_or_init(|| r)
            }
        };
        Ok(base.with_exclude(exclude)?)
    }

    /// The host workspace of a sandbox; 409 `no_workspace` for one created without.
    pub(super) fn workspace_of(rec: &SandboxRecord) -> Result<&api::WorkspaceSpec, ServiceError> {
        rec.api
            .workspace
            .as_ref()
            .ok_or_else(|| ServiceError::NoWorkspace(rec.api.id.clone()))
    }

    /// Refuse a workspace operation on a sandbox without a host workspace before it is resumed
    /// or locked (the record alone says so).
    pub(super) fn needs_workspace(&self, id: &str) -> Result<(), ServiceError> {
        Self::workspace_of(&self.record(id)?).map(|_| ())
    }

    /// Refuse bad `exclude` patterns of a create request before anything boots.
    pub(super) fn check_exclude(&self, patterns: &[String]) -> Result<(), ServiceError> {
        Skip::new(patterns)
            .map(|_| ())
            .map_err(|e| ServiceError::BadRequest(e.to_string()))
    }

    pub fn max_file_bytes(&self) -> u64 {
        self.config.sync.max_file_mib.saturating_mul(1024 * 1024)
    }

    fn max_diff_bytes(&self) -> u64 {
        self.config.sync.max_diff_mib.saturating_mul(1024 * 1024)
    }

    /// The lifecycle guard, record and live VM of a ready sandbox; a paused one is resumed
    /// first (409 unless it is ready). Lock order: the guard is taken before the workspace lock.
    pub(super) async fn ready_vm(
        &self,
        id: &str,
    ) -> Result<(super::locks::LifeGuard, SandboxRecord, Arc<LiveVm>), ServiceError> {
        self.hold_ready(id).await
    }

    pub(super) fn host_root(rec: &SandboxRecord) -> Result<PathBuf, ServiceError> {
        let root = PathBuf::from(&Self::workspace_of(rec)?.host_path);
        if !root.is_dir() {
            return Err(ServiceError::Unprocessable(format!(
                "the workspace {} is gone or not a directory",
                root.display()
            )));
        }
        Ok(root)
    }

    /// `POST /v1/sandboxes/{id}/sync`.
    pub async fn sync_workspace(
        &self,
        id: &str,
        req: api::SyncRequest,
    ) -> Result<api::SyncReport, ServiceError> {
        self.check_exclude(&req.exclude)?;
        self.needs_workspace(id)?;
        let (_life, rec, vm) = self.ready_vm(id).await?;
        let lock = self.ws_lock(id);
        let _g = lock.lock().await;
        // Counted in the metrics; its span would land in a create's trace that has ended.
        self.sync_locked(&rec, &vm, &req.exclude, None).await
    }

    /// Send what changed on the host since the base; record the new base. The caller holds
    /// the sandbox's workspace lock (or owns the sandbox exclusively, at create). Paths that
    /// `exclude` (this request's patterns) matches are left as they are in the VM and base.
    /// Every sync is counted in the sync metrics; with `trace_id` (the create's sandbox id, an
    /// exec's id) it is also a `workspace.sync` span of that trace.
    pub(super) async fn sync_locked(
        &self,
        rec: &SandboxRecord,
        vm: &LiveVm,
        exclude: &[String],
        trace_id: Option<&str>,
    ) -> Result<api::SyncReport, ServiceError> {
        let mut span = trace_id.map(|t| self.telemetry.traces.span(t, "workspace.sync"));
        let res = self.sync_unobserved(rec, vm, exclude).await;
        match &res {
            Ok(r) => {
                crate::telemetry::metrics::record_sync(r.bytes_sent, r.files_sent);
                if let Some(s) = &mut span {
                    s.attr("files", r.files_sent);
                    s.attr("bytes", r.bytes_sent);
                    s.attr("deleted", r.deleted);
                    let via = serde_json::to_value(r.via).unwrap_or_default();
                    s.attr("via", via.as_str().unwrap_or("?"));
                }
            }
            Err(e) => {
                crate::telemetry::metrics::error(crate::telemetry::metrics::ErrorKind::SyncFailed);
                if let Some(s) = &mut span {
                    s.attr("error", e);
                }
            }
        }
        res
    }

    async fn sync_unobserved(
        &self,
        rec: &SandboxRecord,
        vm: &LiveVm,
        exclude: &[String],
    ) -> Result<api::SyncReport, ServiceError> {
        let started = Instant::now();
        let root = Self::host_root(rec)?;
        let skip = Skip::new(exclude).map_err(|e| ServiceError::BadRequest(e.to_string()))?;
        let rules = self.rules(rec)?.with_exclude(exclude)?;
        let base = Base::new(rec.dir.join("workspace"));
        let (r2, b2, cache) = (root.clone(), base.clone(), self.manifests.clone());
        let (scan, old, candidates, load_ms) = blocking(move || {
            let scan = rules::scan(&r2, &rules)?;
            let t = Instant::now();
            let old = cache.load(&b2)?;
            let load_ms = t.elapsed().as_millis() as u64;
            let c = sync::overwrite_candidates(&scan, &old);
            Ok((scan, old, c, load_ms))
        })
        .await?;
        let scan_ms = started.elapsed().as_millis() as u64;
        let vm_changed = self.vm_changed(&rec.api.id, vm, &old, candidates).await?;
        let r2 = root.clone();
        let first = old.entries.is_empty();
        let max_sync = self.config.sync.max_sync_mib.saturating_mul(1024 * 1024);
        let values = self.secret_store.scanner();
        let (mut delta, secrets) = blocking(move || {
            let d = sync::compute_keeping(&r2, &scan, &old, &vm_changed, &skip, max_sync, &values)?;
            Ok((d, scan.secrets_skipped))
        })
        .await?;
        let compute_ms = started.elapsed().as_millis() as u64;
        let archive = Arc::new(std::mem::take(&mut delta.archive));
        // The archive goes into the sync base's packs while it goes to the VM (both only read
        // it); the manifest that names the pack is saved only once the VM has it all.
        let pack = delta.changed.then(|| {
            let (b2, a2, idx) = (
                base.clone(),
                archive.clone(),
                std::mem::take(&mut delta.pack_index),
            );
            tokio::task::spawn_blocking(move || b2.put_pack(&a2, &idx))
        });
        let sent = self.send_delta(vm, &delta, &archive, first).await;
        let packed = match pack {
            Some(t) => Some(
                t.await
                    .map_err(|e| ServiceError::Internal(format!("workspace task failed: {e}")))?,
            ),
            None => None,
        };
        let via = match sent {
            Ok(via) => via,
            Err(e) => {
                // Nothing names this pack: take it away again.
                if let Some(Ok(files)) = packed {
                    for f in files {
                        let _ = crate::safefs::remove_under(&rec.dir, &f);
                    }
                }
                return Err(e);
            }
        };
        if let Some(p) = packed {
            p?;
        }
        let send_ms = started.elapsed().as_millis() as u64;
        if delta.changed {
            let (b2, m) = (base.clone(), std::mem::take(&mut delta.manifest));
            let cache = self.manifests.clone();
            blocking(move || cache.save(&b2, Arc::new(m))).await?;
        }
        let save_ms = started.elapsed().as_millis() as u64;
        let report = api::SyncReport {
            files_sent: delta.files_sent,
            bytes_sent: delta.bytes_sent,
            deleted: delta.delete.len() as u64,
            unchanged: delta.unchanged,
            secrets_skipped: secrets,
            secret_values_skipped: delta
                .secret_values_skipped
                .iter()
                .map(|(path, secret)| api::SecretValueSkipped {
                    path: path.clone(),
                    secret: secret.clone(),
                })
                .collect(),
            kept_vm_changes: delta.kept_vm_changes.clone(),
            via,
            duration_ms: started.elapsed().as_millis() as u64,
        };
        for s in &report.secret_values_skipped {
            tracing::warn!(sandbox = %rec.api.id, path = %s.path, secret = %s.secret,
                "not synced: the file holds a stored secret's value");
        }
        tracing::info!(sandbox = %rec.api.id, files = report.files_sent, bytes = report.bytes_sent,
            deleted = report.deleted, scan_ms, load_ms, compute_ms, send_ms, save_ms, via = ?report.via, ms = report.duration_ms, "workspace synced");
        Ok(report)
    }

    /// Send what `compute` found to the VM: the base disk for a first big sync, else deletes
    /// and the archive over the channel or the transfer disk. Returns how it went in.
    async fn send_delta(
        &self,
        vm: &LiveVm,
        delta: &sync::Delta,
        archive: &Arc<Vec<u8>>,
        first: bool,
    ) -> Result<api::SyncVia, ServiceError> {
        let mut via = api::SyncVia::Nothing;
        // What is sent lands on the data root (the base disk image, or the VM's disk overlay
        // growing as the guest writes it): a sync that cannot fit is refused before it starts
        // (a VM whose overlay hits a full disk would stop on the I/O error).
        if delta.entries > 0 {
            let what = format!("the sync of {}", vm.info.id);
            self.ensure_room_for(&vm.info.dir, &what, archive.len() as u64)?;
        }
        // The first big sync: an ext4 image of the tree on the base disk, mounted by the guest.
        if first
            && delta.delete.is_empty()
            && archive.len() as u64 >= DISK_TRANSFER_MIN
            && self.sync_via_base(vm, archive.clone()).await?
        {
            via = api::SyncVia::BaseDisk;
        } else if delta.entries > 0 || !delta.delete.is_empty() {
            // A request frame is at most 1 MiB: long delete lists go in batches first.
            let mut batches = delete_batches(&delta.delete);
            let last = batches.pop().unwrap_or_default();
            let empty = tar::Builder::new(Vec::new())
                .into_inner()
                .map_err(|e| ServiceError::Internal(e.to_string()))?;
            for b in batches {
                vm.agent
                    .untar(GUEST_ROOT, b, &empty)
                    .await
                    .map_err(agent_err)?;
            }
            let via_disk = archive.len() as u64 >= DISK_TRANSFER_MIN
                && self
                    .untar_via_disk(vm, last.clone(), archive.clone())
                    .await?;
            if !via_disk {
                vm.agent
                    .untar(GUEST_ROOT, last, archive)
                    .await
                    .map_err(agent_err)?;
            }
            if delta.entries > 0 {
                via = if via_disk {
                    api::SyncVia::TransferDisk
                } else {
                    api::SyncVia::Channel
                };
            }
        }
        Ok(via)
    }

    /// The VM's workspace tree (without `.git`), as `Walk` gives it, from the agent's
    /// inotify-kept walk: only what changed since the last call crosses the channel. The
    /// files the agent did not state (still the base disk's) get their stat from `manifest`;
    /// one it has no record of (never expected) has the agent walk again, stating everything.
    async fn vm_walk(
        &self,
        sandbox: &str,
        vm: &LiveVm,
        manifest: &Manifest,
    ) -> Result<Vec<WalkEntry>, ServiceError> {
        match self.vm_walk_once(sandbox, vm, manifest, false).await? {
            Ok(walk) => Ok(walk),
            Err(path) => {
                tracing::warn!(
                    sandbox,
                    path,
                    "an unstated base-disk file has no record: walking again, stating everything"
                );
                self.forget_walk(sandbox);
                self.vm_walk_once(sandbox, vm, manifest, true)
                    .await?
                    .map_err(|p| {
                        ServiceError::Internal(format!(
                            "the agent sent `{p}` unstated in a walk that states everything"
                        ))
                    })
            }
        }
    }

    /// One `WalkSince`, merged into the sandbox's mirror with the unstated entries filled in
    /// from `manifest` as they arrive (so a later diff pays nothing for them); `Ok(Err(path))`
    /// when one has no record (the mirror is left as it was).
    async fn vm_walk_once(
        &self,
        sandbox: &str,
        vm: &LiveVm,
        manifest: &Manifest,
        stat_all: bool,
    ) -> Result<Result<Vec<WalkEntry>, String>, ServiceError> {
        let skip = [".git".to_owned()];
        let since = {
            let m = self.walks.0.lock().unwrap_or_else(|p| p.into_inner());
            m.get(sandbox)
                .filter(|w| w.vm_pid == vm.info.pid)
                .map(|w| w.cursor)
        };
        let mut d = vm
            .agent
            .walk_since(GUEST_ROOT, &skip, since, stat_all)
            .await
            .map_err(agent_err)?;
        if let Err(path) = diff::fill_base(&mut d.entries, manifest) {
            return Ok(Err(path));
        }
        let mut m = self.walks.0.lock().unwrap_or_else(|p| p.into_inner());
        let w = m.entry(sandbox.to_owned()).or_insert_with(|| WalkMirror {
            vm_pid: vm.info.pid,
            cursor: d.cursor,
            entries: BTreeMap::new(),
        });
        if d.full || w.vm_pid != vm.info.pid || since.is_none() {
            w.entries.clear();
        }
        for r in &d.removed {
            w.entries.remove(r);
        }
        let (n_changed, full) = (d.entries.len(), d.full);
        for e in d.entries {
            w.entries.insert(e.path.clone(), e);
        }
        w.vm_pid = vm.info.pid;
        w.cursor = d.cursor;
        tracing::debug!(
            sandbox,
            full,
            changed = n_changed,
            removed = d.removed.len(),
            "workspace walk"
        );
        Ok(Ok(w.entries.values().cloned().collect()))
    }

    /// Forget the walk copy of a sandbox (removed, restored).
    pub(super) fn forget_walk(&self, sandbox: &str) {
        let mut m = self.walks.0.lock().unwrap_or_else(|p| p.into_inner());
        m.remove(sandbox);
    }

    /// Unpack `archive` in the VM through its transfer disk: write it at the start of the disk's
    /// file, then have the agent read it from the device. `Ok(false)` when the VM has no
    /// transfer disk (booted by an older version) or the archive does not fit: use the channel.
    async fn untar_via_disk(
        &self,
        vm: &LiveVm,
        delete: Vec<String>,
        archive: Arc<Vec<u8>>,
    ) -> Result<bool, ServiceError> {
        let path = vm.info.dir.join(crate::vmm::TRANSFER_DISK_FILE);
        let len = archive.len() as u64;
        if len > crate::vmm::TRANSFER_DISK_BYTES || !path.is_file() {
            return Ok(false);
        }
        let p2 = path.clone();
        blocking(move || {
            use std::os::unix::fs::FileExt;
            // No fsync: QEMU reads the file through the same page cache.
            let f = std::fs::OpenOptions::new()
                .write(true)
                .open(&p2)
                .map_err(WorkspaceError::io("open the transfer disk", &p2))?;
            f.write_all_at(&archive, 0)
                .map_err(WorkspaceError::io("write the transfer disk", &p2))
        })
        .await?;
        match vm
            .agent
            .untar_disk(GUEST_ROOT, delete, crate::vmm::TRANSFER_DISK_SERIAL, len)
            .await
        {
            Ok(()) => Ok(true),
            // No such device in this VM: the channel still works.
            Err(RpcError::Remote(r)) if r.kind == crate::rpc::msg::ErrorKind::NotFound => {
                tracing::warn!(sandbox = %vm.info.id, error = %r, "no transfer disk in the VM; syncing over the channel");
                Ok(false)
            }
            Err(e) => Err(agent_err(e)),
        }
    }

    /// Put the first sync's `archive` into the VM through its workspace base disk: build an
    /// ext4 image of it in the disk (`workspace::basedisk`: `mke2fs` reads the archive itself
    /// where it can, else the archive staged in a temporary directory), then have the agent
    /// mount it under an overlayfs on the workspace.
    /// `Ok(false)` (with a log line saying why) when that cannot be done: the disk is missing or
    /// already written (an older VM, a fork child), e2fsprogs is missing or failed, or the agent
    /// refused (the workspace is not empty): the caller sends the archive as usual.
    async fn sync_via_base(
        &self,
        vm: &LiveVm,
        archive: Arc<Vec<u8>>,
    ) -> Result<bool, ServiceError> {
        let img = vm.info.dir.join(crate::vmm::WORKSPACE_DISK_FILE);
        if !basedisk::is_blank(&img) {
            tracing::info!(sandbox = %vm.info.id, "no blank workspace base disk; first sync by archive");
            return Ok(false);
        }
        let t0 = Instant::now();
        let dir = vm.info.dir.clone();
        let built = tokio::task::spawn_blocking(move || {
            // mke2fs reads the archive itself where it can; else the archive is staged.
            if basedisk::reads_tar() {
                match basedisk::build_from_tar(&archive, &img, &dir) {
                    Ok(()) => return Ok(None),
                    Err(e) => {
                        tracing::warn!(error = %e, "mke2fs could not read the sync archive; staging it instead from now on");
                    }
                }
            }
            let parent = basedisk::staging_parent(archive.len() as u64, &dir);
            let staging = tempfile::Builder::new()
                .prefix(".tryboxi-wsbase-staging")
                .tempdir_in(&parent)
                .map_err(|e| WorkspaceError::io("create a staging directory in", &parent)(e))?;
            let res = (|| {
                basedisk::stage(&archive, staging.path())?;
                let staged_ms = t0.elapsed().as_millis() as u64;
                basedisk::build(staging.path(), &img)?;
                Ok::<_, basedisk::BaseDiskError>(Some(staged_ms))
            })();
            // Removing 10,000 staged files takes tens of ms: not on the sync's path.
            std::thread::spawn(move || drop(staging));
            res
        })
        .await
        .map_err(|e| ServiceError::Internal(format!("workspace task failed: {e}")))?;
        let staged_ms = match built {
            Ok(ms) => ms,
            Err(e) => {
                tracing::warn!(sandbox = %vm.info.id, error = %e, "cannot build the workspace base disk; first sync by archive");
                return Ok(false);
            }
        };
        let built_ms = t0.elapsed().as_millis() as u64;
        match vm
            .agent
            .mount_base(GUEST_ROOT, crate::vmm::WORKSPACE_DISK_SERIAL)
            .await
        {
            Ok(()) => {
                tracing::info!(sandbox = %vm.info.id, staged_ms = ?staged_ms, built_ms, ms = t0.elapsed().as_millis() as u64, "workspace base disk mounted");
                Ok(true)
            }
            Err(RpcError::Remote(r)) => {
                tracing::warn!(sandbox = %vm.info.id, error = %r, "the agent did not mount the workspace base disk; first sync by archive");
                Ok(false)
            }
            Err(e) => Err(agent_err(e)),
        }
    }

    /// Which of `paths` (files of the base) the VM changed since the base, by stat: one `Stat`
    /// each for a few, one `Walk` for many.
    async fn vm_changed(
        &self,
        sandbox: &str,
        vm: &LiveVm,
        manifest: &Manifest,
        paths: Vec<String>,
    ) -> Result<HashSet<String>, ServiceError> {
        let mut out = HashSet::new();
        if paths.is_empty() {
            return Ok(out);
        }
        // `nsec` is unknown from a `Stat` (seconds only).
        let differs = |rel: &str, size: u64, mode: u32, mtime: i64, nsec: Option<u32>| {
            manifest.entries.get(rel).is_some_and(|b| {
                b.guest_size != size
                    || b.mode != mode
                    || b.guest_mtime != mtime
                    || nsec.is_some_and(|n| n != b.guest_nsec)
            })
        };
        if paths.len() > 32 {
            let walk = self.vm_walk(sandbox, vm, manifest).await?;
            let want: HashSet<&String> = paths.iter().collect();
            for w in walk {
                if want.contains(&w.path)
                    && (w.kind != FileKind::File
                        || differs(&w.path, w.size, w.mode, w.mtime, Some(w.mtime_nsec)))
                {
                    out.insert(w.path);
                }
            }
            return Ok(out);
        }
        for p in paths {
            match vm.agent.stat(&guest_path(&p)).await {
                Ok(st) => {
                    if st.kind != FileKind::File || differs(&p, st.size, st.mode, st.mtime, None) {
                        out.insert(p);
                    }
                }
                // Deleted in the VM: the host's new version simply goes in.
                Err(RpcError::Remote(_)) => {}
                Err(e) => return Err(agent_err(e)),
            }
        }
        Ok(out)
    }

    /// Sync before an exec (takes the workspace lock); `exclude` as in [`Self::sync_locked`].
    /// The sync before exec `exec_id` (a span of its trace).
    pub(super) async fn sync_before_exec(
        &self,
        rec: &SandboxRecord,
        vm: &LiveVm,
        exclude: &[String],
        exec_id: &str,
    ) -> Result<(), ServiceError> {
        // Nothing on the host to bring in: the command runs on the VM as it is.
        if rec.api.workspace.is_none() {
            return Ok(());
        }
        let lock = self.ws_lock(&rec.api.id);
        let _g = lock.lock().await;
        self.sync_locked(rec, vm, exclude, Some(exec_id))
            .await
            .map(|_| ())
    }

    pub(super) async fn changes(
        &self,
        rec: &SandboxRecord,
        vm: &LiveVm,
        paths: &[String],
    ) -> Result<Changes, ServiceError> {
        let rules = self.rules(rec)?;
        let base = Base::new(rec.dir.join("workspace"));
        let (b2, cache) = (base.clone(), self.manifests.clone());
        let manifest = blocking(move || cache.load(&b2)).await?;
        let t0 = Instant::now();
        let walk = self.vm_walk(&rec.api.id, vm, &manifest).await?;
        let t_walk = t0.elapsed().as_millis() as u64;
        let (m2, b2, paths) = (manifest.clone(), base.clone(), paths.to_vec());
        let (dir, budget) = (rec.dir.clone(), self.max_diff_bytes());
        // One trip to a blocking thread for the CPU work and the spill's setup (file IO).
        let (mut s, spill) = blocking(move || {
            let ignores = Ignores::from_base(&m2, |p| {
                m2.entries.get(p).and_then(|e| b2.blob(&e.sha256).ok())
            });
            let s = diff::suspects(&m2, &walk, &rules, &ignores, &paths);
            Ok((s, Spill::new(&dir, budget)?))
        })
        .await?;
        let spill = Arc::new(spill);
        let max = self.max_file_bytes();
        let too_big = diff::take_too_big(&mut s, max);
        let wanted: Vec<(String, u64)> = s
            .changed
            .iter()
            .filter(|w| w.kind == FileKind::File && w.size <= max)
            .map(|w| (w.path.clone(), w.size))
            .collect();
        let announced = wanted.iter().fold(0u64, |t, w| t.saturating_add(w.1));
        spill.check_announced(announced)?;
        let contents = fetch::into_spill(&vm.agent, &spill, wanted, max).await?;
        tracing::debug!(sandbox = %rec.api.id, files = contents.len(), bytes = spill.used(), walk_ms = t_walk, ms = t0.elapsed().as_millis() as u64, "fetched the VM's changed files");
        let special = s.special.clone();
        let refused = s.refused.clone();
        // Classifying is hashing-map work over the suspects: a few are done here, many (a
        // rename of thousands of files) on a blocking thread.
        let changes = if s.changed.len() + s.deleted.len() <= INLINE_CLASSIFY {
            diff::classify(&manifest, s, contents)
        } else {
            let m2 = manifest.clone();
            blocking(move || Ok(diff::classify(&m2, s, contents))).await?
        };
        Ok(Changes {
            base,
            manifest,
            changes,
            special,
            refused,
            too_big,
            _spill: spill,
        })
    }

    /// `GET /v1/sandboxes/{id}/diff`.
    pub async fn diff(
        &self,
        id: &str,
        stat: bool,
        paths: Vec<String>,
    ) -> Result<api::DiffReport, ServiceError> {
        self.needs_workspace(id)?;
        let (_life, rec, vm) = self.ready_vm(id).await?;
        let lock = self.ws_lock(id);
        let _g = lock.lock().await;
        let t = Instant::now();
        let ch = self.changes(&rec, &vm, &paths).await?;
        let changes_ms = t.elapsed().as_millis() as u64;
        let mut refused: Vec<String> = ch.refused().collect();
        let root = PathBuf::from(&Self::workspace_of(&rec)?.host_path);
        let (files, links) = blocking(move || {
            let links = apply::link_refusals(&root, &ch.changes);
            Ok((diff::report(&ch.base, &ch.changes, stat)?, links))
        })
        .await?;
        refused.extend(links);
        tracing::info!(sandbox = %id, files = files.len(), changes_ms, ms = t.elapsed().as_millis() as u64, "diff done");
        Ok(api::DiffReport {
            files,
            too_big: ch.too_big,
            refused,
        })
    }
}

/// Split a delete list into batches of at most ~256 KiB of path text.
fn delete_batches(paths: &[String]) -> Vec<Vec<String>> {
    let mut out = vec![Vec::new()];
    let mut size = 0usize;
    for p in paths {
        if size + p.len() > 256 * 1024 {
            out.push(Vec::new());
            size = 0;
        }
        size += p.len() + 8;
        if let Some(last) = out.last_mut() {
            last.push(p.clone());
        }
    }
    out
}
