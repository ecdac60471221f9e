//! End to end with real VMs: the workspace goes in one way (sync at create and before every
//! exec, secrets left out) and comes back only through diff / apply / pull, with backups and
//! undo. Uses the guest images from `TRYBOXI_ARTIFACTS` or `_out/` (skips without them,
//! except under CI). Excludes, big syncs and the transfer disk: workspace_sync_e2e.rs.

mod common;

use common::ws::{Rm, cli_ok, sh_ok, text, tree, write};
use std::os::unix::fs::PermissionsExt;

use common::{Daemon, SMALL_VMS, artifacts, create, sh, vm_daemon};

#[test]
fn sync_keeps_secrets_out_and_apply_undo_round_trips_byte_exact() {
    let Some(d) = vm_daemon(SMALL_VMS) else {
        return;
    };
    let repo = tempfile::tempdir().unwrap();
    let r = repo.path();
    write(r, "README.md", "hello\n");
    write(r, "src/lib.rs", "pub fn f() {}\n");
    write(r, "keep.sh", "#!/bin/sh\necho keep\n");
    write(r, ".env", "SECRET=hunter2\n");
    write(r, "certs/server.pem", "PRIVATE\n");
    write(r, ".gitignore", "target/\n");
    write(r, "target/big.o", "ignored");
    write(
        r,
        ".git/config",
        "[remote \"origin\"]\n\turl = https://bob:tok123@example.com/r.git\n[credential]\n\thelper = store\n",
    );
    let id = create(&d, r);
    let _rm = Rm(&d, id.clone());

    // The repo is there; secrets, ignored files and credentials are not.
    assert_eq!(sh_ok(&d, &id, "cat /workspace/README.md"), "hello\n");
    for p in [".env", "certs/server.pem", "target"] {
        let o = sh(&d, &id, &format!("test -e /workspace/{p}"));
        assert_eq!(o.status.code(), Some(1), "{p} must not be in the VM");
    }
    let cfg = sh_ok(&d, &id, "cat /workspace/.git/config");
    assert!(
        cfg.contains("https://example.com/r.git")
            && !cfg.contains("tok123")
            && !cfg.contains("helper"),
        "{cfg}"
    );

    // Host edits (and deletions) are visible at the next exec.
    write(r, "README.md", "hello from the host\n");
    std::fs::remove_file(r.join("src/lib.rs")).unwrap();
    assert_eq!(
        sh_ok(&d, &id, "cat /workspace/README.md"),
        "hello from the host\n"
    );
    assert_eq!(
        sh(&d, &id, "test -e /workspace/src/lib.rs").status.code(),
        Some(1)
    );
    let sync: serde_json::Value =
        serde_json::from_str(&cli_ok(&d, &["sync", &id, "--json"])).unwrap();
    assert_eq!(sync["files_sent"], 0, "{sync}");

    // VM edits stay in the VM until apply.
    let before = tree(r);
    sh_ok(
        &d,
        &id,
        "cd /workspace && echo 'vm line' >> README.md && printf 'new\\n' > added.txt && \
         chmod 755 added.txt && rm keep.sh && mkdir -p node && printf '\\000\\001' > node/bin.dat",
    );
    assert_eq!(tree(r), before, "VM edits must not reach the host");

    let diff = cli_ok(&d, &["diff", &id]);
    assert!(diff.contains("+vm line"), "{diff}");
    assert!(
        diff.contains("b/added.txt") && diff.contains("new file mode 755"),
        "{diff}"
    );
    assert!(
        diff.contains("deleted file mode") && diff.contains("keep.sh"),
        "{diff}"
    );
    assert!(
        diff.contains("Binary files") && diff.contains("node/bin.dat"),
        "{diff}"
    );
    let stat = cli_ok(&d, &["diff", &id, "--stat", "README.md"]);
    assert!(
        stat.contains("README.md | +1 -0") && !stat.contains("added.txt"),
        "{stat}"
    );

    let out = cli_ok(&d, &["apply", &id]);
    let art = out.lines().next().unwrap().to_owned();
    assert!(art.starts_with("art_"), "{out}");
    assert_eq!(
        std::fs::read_to_string(r.join("README.md")).unwrap(),
        "hello from the host\nvm line\n"
    );
    assert_eq!(std::fs::read(r.join("node/bin.dat")).unwrap(), b"\x00\x01");
    let m = std::fs::metadata(r.join("added.txt"))
        .unwrap()
        .permissions()
        .mode()
        & 0o7777;
    assert_eq!(m, 0o755);
    assert!(!r.join("keep.sh").exists());
    assert_eq!(
        std::fs::read_to_string(r.join(".env")).unwrap(),
        "SECRET=hunter2\n"
    );
    // Nothing left to apply.
    let diff = cli_ok(&d, &["diff", &id, "--stat"]);
    assert!(diff.contains(" 0 file(s) changed"), "{diff}");

    let out = cli_ok(&d, &["undo", &art]);
    assert!(out.contains("undone"), "{out}");
    assert_eq!(tree(r), before, "undo must restore the host byte for byte");
    assert!(
        !d.cli(&["undo", &art]).status.success(),
        "a second undo is refused"
    );
}

#[test]
fn conflicts_get_markers_and_escapes_are_refused() {
    let Some(d) = vm_daemon(SMALL_VMS) else {
        return;
    };
    let repo = tempfile::tempdir().unwrap();
    let r = repo.path();
    write(r, "a.txt", "x = 0\n");
    write(r, "b.txt", "b0\n");
    let id = create(&d, r);
    let _rm = Rm(&d, id.clone());
    sh_ok(
        &d,
        &id,
        "cd /workspace && echo 'x = 2' > a.txt && echo b2 > b.txt && ln -s /etc/passwd evil && \
         ln -s ../../outside sneaky && mkfifo pipe && mkdir -p .git/hooks && echo boom > .git/hooks/pre-commit",
    );
    // The host changes the same files after the VM did.
    write(r, "a.txt", "x = 1\n");
    write(r, "b.txt", "b1\n");
    // A sync (also before every exec) leaves files both sides changed as the VM has them.
    let sync = cli_ok(&d, &["sync", &id, "--json"]);
    assert!(
        sync.contains("\"a.txt\"") && sync.contains("\"b.txt\""),
        "{sync}"
    );
    assert_eq!(sh_ok(&d, &id, "cat /workspace/a.txt"), "x = 2\n");

    let o = d.cli(&["apply", &id, "a.txt", "evil", "sneaky", "pipe", ".git"]);
    let (out, err) = (text(&o.stdout), text(&o.stderr));
    assert_eq!(o.status.code(), Some(1), "conflicts exit 1: {out}{err}");
    assert!(
        err.contains(".git: anything under .git/ is never written"),
        "{err}"
    );
    let art = out.lines().next().unwrap().to_owned();
    assert!(art.starts_with("art_"), "{out}");
    assert!(out.contains("CONFLICT a.txt"), "{out}");
    let a = std::fs::read_to_string(r.join("a.txt")).unwrap();
    assert!(
        a.contains("<<<<<<< host")
            && a.contains("x = 1")
            && a.contains("x = 2")
            && a.contains(">>>>>>> sandbox"),
        "{a}"
    );
    assert!(
        err.contains("evil: symlink to `/etc/passwd` points outside the repo"),
        "{err}"
    );
    assert!(
        err.contains("sneaky: symlink to `../../outside` escapes the repo"),
        "{err}"
    );
    assert!(err.contains("pipe: a device, FIFO or socket"), "{err}");
    for p in ["evil", "sneaky", "pipe", ".git"] {
        assert!(
            std::fs::symlink_metadata(r.join(p)).is_err(),
            "{p} must not be written"
        );
    }
    // The backup holds the host's version.
    let backup = d.root().join("artifacts").join(&art).join("record.json");
    assert!(backup.exists());

    // pull refuses to overwrite a host-changed file unless forced.
    let o = d.cli(&["pull", &id, "b.txt"]);
    assert!(
        text(&o.stderr).contains("b.txt: changed on the host since the last sync"),
        "{}",
        text(&o.stderr)
    );
    assert_eq!(std::fs::read_to_string(r.join("b.txt")).unwrap(), "b1\n");
    let out = cli_ok(&d, &["pull", &id, "b.txt", "--force"]);
    let art2 = out.lines().next().unwrap().to_owned();
    assert_eq!(std::fs::read_to_string(r.join("b.txt")).unwrap(), "b2\n");
    // Escape attempts through the API are refused with a clear message.
    let resp = d.request(
        "POST",
        &format!("/v1/sandboxes/{id}/pull"),
        Some(r#"{"paths":["../etc/passwd"]}"#),
    );
    assert_eq!(resp.status, 400, "{}", resp.text());
    assert!(
        resp.text().contains("`..` in the path is refused"),
        "{}",
        resp.text()
    );
    let resp = d.request(
        "POST",
        &format!("/v1/sandboxes/{id}/pull"),
        Some(r#"{"paths":["/etc/passwd"]}"#),
    );
    assert!(
        resp.text().contains("absolute paths are refused"),
        "{}",
        resp.text()
    );
    let resp = d.request(
        "POST",
        &format!("/v1/sandboxes/{id}/pull"),
        Some(r#"{"paths":[".git/hooks/pre-commit"]}"#),
    );
    assert!(resp.text().contains("under .git/"), "{}", resp.text());

    cli_ok(&d, &["undo", &art2]);
    cli_ok(&d, &["undo", &art]);
    assert_eq!(std::fs::read_to_string(r.join("a.txt")).unwrap(), "x = 1\n");
    assert_eq!(std::fs::read_to_string(r.join("b.txt")).unwrap(), "b1\n");

    // Files API: read and write inside the VM, never the host.
    let resp = d.request(
        "PUT",
        &format!("/v1/sandboxes/{id}/files?path=/workspace/new/put.txt"),
        Some(r#"{"path":"/workspace/new/put.txt","content":"put\n","mode":384}"#),
    );
    assert_eq!(resp.status, 200, "{}", resp.text());
    let resp = d.request(
        "GET",
        &format!("/v1/sandboxes/{id}/files?path=%2Fworkspace%2Fnew%2Fput.txt"),
        None,
    );
    assert_eq!(resp.json()["content"], "put\n");
    assert_eq!(resp.json()["mode"], 384);
    assert!(!r.join("new").exists());
}

/// A VM plants git metadata for the host's next `git status` (a `.git` file pointing at a
/// bare-repo layout whose config names `core.fsmonitor`, and a `.GIT` directory): diff lists
/// each as refused, apply brings the rest and none of it.
#[test]
fn git_metadata_planted_in_the_vm_is_refused_by_diff_and_apply() {
    let Some(d) = vm_daemon(SMALL_VMS) else {
        return;
    };
    let repo = tempfile::tempdir().unwrap();
    let r = repo.path();
    write(r, "a.txt", "a\n");
    let id = create(&d, r);
    let _rm = Rm(&d, id.clone());
    sh_ok(
        &d,
        &id,
        "cd /workspace && mkdir -p sub evil/objects evil/refs/heads vend/.GIT && \
         printf 'gitdir: ../evil\\n' > sub/.git && \
         printf 'ref: refs/heads/main\\n' > evil/HEAD && \
         printf '[core]\\n\\tfsmonitor = touch /tmp/pwned\\n' > evil/config && \
         echo hook > vend/.GIT/config && echo ok > ok.txt",
    );
    let o = d.cli(&["diff", &id, "--stat"]);
    let (out, err) = (text(&o.stdout), text(&o.stderr));
    assert!(o.status.success(), "{out}{err}");
    for refused in [
        "refused  evil: looks like a bare git repository",
        "refused  sub/.git: git metadata",
        "refused  vend/.GIT: git metadata",
    ] {
        assert!(err.contains(refused), "`{refused}` missing: {err}");
    }
    assert!(out.contains("ok.txt") && !out.contains("evil/"), "{out}");
    let o = d.cli(&["apply", &id]);
    let (out, err) = (text(&o.stdout), text(&o.stderr));
    assert!(o.status.success(), "{out}{err}");
    assert!(out.contains("applied  ok.txt"), "{out}");
    assert!(err.contains("refused  sub/.git"), "{err}");
    assert_eq!(std::fs::read_to_string(r.join("ok.txt")).unwrap(), "ok\n");
    for p in ["sub/.git", "evil", "vend/.GIT", "vend"] {
        assert!(
            std::fs::symlink_metadata(r.join(p)).is_err(),
            "{p} must not be written"
        );
    }
}

#[test]
fn daemon_killed_mid_apply_leaves_whole_files_and_undo_restores() {
    let Some(art) = artifacts() else { return };
    // This daemon kills itself (SIGKILL) after 2 host writes of an apply.
    let mut d = Daemon::start_env(
        Some(SMALL_VMS),
        &["--artifacts", art.to_str().unwrap()],
        &[("TRYBOXI_TEST_KILL_AFTER_WRITES", "2")],
    );
    let repo = tempfile::tempdir().unwrap();
    let r = repo.path();
    for i in 0..5 {
        write(r, &format!("f{i}.txt"), &format!("old {i}\n"));
    }
    let id = create(&d, r);
    sh_ok(
        &d,
        &id,
        "cd /workspace && for i in 0 1 2 3 4; do echo new $i > f$i.txt; done",
    );
    let before = tree(r);
    let o = d.cli(&["apply", &id]);
    assert!(!o.status.success(), "the daemon should have died mid-apply");
    let status = common::wait_bounded(
        d.child.as_mut().unwrap(),
        std::time::Duration::from_secs(30),
    );
    assert!(!status.success());
    d.child = None;
    // Every file is either all old or all new; some of each.
    let (mut old, mut new) = (0, 0);
    for i in 0..5 {
        let c = std::fs::read_to_string(r.join(format!("f{i}.txt"))).unwrap();
        if c == format!("old {i}\n") {
            old += 1;
        } else if c == format!("new {i}\n") {
            new += 1;
        } else {
            panic!("f{i}.txt is torn: {c:?}");
        }
    }
    assert_eq!((old, new), (3, 2));
    // A new daemon (no hook) finds the backup; undo restores the old state.
    d.respawn();
    let _rm = Rm(&d, id.clone());
    let art_id = std::fs::read_dir(d.root().join("artifacts"))
        .unwrap()
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .find(|n| n.starts_with("art_"))
        .expect("the backup survives the crash");
    cli_ok(&d, &["undo", &art_id]);
    assert_eq!(tree(r), before);
}
