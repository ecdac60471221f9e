//! Execs that outlive their request (detach, list, attach with replay, later stdin, signals,
//! a pause and resume under them), pty execs (size, resize) and execs as a guest user, in one
//! real VM.

mod common;

use std::io::{BufRead, BufReader, Write};
use std::os::unix::net::UnixStream;
use std::time::{Duration, Instant};

use common::{Daemon, SMALL_VMS, create, vm_daemon};
use serde_json::{Value, json};

/// POST an exec and read its stream only up to `started`; the connection is then dropped.
/// The exec id.
fn start_and_leave(d: &Daemon, id: &str, body: &Value) -> String {
    let mut s = UnixStream::connect(d.socket()).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(300))).unwrap();
    let body = body.to_string();
    write!(
        s,
        "POST /v1/sandboxes/{id}/exec HTTP/1.1\r\nHost: localhost\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    let mut r = BufReader::new(s);
    let mut line = String::new();
    loop {
        line.clear();
        assert!(
            r.read_line(&mut line).unwrap() > 0,
            "no started line\n{}",
            d.log_tail(50)
        );
        if line.contains("\"started\"") {
            let v: Value = serde_json::from_str(line.trim()).unwrap();
            assert!(v["pid"].as_u64().is_some_and(|p| p > 1), "{v}");
            return v["exec_id"].as_str().unwrap().to_owned();
        }
        assert!(!line.contains("\"error\""), "{line}");
    }
}

/// A whole NDJSON exec stream (`exec` or `attach`): its events.
fn events(d: &Daemon, path: &str, body: &Value) -> Vec<Value> {
    let r = d.request("POST", path, Some(&body.to_string()));
    assert_eq!(r.status, 200, "{}", r.text());
    r.text()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

/// The stdout of a list of events, and the last event.
fn stdout_and_end(evs: &[Value]) -> (String, Value) {
    let out = evs
        .iter()
        .filter(|e| e["type"] == "stdout")
        .map(|e| e["data"].as_str().unwrap_or_default())
        .collect();
    (out, evs.last().cloned().unwrap_or(Value::Null))
}

fn live_ids(d: &Daemon, id: &str) -> Vec<String> {
    let r = d.request("GET", &format!("/v1/sandboxes/{id}/execs"), None);
    assert_eq!(r.status, 200, "{}", r.text());
    r.json()["execs"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e["id"].as_str().unwrap().to_owned())
        .collect()
}

/// Wait (at most a minute) until `exec` is no longer listed as running.
fn wait_ended(d: &Daemon, id: &str, exec: &str) {
    let deadline = Instant::now() + Duration::from_secs(60);
    while live_ids(d, id).iter().any(|e| e == exec) {
        assert!(Instant::now() < deadline, "{exec} still runs");
        std::thread::sleep(Duration::from_millis(100));
    }
}

#[test]
fn detached_pty_and_user_execs() {
    let Some(d) = vm_daemon(SMALL_VMS) else {
        return;
    };
    let ws = tempfile::tempdir().unwrap();
    let id = create(&d, ws.path());
    let exec_path = format!("/v1/sandboxes/{id}/exec");

    // A detached exec outlives its request, takes stdin later, and is attached with replay.
    let e = start_and_leave(
        &d,
        &id,
        &json!({"cmd": "read x; echo got $x; sleep 1; echo done", "detach": true,
                "stdin_open": true, "tag": "reader"}),
    );
    // Its caller left; it is still listed (and `got hello` below shows it still ran).
    assert!(
        live_ids(&d, &id).contains(&e),
        "the detached exec was killed"
    );
    let info = d.request("GET", &format!("/v1/execs/{e}"), None).json();
    assert_eq!(info["running"], true, "{info}");
    assert_eq!(info["tag"], "reader", "{info}");
    assert_eq!(info["detached"], true, "{info}");
    let r = d.request(
        "POST",
        &format!("/v1/execs/{e}/stdin"),
        Some(r#"{"data":"hello\n"}"#),
    );
    assert_eq!(r.status, 200, "{}", r.text());
    let evs = events(
        &d,
        &format!("/v1/execs/{e}/attach"),
        &json!({"replay": true}),
    );
    assert_eq!(evs[0]["type"], "started", "{evs:?}");
    let (out, end) = stdout_and_end(&evs);
    assert_eq!(out, "got hello\ndone\n", "{evs:?}");
    assert_eq!(end["type"], "exit", "{end}");
    assert_eq!(end["exit_code"], 0, "{end}");
    wait_ended(&d, &id, &e);
    // Ended: no more input (409); attach answers the replay and the exit.
    let r = d.request(
        "POST",
        &format!("/v1/execs/{e}/stdin"),
        Some(r#"{"data":"x"}"#),
    );
    assert_eq!(r.status, 409, "{}", r.text());
    let evs = events(
        &d,
        &format!("/v1/execs/{e}/attach"),
        &json!({"replay": true}),
    );
    assert_eq!(stdout_and_end(&evs), ("got hello\ndone\n".into(), end));

    // SIGTERM ends a detached sleep with signal 15.
    let e = start_and_leave(&d, &id, &json!({"argv": ["sleep", "1000"], "detach": true}));
    let r = d.request(
        "POST",
        &format!("/v1/execs/{e}/signal"),
        Some(r#"{"signal":"SIGTERM"}"#),
    );
    assert_eq!(r.status, 200, "{}", r.text());
    let evs = events(&d, &format!("/v1/execs/{e}/attach"), &json!({}));
    let end = evs.last().unwrap();
    assert_eq!(end["type"], "exit", "{evs:?}");
    assert_eq!(end["signal"], 15, "{end}");

    // An attached exec whose caller goes away is still killed.
    let e = start_and_leave(&d, &id, &json!({"argv": ["sleep", "333"]}));
    wait_ended(&d, &id, &e);
    let info = d.request("GET", &format!("/v1/execs/{e}"), None).json();
    assert!(
        info["error"]
            .as_str()
            .unwrap_or_default()
            .contains("killed"),
        "{info}"
    );

    // A pty: a terminal of the asked size, resizable.
    let evs = events(
        &d,
        &exec_path,
        &json!({"cmd": "tty; stty size", "pty": {"rows": 33, "cols": 101}}),
    );
    let (out, end) = stdout_and_end(&evs);
    assert!(out.starts_with("/dev/pts/"), "{out:?}");
    assert!(out.contains("33 101"), "{out:?}");
    assert_eq!(end["exit_code"], 0, "{end}");
    let e = start_and_leave(
        &d,
        &id,
        &json!({"cmd": "read x; stty size", "pty": {"rows": 10, "cols": 20},
                "detach": true, "stdin_open": true}),
    );
    let r = d.request(
        "POST",
        &format!("/v1/execs/{e}/resize"),
        Some(r#"{"rows":40,"cols":120}"#),
    );
    assert_eq!(r.status, 200, "{}", r.text());
    let r = d.request(
        "POST",
        &format!("/v1/execs/{e}/stdin"),
        Some(r#"{"data":"go\n"}"#),
    );
    assert_eq!(r.status, 200, "{}", r.text());
    let evs = events(
        &d,
        &format!("/v1/execs/{e}/attach"),
        &json!({"replay": true}),
    );
    let (out, _) = stdout_and_end(&evs);
    assert!(out.contains("40 120"), "{out:?}");
    // A non-pty exec cannot be resized.
    let e = start_and_leave(&d, &id, &json!({"argv": ["sleep", "1000"], "detach": true}));
    let r = d.request(
        "POST",
        &format!("/v1/execs/{e}/resize"),
        Some(r#"{"rows":40,"cols":120}"#),
    );
    assert_eq!(r.status, 409, "{}", r.text());

    // The CLI: list, kill, exec -d, attach (exit code = the command's).
    let o = d.cli(&["execs", &id]);
    assert!(String::from_utf8_lossy(&o.stdout).contains(&e), "{o:?}");
    let o = d.cli(&["kill", &e, "-s", "KILL"]);
    assert!(o.status.success(), "{o:?}");
    wait_ended(&d, &id, &e);
    let o = d.cli(&[
        "exec",
        "-d",
        &id,
        "--",
        "sh",
        "-c",
        "echo hi; sleep 1; exit 3",
    ]);
    assert!(o.status.success(), "{o:?}");
    let e = String::from_utf8_lossy(&o.stdout).trim().to_owned();
    assert!(e.starts_with("exe_"), "{e}");
    let o = d.cli(&["attach", &e]);
    assert_eq!(o.status.code(), Some(3), "{o:?}");
    assert_eq!(String::from_utf8_lossy(&o.stdout), "hi\n");

    // As the guest user `user`: its name, home and passwordless sudo.
    let evs = events(
        &d,
        &exec_path,
        &json!({"cmd": "id -un; echo $HOME; sudo -n true && echo sudo-ok", "user": "user"}),
    );
    let (out, end) = stdout_and_end(&evs);
    assert_eq!(out, "user\n/home/user\nsudo-ok\n", "{evs:?}");
    assert_eq!(end["exit_code"], 0, "{end}");
    let o = d.cli(&["exec", "-u", "user", &id, "--", "id", "-u"]);
    assert_eq!(String::from_utf8_lossy(&o.stdout), "1000\n", "{o:?}");
    // An unknown user is a clear 400.
    let r = d.request(
        "POST",
        &exec_path,
        Some(r#"{"cmd":"true","user":"nosuchuser"}"#),
    );
    assert_eq!(r.status, 400, "{}", r.text());
    assert!(r.text().contains("no user `nosuchuser`"), "{}", r.text());
    // A running exec survives a pause: still listed while paused; after the resume its
    // owner re-attaches (the agent's `Resume`), so later stdin reaches it and its output and
    // exit arrive.
    let e = start_and_leave(
        &d,
        &id,
        &json!({"cmd": "echo before; read x; echo after $x", "detach": true, "stdin_open": true}),
    );
    // An attached exec's stream ends at the pause (`vm_lost`): its caller does not wait.
    let attached = std::thread::scope(|sc| {
        let t = sc.spawn(|| events(&d, &exec_path, &json!({"argv": ["sleep", "30"]})));
        let deadline = Instant::now() + Duration::from_secs(60);
        while live_ids(&d, &id).len() < 2 {
            assert!(Instant::now() < deadline, "the attached exec never started");
            std::thread::sleep(Duration::from_millis(50));
        }
        let r = d.request("POST", &format!("/v1/sandboxes/{id}/pause"), None);
        assert_eq!(r.status, 200, "{}", r.text());
        t.join().unwrap()
    });
    let end = attached.last().unwrap();
    assert_eq!(end["type"], "error", "{attached:?}");
    assert_eq!(end["code"], "vm_lost", "{end}");
    assert_eq!(
        live_ids(&d, &id),
        std::slice::from_ref(&e),
        "a pause ended the detached exec"
    );
    let r = d.request("POST", &format!("/v1/sandboxes/{id}/resume"), None);
    assert_eq!(r.status, 200, "{}", r.text());
    // The owner re-attaches within a poll or two; until then input is refused (409).
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let r = d.request(
            "POST",
            &format!("/v1/execs/{e}/stdin"),
            Some(r#"{"data":"z\n"}"#),
        );
        if r.status == 200 {
            break;
        }
        assert_eq!(r.status, 409, "{}", r.text());
        assert!(Instant::now() < deadline, "{}", r.text());
        std::thread::sleep(Duration::from_millis(200));
    }
    let evs = events(
        &d,
        &format!("/v1/execs/{e}/attach"),
        &json!({"replay": true}),
    );
    let (out, end) = stdout_and_end(&evs);
    assert_eq!(out, "before\nafter z\n", "{evs:?}");
    assert_eq!(end["exit_code"], 0, "{end}");
    // Bad sizes and names are refused before anything runs.
    for bad in [
        r#"{"cmd":"true","pty":{"rows":0,"cols":80}}"#,
        r#"{"cmd":"true","user":"Root"}"#,
    ] {
        assert_eq!(
            d.request("POST", &exec_path, Some(bad)).status,
            400,
            "{bad}"
        );
    }
}
