//! E2B snapshots: `create_snapshot()`, `Sandbox.create(snapshot_id)`, `Sandbox.list_snapshots()`
//! and `Sandbox.delete_snapshot()`, mapped onto our snapshots and fork-from-snapshot.
//!
//! E2B treats a snapshot as a template: new sandboxes start from it, and it outlives the
//! sandbox it was taken of. Ours live in their sandbox's directory, so the face's kill retires
//! a sandbox that still has snapshots (see `service/retire.rs`) instead of removing it, and a
//! sandbox made from a snapshot is a fork child of that snapshot. The face sees the snapshots
//! of the sandboxes it created, and those of retired ones (only the face retires).

use hyper::{Response, StatusCode};
use serde::Deserialize;
use serde_json::{Value, json};

use super::{E2bError, Face};
use crate::api::{self, SandboxState};
use crate::daemon::response::Body;

/// Most snapshots one list page returns (the SDK asks for 100 by default).
const MAX_PAGE: usize = 1000;

#[derive(Debug, Default, Deserialize)]
#[serde(default)]
pub(super) struct SnapshotBody {
    name: Option<String>,
    /// `false`: `create_snapshot(mode="filesystem")`, the disk alone.
    memory: Option<bool>,
}

/// `POST /sandboxes/{id}/snapshots` (the caller checked that the face owns `id`).
pub(super) async fn create(
    face: &Face,
    id: &str,
    b: SnapshotBody,
) -> Result<Response<Body>, E2bError> {
    let snap = face
        .svc
        .create_snapshot(
            id,
            api::SnapshotRequest {
                name: b.name,
                keep_memory: b.memory.unwrap_or(true),
            },
        )
        .await?;
    Ok(super::json(StatusCode::CREATED, &info(&snap)))
}

/// E2B's `SnapshotInfo`.
fn info(s: &api::Snapshot) -> Value {
    let names: Vec<&String> = s.name.iter().collect();
    json!({ "snapshotID": s.id, "names": names })
}

/// The snapshots the face may see, oldest first.
fn visible(face: &Face) -> Result<Vec<api::Snapshot>, E2bError> {
    let mut out = Vec::new();
    for (s, state) in face.svc.all_snapshots()? {
        if state == SandboxState::Retired || face.svc.e2b_get(&s.sandbox_id)?.is_some() {
            out.push(s);
        }
    }
    Ok(out)
}

/// The snapshot an E2B `templateID` names, if any: a snapshot id, or a name that exactly one
/// visible snapshot has (E2B's `team/` prefix and `:tag` suffix, as in `team/abc:default`,
/// are ignored: [`super::control::bare_name`]).
pub(super) fn resolve(face: &Face, template_id: &str) -> Result<Option<api::Snapshot>, E2bError> {
    let want = super::control::bare_name(template_id);
    let all = visible(face)?;
    if let Some(s) = all.iter().find(|s| s.id == want) {
        return Ok(Some(s.clone()));
    }
    let named: Vec<&api::Snapshot> = all
        .iter()
        .filter(|s| s.name.as_deref() == Some(want))
        .collect();
    match named.as_slice() {
        [one] => Ok(Some((*one).clone())),
        [] => Ok(None),
        many => Err(E2bError::new(
            StatusCode::BAD_REQUEST,
            format!(
                "{} snapshots are named `{want}`; use a snapshot id ({})",
                many.len(),
                many.iter()
                    .map(|s| s.id.as_str())
                    .collect::<Vec<_>>()
                    .join(", ")
            ),
        )),
    }
}

/// A new sandbox started from snapshot `s` (a fork child of it; its network policy and
/// secrets are those of the snapshot's sandbox).
pub(super) async fn start_from(face: &Face, s: &api::Snapshot) -> Result<api::Sandbox, E2bError> {
    let res = face
        .svc
        .fork_sandbox(
            &s.sandbox_id,
            api::ForkRequest {
                count: Some(1),
                snapshot: Some(s.id.clone()),
            },
        )
        .await?;
    res.sandboxes.into_iter().next().ok_or_else(|| {
        E2bError::new(
            StatusCode::INTERNAL_SERVER_ERROR,
            format!(
                "cannot start a sandbox from snapshot {}: {}",
                s.id,
                res.failed.join("; ")
            ),
        )
    })
}

/// `GET /snapshots?sandboxID=&name=&limit=&nextToken=`: a page of `SnapshotInfo`, oldest
/// first; the next page's token in `x-next-token`.
pub(super) fn list(face: &Face, query: &str) -> Result<Response<Body>, E2bError> {
    let (mut sandbox, mut name, mut after) = (None, None, None);
    let mut limit = 100;
    for (k, v) in form_urlencoded::parse(query.as_bytes()) {
        match k.as_ref() {
            "sandboxID" => sandbox = Some(v.into_owned()),
            "name" => name = Some(v.into_owned()),
            "nextToken" => after = Some(v.into_owned()),
            "limit" => {
                limit = v
                    .parse::<usize>()
                    .map_err(|_| {
                        E2bError::new(StatusCode::BAD_REQUEST, "`limit` must be a number")
                    })?
                    .clamp(1, MAX_PAGE)
            }
            _ => {}
        }
    }
    let key = |s: &api::Snapshot| format!("{}|{}", s.created_at, s.id);
    let mut page: Vec<api::Snapshot> = visible(face)?
        .into_iter()
        .filter(|s| sandbox.as_ref().is_none_or(|id| s.sandbox_id == *id))
        .filter(|s| {
            name.as_ref().is_none_or(|n| {
                let n = n.split(':').next().unwrap_or(n);
                s.id == n || s.name.as_deref() == Some(n)
            })
        })
        .filter(|s| after.as_ref().is_none_or(|a| key(s) > *a))
        .collect();
    let more = page.len() > limit;
    page.truncate(limit);
    let body: Vec<Value> = page.iter().map(info).collect();
    let mut resp = super::json(StatusCode::OK, &body);
    if more
        && let Some(last) = page.last()
        && let Ok(v) = hyper::header::HeaderValue::from_str(&key(last))
    {
        resp.headers_mut().insert("x-next-token", v);
    }
    Ok(resp)
}

/// `DELETE /templates/{id}` (`Sandbox.delete_snapshot`): 204, or 404 for an id that is no
/// snapshot the face sees. Our templates are not deleted this way (400).
pub(super) async fn delete(face: &Face, id: &str) -> Result<Response<Body>, E2bError> {
    // The SDKs percent-encode the segment (`encodeURIComponent`).
    let id = percent_encoding::percent_decode_str(id).decode_utf8_lossy();
    let want = id.split(':').next().unwrap_or(&id);
    match visible(face)?.into_iter().find(|s| s.id == want) {
        Some(s) => {
            face.svc.delete_snapshot(&s.sandbox_id, &s.id).await?;
            Ok(super::empty(StatusCode::NO_CONTENT))
        }
        None if face
            .svc
            .list_templates()?
            .templates
            .iter()
            .any(|t| t.name == want) =>
        {
            Err(E2bError::new(
                StatusCode::BAD_REQUEST,
                format!(
                    "`{want}` is a tryboxi template; templates are managed with `tryboxi template`"
                ),
            ))
        }
        None => Err(E2bError::new(
            StatusCode::NOT_FOUND,
            format!("snapshot {want} not found"),
        )),
    }
}
