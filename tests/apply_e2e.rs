//! End to end with a real VM whose workspace holds what a hostile agent would leave there:
//! apply brings back only the executable bit of a mode (no setuid/setgid/sticky, no
//! world-writable), no symlink that resolves outside the repo through another link, and no
//! file over `sync.max_file_mib` (the host's copy stays as it is, never truncated). Uses the
//! guest images from `TRYBOXI_ARTIFACTS` or `_out/` (skips without them, except under CI).

mod common;

use std::os::unix::fs::PermissionsExt;
use std::path::Path;

use common::{Daemon, SMALL_VMS, create, sh, vm_daemon};

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

fn write(root: &Path, rel: &str, data: &str, mode: u32) {
    let p = root.join(rel);
    std::fs::create_dir_all(p.parent().unwrap()).unwrap();
    std::fs::write(&p, data).unwrap();
    std::fs::set_permissions(&p, std::fs::Permissions::from_mode(mode)).unwrap();
}

fn mode(root: &Path, rel: &str) -> u32 {
    std::fs::symlink_metadata(root.join(rel))
        .map(|m| m.permissions().mode() & 0o7777)
        .unwrap_or(0)
}

/// The umask this process (and so the daemon it starts) has.
fn umask() -> u32 {
    let o = std::process::Command::new("sh")
        .args(["-c", "umask"])
        .output()
        .unwrap();
    u32::from_str_radix(text(&o.stdout).trim(), 8).unwrap()
}

fn json(d: &Daemon, args: &[&str]) -> serde_json::Value {
    let o = d.cli(args);
    serde_json::from_slice(&o.stdout).unwrap_or_else(|e| {
        panic!(
            "{args:?}: not JSON ({e}): {}{}\n{}",
            text(&o.stdout),
            text(&o.stderr),
            d.log_text()
        )
    })
}

#[test]
fn apply_takes_only_the_exec_bit_no_escaping_links_and_never_truncates() {
    let Some(d) = vm_daemon(&format!("{SMALL_VMS}[sync]\nmax_file_mib = 1\n")) else {
        return;
    };
    let repo = tempfile::tempdir().unwrap();
    let r = repo.path();
    write(r, "bin/tool", "#!/bin/sh\necho tool\n", 0o755);
    write(r, "build.sh", "echo build\n", 0o755);
    write(r, "data.txt", "small\n", 0o644);
    write(r, "d/keep.txt", "k\n", 0o644);
    let id = create(&d, r);
    let o = sh(
        &d,
        &id,
        "cd /workspace && chmod 4755 bin/tool && chmod 666 build.sh && echo new > new.sh && \
         chmod 2777 new.sh && ln -s .. d/l && ln -s l/../.. d/m && \
         yes aaaaaaa | head -c 2097152 > data.txt && stat -c '%a %s %n' bin/tool build.sh data.txt",
    );
    assert!(o.status.success(), "{}{}", text(&o.stdout), text(&o.stderr));
    assert!(
        text(&o.stdout).contains("4755 ") && text(&o.stdout).contains("2097152 data.txt"),
        "{}",
        text(&o.stdout)
    );

    // Every failure is collected, so a run on the old code shows each item's.
    let mut bad: Vec<String> = Vec::new();
    let diff = json(&d, &["diff", &id, "--json"]);
    let too_big = diff["too_big"].to_string();
    if !(too_big.contains("\"data.txt\"") && too_big.contains("2097152")) {
        bad.push(format!("diff does not list data.txt as too big: {diff}"));
    }
    if diff["files"].to_string().contains("\"data.txt\"") {
        bad.push(format!(
            "diff shows data.txt as a change: {}",
            diff["files"]
        ));
    }
    if !diff["refused"]
        .to_string()
        .contains("d/m: symlink to `l/../..` escapes the repo")
    {
        bad.push(format!("diff does not show d/m as refused: {diff}"));
    }

    let rep = json(&d, &["apply", &id, "--json"]);
    for (rel, want) in [
        ("bin/tool", 0o755),
        ("build.sh", 0o644),
        ("new.sh", 0o777 & !umask()),
    ] {
        let got = mode(r, rel);
        if got != want {
            bad.push(format!("{rel} has mode {got:o} on the host, want {want:o}"));
        }
    }
    match std::fs::read_link(r.join("d/l")) {
        Ok(t) if t == Path::new("..") => {}
        other => bad.push(format!(
            "d/l -> .. (inside the repo) not applied: {other:?}"
        )),
    }
    if let Ok(t) = std::fs::read_link(r.join("d/m")) {
        bad.push(format!(
            "d/m -> {} escapes the repo but was written",
            t.display()
        ));
    }
    if !rep["refused"]
        .to_string()
        .contains("d/m: symlink to `l/../..` escapes the repo")
    {
        bad.push(format!("apply does not report d/m as refused: {rep}"));
    }
    let host = std::fs::read_to_string(r.join("data.txt")).unwrap_or_default();
    if host != "small\n" {
        bad.push(format!(
            "data.txt on the host is now {} bytes, want it untouched",
            host.len()
        ));
    }
    if !rep["too_big"].to_string().contains("\"data.txt\"") {
        bad.push(format!("apply does not list data.txt as too big: {rep}"));
    }
    let o = d.cli(&["apply", &id]);
    if !text(&o.stderr).contains("too big  data.txt (2097152 bytes") {
        bad.push(format!(
            "the CLI does not say data.txt is too big: {}",
            text(&o.stderr)
        ));
    }
    // An undo limited to other folders (what the MCP server sends) is refused and changes
    // nothing; limited to the repo's folder it runs.
    let art = rep["artifact_id"].as_str().unwrap_or_default().to_owned();
    let elsewhere = tempfile::tempdir().unwrap();
    let undo = |within: &Path| {
        let body = serde_json::json!({ "within": [within] }).to_string();
        d.request("POST", &format!("/v1/artifacts/{art}/undo"), Some(&body))
    };
    let u = undo(elsewhere.path());
    if u.status != 403
        || !u
            .text()
            .contains("outside the folders this client may change")
    {
        bad.push(format!(
            "an undo outside `within` answered {}: {}",
            u.status,
            u.text()
        ));
    }
    if mode(r, "bin/tool") != 0o755 || !r.join("new.sh").exists() {
        bad.push("a refused undo changed the host".into());
    }
    let u = undo(r);
    if u.status != 200 {
        bad.push(format!(
            "an undo inside `within` answered {}: {}",
            u.status,
            u.text()
        ));
    }
    let _ = d.cli(&["rm", &id]);
    assert!(bad.is_empty(), "{}", bad.join("\n"));
}
