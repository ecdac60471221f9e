//! End to end with ONE real VM (issue 16, items 1, 2 and 7): a secret stored through the CLI
//! (value on stdin) never enters the sandbox it is given to. Its execs see only the
//! placeholder; a `grep -r` over the guest finds no value; an exec holding the value in argv,
//! env or stdin is refused naming the secret; a file written through the API and a synced file
//! holding it are refused / left out and reported; a secret added to the running sandbox shows
//! up in the next exec; `secret ls` shows no value; and at the end no file of the data root
//! (daemon log, store with its events, exec logs, sync base) but `secrets.json`, no event, no
//! trace (the sandbox's and every exec's) and no `/metrics` line holds the value. Uses the
//! guest images from `TRYBOXI_ARTIFACTS` or `_out/` (skips without them, except under CI).

mod common;

use std::io::Write as _;
use std::os::unix::fs::PermissionsExt as _;
use std::path::Path;
use std::process::{Command, Output, Stdio};
use std::time::Duration;

use common::{BIN, Daemon, SMALL_VMS, create_with, follow_events, sh_out, vm_daemon};

/// The value: distinctive, and long enough to be scanned for (>= 8 bytes).
const VALUE: &str = "sk-e2e-Zq9x7Lm2Pw4Rt6Yu8Io0Kv3";
/// Its two halves: a guest command joins them, so no request carries the whole value.
const HALF_A: &str = "sk-e2e-Zq9x7Lm2";
const HALF_B: &str = "Pw4Rt6Yu8Io0Kv3";
const OTHER: &str = "second-secret-value-4711-abcd";
/// In a synced file before it is stored.
const LATE: &str = "late-secret-value-99887766";

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

/// Every form the value may take in a leak.
fn forms(v: &str) -> Vec<Vec<u8>> {
    use base64::Engine as _;
    vec![
        v.as_bytes().to_vec(),
        base64::engine::general_purpose::STANDARD
            .encode(v)
            .into_bytes(),
        hex::encode(v).into_bytes(),
    ]
}

fn holds(hay: &[u8], v: &str) -> bool {
    forms(v)
        .iter()
        .any(|f| hay.windows(f.len()).any(|w| w == f.as_slice()))
}

/// `tryboxi <args>` with `input` on stdin.
fn cli_stdin(d: &Daemon, args: &[&str], input: &[u8]) -> Output {
    let mut c = Command::new(BIN)
        .args(args)
        .env("TRYBOXI_HOME", d.root())
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    c.stdin.take().unwrap().write_all(input).unwrap();
    c.wait_with_output().unwrap()
}

fn write(root: &Path, rel: &str, data: &str) {
    let p = root.join(rel);
    std::fs::create_dir_all(p.parent().unwrap()).unwrap();
    std::fs::write(p, data).unwrap();
}

/// The ids of the execs that left a directory under `dir` (`…/execs/exe_…`).
fn exec_ids(dir: &Path, out: &mut Vec<String>) {
    let Ok(rd) = std::fs::read_dir(dir) else {
        return;
    };
    for e in rd.flatten() {
        let name = e.file_name().to_string_lossy().into_owned();
        if e.file_type().is_ok_and(|t| t.is_dir()) {
            if name.starts_with("exe_") {
                out.push(name);
            } else {
                exec_ids(&e.path(), out);
            }
        }
    }
}

/// Files under `dir` holding the value (guest disks and RAM files are left to the guest's grep).
fn leaking_files(dir: &Path, out: &mut Vec<String>) {
    let Ok(rd) = std::fs::read_dir(dir) else {
        return;
    };
    for e in rd.flatten() {
        let p = e.path();
        let Ok(m) = std::fs::symlink_metadata(&p) else {
            continue;
        };
        let name = e.file_name().to_string_lossy().into_owned();
        if m.is_dir() {
            leaking_files(&p, out);
        } else if m.is_file()
            && name != "secrets.json"
            && !name.ends_with(".qcow2")
            && !name.ends_with(".img")
            && !name.ends_with(".ram")
            && !name.ends_with(".sock")
            && m.len() < 256 << 20
            && let Ok(b) = std::fs::read(&p)
            && holds(&b, VALUE)
        {
            out.push(p.display().to_string());
        }
    }
}

#[test]
fn a_secret_never_enters_the_sandbox_and_never_leaks_from_the_daemon() {
    let Some(d) = vm_daemon(SMALL_VMS) else {
        return;
    };
    let events = follow_events(&d, "?since=0");
    // Every failure is collected, so one run shows them all.
    let mut bad: Vec<String> = Vec::new();

    // Set through the CLI, value on stdin (with the trailing newline `echo` adds).
    let o = cli_stdin(
        &d,
        &["secret", "set", "API_KEY", "--host", "api.example.com"],
        format!("{VALUE}\n").as_bytes(),
    );
    assert!(o.status.success(), "{}{}", text(&o.stdout), text(&o.stderr));
    let o = cli_stdin(
        &d,
        &["secret", "set", "OTHER_KEY", "--host", "other.example.com"],
        OTHER.as_bytes(),
    );
    assert!(o.status.success(), "{}", text(&o.stderr));
    let file = d.root().join("secrets.json");
    let mode = std::fs::metadata(&file).unwrap().permissions().mode() & 0o777;
    if mode != 0o600 {
        bad.push(format!("secrets.json has mode {mode:o}"));
    }
    let ls = d.cli(&["secret", "ls", "--json"]);
    let ls_text = text(&ls.stdout);
    if !ls_text.contains("API_KEY") || !ls_text.contains("api.example.com") {
        bad.push(format!("secret ls misses the secret: {ls_text}"));
    }
    if holds(&ls.stdout, VALUE) || holds(&ls.stdout, OTHER) {
        bad.push("secret ls shows a value".into());
    }

    // A repo with a file holding the value: left out of the first sync.
    let repo = tempfile::tempdir().unwrap();
    let r = repo.path();
    write(r, "README.md", "hello\n");
    write(r, "config/leak.env", &format!("API_KEY={VALUE}\n"));
    write(r, "notes.txt", &format!("{LATE}\n"));
    let id = create_with(&d, r, &["--secret", "API_KEY"]);

    // A value stored after a sync took it in: `secret set` names the sandbox.
    let o = cli_stdin(
        &d,
        &["secret", "set", "LATE", "--host", "late.example.com"],
        LATE.as_bytes(),
    );
    if !(o.status.success() && text(&o.stderr).contains(&id)) {
        bad.push(format!(
            "secret set does not name the sandbox already holding it: {}",
            text(&o.stderr)
        ));
    }

    // env shows the placeholder only.
    let (_, env) = sh_out(&d, &id, "env");
    let placeholder = env
        .lines()
        .find_map(|l| l.strip_prefix("API_KEY="))
        .unwrap_or_default()
        .to_owned();
    if !(placeholder.starts_with("tbx_") && placeholder.len() == 36) {
        bad.push(format!("no placeholder in env: {env}"));
    }
    if env.contains("OTHER_KEY") {
        bad.push("a secret the sandbox was not given is in its env".into());
    }
    if holds(env.as_bytes(), VALUE) {
        bad.push("env holds the value".into());
    }
    let (code, _) = sh_out(&d, &id, "test -e /workspace/config/leak.env");
    if code != Some(1) {
        bad.push(format!(
            "the file holding the value reached the VM (test -e: {code:?})"
        ));
    }
    let (code, _) = sh_out(&d, &id, "test -e /workspace/README.md");
    if code != Some(0) {
        bad.push("the rest of the repo did not sync".into());
    }

    // Nowhere in the guest: the halves are joined inside it.
    let (code, out) = sh_out(
        &d,
        &id,
        &format!(
            "A={HALF_A}; B={HALF_B}; grep -rlsF --exclude-dir=proc --exclude-dir=sys \
             --exclude-dir=dev -- \"$A$B\" / ; echo rc=$?"
        ),
    );
    if !out.contains("rc=1") {
        bad.push(format!(
            "grep -r found the value in the VM ({code:?}): {out}"
        ));
    }

    // Refused inbound: argv, env, stdin (base64 of it), each naming the secret.
    let b64 = {
        use base64::Engine as _;
        base64::engine::general_purpose::STANDARD.encode(VALUE)
    };
    let env_arg = format!("X={VALUE}");
    let attempts: Vec<(&str, Output)> = vec![
        ("argv", d.cli(&["exec", &id, "--", "echo", VALUE])),
        ("env", d.cli(&["exec", &id, "-e", &env_arg, "--", "true"])),
        (
            "stdin",
            cli_stdin(
                &d,
                &["exec", &id, "--stdin", "--", "cat"],
                format!("token: {b64}\n").as_bytes(),
            ),
        ),
    ];
    for (what, o) in attempts {
        let err = text(&o.stderr);
        if o.status.success() || !err.contains("API_KEY") {
            bad.push(format!(
                "exec with the value in {what} was not refused naming the secret: {err}"
            ));
        }
        if holds(&o.stderr, VALUE) || holds(&o.stdout, VALUE) {
            bad.push(format!("the refusal of {what} shows the value"));
        }
    }

    // A file written through the API.
    let body = serde_json::json!({"path": "/workspace/x.txt", "content": format!("k={VALUE}")});
    let resp = d.request(
        "PUT",
        &format!("/v1/sandboxes/{id}/files?path=/workspace/x.txt"),
        Some(&body.to_string()),
    );
    if resp.status != 403 || !resp.text().contains("API_KEY") || holds(&resp.body, VALUE) {
        bad.push(format!(
            "PUT files with the value: {} {}",
            resp.status,
            resp.text()
        ));
    }

    // A synced file (hex of the value) is left out and reported.
    write(r, "src/leak.hex", &format!("{}\n", hex::encode(VALUE)));
    write(r, "src/ok.txt", "fine\n");
    let o = d.cli(&["sync", &id, "--json"]);
    let report: serde_json::Value = serde_json::from_slice(&o.stdout)
        .unwrap_or_else(|e| panic!("sync --json: {e}: {}{}", text(&o.stdout), text(&o.stderr)));
    let skipped = report["secret_values_skipped"].to_string();
    if !(skipped.contains("src/leak.hex") && skipped.contains("API_KEY")) {
        bad.push(format!("the sync report does not list the file: {report}"));
    }
    let (code, _) = sh_out(
        &d,
        &id,
        "test -e /workspace/src/ok.txt && ! test -e /workspace/src/leak.hex",
    );
    if code != Some(0) {
        bad.push("the synced file holding the value reached the VM (or ok.txt did not)".into());
    }

    // Pause and resume keep the placeholder (the sandbox's processes hold it).
    let p = d.cli(&["pause", &id]);
    let q = d.cli(&["resume", &id]);
    if !(p.status.success() && q.status.success()) {
        bad.push(format!(
            "pause/resume: {}{}",
            text(&p.stderr),
            text(&q.stderr)
        ));
    }
    let (_, env_after) = sh_out(&d, &id, "env");
    if !env_after.contains(&format!("API_KEY={placeholder}")) {
        bad.push(format!(
            "the placeholder changed across pause/resume: {env_after}"
        ));
    }

    // Added to the running sandbox: the next exec sees it.
    let resp = d.request(
        "POST",
        &format!("/v1/sandboxes/{id}/secrets"),
        Some(r#"{"name":"OTHER_KEY"}"#),
    );
    if resp.status != 200 {
        bad.push(format!("add a secret: {} {}", resp.status, resp.text()));
    }
    let (_, env2) = sh_out(&d, &id, "env");
    let other_ph = env2
        .lines()
        .find_map(|l| l.strip_prefix("OTHER_KEY="))
        .unwrap_or_default();
    if !other_ph.starts_with("tbx_") || !env2.contains(&format!("API_KEY={placeholder}")) {
        bad.push(format!(
            "the added secret is not in the next exec's env: {env2}"
        ));
    }
    let resp = d.request(
        "POST",
        &format!("/v1/sandboxes/{id}/secrets"),
        Some(r#"{"name":"NOT_STORED"}"#),
    );
    if resp.status != 400 {
        bad.push(format!(
            "an unknown secret: {} {}",
            resp.status,
            resp.text()
        ));
    }

    // Nothing the daemon wrote or answers holds a value.
    let metrics = d.request("GET", "/metrics", None);
    for v in [VALUE, OTHER] {
        if holds(&metrics.body, v) {
            bad.push("/metrics holds a value".into());
        }
    }
    let mut seen = Vec::new();
    while let Ok(ev) = events.recv_timeout(Duration::from_secs(2)) {
        seen.push(ev.to_string());
    }
    let all_events = seen.join("\n");
    if !all_events.contains("secret.inbound_refused") {
        bad.push("no secret.inbound_refused event".into());
    }
    for v in [VALUE, OTHER] {
        if holds(all_events.as_bytes(), v) {
            bad.push("an event holds a value".into());
        }
    }
    // The traces of the sandbox and of every exec it ran.
    let mut ids = vec![id.clone()];
    exec_ids(d.root(), &mut ids);
    if ids.len() < 5 {
        bad.push(format!("too few execs found for the trace check: {ids:?}"));
    }
    for t in &ids {
        let r = d.request("GET", &format!("/v1/traces/{t}"), None);
        if r.status != 200 {
            bad.push(format!("trace {t}: {}", r.status));
        }
        if holds(&r.body, VALUE) || holds(&r.body, OTHER) {
            bad.push(format!("the trace of {t} holds a value"));
        }
    }
    // While the sandbox exists (its exec logs and sync base), then after it is gone.
    for phase in ["with the sandbox", "after rm"] {
        let mut files = Vec::new();
        leaking_files(d.root(), &mut files);
        if !files.is_empty() {
            bad.push(format!(
                "{phase}: files of the data root hold the value: {files:?}"
            ));
        }
        if phase == "with the sandbox" {
            let rm = d.cli(&["rm", &id]);
            assert!(rm.status.success(), "{}", text(&rm.stderr));
        }
    }
    if holds(d.log_text().as_bytes(), VALUE) || holds(d.log_text().as_bytes(), OTHER) {
        bad.push("the daemon log holds a value".into());
    }
    let rm = d.cli(&["secret", "rm", "OTHER_KEY"]);
    if !rm.status.success() {
        bad.push(format!("secret rm: {}", text(&rm.stderr)));
    }
    assert!(bad.is_empty(), "{bad:#?}\n{}", d.log_text());
}

/// No VM: `secret set` on a terminal prompts with echo off, so the value typed after the
/// prompt never comes back on the terminal, and it is stored.
#[test]
fn secret_set_on_a_terminal_prompts_without_echo() {
    use std::io::Read as _;
    let d = Daemon::start(None, &[]);
    let pty = nix::pty::openpty(None, None).unwrap();
    let mut master = std::fs::File::from(pty.master);
    let mut c = Command::new(BIN)
        .args(["secret", "set", "TTY_KEY", "--host", "tty.example.com"])
        .env("TRYBOXI_HOME", d.root())
        .stdin(Stdio::from(pty.slave))
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    // The prompt (on stderr) comes once echo is off; the terminal's output is collected aside.
    let (tx, rx) = std::sync::mpsc::channel::<u8>();
    let mut err = c.stderr.take().unwrap();
    std::thread::spawn(move || {
        let mut b = [0u8; 1];
        while matches!(err.read(&mut b), Ok(1)) {
            let _ = tx.send(b[0]);
        }
    });
    let mut echo_reader = master.try_clone().unwrap();
    let (etx, erx) = std::sync::mpsc::channel::<Vec<u8>>();
    std::thread::spawn(move || {
        let mut b = [0u8; 256];
        while let Ok(n @ 1..) = echo_reader.read(&mut b) {
            let _ = etx.send(b[..n].to_vec());
        }
    });
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    let mut prompt = Vec::new();
    while !text(&prompt).contains("(not shown)") {
        let left = deadline.saturating_duration_since(std::time::Instant::now());
        match rx.recv_timeout(left) {
            Ok(b) => prompt.push(b),
            Err(_) => panic!("no prompt: {}", text(&prompt)),
        }
    }
    master.write_all(format!("{VALUE}\n").as_bytes()).unwrap();
    let status = c.wait().unwrap();
    assert!(status.success(), "{}", text(&prompt));
    let mut shown = Vec::new();
    while let Ok(b) = erx.recv_timeout(Duration::from_millis(500)) {
        shown.extend(b);
    }
    assert!(
        !holds(&shown, VALUE),
        "the terminal echoed the value: {shown:?}"
    );
    assert!(!holds(&prompt, VALUE));
    let r = d.request("GET", "/v1/secrets", None);
    assert!(r.text().contains("TTY_KEY"), "{}", r.text());
    let stored = std::fs::read(d.root().join("secrets.json")).unwrap();
    assert!(holds(&stored, VALUE), "the typed value was not stored");
}

/// No VM: the API over the socket. A set answers without the value, `GET /v1/secrets` never
/// has it, a create naming an unknown secret is a 400 before anything boots, the value does
/// not reach the daemon log, and a `secrets.json` the daemon cannot read stops it from
/// starting without overwriting the file.
#[test]
fn the_secret_api_never_answers_a_value_and_an_unreadable_store_stops_the_daemon() {
    let mut d = Daemon::start(None, &[]);
    let body =
        serde_json::json!({"value": VALUE, "hosts": ["API.example.com"], "headers": ["X-Foo"]});
    let r = d.request("PUT", "/v1/secrets/API_KEY", Some(&body.to_string()));
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(r.json()["hosts"], serde_json::json!(["api.example.com"]));
    assert!(!holds(&r.body, VALUE), "{}", r.text());
    let r = d.request("GET", "/v1/secrets", None);
    assert_eq!(r.json()["secrets"][0]["name"], "API_KEY");
    assert!(!holds(&r.body, VALUE), "{}", r.text());
    // A value of the wrong type is refused without being quoted.
    let r = d.request(
        "PUT",
        "/v1/secrets/API_KEY",
        Some(r#"{"value": 918273645546372819, "hosts": ["a.io"]}"#),
    );
    assert_eq!(r.status, 400);
    assert!(!r.text().contains("918273645546372819"), "{}", r.text());
    let repo = tempfile::tempdir().unwrap();
    let create = serde_json::json!({
        "workspace": {"host_path": repo.path()},
        "secrets": ["NOT_STORED"],
    });
    let r = d.request("POST", "/v1/sandboxes", Some(&create.to_string()));
    assert_eq!(r.status, 400, "{}", r.text());
    assert!(r.text().contains("NOT_STORED"), "{}", r.text());
    let r = d.request("DELETE", "/v1/secrets/NOT_STORED", None);
    assert_eq!(r.status, 404);
    assert!(!holds(d.log_text().as_bytes(), VALUE));
    // Unreadable: the daemon refuses to start and leaves the file as it was.
    d.stop();
    let file = d.root().join("secrets.json");
    std::fs::write(&file, b"{\"version\":1,\"secrets\":[").unwrap();
    let out = Command::new(BIN)
        .arg("serve")
        .env("TRYBOXI_HOME", d.root())
        .stdin(Stdio::null())
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(
        text(&out.stderr).contains("secrets.json"),
        "{}",
        text(&out.stderr)
    );
    assert_eq!(
        std::fs::read(&file).unwrap(),
        b"{\"version\":1,\"secrets\":["
    );
}

/// No VM: `tryboxi mcp --secret NAME` sends the user's secrets with every create the model
/// asks for (a name the store does not hold comes back as the daemon's 400, naming it).
#[test]
fn the_mcp_servers_secret_flag_reaches_the_create() {
    use std::io::{BufRead as _, BufReader};
    let d = Daemon::start(None, &[]);
    let ws = tempfile::tempdir().unwrap();
    let mut mcp = Command::new(BIN)
        .args(["mcp", "--workspace", ws.path().to_str().unwrap()])
        .args(["--secret", "NOT_STORED_MCP"])
        .env("TRYBOXI_HOME", d.root())
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let mut stdin = mcp.stdin.take().unwrap();
    let mut lines = BufReader::new(mcp.stdout.take().unwrap()).lines();
    let mut send = |v: serde_json::Value| writeln!(stdin, "{v}").unwrap();
    send(
        serde_json::json!({"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": {
        "protocolVersion": "2025-06-18", "capabilities": {},
        "clientInfo": {"name": "secrets_e2e", "version": "0"}}}),
    );
    send(serde_json::json!({"jsonrpc": "2.0", "method": "notifications/initialized"}));
    send(
        serde_json::json!({"jsonrpc": "2.0", "id": 2, "method": "tools/call",
        "params": {"name": "create", "arguments": {}}}),
    );
    let answer = loop {
        let line = lines.next().expect("the MCP server closed stdout").unwrap();
        let v: serde_json::Value = serde_json::from_str(&line).unwrap();
        if v["id"] == 2 {
            break v;
        }
    };
    drop(stdin);
    let _ = mcp.kill();
    let _ = mcp.wait();
    let s = answer.to_string();
    assert!(s.contains("NOT_STORED_MCP"), "{s}");
}
