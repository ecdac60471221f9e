//! Retire, reap and snapshot delete against an in-memory store, without a VMM (records and
//! directories as a VM would leave them; nothing here starts a QEMU).

use std::path::{Path, PathBuf};
use std::sync::Arc;

use super::*;
use crate::config::Config;
use crate::vmm::qemu::Checkpoint;

fn service() -> (Arc<Service>, tempfile::TempDir) {
    let dir = tempfile::tempdir().unwrap();
    let config = Config {
        qemu_binary: "/nonexistent/qemu-system-x86_64".into(),
        ..Config::default()
    };
    (crate::service::test_service(dir.path(), config), dir)
}

/// A ready sandbox with its directory and a RAM file in it.
fn sandbox(svc: &Service) -> SandboxRecord {
    let id = crate::ids::new_id(crate::ids::SANDBOX);
    let dir = svc.paths.sandbox_dir(&id);
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(ram_of(&dir), b"ram").unwrap();
    std::fs::write(dir.join("disk.qcow2"), b"layer").unwrap();
    let rec = SandboxRecord::creating(
        &id,
        dir,
        None,
        "auto".into(),
        (1, 256, crate::vmm::Accel::Tcg),
    );
    let mut rec = rec;
    rec.api.state = SandboxState::Ready;
    svc.store.put(SANDBOXES, &id, &rec).unwrap();
    rec
}

fn ram_of(dir: &Path) -> PathBuf {
    crate::vmm::qemu::VmPaths::new(dir).ram.path().to_owned()
}

/// A snapshot of `rec` as `snapshot_held` leaves it: files in `snapshots/<id>/`, a record.
fn snapshot(svc: &Service, rec: &SandboxRecord, name: Option<&str>) -> String {
    let snap_id = crate::ids::new_id(crate::ids::SNAPSHOT);
    let d = rec.dir.join("snapshots").join(&snap_id);
    std::fs::create_dir_all(&d).unwrap();
    std::fs::write(d.join("state.bin"), b"state").unwrap();
    std::fs::write(d.join("mem.ram"), b"frozen").unwrap();
    let s = SnapshotRecord {
        api: api::Snapshot {
            id: snap_id.clone(),
            sandbox_id: rec.api.id.clone(),
            name: name.map(str::to_owned),
            created_at: super::super::now_rfc3339(),
            state_bytes: 5,
            duration_ms: 1,
            memory: true,
        },
        checkpoint: Checkpoint {
            state_file: d.join("state.bin"),
            disk_layer: rec.dir.join("disk.qcow2"),
            state_bytes: 5,
            ram_file: Some(d.join("mem.ram")),
            workspace_disk: None,
            disk_only: false,
        },
        trust_digest: None,
    };
    svc.store.put(SNAPSHOTS, &snap_id, &s).unwrap();
    snap_id
}

/// `child` depends on `parent`'s directory, as a fork child does.
fn make_child_of(svc: &Service, parent: &SandboxRecord) -> SandboxRecord {
    let child = sandbox(svc);
    let lineage = serde_json::json!({ "depends_on": [parent.dir] });
    std::fs::write(child.dir.join("lineage.json"), lineage.to_string()).unwrap();
    child
}

fn state(svc: &Service, id: &str) -> Option<SandboxState> {
    svc.store
        .get::<SandboxRecord>(SANDBOXES, id)
        .unwrap()
        .map(|r| r.api.state)
}

#[tokio::test(flavor = "current_thread")]
async fn a_sandbox_nothing_needs_is_removed_by_retire() {
    let (svc, _d) = service();
    let rec = sandbox(&svc);
    svc.retire_sandbox(&rec.api.id).await.unwrap();
    assert_eq!(state(&svc, &rec.api.id), None);
    assert!(!rec.dir.exists());
}

#[tokio::test(flavor = "current_thread")]
async fn a_sandbox_with_a_snapshot_is_retired_until_the_snapshot_goes() {
    let (svc, _d) = service();
    let rec = sandbox(&svc);
    let snap = snapshot(&svc, &rec, Some("clean"));
    let r = svc.retire_sandbox(&rec.api.id).await.unwrap();
    assert_eq!(r.state, SandboxState::Retired);
    assert_eq!(state(&svc, &rec.api.id), Some(SandboxState::Retired));
    // Its own RAM is gone; the snapshot's files and the disk layers stay.
    assert!(!ram_of(&rec.dir).exists());
    assert!(rec.dir.join("disk.qcow2").exists());
    assert!(
        rec.dir
            .join("snapshots")
            .join(&snap)
            .join("mem.ram")
            .exists()
    );
    // Retiring again changes nothing; a retired sandbox is not ready for anything.
    let again = svc.retire_sandbox(&rec.api.id).await.unwrap();
    assert_eq!(again.state, SandboxState::Retired);
    let e = svc.hold_ready(&rec.api.id).await.err().unwrap();
    assert!(e.to_string().contains("retired"), "{e}");
    // A daemon start leaves it as it is.
    svc.reap_retired().await;
    assert_eq!(state(&svc, &rec.api.id), Some(SandboxState::Retired));
    // The snapshot deleted (by name): the sandbox goes with it.
    let gone = svc.delete_snapshot(&rec.api.id, "clean").await.unwrap();
    assert_eq!(gone.id, snap);
    assert_eq!(state(&svc, &rec.api.id), None);
    assert!(!rec.dir.exists());
    assert!(svc.all_snapshots().unwrap().is_empty());
}

#[tokio::test(flavor = "current_thread")]
async fn a_retired_parent_goes_when_its_last_child_is_removed() {
    let (svc, _d) = service();
    let parent = sandbox(&svc);
    let child = make_child_of(&svc, &parent);
    // `rm` of the parent is still refused; the E2B kill retires it.
    let e = svc.remove_sandbox(&parent.api.id).await.err().unwrap();
    assert!(e.to_string().contains("forks"), "{e}");
    svc.retire_sandbox(&parent.api.id).await.unwrap();
    assert_eq!(state(&svc, &parent.api.id), Some(SandboxState::Retired));
    assert!(parent.dir.exists());
    svc.remove_sandbox(&child.api.id).await.unwrap();
    // The reap runs in the background after a remove; run it here too (idempotent).
    svc.reap_retired().await;
    assert_eq!(state(&svc, &parent.api.id), None);
    assert!(!parent.dir.exists());
}

#[tokio::test(flavor = "current_thread")]
async fn a_retired_child_keeps_its_retired_parent_until_both_are_unneeded() {
    let (svc, _d) = service();
    let parent = sandbox(&svc);
    let child = make_child_of(&svc, &parent);
    let snap = snapshot(&svc, &child, None);
    svc.retire_sandbox(&parent.api.id).await.unwrap();
    svc.retire_sandbox(&child.api.id).await.unwrap();
    assert_eq!(state(&svc, &child.api.id), Some(SandboxState::Retired));
    assert_eq!(state(&svc, &parent.api.id), Some(SandboxState::Retired));
    // Deleting the child's snapshot reaps the child, then its parent.
    svc.delete_snapshot(&child.api.id, &snap).await.unwrap();
    assert_eq!(state(&svc, &child.api.id), None);
    assert_eq!(state(&svc, &parent.api.id), None);
    assert!(!parent.dir.exists() && !child.dir.exists());
}

#[tokio::test(flavor = "current_thread")]
async fn fork_from_a_snapshot_names_what_is_wrong_before_starting_anything() {
    let (svc, _d) = service();
    let rec = sandbox(&svc);
    let req = |s: &str| api::ForkRequest {
        count: Some(1),
        snapshot: Some(s.into()),
    };
    let e = svc
        .fork_sandbox(&rec.api.id, req("nope"))
        .await
        .err()
        .unwrap();
    assert!(matches!(e, ServiceError::NotFound(_)), "{e}");
    let snap = snapshot(&svc, &rec, None);
    let mut creating = rec.clone();
    creating.api.state = SandboxState::Creating;
    svc.store.put(SANDBOXES, &rec.api.id, &creating).unwrap();
    let e = svc
        .fork_sandbox(&rec.api.id, req(&snap))
        .await
        .err()
        .unwrap();
    assert!(matches!(e, ServiceError::Conflict(_)), "{e}");
    // Only the sandbox's own snapshots: another sandbox's id is not found.
    let other = sandbox(&svc);
    let e = svc
        .fork_sandbox(&other.api.id, req(&snap))
        .await
        .err()
        .unwrap();
    assert!(matches!(e, ServiceError::NotFound(_)), "{e}");
}

#[tokio::test(flavor = "current_thread")]
async fn delete_snapshot_of_an_unknown_snapshot_is_not_found_and_deletes_nothing() {
    let (svc, _d) = service();
    let rec = sandbox(&svc);
    let snap = snapshot(&svc, &rec, Some("keep"));
    let e = svc
        .delete_snapshot(&rec.api.id, "other")
        .await
        .err()
        .unwrap();
    assert!(matches!(e, ServiceError::NotFound(_)), "{e}");
    assert!(rec.dir.join("snapshots").join(&snap).exists());
    assert_eq!(svc.all_snapshots().unwrap().len(), 1);
}
