//! Garbage collection (`tryboxi gc [--dry-run]`, `POST /v1/gc`): orphaned VM directories, old
//! snapshots by policy, stale golden snapshots, and apply/pull backups past retention.
//!
//! Owns: the plan (a pure function of what is on disk and in the store, unit tested) and its
//! execution: every deletion through `safefs::remove_under` under the data root, one
//! `gc.deleted` event each. A dry run lists exactly the plan, with sizes, and deletes nothing.
//! Never: deletes a directory younger than [`GRACE_S`] (a create in flight makes its directory
//! before its record), a sandbox's live disk chain, the newest backup of an existing sandbox (its
//! undo), or golden snapshots when the current images cannot be read (staleness is unknown then).
//! QEMU processes are killed only when an orphaned directory's `vm.json` proves they are ours
//! (the driver's pidfd + cmdline check), never by name.

use std::collections::{HashMap, HashSet};
use std::path::{Path, PathBuf};

use sha2::{Digest, Sha256};

use super::snapshots::SnapshotRecord;
use super::{SandboxRecord, Service, ServiceError};
use crate::api::{self, GcItem, GcReport};
use crate::config::GcConfig;
use crate::store::{ARTIFACTS, SANDBOXES, SNAPSHOTS};
use crate::vmm::image_sets::{self, Pruned};
use crate::workspace::backup::ArtifactRecord;

/// Directories younger than this (seconds, by mtime) are never collected.
pub const GRACE_S: u64 = 60;
const DAY: u64 = 86_400;

/// The key of a golden snapshot made from these images and this template's disk: golden
/// snapshots live in `<data root>/golden/<name>/` where `<name>` contains this key; any other
/// name is stale (made from images that are no longer installed).
pub fn golden_key(kernel_sha: &str, initramfs_sha: &str, rootfs_sha: &str) -> String {
    let mut h = Sha256::new();
    for part in ["golden-1", kernel_sha, initramfs_sha, rootfs_sha] {
        h.update(part.as_bytes());
        h.update([0]);
    }
    hex::encode(&h.finalize()[..8])
}

/// A directory entry as the planner sees it.
#[derive(Debug, Clone)]
pub struct DirInfo {
    pub path: PathBuf,
    pub name: String,
    pub age_s: u64,
}

#[derive(Debug, Clone)]
pub struct SnapInfo {
    pub id: String,
    pub sandbox_id: String,
    pub age_s: u64,
    pub dir: PathBuf,
}

#[derive(Debug, Clone)]
pub struct BackupInfo {
    pub dir: DirInfo,
    /// From the store's record (`None`: no record anywhere).
    pub sandbox_id: Option<String>,
    pub age_s: u64,
}

/// Everything the planner needs.
#[derive(Debug, Clone, Default)]
pub struct Inputs {
    pub vm_dirs: Vec<DirInfo>,
    /// Directories that belong to a sandbox record.
    pub known_dirs: HashSet<PathBuf>,
    pub sandboxes: HashSet<String>,
    pub snapshots: Vec<SnapInfo>,
    pub golden: Vec<DirInfo>,
    /// `None`: the images cannot be read; golden snapshots are left alone.
    pub golden_keys: Option<Vec<String>>,
    pub backups: Vec<BackupInfo>,
}

/// One planned deletion.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Planned {
    pub kind: &'static str,
    pub path: PathBuf,
    pub reason: String,
    /// The store record that goes with it (`snapshots`/`artifacts` key).
    pub record: Option<String>,
}

pub fn plan(i: &Inputs, cfg: &GcConfig) -> Vec<Planned> {
    let mut out = Vec::new();
    for d in &i.vm_dirs {
        if !i.known_dirs.contains(&d.path) && d.age_s >= GRACE_S {
            out.push(Planned {
                kind: "orphan_vm_dir",
                path: d.path.clone(),
                reason: "no sandbox record owns this directory".into(),
                record: None,
            });
        }
    }
    let mut by_sandbox: HashMap<&str, Vec<&SnapInfo>> = HashMap::new();
    for s in &i.snapshots {
        by_sandbox.entry(&s.sandbox_id).or_default().push(s);
    }
    let mut sandboxes: Vec<_> = by_sandbox.into_iter().collect();
    sandboxes.sort_by_key(|(k, _)| *k);
    for (_, mut snaps) in sandboxes {
        // Newest first.
        snaps.sort_by(|a, b| a.age_s.cmp(&b.age_s).then(a.id.cmp(&b.id)));
        for (n, s) in snaps.iter().enumerate() {
            let reason = if cfg.keep_snapshots_per_sandbox > 0
                && n >= cfg.keep_snapshots_per_sandbox
            {
                format!(
                    "older than the newest {} of its sandbox (gc.keep_snapshots_per_sandbox)",
                    cfg.keep_snapshots_per_sandbox
                )
            } else if cfg.snapshot_max_age_days > 0 && s.age_s > cfg.snapshot_max_age_days * DAY {
                format!(
                    "older than {} days (gc.snapshot_max_age_days)",
                    cfg.snapshot_max_age_days
                )
            } else {
                continue;
            };
            out.push(Planned {
                kind: "snapshot",
                path: s.dir.clone(),
                reason,
                record: Some(s.id.clone()),
            });
        }
    }
    if let Some(keys) = &i.golden_keys {
        for g in &i.golden {
            if g.age_s >= GRACE_S && !keys.iter().any(|k| g.name.contains(k.as_str())) {
                out.push(Planned {
                    kind: "golden",
                    path: g.path.clone(),
                    reason: "made from images that are no longer installed".into(),
                    record: None,
                });
            }
        }
    }
    // The newest backup of each existing sandbox is its undo: kept whatever its age.
    let mut newest: HashMap<&str, (u64, &Path)> = HashMap::new();
    for b in &i.backups {
        if let Some(s) = &b.sandbox_id
            && i.sandboxes.contains(s)
        {
            let e = newest.entry(s.as_str()).or_insert((b.age_s, &b.dir.path));
            if b.age_s < e.0 {
                *e = (b.age_s, &b.dir.path);
            }
        }
    }
    let kept: HashSet<&Path> = newest.values().map(|(_, p)| *p).collect();
    let limit = cfg.backup_retention_days * DAY;
    for b in &i.backups {
        if kept.contains(b.dir.path.as_path()) || b.dir.age_s < GRACE_S {
            continue;
        }
        let reason = match &b.sandbox_id {
            None => "no record of this backup".to_owned(),
            Some(_) if cfg.backup_retention_days > 0 && b.age_s > limit => format!(
                "older than {} days (gc.backup_retention_days)",
                cfg.backup_retention_days
            ),
            Some(_) => continue,
        };
        out.push(Planned {
            kind: "backup",
            path: b.dir.path.clone(),
            reason,
            record: b.sandbox_id.as_ref().map(|_| b.dir.name.clone()),
        });
    }
    out
}

/// Seconds since the epoch of `2026-12-02T10:00:00Z` (the format `now_rfc3339` writes).
pub fn parse_rfc3339(s: &str) -> Option<u64> {
    let b = s.as_bytes();
    if b.len() < 20 || b[4] != b'-' || b[10] != b'T' {
        return None;
    }
    let n = |r: std::ops::Range<usize>| s.get(r)?.parse::<i64>().ok();
    let (y, m, d) = (n(0..4)?, n(5..7)?, n(8..10)?);
    let (hh, mm, ss) = (n(11..13)?, n(14..16)?, n(17..19)?);
    // Days from civil (H. Hinnant).
    let y2 = if m <= 2 { y - 1 } else { y };
    let era = y2.div_euclid(400);
    let yoe = y2 - era * 400;
    let mp = (m + 9) % 12;
    let doy = (153 * mp + 2) / 5 + d - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    let days = era * 146_097 + doe - 719_468;
    u64::try_from(days * DAY as i64 + hh * 3600 + mm * 60 + ss).ok()
}

fn now_s() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

fn age_of(created: &str, now: u64) -> u64 {
    parse_rfc3339(created).map_or(0, |t| now.saturating_sub(t))
}

/// Subdirectories of `dir` (missing `dir` = none), with their mtime age.
fn subdirs(dir: &Path, now: u64) -> Vec<DirInfo> {
    let Ok(rd) = std::fs::read_dir(dir) else {
        return Vec::new();
    };
    let mut out: Vec<DirInfo> = rd
        .flatten()
        .filter(|e| e.file_type().is_ok_and(|t| t.is_dir()))
        .map(|e| {
            let mtime = e
                .metadata()
                .ok()
                .and_then(|m| m.modified().ok())
                .and_then(|t| t.duration_since(std::time::UNIX_EPOCH).ok())
                .map_or(now, |d| d.as_secs());
            DirInfo {
                path: e.path(),
                name: e.file_name().to_string_lossy().into_owned(),
                age_s: now.saturating_sub(mtime),
            }
        })
        .collect();
    out.sort_by(|a, b| a.path.cmp(&b.path));
    out
}

/// Allocated bytes of a file or tree (like `du`; sparse files count what they use).
pub fn disk_usage(p: &Path) -> u64 {
    use std::os::unix::fs::MetadataExt;
    let Ok(m) = std::fs::symlink_metadata(p) else {
        return 0;
    };
    let mut n = m.blocks() * 512;
    if m.is_dir()
        && let Ok(rd) = std::fs::read_dir(p)
    {
        n += rd.flatten().map(|e| disk_usage(&e.path())).sum::<u64>();
    }
    n
}

impl Service {
    fn gc_inputs(&self) -> Result<Inputs, ServiceError> {
        let now = now_s();
        let recs: Vec<SandboxRecord> = self.store.list(SANDBOXES)?;
        let snaps: Vec<SnapshotRecord> = self.store.list(SNAPSHOTS)?;
        let arts: Vec<ArtifactRecord> = self.store.list(ARTIFACTS)?;
        let golden_keys = self.images().ok().map(|images| {
            let sha = |name: &str| {
                images
                    .manifest
                    .artifacts
                    .iter()
                    .find(|a| a.name == name)
                    .map(|a| a.sha256.clone())
                    .unwrap_or_default()
            };
            let (k, i) = (sha("kernel"), sha("initramfs"));
            images
                .manifest
                .artifacts
                .iter()
                .filter(|a| a.name == "rootfs" || a.name.starts_with("template."))
                .map(|a| golden_key(&k, &i, &a.sha256))
                .collect::<Vec<String>>()
        });
        let arts: HashMap<String, ArtifactRecord> =
            arts.into_iter().map(|a| (a.id.clone(), a)).collect();
        let backups = subdirs(&self.paths.artifacts_dir(), now)
            .into_iter()
            .filter(|d| d.name.starts_with(crate::ids::ARTIFACT))
            .map(|d| {
                let rec = arts.get(&d.name);
                BackupInfo {
                    sandbox_id: rec.map(|r| r.sandbox_id.clone()),
                    age_s: rec.map_or(d.age_s, |r| age_of(&r.created_at, now)),
                    dir: d,
                }
            })
            .collect();
        Ok(Inputs {
            vm_dirs: subdirs(&self.paths.sandboxes_dir(), now),
            known_dirs: recs.iter().map(|r| r.dir.clone()).collect(),
            sandboxes: recs.iter().map(|r| r.api.id.clone()).collect(),
            snapshots: snaps
                .iter()
                .map(|s| SnapInfo {
                    id: s.api.id.clone(),
                    sandbox_id: s.api.sandbox_id.clone(),
                    age_s: age_of(&s.api.created_at, now),
                    dir: s
                        .checkpoint
                        .state_file
                        .parent()
                        .map(Path::to_path_buf)
                        .unwrap_or_default(),
                })
                .collect(),
            golden: subdirs(&self.paths.golden_dir(), now),
            golden_keys,
            backups,
        })
    }

    /// `POST /v1/gc`.
    pub async fn gc(&self, req: api::GcRequest) -> Result<GcReport, ServiceError> {
        let planned = plan(&self.gc_inputs()?, &self.config.gc);
        let mut report = GcReport {
            dry_run: req.dry_run,
            ..Default::default()
        };
        for p in planned {
            let bytes = disk_usage(&p.path);
            let mut item = GcItem {
                kind: p.kind.to_owned(),
                path: p.path.display().to_string(),
                bytes,
                reason: p.reason,
                error: None,
            };
            if !req.dry_run {
                // A snapshot goes under its sandbox's lifecycle lock: never from under a
                // restore from it. A sandbox that is gone took its snapshots' files with it.
                let _life = match (p.kind, &p.record) {
                    ("snapshot", Some(snap)) => {
                        match self.store.get::<SnapshotRecord>(SNAPSHOTS, snap) {
                            Ok(Some(s)) => self.hold(&s.api.sandbox_id).await.ok().map(|(g, _)| g),
                            _ => None,
                        }
                    }
                    _ => None,
                };
                // A backup goes under its sandbox's workspace lock: never from under its undo.
                let ws = match (p.kind, &p.record) {
                    ("backup", Some(art)) => match self.store.get::<ArtifactRecord>(ARTIFACTS, art)
                    {
                        Ok(Some(a)) => Some(self.ws_lock(&a.sandbox_id)),
                        _ => None,
                    },
                    _ => None,
                };
                let _ws = match &ws {
                    Some(l) => Some(l.lock().await),
                    None => None,
                };
                if p.kind == "orphan_vm_dir" {
                    // Only a QEMU that this directory's vm.json proves is ours.
                    self.kill_leftover(&p.path).await;
                    self.forget_vm_dir(&p.path);
                }
                match crate::safefs::remove_under(&self.paths.root, &p.path) {
                    Ok(()) => {
                        match (p.kind, &p.record) {
                            ("snapshot", Some(id)) => {
                                let _ = self.store.delete(SNAPSHOTS, id);
                            }
                            ("backup", Some(id)) => {
                                let _ = self.store.delete(ARTIFACTS, id);
                            }
                            _ => {}
                        }
                        tracing::info!(kind = p.kind, path = %item.path, bytes, "gc deleted");
                        self.telemetry.events.publish(
                            "gc.deleted",
                            "",
                            None,
                            serde_json::json!({"kind": p.kind, "path": item.path, "bytes": bytes, "reason": item.reason}),
                        );
                    }
                    Err(e) => {
                        tracing::warn!(path = %item.path, error = %e, "gc cannot delete");
                        item.error = Some(e.to_string());
                    }
                }
            }
            if item.error.is_none() {
                report.bytes += bytes;
            }
            report.items.push(item);
        }
        // A retired sandbox whose last snapshot went is removed now.
        if !req.dry_run {
            self.reap_retired().await;
        }
        // Older installed image sets no layer uses any more (the data root's own images only,
        // not a build's `--artifacts` directory).
        if self.artifacts == self.paths.artifacts_dir() {
            for p in image_sets::prune(&self.paths.root, req.dry_run, disk_usage) {
                let (set, bytes, error) = match p {
                    Pruned::Removed { set, bytes } => (set, bytes, None),
                    Pruned::Failed { set, error } => (set, 0, Some(error)),
                    Pruned::Kept { .. } => continue,
                };
                if error.is_none() {
                    report.bytes += bytes;
                    if !req.dry_run {
                        tracing::info!(path = %set.display(), bytes, "gc deleted an older image set");
                    }
                }
                report.items.push(GcItem {
                    kind: "image_set".into(),
                    path: set.display().to_string(),
                    bytes,
                    reason: "guest images replaced by a newer install that no sandbox, snapshot \
                             or golden snapshot uses any more"
                        .into(),
                    error,
                });
            }
        }
        // Cgroups of QEMUs that are gone (a VM that ended while no daemon ran). Not a file
        // under the data root, so not an item: an empty cgroup holds nothing.
        if !req.dry_run
            && let Ok(d) = &self.vms.driver
        {
            d.jail().sweep();
        }
        Ok(report)
    }
}

#[cfg(test)]
#[path = "gc_tests.rs"]
mod tests;
