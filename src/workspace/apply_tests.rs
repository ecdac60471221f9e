//! Tests of [`super`]: path checks, merges, and the plan (modes, sizes, symlinks).

use super::*;

#[test]
fn every_unsafe_path_form_is_refused() {
    for p in [
        "",
        "/etc/passwd",
        "../x",
        "a/../../x",
        "a/./b",
        ".git/config",
        ".git/hooks/pre-commit",
        ".git",
        &*"n".repeat(256),
        &*format!("{}x", "d/".repeat(2100)),
    ] {
        assert!(check_path(p).is_err(), "{p:?} should be refused");
    }
    for p in [
        "a",
        "src/main.rs",
        ".github/workflows/ci.yml",
        ".gitignore",
        "a/.git-keep",
        &*"n".repeat(255),
    ] {
        assert!(check_path(p).is_ok(), "{p:?} should be fine");
    }
}

#[test]
fn a_symlinked_parent_on_the_host_is_refused() {
    let d = tempfile::tempdir().unwrap();
    let out = tempfile::tempdir().unwrap();
    std::os::unix::fs::symlink(out.path(), d.path().join("evil")).unwrap();
    std::fs::create_dir(d.path().join("ok")).unwrap();
    assert!(check_host_parents(d.path(), "evil/x").is_err());
    assert!(check_host_parents(d.path(), "ok/x").is_ok());
    assert!(check_host_parents(d.path(), "new/dir/x").is_ok());
}

#[test]
fn clean_merge_combines_both_sides() {
    let base = b"a\nb\nc\nd\ne\nf\ng\n";
    let host = b"A\nb\nc\nd\ne\nf\ng\n";
    let vm = b"a\nb\nc\nd\ne\nf\nG\n";
    let (m, conflict) = merge3(host, base, vm).unwrap();
    assert!(!conflict);
    assert_eq!(m, b"A\nb\nc\nd\ne\nf\nG\n");
}

#[test]
fn conflicting_merge_leaves_markers_naming_both_sides() {
    let (m, conflict) = merge3(b"x = 1\n", b"x = 0\n", b"x = 2\n").unwrap();
    assert!(conflict);
    let s = String::from_utf8(m).unwrap();
    assert!(
        s.contains("<<<<<<< host") && s.contains(">>>>>>> sandbox"),
        "{s}"
    );
    assert!(s.contains("x = 1") && s.contains("x = 2"), "{s}");
}

use std::os::unix::fs::PermissionsExt;

use crate::config::SyncConfig;
use crate::rpc::{FileKind, WalkEntry};

/// A host repo and a sync base (both temporary) with the default rules.
struct Repo {
    host: tempfile::TempDir,
    _base_dir: tempfile::TempDir,
    base: Base,
    rules: Rules,
}

impl Repo {
    fn new() -> Repo {
        let base_dir = tempfile::tempdir().unwrap();
        Repo {
            host: tempfile::tempdir().unwrap(),
            base: Base::new(base_dir.path().join("ws")),
            _base_dir: base_dir,
            rules: Rules::new(&SyncConfig::default()).unwrap(),
        }
    }

    fn root(&self) -> &Path {
        self.host.path()
    }

    /// A host file that is also in the base as it is (unchanged on the host since the sync).
    fn synced(&self, rel: &str, content: &[u8], mode: u32) -> Entry {
        let p = self.root().join(rel);
        std::fs::create_dir_all(p.parent().unwrap()).unwrap();
        std::fs::write(&p, content).unwrap();
        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(mode)).unwrap();
        let sha = self.base.put_blob(content).unwrap();
        Entry::file(mode, content.len() as u64, 1, sha)
    }

    fn plan(&self, changes: Vec<Change>, max: u64, umask: u32, big: &[TooBigFile]) -> Plan {
        self.plan_as(Mode::Apply, changes, max, umask, big)
    }

    fn plan_as(
        &self,
        mode: Mode,
        changes: Vec<Change>,
        max: u64,
        umask: u32,
        big: &[TooBigFile],
    ) -> Plan {
        let opts = PlanOpts {
            mode,
            max_bytes: max,
            umask,
        };
        plan(self.root(), &self.base, changes, &self.rules, opts, big).unwrap()
    }
}

fn vm_item(path: &str, kind: Kind, mode: u32, content: &[u8], link: Option<&str>) -> VmItem {
    VmItem {
        kind,
        mode,
        content: content.to_vec(),
        spill: None,
        sha256: match kind {
            Kind::File => crate::workspace::sha256(content),
            _ => String::new(),
        },
        link: link.map(str::to_owned),
        walk: WalkEntry {
            path: path.into(),
            kind: match kind {
                Kind::File => FileKind::File,
                Kind::Symlink => FileKind::Symlink,
                Kind::Dir => FileKind::Dir,
            },
            size: content.len() as u64,
            mode,
            mtime: 2,
            mtime_nsec: 0,
            link: link.map(str::to_owned),
            base: false,
        },
    }
}

fn change(path: &str, kind: ChangeKind, base: Option<Entry>, vm: VmItem) -> Change {
    Change {
        path: path.into(),
        kind,
        old_path: None,
        base,
        vm: Some(vm),
    }
}

fn added_file(path: &str, content: &[u8], mode: u32) -> Change {
    let v = vm_item(path, Kind::File, mode, content, None);
    change(path, ChangeKind::Added, None, v)
}

fn added_link(path: &str, target: &str) -> Change {
    let v = vm_item(path, Kind::Symlink, 0o777, b"", Some(target));
    change(path, ChangeKind::Added, None, v)
}

/// The mode each write of `p` sets, by path.
fn modes(p: &Plan) -> Vec<(&str, u32)> {
    p.ops
        .iter()
        .filter_map(|o| match &o.action {
            Action::Write { mode, .. } => Some((o.path.as_str(), *mode)),
            _ => None,
        })
        .collect()
}

#[test]
fn only_the_executable_bit_comes_from_the_vm() {
    let r = Repo::new();
    let private = r.synced("private.sh", b"old\n", 0o600);
    let shared = r.synced("shared.txt", b"x\n", 0o644);
    let changes = vec![
        added_file("bin/tool", b"#!/bin/sh\n", 0o4755),
        added_file("build.sh", b"echo\n", 0o666),
        added_file("g", b"g\n", 0o2775),
        added_file("t", b"t\n", 0o1777),
        // An existing private file made setuid-executable in the VM: it stays private.
        change(
            "private.sh",
            ChangeKind::Modified,
            Some(private),
            vm_item("private.sh", Kind::File, 0o4777, b"new\n", None),
        ),
        // A world-writable mode only: the host's mode already has the VM's executable bit.
        change(
            "shared.txt",
            ChangeKind::ModeChanged,
            Some(shared),
            vm_item("shared.txt", Kind::File, 0o666, b"x\n", None),
        ),
    ];
    for mode in [Mode::Apply, Mode::Pull { force: false }] {
        let p = r.plan_as(mode, changes.clone(), 1 << 20, 0o022, &[]);
        assert_eq!(
            modes(&p),
            [
                ("bin/tool", 0o755),
                ("build.sh", 0o644),
                ("g", 0o755),
                ("t", 0o755),
                ("private.sh", 0o700),
            ],
            "{mode:?}"
        );
        assert!(p.applied.contains(&"shared.txt".to_string()), "{p:?}");
    }
    // The umask narrows new files and the added `x`.
    let p = r.plan(changes, 1 << 20, 0o077, &[]);
    assert_eq!(modes(&p)[..2], [("bin/tool", 0o700), ("build.sh", 0o600)]);
    // A merged file whose mode the VM changed gets the same treatment.
    assert_eq!(host_mode(0o6777, Some(0o644), 0o022), 0o755);
    assert_eq!(host_mode(0o644, Some(0o4755), 0o022), 0o644);
    assert_eq!(host_mode(0o755, Some(0o4750), 0o022), 0o750);
}

#[test]
fn the_umask_is_read_without_changing_it() {
    let out = std::process::Command::new("sh")
        .args(["-c", "umask"])
        .output()
        .unwrap();
    let shell = u32::from_str_radix(String::from_utf8_lossy(&out.stdout).trim(), 8).unwrap();
    assert_eq!(process_umask(), shell);
}

#[test]
fn an_over_limit_file_is_never_written_and_its_maybe_rename_not_deleted() {
    let r = Repo::new();
    let keep = r.synced("data.txt", b"small\n", 0o644);
    let gone = r.synced("old.bin", &[7u8; 64], 0o644);
    // As an unfetched file reached the plan before: its stat says big, its content is empty.
    let mut v = vm_item("data.txt", Kind::File, 0o644, b"", None);
    v.walk.size = 3 << 20;
    let big = [TooBigFile {
        path: "new.bin".into(),
        size: 64,
    }];
    let changes = vec![
        change("data.txt", ChangeKind::Modified, Some(keep), v),
        Change {
            path: "old.bin".into(),
            kind: ChangeKind::Deleted,
            old_path: None,
            base: Some(gone),
            vm: None,
        },
    ];
    let p = r.plan(changes, 1 << 20, 0o022, &big);
    assert!(p.ops.is_empty(), "{:?}", p.ops);
    assert_eq!(
        p.too_big,
        [TooBigFile {
            path: "data.txt".into(),
            size: 3 << 20
        }]
    );
    assert!(
        p.refused[0].starts_with("old.bin: deleted in the sandbox, maybe renamed to `new.bin`"),
        "{:?}",
        p.refused
    );
}

#[test]
fn links_resolved_through_other_links_must_stay_in_the_repo() {
    let r = Repo::new();
    std::fs::create_dir(r.root().join("d")).unwrap();
    let p = r.plan(
        vec![
            added_link("d/l", ".."),
            added_link("d/m", "l/../.."),
            added_link("evil", "/etc/passwd"),
            added_link("x/y", "../../out"),
            // A write below a link this apply creates would go through it.
            added_link("s", "d"),
            added_file("s/f", b"f\n", 0o644),
            added_link("ok", "d/l/d"),
        ],
        1 << 20,
        0o022,
        &[],
    );
    let paths: Vec<&str> = p.ops.iter().map(|o| o.path.as_str()).collect();
    assert_eq!(paths, ["d/l", "s", "ok"], "{:?}", p.refused);
    assert_eq!(p.applied, ["d/l", "s", "ok"]);
    let why = p.refused.join("\n");
    for want in [
        "d/m: symlink to `l/../..` escapes the repo",
        "evil: symlink to `/etc/passwd` points outside the repo",
        "x/y: symlink to `../../out` escapes the repo",
        "s/f: parent `s` is a symlink this apply would create",
    ] {
        assert!(why.contains(want), "{want} not in\n{why}");
    }
    assert!(
        p.base_updates
            .iter()
            .all(|(path, _)| ["d/l", "s", "ok"].contains(&path.as_str()))
    );
    // The diff names the same refusals.
    let changes = vec![added_link("d/l", ".."), added_link("d/m", "l/../..")];
    assert_eq!(
        link_refusals(r.root(), &changes),
        ["d/m: symlink to `l/../..` escapes the repo"]
    );
}

#[test]
fn thousands_of_links_are_checked_in_linear_time() {
    let r = Repo::new();
    let mut changes = Vec::new();
    for i in 0..2_000 {
        changes.push(added_link(&format!("d{i}/l"), ".."));
        changes.push(added_link(&format!("d{i}/m"), "l/../.."));
        changes.push(added_file(&format!("d{i}/f"), b"f\n", 0o644));
    }
    let t = std::time::Instant::now();
    let p = r.plan(changes, 1 << 20, 0o022, &[]);
    let took = t.elapsed();
    assert_eq!((p.ops.len(), p.refused.len()), (4_000, 2_000));
    assert!(took < std::time::Duration::from_secs(20), "{took:?}");
    eprintln!("6,000 changes planned in {took:?}");
}
