//! End to end with ONE real VM (issue 16): the daemon's guest egress goes through an explicit
//! upstream proxy (`[network] upstream_proxy`, with Basic credentials) as `CONNECT <name>:<port>`.
//!
//! The proxy is a real local `CONNECT` proxy (`common::proxy`, shared with `git_proxy_e2e`): it
//! requires the credentials, records its tunnels, and is the only way to the upstreams' names
//! (it maps `upstream.test:443`, `secret.test:443` and `plain.test:80` to loopback servers). The daemon's own resolver
//! (`upstream_dns = 127.0.0.1:9`) cannot resolve them, so the sandbox resolver answers them
//! with synthetic addresses. In the VM: curl reaches the HTTPS upstream (pass-through, the
//! guest trusting the test CA), a secret's host (intercepted: the upstream sees the value,
//! upstream TLS verified inside the tunnel), and a plaintext host, all through the proxy; an
//! unlisted name is still refused and never reaches the proxy; a name the proxy refuses (403)
//! resets the guest with a `network.upstream_failed` event that never holds the password; a
//! `upstream_no_proxy` name is reached directly. Uses the guest images from `TRYBOXI_ARTIFACTS`
//! or `_out/` (skips without them, except under CI).

mod common;

use std::collections::HashMap;
use std::io::{BufRead as _, BufReader, Write as _};
use std::net::{IpAddr, SocketAddr, TcpListener};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::proxy::{PASS as PROXY_PASS, Proxy};
use common::{Daemon, SMALL_VMS, bash, create_with, follow_events, vm_daemon};

const VALUE: &str = "sk-proxy-e2e-Ub7Yt3Rk9Pw2Qs5";

/// Reads a request head (bounded); returns its `Authorization` value ("" if none).
fn read_head<R: std::io::Read>(r: R) -> String {
    let mut r = BufReader::new(r.take(64 << 10));
    let (mut auth, mut line) = (String::new(), String::new());
    while r.read_line(&mut line).unwrap_or(0) > 0 && line != "\r\n" {
        if let Some((k, v)) = line.split_once(':')
            && k.eq_ignore_ascii_case("authorization")
        {
            auth = v.trim().to_owned();
        }
        line.clear();
    }
    auth
}

/// An HTTPS server on `ip` with `cfg`: answers `hello <tag> auth=[...]` and hands over each
/// request's `Authorization`.
fn tls_server(
    ip: IpAddr,
    cfg: Arc<rustls::ServerConfig>,
    tag: &'static str,
) -> (SocketAddr, std::sync::mpsc::Receiver<String>) {
    let l = TcpListener::bind((ip, 0)).unwrap();
    let addr = l.local_addr().unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for conn in l.incoming() {
            let Ok(tcp) = conn else { return };
            let (cfg, tx) = (cfg.clone(), tx.clone());
            std::thread::spawn(move || {
                let _ = tcp.set_read_timeout(Some(Duration::from_secs(60)));
                let Ok(conn) = rustls::ServerConnection::new(cfg) else {
                    return;
                };
                let mut s = rustls::StreamOwned::new(conn, tcp);
                let auth = read_head(&mut s);
                let body = format!("hello {tag} auth=[{auth}]\n");
                let _ = write!(
                    s,
                    "HTTP/1.1 200 OK\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
                    body.len()
                );
                let _ = s.flush();
                s.conn.send_close_notify();
                let _ = s.flush();
                let _ = tx.send(auth);
            });
        }
    });
    (addr, rx)
}

fn plain_server() -> SocketAddr {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap();
    std::thread::spawn(move || {
        for conn in l.incoming() {
            let Ok(mut c) = conn else { return };
            read_head(c.try_clone().unwrap());
            let _ = c.write_all(
                b"HTTP/1.1 200 OK\r\nContent-Length: 12\r\nConnection: close\r\n\r\nhello plain\n",
            );
        }
    });
    addr
}

/// A local address that is not loopback (loopback always bypasses the proxy), if the host has
/// one; found without sending a packet.
fn non_loopback_ip() -> Option<IpAddr> {
    let s = std::net::UdpSocket::bind("0.0.0.0:0").ok()?;
    s.connect("192.0.2.1:9").ok()?;
    let ip = s.local_addr().ok()?.ip();
    (!ip.is_loopback() && !ip.is_unspecified()).then_some(ip)
}

fn secret_set(d: &Daemon, name: &str, host: &str, value: &str) {
    let o = d.cli_stdin(&["secret", "set", name, "--host", host], value.as_bytes());
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
}

#[test]
fn guest_egress_goes_through_the_upstream_proxy_by_name() {
    let dir = tempfile::tempdir().unwrap();
    let ws = tempfile::tempdir().unwrap();
    let ca_path = ws.path().join("test-ca.txt");
    let names = ["upstream.test", "secret.test", "direct.test"];
    let cfg = common::tls::ca_signed_server(&ca_path, Some("tryboxi proxy e2e CA"), &names);
    let extra_ca = dir.path().join("extra-ca.pem");
    std::fs::copy(&ca_path, &extra_ca).unwrap();
    let loopback: IpAddr = "127.0.0.1".parse().unwrap();
    let (tls_addr, tls_seen) = tls_server(loopback, cfg.clone(), "tls");
    let plain_addr = plain_server();
    // The no-proxy upstream listens on a non-loopback address, so reaching it directly is the
    // no-proxy entry's doing (loopback would bypass the proxy anyway).
    let direct_ip = non_loopback_ip();
    if direct_ip.is_none() {
        assert!(
            std::env::var_os("CI").is_none(),
            "under CI every test runs: the host needs a non-loopback IPv4 address"
        );
        println!("the no-proxy part is skipped: the host has no non-loopback IPv4 address");
    }
    let direct = direct_ip.map(|ip| tls_server(ip, cfg.clone(), "direct"));
    let proxy = Proxy::start(
        HashMap::from([
            ("upstream.test:443".to_owned(), tls_addr),
            ("secret.test:443".to_owned(), tls_addr),
            ("plain.test:80".to_owned(), plain_addr),
        ]),
        HashMap::from([("refused.test:443".to_owned(), 403)]),
    );
    let mut config = format!(
        "{SMALL_VMS}[network]\ndefault_policy = []\nupstream_dns = \"127.0.0.1:9\"\n\
         intercept_extra_ca = \"{}\"\n\
         upstream_proxy = \"{}\"\n\
         upstream_no_proxy = [\"direct.test\"]\n\
         [network.test_hosts]\n\"direct.test\" = [\"203.0.113.40\"]\n",
        extra_ca.display(),
        proxy.url()
    );
    if let Some((addr, _)) = &direct {
        config.push_str(&format!(
            "[network.test_upstream_map]\n\"203.0.113.40:443\" = \"{addr}\"\n"
        ));
    }
    let Some(d) = vm_daemon(&config) else { return };
    let events = follow_events(&d, "?since=0");
    let mut bad: Vec<String> = Vec::new();

    secret_set(&d, "API_KEY", "secret.test", VALUE);
    let id = create_with(&d, ws.path(), &["--secret", "API_KEY"]);
    for h in [
        "upstream.test",
        "secret.test",
        "plain.test",
        "direct.test",
        "refused.test",
    ] {
        let o = d.cli(&["net", "allow", &id, h]);
        assert!(
            o.status.success(),
            "net allow {h}: {}",
            String::from_utf8_lossy(&o.stderr)
        );
    }
    let curl = "curl -sS -m 60";

    // Pass-through HTTPS to a name only the proxy reaches; the guest trusts the test CA.
    let out = bash(
        &d,
        &id,
        &format!(
            "getent hosts upstream.test; {curl} --cacert /workspace/test-ca.txt https://upstream.test/a"
        ),
    );
    if !out.contains("hello tls auth=[]") || !out.contains("198.19.") {
        bad.push(format!("pass-through through the proxy: {out}"));
    }
    let _ = tls_seen.recv_timeout(Duration::from_secs(10));
    // Intercepted (a secret's host): the value is swapped in inside the tunnel.
    let out = bash(
        &d,
        &id,
        &format!("{curl} -H \"Authorization: Bearer $API_KEY\" https://secret.test/b"),
    );
    if !out.contains("hello tls auth=[Bearer ") || out.contains(VALUE) {
        bad.push(format!("intercepted through the proxy: {out}"));
    }
    match tls_seen.recv_timeout(Duration::from_secs(30)) {
        Ok(a) if a == format!("Bearer {VALUE}") => {}
        Ok(a) => bad.push(format!("the upstream saw {} other bytes", a.len())),
        Err(_) => bad.push("the intercepted request never reached the upstream".into()),
    }
    // Plaintext HTTP: CONNECT by the Host the gate allowed.
    let out = bash(&d, &id, &format!("{curl} http://plain.test/c"));
    if !out.contains("hello plain") {
        bad.push(format!("plaintext through the proxy: {out}"));
    }
    // An unlisted name: refused by the resolver, never sent to the proxy.
    let out = bash(
        &d,
        &id,
        &format!("{curl} https://unlisted.test/ ; echo rc=$?"),
    );
    if out.contains("rc=0") {
        bad.push(format!("unlisted name reached: {out}"));
    }
    // A name the proxy refuses: the guest gets a reset.
    let out = bash(
        &d,
        &id,
        &format!("{curl} --cacert /workspace/test-ca.txt https://refused.test/ ; echo rc=$?"),
    );
    if out.contains("rc=0") {
        bad.push(format!("refused name reached: {out}"));
    }
    // The no-proxy name goes directly.
    if let Some((_, direct_seen)) = &direct {
        let out = bash(
            &d,
            &id,
            &format!("{curl} --cacert /workspace/test-ca.txt https://direct.test/d"),
        );
        if !out.contains("hello direct") {
            bad.push(format!("no-proxy name: {out}"));
        }
        if direct_seen.recv_timeout(Duration::from_secs(10)).is_err() {
            bad.push("the direct upstream saw no request".into());
        }
    }

    let targets = proxy.targets();
    for want in [
        "upstream.test:443",
        "secret.test:443",
        "plain.test:80",
        "refused.test:443",
    ] {
        if !targets.iter().any(|t| t == want) {
            bad.push(format!("the proxy never saw CONNECT {want}: {targets:?}"));
        }
    }
    if targets
        .iter()
        .any(|t| t.starts_with("unlisted") || t.starts_with("direct") || t.starts_with("198.19"))
    {
        bad.push(format!(
            "the proxy was asked for what it should not: {targets:?}"
        ));
    }
    if !proxy.all_authed() {
        bad.push("a CONNECT without the right credentials".into());
    }
    // The refusal's event: the proxy's status, the masked proxy, never the password.
    let deadline = Instant::now() + Duration::from_secs(20);
    let mut failed = None;
    while failed.is_none() && Instant::now() < deadline {
        if let Ok(ev) = events.recv_timeout(Duration::from_millis(500))
            && ev["type"] == "network.upstream_failed"
            && ev.to_string().contains("refused.test")
        {
            failed = Some(ev.to_string());
        }
    }
    match failed {
        Some(ev) if ev.contains("403") && ev.contains("***@") => {
            if ev.contains(PROXY_PASS) {
                bad.push("the upstream_failed event holds the proxy password".into());
            }
        }
        other => bad.push(format!("no upstream_failed event with 403: {other:?}")),
    }

    assert!(d.cli(&["rm", &id]).status.success());
    let log = d.log_text();
    if log.contains(PROXY_PASS) || log.contains(VALUE) {
        bad.push("the daemon log holds the proxy password or the secret".into());
    }
    assert!(bad.is_empty(), "{}\n{}", bad.join("\n"), d.log_tail(60));
}
