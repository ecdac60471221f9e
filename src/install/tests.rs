//! Layout, unit rendering and idempotent file writes (the end-to-end install/uninstall runs
//! are in tests/install.rs).

use std::path::{Path, PathBuf};

use super::systemd::render;
use super::*;

#[test]
fn root_installs_system_wide_and_a_user_under_home() {
    let sys = Layout::new(true, Some(Path::new("/root")), None, None, None, None).unwrap();
    assert_eq!(sys.scope, Scope::System);
    assert_eq!(sys.binary(), Path::new("/usr/local/bin/tryboxi"));
    assert_eq!(sys.unit, Path::new("/etc/systemd/system/tryboxi.service"));
    let user = Layout::new(
        false,
        Some(Path::new("/home/u")),
        None,
        Some("u".into()),
        None,
        Some(PathBuf::from("/tmp/d")),
    )
    .unwrap();
    assert_eq!(user.scope, Scope::User);
    assert_eq!(user.binary(), Path::new("/home/u/.local/bin/tryboxi"));
    assert_eq!(
        user.unit,
        Path::new("/home/u/.config/systemd/user/tryboxi.service")
    );
    assert_eq!(
        user.staged(&user.unit),
        Path::new("/tmp/d/home/u/.config/systemd/user/tryboxi.service")
    );
    let xdg = Layout::new(
        false,
        Some(Path::new("/home/u")),
        Some(Path::new("/cfg")),
        None,
        None,
        None,
    )
    .unwrap();
    assert_eq!(xdg.unit, Path::new("/cfg/systemd/user/tryboxi.service"));
    assert!(Layout::new(false, None, None, None, None, None).is_err());
}

#[test]
fn the_unit_keeps_qemus_on_stop_and_names_the_binary_and_data_root() {
    let sys = render(
        Scope::System,
        Path::new("/usr/local/bin/tryboxi"),
        Path::new("/var/lib/tryboxi"),
    )
    .unwrap();
    assert!(!sys.contains('@'), "{sys}");
    for line in [
        "ExecStart=/usr/local/bin/tryboxi serve",
        "Environment=\"TRYBOXI_HOME=/var/lib/tryboxi\"",
        "KillMode=process",
        "Delegate=yes",
        "WantedBy=multi-user.target",
    ] {
        assert!(sys.lines().any(|l| l == line), "{line} missing:\n{sys}");
    }
    let user = render(
        Scope::User,
        Path::new("/home/a b/.local/bin/tryboxi"),
        Path::new("/home/a b/100%"),
    )
    .unwrap();
    assert!(
        user.contains("ExecStart=\"/home/a b/.local/bin/tryboxi\" serve"),
        "{user}"
    );
    assert!(
        user.contains("Environment=\"TRYBOXI_HOME=/home/a b/100%%\""),
        "{user}"
    );
    assert!(user.contains("WantedBy=default.target"), "{user}");
    assert!(render(Scope::User, Path::new("/a\nb"), Path::new("/x")).is_err());
}

#[test]
fn put_writes_only_what_differs_and_symlinks_replace_only_symlinks() {
    let dir = tempfile::tempdir().unwrap();
    let f = dir.path().join("a/b/file");
    assert!(put(&f, b"one", 0o644).unwrap());
    assert!(!put(&f, b"one", 0o644).unwrap());
    assert!(put(&f, b"one", 0o755).unwrap());
    assert!(put(&f, b"two", 0o755).unwrap());
    assert_eq!(std::fs::read(&f).unwrap(), b"two");
    let l = dir.path().join("a/link");
    assert!(put_symlink(&l, "file").unwrap());
    assert!(!put_symlink(&l, "file").unwrap());
    assert!(put_symlink(&l, "b/file").unwrap());
    assert!(matches!(
        put_symlink(&f, "x"),
        Err(InstallError::NotOurs(_))
    ));
    assert!(remove(&l).unwrap());
    assert!(!remove(&l).unwrap());
}

#[test]
fn the_record_round_trips_and_a_missing_one_is_none() {
    let dir = tempfile::tempdir().unwrap();
    assert_eq!(Record::load(dir.path()).unwrap(), None);
    let mut r = Record {
        scope: Some(Scope::User),
        destdir: PathBuf::from("/"),
        unit: Some(PathBuf::from(
            "/home/u/.config/systemd/user/tryboxi.service",
        )),
        files: Vec::new(),
        linger_enabled: Some("u".into()),
    };
    r.add(PathBuf::from("/home/u/.local/bin/tryboxi"));
    r.add(PathBuf::from("/home/u/.local/bin/tryboxi"));
    assert_eq!(r.files.len(), 1);
    assert!(r.save(dir.path()).unwrap());
    assert!(!r.save(dir.path()).unwrap());
    assert_eq!(Record::load(dir.path()).unwrap(), Some(r));
}

/// `systemd-analyze verify` (from the `systemd` package, installed by `cargo xtask deps`)
/// accepts both renderings: every setting parses (a warning on stderr fails the test too), and
/// `ExecStart` names an executable (this test binary).
#[test]
fn systemd_analyze_verify_accepts_the_unit() {
    let Some(analyze) = ["/usr/bin/systemd-analyze", "/bin/systemd-analyze"]
        .into_iter()
        .find(|p| Path::new(p).exists())
    else {
        assert!(
            std::env::var_os("CI").is_none(),
            "systemd-analyze is missing: run `cargo xtask deps`"
        );
        println!("SKIP systemd_analyze_verify_accepts_the_unit: no systemd-analyze here");
        return;
    };
    let exe = std::env::current_exe().unwrap();
    for scope in [Scope::System, Scope::User] {
        let dir = tempfile::tempdir().unwrap();
        let runtime = dir.path().join("run");
        std::fs::create_dir(&runtime).unwrap();
        let unit = dir.path().join(UNIT_NAME);
        std::fs::write(&unit, render(scope, &exe, dir.path()).unwrap()).unwrap();
        let mut c = std::process::Command::new(analyze);
        if scope == Scope::User {
            // The user manager wants a runtime directory; none exists without a login.
            c.arg("--user").env("XDG_RUNTIME_DIR", &runtime);
        }
        let out = c.args(["verify", "--man=no"]).arg(&unit).output().unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(
            out.status.success() && err.trim().is_empty(),
            "{scope:?}: {}\n{err}",
            out.status
        );
    }
}

/// README's install section shows the system unit exactly as install writes it.
#[test]
fn readme_shows_the_system_unit_as_written() {
    let readme = include_str!("../../README.md");
    let unit = render(
        Scope::System,
        Path::new("/usr/local/bin/tryboxi"),
        Path::new("/var/lib/tryboxi"),
    )
    .unwrap();
    assert!(
        readme.contains(&format!("```ini\n{unit}```")),
        "README.md's unit differs from:\n{unit}"
    );
}
