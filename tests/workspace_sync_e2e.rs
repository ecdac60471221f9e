//! End to end with real VMs: what a sync sends and leaves alone (excludes per sandbox and per
//! request), a first big sync through the base disk, big changes through the transfer disk.
//! Uses the guest images from `TRYBOXI_ARTIFACTS` or `_out/` (skips without them, except
//! under CI).

mod common;

use std::collections::BTreeMap;
use std::os::unix::fs::PermissionsExt;
use std::path::Path;

use common::ws::{Rm, cli_ok, sh_ok, text, tree, write};
use common::{Daemon, SMALL_VMS, create, sh, vm_daemon};

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
