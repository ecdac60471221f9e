//! The daemon's HTTP contract without VMs: access control, errors, the OpenAPI document,
//! the single-daemon lock and graceful shutdown.
// This test binary is dynamically linked, so its own NSS lookups are safe (clippy.toml bans them
// for the static product binary).
#![allow(clippy::disallowed_methods)]

mod common;

use std::os::unix::fs::PermissionsExt;
use std::os::unix::process::CommandExt;
use std::process::Command;

use common::{BIN, Daemon, free_port, raw_http};

#[test]
fn health_answers_with_facts() {
    let d = Daemon::start(None, &[]);
    let r = d.request("GET", "/v1/health", None);
    assert_eq!(r.status, 200);
    let j = r.json();
    assert_eq!(j["status"], "ok");
    assert_eq!(j["data_root"].as_str().unwrap(), d.root().to_str().unwrap());
}

#[test]
fn socket_is_owner_only() {
    let d = Daemon::start(None, &[]);
    let mode = std::fs::metadata(d.socket()).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode, 0o600, "socket mode {mode:o}");
    let mode = std::fs::metadata(d.root().join("token"))
        .unwrap()
        .permissions()
        .mode()
        & 0o777;
    assert_eq!(mode, 0o600, "token mode {mode:o}");
}

#[test]
fn openapi_document_is_served_and_parses() {
    let d = Daemon::start(None, &[]);
    let r = d.request("GET", "/v1/openapi.yaml", None);
    assert_eq!(r.status, 200);
    assert!(
        r.headers
            .to_ascii_lowercase()
            .contains("content-type: application/yaml")
    );
    let docs = yaml_rust2::YamlLoader::load_from_str(&r.text()).expect("valid YAML");
    let doc = &docs[0];
    assert!(doc["openapi"].as_str().unwrap().starts_with("3."));
    for p in [
        "/v1/health",
        "/v1/sandboxes",
        "/v1/sandboxes/{id}",
        "/v1/sandboxes/{id}/exec",
    ] {
        assert!(
            !doc["paths"][p].is_badvalue(),
            "{p} missing from the served document"
        );
    }
    assert_eq!(
        r.text(),
        std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/api/openapi.yaml")).unwrap()
    );
}

/// Every operation that takes a body documents the 408 of `[http] body_timeout_s`.
#[test]
fn every_operation_with_a_body_documents_the_body_timeout() {
    let text =
        std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/api/openapi.yaml")).unwrap();
    let doc = &yaml_rust2::YamlLoader::load_from_str(&text).unwrap()[0];
    let mut with_body = 0;
    for (path, item) in doc["paths"].as_hash().unwrap() {
        for (method, op) in item.as_hash().unwrap() {
            if op["requestBody"].is_badvalue() {
                continue;
            }
            with_body += 1;
            let r408 = &op["responses"]["408"];
            assert!(
                !r408.is_badvalue(),
                "{method:?} {path:?} takes a body but does not document 408"
            );
        }
    }
    assert!(with_body >= 10, "{with_body}");
}

#[test]
fn malformed_json_is_400_with_an_error_body() {
    let d = Daemon::start(None, &[]);
    let r = d.request("POST", "/v1/sandboxes", Some("{\"workspace\": "));
    assert_eq!(r.status, 400);
    assert_eq!(r.error_code(), "bad_request");
    let r = d.request(
        "POST",
        "/v1/sandboxes",
        Some("{\"workspace\":{\"host_path\":\"/tmp\"},\"nope\":1}"),
    );
    assert_eq!(r.status, 400, "{}", r.text());
}

#[test]
fn unknown_sandbox_is_404_and_unknown_route_too() {
    let d = Daemon::start(None, &[]);
    let r = d.request("GET", "/v1/sandboxes/sbx_0123456789abcdef", None);
    assert_eq!(r.status, 404);
    assert_eq!(r.error_code(), "not_found");
    let r = d.request("DELETE", "/v1/sandboxes/sbx_0123456789abcdef", None);
    assert_eq!(r.status, 404);
    let r = d.request(
        "POST",
        "/v1/sandboxes/sbx_0123456789abcdef/exec",
        Some(r#"{"cmd":"true"}"#),
    );
    assert_eq!(r.status, 404);
    let r = d.request("GET", "/v1/nothing", None);
    assert_eq!(r.status, 404);
    assert_eq!(r.error_code(), "not_found");
    let r = d.request("PATCH", "/v1/sandboxes", None);
    assert_eq!(r.status, 405);
}

#[test]
fn missing_workspace_is_422_and_relative_is_400() {
    let d = Daemon::start(None, &[]);
    let r = d.request(
        "POST",
        "/v1/sandboxes",
        Some(r#"{"workspace":{"host_path":"/definitely/not/here"}}"#),
    );
    assert_eq!(r.status, 422, "{}", r.text());
    assert_eq!(r.error_code(), "unprocessable");
    let r = d.request(
        "POST",
        "/v1/sandboxes",
        Some(r#"{"workspace":{"host_path":"rel/path"}}"#),
    );
    assert_eq!(r.status, 400, "{}", r.text());
    let r = d.request("GET", "/v1/sandboxes", None);
    assert_eq!(
        r.json()["sandboxes"].as_array().unwrap().len(),
        0,
        "a failed create left a record"
    );
}

#[test]
fn second_daemon_on_the_same_root_is_refused() {
    let d = Daemon::start(None, &[]);
    let out = Command::new(BIN)
        .arg("serve")
        .env("TRYBOXI_HOME", d.root())
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("already serves"), "{err}");
    // The first daemon still works.
    assert_eq!(d.request("GET", "/v1/health", None).status, 200);
}

#[test]
fn stale_socket_is_replaced_and_sigterm_shuts_down_cleanly() {
    let mut d = Daemon::start(None, &[]);
    let st = d.stop();
    assert!(st.success(), "exit status {st}: {}", d.log_text());
    assert!(
        !d.socket().exists(),
        "socket left behind after a clean shutdown"
    );
    // A stale socket file (e.g. after a crash) does not stop the next start.
    std::os::unix::net::UnixListener::bind(d.socket()).unwrap();
    d.spawn(&[]);
    assert_eq!(d.request("GET", "/v1/health", None).status, 200);
}

#[test]
fn other_users_are_refused_by_peer_credentials() {
    if !nix::unistd::geteuid().is_root() {
        eprintln!("skipped: needs root to run a client under another uid");
        return;
    }
    let d = Daemon::start(None, &[]);
    // Open up the file modes so only SO_PEERCRED stands in the way.
    std::fs::set_permissions(d.root(), std::fs::Permissions::from_mode(0o755)).unwrap();
    std::fs::set_permissions(d.socket(), std::fs::Permissions::from_mode(0o777)).unwrap();
    let out = Command::new(BIN)
        .args(["ls"])
        .env("TRYBOXI_HOME", d.root())
        .uid(65534)
        .gid(65534)
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "another uid was served: {err}");
    assert!(err.contains("uid 65534 may not use this daemon"), "{err}");
    // The owner still is served.
    assert!(d.cli(&["ls"]).status.success());
}

#[test]
fn tcp_needs_a_token_and_a_loopback_host() {
    let port = free_port();
    let d = Daemon::start(Some(&format!("tcp_listen = \"127.0.0.1:{port}\"\n")), &[]);
    let token = String::from_utf8(d.cli(&["token"]).stdout)
        .unwrap()
        .trim()
        .to_owned();
    assert!(token.len() >= 32, "token `{token}`");
    let host = format!("127.0.0.1:{port}");
    let call = |headers: &[(&str, &str)]| {
        let mut s = std::net::TcpStream::connect(("127.0.0.1", port)).unwrap();
        raw_http(&mut s, "GET", "/v1/health", None, headers).unwrap()
    };
    let r = call(&[("Host", &host)]);
    assert_eq!(r.status, 401);
    assert_eq!(r.error_code(), "unauthorized");
    let r = call(&[("Host", &host), ("Authorization", "Bearer wrong")]);
    assert_eq!(r.status, 401);
    let bearer = format!("Bearer {token}");
    let r = call(&[("Host", &host), ("Authorization", &bearer)]);
    assert_eq!(r.status, 200, "{}", r.text());
    let r = call(&[
        ("Host", &format!("attacker.example:{port}")),
        ("Authorization", &bearer),
    ]);
    assert_eq!(r.status, 403);
    let r = call(&[
        ("Host", &host),
        ("Origin", "http://attacker.example"),
        ("Authorization", &bearer),
    ]);
    assert_eq!(r.status, 403);
}

#[test]
fn cli_lists_every_subcommand_and_bad_usage_exits_2() {
    let out = Command::new(BIN).arg("--help").output().unwrap();
    let help = String::from_utf8_lossy(&out.stdout);
    for c in [
        "serve", "install", "create", "exec", "ls", "rm", "diff", "apply", "pull", "undo",
        "events", "trace", "logs", "doctor", "mcp", "token", "version", "sync", "snapshot",
        "restore",
    ] {
        assert!(
            help.lines().any(|l| l.trim_start().starts_with(c)),
            "`{c}` missing from --help:\n{help}"
        );
    }
    // A missing argument is a usage error with clap's message, not a crash.
    let out = Command::new(BIN).arg("undo").output().unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("Usage"));
}

#[test]
fn alias_names_pick_the_face() {
    let dir = tempfile::tempdir().unwrap();
    let ctl = dir.path().join("sandboxctl");
    std::os::unix::fs::symlink(BIN, &ctl).unwrap();
    let out = Command::new(&ctl).arg("version").output().unwrap();
    assert!(String::from_utf8_lossy(&out.stdout).starts_with("tryboxi "));
    // sandboxd = serve: a second one on a held root is refused by the lock, proving it served.
    let d = Daemon::start(None, &[]);
    let sd = dir.path().join("sandboxd");
    std::os::unix::fs::symlink(BIN, &sd).unwrap();
    let out = Command::new(&sd)
        .env("TRYBOXI_HOME", d.root())
        .output()
        .unwrap();
    assert!(String::from_utf8_lossy(&out.stderr).contains("already serves"));
}

#[test]
fn cli_without_daemon_says_how_to_start_it() {
    let home = tempfile::tempdir().unwrap();
    let out = Command::new(BIN)
        .arg("ls")
        .env("TRYBOXI_HOME", home.path())
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(3));
    assert!(String::from_utf8_lossy(&out.stderr).contains("tryboxi serve"));
}

/// `/`, the caller's home folder, the data root, anything in it and any folder holding it are
/// never a workspace: 403 before anything boots (no VM needed), symlinks resolved.
#[test]
fn root_home_and_data_root_are_never_a_workspace() {
    let d = Daemon::start(None, &[]);
    let root = d.root().canonicalize().unwrap();
    let inside = root.join("sandboxes");
    std::fs::create_dir_all(&inside).unwrap();
    let links = tempfile::tempdir().unwrap();
    let link = links.path().join("data-link");
    std::os::unix::fs::symlink(&root, &link).unwrap();
    let mut cases = vec![
        (std::path::PathBuf::from("/"), "file system root"),
        (root.clone(), "holds tryboxi's data root"),
        (
            root.parent().unwrap().to_path_buf(),
            "holds tryboxi's data root",
        ),
        (link, "holds tryboxi's data root"),
        (inside, "inside tryboxi's data root"),
    ];
    let uid = nix::unistd::getuid();
    match nix::unistd::User::from_uid(uid).ok().flatten() {
        Some(u) if u.dir.is_dir() => cases.push((u.dir, "home folder")),
        _ => println!("uid {uid} has no home folder: its refusal is not exercised"),
    }
    for (ws, why) in cases {
        let body = serde_json::json!({"workspace": {"host_path": ws}}).to_string();
        let r = d.request("POST", "/v1/sandboxes", Some(&body));
        assert_eq!(r.status, 403, "{}: {}", ws.display(), r.text());
        assert_eq!(r.error_code(), "forbidden");
        let msg = r.json()["error"]["message"].as_str().unwrap().to_owned();
        assert!(msg.contains(why), "{}: {msg}", ws.display());
    }
    let r = d.request("GET", "/v1/sandboxes", None);
    assert_eq!(
        r.json()["sandboxes"],
        serde_json::json!([]),
        "nothing was created"
    );
    // A project folder passes that check (and is refused next, for the vCPUs asked).
    let project = tempfile::tempdir().unwrap();
    let body = serde_json::json!({"workspace": {"host_path": project.path()}, "vcpus": 0});
    let r = d.request("POST", "/v1/sandboxes", Some(&body.to_string()));
    assert_eq!(r.status, 400, "{}", r.text());
    assert!(r.text().contains("vcpus"), "{}", r.text());
}
