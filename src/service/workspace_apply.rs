//! Bringing a sandbox's changes back to the host: apply (everything or some paths), pull
//! (chosen files, `force` to overwrite host edits), and undo of either (`within` limits an
//! undo to the caller's folders).
//!
//! Owns the order of operations under the workspace lock (diff, fetch, three-way decisions,
//! backup, write) and the artifact records; the file logic lives in `crate::workspace`.

use std::sync::Arc;

use super::workspace::blocking;
use super::{Service, ServiceError};
use crate::api;
use crate::ids;
use crate::store::ARTIFACTS;
use crate::workspace::WorkspaceError;
use crate::workspace::apply::{self, Mode};
use crate::workspace::backup::{self, ArtifactRecord, ArtifactState};
use crate::workspace::diff;
use crate::workspace::manifest::{Entry, Kind};
use crate::workspace::rules;

impl Service {
    /// `POST /v1/sandboxes/{id}/apply`.
    pub async fn apply(
        &self,
        id: &str,
        req: api::ApplyRequest,
    ) -> Result<api::ApplyReport, ServiceError> {
        self.bring_back(id, req.paths, Mode::Apply, "apply").await
    }

    /// `POST /v1/sandboxes/{id}/pull`.
    pub async fn pull(
        &self,
        id: &str,
        req: api::ApplyRequest,
    ) -> Result<api::ApplyReport, ServiceError> {
        if req.paths.is_empty() {
            return Err(ServiceError::BadRequest(
                "pull needs at least one path (use apply to bring everything)".into(),
            ));
        }
        self.bring_back(id, req.paths, Mode::Pull { force: req.force }, "pull")
            .await
    }

    async fn bring_back(
        &self,
        id: &str,
        paths: Vec<String>,
        mode: Mode,
        kind: &str,
    ) -> Result<api::ApplyReport, ServiceError> {
        self.needs_workspace(id)?;
        let mut refused_early = Vec::new();
        let mut ok_paths = Vec::new();
        for p in &paths {
            match apply::check_path(p.trim_end_matches('/')) {
                Ok(()) => ok_paths.push(p.trim_end_matches('/').to_owned()),
                Err(why) => refused_early.push(format!("{p}: {why}")),
            }
        }
        if !paths.is_empty() && ok_paths.is_empty() {
            return Err(ServiceError::BadRequest(format!(
                "nothing to {kind}: {}",
                refused_early.join("; ")
            )));
        }
        let (_life, rec, vm) = self.ready_vm(id).await?;
        let root = Self::host_root(&rec)?;
        let lock = self.ws_lock(id);
        let _g = lock.lock().await;
        let ch = self.changes(&rec, &vm, &ok_paths).await?;
        let rules = self.rules(&rec)?;
        let ch_refused: Vec<String> = ch.refused().collect();
        let opts = apply::PlanOpts {
            mode,
            max_bytes: self.max_file_bytes(),
            umask: apply::process_umask(),
        };
        let (r2, b2, tb) = (root.clone(), ch.base.clone(), ch.too_big.clone());
        let mut changes = ch.changes;
        let plan = blocking(move || {
            diff::load_contents(&mut changes)?;
            apply::plan(&r2, &b2, changes, &rules, opts, &tb)
        })
        .await?;
        let mut report = api::ApplyReport {
            artifact_id: None,
            applied: plan.applied.clone(),
            conflicts: plan.conflicts.clone(),
            refused: refused_early,
            too_big: ch.too_big,
        };
        report.too_big.extend(plan.too_big.iter().cloned());
        report.refused.extend(plan.refused.iter().cloned());
        report.refused.extend(ch_refused);
        if !plan.ops.is_empty() {
            // The backup's size is known (the host files it copies): refused up front when it
            // cannot fit, with the host repo untouched.
            let need: u64 = (plan.ops.iter())
                .filter_map(|op| std::fs::symlink_metadata(root.join(&op.path)).ok())
                .filter(|m| m.is_file())
                .map(|m| m.len())
                .sum();
            let what = format!("the backup of this {kind}");
            self.ensure_room_for(&self.paths.artifacts_dir(), &what, need)?;
            let art_id = ids::new_id(ids::ARTIFACT);
            let dir = self.paths.artifacts_dir().join(&art_id);
            let rec0 = ArtifactRecord {
                id: art_id.clone(),
                sandbox_id: id.to_owned(),
                kind: kind.to_owned(),
                created_at: super::now_rfc3339(),
                host_root: root.clone(),
                state: ArtifactState::Applying,
                entries: Vec::new(),
                overwritten_by_undo: Vec::new(),
            };
            let store = self.store.clone();
            let ops = plan.ops.clone();
            let r2 = root.clone();
            blocking(move || {
                backup::execute(&r2, &dir, rec0, &ops, &mut |r| {
                    store
                        .put(ARTIFACTS, &r.id, r)
                        .map_err(|e| WorkspaceError::Store(e.to_string()))
                })
            })
            .await?;
            tracing::info!(sandbox = %id, artifact = %art_id, files = plan.ops.len(), conflicts = plan.conflicts.len(), "{kind} done");
            report.artifact_id = Some(art_id);
        }
        // The VM's version becomes the base of what was taken.
        let (base, mut manifest) = (ch.base, Arc::unwrap_or_clone(ch.manifest));
        let updates = plan.base_updates;
        let cache = self.manifests.clone();
        blocking(move || {
            for (path, vm_item) in updates {
                let Some(v) = vm_item else {
                    manifest.entries.remove(&path);
                    continue;
                };
                let host = apply::host_state(&root, &path)?;
                let md = std::fs::symlink_metadata(root.join(&path)).ok();
                let (size, mtime_ns) = md
                    .as_ref()
                    .and_then(|m| rules::HostEntry::from_metadata(m, None))
                    .map(|h| (h.size, h.mtime_ns))
                    .unwrap_or((0, 0));
                let mut e = match v.kind {
                    Kind::File => {
                        let sha = base.put_blob(&v.content)?;
                        let mut e = Entry::file(v.mode, size, mtime_ns, sha);
                        // The host holds something else (a merge): make the next sync look.
                        if !matches!(&host, apply::HostState::File { content, .. } if *content == v.content) {
                            e.mtime_ns = i64::MIN;
                        }
                        e
                    }
                    _ => Entry {
                        kind: Kind::Symlink,
                        mode: v.mode,
                        size,
                        mtime_ns,
                        sha256: String::new(),
                        link: v.link.clone(),
                        guest_size: 0,
                        guest_mtime: 0,
                        guest_nsec: 0,
                    },
                };
                e.guest_size = v.walk.size;
                e.guest_mtime = v.walk.mtime;
                e.guest_nsec = v.walk.mtime_nsec;
                manifest.entries.insert(path, e);
            }
            cache.save(&base, Arc::new(manifest))
        })
        .await?;
        Ok(report)
    }

    /// `POST /v1/artifacts/{art_id}/undo`: refused (409) when the host changed an applied path
    /// since, unless `force` (then what it overwrites is backed up first).
    pub async fn undo(
        &self,
        art_id: &str,
        req: api::UndoRequest,
    ) -> Result<api::UndoReport, ServiceError> {
        let rec: ArtifactRecord = self
            .store
            .get(ARTIFACTS, art_id)?
            .ok_or_else(|| WorkspaceError::NoArtifact(art_id.to_owned()))?;
        check_within(&rec.host_root, &req.within)?;
        let lock = self.ws_lock(&rec.sandbox_id);
        let _g = lock.lock().await;
        let dir = self.paths.artifacts_dir().join(art_id);
        let store = self.store.clone();
        let report = blocking(move || {
            backup::undo(&dir, rec, req.force, &mut |r| {
                store
                    .put(ARTIFACTS, &r.id, r)
                    .map_err(|e| WorkspaceError::Store(e.to_string()))
            })
        })
        .await?;
        tracing::info!(artifact = %art_id, restored = report.restored.len(), removed = report.removed.len(),
            overwritten = report.overwritten.len(), "undo done");
        Ok(report)
    }
}

/// Most folders an undo's `within` may name (each is resolved on the host).
const MAX_WITHIN: usize = 64;

/// An undo limited to `within` (see [`api::UndoRequest::within`]): the apply's host folder,
/// resolved, must be one of those folders (resolved) or below one. Empty: no limit.
fn check_within(host_root: &std::path::Path, within: &[String]) -> Result<(), ServiceError> {
    if within.is_empty() {
        return Ok(());
    }
    if within.len() > MAX_WITHIN || within.iter().any(|w| w.len() > 4096) {
        return Err(ServiceError::BadRequest(format!(
            "`within` takes at most {MAX_WITHIN} folders of at most 4096 bytes each"
        )));
    }
    let resolve = |p: &std::path::Path| p.canonicalize().unwrap_or_else(|_| p.to_path_buf());
    let root = resolve(host_root);
    let allowed: Vec<std::path::PathBuf> = within
        .iter()
        .map(|w| resolve(std::path::Path::new(w)))
        .filter(|w| w.is_absolute())
        .collect();
    if allowed.iter().any(|w| root.starts_with(w)) {
        return Ok(());
    }
    Err(ServiceError::Forbidden(format!(
        "this apply wrote to {}, outside the folders this client may change ({})",
        root.display(),
        allowed
            .iter()
            .map(|w| w.display().to_string())
            .collect::<Vec<_>>()
            .join(", ")
    )))
}

#[cfg(test)]
mod within_tests {
    use super::check_within;

    #[test]
    fn an_undo_outside_the_allowed_folders_is_refused() {
        let d = tempfile::tempdir().unwrap();
        let base = d.path().canonicalize().unwrap();
        for p in ["ws/sub", "other", "ws-evil"] {
            std::fs::create_dir_all(base.join(p)).unwrap();
        }
        std::os::unix::fs::symlink(base.join("other"), base.join("ws/link")).unwrap();
        let ws = base.join("ws").display().to_string();
        assert!(check_within(&base.join("other"), &[]).is_ok(), "no limit");
        assert!(check_within(&base.join("ws"), std::slice::from_ref(&ws)).is_ok());
        assert!(check_within(&base.join("ws/sub"), std::slice::from_ref(&ws)).is_ok());
        for bad in ["other", "ws-evil", "ws/link", "ws/.."] {
            let e = check_within(&base.join(bad), std::slice::from_ref(&ws)).unwrap_err();
            assert!(
                matches!(e, super::ServiceError::Forbidden(_)),
                "{bad}: {e:?}"
            );
        }
        // A relative `within` grants nothing.
        assert!(check_within(&base.join("ws"), &["ws".to_owned()]).is_err());
        // A hostile client's list is refused before anything is resolved.
        let many = vec![ws.clone(); 65];
        let e = check_within(&base.join("ws"), &many).unwrap_err();
        assert!(matches!(e, super::ServiceError::BadRequest(_)), "{e:?}");
        let long = format!("{ws}/{}", "a".repeat(5000));
        assert!(matches!(
            check_within(&base.join("ws"), &[long]),
            Err(super::ServiceError::BadRequest(_))
        ));
    }
}
