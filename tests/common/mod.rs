//! Test harness: a real `tryboxi serve` on a temporary data root, driven by the real CLI binary
//! and by raw HTTP over its unix socket.
#![allow(dead_code)]

pub mod proxy;
pub mod tls;
pub mod ws;

use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

pub const BIN: &str = env!("CARGO_BIN_EXE_tryboxi");

pub struct Daemon {
    pub home: tempfile::TempDir,
    pub child: Option<Child>,
    pub log: PathBuf,
    /// The `serve` arguments of the last start (see [`Daemon::respawn`]).
    args: Vec<String>,
}

impl Daemon {
    /// Start a daemon with an optional `config.toml` and extra `serve` arguments; waits until
    /// `/v1/health` answers (bounded).
    pub fn start(config: Option<&str>, extra: &[&str]) -> Daemon {
        Daemon::start_env(config, extra, &[])
    }

    /// [`Daemon::start`] with extra environment variables for this first start only (a test
    /// hook such as `TRYBOXI_TEST_KILL_AFTER_WRITES`).
    pub fn start_env(config: Option<&str>, extra: &[&str], env: &[(&str, &str)]) -> Daemon {
        Daemon::start_in(new_home(), config, extra, env)
    }

    /// [`Daemon::start_env`] on a data root the test made (e.g. a size-limited tmpfs mounted on
    /// a [`new_home`]).
    pub fn start_in(
        home: tempfile::TempDir,
        config: Option<&str>,
        extra: &[&str],
        env: &[(&str, &str)],
    ) -> Daemon {
        // No golden snapshot builds and no warm pool unless a test asks for them (each is a
        // background boot or a running QEMU: CI stays light; tests/fork_e2e.rs covers them).
        const NO_POOL: &str = "\n[pool]\ngolden = false\nsize = 0\n";
        let config = match config {
            Some(c) if !c.contains("[pool]") => Some(format!("{c}{NO_POOL}")),
            Some(c) => Some(c.to_owned()),
            None => Some(NO_POOL.to_owned()),
        };
        if let Some(c) = config {
            std::fs::write(home.path().join("config.toml"), c).unwrap();
        }
        // The log lives beside the data root, not in it: a test that fills the data root
        // (tests/full_disk_e2e.rs) still gets every line of it.
        let mut d = Daemon {
            log: home.path().with_extension("log"),
            home,
            child: None,
            args: Vec::new(),
        };
        d.spawn_env(extra, env);
        d
    }

    /// Start `serve` with `extra` arguments on this data root (after a stop or kill);
    /// waits until `/v1/health` answers (bounded).
    pub fn spawn(&mut self, extra: &[&str]) {
        self.spawn_env(extra, &[]);
    }

    fn spawn_env(&mut self, extra: &[&str], env: &[(&str, &str)]) {
        self.args = extra.iter().map(|a| a.to_string()).collect();
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&self.log)
            .unwrap();
        let child = Command::new(BIN)
            .arg("serve")
            .args(extra)
            .env("TRYBOXI_HOME", self.home.path())
            .env("TRYBOXI_LOG", "debug")
            // The daemon honours these; the tests set a proxy in its config when they want one.
            .env_remove("https_proxy")
            .env_remove("HTTPS_PROXY")
            .env_remove("http_proxy")
            .env_remove("HTTP_PROXY")
            .env_remove("all_proxy")
            .env_remove("ALL_PROXY")
            .envs(env.iter().copied())
            .stdin(Stdio::null())
            .stdout(log.try_clone().unwrap())
            .stderr(log)
            .spawn()
            .expect("spawn daemon");
        self.child = Some(child);
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            if let Ok(r) = self.try_request("GET", "/v1/health", None)
                && r.status == 200
            {
                return;
            }
            if let Some(status) = self.child.as_mut().unwrap().try_wait().unwrap() {
                panic!("daemon exited early ({status}): {}", self.log_text());
            }
            assert!(
                Instant::now() < deadline,
                "daemon did not answer in 30 s: {}",
                self.log_text()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// [`Daemon::spawn`] again with the arguments of the last start (a daemon restart).
    pub fn respawn(&mut self) {
        let args = self.args.clone();
        self.spawn(&args.iter().map(String::as_str).collect::<Vec<_>>());
    }

    pub fn root(&self) -> &Path {
        self.home.path()
    }

    pub fn socket(&self) -> PathBuf {
        self.home.path().join("tryboxi.sock")
    }

    pub fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// Run the CLI against this daemon.
    pub fn cli(&self, args: &[&str]) -> Output {
        Command::new(BIN)
            .args(args)
            .env("TRYBOXI_HOME", self.home.path())
            .stdin(Stdio::null())
            .output()
            .expect("run cli")
    }

    /// Run the CLI against this daemon with `input` on its stdin (e.g. `secret set`'s value).
    pub fn cli_stdin(&self, args: &[&str], input: &[u8]) -> Output {
        let mut c = Command::new(BIN)
            .args(args)
            .env("TRYBOXI_HOME", self.home.path())
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("run cli");
        c.stdin.take().unwrap().write_all(input).unwrap();
        c.wait_with_output().expect("run cli")
    }

    pub fn request(&self, method: &str, path: &str, body: Option<&str>) -> Resp {
        self.try_request(method, path, body).unwrap_or_else(|e| {
            panic!(
                "{method} {path}: {e}\n--- daemon log (tail) ---\n{}",
                self.log_tail(200)
            )
        })
    }

    /// The last `lines` lines of the daemon's log.
    pub fn log_tail(&self, lines: usize) -> String {
        let text = self.log_text();
        let all: Vec<&str> = text.lines().collect();
        all[all.len().saturating_sub(lines)..].join("\n")
    }

    pub fn try_request(
        &self,
        method: &str,
        path: &str,
        body: Option<&str>,
    ) -> std::io::Result<Resp> {
        let mut s = UnixStream::connect(self.socket())?;
        s.set_read_timeout(Some(Duration::from_secs(600)))?;
        raw_http(&mut s, method, path, body, &[("Host", "localhost")])
    }

    /// SIGTERM, then wait (bounded) for a clean exit; returns the exit status.
    pub fn stop(&mut self) -> std::process::ExitStatus {
        self.stop_with(nix::sys::signal::Signal::SIGTERM)
    }

    /// Stop the daemon with `sig` (SIGTERM as a service manager does, SIGINT as Ctrl-C in a
    /// terminal does) and wait for it to exit (bounded).
    pub fn stop_with(&mut self, sig: nix::sys::signal::Signal) -> std::process::ExitStatus {
        let mut child = self.child.take().expect("running");
        let pid = nix::unistd::Pid::from_raw(child.id() as i32);
        let _ = nix::sys::signal::kill(pid, sig);
        wait_bounded(&mut child, Duration::from_secs(60))
    }

    /// SIGKILL (no cleanup).
    pub fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

impl Drop for Daemon {
    /// Remove every sandbox (VMs outlive the daemon by design, so a failed test must not leave
    /// them running), then stop the daemon.
    fn drop(&mut self) {
        // A passing test leaves no log behind; a failing one keeps it for the reader.
        if std::thread::panicking() {
            eprintln!("daemon log kept at {}", self.log.display());
        } else {
            let _ = std::fs::remove_file(&self.log);
        }
        if self.child.is_none() {
            return;
        }
        if let Ok(r) = self.try_request("GET", "/v1/sandboxes", None)
            && let Ok(list) = serde_json::from_slice::<serde_json::Value>(&r.body)
        {
            for s in list["sandboxes"].as_array().into_iter().flatten() {
                if let Some(id) = s["id"].as_str() {
                    let _ = self.try_request("DELETE", &format!("/v1/sandboxes/{id}"), None);
                }
            }
        }
        let _ = self.stop();
    }
}

/// The stdout of a command that must have succeeded (else a panic with its status, stdout and
/// stderr).
pub fn ok(o: Output) -> String {
    let text = String::from_utf8_lossy(&o.stdout).into_owned();
    assert!(
        o.status.success(),
        "{}: {text}\n{}",
        o.status,
        String::from_utf8_lossy(&o.stderr)
    );
    text
}

/// A new empty directory for a data root.
pub fn new_home() -> tempfile::TempDir {
    tempfile::Builder::new()
        .prefix("tbx-test-")
        .tempdir()
        .expect("tempdir")
}

pub fn wait_bounded(child: &mut Child, limit: Duration) -> std::process::ExitStatus {
    let deadline = Instant::now() + limit;
    loop {
        if let Some(st) = child.try_wait().unwrap() {
            return st;
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            panic!("process did not exit within {limit:?}");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[derive(Debug)]
pub struct Resp {
    pub status: u16,
    pub headers: String,
    pub body: Vec<u8>,
}

impl Resp {
    pub fn json(&self) -> serde_json::Value {
        serde_json::from_slice(&self.body)
            .unwrap_or_else(|e| panic!("not JSON ({e}): {}", String::from_utf8_lossy(&self.body)))
    }
    pub fn text(&self) -> String {
        String::from_utf8_lossy(&self.body).into_owned()
    }
    /// The `error.code` of an error body (asserting the envelope's shape).
    pub fn error_code(&self) -> String {
        let j = self.json();
        assert!(j["error"]["message"].is_string(), "no error.message: {j}");
        j["error"]["code"].as_str().expect("error.code").to_owned()
    }
}

/// A minimal HTTP/1.1 client (Connection: close; chunked bodies decoded).
pub fn raw_http<S: Read + Write>(
    s: &mut S,
    method: &str,
    path: &str,
    body: Option<&str>,
    headers: &[(&str, &str)],
) -> std::io::Result<Resp> {
    let body = body.unwrap_or("");
    let mut req = format!(
        "{method} {path} HTTP/1.1\r\nConnection: close\r\nContent-Length: {}\r\n",
        body.len()
    );
    for (k, v) in headers {
        req.push_str(&format!("{k}: {v}\r\n"));
    }
    req.push_str("\r\n");
    req.push_str(body);
    s.write_all(req.as_bytes())?;
    let mut raw = Vec::new();
    s.read_to_end(&mut raw)?;
    let split = raw
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .ok_or_else(|| std::io::Error::other("no header end"))?;
    let head = String::from_utf8_lossy(&raw[..split]).into_owned();
    let status: u16 = head
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .ok_or_else(|| std::io::Error::other("bad status line"))?;
    let mut body = raw[split + 4..].to_vec();
    if head
        .to_ascii_lowercase()
        .contains("transfer-encoding: chunked")
    {
        body = dechunk(&body);
    }
    Ok(Resp {
        status,
        headers: head,
        body,
    })
}

fn dechunk(mut b: &[u8]) -> Vec<u8> {
    let mut out = Vec::new();
    while let Some(nl) = b.windows(2).position(|w| w == b"\r\n") {
        let size =
            usize::from_str_radix(std::str::from_utf8(&b[..nl]).unwrap().trim(), 16).unwrap();
        if size == 0 {
            break;
        }
        out.extend_from_slice(&b[nl + 2..nl + 2 + size]);
        b = &b[nl + 2 + size + 2..];
    }
    out
}

/// The guest images: `TRYBOXI_ARTIFACTS` (set by `cargo xtask ci`) or `_out/`. Without them a
/// VM test skips with a message, except under CI, where that is a failure.
pub fn artifacts() -> Option<PathBuf> {
    let dir = std::env::var_os("TRYBOXI_ARTIFACTS")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/_out")));
    if dir.join("images/manifest.json").exists() {
        return Some(dir);
    }
    assert!(
        std::env::var_os("CI").is_none(),
        "no guest images at {} under CI: `cargo xtask ci` builds them",
        dir.display()
    );
    eprintln!(
        "skipped: no guest images at {} (run `cargo xtask images`)",
        dir.display()
    );
    None
}

/// A test (or part of one) that cannot run here: prints why on a line of its own, except under
/// CI (`CI` set), where every test runs and this is a failure.
pub fn skip_unless_ci(why: &str) {
    assert!(
        std::env::var_os("CI").is_none(),
        "cannot run under CI, where every test runs: {why}"
    );
    eprintln!("skipped: {why}");
}

pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// Follow `/v1/events{query}` over raw HTTP; each `data:` line's JSON goes to the channel.
pub fn follow_events(d: &Daemon, query: &str) -> std::sync::mpsc::Receiver<serde_json::Value> {
    use std::io::{BufRead as _, BufReader};
    let mut s = UnixStream::connect(d.socket()).unwrap();
    write!(
        s,
        "GET /v1/events{query} HTTP/1.1\r\nHost: localhost\r\nAccept: text/event-stream\r\n\r\n"
    )
    .unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(s).lines() {
            let Ok(line) = line else { return };
            if let Some(json) = line.strip_prefix("data: ") {
                let v: serde_json::Value = serde_json::from_str(json).expect("event JSON");
                if tx.send(v).is_err() {
                    return;
                }
            }
        }
    });
    rx
}

/// The VM tests' usual config: small VMs, and a boot timeout that allows for TCG on a busy host.
pub const SMALL_VMS: &str = "default_memory_mib = 512\ndefault_vcpus = 1\nboot_timeout_s = 180\n";

/// A daemon using the built guest images with `config`; `None` (the test skips) without images.
pub fn vm_daemon(config: &str) -> Option<Daemon> {
    let art = artifacts()?;
    Some(Daemon::start(
        Some(config),
        &["--artifacts", art.to_str().unwrap()],
    ))
}

/// `tryboxi create -w <ws>`, which must succeed; the new sandbox's id.
pub fn create(d: &Daemon, ws: &Path) -> String {
    create_with(d, ws, &[])
}

/// `tryboxi create -w <ws> <extra>`, which must succeed; the new sandbox's id.
pub fn create_with(d: &Daemon, ws: &Path, extra: &[&str]) -> String {
    let out = create_out(d, ws, extra);
    assert!(
        out.status.success(),
        "create failed: {}\n{}",
        String::from_utf8_lossy(&out.stderr),
        d.log_text()
    );
    let id = first_word(&out);
    assert!(
        id.starts_with("sbx_"),
        "{}",
        String::from_utf8_lossy(&out.stdout)
    );
    id
}

/// `tryboxi create -w <ws> <extra>`, whatever comes of it.
pub fn create_out(d: &Daemon, ws: &Path, extra: &[&str]) -> Output {
    let mut args = vec!["create", "-w", ws.to_str().unwrap()];
    args.extend_from_slice(extra);
    d.cli(&args)
}

/// The first word of a command's stdout (an id, for `create`), or "".
pub fn first_word(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout)
        .split_whitespace()
        .next()
        .unwrap_or_default()
        .to_owned()
}

/// `sh -c <script>` in the sandbox through the CLI.
pub fn sh(d: &Daemon, id: &str, script: &str) -> Output {
    d.cli(&["exec", id, "--", "sh", "-c", script])
}

/// `sh -c <script>` in the sandbox: its exit code and stdout.
pub fn sh_out(d: &Daemon, id: &str, script: &str) -> (Option<i32>, String) {
    let o = sh(d, id, script);
    (
        o.status.code(),
        String::from_utf8_lossy(&o.stdout).into_owned(),
    )
}

/// `bash -c <script>` in the sandbox: stdout, then stderr.
pub fn bash(d: &Daemon, id: &str, script: &str) -> String {
    let o = d.cli(&["exec", id, "--", "bash", "-c", script]);
    format!(
        "{}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

/// `tryboxi secret set NAME --host HOST` with `value` on stdin, which must succeed.
pub fn set_secret(d: &Daemon, name: &str, value: &str, host: &str) {
    let o = d.cli_stdin(&["secret", "set", name, "--host", host], value.as_bytes());
    assert!(
        o.status.success(),
        "secret set: {}",
        String::from_utf8_lossy(&o.stderr)
    );
}

/// The placeholder sandbox `id` sees for secret `name` (checked to look like one, not `value`).
pub fn placeholder(d: &Daemon, id: &str, name: &str, value: &str) -> String {
    let p = bash(d, id, &format!("printf %s \"${name}\""));
    assert!(p.starts_with("tbx_") && !p.contains(value), "{p}");
    p
}
