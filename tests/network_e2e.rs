//! End to end: the guest's network through the daemon's userspace stack, in real VMs.
//!
//! What a sandbox without a policy sees: eth0 with its static address, no IPv6 at all, every
//! connection refused at once (never a timeout, never a fake open), DNS refused at once, UDP
//! other than DNS answered with port unreachable, and all of it again after a daemon restart
//! (QEMU reconnects its NIC to the new daemon's stack).

mod common;

use std::io::{BufRead as _, BufReader, Write as _};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use common::{Daemon, SMALL_VMS, bash, create, follow_events, vm_daemon};

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
    let Some(mut d) = vm_daemon(SMALL_VMS) else {
        return;
    };
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
        // IPv6 is off, so the guest has no source address for it (EADDRNOTAVAIL).
        out.contains("unreachable")
            || out.contains("not available")
            || out.contains("Cannot assign requested address"),
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
    // stack reports QUIC as blocked (a `network.denied` event for this sandbox).
    let events = follow_events(&d, &format!("?sandbox={id}&since=now"));
    let out = bash(
        &d,
        &id,
        "python3 -c \"\nimport socket, time\ns = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)\n\
         s.connect(('192.0.2.1', 443))\ns.send(b'x')\ntime.sleep(0.5)\ntry:\n    s.send(b'y')\n    \
         print('udp: sent')\nexcept ConnectionRefusedError:\n    print('udp: refused')\n\"",
    );
    assert!(out.contains("udp: refused"), "{out}");
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        let e = events
            .recv_timeout(left)
            .unwrap_or_else(|e| panic!("no QUIC denial event ({e}); log:\n{}", d.log_text()));
        if e["type"] == "network.denied"
            && e["data"]["proto"] == "udp"
            && e["data"]["port"] == 443
            && e["data"]["ip"] == "192.0.2.1"
        {
            let reason = e["data"]["reason"].as_str().unwrap_or_default();
            assert!(reason.contains("QUIC (UDP 443) is blocked"), "{e}");
            break;
        }
    }

    // A daemon restart: QEMU reconnects its NIC to the new daemon's stack.
    d.kill();
    d.respawn();
    assert_refused_fast(&d, &id, "192.0.2.10", 443);
    let out = bash(
        &d,
        &id,
        &format!("{TIMED} echo DNS; t getent hosts example.com"),
    );
    assert!(ms_after(&out, "DNS") < 3000, "{out}");

    assert!(d.cli(&["rm", &id]).status.success());
}

/// A local HTTP server on 127.0.0.1: answers every request with a fixed body and hands over
/// each request's `Host` header.
fn local_http_server() -> (std::net::SocketAddr, mpsc::Receiver<String>) {
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap();
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        for conn in l.incoming() {
            let Ok(mut c) = conn else { return };
            let mut r = BufReader::new(c.try_clone().unwrap());
            let mut host = String::new();
            let mut line = String::new();
            while r.read_line(&mut line).unwrap_or(0) > 0 && line != "\r\n" {
                if let Some(h) = line.to_ascii_lowercase().strip_prefix("host:") {
                    host = h.trim().to_owned();
                }
                line.clear();
            }
            let body = "hello-from-the-upstream-map\n";
            let _ = write!(
                c,
                "HTTP/1.1 200 OK\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
                body.len()
            );
            let _ = tx.send(host);
        }
    });
    (addr, rx)
}

#[test]
fn an_allowed_name_reaches_its_upstream_and_everything_else_fails_fast() {
    let (server, hosts) = local_http_server();
    let cfg = format!(
        "{SMALL_VMS}[network]\ndefault_policy = []\nupstream_dns = \"127.0.0.1:9\"\n\
         [network.test_hosts]\n\"allowed.test\" = [\"203.0.113.10\"]\n\
         \"denied.test\" = [\"203.0.113.11\"]\n\
         [network.test_upstream_map]\n\"203.0.113.10:80\" = \"{server}\"\n\
         \"203.0.113.11:80\" = \"{server}\"\n"
    );
    let Some(d) = vm_daemon(&cfg) else { return };
    let ws = tempfile::tempdir().unwrap();
    let id = create(&d, ws.path());
    let o = d.cli(&["net", "allow", &id, "allowed.test"]);
    assert!(
        o.status.success(),
        "net allow: {}",
        String::from_utf8_lossy(&o.stderr)
    );

    // The allowed name: resolved by the sandbox resolver, the connection relayed to the
    // local server, which sees the guest's Host header.
    let out = bash(
        &d,
        &id,
        "getent hosts allowed.test; python3 -c \"\nimport urllib.request\n\
         print(urllib.request.urlopen('http://allowed.test/x', timeout=30).read().decode())\n\"",
    );
    assert!(out.contains("203.0.113.10"), "{out}");
    assert!(out.contains("hello-from-the-upstream-map"), "{out}");
    let host = hosts
        .recv_timeout(Duration::from_secs(10))
        .expect("the local server saw no request");
    assert_eq!(host, "allowed.test");

    // A name the policy does not allow: the resolver refuses it at once.
    let out = bash(
        &d,
        &id,
        &format!("{TIMED} echo DNS; t getent hosts denied.test"),
    );
    assert!(out.contains("rc=2"), "denied.test resolved: {out}");
    assert!(ms_after(&out, "DNS") < 3000, "{out}");

    // Hard-coded addresses, even one the upstream map would relay: refused at once.
    assert_refused_fast(&d, &id, "203.0.113.11", 80);
    assert_refused_fast(&d, &id, "192.0.2.10", 80);
    assert!(
        hosts.try_recv().is_err(),
        "a denied connection reached the upstream"
    );

    assert!(d.cli(&["rm", &id]).status.success());
}
