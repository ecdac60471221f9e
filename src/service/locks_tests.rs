//! Lifecycle races against an in-memory store, without a VMM: an operation in flight is played
//! by a test that holds the sandbox's lifecycle lock (as resume, apply and the others do for
//! their whole run) and writes what that operation writes when it ends; the operation that
//! races it is the real service call. Deterministic: the runtime has one thread, and the racing
//! call either runs to its end at once (no lock) or waits on the lock.

use std::sync::Arc;
use std::time::Duration;

use super::*;
use crate::api;
use crate::config::Config;
use crate::service::ServicePauser;
use crate::service::scheduler::{Pauser, Resources};
use crate::store::SANDBOXES;

fn service(state: SandboxState) -> (Arc<Service>, String, tempfile::TempDir) {
    let dir = tempfile::tempdir().unwrap();
    // No VMM: nothing here may start or find a QEMU.
    let config = Config {
        qemu_binary: "/nonexistent/qemu-system-x86_64".into(),
        ..Config::default()
    };
    let svc = crate::service::test_service(dir.path(), config);
    let id = crate::ids::new_id(crate::ids::SANDBOX);
    let sdir = svc.paths.sandbox_dir(&id);
    std::fs::create_dir_all(&sdir).unwrap();
    let mut rec = SandboxRecord::creating(
        &id,
        sdir,
        Some((dir.path(), Vec::new())),
        "auto".into(),
        (1, 256, crate::vmm::Accel::Tcg),
    );
    rec.api.state = state;
    svc.store.put(SANDBOXES, &id, &rec).unwrap();
    (svc, id, dir)
}

/// Let every task that can run, run (one thread: a call that takes no lock finishes here).
async fn settle() {
    tokio::time::sleep(Duration::from_millis(100)).await;
}

fn record(svc: &Service, id: &str) -> Option<SandboxRecord> {
    svc.store.get::<SandboxRecord>(SANDBOXES, id).unwrap()
}

#[tokio::test(flavor = "current_thread")]
async fn remove_during_a_resume_waits_and_leaves_no_record_and_nothing_reserved() {
    let (svc, id, _dir) = service(SandboxState::Paused);
    // A resume in flight: it holds the lock while its VM boots, then writes `ready` and keeps
    // its reservation.
    let (held, mut rec) = svc.hold(&id).await.unwrap();
    let rm = tokio::spawn({
        let (svc, id) = (svc.clone(), id.clone());
        async move { svc.remove_sandbox(&id).await }
    });
    settle().await;
    assert!(
        !rm.is_finished(),
        "the remove went ahead while a resume held the sandbox"
    );
    rec.api.state = SandboxState::Ready;
    svc.store.put(SANDBOXES, &id, &rec).unwrap();
    svc.ledger.adopt(&id, Resources::new(1, 256));
    drop(held);
    rm.await.unwrap().expect("remove after the resume");
    assert!(
        record(&svc, &id).is_none(),
        "the resume resurrected the removed sandbox: {:?}",
        record(&svc, &id).map(|r| r.api.state)
    );
    assert!(
        !svc.ledger.holds(&id),
        "the ledger still holds the removed sandbox"
    );
    assert!(!rec.dir.exists());
}

#[tokio::test(flavor = "current_thread")]
async fn callers_queued_behind_a_remove_find_no_sandbox() {
    let (svc, id, _dir) = service(SandboxState::Paused);
    let (held, _) = svc.hold(&id).await.unwrap();
    let rm = tokio::spawn({
        let (svc, id) = (svc.clone(), id.clone());
        async move { svc.remove_sandbox(&id).await }
    });
    settle().await;
    // Queued after the remove: a resume (e.g. an exec's resume on use) and a pause.
    let resume = tokio::spawn({
        let (svc, id) = (svc.clone(), id.clone());
        async move { svc.resume_sandbox(&id).await }
    });
    let pause = tokio::spawn({
        let (svc, id) = (svc.clone(), id.clone());
        async move { svc.pause_sandbox(&id).await }
    });
    settle().await;
    assert!(!resume.is_finished() && !pause.is_finished());
    drop(held);
    rm.await.unwrap().unwrap();
    for r in [resume.await.unwrap(), pause.await.unwrap()] {
        assert!(matches!(r, Err(ServiceError::NotFound(_))), "{r:?}");
    }
    assert!(record(&svc, &id).is_none());
    assert_eq!(svc.life.locks.len(), 0, "a removed sandbox's lock lingers");
}

#[tokio::test(flavor = "current_thread")]
async fn restore_during_an_apply_waits_for_it() {
    let (svc, id, _dir) = service(SandboxState::Ready);
    // An apply in flight holds the lifecycle lock (taken by `ready_vm`), then the workspace
    // lock, and writes the sync base last.
    let (held, rec) = svc.hold(&id).await.unwrap();
    let ws = svc.ws_lock(&id);
    let ws_guard = ws.lock().await;
    let restore = tokio::spawn({
        let (svc, id) = (svc.clone(), id.clone());
        async move {
            let req = api::RestoreRequest {
                snapshot: "before".into(),
                reboot: false,
            };
            svc.restore_snapshot(&id, req).await
        }
    });
    settle().await;
    assert!(
        !restore.is_finished(),
        "a restore ran while an apply held the sandbox: {:?}",
        restore.await.unwrap()
    );
    let base = crate::workspace::manifest::Base::new(rec.dir.join("workspace"));
    base.save(&crate::workspace::manifest::Manifest::default())
        .unwrap();
    drop(ws_guard);
    drop(held);
    // This sandbox has no such snapshot: the restore, once it runs, says so.
    let r = restore.await.unwrap();
    assert!(matches!(r, Err(ServiceError::NotFound(_))), "{r:?}");
}

#[tokio::test(flavor = "current_thread")]
async fn a_snapshot_waits_for_a_pause_in_flight() {
    let (svc, id, _dir) = service(SandboxState::Ready);
    let (held, mut rec) = svc.hold(&id).await.unwrap();
    let snap = tokio::spawn({
        let (svc, id) = (svc.clone(), id.clone());
        async move {
            svc.create_snapshot(&id, api::SnapshotRequest::default())
                .await
        }
    });
    settle().await;
    assert!(!snap.is_finished(), "a snapshot ran during a pause");
    // The pause ends: paused, nothing reserved. The snapshot then resumes it first (which
    // needs a VMM here: a clear 503, not a snapshot of a VM that is not there).
    rec.api.state = SandboxState::Paused;
    svc.store.put(SANDBOXES, &id, &rec).unwrap();
    drop(held);
    let r = snap.await.unwrap();
    assert!(
        matches!(
            r,
            Err(ServiceError::Internal(_) | ServiceError::Unavailable(_))
        ),
        "{r:?}"
    );
    assert_eq!(record(&svc, &id).unwrap().api.state, SandboxState::Paused);
    assert!(
        !svc.ledger.holds(&id),
        "a failed resume kept its reservation"
    );
}

#[tokio::test(flavor = "current_thread")]
async fn pressure_and_idle_pause_skip_a_sandbox_in_use_without_waiting() {
    let (svc, id, _dir) = service(SandboxState::Ready);
    let (held, _) = svc.hold(&id).await.unwrap();
    let pauser = ServicePauser(Arc::downgrade(&svc));
    let r = tokio::time::timeout(Duration::from_secs(5), pauser.pause(&id))
        .await
        .expect("the pressure pause waited for a sandbox in use");
    assert!(r.is_err_and(|e| e.contains("in use")));
    drop(held);
}

#[tokio::test(flavor = "current_thread")]
async fn unknown_sandboxes_get_no_lock_entry() {
    let (svc, _id, _dir) = service(SandboxState::Ready);
    for _ in 0..100 {
        let id = crate::ids::new_id(crate::ids::SANDBOX);
        assert!(matches!(
            svc.resume_sandbox(&id).await,
            Err(ServiceError::NotFound(_))
        ));
        assert!(svc.remove_sandbox(&id).await.is_err());
    }
    assert_eq!(svc.life.locks.len(), 0);
}
