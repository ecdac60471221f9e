//! End to end with real VMs: the workspace goes in one way (sync at create and before every
//! exec, secrets left out) and comes back only through diff / apply / pull, with backups and
//! undo. Uses the guest images from `TRYBOXI_ARTIFACTS` or `_out/` (skips without them,
//! except under CI).

mod common;

use std::collections::BTreeMap;
use std::os::unix::fs::PermissionsExt;
use std::path::Path;

use common::{Daemon, SMALL_VMS, artifacts, create, sh, vm_daemon};

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

fn cli_ok(d: &Daemon, args: &[&str]) -> String {
    let o = d.cli(args);
    assert!(
        o.status.success(),
        "{args:?} failed ({}): {}{}\n{}",
        o.status,
        text(&o.stdout),
        text(&o.stderr),
        d.log_text()
    );
    text(&o.stdout)
}

fn sh_ok(d: &Daemon, id: &str, script: &str) -> String {
    let o = sh(d, id, script);
    assert!(
        o.status.success(),
        "`{script}` failed: {}{}",
        text(&o.stdout),
        text(&o.stderr)
    );
    text(&o.stdout)
}

fn write(root: &Path, rel: &str, data: &str) {
    let p = root.join(rel);
    std::fs::create_dir_all(p.parent().unwrap()).unwrap();
    std::fs::write(p, data).unwrap();
}

/// Every file/symlink of a tree (outside .git): path -> (mode, bytes or link target).
fn tree(root: &Path) -> BTreeMap<String, (u32, Vec<u8>)> {
    let mut out = BTreeMap::new();
    let mut stack = vec![root.to_path_buf()];
    while let Some(dir) = stack.pop() {
        for e in std::fs::read_dir(&dir).unwrap() {
            let e = e.unwrap();
            let p = e.path();
            let rel = p.strip_prefix(root).unwrap().to_string_lossy().into_owned();
            if rel == ".git" {
                continue;
            }
            let md = std::fs::symlink_metadata(&p).unwrap();
            if md.is_dir() {
                stack.push(p);
            } else if md.file_type().is_symlink() {
                let t = std::fs::read_link(&p).unwrap();
                out.insert(rel, (0, t.to_string_lossy().as_bytes().to_vec()));
            } else {
                out.insert(
                    rel,
                    (md.permissions().mode() & 0o7777, std::fs::read(&p).unwrap()),
                );
            }
        }
    }
    out
}

struct Rm<'a>(&'a Daemon, String);
impl Drop for Rm<'_> {
    fn drop(&mut self) {
        let _ = self.0.cli(&["rm", &self.1]);
    }
}

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

/// The changed paths `diff --json` reports, with their kind.
fn diff_paths(d: &Daemon, id: &str) -> BTreeMap<String, String> {
    let v: serde_json::Value = serde_json::from_str(&cli_ok(d, &["diff", id, "--json"])).unwrap();
    v["files"]
        .as_array()
        .unwrap()
        .iter()
        .map(|f| {
            (
                f["path"].as_str().unwrap().to_owned(),
                f["kind"].as_str().unwrap().to_owned(),
            )
        })
        .collect()
}

#[test]
fn excludes_per_sandbox_and_per_request_and_diff_sees_every_change() {
    let Some(d) = vm_daemon(SMALL_VMS) else {
        return;
    };
    let repo = tempfile::tempdir().unwrap();
    let r = repo.path();
    for f in ["a", "b", "c", "d", "e", "f"] {
        write(r, &format!("src/{f}.txt"), &format!("{f}\n"));
    }
    write(r, "data/huge.bin", "not for the VM");
    write(r, "gen/x.txt", "x1\n");
    write(r, "a/b/c/d/e/deep.txt", "deep\n");
    let o = d.cli(&["create", "-w", r.to_str().unwrap(), "--exclude", "data"]);
    assert!(o.status.success(), "{}", text(&o.stderr));
    let id = text(&o.stdout)
        .split_whitespace()
        .next()
        .unwrap()
        .to_owned();
    let _rm = Rm(&d, id.clone());
    assert_eq!(
        sh(&d, &id, "test -e /workspace/data").status.code(),
        Some(1),
        "excluded at create"
    );

    // One exec's sync leaves `gen` alone; the next sync without it sends it.
    write(r, "gen/x.txt", "x2\n");
    write(r, "src/a.txt", "a2\n");
    let o = d.cli(&[
        "exec",
        &id,
        "--sync-exclude",
        "gen",
        "--",
        "cat",
        "/workspace/gen/x.txt",
        "/workspace/src/a.txt",
    ]);
    assert_eq!(text(&o.stdout), "x1\na2\n", "{}", text(&o.stderr));
    // A sync excluding `src` neither sends nor deletes there.
    std::fs::remove_file(r.join("src/f.txt")).unwrap();
    let rep: serde_json::Value =
        serde_json::from_str(&cli_ok(&d, &["sync", &id, "--exclude", "src", "--json"])).unwrap();
    assert_eq!(
        (rep["files_sent"].as_u64(), rep["deleted"].as_u64()),
        (Some(1), Some(0)),
        "{rep}"
    );
    // (every exec syncs first: this one leaves `src` alone too, or it would delete f.txt)
    let o = d.cli(&[
        "exec",
        &id,
        "--sync-exclude",
        "src",
        "--",
        "cat",
        "/workspace/gen/x.txt",
        "/workspace/src/f.txt",
    ]);
    assert_eq!(text(&o.stdout), "x2\nf\n", "{}", text(&o.stderr));
    write(r, "src/f.txt", "f\n"); // back as the base has it
    assert!(diff_paths(&d, &id).is_empty(), "the VM equals the base");

    // A process started before the next sync writes later: seen too.
    sh_ok(
        &d,
        &id,
        "setsid sh -c 'sleep 3; echo late >> /workspace/src/f.txt' </dev/null >/dev/null 2>&1 &",
    );
    let steps: [(&str, &str, &str); 6] = [
        ("echo b2 >> /workspace/src/b.txt", "src/b.txt", "modified"),
        (
            "mkdir -p /workspace/n1/n2 && echo n > /workspace/n1/n2/new.txt",
            "n1/n2/new.txt",
            "added",
        ),
        ("rm /workspace/src/c.txt", "src/c.txt", "deleted"),
        (
            "mv /workspace/src/d.txt /workspace/src/d2.txt",
            "src/d2.txt",
            "renamed",
        ),
        (
            "chmod 700 /workspace/src/e.txt",
            "src/e.txt",
            "mode_changed",
        ),
        (
            "echo deeper >> /workspace/a/b/c/d/e/deep.txt",
            "a/b/c/d/e/deep.txt",
            "modified",
        ),
    ];
    let mut want = BTreeMap::new();
    for (script, path, kind) in steps {
        sh_ok(&d, &id, script);
        want.insert(path.to_owned(), kind.to_owned());
        let got = diff_paths(&d, &id);
        for (p, k) in &want {
            assert_eq!(got.get(p), Some(k), "after `{script}`: {got:?}");
        }
    }
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
    loop {
        if diff_paths(&d, &id).get("src/f.txt").map(String::as_str) == Some("modified") {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "the background write never showed in the diff"
        );
        std::thread::sleep(std::time::Duration::from_millis(300));
    }

    // A directory renamed in the VM (on overlayfs a redirect, not a copy of its files): what
    // was under it shows at the new path only, and apply moves it on the host.
    sh_ok(&d, &id, "mv /workspace/a/b /workspace/a/moved");
    let got = diff_paths(&d, &id);
    assert_eq!(
        got.get("a/b/c/d/e/deep.txt").map(String::as_str),
        Some("deleted"),
        "{got:?}"
    );
    assert!(
        matches!(
            got.get("a/moved/c/d/e/deep.txt").map(String::as_str),
            Some("added" | "renamed")
        ),
        "{got:?}"
    );
    cli_ok(&d, &["apply", &id, "a"]);
    assert!(!r.join("a/b/c/d/e/deep.txt").exists());
    assert_eq!(
        std::fs::read_to_string(r.join("a/moved/c/d/e/deep.txt")).unwrap(),
        "deep\ndeeper\n"
    );

    // Undo does not silently destroy host edits made after the apply.
    let out = cli_ok(&d, &["apply", &id, "src/b.txt"]);
    let art = out.lines().next().unwrap().to_owned();
    assert_eq!(
        std::fs::read_to_string(r.join("src/b.txt")).unwrap(),
        "b\nb2\n"
    );
    write(r, "src/b.txt", "my own later edit\n");
    let o = d.cli(&["undo", &art]);
    assert!(
        !o.status.success(),
        "undo over a later host edit must be refused"
    );
    assert!(text(&o.stderr).contains("src/b.txt"), "{}", text(&o.stderr));
    assert_eq!(
        std::fs::read_to_string(r.join("src/b.txt")).unwrap(),
        "my own later edit\n",
        "a refused undo changes nothing"
    );
    let out = cli_ok(&d, &["undo", &art, "--force"]);
    assert_eq!(std::fs::read_to_string(r.join("src/b.txt")).unwrap(), "b\n");
    let dir = out
        .lines()
        .find_map(|l| l.strip_prefix("host edits it overwrote are backed up in "))
        .unwrap_or_else(|| panic!("{out}"));
    let kept: Vec<String> = std::fs::read_dir(dir)
        .unwrap()
        .flatten()
        .map(|e| std::fs::read_to_string(e.path()).unwrap())
        .collect();
    assert_eq!(kept, ["my own later edit\n"]);
}

/// sha256 of every file and the target of every symlink under `root` (outside .git), as
/// `sha256sum` prints them from inside `root`, sorted.
fn sums(root: &Path) -> String {
    use sha2::Digest;
    let mut lines: Vec<String> = tree(root)
        .into_iter()
        .map(|(rel, (mode, data))| {
            format!(
                "{mode:o} {} ./{rel}",
                hex::encode(sha2::Sha256::digest(&data))
            )
        })
        .collect();
    lines.sort();
    lines.join("\n")
}

/// The same listing taken inside the VM (symlinks as mode 0 and the hash of their target).
const VM_SUMS: &str = "cd /workspace && find . -path ./.git -prune -o -type f -printf '%m %p\\n' \
    | while read m p; do echo \"$m $(sha256sum < \"$p\" | cut -d' ' -f1) $p\"; done; \
    find . -path ./.git -prune -o -type l -print | while read p; do \
    echo \"0 $(readlink \"$p\" | tr -d '\\n' | sha256sum | cut -d' ' -f1) $p\"; done";

#[test]
fn a_first_big_sync_goes_in_through_the_base_disk() {
    let Some(d) = vm_daemon(SMALL_VMS) else {
        return;
    };
    let repo = tempfile::tempdir().unwrap();
    let r = repo.path();
    // An empty repo at create: the first sync with files is the one below.
    let id = create(&d, r);
    let _rm = Rm(&d, id.clone());
    for i in 0..300 {
        let line = format!("file {i} line of text for the base disk\n");
        write(
            r,
            &format!("d{}/f{i}.txt", i % 10),
            &line.repeat(4200 / line.len()),
        );
    }
    write(r, "run.sh", "#!/bin/sh\necho ran\n");
    std::fs::set_permissions(r.join("run.sh"), std::fs::Permissions::from_mode(0o755)).unwrap();
    std::os::unix::fs::symlink("d1/f1.txt", r.join("link")).unwrap();
    write(r, ".env", "SECRET=x\n");

    let sync: serde_json::Value =
        serde_json::from_str(&cli_ok(&d, &["sync", &id, "--json"])).unwrap();
    assert_eq!(sync["via"], "base_disk", "{sync}\n{}", d.log_text());
    assert_eq!(sync["files_sent"], 302, "{sync}");
    assert!(sync["bytes_sent"].as_u64().unwrap() >= 1 << 20, "{sync}");
    let mounts = sh_ok(&d, &id, "grep ' /workspace ' /proc/mounts");
    assert!(mounts.starts_with("overlay /workspace overlay"), "{mounts}");

    // Byte-exact, modes and symlinks included; the secret stayed out.
    std::fs::remove_file(r.join(".env")).unwrap();
    let mut vm: Vec<String> = sh_ok(&d, &id, VM_SUMS).lines().map(str::to_owned).collect();
    vm.sort();
    assert_eq!(vm.join("\n"), sums(r));
    write(r, ".env", "SECRET=x\n");
    assert_eq!(sh_ok(&d, &id, "/workspace/run.sh"), "ran\n");

    // A host edit and a host delete go in with the next exec (over the overlay).
    write(r, "d3/f3.txt", "edited on the host\n");
    std::fs::remove_file(r.join("d4/f4.txt")).unwrap();
    assert_eq!(
        sh_ok(
            &d,
            &id,
            "cat /workspace/d3/f3.txt; test -e /workspace/d4/f4.txt || echo gone"
        ),
        "edited on the host\ngone\n"
    );

    // A VM edit (a file from the base disk) shows in diff and applies back.
    sh_ok(
        &d,
        &id,
        "cd /workspace && echo 'vm line' >> d5/f5.txt && rm d6/f6.txt",
    );
    let diff = cli_ok(&d, &["diff", &id, "--stat"]);
    assert!(
        diff.contains("d5/f5.txt")
            && diff.contains("d6/f6.txt")
            && diff.contains(" 2 file(s) changed"),
        "{diff}"
    );
    cli_ok(&d, &["apply", &id]);
    assert!(
        std::fs::read_to_string(r.join("d5/f5.txt"))
            .unwrap()
            .ends_with("vm line\n")
    );
    assert!(!r.join("d6/f6.txt").exists());

    // A snapshot keeps /workspace (overlay and base disk): changes after it are undone by the
    // restore, and the base disk's files read as before.
    let o = cli_ok(&d, &["snapshot", "create", &id, "--name", "ws"]);
    assert!(o.starts_with("snap_"), "{o}");
    sh_ok(
        &d,
        &id,
        "cd /workspace && echo later > d7/f7.txt && rm -r d8",
    );
    cli_ok(&d, &["restore", &id, "ws"]);
    let f7 = sh_ok(
        &d,
        &id,
        "head -c 10 /workspace/d7/f7.txt; ls /workspace/d8 | wc -l",
    );
    assert_eq!(f7, "file 7 lin30\n");
    let mut vm: Vec<String> = sh_ok(&d, &id, VM_SUMS).lines().map(str::to_owned).collect();
    vm.sort();
    std::fs::remove_file(r.join(".env")).unwrap();
    assert_eq!(vm.join("\n"), sums(r));

    // A fork child reads the parent's base disk (its wsbase.img is a link to the parent's);
    // the parent cannot be removed while the child uses it.
    let kid = cli_ok(&d, &["fork", &id, "--count", "1"]).trim().to_owned();
    assert!(kid.starts_with("sbx_"), "{kid}");
    let _rm_kid = Rm(&d, kid.clone());
    let mut vm: Vec<String> = sh_ok(&d, &kid, VM_SUMS)
        .lines()
        .map(str::to_owned)
        .collect();
    vm.sort();
    assert_eq!(vm.join("\n"), sums(r));
    assert!(
        !d.cli(&["rm", &id]).status.success(),
        "the parent's disk is in use"
    );
}

/// Incompressible bytes (xorshift) so the archive really is as big as the file.
fn noise(seed: u64, len: usize) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    let mut v = Vec::with_capacity(len + 8);
    while v.len() < len {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        v.extend_from_slice(&x.to_le_bytes());
    }
    v.truncate(len);
    v
}

fn sha256_hex(b: &[u8]) -> String {
    use sha2::Digest as _;
    hex::encode(sha2::Sha256::digest(b))
}

/// How many syncs went through the transfer disk so far (the daemon logs `via=TransferDisk`).
fn disk_syncs(d: &Daemon) -> usize {
    let log = d.log_text();
    // Strip ANSI colour codes, if any, before matching the field.
    let mut plain = String::with_capacity(log.len());
    let mut esc = false;
    for c in log.chars() {
        match (esc, c) {
            (false, '\u{1b}') => esc = true,
            (true, 'm') => esc = false,
            (true, _) => {}
            (false, c) => plain.push(c),
        }
    }
    plain
        .lines()
        .filter(|l| l.contains("workspace synced") && l.contains("via=TransferDisk"))
        .count()
}

#[test]
fn big_changes_go_through_the_transfer_disk_and_a_second_one_is_not_read_stale() {
    let Some(d) = vm_daemon(SMALL_VMS) else {
        return;
    };
    let ws = tempfile::tempdir().unwrap();
    write(ws.path(), "small.txt", "small\n");
    write(ws.path(), "gone.txt", "deleted by the second sync\n");
    let id = create(&d, ws.path());
    let _rm = Rm(&d, id.clone());
    let before = disk_syncs(&d);

    // 1: one 2 MiB file (an archive >= 1 MiB) goes in through the disk.
    let v1 = noise(1, 2 << 20);
    std::fs::write(ws.path().join("big.bin"), &v1).unwrap();
    let out = sh_ok(
        &d,
        &id,
        "sha256sum /workspace/big.bin; cat /workspace/small.txt",
    );
    assert!(out.contains(&sha256_hex(&v1)), "first big sync: {out}");
    assert!(out.contains("small"), "{out}");
    assert_eq!(
        disk_syncs(&d),
        before + 1,
        "the first big sync did not use the disk"
    );

    // 2: the same file rewritten (same size, so the same disk blocks), a second big file and a
    // delete in one sync: the guest must read the new archive, not its cached copy of the old.
    let v2 = noise(2, 2 << 20);
    let v3 = noise(3, 1536 << 10);
    std::fs::write(ws.path().join("big.bin"), &v2).unwrap();
    std::fs::create_dir_all(ws.path().join("sub")).unwrap();
    std::fs::write(ws.path().join("sub/big2.bin"), &v3).unwrap();
    std::fs::remove_file(ws.path().join("gone.txt")).unwrap();
    let out = sh_ok(
        &d,
        &id,
        "sha256sum /workspace/big.bin /workspace/sub/big2.bin; \
         test -e /workspace/gone.txt && echo STILL-THERE || echo GONE",
    );
    assert!(
        out.contains(&sha256_hex(&v2)),
        "stale or wrong big.bin: {out}"
    );
    assert!(
        !out.contains(&sha256_hex(&v1)),
        "the old content came back: {out}"
    );
    assert!(out.contains(&sha256_hex(&v3)), "big2.bin: {out}");
    assert!(out.contains("GONE"), "{out}");
    assert_eq!(
        disk_syncs(&d),
        before + 2,
        "the second big sync did not use the disk"
    );

    // Nothing of this came back to the host, and the VM sees no leftovers of the transfer.
    assert_eq!(std::fs::read(ws.path().join("big.bin")).unwrap(), v2);
    let stat = cli_ok(&d, &["diff", &id, "--stat"]);
    assert!(
        !stat.contains("big.bin") && !stat.contains("big2.bin"),
        "the VM's copy differs from the sync base: {stat}"
    );
}
