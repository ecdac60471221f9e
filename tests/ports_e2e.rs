//! Port exposure in a real VM (`tryboxi port`): a server inside the guest answers through a
//! loopback port on the host, through the sandbox's userspace network stack; the listing,
//! the refusals, a paused sandbox resumed by a connection, the listener bound again after a
//! daemon restart, and everything gone with `rm`. Skips (with a message) without guest
//! images, except under CI.

mod common;

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

use common::{SMALL_VMS, first_word, free_port, sh_out, vm_daemon};

/// `GET /` over a plain TcpStream: the whole answer ("" when the connection was closed at
/// once or refused).
fn get(host_port: u16) -> String {
    let Ok(mut s) = TcpStream::connect(("127.0.0.1", host_port)) else {
        return String::new();
    };
    s.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
    let req = format!("GET / HTTP/1.0\r\nHost: 127.0.0.1:{host_port}\r\n\r\n");
    if s.write_all(req.as_bytes()).is_err() {
        return String::new();
    }
    let mut out = Vec::new();
    let _ = s.read_to_end(&mut out);
    String::from_utf8_lossy(&out).into_owned()
}

/// [`get`] until the answer lists `name` (bounded).
fn get_until(host_port: u16, name: &str, what: &str) -> String {
    let deadline = Instant::now() + Duration::from_secs(120);
    loop {
        let r = get(host_port);
        if r.contains(name) {
            return r;
        }
        assert!(Instant::now() < deadline, "{what}: last answer {r:?}");
        std::thread::sleep(Duration::from_millis(200));
    }
}

#[test]
fn a_guest_server_answers_through_an_exposed_port() {
    let Some(mut d) = vm_daemon(&format!("{SMALL_VMS}shutdown = \"leave\"\n")) else {
        return;
    };
    let o = d.cli(&["create"]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let id = first_word(&o);
    let (code, _) = sh_out(&d, &id, "echo hi > /workspace/hello-port.txt");
    assert_eq!(code, Some(0));

    // Exposed before anything listens: a connection is closed at once, nothing hangs.
    let r = d.request(
        "POST",
        &format!("/v1/sandboxes/{id}/ports"),
        Some(r#"{"port":3000}"#),
    );
    assert_eq!(r.status, 201, "{}", r.text());
    let p = r.json();
    let host_port = p["host_port"].as_u64().unwrap() as u16;
    assert_eq!(p["port"], 3000);
    assert_eq!(p["url"], format!("http://127.0.0.1:{host_port}"));
    let t0 = Instant::now();
    assert_eq!(get(host_port), "");
    assert!(t0.elapsed() < Duration::from_secs(10), "{:?}", t0.elapsed());

    // A server in the guest (in a session of its own, outliving the exec).
    let (code, _) = sh_out(
        &d,
        &id,
        "cd /workspace && setsid nohup python3 -m http.server 3000 >/dev/null 2>&1 < /dev/null &",
    );
    assert_eq!(code, Some(0));
    let page = get_until(host_port, "hello-port.txt", "the directory listing");
    assert!(page.starts_with("HTTP/1.0 200"), "{page}");

    // Listed, in `ls` too.
    let list = d
        .request("GET", &format!("/v1/sandboxes/{id}/ports"), None)
        .json();
    assert_eq!(list["ports"][0]["host_port"], host_port as u64, "{list}");
    let ls = String::from_utf8_lossy(&d.cli(&["ls"]).stdout).into_owned();
    assert!(
        ls.contains(&format!("3000 -> http://127.0.0.1:{host_port}")),
        "{ls}"
    );

    // Refusals: a privileged host port, the same guest port twice.
    let r = d.request(
        "POST",
        &format!("/v1/sandboxes/{id}/ports"),
        Some(r#"{"port":3001,"host_port":80}"#),
    );
    assert_eq!(r.status, 400, "{}", r.text());
    let r = d.request(
        "POST",
        &format!("/v1/sandboxes/{id}/ports"),
        Some(r#"{"port":3000}"#),
    );
    assert_eq!(r.status, 409, "{}", r.text());

    // The CLI: a chosen host port, listed, removed.
    let chosen = free_port();
    let o = d.cli(&["port", &id, "3000", "--host-port", &chosen.to_string()]);
    assert!(!o.status.success(), "exposed twice");
    let o = d.cli(&["port", &id, "8000", "--host-port", &chosen.to_string()]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    assert_eq!(
        String::from_utf8_lossy(&o.stdout).trim(),
        format!("http://127.0.0.1:{chosen}")
    );
    let o = d.cli(&["port", &id]);
    let listed = String::from_utf8_lossy(&o.stdout).into_owned();
    assert!(
        listed.contains("8000") && listed.contains("3000"),
        "{listed}"
    );
    let o = d.cli(&["port", &id, "--rm", "8000"]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    assert!(
        TcpStream::connect(("127.0.0.1", chosen)).is_err(),
        "still listening after --rm"
    );

    // A paused sandbox: the next connection resumes it, and the server is still there.
    let o = d.cli(&["pause", &id]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    get_until(host_port, "hello-port.txt", "the listing after a pause");
    let s = d
        .request("GET", &format!("/v1/sandboxes/{id}"), None)
        .json();
    assert_eq!(s["state"], "ready", "{s}");

    // A daemon restart: the listener is bound again on the same host port.
    d.stop();
    assert_eq!(get(host_port), "", "the listener outlived the daemon");
    d.respawn();
    get_until(
        host_port,
        "hello-port.txt",
        "the listing after a daemon restart",
    );

    // rm: the listener goes.
    let o = d.cli(&["rm", &id]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    assert!(
        TcpStream::connect(("127.0.0.1", host_port)).is_err(),
        "still listening after rm"
    );
}
