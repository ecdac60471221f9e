//! A sandbox created without a host workspace: every workspace operation is refused with
//! 409 `no_workspace` from its record alone (before any resume, lock or agent call), and
//! records written before the workspace became optional still load.

use super::*;
use crate::config::Config;

/// A `ready` record without a workspace (no VM behind it).
fn bare(svc: &Service, dir: &Path) -> String {
    let id = crate::ids::new_id(crate::ids::SANDBOX);
    let rec = SandboxRecord::creating(
        &id,
        dir.join("sandboxes").join(&id),
        None,
        "base".into(),
        (1, 256, crate::vmm::Accel::Tcg),
    );
    svc.store.put(crate::store::SANDBOXES, &id, &rec).unwrap();
    id
}

fn assert_no_workspace<T: std::fmt::Debug>(what: &str, id: &str, r: Result<T, ServiceError>) {
    let e = r.unwrap_err();
    assert!(matches!(e, ServiceError::NoWorkspace(_)), "{what}: {e:?}");
    assert_eq!(e.to_string(), format!("sandbox {id} has no host workspace"));
    let api = crate::daemon::response::ApiError::from(e);
    assert_eq!(api.status, hyper::StatusCode::CONFLICT, "{what}");
    assert_eq!(api.code, "no_workspace", "{what}");
}

#[tokio::test]
async fn workspace_operations_on_a_sandbox_without_one_are_409_no_workspace() {
    let dir = tempfile::tempdir().unwrap();
    let svc = test_service(dir.path(), Config::default());
    let id = bare(&svc, dir.path());
    assert!(svc.get_sandbox(&id).unwrap().workspace.is_none());
    assert_no_workspace(
        "sync",
        &id,
        svc.sync_workspace(&id, api::SyncRequest::default()).await,
    );
    assert_no_workspace("diff", &id, svc.diff(&id, false, Vec::new()).await);
    assert_no_workspace(
        "apply",
        &id,
        svc.apply(&id, api::ApplyRequest::default()).await,
    );
    let pull = api::ApplyRequest {
        paths: vec!["a.txt".into()],
        ..Default::default()
    };
    assert_no_workspace("pull", &id, svc.pull(&id, pull).await);
    // A sandbox with a workspace (and no VM) gets past that check: the refusal is the
    // missing workspace, not the missing VM.
    let with = test_sandbox(&svc, dir.path());
    let e = svc.diff(&with, false, Vec::new()).await.unwrap_err();
    assert!(!matches!(e, ServiceError::NoWorkspace(_)), "{e:?}");
}

#[test]
fn old_and_new_records_load() {
    // A record as written before the workspace was optional.
    let old = r#"{"id":"sbx_0000000000000001","state":"ready",
        "workspace":{"host_path":"/srv/repo","exclude":["data"]},"template":"base","vcpus":1,
        "memory_mib":256,"accel":"tcg","created_at":"2026-01-01T00:00:00Z","dir":"/x"}"#;
    let rec: SandboxRecord = serde_json::from_str(old).unwrap();
    let ws = rec.api.workspace.unwrap();
    assert_eq!(
        (ws.host_path.as_str(), ws.exclude),
        ("/srv/repo", vec!["data".into()])
    );
    let new = old.replace(
        r#""workspace":{"host_path":"/srv/repo","exclude":["data"]},"#,
        "",
    );
    let rec: SandboxRecord = serde_json::from_str(&new).unwrap();
    assert!(rec.api.workspace.is_none());
    // Written back without the field.
    assert!(!serde_json::to_string(&rec).unwrap().contains("workspace"));
    // And a create request may leave it out.
    let req: api::CreateSandboxRequest = serde_json::from_str("{}").unwrap();
    assert!(req.workspace.is_none());
}
