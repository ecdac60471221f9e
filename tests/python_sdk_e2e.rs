//! The Python SDK (`sdk/python`, package `tryboxi`) and its example harness
//! (`examples/python-harness/harness.py`):
//!
//! - `python_sdk_unit_tests_pass`: the SDK's own unit tests (`sdk/python/tests`, standard
//!   library `unittest` against a fake daemon on a temporary unix socket) — no VM.
//! - `harness_and_sdk_against_a_real_vm`: the SDK pip-installed into a fresh venv (as a user
//!   would: `pip install ./sdk/python`), then the harness runs against a real daemon booting one
//!   real VM on a tiny repo whose check fails until the harness's fix step repairs it; the
//!   harness shows the diff and applies it (the host file changes). Then `tests/python_sdk/
//!   checks.py` drives the same sandbox through the installed SDK: exec with streaming
//!   callbacks, stdin, env, timeout, files, snapshot/restore, pause/resume, typed exceptions,
//!   undo of the harness's apply, rm.
//!
//! Needs `python3` (>= 3.9, with venv) and, for the VM test, the guest images
//! (`TRYBOXI_ARTIFACTS`, else `_out/`). Without them a test skips with a message, except under
//! CI, where that is a failure.

mod common;

use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::Duration;

use common::{SMALL_VMS, skip_unless_ci, vm_daemon, wait_bounded};

const SDK: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/sdk/python");
const HARNESS: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/examples/python-harness/harness.py"
);
const CHECKS: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/python_sdk/checks.py");

/// `python3` on PATH when it is 3.9 or newer.
fn python3() -> Option<PathBuf> {
    let ok = Command::new("python3")
        .args(["-c", "import sys, venv; assert sys.version_info >= (3, 9)"])
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success());
    if !ok {
        skip_unless_ci("no python3 >= 3.9 with venv on PATH (`cargo xtask deps` installs it)");
    }
    ok.then(|| PathBuf::from("python3"))
}

/// Run `cmd` with its output captured, at most `limit`.
fn run_bounded(cmd: &mut Command, limit: Duration) -> Output {
    let dir = tempfile::tempdir().unwrap();
    let (out, err) = (dir.path().join("out"), dir.path().join("err"));
    let mut child = cmd
        .stdin(Stdio::null())
        .stdout(std::fs::File::create(&out).unwrap())
        .stderr(std::fs::File::create(&err).unwrap())
        .spawn()
        .expect("spawn");
    let status = wait_bounded(&mut child, limit);
    Output {
        status,
        stdout: std::fs::read(&out).unwrap(),
        stderr: std::fs::read(&err).unwrap(),
    }
}

fn text(o: &Output) -> String {
    format!(
        "--- stdout\n{}\n--- stderr\n{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

/// The number in unittest's `Ran N tests` line.
fn tests_ran(stderr: &str) -> usize {
    stderr
        .lines()
        .find_map(|l| {
            l.strip_prefix("Ran ")?
                .split_whitespace()
                .next()?
                .parse()
                .ok()
        })
        .unwrap_or(0)
}

#[test]
fn python_sdk_unit_tests_pass() {
    let Some(py) = python3() else { return };
    let o = run_bounded(
        Command::new(py)
            .args(["-m", "unittest", "discover", "-v", "-s"])
            .arg(format!("{SDK}/tests"))
            // No __pycache__ in the source tree.
            .env("PYTHONDONTWRITEBYTECODE", "1"),
        Duration::from_secs(180),
    );
    let stderr = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success(), "SDK unit tests failed:\n{}", text(&o));
    assert!(tests_ran(&stderr) >= 25, "too few tests ran:\n{stderr}");
    if std::env::var_os("CI").is_some() {
        assert!(
            !stderr.contains("skipped"),
            "a test skipped under CI:\n{stderr}"
        );
    }
}

/// A fresh venv in `dir` with the SDK installed by pip from a copy of `sdk/python` (pip builds
/// in the source tree; the checkout stays clean). Offline when the venv's own setuptools can
/// build it; else pip fetches the build backend from the machine's configured index.
fn install_sdk(py: &Path, dir: &Path) -> PathBuf {
    let src = dir.join("sdk");
    std::fs::create_dir_all(src.join("src/tryboxi")).unwrap();
    for f in ["pyproject.toml", "README.md"] {
        std::fs::copy(Path::new(SDK).join(f), src.join(f)).unwrap();
    }
    for e in std::fs::read_dir(Path::new(SDK).join("src/tryboxi")).unwrap() {
        let p = e.unwrap().path();
        if p.is_file() {
            std::fs::copy(&p, src.join("src/tryboxi").join(p.file_name().unwrap())).unwrap();
        }
    }
    let venv = dir.join("venv");
    let o = run_bounded(
        Command::new(py).args(["-m", "venv"]).arg(&venv),
        Duration::from_secs(120),
    );
    assert!(o.status.success(), "python3 -m venv:\n{}", text(&o));
    let vpy = venv.join("bin/python3");
    let pip = |extra: &[&str]| {
        run_bounded(
            Command::new(&vpy)
                .args(["-m", "pip", "install", "--quiet", "--no-deps"])
                .args(extra)
                .arg(&src),
            Duration::from_secs(300),
        )
    };
    let offline = pip(&["--no-build-isolation", "--no-index"]);
    if !offline.status.success() {
        let online = pip(&[]);
        assert!(
            online.status.success(),
            "pip install ./sdk/python failed offline:\n{}\nand with the index:\n{}",
            text(&offline),
            text(&online)
        );
    }
    vpy
}

#[test]
fn harness_and_sdk_against_a_real_vm() {
    let Some(py) = python3() else { return };
    let Some(d) = vm_daemon(SMALL_VMS) else {
        return;
    };
    let tmp = tempfile::tempdir().unwrap();
    let vpy = install_sdk(&py, tmp.path());

    let repo = tmp.path().join("repo");
    std::fs::create_dir(&repo).unwrap();
    std::fs::write(repo.join("value.txt"), "broken\n").unwrap();
    std::fs::write(
        repo.join("check.sh"),
        "v=$(cat value.txt)\n\
         if [ \"$v\" = fixed ]; then echo \"check passed\"; else echo \"value is $v, want fixed\" >&2; exit 1; fi\n",
    )
    .unwrap();

    // The agent loop: tests fail, the fix step edits value.txt in the VM, tests pass, diff, apply.
    let o = run_bounded(
        Command::new(&vpy)
            .arg(HARNESS)
            .args(["--repo", repo.to_str().unwrap()])
            .args(["--test", "sh check.sh"])
            .args(["--fix", "echo fixed > value.txt"])
            .args(["--apply", "--keep", "--timeout", "120"])
            .env("TRYBOXI_HOME", d.root())
            .current_dir(tmp.path()),
        Duration::from_secs(600),
    );
    let out = String::from_utf8_lossy(&o.stdout).into_owned();
    let err = String::from_utf8_lossy(&o.stderr).into_owned();
    assert!(
        o.status.success(),
        "harness failed ({}):\n{}\n--- daemon\n{}",
        o.status,
        text(&o),
        d.log_tail(100)
    );
    for want in [
        "-- tests, round 1: exit 1",
        "== fix: echo fixed > value.txt",
        "-- tests, round 2: exit 0",
        "check passed",
        "tests: passed",
        "diff: 1 file(s) changed in the sandbox",
        "modified     value.txt (+1 -1)",
        "-broken",
        "+fixed",
        "applied: value.txt",
    ] {
        assert!(out.contains(want), "harness output lacks `{want}`:\n{out}");
    }
    assert!(
        err.contains("value is broken, want fixed"),
        "the failing check's stderr was not streamed:\n{err}"
    );
    assert_eq!(
        std::fs::read_to_string(repo.join("value.txt")).unwrap(),
        "fixed\n",
        "apply did not change the host file"
    );
    let field = |prefix: &str| -> String {
        out.lines()
            .find_map(|l| l.strip_prefix(prefix))
            .unwrap_or_else(|| panic!("no `{prefix}` line:\n{out}"))
            .split_whitespace()
            .next()
            .unwrap()
            .to_owned()
    };
    let artifact = field("artifact: ");
    let sbx = field("kept: ");
    assert!(artifact.starts_with("art_"), "{artifact}");
    assert!(sbx.starts_with("sbx_"), "{sbx}");

    // The installed SDK on the same sandbox.
    let o = run_bounded(
        Command::new(&vpy)
            .arg(CHECKS)
            .args([&sbx, &artifact, repo.to_str().unwrap()])
            .env("TRYBOXI_HOME", d.root())
            .current_dir(tmp.path()),
        Duration::from_secs(300),
    );
    assert!(
        o.status.success(),
        "checks.py failed:\n{}\n--- daemon\n{}",
        text(&o),
        d.log_tail(100)
    );
    let stdout = String::from_utf8_lossy(&o.stdout);
    let summary: serde_json::Value = stdout
        .lines()
        .find_map(|l| l.strip_prefix("SUMMARY "))
        .map(|j| serde_json::from_str(j).unwrap())
        .unwrap_or_else(|| panic!("no SUMMARY:\n{}", text(&o)));
    let s = &summary;
    let venv = tmp.path().join("venv");
    assert!(
        s["sdk_file"]
            .as_str()
            .unwrap()
            .starts_with(venv.to_str().unwrap()),
        "checks.py did not use the pip-installed SDK: {s}"
    );
    assert_eq!(s["state"], "ready", "{s}");
    assert_eq!(s["listed"], true, "{s}");
    let cb = &s["callback"];
    assert_eq!(cb["exit_code"], 7, "{s}");
    assert_eq!(
        cb["stdout_bytes"],
        hex::encode(b"out1\ncaf\xc3\xa9 \xff\n"),
        "exact stdout bytes (a chunk that is not UTF-8 arrives as data_b64): {s}"
    );
    let joined: String = cb["out_chunks"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| c.as_str().unwrap())
        .collect();
    assert_eq!(joined, "out1\ncafé \u{fffd}\n", "{s}");
    assert_eq!(cb["err_joined"], "err1\nerr2\n", "{s}");
    assert_eq!(cb["stderr"], "err1\nerr2\n", "{s}");
    assert!(
        cb["first_chunk_lead_s"].as_f64().unwrap() >= 0.5,
        "the first output chunk reached the callback only at the end (not streamed): {s}"
    );
    assert_eq!(s["stdin_roundtrip"], true, "{s}");
    assert_eq!(s["env_cwd"], "bar\n/tmp\n", "{s}");
    assert_eq!(s["timeout"]["timed_out"], true, "{s}");
    assert_eq!(s["file_roundtrip"], true, "{s}");
    let l = &s["lifecycle"];
    assert_eq!(l["snapshot_name"], "sdk-before", "{s}");
    assert_eq!(l["listed"], serde_json::json!(["sdk-before"]), "{s}");
    assert_eq!(
        l["after_restore"], "absent\n",
        "restore did not bring the VM back: {s}"
    );
    assert_eq!(
        (&l["paused"], &l["resumed"]),
        (&"paused".into(), &"ready".into()),
        "{s}"
    );
    assert_eq!(l["exec_after_resume"], "back\n", "{s}");
    let e = &s["errors"];
    assert_eq!(
        e["unknown_sandbox"],
        serde_json::json!(["NotFound", 404, "not_found"]),
        "{s}"
    );
    assert_eq!(
        e["exec_unknown_sandbox"],
        serde_json::json!(["NotFound", 404, "not_found"]),
        "{s}"
    );
    assert_eq!(e["unknown_artifact"][0], "NotFound", "{s}");
    assert_eq!(
        e["no_daemon"],
        serde_json::json!(["DaemonUnreachable"]),
        "{s}"
    );
    assert_eq!(s["undo_restored"], serde_json::json!(["value.txt"]), "{s}");
    assert_eq!(
        std::fs::read_to_string(repo.join("value.txt")).unwrap(),
        "broken\n",
        "undo did not restore the host file"
    );
    assert_eq!(s["gone_after_rm"], true, "{s}");
}
