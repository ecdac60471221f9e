//! Checkpoint and restore of a real VM: files and running processes come back, and the agent
//! channel works at once after a restore.

mod common;

use common::{SMALL_VMS, create, sh_out, vm_daemon};

#[test]
fn restore_brings_back_files_and_processes() {
    let Some(d) = vm_daemon(SMALL_VMS) else {
        return;
    };
    let ws = tempfile::tempdir().unwrap();
    let id = create(&d, ws.path());

    // A file and a background process.
    let (code, _) = sh_out(
        &d,
        &id,
        "echo before > /root/f; setsid sh -c 'while :; do sleep 1; done' >/dev/null 2>&1 & echo $! > /root/pid",
    );
    assert_eq!(code, Some(0));
    let o = d.cli(&["snapshot", "create", &id, "--name", "base"]);
    assert!(
        o.status.success(),
        "{}\n{}",
        String::from_utf8_lossy(&o.stderr),
        d.log_text()
    );
    let snap = String::from_utf8_lossy(&o.stdout)
        .split_whitespace()
        .next()
        .unwrap()
        .to_owned();
    assert!(snap.starts_with("snap_"), "{snap}");
    // The VM goes on after the checkpoint.
    assert_eq!(sh_out(&d, &id, "cat /root/f").1, "before\n");

    // Change things: the file, kill the process.
    let (code, _) = sh_out(
        &d,
        &id,
        "echo after > /root/f; kill -9 $(cat /root/pid); echo gone > /root/g",
    );
    assert_eq!(code, Some(0));
    assert_eq!(
        sh_out(
            &d,
            &id,
            "kill -0 $(cat /root/pid) 2>/dev/null && echo alive || echo dead"
        )
        .1,
        "dead\n"
    );

    // Restore by name: the file and the process are back, /root/g never existed, exec works at once.
    let o = d.cli(&["restore", &id, "base"]);
    assert!(
        o.status.success(),
        "{}\n{}",
        String::from_utf8_lossy(&o.stderr),
        d.log_text()
    );
    assert_eq!(sh_out(&d, &id, "cat /root/f").1, "before\n");
    assert_eq!(
        sh_out(&d, &id, "kill -0 $(cat /root/pid) && echo alive").1,
        "alive\n"
    );
    assert_eq!(
        sh_out(&d, &id, "test -e /root/g && echo yes || echo no").1,
        "no\n"
    );

    // Restore twice from the same snapshot works too (the frozen layer is never written).
    assert_eq!(sh_out(&d, &id, "echo again > /root/f").0, Some(0));
    assert!(d.cli(&["restore", &id, &snap]).status.success());
    assert_eq!(sh_out(&d, &id, "cat /root/f").1, "before\n");

    // The sync base goes with the snapshot: a host edit synced after the snapshot does not look,
    // after a restore, like the VM reverting it (which apply would copy back to the host).
    std::fs::write(ws.path().join("a.txt"), "v1\n").unwrap();
    assert_eq!(sh_out(&d, &id, "cat /workspace/a.txt").1, "v1\n");
    assert!(
        d.cli(&["snapshot", "create", &id, "--name", "ws-v1"])
            .status
            .success()
    );
    std::fs::write(ws.path().join("a.txt"), "v2\n").unwrap();
    assert_eq!(sh_out(&d, &id, "cat /workspace/a.txt").1, "v2\n");
    assert!(d.cli(&["restore", &id, "ws-v1"]).status.success());
    let diff = d
        .request("GET", &format!("/v1/sandboxes/{id}/diff"), None)
        .json();
    assert_eq!(
        diff["files"].as_array().unwrap().len(),
        0,
        "restore made a phantom VM change: {diff}"
    );
    assert_eq!(
        sh_out(&d, &id, "cat /workspace/a.txt").1,
        "v2\n",
        "the next exec syncs the host's edit"
    );

    // Listing, unknown snapshot, and removal of everything.
    let list = d
        .request("GET", &format!("/v1/sandboxes/{id}/snapshots"), None)
        .json();
    assert_eq!(list["snapshots"].as_array().unwrap().len(), 2);
    let r = d.request(
        "POST",
        &format!("/v1/sandboxes/{id}/restore"),
        Some(r#"{"snapshot":"nope"}"#),
    );
    assert_eq!(r.status, 404);
    let r = d.request(
        "POST",
        &format!("/v1/sandboxes/{id}/snapshots"),
        Some(r#"{"name":"base"}"#),
    );
    assert_eq!(r.status, 409, "duplicate names are refused");
    assert!(d.cli(&["rm", &id]).status.success());
    assert!(!d.root().join("sandboxes").join(&id).exists());
}
