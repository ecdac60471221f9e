//! End to end with real VMs: the real daemon on a temporary data root, driven by the real CLI,
//! booting real QEMU microVMs with the guest images from `cargo xtask images`.
//!
//! The images are found through `TRYBOXI_ARTIFACTS` (set by `cargo xtask ci`) or `_out/`.
//! Without images the tests skip with a message, except under CI, where that is a failure.

mod common;

use std::io::{BufRead, BufReader, Write};
use std::os::unix::net::UnixStream;
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::Duration;

use common::{BIN, Daemon, SMALL_VMS, artifacts, create, sh, vm_daemon};
use sha2::{Digest, Sha256};

/// A daemon using the built images, with small VMs.
fn daemon() -> Option<Daemon> {
    // `leave`: these tests check that QEMU outlives the daemon (fork_e2e covers `pause`).
    vm_daemon(&format!("{SMALL_VMS}shutdown = \"leave\"\n"))
}

fn exec(d: &Daemon, id: &str, args: &[&str]) -> std::process::Output {
    let mut a = vec!["exec"];
    a.extend_from_slice(args);
    let (flags, cmd): (Vec<&str>, Vec<&str>) = {
        let pos = a.iter().position(|x| *x == "--").unwrap_or(a.len());
        (a[..pos].to_vec(), a[pos..].to_vec())
    };
    let mut full = flags;
    full.push(id);
    full.extend(cmd);
    d.cli(&full)
}

fn stdout(o: &std::process::Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}

fn sandbox_dir(d: &Daemon, id: &str) -> PathBuf {
    d.root().join("sandboxes").join(id)
}

fn qemu_pid(d: &Daemon, id: &str) -> i32 {
    let vm: serde_json::Value =
        serde_json::from_slice(&std::fs::read(sandbox_dir(d, id).join("vm.json")).unwrap())
            .unwrap();
    vm["pid"].as_i64().unwrap() as i32
}

/// True if any process's command line mentions `needle` (e.g. a sandbox directory).
fn process_mentions(needle: &str) -> bool {
    std::fs::read_dir("/proc").unwrap().flatten().any(|e| {
        std::fs::read(e.path().join("cmdline"))
            .map(|c| String::from_utf8_lossy(&c).contains(needle))
            .unwrap_or(false)
    })
}

#[test]
fn exec_semantics_in_a_real_vm() {
    let Some(d) = daemon() else { return };
    let ws = tempfile::tempdir().unwrap();
    let id = create(&d, ws.path());

    // stdout, stderr, exit code, separately.
    let o = sh(&d, &id, "echo out; echo err >&2; exit 7");
    assert_eq!(o.status.code(), Some(7));
    assert_eq!(stdout(&o), "out\n");
    assert_eq!(String::from_utf8_lossy(&o.stderr), "err\n");
    let o = exec(&d, &id, &["--", "uname", "-s"]);
    assert!(o.status.success());
    assert_eq!(stdout(&o), "Linux\n");

    // The system calls runtimes rely on are there (tinyconfig drops them; V8 in Node 20 aborts
    // without madvise).
    const SYSCALLS: &str = r#"
import ctypes, mmap, os
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
m = mmap.mmap(-1, 4096)
m.madvise(mmap.MADV_DONTNEED)
calls = (("membarrier", (324, 0, 0)),
         ("process_vm_readv", (310, os.getpid(), 0, 0, 0, 0, 0)),
         ("kcmp", (312, os.getpid(), os.getpid(), 0, 0, 0)))
gone = [n for n, a in calls if libc.syscall(*a) < 0 and ctypes.get_errno() == 38]
print(" ".join(gone) or "none missing")
"#;
    let o = exec(&d, &id, &["--", "python3", "-c", SYSCALLS]);
    assert_eq!(
        (o.status.code(), stdout(&o)),
        (Some(0), "none missing\n".to_owned()),
        "{}",
        String::from_utf8_lossy(&o.stderr)
    );

    // env, cwd, stdin.
    let o = exec(
        &d,
        &id,
        &[
            "-e",
            "GREETING=hi there",
            "--cwd",
            "/tmp",
            "--",
            "sh",
            "-c",
            "echo \"$GREETING\"; pwd",
        ],
    );
    assert_eq!(
        stdout(&o),
        "hi there\n/tmp\n",
        "{}",
        String::from_utf8_lossy(&o.stderr)
    );
    // The default working directory; the agent (PID 1) enters a command's directory only for
    // the moment of the spawn and is back in `/` after; argv[0] is the name as given.
    let o = exec(
        &d,
        &id,
        &["--", "sh", "-c", "pwd; echo $0; readlink /proc/1/cwd"],
    );
    assert_eq!(stdout(&o), "/workspace\nsh\n/\n");
    let o = exec(&d, &id, &["--cwd", "/no/such/dir", "--", "true"]);
    assert!(!o.status.success());
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(err.contains("/no/such/dir"), "{err}");
    let o = exec(&d, &id, &["--", "no-such-command-here"]);
    assert!(!o.status.success());
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(err.contains("no-such-command-here"), "{err}");
    let mut child = Command::new(BIN)
        .args(["exec", "--stdin", &id, "--", "tr", "a-z", "A-Z"])
        .env("TRYBOXI_HOME", d.root())
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    child
        .stdin
        .take()
        .unwrap()
        .write_all(b"from stdin")
        .unwrap();
    let o = child.wait_with_output().unwrap();
    assert_eq!(stdout(&o), "FROM STDIN");

    // A signal death is 128 + N.
    let o = sh(&d, &id, "kill -TERM $$");
    assert_eq!(o.status.code(), Some(128 + 15));

    // Timeout kills the whole process group, background children included.
    let o = exec(
        &d,
        &id,
        &[
            "--timeout",
            "1",
            "--",
            "sh",
            "-c",
            "sleep 300 & sleep 301; echo never",
        ],
    );
    assert_eq!(
        o.status.code(),
        Some(124),
        "{}",
        String::from_utf8_lossy(&o.stderr)
    );
    assert_eq!(stdout(&o), "");
    let o = sh(&d, &id, "ps -eo args | grep -c '^sleep 30[01]' || true");
    assert_eq!(stdout(&o).trim(), "0", "sleeps survived the timeout");

    // 10 MB of output, intact; binary output intact.
    let o = sh(
        &d,
        &id,
        "yes 0123456789abcdefghijklmnopqrstuvwxyz | head -c 10485760",
    );
    assert!(o.status.success());
    assert_eq!(o.stdout.len(), 10 * 1024 * 1024);
    let expected: Vec<u8> = b"0123456789abcdefghijklmnopqrstuvwxyz\n"
        .iter()
        .copied()
        .cycle()
        .take(10 * 1024 * 1024)
        .collect();
    assert!(o.stdout == expected, "10 MB output corrupted");
    let o = sh(
        &d,
        &id,
        "head -c 300000 /dev/urandom > /tmp/bin; sha256sum /tmp/bin | cut -d' ' -f1 >&2; cat /tmp/bin",
    );
    assert!(o.status.success());
    let got = hex::encode(Sha256::digest(&o.stdout));
    assert_eq!(
        got,
        String::from_utf8_lossy(&o.stderr).trim(),
        "binary output corrupted"
    );

    // 20 concurrent execs.
    let handles: Vec<_> = (0..20)
        .map(|i| {
            let root = d.root().to_path_buf();
            let id = id.clone();
            std::thread::spawn(move || {
                let o = Command::new(BIN)
                    .args(["exec", &id, "--", "sh", "-c", &format!("echo n{i}")])
                    .env("TRYBOXI_HOME", root)
                    .output()
                    .unwrap();
                (i, o)
            })
        })
        .collect();
    for h in handles {
        let (i, o) = h.join().unwrap();
        assert!(
            o.status.success(),
            "exec {i}: {}",
            String::from_utf8_lossy(&o.stderr)
        );
        assert_eq!(stdout(&o), format!("n{i}\n"));
    }

    // ls shows it; rm leaves no process, socket or file behind.
    let o = d.cli(&["ls"]);
    assert!(stdout(&o).contains(&id));
    let dir = sandbox_dir(&d, &id);
    assert!(dir.join("disk.qcow2").exists());
    let o = d.cli(&["rm", &id]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    assert!(!dir.exists(), "sandbox directory left behind");
    assert!(
        !process_mentions(dir.to_str().unwrap()),
        "a process of the removed sandbox still runs"
    );
    let o = d.cli(&["exec", &id, "--", "true"]);
    assert!(!o.status.success());
    assert!(
        String::from_utf8_lossy(&o.stderr).contains("no sandbox"),
        "{}",
        String::from_utf8_lossy(&o.stderr)
    );
}

#[test]
fn vm_killed_mid_exec_is_an_error_and_the_sandbox_fails() {
    let Some(d) = daemon() else { return };
    let ws = tempfile::tempdir().unwrap();
    let id = create(&d, ws.path());
    // Start a long exec over raw HTTP and read until the command is running.
    let mut s = UnixStream::connect(d.socket()).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(120))).unwrap();
    let body = r#"{"cmd":"echo running; sleep 600"}"#;
    write!(
        s,
        "POST /v1/sandboxes/{id}/exec HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    let mut r = BufReader::new(s);
    let mut seen = String::new();
    while !seen.contains("running") {
        let mut line = String::new();
        assert!(
            r.read_line(&mut line).unwrap() > 0,
            "stream ended early: {seen}"
        );
        seen.push_str(&line);
    }
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(qemu_pid(&d, &id)),
        nix::sys::signal::Signal::SIGKILL,
    )
    .unwrap();
    let mut rest = String::new();
    let _ = std::io::Read::read_to_string(&mut r, &mut rest);
    assert!(
        rest.contains("\"type\":\"error\""),
        "no error event after the VM died: {rest}"
    );
    assert!(rest.contains("vm_lost"), "{rest}");
    // The sandbox is marked failed (bounded wait on the watcher), and says why.
    let mut state = String::new();
    for _ in 0..100 {
        let j = d
            .request("GET", &format!("/v1/sandboxes/{id}"), None)
            .json();
        state = j["state"].as_str().unwrap().to_owned();
        if state == "failed" {
            assert!(j["error"].as_str().unwrap().contains("stopped"), "{j}");
            break;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    assert_eq!(state, "failed");
    let o = d.cli(&["exec", &id, "--", "true"]);
    assert!(!o.status.success());
    assert!(String::from_utf8_lossy(&o.stderr).contains("failed"));
    assert!(d.cli(&["rm", &id]).status.success());
    assert!(!sandbox_dir(&d, &id).exists());
}

#[test]
fn daemon_restart_finds_running_vms_again() {
    let Some(mut d) = daemon() else { return };
    let ws = tempfile::tempdir().unwrap();
    let id = create(&d, ws.path());
    let o = sh(&d, &id, "echo kept > /root/state");
    assert!(o.status.success());
    let pid = qemu_pid(&d, &id);
    assert!(d.stop().success());
    // The VM outlives the daemon...
    assert!(alive(pid), "VM died with the daemon");
    d.respawn();
    // ...and the next daemon reattaches to it.
    let o = sh(&d, &id, "cat /root/state");
    assert_eq!(
        stdout(&o),
        "kept\n",
        "{}\n--- daemon log ---\n{}\n--- console ---\n{}",
        String::from_utf8_lossy(&o.stderr),
        d.log_text(),
        std::fs::read_to_string(sandbox_dir(&d, &id).join("console.log")).unwrap_or_default()
    );
    assert_eq!(qemu_pid(&d, &id), pid);
    // A daemon killed outright (no cleanup) is recovered from too.
    d.kill();
    d.respawn();
    assert_eq!(stdout(&sh(&d, &id, "cat /root/state")), "kept\n");
    // Even when it dies while the agent is streaming output (frames of the old connection, maybe
    // half of one, are still on the port when the next daemon connects).
    for round in 0..2 {
        let mut cat = Command::new(BIN)
            .args(["exec", &id, "--", "sh", "-c", "exec cat /dev/urandom"])
            .env("TRYBOXI_HOME", d.root())
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        let mut out = cat.stdout.take().unwrap();
        let mut got = vec![0u8; 256 * 1024];
        std::io::Read::read_exact(&mut out, &mut got).unwrap();
        d.kill();
        drop(out);
        common::wait_bounded(&mut cat, Duration::from_secs(60));
        d.respawn();
        let o = sh(&d, &id, "cat /root/state");
        assert_eq!(
            stdout(&o),
            "kept\n",
            "round {round}: {}\n--- daemon log ---\n{}\n--- console ---\n{}",
            String::from_utf8_lossy(&o.stderr),
            d.log_text(),
            std::fs::read_to_string(sandbox_dir(&d, &id).join("console.log")).unwrap_or_default()
        );
    }
    // What the reconnects found on the channel (informational; see docs/RPC.md, Handshake).
    for l in d
        .log_text()
        .lines()
        .filter(|l| l.contains("earlier connection left"))
    {
        eprintln!("{l}");
    }
    assert!(d.cli(&["rm", &id]).status.success());
    assert!(!alive(pid), "the VM still runs after rm");
}

/// Whether `pid` runs (a zombie or a missing process does not).
fn alive(pid: i32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Ok(stat) => {
            stat.rsplit(')')
                .next()
                .and_then(|r| r.split_whitespace().next())
                != Some("Z")
        }
        Err(_) => false,
    }
}

#[test]
fn hostile_commands_do_not_hurt_the_daemon_or_the_vm() {
    let Some(d) = daemon() else { return };
    let ws = tempfile::tempdir().unwrap();
    let id = create(&d, ws.path());
    // Out of memory in the guest: the kernel's OOM killer ends the hog; the VM stays usable.
    let o = sh(&d, &id, "tail /dev/zero");
    assert!(
        !o.status.success(),
        "an endless line fit into a 512 MiB guest?"
    );
    let o = exec(&d, &id, &["--", "echo", "still here"]);
    assert_eq!(
        stdout(&o),
        "still here\n",
        "{}",
        String::from_utf8_lossy(&o.stderr)
    );
    // A command that prints forever is stopped by its timeout; its output so far arrives.
    let o = exec(&d, &id, &["--timeout", "2", "--", "yes", "spam"]);
    assert_eq!(o.status.code(), Some(124));
    assert!(
        o.stdout.starts_with(b"spam\nspam\n"),
        "no output before the timeout"
    );
    // The daemon still answers, and so does the VM.
    assert_eq!(d.request("GET", "/v1/health", None).status, 200);
    assert_eq!(stdout(&exec(&d, &id, &["--", "echo", "ok"])), "ok\n");
    // A caller that goes away mid-command (even a silent one) gets the command killed.
    {
        let mut s = UnixStream::connect(d.socket()).unwrap();
        let body = r#"{"cmd":"sleep 333"}"#;
        write!(
            s,
            "POST /v1/sandboxes/{id}/exec HTTP/1.1\r\nHost: localhost\r\nContent-Length: {}\r\n\r\n{body}",
            body.len()
        )
        .unwrap();
        let mut r = BufReader::new(s.try_clone().unwrap());
        let mut line = String::new();
        while !line.contains("started") {
            line.clear();
            assert!(r.read_line(&mut line).unwrap() > 0);
        }
        drop(r);
        drop(s);
    }
    let mut left = String::new();
    for _ in 0..100 {
        left = stdout(&sh(&d, &id, "ps -eo args | grep -c '^sleep 333' || true"));
        if left.trim() == "0" {
            break;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    assert_eq!(left.trim(), "0", "the command outlived its caller");
    // Bad requests are refused clearly and lose nothing.
    let r = d.request(
        "POST",
        &format!("/v1/sandboxes/{id}/exec"),
        Some(r#"{"cmd":"true","argv":["true"]}"#),
    );
    assert_eq!(r.status, 400);
    let r = d.request(
        "POST",
        &format!("/v1/sandboxes/{id}/exec"),
        Some(r#"{"cmd":"true","timeout_s":-1}"#),
    );
    assert_eq!(r.status, 400);
    let o = exec(&d, &id, &["--", "/no/such/program"]);
    assert!(!o.status.success());
    assert!(!String::from_utf8_lossy(&o.stderr).is_empty());
}

#[test]
fn three_sandboxes_at_once() {
    let Some(d) = daemon() else { return };
    let ws = tempfile::tempdir().unwrap();
    let handles: Vec<_> = (0..3)
        .map(|_| {
            let root = d.root().to_path_buf();
            let ws = ws.path().to_path_buf();
            std::thread::spawn(move || {
                Command::new(BIN)
                    .args(["create", "--memory", "256", "-w", ws.to_str().unwrap()])
                    .env("TRYBOXI_HOME", root)
                    .output()
                    .unwrap()
            })
        })
        .collect();
    let mut ids = Vec::new();
    for h in handles {
        let o = h.join().unwrap();
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        ids.push(stdout(&o).split_whitespace().next().unwrap().to_owned());
    }
    for id in &ids {
        // Each VM is its own machine: its hostname is its id.
        assert_eq!(stdout(&exec(&d, id, &["--", "hostname"])).trim(), id);
    }
    for id in &ids {
        assert!(d.cli(&["rm", id]).status.success());
    }
    assert_eq!(
        d.request("GET", "/v1/sandboxes", None).json()["sandboxes"]
            .as_array()
            .unwrap()
            .len(),
        0
    );
}

#[test]
fn install_copies_verified_images_and_doctor_checks_the_host() {
    let Some(art) = artifacts() else { return };
    let home = tempfile::tempdir().unwrap();
    let run = |args: &[&str]| {
        Command::new(BIN)
            .args(args)
            .env("TRYBOXI_HOME", home.path())
            .output()
            .unwrap()
    };
    let o = run(&["install", "--artifacts", art.to_str().unwrap()]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let current = std::fs::read_to_string(home.path().join("artifacts/images.current")).unwrap();
    let installed = home.path().join("artifacts").join(current.trim());
    for f in [
        "manifest.json",
        "vmlinuz",
        "initramfs.cpio.gz",
        "rootfs.ext4",
    ] {
        assert!(installed.join(f).exists(), "{f} not installed");
    }
    // doctor: every check has a line; images and QEMU pass; accel names kvm or tcg.
    let o = run(&["doctor"]);
    let text = stdout(&o);
    for name in [
        "qemu",
        "accel",
        "images",
        "data-root",
        "daemon",
        "memory",
        "disk",
        "fence",
    ] {
        assert!(
            text.lines().any(|l| l.contains(&format!(" {name} "))),
            "no `{name}` line:\n{text}"
        );
    }
    assert!(
        text.lines().any(|l| l.starts_with("[ ok ] images")),
        "{text}"
    );
    assert!(text.lines().any(|l| l.starts_with("[ ok ] qemu")), "{text}");
    assert!(text.contains("kvm") || text.contains("tcg"), "{text}");
    // No daemon runs on this root: that is a warning, not a failure.
    assert!(
        o.status.success(),
        "{text}\n{}",
        String::from_utf8_lossy(&o.stderr)
    );
    // A corrupted image is caught by doctor's checksum and makes it fail.
    let manifest = installed.join("manifest.json");
    let m = std::fs::read_to_string(&manifest).unwrap();
    let v: serde_json::Value = serde_json::from_str(&m).unwrap();
    let kernel_sha = v["artifacts"]
        .as_array()
        .unwrap()
        .iter()
        .find(|a| a["name"] == "kernel")
        .unwrap()["sha256"]
        .as_str()
        .unwrap()
        .to_owned();
    let tmp = installed.join("manifest.json.tmp");
    std::fs::write(&tmp, m.replace(&kernel_sha, &"0".repeat(64))).unwrap();
    std::fs::rename(&tmp, &manifest).unwrap();
    let o = run(&["doctor"]);
    assert!(
        !o.status.success(),
        "doctor passed with a wrong checksum: {}",
        stdout(&o)
    );
    assert!(
        stdout(&o).lines().any(|l| l.starts_with("[FAIL] images")),
        "{}",
        stdout(&o)
    );
}
