//! End to end: the guest's network through the daemon's userspace stack, in real VMs.
//!
//! What a sandbox without a policy sees: eth0 with its static address, no IPv6 at all, every
//! connection refused at once (never a timeout, never a fake open), DNS refused at once, UDP
//! other than DNS answered with port unreachable, and all of it again after a daemon restart
//! (QEMU reconnects its NIC to the new daemon's stack).

mod common;

use std::time::{Duration, Instant};

use common::{Daemon, artifacts};

fn daemon() -> Option<Daemon> {
    let art = artifacts()?;
    let cfg = "default_memory_mib = 512\ndefault_vcpus = 1\nboot_timeout_s = 180\n";
    Some(Daemon::start(
        Some(cfg),
        &["--artifacts", art.to_str().unwrap()],
    ))
}

fn create(d: &Daemon, ws: &std::path::Path) -> String {
    let out = d.cli(&["create", "-w", ws.to_str().unwrap()]);
    assert!(
        out.status.success(),
        "create failed: {}\n{}",
        String::from_utf8_lossy(&out.stderr),
        d.log_text()
    );
    let line = String::from_utf8(out.stdout).unwrap();
    line.split_whitespace().next().unwrap().to_owned()
}

/// Run a bash script in the sandbox; returns stdout + stderr.
fn bash(d: &Daemon, id: &str, script: &str) -> String {
    let o = d.cli(&["exec", id, "--", "bash", "-c", script]);
    format!(
        "{}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

/// A bash function that runs a command and prints its exit code and duration in ms.
const TIMED: &str = r#"t() { s=$(date +%s%N); "$@"; rc=$?; e=$(date +%s%N); echo "rc=$rc ms=$(( (e-s)/1000000 ))"; }; "#;

/// The `ms=` of a `t` line that follows `marker`.
fn ms_after(out: &str, marker: &str) -> u64 {
    let rest = &out[out
        .find(marker)
        .unwrap_or_else(|| panic!("no {marker} in {out}"))..];
    let ms = rest.split("ms=").nth(1).unwrap_or_else(|| panic!("{out}"));
    ms.split_whitespace().next().unwrap().parse().unwrap()
}

/// A TCP connect from the guest: refused at once, not a timeout.
fn assert_refused_fast(d: &Daemon, id: &str, host: &str, port: u16) {
    let out = bash(
        d,
        id,
        &format!(
            "{TIMED} echo CONNECT; t timeout 20 bash -c 'exec 3<>/dev/tcp/{host}/{port}' 2>&1"
        ),
    );
    assert!(
        out.contains("Connection refused"),
        "connect to {host}:{port}: {out}"
    );
    let ms = ms_after(&out, "CONNECT");
    assert!(ms < 3000, "connect to {host}:{port} took {ms} ms: {out}");
}

#[test]
fn sandbox_without_policy_has_a_network_that_refuses_everything_fast() {
    let Some(mut d) = daemon() else { return };
    let ws = tempfile::tempdir().unwrap();
    let id = create(&d, ws.path());

    // Addressing: static IPv4 from the agent, no IPv6 anywhere.
    let out = bash(
        &d,
        &id,
        "ip -4 -o addr show dev eth0; ip route; echo V6:; cat /proc/net/if_inet6; ip -6 route; \
         ip -6 addr; echo :V6; cat /etc/resolv.conf",
    );
    assert!(out.contains("inet 10.0.2.15/24"), "{out}");
    assert!(out.contains("default via 10.0.2.2 dev eth0"), "{out}");
    let v6 = &out[out.find("V6:").unwrap() + 3..out.find(":V6").unwrap()];
    assert_eq!(
        v6.trim(),
        "",
        "the guest has IPv6 addresses or routes: {out}"
    );
    assert!(out.contains("nameserver 10.0.2.2"), "{out}");

    // Connections: refused at once, to the outside, to the gateway, over IPv6.
    assert_refused_fast(&d, &id, "192.0.2.10", 80);
    assert_refused_fast(&d, &id, "10.0.2.2", 22);
    let out = bash(
        &d,
        &id,
        &format!("{TIMED} echo V6; t timeout 20 bash -c 'exec 3<>/dev/tcp/2001:db8::1/80' 2>&1"),
    );
    assert!(
        out.contains("unreachable") || out.contains("not available"),
        "{out}"
    );
    assert!(ms_after(&out, "V6") < 3000, "{out}");

    // DNS: the sandbox resolver answers (REFUSED without a policy) at once.
    let out = bash(
        &d,
        &id,
        &format!("{TIMED} echo DNS; t getent hosts example.com"),
    );
    assert!(out.contains("rc=2"), "getent should find nothing: {out}");
    assert!(ms_after(&out, "DNS") < 3000, "{out}");

    // UDP other than DNS: port unreachable comes back (a connected socket sees it), and the
    // stack reports QUIC as blocked.
    let out = bash(
        &d,
        &id,
        "python3 -c \"\nimport socket, time\ns = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)\n\
         s.connect(('192.0.2.1', 443))\ns.send(b'x')\ntime.sleep(0.5)\ntry:\n    s.send(b'y')\n    \
         print('udp: sent')\nexcept ConnectionRefusedError:\n    print('udp: refused')\n\"",
    );
    assert!(out.contains("udp: refused"), "{out}");
    let deadline = Instant::now() + Duration::from_secs(10);
    while !d.log_text().contains("QUIC (UDP 443) is blocked") {
        assert!(Instant::now() < deadline, "no QUIC denial in the log");
        std::thread::sleep(Duration::from_millis(50));
    }

    // A daemon restart: QEMU reconnects its NIC to the new daemon's stack.
    let args = [
        "--artifacts".to_owned(),
        artifacts().unwrap().display().to_string(),
    ];
    d.kill();
    d.spawn(&args.iter().map(String::as_str).collect::<Vec<_>>());
    assert_refused_fast(&d, &id, "192.0.2.10", 443);
    let out = bash(
        &d,
        &id,
        &format!("{TIMED} echo DNS; t getent hosts example.com"),
    );
    assert!(ms_after(&out, "DNS") < 3000, "{out}");

    assert!(d.cli(&["rm", &id]).status.success());
}
