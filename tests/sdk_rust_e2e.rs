//! The Rust SDK from the outside: `examples/rust-harness` (built on `tryboxi::client` only) runs
//! its agent loop against a real daemon and VM: a failing test run changes nothing on the host,
//! a fixing one is shown in the diff and applied, with an artifact id for undo.

mod common;

use std::path::PathBuf;
use std::process::Command;

use common::{SMALL_VMS, vm_daemon};

/// The example's binary (`cargo test` builds examples; a lone `cargo test --test` does not,
/// so it is built here then).
fn harness_bin() -> PathBuf {
    let bin = PathBuf::from(common::BIN);
    let exe = bin.parent().unwrap().join("examples").join("rust-harness");
    if !exe.exists() {
        let cargo = option_env!("CARGO").unwrap_or("cargo");
        let st = Command::new(cargo)
            .args(["build", "--example", "rust-harness"])
            .current_dir(env!("CARGO_MANIFEST_DIR"))
            .status()
            .expect("run cargo build --example rust-harness");
        assert!(st.success(), "building the example failed");
    }
    exe
}

#[test]
fn the_rust_harness_runs_tests_shows_the_diff_and_applies() {
    let Some(d) = vm_daemon(SMALL_VMS) else {
        return;
    };
    let exe = harness_bin();
    let repo = tempfile::tempdir().unwrap();
    std::fs::write(repo.path().join("value.txt"), "broken\n").unwrap();
    std::fs::write(
        repo.path().join("check.sh"),
        "test \"$(cat value.txt)\" = fixed || { echo 'value is not fixed' >&2; exit 1; }\necho tests-pass\n",
    )
    .unwrap();
    let run = |test: &str, apply: bool| {
        let mut cmd = Command::new(&exe);
        cmd.args(["--repo", repo.path().to_str().unwrap(), "--test", test])
            .env("TRYBOXI_HOME", d.home.path());
        if apply {
            cmd.arg("--apply");
        }
        let o = cmd.output().expect("run the harness");
        (
            o.status.code(),
            String::from_utf8_lossy(&o.stdout).into_owned(),
            String::from_utf8_lossy(&o.stderr).into_owned(),
        )
    };

    // The tests fail: their exit code and stderr come through; nothing changes on the host.
    let (code, out, err) = run("sh check.sh", true);
    assert_eq!(code, Some(1), "{out}{err}\n{}", d.log_tail(30));
    assert!(err.contains("value is not fixed"), "{err}");
    assert!(out.contains("tests exited with 1"), "{out}");
    assert!(!out.contains("applied"), "{out}");
    assert_eq!(
        std::fs::read_to_string(repo.path().join("value.txt")).unwrap(),
        "broken\n"
    );

    // The agent's fix: shown in the diff, applied with an artifact, the host file changed.
    let (code, out, err) = run("echo fixed > value.txt && sh check.sh", true);
    assert_eq!(code, Some(0), "{out}{err}\n{}", d.log_tail(30));
    assert!(out.contains("tests-pass"), "{out}");
    assert!(out.contains("changed value.txt Modified +1 -1"), "{out}");
    assert!(
        out.contains("applied 1 file(s), 0 conflict(s); undo with artifact art_"),
        "{out}"
    );
    assert_eq!(
        std::fs::read_to_string(repo.path().join("value.txt")).unwrap(),
        "fixed\n"
    );
    // The harness threw its sandboxes away.
    let ls = d.request("GET", "/v1/sandboxes", None).json();
    assert_eq!(ls["sandboxes"].as_array().map(Vec::len), Some(0), "{ls}");

    // A usage error is 2.
    let o = Command::new(&exe).arg("--nope").output().unwrap();
    assert_eq!(o.status.code(), Some(2));
}
