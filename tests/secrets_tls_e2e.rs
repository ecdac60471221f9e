//! End to end with ONE real VM and its fork (issue 16, item 3, guest side): real TLS clients
//! inside the sandbox reach an intercepted HTTPS upstream with a secret's placeholder and the
//! upstream sees the real value. The guest trusts the sandbox's interception CA through its
//! trust store and the CA env vars; curl (HTTP/1.1 and HTTP/2) and Python `urllib` work; an
//! upstream echo of the value comes back as the placeholder; a guest clock 2 h behind still
//! accepts the leaf; the placeholder sent to another allowed host is refused with a
//! `secret.blocked` event, also when a redirect leads there; pause/resume keeps the
//! placeholder and the CA; a restored VM gets the host's clock back (its checkpoint's clock was
//! set to 2020); a fork gets fresh placeholders (the parent's is not swapped in it); and
//! `secret ls` shows when a secret was last swapped in (never for one not used yet).
//!
//! The upstream is a local rustls server whose certificate comes from a test CA the daemon is
//! told to trust (`[network] intercept_extra_ca`); `api.test` is pinned to a test address that
//! the stack relays to it. Uses the guest images from `TRYBOXI_ARTIFACTS` or `_out/` (skips
//! without them, except under CI).

mod common;

use std::io::{BufReader, Read as _, Write as _};
use std::net::{SocketAddr, TcpListener};
use std::sync::mpsc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use common::tls::{
    Reply, Seen, foreign_placeholder_stays_a_string, https_upstream, intercept_config,
    read_request, seen_path,
};
use common::{SMALL_VMS, bash, create_with, follow_events, placeholder, set_secret, vm_daemon};

const VALUE: &str = "sk-tls-e2e-Hn4Jk7Lq1Ws9Xe3Rd5";
const HOST: &str = "api.test";
/// A second secret, added to the running sandbox for a host the CA did not cover yet.
const VALUE2: &str = "sk-tls-e2e-second-Qa8Zs2Xc6Vb0";
const HOST2: &str = "api2.test";

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

/// An HTTPS upstream for [`HOST`] and [`HOST2`] (certificate from a fresh test CA written to
/// `ca_path`) that echoes each request's `Authorization` back; `/redir` answers a redirect to
/// the plaintext other host.
fn tls_upstream(ca_path: &std::path::Path) -> (SocketAddr, mpsc::Receiver<Seen>) {
    https_upstream(ca_path, &[HOST, HOST2], |r| {
        if r.path == "/redir" {
            return Reply::redirect("http://other.test/cb");
        }
        Reply::ok("text/plain", format!("auth=[{}]\n", r.auth))
    })
}

/// The next `secret.blocked` event naming `host` within 20 s.
fn blocked_event(events: &mpsc::Receiver<serde_json::Value>, host: &str) -> Option<String> {
    let deadline = Instant::now() + Duration::from_secs(20);
    while Instant::now() < deadline {
        if let Ok(ev) = events.recv_timeout(Duration::from_millis(500))
            && ev["type"] == "secret.blocked"
            && ev.to_string().contains(host)
        {
            return Some(ev.to_string());
        }
    }
    None
}

/// A plaintext HTTP upstream for the other allowed host: hands over each request's
/// `Authorization`.
fn plain_upstream() -> (SocketAddr, mpsc::Receiver<String>) {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap();
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        for conn in l.incoming() {
            let Ok(mut c) = conn else { return };
            let mut r = BufReader::new(c.try_clone().unwrap().take(64 << 10));
            let auth = read_request(&mut r)
                .map(|(s, _)| s.auth)
                .unwrap_or_default();
            let _ = c.write_all(
                b"HTTP/1.1 200 OK\r\nContent-Length: 3\r\nConnection: close\r\n\r\nok\n",
            );
            let _ = tx.send(auth);
        }
    });
    (addr, rx)
}

fn now_s() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_secs() as i64
}

#[test]
fn real_tls_clients_in_the_vm_get_the_value_swapped_in_and_scrubbed_out() {
    let dir = tempfile::tempdir().unwrap();
    let ca_path = dir.path().join("upstream-ca.pem");
    let (tls_addr, tls_seen) = tls_upstream(&ca_path);
    let (plain_addr, plain_seen) = plain_upstream();
    let cfg = SMALL_VMS.to_owned()
        + &intercept_config(
            &ca_path,
            &[
                (HOST, "203.0.113.10", 443, tls_addr),
                ("other.test", "203.0.113.11", 80, plain_addr),
                (HOST2, "203.0.113.12", 443, tls_addr),
            ],
        );
    let Some(d) = vm_daemon(&cfg) else { return };
    let events = follow_events(&d, "?since=0");
    let mut bad: Vec<String> = Vec::new();

    set_secret(&d, "API_KEY", VALUE, HOST);
    let ws = tempfile::tempdir().unwrap();
    let id = create_with(&d, ws.path(), &["--secret", "API_KEY"]);
    for h in [HOST, "other.test", HOST2] {
        let o = d.cli(&["net", "allow", &id, h]);
        assert!(o.status.success(), "net allow: {}", text(&o.stderr));
    }

    // The guest clock after boot is the host's.
    let out = bash(&d, &id, "date +%s");
    let guest: i64 = out.trim().parse().unwrap_or(0);
    if (guest - now_s()).abs() > 120 {
        bad.push(format!(
            "guest clock after boot {guest} vs host {}",
            now_s()
        ));
    }

    // Every CA variable names the guest bundle, whose original was kept.
    let out = bash(
        &d,
        &id,
        "for v in SSL_CERT_FILE REQUESTS_CA_BUNDLE NODE_EXTRA_CA_CERTS CURL_CA_BUNDLE \
         GIT_SSL_CAINFO CARGO_HTTP_CAINFO; do printf '%s=%s\\n' $v \"$(printenv $v)\"; done; \
         test -s /etc/ssl/certs/ca-certificates.crt.distro && echo DISTRO-KEPT; \
         grep -c 'BEGIN CERTIFICATE' /etc/ssl/certs/ca-certificates.crt",
    );
    for v in [
        "SSL_CERT_FILE",
        "REQUESTS_CA_BUNDLE",
        "NODE_EXTRA_CA_CERTS",
        "CURL_CA_BUNDLE",
        "GIT_SSL_CAINFO",
        "CARGO_HTTP_CAINFO",
    ] {
        if !out.contains(&format!("{v}=/etc/ssl/certs/ca-certificates.crt\n")) {
            bad.push(format!("{v} not set: {out}"));
        }
    }
    if !out.contains("DISTRO-KEPT") {
        bad.push(format!("no .distro copy: {out}"));
    }

    let placeholder = placeholder(&d, &id, "API_KEY", VALUE);
    let echoed = format!("auth=[Bearer {placeholder}]");

    // curl over HTTP/1.1 and HTTP/2, Python urllib: the upstream sees the value, the guest the
    // placeholder in the echo.
    let clients: [(&str, String); 3] = [
        (
            "curl http/1.1",
            "curl -sS --http1.1 -m 60 -w '\\nv=%{http_version}\\n' \
             -H \"Authorization: Bearer $API_KEY\" https://api.test/h1"
                .into(),
        ),
        (
            "curl http/2",
            "curl -sS --http2 -m 60 -w '\\nv=%{http_version}\\n' \
             -H \"Authorization: Bearer $API_KEY\" https://api.test/h2"
                .into(),
        ),
        (
            "python urllib",
            "python3 -c \"\nimport os, urllib.request\n\
             r = urllib.request.Request('https://api.test/py', headers={'Authorization': \
             'Bearer ' + os.environ['API_KEY']})\n\
             print(urllib.request.urlopen(r, timeout=60).read().decode())\n\""
                .into(),
        ),
    ];
    for (what, script) in &clients {
        let out = bash(&d, &id, script);
        if !out.contains(&echoed) {
            bad.push(format!("{what}: no scrubbed echo: {out}"));
        }
        if out.contains(VALUE) {
            bad.push(format!("{what}: the value reached the guest"));
        }
        if *what == "curl http/2" && !out.contains("v=2") {
            bad.push(format!("{what}: not HTTP/2: {out}"));
        }
        match tls_seen
            .recv_timeout(Duration::from_secs(30))
            .map(|s| s.auth)
        {
            Ok(a) if a == format!("Bearer {VALUE}") => {}
            Ok(a) => bad.push(format!(
                "{what}: the upstream saw another Authorization ({} bytes)",
                a.len()
            )),
            Err(_) => bad.push(format!("{what}: the upstream saw no request")),
        }
    }

    // `secret ls` says when each secret was last swapped in: API_KEY now, API2_KEY (stored
    // just now, nothing sent yet) never.
    set_secret(&d, "API2_KEY", VALUE2, HOST2);
    let o = d.cli(&["secret", "ls", "--json"]);
    let ls: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap_or_default();
    let used = |n: &str| {
        ls["secrets"]
            .as_array()
            .and_then(|a| a.iter().find(|s| s["name"] == n))
            .map(|s| s["last_used_at"].clone())
    };
    if !matches!(used("API_KEY"), Some(serde_json::Value::String(_)))
        || used("API2_KEY") != Some(serde_json::Value::Null)
    {
        bad.push(format!("secret ls last used: {}", text(&o.stdout)));
    }
    if o.stdout.windows(VALUE.len()).any(|w| w == VALUE.as_bytes()) {
        bad.push("secret ls shows a value".into());
    }

    // A secret for a new host added to the running sandbox: the CA is re-issued to cover it
    // and the guest's bundle is written again before the next exec.
    let r = d.request(
        "POST",
        &format!("/v1/sandboxes/{id}/secrets"),
        Some(r#"{"name":"API2_KEY"}"#),
    );
    assert!((200..300).contains(&r.status), "{} {}", r.status, r.text());
    let out = bash(
        &d,
        &id,
        "curl -sS -m 60 -H \"Authorization: Bearer $API2_KEY\" https://api2.test/second",
    );
    if !out.contains("auth=[Bearer ") || out.contains(VALUE2) {
        bad.push(format!("new host after a secret add: {out}"));
    }
    match tls_seen
        .recv_timeout(Duration::from_secs(30))
        .map(|s| s.auth)
    {
        Ok(a) if a == format!("Bearer {VALUE2}") => {}
        Ok(a) => bad.push(format!("new host: the upstream saw {} bytes", a.len())),
        Err(_) => bad.push("new host: the upstream saw no request".into()),
    }

    // A guest clock 2 h behind still accepts the leaf.
    let out = bash(
        &d,
        &id,
        "date -s @$(( $(date +%s) - 7200 )) >/dev/null && \
         curl -sS -m 60 -H \"Authorization: Bearer $API_KEY\" https://api.test/late",
    );
    if !out.contains(&echoed) {
        bad.push(format!("clock 2 h behind: {out}"));
    }
    let _ = tls_seen.recv_timeout(Duration::from_secs(10));

    // The placeholder to another allowed host (plaintext): refused, with its event.
    let out = bash(
        &d,
        &id,
        "curl -sS -m 30 -o /dev/null -w 'code=%{http_code}\\n' \
         -H \"Authorization: Bearer $API_KEY\" http://other.test/x; echo rc=$?",
    );
    if let Ok(a) = plain_seen.recv_timeout(Duration::from_secs(3))
        && a.contains(&placeholder)
    {
        bad.push(format!("the placeholder reached other.test: {out}"));
    }
    match blocked_event(&events, "other.test") {
        Some(ev) if ev.contains("API_KEY") && ev.contains("other.test") => {
            if ev.contains(VALUE) || ev.contains(&placeholder) {
                bad.push("the secret.blocked event holds the value or placeholder".into());
            }
        }
        other => bad.push(format!(
            "no secret.blocked event for other.test: {other:?} {out}"
        )),
    }

    // A redirect to another host: the interceptor hands the 302 back (it follows nothing
    // itself), so the value goes only to api.test; a client that carries the header across
    // hosts (`--location-trusted`) carries the placeholder, which is refused at other.test.
    // Whatever the first refusal published is taken first, so the event below is the redirect's.
    while let Ok(ev) = events.recv_timeout(Duration::from_millis(500)) {
        if ev["type"] == "secret.blocked" {
            bad.push(format!("a second event for one refusal: {ev}"));
        }
    }
    let out = bash(
        &d,
        &id,
        "curl -sS -L --location-trusted -m 60 -o /dev/null -w 'code=%{http_code}\\n' \
         -H \"Authorization: Bearer $API_KEY\" https://api.test/redir; echo rc=$?",
    );
    match seen_path(&tls_seen, "/redir", Duration::from_secs(30)) {
        Some(s) if s.auth == format!("Bearer {VALUE}") => {}
        Some(s) => bad.push(format!(
            "redirect: the first hop saw {} bytes",
            s.auth.len()
        )),
        None => bad.push(format!("redirect: the first hop saw no request: {out}")),
    }
    if let Ok(a) = plain_seen.recv_timeout(Duration::from_secs(3))
        && (a.contains(&placeholder) || a.contains(VALUE))
    {
        bad.push(format!(
            "the redirect carried the secret to other.test: {out}"
        ));
    }
    match blocked_event(&events, "other.test") {
        Some(ev) if ev.contains("API_KEY") => {}
        other => bad.push(format!(
            "redirect: no secret.blocked for other.test: {other:?} {out}"
        )),
    }

    // Pause to disk and resume: the same placeholder, and the guest still trusts the CA.
    for verb in ["pause", "resume"] {
        let o = d.cli(&[verb, &id]);
        assert!(o.status.success(), "{verb}: {}", text(&o.stderr));
    }
    let out = bash(
        &d,
        &id,
        "curl -sS -m 60 -H \"Authorization: Bearer $API_KEY\" https://api.test/resumed",
    );
    if !out.contains(&echoed) {
        bad.push(format!("after pause/resume: {out}"));
    }
    match seen_path(&tls_seen, "/resumed", Duration::from_secs(30)) {
        Some(s) if s.auth == format!("Bearer {VALUE}") => {}
        _ => bad.push(format!(
            "after pause/resume: the upstream saw no value: {out}"
        )),
    }

    // A restore puts the VM back on its checkpoint's clock; the daemon sets the host's.
    let out = bash(&d, &id, "date -s @1600000000 >/dev/null; date +%s");
    assert!(out.trim().starts_with("16000000"), "{out}");
    let o = d.cli(&["snapshot", "create", &id]);
    assert!(o.status.success(), "snapshot: {}", text(&o.stderr));
    let snap = common::first_word(&o);
    let o = d.cli(&["restore", &id, &snap]);
    assert!(o.status.success(), "restore: {}", text(&o.stderr));
    let out = bash(&d, &id, "date +%s");
    let guest: i64 = out.trim().parse().unwrap_or(0);
    if (guest - now_s()).abs() > 120 {
        bad.push(format!(
            "guest clock after restore {guest} vs host {}",
            now_s()
        ));
    }
    // And the restored VM still trusts the CA.
    let out = bash(
        &d,
        &id,
        "curl -sS -m 60 -H \"Authorization: Bearer $API_KEY\" https://api.test/restored",
    );
    if !out.contains(&echoed) {
        bad.push(format!("after restore: {out}"));
    }

    // A fork gets fresh placeholders: its own works (the upstream gets the value, the guest
    // its own placeholder back), the parent's is only a string in the child.
    let o = d.cli(&["fork", &id]);
    assert!(o.status.success(), "fork: {}", text(&o.stderr));
    let child = common::first_word(&o);
    let child_ph = common::placeholder(&d, &child, "API_KEY", VALUE);
    if child_ph == placeholder {
        bad.push("the fork kept its parent's placeholder".into());
    }
    let out = bash(
        &d,
        &child,
        "curl -sS -m 60 -H \"Authorization: Bearer $API_KEY\" https://api.test/child",
    );
    if !out.contains(&format!("auth=[Bearer {child_ph}]")) {
        bad.push(format!("fork: its own placeholder: {out}"));
    }
    match seen_path(&tls_seen, "/child", Duration::from_secs(30)) {
        Some(s) if s.auth == format!("Bearer {VALUE}") => {}
        Some(s) => bad.push(format!("fork: the upstream saw {} bytes", s.auth.len())),
        None => bad.push(format!("fork: the upstream saw no request: {out}")),
    }
    bad.extend(foreign_placeholder_stays_a_string(
        &d,
        &child,
        &placeholder,
        &tls_seen,
        "/stale",
        VALUE,
        "fork child (its parent's placeholder)",
    ));
    assert!(d.cli(&["rm", &child]).status.success());

    assert!(d.cli(&["rm", &id]).status.success());
    if d.log_text().contains(VALUE) {
        bad.push("the daemon log holds the value".into());
    }
    assert!(bad.is_empty(), "{}", bad.join("\n"));
}
