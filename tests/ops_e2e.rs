//! Operational limits end to end, with a real VM: a guest flooding its serial console cannot
//! grow `console.log` past its cap, and a QEMU killed from outside (as the kernel's OOM killer
//! does) leaves its sandbox `failed` with that reason; the daemon protects itself from the OOM
//! killer and its QEMUs do not inherit that protection.
//!
//! VM tests: `TRYBOXI_ARTIFACTS=/work/main/_out cargo test --test ops_e2e`.

mod common;

use std::path::PathBuf;
use std::time::{Duration, Instant};

use common::{Daemon, SMALL_VMS, create, sh_out, vm_daemon};

fn sandbox_dir(d: &Daemon, id: &str) -> PathBuf {
    d.root().join("sandboxes").join(id)
}

fn qemu_pid(d: &Daemon, id: &str) -> u32 {
    let vm: serde_json::Value =
        serde_json::from_slice(&std::fs::read(sandbox_dir(d, id).join("vm.json")).unwrap())
            .unwrap();
    vm["pid"].as_u64().unwrap() as u32
}

fn oom_score_adj(pid: u32) -> i32 {
    std::fs::read_to_string(format!("/proc/{pid}/oom_score_adj"))
        .unwrap()
        .trim()
        .parse()
        .unwrap()
}

fn len(p: &std::path::Path) -> u64 {
    std::fs::metadata(p).map(|m| m.len()).unwrap_or(0)
}

/// Whether this process may lower its OOM score below the floor it inherited
/// (`CAP_SYS_RESOURCE`, bit 24 of `CapEff`; root in a container often lacks it).
fn has_cap_sys_resource() -> bool {
    let status = std::fs::read_to_string("/proc/self/status").unwrap();
    let hex = status
        .lines()
        .find_map(|l| l.strip_prefix("CapEff:"))
        .unwrap()
        .trim();
    u64::from_str_radix(hex, 16).unwrap() & (1 << 24) != 0
}

const CAP: u64 = 64 * 1024;

#[test]
fn a_guest_flooding_its_console_cannot_grow_the_log_past_its_cap() {
    let config = format!("{SMALL_VMS}\n[telemetry]\nvm_log_max_bytes = {CAP}\n");
    let Some(d) = vm_daemon(&config) else { return };
    let ws = tempfile::tempdir().unwrap();
    let id = create(&d, ws.path());
    let dir = sandbox_dir(&d, &id);
    let (console, rotated) = (dir.join("console.log"), dir.join("console.log.1"));
    // The guest writes to its serial console as fast as it can, bounded by `timeout`, and
    // reports how much it wrote.
    let (code, out) = sh_out(
        &d,
        &id,
        "timeout 8 cat /dev/zero | tr '\\0' x | dd of=/dev/ttyS0 bs=4k 2>/tmp/dd; \
         tail -n1 /tmp/dd | cut -d' ' -f1",
    );
    let written: u64 = out.trim().parse().unwrap_or(0);
    println!("the guest wrote {written} bytes to ttyS0 (exit {code:?})");
    assert!(
        written > 2 * CAP,
        "the flood was too small to test the cap: {written} bytes ({out})"
    );
    // The console still reaches the log after rotations (the daemon follows it).
    let (code, _) = sh_out(&d, &id, "echo CONSOLE_MARK_AFTER_FLOOD > /dev/ttyS0");
    assert_eq!(code, Some(0));
    let deadline = Instant::now() + Duration::from_secs(60);
    while !std::fs::read_to_string(&console)
        .unwrap_or_default()
        .contains("CONSOLE_MARK_AFTER_FLOOD")
    {
        assert!(
            Instant::now() < deadline,
            "the mark never reached console.log ({} bytes)",
            len(&console)
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    let (now, prev) = (len(&console), len(&rotated));
    println!("console.log {now} bytes, console.log.1 {prev} bytes (cap {CAP})");
    assert!(now <= CAP, "console.log is {now} bytes, over the cap {CAP}");
    assert!(prev > 0 && prev <= CAP, "console.log.1 is {prev} bytes");
    assert!(len(&dir.join("qemu.log")) <= CAP);
}

#[test]
fn a_qemu_killed_from_outside_leaves_its_sandbox_failed_with_the_reason() {
    // The daemon inherits a raised score (raising needs no privilege), so that lowering it
    // is seen even where -900 is not allowed: it must go back to at most where this process
    // started (the floor it inherited), or to -900 with CAP_SYS_RESOURCE (not -1000: see
    // src/oom.rs).
    let floor = oom_score_adj(std::process::id());
    std::fs::write("/proc/self/oom_score_adj", "300").unwrap();
    let Some(d) = vm_daemon(SMALL_VMS) else {
        return;
    };
    let daemon_pid = d.child.as_ref().unwrap().id();
    let score = oom_score_adj(daemon_pid);
    if has_cap_sys_resource() {
        assert_eq!(score, -900, "the daemon's oom_score_adj");
    } else {
        println!(
            "no CAP_SYS_RESOURCE here: the daemon's oom_score_adj is {score} (floor {floor}; \
             -900 needs the capability)"
        );
        assert!(score <= floor, "the daemon's oom_score_adj is {score}");
    }
    let ws = tempfile::tempdir().unwrap();
    let oom_kills_before = oom_kill_count();
    let id = create(&d, ws.path());
    let pid = qemu_pid(&d, &id);
    // Its QEMU goes first when memory runs out (and did not inherit the daemon's -900).
    assert_eq!(oom_score_adj(pid), 500, "QEMU's oom_score_adj");
    let events = common::follow_events(&d, "?since=0");
    // What the kernel's OOM killer does, SIGKILL from outside tryboxi, but sent by this test:
    // the host's OOM kill counter does not move, so the reason names another process.
    // SAFETY: kill(2) on the pid of the QEMU this test's daemon started; no memory involved.
    assert_eq!(unsafe { libc::kill(pid as i32, libc::SIGKILL) }, 0);
    const OUTSIDE: &str = "QEMU was killed by a SIGKILL tryboxi did not send";
    let deadline = Instant::now() + Duration::from_secs(60);
    let failed = loop {
        let left = deadline.saturating_duration_since(Instant::now());
        let ev = events
            .recv_timeout(left)
            .unwrap_or_else(|_| panic!("no sandbox.failed event\n{}", d.log_text()));
        if ev["type"] == "sandbox.failed" && ev["sandbox_id"] == id.as_str() {
            break ev;
        }
    };
    let why = failed["data"]["error"].as_str().unwrap_or_default();
    let oom_moved = oom_kill_count() != oom_kills_before;
    // Another process on the host killed for memory meanwhile would read as the OOM killer.
    let reason = if oom_moved {
        println!("the host's oom_kill counter moved during the test: not asserting the cause");
        OUTSIDE
    } else {
        "QEMU was killed by a SIGKILL tryboxi did not send: killed by another process (SIGKILL)"
    };
    assert!(why.contains(reason), "event reason: {why}");
    let ls = d.cli(&["ls"]);
    let text = String::from_utf8_lossy(&ls.stdout);
    let line = text
        .lines()
        .find(|l| l.starts_with(&id))
        .unwrap_or_default();
    assert!(line.contains("failed"), "{text}");
    assert!(text.contains(reason), "ls does not say why:\n{text}");
    let sb = d
        .request("GET", &format!("/v1/sandboxes/{id}"), None)
        .json();
    assert!(
        sb["error"].as_str().unwrap_or_default().contains(reason),
        "{sb}"
    );
}

/// The host's `oom_kill` counter (`/proc/vmstat`).
fn oom_kill_count() -> Option<u64> {
    let text = std::fs::read_to_string("/proc/vmstat").ok()?;
    text.lines()
        .find_map(|l| l.strip_prefix("oom_kill ")?.trim().parse().ok())
}
