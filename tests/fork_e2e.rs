//! Fork, golden-snapshot creates and pause to disk on real VMs (TCG, kept light: 1 vCPU,
//! 256 MiB).

mod common;

use std::time::{Duration, Instant};

use common::{Daemon, create, sh_out, vm_daemon};

const LIGHT: &str = "default_memory_mib = 256\ndefault_vcpus = 1\n";

fn state(d: &Daemon, id: &str) -> String {
    d.request("GET", &format!("/v1/sandboxes/{id}"), None)
        .json()["state"]
        .as_str()
        .unwrap_or_default()
        .to_owned()
}

/// Poll `cond` every 100 ms until it holds or `limit` passes.
fn wait_for(limit: Duration, what: &str, mut cond: impl FnMut() -> bool) {
    let deadline = Instant::now() + limit;
    while !cond() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(100));
    }
}

#[test]
fn fork_children_share_the_past_not_the_future() {
    let cfg = format!("{LIGHT}[pool]\ngolden = false\nsize = 0\n");
    let Some(d) = vm_daemon(&cfg) else { return };
    let ws = tempfile::tempdir().unwrap();
    std::fs::write(ws.path().join("w.txt"), "host\n").unwrap();
    let parent = create(&d, ws.path());
    assert_eq!(sh_out(&d, &parent, "echo parent > /root/pf").0, Some(0));

    let o = d.cli(&["fork", &parent, "--count", "3"]);
    assert!(
        o.status.success(),
        "{}\n{}",
        String::from_utf8_lossy(&o.stderr),
        d.log_text()
    );
    let kids: Vec<String> = String::from_utf8_lossy(&o.stdout)
        .lines()
        .map(str::to_owned)
        .collect();
    assert_eq!(kids.len(), 3, "{kids:?}");
    for k in &kids {
        assert_ne!(k, &parent);
        assert_eq!(state(&d, k), "ready");
        assert_eq!(sh_out(&d, k, "cat /root/pf").1, "parent\n", "child {k}");
        assert_eq!(sh_out(&d, k, "cat /workspace/w.txt").1, "host\n");
        assert_eq!(
            sh_out(&d, k, "hostname").1,
            format!("{k}\n"),
            "own hostname"
        );
    }
    // Each child writes its own file: nobody else sees it.
    for (i, k) in kids.iter().enumerate() {
        assert_eq!(sh_out(&d, k, &format!("echo {i} > /root/mine")).0, Some(0));
    }
    for (i, k) in kids.iter().enumerate() {
        assert_eq!(sh_out(&d, k, "cat /root/mine").1, format!("{i}\n"));
    }
    assert_eq!(
        sh_out(&d, &parent, "test -e /root/mine && echo yes || echo no").1,
        "no\n"
    );
    // The parent goes on, and its later writes do not reach the children.
    assert_eq!(sh_out(&d, &parent, "echo later > /root/pf").0, Some(0));
    assert_eq!(sh_out(&d, &kids[0], "cat /root/pf").1, "parent\n");
    // Memory is private too: a child's page change is invisible to a sibling.
    assert_eq!(
        sh_out(&d, &kids[1], "echo x > /dev/shm/m; cat /dev/shm/m").1,
        "x\n"
    );
    assert_eq!(
        sh_out(&d, &kids[2], "test -e /dev/shm/m && echo yes || echo no").1,
        "no\n"
    );

    // Children from a snapshot: the snapshot's instant, not the parent's now; the parent
    // may be paused meanwhile and stays so.
    let o = d.cli(&["snapshot", "create", &parent, "--name", "at-later"]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    assert_eq!(sh_out(&d, &parent, "echo latest > /root/pf").0, Some(0));
    assert!(d.cli(&["pause", &parent]).status.success());
    let o = d.cli(&["fork", &parent, "--from", "at-later"]);
    assert!(
        o.status.success(),
        "{}\n{}",
        String::from_utf8_lossy(&o.stderr),
        d.log_text()
    );
    let from_snap = String::from_utf8_lossy(&o.stdout).trim().to_owned();
    assert!(from_snap.starts_with("sbx_"), "{from_snap}");
    assert_eq!(state(&d, &parent), "paused");
    assert_eq!(sh_out(&d, &from_snap, "cat /root/pf").1, "later\n");
    assert_eq!(
        sh_out(&d, &from_snap, "hostname").1,
        format!("{from_snap}\n")
    );
    // Deleting the snapshot leaves the sandbox made from it running.
    let o = d.cli(&["snapshot", "rm", &parent, "at-later"]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let r = d.request("GET", &format!("/v1/sandboxes/{parent}/snapshots"), None);
    assert_eq!(r.json()["snapshots"], serde_json::json!([]), "{}", r.text());
    assert_eq!(sh_out(&d, &from_snap, "echo ok").1, "ok\n");
    let r = d.request(
        "DELETE",
        &format!("/v1/sandboxes/{parent}/snapshots/at-later"),
        None,
    );
    assert_eq!(r.status, 404, "{}", r.text());

    // The parent holds the children's files: removing it first is refused.
    let r = d.request("DELETE", &format!("/v1/sandboxes/{parent}"), None);
    assert_eq!(r.status, 409, "{}", r.text());
    for k in kids.iter().chain([&from_snap]) {
        assert!(d.cli(&["rm", k]).status.success());
    }
    assert!(d.cli(&["rm", &parent]).status.success());
}

#[test]
fn golden_create_matches_a_cold_boot() {
    // CPU pressure ignored: on a saturated CI host the golden build would not start.
    let cfg =
        format!("{LIGHT}[pool]\ngolden = true\nsize = 0\n[limits]\ncpu_pressure_psi_avg60 = 0\n");
    let Some(d) = vm_daemon(&cfg) else { return };
    let ws = tempfile::tempdir().unwrap();
    std::fs::write(ws.path().join("w.txt"), "host\n").unwrap();
    let cold = create(&d, ws.path());
    assert!(
        d.log_text().contains("no golden snapshot yet: cold boot"),
        "{}",
        d.log_text()
    );
    // The golden snapshot is built in the background after that first boot.
    let golden = d.root().join("golden");
    wait_for(Duration::from_secs(180), "the golden snapshot", || {
        std::fs::read_dir(&golden)
            .map(|mut r| r.any(|e| e.unwrap().path().join("golden.json").exists()))
            .unwrap_or(false)
    });
    let warm = create(&d, ws.path());
    assert!(
        d.log_text().contains("created from the golden snapshot"),
        "{}",
        d.log_text()
    );
    let probe = "uname -r; cat /etc/os-release | head -1; cat /workspace/w.txt; nproc; \
                 awk '/MemTotal/ {print $2}' /proc/meminfo";
    let (c1, a) = sh_out(&d, &cold, probe);
    let (c2, b) = sh_out(&d, &warm, probe);
    assert_eq!((c1, c2), (Some(0), Some(0)));
    assert_eq!(a, b, "cold and golden sandboxes differ");
    assert_eq!(sh_out(&d, &warm, "hostname").1, format!("{warm}\n"));
    // Both are independent machines.
    assert_eq!(sh_out(&d, &warm, "echo w > /root/only-warm").0, Some(0));
    assert_eq!(
        sh_out(&d, &cold, "test -e /root/only-warm && echo yes || echo no").1,
        "no\n"
    );
    // And the golden sandbox can be snapshotted and restored like any other.
    assert!(
        d.cli(&["snapshot", "create", &warm, "--name", "s"])
            .status
            .success()
    );
    assert_eq!(sh_out(&d, &warm, "rm /root/only-warm").0, Some(0));
    assert!(d.cli(&["restore", &warm, "s"]).status.success());
    assert_eq!(sh_out(&d, &warm, "cat /root/only-warm").1, "w\n");
}

#[test]
fn pause_and_resume_across_a_daemon_restart() {
    let cfg = format!("{LIGHT}[pool]\ngolden = false\nsize = 0\n");
    let Some(mut d) = vm_daemon(&cfg) else { return };
    let ws = tempfile::tempdir().unwrap();
    let id = create(&d, ws.path());
    let (code, _) = sh_out(
        &d,
        &id,
        "echo kept > /root/f; setsid sh -c 'i=0; while :; do i=$((i+1)); echo $i > /root/tick; sleep 1; done' \
         >/dev/null 2>&1 & echo $! > /root/pid",
    );
    assert_eq!(code, Some(0));

    // Explicit pause: no QEMU, state `paused`; an exec resumes it transparently.
    let o = d.cli(&["pause", &id]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    assert_eq!(state(&d, &id), "paused");
    assert!(d.root().join("sandboxes").join(&id).join("paused").exists());
    assert_eq!(sh_out(&d, &id, "cat /root/f").1, "kept\n");
    assert_eq!(state(&d, &id), "ready");
    assert!(!d.root().join("sandboxes").join(&id).join("paused").exists());

    // Daemon shutdown pauses it to disk; the next daemon resumes it.
    assert!(d.stop().success());
    let pause_file = d
        .root()
        .join("sandboxes")
        .join(&id)
        .join("paused/pause.json");
    assert!(pause_file.exists(), "{}", d.log_text());
    d.respawn();
    wait_for(Duration::from_secs(60), "the resume after restart", || {
        state(&d, &id) == "ready"
    });
    assert_eq!(sh_out(&d, &id, "cat /root/f").1, "kept\n");
    let alive = sh_out(&d, &id, "kill -0 $(cat /root/pid) && echo alive").1;
    assert_eq!(alive, "alive\n", "the background process survived");
    let t1: u64 = sh_out(&d, &id, "cat /root/tick").1.trim().parse().unwrap();
    wait_for(Duration::from_secs(20), "the process to go on", || {
        sh_out(&d, &id, "cat /root/tick")
            .1
            .trim()
            .parse::<u64>()
            .is_ok_and(|t| t > t1)
    });
    let r = d.request("POST", &format!("/v1/sandboxes/{id}/resume"), None);
    assert_eq!(r.status, 200, "resume of a ready sandbox is a no-op");
    assert!(d.cli(&["rm", &id]).status.success());
}

/// Ctrl-C on a foreground `tryboxi serve` (SIGINT) pauses sandboxes to disk as SIGTERM does,
/// and the next daemon resumes them with their state.
#[test]
fn ctrl_c_on_a_foreground_daemon_pauses_sandboxes_to_disk() {
    let cfg = format!("{LIGHT}[pool]\ngolden = false\nsize = 0\n");
    let Some(mut d) = vm_daemon(&cfg) else { return };
    let o = d.cli(&["create"]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let id = common::first_word(&o);
    assert_eq!(sh_out(&d, &id, "echo kept > /root/f").0, Some(0));
    assert!(
        d.stop_with(nix::sys::signal::Signal::SIGINT).success(),
        "{}",
        d.log_text()
    );
    let pause_file = d
        .root()
        .join("sandboxes")
        .join(&id)
        .join("paused/pause.json");
    assert!(
        pause_file.exists(),
        "SIGINT did not pause to disk:\n{}",
        d.log_text()
    );
    d.respawn();
    wait_for(Duration::from_secs(60), "the resume after restart", || {
        state(&d, &id) == "ready"
    });
    assert_eq!(sh_out(&d, &id, "cat /root/f").1, "kept\n");
    assert!(d.cli(&["rm", &id]).status.success());
}

#[test]
fn idle_sandboxes_pause_and_wake_on_use() {
    let cfg = format!("{LIGHT}idle_pause_secs = 2\n[pool]\ngolden = false\nsize = 0\n");
    let Some(d) = vm_daemon(&cfg) else { return };
    let ws = tempfile::tempdir().unwrap();
    let id = create(&d, ws.path());
    assert_eq!(sh_out(&d, &id, "echo z > /root/z").0, Some(0));
    wait_for(Duration::from_secs(30), "the idle pause", || {
        state(&d, &id) == "paused"
    });
    assert_eq!(sh_out(&d, &id, "cat /root/z").1, "z\n");
    assert!(d.cli(&["rm", &id]).status.success());
}

/// A state file that does not fit the VM (saved by a VM with other devices: here the next
/// daemon's QEMU swaps the rng device for another when it starts a VM from a state file) is
/// refused with QEMU's reason, and loses nothing: the paused sandbox stays paused through a
/// failed resume and a failed restore, and resumes with its latest state once the devices fit.
#[test]
fn a_state_that_does_not_fit_is_refused_and_loses_nothing() {
    let cfg = format!("{LIGHT}[pool]\ngolden = false\nsize = 0\n");
    let Some(mut d) = vm_daemon(&cfg) else { return };
    let ws = tempfile::tempdir().unwrap();
    let id = create(&d, ws.path());
    assert_eq!(sh_out(&d, &id, "echo one > /root/f").0, Some(0));
    let o = d.cli(&["snapshot", "create", &id, "--name", "s1"]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    assert_eq!(sh_out(&d, &id, "echo two > /root/f").0, Some(0));
    let o = d.cli(&["pause", &id]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    assert!(d.stop().success());

    let wrapper = d.root().join("qemu-other-devices");
    std::fs::write(
        &wrapper,
        "#!/bin/sh\n\
         case \" $* \" in *\" -incoming \"*) ;; *) exec qemu-system-x86_64 \"$@\";; esac\n\
         for a do\n  shift\n  case \"$a\" in virtio-rng-device*) a=virtio-keyboard-device;; esac\n  \
         set -- \"$@\" \"$a\"\ndone\nexec qemu-system-x86_64 \"$@\"\n",
    )
    .unwrap();
    std::fs::set_permissions(
        &wrapper,
        std::os::unix::fs::PermissionsExt::from_mode(0o755),
    )
    .unwrap();
    let config = d.root().join("config.toml");
    let normal = std::fs::read_to_string(&config).unwrap();
    std::fs::write(
        &config,
        format!("qemu_binary = \"{}\"\n{normal}", wrapper.display()),
    )
    .unwrap();
    d.respawn();
    for args in [
        vec!["resume", id.as_str()],
        vec!["restore", id.as_str(), "s1"],
    ] {
        let o = d.cli(&args);
        let err = String::from_utf8_lossy(&o.stderr);
        assert!(!o.status.success(), "{args:?} worked");
        assert!(err.contains("does not fit this VM"), "{args:?}: {err}");
        assert!(err.contains("Unknown savevm section"), "{args:?}: {err}");
        assert_eq!(state(&d, &id), "paused", "after {args:?}");
    }
    assert!(d.stop().success());
    std::fs::write(&config, normal).unwrap();
    d.respawn();
    assert_eq!(state(&d, &id), "paused");
    assert_eq!(sh_out(&d, &id, "cat /root/f").1, "two\n");
    let o = d.cli(&["restore", &id, "s1"]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    assert_eq!(sh_out(&d, &id, "cat /root/f").1, "one\n");
    assert!(d.cli(&["rm", &id]).status.success());
}

/// A fork child's diff and apply read its sync base, whose contents the parent stored (the
/// first sync's pack): the child has them too (it had only the manifest, so its apply failed
/// with "cannot read the sync base blob", found by tests/lifecycle_torture_e2e.rs).
#[test]
fn a_fork_child_applies_against_the_sync_base_it_inherited() {
    let Some(d) = vm_daemon(LIGHT) else {
        return;
    };
    let ws = tempfile::tempdir().unwrap();
    std::fs::write(ws.path().join("README"), "hello\n").unwrap();
    let parent = create(&d, ws.path());
    // An apply stores what it brings back in the parent's base (a blob).
    let (code, _) = sh_out(&d, &parent, "echo one > /workspace/out.txt");
    assert_eq!(code, Some(0));
    let r = d.request("POST", &format!("/v1/sandboxes/{parent}/apply"), Some("{}"));
    assert_eq!(r.status, 200, "{}", r.text());
    let r = d.request(
        "POST",
        &format!("/v1/sandboxes/{parent}/fork"),
        Some(r#"{"count":1}"#),
    );
    assert_eq!(r.status, 201, "{}", r.text());
    let child = r.json()["sandboxes"][0]["id"].as_str().unwrap().to_owned();
    let (code, _) = sh_out(
        &d,
        &child,
        "echo changed > /workspace/README; echo two > /workspace/out.txt",
    );
    assert_eq!(code, Some(0));
    // The parent's next apply changes the host under the child (they share the folder), so
    // the child's apply of the same file merges against its base's content.
    let (code, _) = sh_out(&d, &parent, "echo three > /workspace/out.txt");
    assert_eq!(code, Some(0));
    let r = d.request("POST", &format!("/v1/sandboxes/{parent}/apply"), Some("{}"));
    assert_eq!(r.status, 200, "{}", r.text());
    let r = d.request("POST", &format!("/v1/sandboxes/{child}/apply"), Some("{}"));
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(
        std::fs::read_to_string(ws.path().join("README")).unwrap(),
        "changed\n"
    );
    // Both changed out.txt since the base: a conflict, reported and marked in the file.
    assert!(
        r.json()["conflicts"].to_string().contains("out.txt"),
        "{}",
        r.text()
    );
    let merged = std::fs::read_to_string(ws.path().join("out.txt")).unwrap();
    assert!(
        merged.contains("three") && merged.contains("two"),
        "{merged}"
    );
}

/// A background loop started from a script file, so that [`ALIVE`] finds it by name (its
/// pattern does not match its own command line). Pids are not compared across a boot: a
/// fresh boot hands out the same low numbers again.
const LOOP: &str = "printf 'while :; do sleep 1; done\\n' > /root/loop.sh; setsid sh /root/loop.sh >/dev/null 2>&1 &";
/// Prints `alive` while the [`LOOP`] runs, else `gone`.
const ALIVE: &str = "pgrep -f '/root/[l]oop.sh' >/dev/null && echo alive || echo gone";

/// A filesystem-only pause (`pause --filesystem`, E2B's `mode="filesystem"`) keeps the disk
/// alone: no state or RAM file; the next use boots afresh on that disk, so files written in
/// the VM are there, the workspace overlay on the base disk is mounted again (a diff shows
/// only what the VM changed, not every host file deleted), and processes are gone. A memory
/// pause resumed with `--reboot` drops its memory state the same way.
#[test]
fn a_filesystem_pause_and_a_reboot_keep_the_files_not_the_processes() {
    let cfg = format!("{LIGHT}[pool]\ngolden = false\nsize = 0\n");
    let Some(d) = vm_daemon(&cfg) else { return };
    let ws = tempfile::tempdir().unwrap();
    std::fs::write(ws.path().join("a.txt"), "host\n").unwrap();
    // Over 1 MiB: the first sync goes through the workspace base disk (an overlay in the VM).
    let big: Vec<u8> = (0..(2u32 << 20)).map(|i| (i * 7 + i / 3) as u8).collect();
    std::fs::write(ws.path().join("big.bin"), &big).unwrap();
    let id = create(&d, ws.path());
    let dir = d.root().join("sandboxes").join(&id);
    let (code, out) = sh_out(
        &d,
        &id,
        &format!(
            "mount | grep -c ' on /workspace type overlay'; echo vm > /workspace/b.txt; \
         echo kept > /root/f; {LOOP}"
        ),
    );
    assert_eq!(
        (code, out.as_str()),
        (Some(0), "1\n"),
        "no base-disk overlay"
    );

    let o = d.cli(&["pause", "--filesystem", &id]);
    assert!(
        o.status.success(),
        "{}\n{}",
        String::from_utf8_lossy(&o.stderr),
        d.log_text()
    );
    assert_eq!(state(&d, &id), "paused");
    let pause = std::fs::read_to_string(dir.join("paused/pause.json")).unwrap();
    assert!(
        !pause.contains("checkpoint") && pause.contains("disk_layer"),
        "{pause}"
    );
    assert!(!dir.join("paused/state.bin").exists());
    assert!(
        !dir.join("mem.ram").exists(),
        "the RAM file outlived the VM"
    );

    // Any use boots it afresh on its disk.
    let (code, out) = sh_out(
        &d,
        &id,
        &format!(
            "cat /root/f /workspace/b.txt /workspace/a.txt; \
         mount | grep -c ' on /workspace type overlay'; {ALIVE}"
        ),
    );
    assert_eq!(code, Some(0), "{out}\n{}", d.log_text());
    assert_eq!(out, "kept\nvm\nhost\n1\ngone\n", "{}", d.log_text());
    assert_eq!(state(&d, &id), "ready");
    assert!(!dir.join("paused").exists());
    assert_eq!(
        sh_out(&d, &id, "md5sum < /workspace/big.bin").1,
        format!("{}  -\n", md5_of(&big)),
        "the base disk's file through the remounted overlay"
    );
    let diff = d
        .request("GET", &format!("/v1/sandboxes/{id}/diff"), None)
        .json();
    let files: Vec<String> = diff["files"]
        .as_array()
        .unwrap()
        .iter()
        .map(|f| {
            format!(
                "{} {}",
                f["kind"].as_str().unwrap(),
                f["path"].as_str().unwrap()
            )
        })
        .collect();
    assert_eq!(files, ["added b.txt"], "{diff}");

    // A memory pause resumed with --reboot: files kept, the process and the state dropped.
    let (code, _) = sh_out(&d, &id, &format!("echo again > /root/g; {LOOP}"));
    assert_eq!(code, Some(0));
    assert!(d.cli(&["pause", &id]).status.success());
    assert!(dir.join("paused/state.bin").exists());
    let o = d.cli(&["resume", "--reboot", &id]);
    assert!(
        o.status.success(),
        "{}\n{}",
        String::from_utf8_lossy(&o.stderr),
        d.log_text()
    );
    assert!(!dir.join("paused").exists());
    assert_eq!(
        sh_out(&d, &id, &format!("cat /root/g; {ALIVE}")).1,
        "again\ngone\n"
    );
    // Resumed with its memory (the default), a process lives on, as before.
    assert_eq!(sh_out(&d, &id, LOOP).0, Some(0));
    assert!(d.cli(&["pause", &id]).status.success());
    assert!(d.cli(&["resume", &id]).status.success());
    assert_eq!(sh_out(&d, &id, ALIVE).1, "alive\n");
    assert!(d.cli(&["rm", &id]).status.success());
}

/// A filesystem-only snapshot (`snapshot create --filesystem`, E2B's
/// `create_snapshot(mode="filesystem")`) has no state or RAM file; a restore or fork from it
/// boots afresh on its disk: files (the workspace overlay on the base disk too) as at the
/// snapshot, processes gone, a fork child its own machine.
#[test]
fn a_filesystem_snapshot_restores_and_forks_by_booting_afresh() {
    let cfg = format!("{LIGHT}[pool]\ngolden = false\nsize = 0\n");
    let Some(d) = vm_daemon(&cfg) else { return };
    let ws = tempfile::tempdir().unwrap();
    let big: Vec<u8> = (0..(2u32 << 20)).map(|i| (i * 5 + i / 7) as u8).collect();
    std::fs::write(ws.path().join("big.bin"), &big).unwrap();
    let id = create(&d, ws.path());
    let (code, _) = sh_out(
        &d,
        &id,
        &format!(
            "echo one > /root/f; echo vm > /workspace/b.txt; \
         {LOOP}"
        ),
    );
    assert_eq!(code, Some(0));
    let o = d.cli(&["snapshot", "create", &id, "--name", "disk", "--filesystem"]);
    let out = String::from_utf8_lossy(&o.stdout).to_string();
    assert!(
        o.status.success() && out.contains("the disk alone"),
        "{out}{}\n{}",
        String::from_utf8_lossy(&o.stderr),
        d.log_text()
    );
    let snap = out.split_whitespace().next().unwrap().to_owned();
    let snap_dir = d
        .root()
        .join("sandboxes")
        .join(&id)
        .join("snapshots")
        .join(&snap);
    assert!(snap_dir.is_dir());
    assert!(!snap_dir.join("state.bin").exists() && !snap_dir.join("mem.ram").exists());
    let listed = d
        .request("GET", &format!("/v1/sandboxes/{id}/snapshots"), None)
        .json();
    assert_eq!(listed["snapshots"][0]["memory"], false, "{listed}");
    assert_eq!(listed["snapshots"][0]["state_bytes"], 0, "{listed}");

    // Changed after the snapshot; the restore puts the disk back and boots it.
    assert_eq!(
        sh_out(&d, &id, "echo two > /root/f; rm /workspace/b.txt").0,
        Some(0)
    );
    let o = d.cli(&["restore", &id, "disk"]);
    assert!(
        o.status.success(),
        "{}\n{}",
        String::from_utf8_lossy(&o.stderr),
        d.log_text()
    );
    let check = &format!(
        "cat /root/f /workspace/b.txt; mount | grep -c ' on /workspace type overlay'; \
                 md5sum < /workspace/big.bin; {ALIVE}"
    );
    let want = format!("one\nvm\n1\n{}  -\ngone\n", md5_of(&big));
    assert_eq!(sh_out(&d, &id, check).1, want, "{}", d.log_text());
    let diff = d
        .request("GET", &format!("/v1/sandboxes/{id}/diff"), None)
        .json();
    assert_eq!(diff["files"].as_array().unwrap().len(), 1, "{diff}");

    // A child from it: the same files, its own hostname, no processes.
    let o = d.cli(&["fork", &id, "--from", "disk"]);
    assert!(
        o.status.success(),
        "{}\n{}",
        String::from_utf8_lossy(&o.stderr),
        d.log_text()
    );
    let child = String::from_utf8_lossy(&o.stdout).trim().to_owned();
    assert!(child.starts_with("sbx_"), "{child}");
    assert_eq!(sh_out(&d, &child, check).1, want, "{}", d.log_text());
    assert_eq!(sh_out(&d, &child, "hostname").1, format!("{child}\n"));
    assert!(d.cli(&["rm", &child]).status.success());

    // A memory snapshot restored with --reboot (the way back when its state cannot be loaded):
    // its disk, booted afresh. (What the guest had not written back is only in the state: the
    // command syncs so that the test does not depend on the guest's writeback timing.)
    let (code, _) = sh_out(&d, &id, &format!("echo mem > /root/m; sync; {LOOP}"));
    assert_eq!(code, Some(0));
    assert!(
        d.cli(&["snapshot", "create", &id, "--name", "mem"])
            .status
            .success()
    );
    assert_eq!(sh_out(&d, &id, "rm /root/m").0, Some(0));
    let o = d.cli(&["restore", "--reboot", &id, "mem"]);
    assert!(
        o.status.success(),
        "{}\n{}",
        String::from_utf8_lossy(&o.stderr),
        d.log_text()
    );
    assert_eq!(
        sh_out(&d, &id, &format!("cat /root/m; {ALIVE}")).1,
        "mem\ngone\n"
    );
    assert!(d.cli(&["rm", &id]).status.success());
}

/// MD5 of `data` (the guest has `md5sum`; the test crate has no hash dependency for it).
fn md5_of(data: &[u8]) -> String {
    let mut f = tempfile::NamedTempFile::new().unwrap();
    std::io::Write::write_all(&mut f, data).unwrap();
    let o = std::process::Command::new("md5sum")
        .arg(f.path())
        .output()
        .unwrap();
    String::from_utf8_lossy(&o.stdout)
        .split_whitespace()
        .next()
        .unwrap()
        .to_owned()
}
