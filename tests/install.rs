//! `tryboxi install` and `tryboxi uninstall` end to end, into a temporary destdir (never the
//! host's own /etc or /usr/local): idempotent installs, an uninstall that removes exactly what
//! install wrote, `--purge` refused without a terminal and without `--yes`, the message when
//! systemd is absent, and the `systemctl`/`loginctl` calls when it runs (through stand-ins that
//! record their arguments). No VM, no daemon.
// This test binary is dynamically linked, so its own NSS lookups are safe (clippy.toml bans them
// for the static product binary).
#![allow(clippy::disallowed_methods)]

mod common;

use std::collections::BTreeMap;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};

use common::{BIN, ok};
use sha2::Digest;

/// An artifacts dir with three tiny "images" and their manifest (install checks sizes and
/// hashes, nothing boots them).
fn fake_artifacts(dir: &Path) -> PathBuf {
    let images = dir.join("artifacts/images");
    std::fs::create_dir_all(&images).unwrap();
    let mut list = Vec::new();
    for (name, file) in [
        ("kernel", "vmlinuz"),
        ("initramfs", "initramfs.cpio.gz"),
        ("rootfs", "rootfs.ext4"),
    ] {
        let body = format!("not really a {name}\n");
        std::fs::write(images.join(file), &body).unwrap();
        let sha = hex::encode(sha2::Sha256::digest(body.as_bytes()));
        list.push(
            serde_json::json!({"name": name, "file": file, "size": body.len(), "sha256": sha}),
        );
    }
    let manifest = serde_json::json!({"version": 1, "artifacts": list});
    std::fs::write(images.join("manifest.json"), manifest.to_string()).unwrap();
    dir.join("artifacts")
}

struct Setup {
    _tmp: tempfile::TempDir,
    home: PathBuf,
    destdir: PathBuf,
    artifacts: PathBuf,
    env: Vec<(String, PathBuf)>,
}

const PREFIX: &str = "/opt/tb";

impl Setup {
    fn new() -> Setup {
        let tmp = tempfile::tempdir().unwrap();
        let home = tmp.path().join("data");
        let destdir = tmp.path().join("dest");
        std::fs::create_dir_all(&destdir).unwrap();
        let artifacts = fake_artifacts(tmp.path());
        Setup {
            home,
            destdir,
            artifacts,
            env: Vec::new(),
            _tmp: tmp,
        }
    }

    fn run(&self, args: &[&str]) -> Output {
        let mut c = Command::new(BIN);
        c.args(args)
            .env("TRYBOXI_HOME", &self.home)
            .env("HOME", "/home/tester")
            .env("XDG_CONFIG_HOME", "/home/tester/.config")
            .env_remove("TRYBOXI_SYSTEMCTL")
            .env_remove("TRYBOXI_LOGINCTL")
            .stdin(Stdio::null());
        for (k, v) in &self.env {
            c.env(k, v);
        }
        c.output().unwrap()
    }

    /// `tryboxi install` of the test's artifacts into its destdir, whatever its exit status.
    fn install_output(&self, extra: &[&str]) -> Output {
        let a = self.artifacts.to_str().unwrap();
        let d = self.destdir.to_str().unwrap();
        let mut args = vec![
            "install",
            "--artifacts",
            a,
            "--prefix",
            PREFIX,
            "--destdir",
            d,
        ];
        args.extend_from_slice(extra);
        self.run(&args)
    }

    fn install(&self, extra: &[&str]) -> String {
        ok(self.install_output(extra))
    }

    fn uninstall(&self, extra: &[&str]) -> Output {
        let mut args = vec!["uninstall"];
        args.extend_from_slice(extra);
        self.run(&args)
    }

    fn staged(&self, p: &str) -> PathBuf {
        self.destdir.join(p.trim_start_matches('/'))
    }

    /// The unit path: system unit as root, user unit otherwise.
    fn unit(&self) -> PathBuf {
        if nix::unistd::geteuid().is_root() {
            self.staged("/etc/systemd/system/tryboxi.service")
        } else {
            self.staged("/home/tester/.config/systemd/user/tryboxi.service")
        }
    }

    /// Every file and symlink below the destdir with its content (or link target) and mtime.
    fn tree(&self) -> BTreeMap<PathBuf, (Vec<u8>, std::time::SystemTime)> {
        fn walk(d: &Path, out: &mut BTreeMap<PathBuf, (Vec<u8>, std::time::SystemTime)>) {
            for e in std::fs::read_dir(d).unwrap().flatten() {
                let p = e.path();
                let m = std::fs::symlink_metadata(&p).unwrap();
                if m.is_dir() {
                    walk(&p, out);
                } else {
                    let body = if m.file_type().is_symlink() {
                        std::fs::read_link(&p)
                            .unwrap()
                            .into_os_string()
                            .into_encoded_bytes()
                    } else {
                        std::fs::read(&p).unwrap()
                    };
                    out.insert(p, (body, m.modified().unwrap()));
                }
            }
        }
        let mut out = BTreeMap::new();
        walk(&self.destdir, &mut out);
        out
    }
}

/// The installed set of guest images the data root's pointer names.
fn current_images(home: &Path) -> PathBuf {
    let name = std::fs::read_to_string(home.join("artifacts/images.current")).unwrap();
    home.join("artifacts").join(name.trim())
}

/// A sandbox's disk layer `dir/disk.qcow2` over `base` (as the daemon makes them); its path.
fn layer_over(base: &Path, dir: &Path) -> PathBuf {
    let layer = dir.join("disk.qcow2");
    let o = Command::new("qemu-img")
        .args(["create", "-q", "-f", "qcow2", "-u", "-F", "raw", "-b"])
        .arg(base)
        .arg(&layer)
        .arg("1M")
        .output()
        .expect("qemu-img (cargo xtask deps installs it)");
    assert!(o.status.success(), "{o:?}");
    layer
}

/// Replace the rootfs of the fake artifacts with `body` (manifest updated).
fn new_rootfs(artifacts: &Path, body: &str) {
    let images = artifacts.join("images");
    let path = images.join("manifest.json");
    let mut m: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    for a in m["artifacts"].as_array_mut().unwrap() {
        if a["name"] == "rootfs" {
            a["size"] = body.len().into();
            a["sha256"] = hex::encode(sha2::Sha256::digest(body.as_bytes())).into();
        }
    }
    // A new file, as a build makes it (the installed set may hold a hard link to the old one).
    std::fs::remove_file(images.join("rootfs.ext4")).unwrap();
    std::fs::write(images.join("rootfs.ext4"), body).unwrap();
    std::fs::write(&path, m.to_string()).unwrap();
}

#[test]
fn install_is_idempotent_and_uninstall_removes_exactly_what_it_wrote() {
    let s = Setup::new();
    // Someone else's file in the same bin directory stays.
    let other = s.staged("/opt/tb/bin/other-tool");
    std::fs::create_dir_all(other.parent().unwrap()).unwrap();
    std::fs::write(&other, "#!/bin/sh\n").unwrap();
    let before = s.tree();

    let first = s.install(&[]);
    // No systemd below the destdir: the files are in place, and the message says how to run
    // the daemon by hand.
    assert!(
        first.contains("the service could not be started")
            && first.contains("systemd is not running")
            && first.contains("/opt/tb/bin/tryboxi serve"),
        "{first}"
    );
    let bin = s.staged("/opt/tb/bin/tryboxi");
    assert_eq!(std::fs::read(&bin).unwrap(), std::fs::read(BIN).unwrap());
    assert_eq!(
        std::fs::metadata(&bin).unwrap().permissions().mode() & 0o777,
        0o755
    );
    for alias in ["sandboxd", "sandboxctl", "sandbox-mcp"] {
        let link = s.staged(&format!("/opt/tb/bin/{alias}"));
        assert_eq!(std::fs::read_link(&link).unwrap(), Path::new("tryboxi"));
    }
    for f in [
        "/opt/tb/share/bash-completion/completions/tryboxi",
        "/opt/tb/share/zsh/site-functions/_tryboxi",
        "/opt/tb/share/fish/vendor_completions.d/tryboxi.fish",
        "/opt/tb/share/man/man1/tryboxi.1",
        "/opt/tb/share/man/man1/tryboxi-serve.1",
        "/opt/tb/share/man/man1/tryboxi-net-allow.1",
    ] {
        assert!(
            std::fs::metadata(s.staged(f)).unwrap().len() > 0,
            "{f} empty"
        );
    }
    let unit = std::fs::read_to_string(s.unit()).unwrap();
    for line in [
        "ExecStart=/opt/tb/bin/tryboxi serve".to_owned(),
        format!("Environment=\"TRYBOXI_HOME={}\"", s.home.display()),
        "KillMode=process".to_owned(),
        "Delegate=yes".to_owned(),
    ] {
        assert!(unit.lines().any(|l| l == line), "{line}:\n{unit}");
    }
    assert!(current_images(&s.home).join("manifest.json").is_file());
    assert!(s.home.join("installed.json").is_file());

    // A second run changes nothing (not one mtime) and says so.
    let installed = s.tree();
    let second = s.install(&[]);
    assert!(second.contains("nothing changed"), "{second}");
    assert!(second.contains("guest images: unchanged"), "{second}");
    assert_eq!(s.tree(), installed);

    // Uninstall: exactly the installed files go; the data root stays.
    let out = ok(s.uninstall(&[]));
    assert!(out.contains("kept the data root"), "{out}");
    assert_eq!(s.tree(), before, "{out}");
    assert!(current_images(&s.home).join("manifest.json").is_file());
    assert!(!s.home.join("installed.json").exists());
    let again = ok(s.uninstall(&[]));
    assert!(again.contains("nothing to remove"), "{again}");
    assert_eq!(s.tree(), before);
}

#[test]
fn no_service_installs_the_programs_but_no_unit() {
    let s = Setup::new();
    let out = s.install(&["--no-service"]);
    assert!(out.contains("--no-service"), "{out}");
    assert!(s.staged("/opt/tb/bin/sandboxd").exists());
    assert!(!s.unit().exists());
    ok(s.uninstall(&[]));
    assert!(s.tree().is_empty(), "{:?}", s.tree().keys());
}

#[test]
fn purge_needs_a_terminal_or_yes_and_then_deletes_the_data_root() {
    let s = Setup::new();
    s.install(&[]);
    let installed = s.tree();
    // stdin is not a terminal and there is no --yes: refused, nothing changed.
    let out = s.uninstall(&["--purge"]);
    assert_eq!(out.status.code(), Some(2), "{out:?}");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("--yes") && err.contains("nothing was changed"),
        "{err}"
    );
    assert_eq!(s.tree(), installed);
    assert!(s.home.join("installed.json").exists());
    // With --yes: everything goes, the data root too.
    let out = ok(s.uninstall(&["--purge", "--yes"]));
    assert!(out.contains("deleted the data root"), "{out}");
    assert!(!s.home.exists());
    assert!(s.tree().is_empty(), "{:?}", s.tree().keys());
}

#[test]
fn purge_refuses_a_directory_that_is_not_a_data_root() {
    let s = Setup::new();
    std::fs::create_dir_all(&s.home).unwrap();
    std::fs::write(s.home.join("precious.txt"), "x").unwrap();
    let out = s.uninstall(&["--purge", "--yes"]);
    assert_eq!(out.status.code(), Some(2), "{out:?}");
    assert!(s.home.join("precious.txt").exists());
}

/// A stand-in for systemctl and loginctl: appends its arguments to `calls` and keeps the
/// unit's enabled/active state and the lingering flag as files.
fn fake_manager(dir: &Path, destdir: &Path) -> (PathBuf, PathBuf, PathBuf) {
    let calls = dir.join("calls");
    let state = dir.join("state");
    std::fs::create_dir_all(&state).unwrap();
    let systemctl = dir.join("systemctl");
    std::fs::write(
        &systemctl,
        format!(
            "#!/bin/sh\necho \"systemctl $*\" >> {calls}\ncase \"$*\" in\n\
             *is-enabled*) test -e {st}/enabled ;;\n*is-active*) test -e {st}/active ;;\n\
             *'disable --now'*) rm -f {st}/enabled {st}/active ;;\n\
             *enable*) touch {st}/enabled ;;\n*start*) touch {st}/active ;;\nesac\n",
            calls = calls.display(),
            st = state.display()
        ),
    )
    .unwrap();
    let linger = destdir.join("var/lib/systemd/linger");
    let loginctl = dir.join("loginctl");
    std::fs::write(
        &loginctl,
        format!(
            "#!/bin/sh\necho \"loginctl $*\" >> {calls}\nmkdir -p {l}\ncase \"$1\" in\n\
             enable-linger) touch {l}/$2 ;;\ndisable-linger) rm -f {l}/$2 ;;\nesac\n",
            calls = calls.display(),
            l = linger.display()
        ),
    )
    .unwrap();
    for p in [&systemctl, &loginctl] {
        std::fs::set_permissions(p, std::fs::Permissions::from_mode(0o755)).unwrap();
    }
    (systemctl, loginctl, calls)
}

/// The calls made since the last look, without the read-only queries.
fn changes(calls: &Path, seen: &mut usize) -> Vec<String> {
    let all: Vec<String> = std::fs::read_to_string(calls)
        .unwrap_or_default()
        .lines()
        .map(str::to_owned)
        .collect();
    let new = all[*seen..].to_vec();
    *seen = all.len();
    new.into_iter()
        .filter(|c| !c.contains("is-enabled") && !c.contains("is-active"))
        .collect()
}

#[test]
fn with_systemd_install_enables_and_starts_and_uninstall_stops_and_disables() {
    let mut s = Setup::new();
    let tools = s._tmp.path().join("tools");
    let (systemctl, loginctl, calls) = fake_manager(&tools, &s.destdir);
    std::fs::create_dir_all(s.staged("/run/systemd/system")).unwrap();
    s.env.push(("TRYBOXI_SYSTEMCTL".into(), systemctl));
    s.env.push(("TRYBOXI_LOGINCTL".into(), loginctl));
    let root = nix::unistd::geteuid().is_root();
    let ctl = if root {
        "systemctl"
    } else {
        "systemctl --user"
    };
    let mut seen = 0;

    let out = s.install(&[]);
    assert!(!out.contains("could not be started"), "{out}");
    let mut want = vec![
        format!("{ctl} daemon-reload"),
        format!("{ctl} enable tryboxi.service"),
        format!("{ctl} start tryboxi.service"),
    ];
    let linger_user = (!root).then(|| {
        nix::unistd::User::from_uid(nix::unistd::geteuid())
            .unwrap()
            .unwrap()
            .name
    });
    if let Some(user) = &linger_user {
        want.insert(0, format!("loginctl enable-linger {user}"));
    }
    assert_eq!(changes(&calls, &mut seen), want, "{out}");

    // Again: the manager is only asked, nothing is enabled, started or restarted.
    let out = s.install(&[]);
    assert!(out.contains("nothing changed"), "{out}");
    assert_eq!(changes(&calls, &mut seen), Vec::<String>::new());

    // A changed unit (here: another data root) is reloaded and the service restarted.
    s.env
        .push(("TRYBOXI_HOME".into(), s.home.join("elsewhere")));
    let out = s.install(&[]);
    assert!(out.contains("restarted"), "{out}");
    assert_eq!(
        changes(&calls, &mut seen),
        [
            format!("{ctl} daemon-reload"),
            format!("{ctl} restart tryboxi.service")
        ]
    );
    s.env.pop();

    // Uninstall stops and disables it, removes the unit and reloads; lingering goes off again
    // only because install turned it on.
    let out = ok(s.uninstall(&[]));
    let mut want = vec![
        format!("{ctl} disable --now tryboxi.service"),
        format!("{ctl} daemon-reload"),
    ];
    if let Some(user) = linger_user {
        want.push(format!("loginctl disable-linger {user}"));
    }
    assert_eq!(changes(&calls, &mut seen), want, "{out}");
    assert!(!s.unit().exists());
    let out = ok(s.uninstall(&[]));
    assert!(out.contains("nothing to remove"), "{out}");
    assert_eq!(changes(&calls, &mut seen), Vec::<String>::new());
}

#[test]
fn purge_refuses_while_a_daemon_or_a_qemu_still_uses_the_data_root() {
    use nix::fcntl::{Flock, FlockArg};
    let s = Setup::new();
    s.install(&["--no-service"]);
    // A daemon holds the lock: the install is removed, the data root is not.
    let lock = std::fs::File::create(s.home.join("tryboxi.lock")).unwrap();
    let held = Flock::lock(lock, FlockArg::LockExclusiveNonblock).unwrap();
    let out = s.uninstall(&["--purge", "--yes"]);
    assert_eq!(out.status.code(), Some(2), "{out:?}");
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("still uses"),
        "{out:?}"
    );
    assert!(current_images(&s.home).join("manifest.json").exists());
    drop(held);
    // A QEMU left running (`shutdown = "leave"`): a process that looks like ours for its dir.
    let vm = s.home.join("sandboxes/sbx_left");
    std::fs::create_dir_all(&vm).unwrap();
    let pidfile = vm.join("qemu.pid");
    let mut qemu = Command::new("bash")
        .arg("-c")
        .arg(format!(
            "exec -a qemu-system-x86_64 sh -c 'sleep 30; :' -pidfile {}",
            pidfile.display()
        ))
        .spawn()
        .unwrap();
    std::fs::write(&pidfile, qemu.id().to_string()).unwrap();
    // Until bash has exec'd the stand-in, its cmdline is bash's own.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    while !std::fs::read(format!("/proc/{}/cmdline", qemu.id()))
        .unwrap_or_default()
        .starts_with(b"qemu-system")
    {
        assert!(
            std::time::Instant::now() < deadline,
            "the stand-in did not start"
        );
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
    let out = s.uninstall(&["--purge", "--yes"]);
    let _ = qemu.kill();
    let _ = qemu.wait();
    assert_eq!(out.status.code(), Some(2), "{out:?}");
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("a QEMU"),
        "{out:?}"
    );
    assert!(vm.exists());
    // Nothing runs any more: purged.
    ok(s.uninstall(&["--purge", "--yes"]));
    assert!(!s.home.exists());
}

#[test]
fn a_second_install_below_another_destdir_is_refused() {
    let s = Setup::new();
    s.install(&["--no-service"]);
    let other = s._tmp.path().join("other");
    let out = s.run(&[
        "install",
        "--artifacts",
        s.artifacts.to_str().unwrap(),
        "--destdir",
        other.to_str().unwrap(),
    ]);
    assert_eq!(out.status.code(), Some(2), "{out:?}");
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("tryboxi uninstall"),
        "{out:?}"
    );
    assert!(!other.exists());
}

/// On a terminal `--purge` asks: anything but `yes` changes nothing, `yes` purges. The
/// terminal is `script`'s pty (util-linux), fed from a pipe.
#[test]
fn purge_asks_on_a_terminal() {
    if !Path::new("/usr/bin/script").exists() {
        common::skip_unless_ci("no /usr/bin/script (util-linux) to give uninstall a terminal");
        return;
    }
    let s = Setup::new();
    s.install(&["--no-service"]);
    let on_a_tty = |answer: &str| {
        let mut c = Command::new("/usr/bin/script")
            .args(["-qec", &format!("{BIN} uninstall --purge"), "/dev/null"])
            .env("TRYBOXI_HOME", &s.home)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        use std::io::Write as _;
        c.stdin
            .take()
            .unwrap()
            .write_all(answer.as_bytes())
            .unwrap();
        let out = c.wait_with_output().unwrap();
        (
            out.status.code(),
            String::from_utf8_lossy(&out.stdout).into_owned(),
        )
    };
    let (code, text) = on_a_tty("no\n");
    assert_eq!(code, Some(2), "{text}");
    assert!(
        text.contains("Type `yes`") && text.contains("not confirmed"),
        "{text}"
    );
    assert!(s.home.join("installed.json").exists());
    let (code, text) = on_a_tty("yes\n");
    assert_eq!(code, Some(0), "{text}");
    assert!(text.contains("deleted the data root"), "{text}");
    assert!(!s.home.exists());
}

/// A service manager that fails (e.g. `systemctl --user` with no user bus): install exits 1,
/// names the failing call and still says how to run the daemon by hand.
#[test]
fn a_failing_service_manager_is_reported_with_the_manual_way() {
    let mut s = Setup::new();
    let tools = s._tmp.path().join("tools");
    std::fs::create_dir_all(&tools).unwrap();
    let failing = tools.join("systemctl");
    std::fs::write(
        &failing,
        "#!/bin/sh\necho 'Failed to connect to bus: No medium found' >&2\nexit 1\n",
    )
    .unwrap();
    std::fs::set_permissions(&failing, std::fs::Permissions::from_mode(0o755)).unwrap();
    std::fs::create_dir_all(s.staged("/run/systemd/system")).unwrap();
    // Lingering counts as on, so only systemctl is called.
    let user = nix::unistd::User::from_uid(nix::unistd::geteuid())
        .unwrap()
        .unwrap()
        .name;
    std::fs::create_dir_all(s.staged("/var/lib/systemd/linger")).unwrap();
    std::fs::write(s.staged(&format!("/var/lib/systemd/linger/{user}")), "").unwrap();
    s.env.push(("TRYBOXI_SYSTEMCTL".into(), failing));
    let out = s.install_output(&[]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(
        err.contains("daemon-reload") && err.contains("Failed to connect to bus"),
        "{err}"
    );
    assert!(err.contains("/opt/tb/bin/tryboxi serve"), "{err}");
    assert!(s.unit().exists() && s.staged("/opt/tb/bin/tryboxi").exists());
}

/// New images never replace files a disk layer is built on: the older set stays while a layer
/// names its rootfs as backing file, and goes once nothing does.
#[test]
fn an_install_keeps_the_older_images_a_layer_uses_and_removes_them_after() {
    let s = Setup::new();
    s.install(&["--no-service"]);
    let first = current_images(&s.home);
    let old_rootfs = first.join("rootfs.ext4");
    assert_eq!(
        std::fs::read_to_string(&old_rootfs).unwrap(),
        "not really a rootfs\n"
    );
    // A paused sandbox's disk: a qcow2 layer over the installed rootfs.
    let sbx = s.home.join("sandboxes/sbx_0123456789abcdef");
    std::fs::create_dir_all(&sbx).unwrap();
    let layer = layer_over(&old_rootfs, &sbx);

    new_rootfs(&s.artifacts, "another rootfs\n");
    let out = s.install(&["--no-service"]);
    let second = current_images(&s.home);
    assert_ne!(second, first, "{out}");
    assert_eq!(
        std::fs::read_to_string(second.join("rootfs.ext4")).unwrap(),
        "another rootfs\n"
    );
    // The layer's base is what it was made on.
    assert_eq!(
        std::fs::read_to_string(&old_rootfs).unwrap(),
        "not really a rootfs\n",
        "{out}"
    );
    assert!(out.contains("keeping the older set"), "{out}");
    assert!(out.contains(layer.to_str().unwrap()), "{out}");

    // The sandbox gone, the next install (nothing else changed) removes the older set.
    std::fs::remove_dir_all(&sbx).unwrap();
    let out = s.install(&["--no-service"]);
    assert!(out.contains("guest images: unchanged"), "{out}");
    assert!(out.contains("removed older guest images"), "{out}");
    assert!(!first.exists() && second.join("manifest.json").is_file());
}

/// An installed set that no longer matches its manifest is not replaced while a layer is built
/// on it: install refuses, names the layer, and leaves the set as it is.
#[test]
fn a_damaged_set_a_layer_uses_is_not_replaced_under_it() {
    let s = Setup::new();
    s.install(&["--no-service"]);
    let set = current_images(&s.home);
    let sbx = s.home.join("sandboxes/sbx_0123456789abcdef");
    std::fs::create_dir_all(&sbx).unwrap();
    let layer = layer_over(&set.join("rootfs.ext4"), &sbx);
    // Damaged: its initramfs is gone (the sources are intact).
    std::fs::remove_file(set.join("initramfs.cpio.gz")).unwrap();
    let out = s.install_output(&["--no-service"]);
    assert_eq!(out.status.code(), Some(2), "{out:?}");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains(layer.to_str().unwrap()), "{err}");
    assert!(set.join("rootfs.ext4").is_file() && set.join("manifest.json").is_file());
    // The layer gone, the same install repairs the set.
    std::fs::remove_dir_all(&sbx).unwrap();
    s.install(&["--no-service"]);
    assert!(current_images(&s.home).join("initramfs.cpio.gz").is_file());
}
