//! Non-root is a first-class mode, end to end with the real binary:
//!
//! - an ordinary user runs its own daemon (`tryboxi serve`, data root defaulting to
//!   `~/.local/share/tryboxi`, socket owned by that user) and drives it with the CLI: create
//!   from a repo it owns, exec (stdout and exit code), diff, apply (the file lands owned by the
//!   user), snapshot, rm; its QEMU runs as that user. As root (CI), the user is a system user
//!   made here (`useradd`, idempotent) and every command goes through `runuser`, with the
//!   binary and the guest images reached through a world-readable staging directory of hard
//!   links (copies across filesystems); otherwise it is the current user with a temporary HOME.
//! - `[api] allowed_uids`: a root daemon lets a listed uid run `tryboxi ls`, and refuses
//!   another uid with the message naming the uid and the key, shown as it is by the CLI;
//!   that other user can list nothing in the data root (root only: needs two other uids).
//!
//! Uses the guest images from `TRYBOXI_ARTIFACTS` or `_out/` (skips without them, except under
//! CI).
// This test binary is dynamically linked, so its own NSS lookups are safe (clippy.toml bans them
// for the static product binary).
#![allow(clippy::disallowed_methods)]

mod common;

use std::os::unix::fs::MetadataExt as _;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

use common::{BIN, Daemon, SMALL_VMS, artifacts, raw_http, skip_unless_ci};

const PATH: &str = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin";
/// The user the round trip runs as under root, and the one `allowed_uids` does not list.
const USER: &str = "tbx-e2e-user";
const OTHER: &str = "tbx-e2e-other";

fn is_root() -> bool {
    nix::unistd::geteuid().is_root()
}

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

/// Held while a user is made: the tests of this binary run in parallel, and two `useradd`
/// at once on a fresh machine left one user's home filled with the other's files (seen in
/// CI: the daemon then could not `chmod` its own data root).
static USERADD: std::sync::Mutex<()> = std::sync::Mutex::new(());

/// `path` and everything below it (symlinks not followed) owned by `uid:gid`.
fn chown_tree(path: &Path, uid: u32, gid: u32) {
    std::os::unix::fs::lchown(path, Some(uid), Some(gid)).unwrap();
    if std::fs::symlink_metadata(path).unwrap().is_dir() {
        for e in std::fs::read_dir(path).unwrap() {
            chown_tree(&e.unwrap().path(), uid, gid);
        }
    }
}

/// The system user `name` (made with `useradd` if missing): (uid, gid, home). Its home and
/// everything in it are its own.
fn ensure_user(name: &str) -> (u32, u32, PathBuf) {
    let _one_at_a_time = USERADD.lock().unwrap_or_else(|p| p.into_inner());
    if nix::unistd::User::from_name(name).unwrap().is_none() {
        let o = Command::new("useradd")
            .args([
                "--system",
                "--user-group",
                "--create-home",
                "--shell",
                "/bin/sh",
            ])
            .args(["--comment", "tryboxi e2e test user", name])
            .output()
            .expect("useradd");
        // 9: made meanwhile by a concurrent test.
        assert!(
            o.status.success() || o.status.code() == Some(9),
            "useradd {name}: {}",
            text(&o.stderr)
        );
    }
    let u = nix::unistd::User::from_name(name).unwrap().expect("user");
    std::fs::create_dir_all(&u.dir).unwrap();
    chown_tree(&u.dir, u.uid.as_raw(), u.gid.as_raw());
    (u.uid.as_raw(), u.gid.as_raw(), u.dir)
}

/// Hard link `src` at `dst`, or copy it when they are on different filesystems.
fn link_or_copy(src: &Path, dst: &Path) {
    if std::fs::hard_link(src, dst).is_err() {
        std::fs::copy(src, dst).unwrap_or_else(|e| panic!("copy {}: {e}", src.display()));
    }
}

/// A world-readable directory holding the binary and `images/` (links to the built images),
/// so another user reaches them whatever the modes of the checkout's parents.
struct Stage {
    dir: tempfile::TempDir,
}

impl Stage {
    fn new(art: Option<&Path>) -> Stage {
        use std::os::unix::fs::PermissionsExt as _;
        let dir = tempfile::Builder::new()
            .prefix("tbx-nonroot-")
            .tempdir()
            .unwrap();
        let open =
            |p: &Path| std::fs::set_permissions(p, std::fs::Permissions::from_mode(0o755)).unwrap();
        open(dir.path());
        link_or_copy(Path::new(BIN), &dir.path().join("tryboxi"));
        if let Some(art) = art {
            let images = dir.path().join("images");
            std::fs::create_dir(&images).unwrap();
            open(&images);
            for e in std::fs::read_dir(art.join("images")).unwrap() {
                let e = e.unwrap();
                if e.file_type().unwrap().is_file() {
                    link_or_copy(&e.path(), &images.join(e.file_name()));
                }
            }
        }
        Stage { dir }
    }
    fn bin(&self) -> PathBuf {
        self.dir.path().join("tryboxi")
    }
    fn artifacts(&self) -> &Path {
        self.dir.path()
    }
}

/// Runs the binary as one user with a clean environment: `HOME` (so the data root is the
/// default one under it) and `PATH`, plus `env`.
struct As {
    /// `Some(name)`: through `runuser -u name` (the test is root).
    user: Option<String>,
    uid: u32,
    home: PathBuf,
    bin: PathBuf,
    env: Vec<(String, String)>,
}

impl As {
    fn command(&self, args: &[&str]) -> Command {
        let mut env: Vec<String> = vec![format!("HOME={}", self.home.display())];
        env.push(format!("PATH={PATH}"));
        env.extend(self.env.iter().map(|(k, v)| format!("{k}={v}")));
        let mut c = match &self.user {
            Some(u) => {
                let mut c = Command::new("runuser");
                c.args(["-u", u, "--", "env", "-i"])
                    .args(&env)
                    .arg(&self.bin);
                c
            }
            None => {
                let mut c = Command::new(&self.bin);
                c.env_clear();
                for kv in &env {
                    let (k, v) = kv.split_once('=').unwrap();
                    c.env(k, v);
                }
                c
            }
        };
        c.args(args).stdin(Stdio::null());
        c
    }

    fn run(&self, args: &[&str]) -> Output {
        self.command(args).output().expect("run the CLI")
    }

    /// Run; it must succeed. Its stdout.
    fn ok(&self, args: &[&str]) -> String {
        let o = self.run(args);
        assert!(
            o.status.success(),
            "{args:?}: {:?}\n{}{}",
            o.status,
            text(&o.stdout),
            text(&o.stderr)
        );
        text(&o.stdout)
    }

    fn data_root(&self) -> PathBuf {
        self.home.join(".local/share/tryboxi")
    }
}

/// Write `data` at `path` (making parents) owned by `uid`/`gid`.
fn write_owned(path: &Path, data: &str, uid: u32, gid: u32) {
    let mut made = Vec::new();
    let mut p = path.parent();
    while let Some(d) = p
        && !d.exists()
    {
        made.push(d.to_path_buf());
        p = d.parent();
    }
    std::fs::create_dir_all(path.parent().unwrap()).unwrap();
    std::fs::write(path, data).unwrap();
    for p in made.iter().chain([&path.to_path_buf()]) {
        std::os::unix::fs::chown(p, Some(uid), Some(gid)).unwrap();
    }
}

/// The pids of the QEMU processes whose command line names `needle`.
fn qemu_pids(needle: &str) -> Vec<u32> {
    let mut out = Vec::new();
    for e in std::fs::read_dir("/proc").unwrap().flatten() {
        let Ok(pid) = e.file_name().to_string_lossy().parse::<u32>() else {
            continue;
        };
        let comm = std::fs::read_to_string(e.path().join("comm")).unwrap_or_default();
        let cmd = std::fs::read(e.path().join("cmdline")).unwrap_or_default();
        if comm.starts_with("qemu-system") && text(&cmd).contains(needle) {
            out.push(pid);
        }
    }
    out
}

fn poll(what: &str, limit: Duration, mut done: impl FnMut() -> bool) {
    let deadline = Instant::now() + limit;
    while !done() {
        assert!(Instant::now() < deadline, "{what}: not within {limit:?}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// The user's own daemon: started with `serve`, stopped by the pid in its lock file.
struct OwnDaemon<'a> {
    who: &'a As,
    log: PathBuf,
    child: std::process::Child,
}

impl<'a> OwnDaemon<'a> {
    fn start(who: &'a As, artifacts: &Path, log: PathBuf) -> OwnDaemon<'a> {
        let f = std::fs::File::create(&log).unwrap();
        let child = who
            .command(&["serve", "--artifacts", artifacts.to_str().unwrap()])
            .stdout(f.try_clone().unwrap())
            .stderr(f)
            .spawn()
            .expect("spawn serve");
        let mut d = OwnDaemon { who, log, child };
        let sock = who.data_root().join("tryboxi.sock");
        poll(
            "the daemon answers /v1/health",
            Duration::from_secs(30),
            || {
                if let Some(st) = d.child.try_wait().unwrap() {
                    panic!("serve exited ({st}): {}", d.log_text());
                }
                std::os::unix::net::UnixStream::connect(&sock)
                    .ok()
                    .and_then(|mut s| {
                        raw_http(&mut s, "GET", "/v1/health", None, &[("Host", "x")]).ok()
                    })
                    .is_some_and(|r| r.status == 200)
            },
        );
        let md = std::fs::metadata(&sock).unwrap();
        assert_eq!(md.uid(), who.uid, "the socket is the user's");
        d
    }

    fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }
}

impl Drop for OwnDaemon<'_> {
    fn drop(&mut self) {
        let pid = std::fs::read_to_string(self.who.data_root().join("tryboxi.lock"))
            .ok()
            .and_then(|p| p.trim().parse::<i32>().ok());
        if let Some(pid) = pid {
            let _ = nix::sys::signal::kill(
                nix::unistd::Pid::from_raw(pid),
                nix::sys::signal::Signal::SIGTERM,
            );
        }
        let deadline = Instant::now() + Duration::from_secs(60);
        while self.child.try_wait().ok().flatten().is_none() && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(50));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
        if std::thread::panicking() {
            eprintln!("--- daemon log ---\n{}", self.log_text());
        }
    }
}

#[test]
fn an_ordinary_user_runs_its_own_daemon_through_a_whole_round_trip() {
    let Some(art) = artifacts() else { return };
    let started = Instant::now();
    // Root (CI): a system user through runuser. Not root: this user, with a temporary HOME.
    let tmp_home = tempfile::tempdir().unwrap();
    let stage;
    let (who, gid, art) = if is_root() {
        let (uid, gid, home) = ensure_user(USER);
        stage = Stage::new(Some(&art));
        let who = As {
            user: Some(USER.into()),
            uid,
            home,
            bin: stage.bin(),
            env: Vec::new(),
        };
        (who, gid, stage.artifacts().to_path_buf())
    } else {
        let who = As {
            user: None,
            uid: nix::unistd::geteuid().as_raw(),
            home: tmp_home.path().to_path_buf(),
            bin: PathBuf::from(BIN),
            env: Vec::new(),
        };
        (who, nix::unistd::getegid().as_raw(), art)
    };
    // A fresh default data root (a previous run's is removed) with the small test config.
    let root = who.data_root();
    let _ = std::fs::remove_dir_all(&root);
    let config = format!("{SMALL_VMS}[pool]\ngolden = false\nsize = 0\n");
    write_owned(&root.join("config.toml"), &config, who.uid, gid);
    let repo = who.home.join(format!("tbx-repo-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&repo);
    write_owned(&repo.join("a.txt"), "hello\n", who.uid, gid);

    let log = tmp_home.path().join("daemon.log");
    let d = OwnDaemon::start(&who, &art, log);
    let id = who.ok(&["create", "-w", repo.to_str().unwrap()]);
    let id = id.split_whitespace().next().unwrap_or_default().to_owned();
    assert!(id.starts_with("sbx_"), "{id}");
    assert!(
        root.join("sandboxes").join(&id).is_dir(),
        "the sandbox lives in the default data root {}",
        root.display()
    );

    let pids = qemu_pids(&id);
    assert_eq!(pids.len(), 1, "one QEMU for {id}: {pids:?}");
    let qemu_uid = std::fs::metadata(format!("/proc/{}", pids[0]))
        .unwrap()
        .uid();
    assert_eq!(qemu_uid, who.uid, "QEMU runs as the daemon's user");
    // Where the host allows unprivileged user namespaces (SECURITY.md, QEMU fence), that
    // QEMU is in a user + mount namespace of its own: no /etc/passwd, no /proc in its view.
    let userns_ok = std::fs::read_to_string("/proc/sys/user/max_user_namespaces")
        .is_ok_and(|n| n.trim() != "0")
        && std::fs::read_to_string("/proc/sys/kernel/unprivileged_userns_clone")
            .map_or(true, |v| v.trim() != "0");
    if userns_ok {
        let ns =
            |pid: &str, which: &str| std::fs::read_link(format!("/proc/{pid}/ns/{which}")).unwrap();
        let q = pids[0].to_string();
        for which in ["user", "mnt"] {
            assert_ne!(
                ns(&q, which),
                ns("self", which),
                "QEMU shares the host's {which} namespace"
            );
        }
        assert!(!std::path::Path::new(&format!("/proc/{q}/root/etc/passwd")).exists());
        assert!(!std::path::Path::new(&format!("/proc/{q}/root/proc/self")).exists());
    } else {
        eprintln!("unprivileged user namespaces are off here: QEMU has no namespace of its own");
    }

    let o = who.run(&[
        "exec",
        &id,
        "--",
        "sh",
        "-c",
        "cat /workspace/a.txt; echo new > /workspace/b.txt; exit 7",
    ]);
    assert_eq!(o.status.code(), Some(7), "{}", text(&o.stderr));
    assert_eq!(text(&o.stdout), "hello\n");

    let diff = who.ok(&["diff", &id]);
    assert!(diff.contains("b/b.txt") && diff.contains("+new"), "{diff}");
    who.ok(&["apply", &id]);
    let b = repo.join("b.txt");
    assert_eq!(std::fs::read_to_string(&b).unwrap(), "new\n");
    assert_eq!(
        std::fs::metadata(&b).unwrap().uid(),
        who.uid,
        "applied file's owner"
    );

    let snap = who.ok(&["snapshot", "create", &id]);
    let snap = snap
        .split_whitespace()
        .next()
        .unwrap_or_default()
        .to_owned();
    assert!(snap.starts_with("snap_"), "{snap}");
    assert!(who.ok(&["snapshot", "ls", &id]).contains(&snap));

    who.ok(&["rm", &id]);
    assert!(!who.ok(&["ls"]).contains(&id));
    poll("QEMU exits after rm", Duration::from_secs(30), || {
        qemu_pids(&id).is_empty()
    });
    drop(d);
    let _ = std::fs::remove_dir_all(&repo);
    eprintln!(
        "non-root round trip as uid {} took {:.1} s",
        who.uid,
        started.elapsed().as_secs_f64()
    );
}

#[test]
fn a_root_daemon_lets_in_listed_uids_and_names_the_key_to_others() {
    if !is_root() {
        skip_unless_ci("allowed_uids needs root (a root daemon and two other uids)");
        return;
    }
    let (uid, _, home) = ensure_user(USER);
    let (other_uid, _, other_home) = ensure_user(OTHER);
    let stage = Stage::new(None);
    let d = Daemon::start(Some(&format!("[api]\nallowed_uids = [{uid}]\n")), &[]);
    let env = vec![(
        "TRYBOXI_HOME".to_owned(),
        d.root().to_str().unwrap().to_owned(),
    )];
    let listed = As {
        user: Some(USER.into()),
        uid,
        home,
        bin: stage.bin(),
        env: env.clone(),
    };
    let other = As {
        user: Some(OTHER.into()),
        uid: other_uid,
        home: other_home,
        bin: stage.bin(),
        env,
    };
    assert!(
        listed.ok(&["ls"]).starts_with("ID "),
        "the listed uid lists"
    );

    let o = other.run(&["ls"]);
    let want = format!(
        "tryboxi: uid {other_uid} may not use this daemon: add it to [api] allowed_uids in {}\n",
        d.root().join("config.toml").display()
    );
    assert_eq!(text(&o.stderr), want);
    assert_eq!(o.status.code(), Some(3));

    // The other user reaches the socket by its name and nothing else of the data root.
    let sh = |script: &str| {
        Command::new("runuser")
            .args(["-u", OTHER, "--", "sh", "-c", script])
            .arg("sh")
            .arg(d.root())
            .output()
            .unwrap()
            .status
            .success()
    };
    assert!(
        !sh("ls \"$1\" >/dev/null 2>&1"),
        "the data root is listable"
    );
    for entry in std::fs::read_dir(d.root()).unwrap().flatten() {
        let name = entry.file_name().to_string_lossy().into_owned();
        if name == "tryboxi.sock" {
            continue;
        }
        let p = entry.path();
        let script = format!(
            "cat '{0}' >/dev/null 2>&1 || ls '{0}/' >/dev/null 2>&1",
            p.display()
        );
        assert!(
            !sh(&script),
            "{name} in the data root is open to other users"
        );
    }
}
