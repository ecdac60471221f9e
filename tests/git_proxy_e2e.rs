//! End to end with TWO real VMs (issue 16, item 8), one scenario run twice: the git proxy with
//! the guest's own `git`, directly and through an explicit upstream proxy.
//! A local forge stands in for the internet: `git http-backend` (CGI) behind a small rustls
//! HTTP/1.1 server for `git.test`, whose certificate comes from a test CA the daemon is told to
//! trust (`[network] intercept_extra_ca`), and which, like a forge with private repositories,
//! answers 401 unless a request carries the token (`Basic x-access-token:<token>`). The sandbox
//! holds the token secret and a grant `git.test/owner/repo --push 'agent/*'`; inside the VM:
//! `git clone`, a commit, `git push origin HEAD:agent/x` lands (the forge saw the token on every
//! request to the repository), `git push origin HEAD:main` is refused with git's own
//! `[remote rejected]` line carrying our reason (nothing lands), and another repository of the
//! same forge gets no token (the forge's 401 fails the clone). The token never reaches the VM.
//! The second run sets `[network] upstream_proxy` to the test `CONNECT` proxy
//! (`common::proxy`, with Basic credentials), the only way to `git.test`: clone, allowed push
//! and refused push again, every tunnel `CONNECT git.test:443` with the right credentials.
//! Neither run's events nor daemon log hold the token (or the proxy's password).
//! Uses the guest images from `TRYBOXI_ARTIFACTS` or `_out/` (skips without them or without
//! `git http-backend` on the host, except under CI).

mod common;

use std::collections::HashMap;
use std::io::{BufRead as _, BufReader, Read as _, Write as _};
use std::net::{SocketAddr, TcpListener};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::proxy::{PASS as PROXY_PASS, Proxy};
use common::{SMALL_VMS, bash, create_with, follow_events, skip_unless_ci, vm_daemon};

const GHOST: &str = "git.test";
const TOKEN: &str = "ghs_e2e_token_Zx81Lm02Qp93Rt74Wq";

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

fn expected_auth() -> String {
    use base64::Engine as _;
    format!(
        "Basic {}",
        base64::engine::general_purpose::STANDARD.encode(format!("x-access-token:{TOKEN}"))
    )
}

/// Host-side git (setup and checks), with its own HOME.
fn git(dir: &Path, home: &Path, args: &[&str]) -> String {
    let o = Command::new("git")
        .args(["-c", "user.name=t", "-c", "user.email=t@example.com"])
        .args(["-c", "init.defaultBranch=main"])
        .args(args)
        .current_dir(dir)
        .env("HOME", home)
        .env("GIT_CONFIG_NOSYSTEM", "1")
        .env_remove("GIT_DIR")
        .output()
        .unwrap();
    let t = format!("{}{}", text(&o.stdout), text(&o.stderr));
    assert!(o.status.success(), "git {args:?}: {t}");
    t.trim().to_owned()
}

fn http_backend() -> Option<PathBuf> {
    let out = Command::new("git").arg("--exec-path").output().ok()?;
    let p = PathBuf::from(String::from_utf8(out.stdout).ok()?.trim()).join("git-http-backend");
    p.exists().then_some(p)
}

/// `(method, target, headers lowercased, body de-chunked)`.
type Req = (String, String, Vec<(String, String)>, Vec<u8>);

/// One request off a keep-alive connection (bounded head and body); `None` at its end.
fn read_request<S: std::io::Read + std::io::Write>(r: &mut BufReader<S>) -> Option<Req> {
    let mut head = String::new();
    loop {
        let mut line = String::new();
        if r.read_line(&mut line).ok()? == 0 || head.len() > 64 << 10 {
            return None;
        }
        if line == "\r\n" {
            break;
        }
        head.push_str(&line);
    }
    let mut lines = head.lines();
    let mut first = lines.next()?.split(' ');
    let (method, target) = (first.next()?.to_owned(), first.next()?.to_owned());
    let headers: Vec<(String, String)> = lines
        .filter_map(|l| l.split_once(':'))
        .map(|(k, v)| (k.trim().to_ascii_lowercase(), v.trim().to_owned()))
        .collect();
    let get = |k: &str| headers.iter().find(|(n, _)| n == k).map(|(_, v)| v.clone());
    if get("expect").is_some_and(|e| e.eq_ignore_ascii_case("100-continue")) {
        r.get_mut()
            .write_all(b"HTTP/1.1 100 Continue\r\n\r\n")
            .ok()?;
        r.get_mut().flush().ok()?;
    }
    let mut body = Vec::new();
    if get("transfer-encoding").is_some_and(|t| t.eq_ignore_ascii_case("chunked")) {
        loop {
            let mut size = String::new();
            r.read_line(&mut size).ok()?;
            let n = usize::from_str_radix(size.trim().split(';').next()?, 16).ok()?;
            if n > 64 << 20 {
                return None;
            }
            let mut chunk = vec![0; n + 2];
            r.read_exact(&mut chunk).ok()?;
            if n == 0 {
                break;
            }
            body.extend_from_slice(&chunk[..n]);
        }
    } else if let Some(n) = get("content-length") {
        let n: usize = n.parse().ok()?;
        if n > 64 << 20 {
            return None;
        }
        body.resize(n, 0);
        r.read_exact(&mut body).ok()?;
    }
    Some((method, target, headers, body))
}

/// `git http-backend` for one request: status, headers, body.
fn cgi(backend: &Path, root: &Path, req: &Req) -> (u16, Vec<(String, String)>, Vec<u8>) {
    let (method, target, headers, body) = req;
    let (path, query) = target.split_once('?').unwrap_or((target, ""));
    let get = |k: &str| {
        headers
            .iter()
            .find(|(n, _)| n == k)
            .map(|(_, v)| v.clone())
            .unwrap_or_default()
    };
    let mut child = Command::new(backend)
        .env_clear()
        .env("GIT_PROJECT_ROOT", root)
        .env("GIT_HTTP_EXPORT_ALL", "1")
        .env("REMOTE_USER", "x-access-token")
        .env("REQUEST_METHOD", method)
        .env("PATH_INFO", path)
        .env("QUERY_STRING", query)
        .env("CONTENT_TYPE", get("content-type"))
        .env("CONTENT_LENGTH", body.len().to_string())
        .env("HTTP_CONTENT_ENCODING", get("content-encoding"))
        .env("GIT_PROTOCOL", get("git-protocol"))
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut stdin = child.stdin.take().unwrap();
    let input = body.clone();
    let writer = std::thread::spawn(move || {
        let _ = stdin.write_all(&input);
    });
    let out = child.wait_with_output().unwrap();
    writer.join().unwrap();
    let (i, n) = out
        .stdout
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .map(|i| (i, 4))
        .or_else(|| {
            out.stdout
                .windows(2)
                .position(|w| w == b"\n\n")
                .map(|i| (i, 2))
        })
        .expect("CGI headers");
    let mut status = 200;
    let mut hs = Vec::new();
    for l in text(&out.stdout[..i]).lines() {
        let Some((k, v)) = l.split_once(':') else {
            continue;
        };
        if k.eq_ignore_ascii_case("status") {
            status = v.trim().split(' ').next().unwrap().parse().unwrap();
        } else {
            hs.push((k.trim().to_owned(), v.trim().to_owned()));
        }
    }
    (status, hs, out.stdout[i + n..].to_vec())
}

/// `(method path, authorization)` of every request the forge saw.
type Seen = Arc<Mutex<Vec<(String, String)>>>;

/// The forge on 127.0.0.1: TLS for [`GHOST`] (certificate from a fresh test CA written to
/// `ca_path`), keep-alive HTTP/1.1, 401 without the token, else `git http-backend`.
fn forge(ca_path: &Path, backend: PathBuf, root: PathBuf) -> (SocketAddr, Seen) {
    let cfg = common::tls::ca_signed_server(ca_path, None, &[GHOST]);
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap();
    let seen: Seen = Arc::default();
    let s2 = seen.clone();
    std::thread::spawn(move || {
        for conn in l.incoming() {
            let Ok(tcp) = conn else { return };
            let (cfg, seen) = (cfg.clone(), s2.clone());
            let (backend, root) = (backend.clone(), root.clone());
            std::thread::spawn(move || {
                let _ = tcp.set_read_timeout(Some(Duration::from_secs(120)));
                let Ok(conn) = rustls::ServerConnection::new(cfg) else {
                    return;
                };
                let mut r = BufReader::new(rustls::StreamOwned::new(conn, tcp));
                while let Some(req) = read_request(&mut r) {
                    let auth = req
                        .2
                        .iter()
                        .find(|(k, _)| k == "authorization")
                        .map(|(_, v)| v.clone())
                        .unwrap_or_default();
                    let path = req.1.split('?').next().unwrap_or("").to_owned();
                    seen.lock()
                        .unwrap()
                        .push((format!("{} {path}", req.0), auth.clone()));
                    let (status, hs, body) = if auth == expected_auth() {
                        cgi(&backend, &root, &req)
                    } else {
                        (
                            401,
                            vec![(
                                "WWW-Authenticate".to_owned(),
                                "Basic realm=\"forge\"".to_owned(),
                            )],
                            b"authentication required\n".to_vec(),
                        )
                    };
                    let mut out =
                        format!("HTTP/1.1 {status} X\r\nContent-Length: {}\r\n", body.len());
                    for (k, v) in hs {
                        out.push_str(&format!("{k}: {v}\r\n"));
                    }
                    out.push_str("\r\n");
                    let s = r.get_mut();
                    if s.write_all(out.as_bytes()).is_err()
                        || s.write_all(&body).is_err()
                        || s.flush().is_err()
                    {
                        return;
                    }
                }
            });
        }
    });
    (addr, seen)
}

#[test]
fn guest_git_clones_pushes_its_branch_and_is_refused_main_and_other_repos() {
    scenario(false);
}

/// The same grant with the daemon's egress through an explicit upstream proxy (its one extra
/// VM): `git.test` resolves nowhere but in the proxy, which maps `git.test:443` to the forge.
/// A clone and the `agent/x` push land, `main` is refused; every tunnel was `CONNECT
/// git.test:443` with the proxy's credentials; the forge saw the token, the guest never did;
/// neither the events nor the daemon log hold the token or the proxy's password.
#[test]
fn guest_git_goes_through_the_upstream_proxy() {
    scenario(true);
}

/// One run of the git scenario, direct (`test_hosts` maps the forge's name) or through a
/// [`Proxy`] (the only way to the forge's name). The direct run also checks that another
/// repository of the forge gets no token; the proxied run keeps to clone, push, refusal.
fn scenario(proxied: bool) {
    let Some(backend) = http_backend() else {
        skip_unless_ci("no git-http-backend on the host");
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let (root, home, seed) = (
        dir.path().join("srv"),
        dir.path().join("home"),
        dir.path().join("seed"),
    );
    for d in [&root, &home, &seed] {
        std::fs::create_dir_all(d).unwrap();
    }
    let (bare, other) = (root.join("owner/repo"), root.join("owner/other"));
    for b in [&bare, &other] {
        git(
            dir.path(),
            &home,
            &["init", "--bare", "-q", b.to_str().unwrap()],
        );
    }
    git(&seed, &home, &["init", "-q"]);
    std::fs::write(seed.join("a.txt"), "one\n").unwrap();
    git(&seed, &home, &["add", "a.txt"]);
    git(&seed, &home, &["commit", "-q", "-m", "one"]);
    for b in [&bare, &other] {
        git(
            &seed,
            &home,
            &["push", "-q", b.to_str().unwrap(), "HEAD:refs/heads/main"],
        );
    }
    let main_before = git(&bare, &home, &["rev-parse", "refs/heads/main"]);

    let ca_path = dir.path().join("forge-ca.pem");
    let (addr, seen) = forge(&ca_path, backend, root.clone());
    let proxy = proxied.then(|| {
        Proxy::start(
            HashMap::from([(format!("{GHOST}:443"), addr)]),
            HashMap::new(),
        )
    });
    // The forge's name: through the proxy, or mapped by the test resolver. Either way the
    // daemon's own resolver (`upstream_dns`) answers nothing.
    let route = match &proxy {
        Some(p) => format!("upstream_proxy = \"{}\"\n", p.url()),
        None => format!(
            "[network.test_hosts]\n\"{GHOST}\" = [\"203.0.113.20\"]\n\
             [network.test_upstream_map]\n\"203.0.113.20:443\" = \"{addr}\"\n"
        ),
    };
    let cfg = format!(
        "{SMALL_VMS}[network]\ndefault_policy = []\nupstream_dns = \"127.0.0.1:9\"\n\
         intercept_extra_ca = \"{}\"\n{route}",
        ca_path.display()
    );
    let Some(d) = vm_daemon(&cfg) else { return };
    let events = follow_events(&d, "?since=0");
    let o = d.cli_stdin(
        &["secret", "set", "GH_TOKEN", "--host", GHOST],
        TOKEN.as_bytes(),
    );
    assert!(o.status.success(), "{}", text(&o.stderr));
    let ws = tempfile::tempdir().unwrap();
    let id = create_with(&d, ws.path(), &["--secret", "GH_TOKEN"]);
    let o = d.cli(&["net", "allow", &id, GHOST]);
    assert!(o.status.success(), "net allow: {}", text(&o.stderr));
    let o = d.cli(&[
        "git",
        "allow",
        &id,
        &format!("{GHOST}/owner/repo"),
        "--push",
        "agent/*",
        "--token-secret",
        "GH_TOKEN",
    ]);
    assert!(o.status.success(), "git allow: {}", text(&o.stderr));

    let mut bad: Vec<String> = Vec::new();
    // One exec for the whole guest side (each exec costs seconds under TCG).
    let mut script = "export GIT_TERMINAL_PROMPT=0; cd /tmp && \
         git clone -q https://git.test/owner/repo w 2>&1; echo clone=$?; cd w && \
         echo two > a.txt && git -c user.name=t -c user.email=t@e commit -qam two && \
         git rev-parse HEAD | sed 's/^/head=/'; \
         git push origin HEAD:agent/x 2>&1; echo push_agent=$?; \
         git push origin HEAD:main 2>&1; echo push_main=$?; "
        .to_owned();
    let mut wants = vec!["clone=0", "push_agent=0", "push_main=1"];
    if !proxied {
        script.push_str(
            "cd /tmp && git clone -q https://git.test/owner/other o2 2>&1; echo clone_other=$?",
        );
        wants.push("clone_other=128");
    }
    let out = bash(&d, &id, &script);
    for want in wants {
        if !out.contains(&format!("{want}\n")) {
            bad.push(format!("expected {want}"));
        }
    }
    if !out.contains(
        "! [remote rejected] HEAD -> main (tryboxi: push to main is not allowed; allowed: agent/*)",
    ) {
        bad.push("git printed no rejection of main".into());
    }
    if out.contains(TOKEN) || out.contains(&expected_auth()[6..]) {
        bad.push("the token reached the guest".into());
    }
    let head = out
        .lines()
        .find_map(|l| l.strip_prefix("head="))
        .unwrap_or("?")
        .to_owned();
    // On the forge: agent/x is the guest's commit, main did not move.
    let agent = Command::new("git")
        .args(["rev-parse", "refs/heads/agent/x"])
        .current_dir(&bare)
        .output()
        .unwrap();
    if text(&agent.stdout).trim() != head {
        bad.push(format!(
            "agent/x on the forge is not the guest's commit {head}"
        ));
    }
    if git(&bare, &home, &["rev-parse", "refs/heads/main"]) != main_before {
        bad.push("main moved on the forge".into());
    }
    {
        let seen = seen.lock().unwrap();
        let (r, o): (Vec<_>, Vec<_>) = seen
            .iter()
            .partition(|(what, _)| what.contains("/owner/repo/"));
        if r.len() < 4 || !r.iter().all(|(_, a)| *a == expected_auth()) {
            bad.push(format!(
                "the granted repository's requests did not all carry the token: {:?}",
                r.iter().map(|(w, a)| (w, a.len())).collect::<Vec<_>>()
            ));
        }
        let posts = r
            .iter()
            .filter(|(w, _)| w.starts_with("POST") && w.ends_with("git-receive-pack"))
            .count();
        if posts != 1 {
            bad.push(format!(
                "{posts} receive-pack POSTs reached the forge (want 1: agent/x)"
            ));
        }
        if !proxied && (o.is_empty() || o.iter().any(|(_, a)| a.contains(&expected_auth()[6..]))) {
            bad.push(format!(
                "the other repository: {} requests, token present: {}",
                o.len(),
                o.iter().any(|(_, a)| !a.is_empty())
            ));
        }
    }
    if let Some(p) = &proxy {
        let targets = p.targets();
        let want = format!("{GHOST}:443");
        if targets.is_empty() || targets.iter().any(|t| *t != want) {
            bad.push(format!(
                "the proxy's tunnels were not all {want}: {targets:?}"
            ));
        }
        if !p.all_authed() {
            bad.push("a CONNECT without the proxy's credentials".into());
        }
    }
    assert!(d.cli(&["rm", &id]).status.success());
    // The events up to the removal (bounded): the refusal is among them; none holds a secret.
    let deadline = Instant::now() + Duration::from_secs(20);
    let (mut refused, mut removed) = (false, false);
    while !removed && Instant::now() < deadline {
        let Ok(ev) = events.recv_timeout(Duration::from_millis(500)) else {
            continue;
        };
        let t = ev.to_string();
        if t.contains(TOKEN) || t.contains(PROXY_PASS) || t.contains(&expected_auth()[6..]) {
            bad.push(format!(
                "a {} event holds the token or the proxy password",
                ev["type"]
            ));
        }
        refused |= ev["type"] == "git.refused" && t.contains("main");
        removed |= ev["type"] == "sandbox.removed";
    }
    if !refused || !removed {
        bad.push(format!(
            "events: git.refused {refused}, sandbox.removed {removed}"
        ));
    }
    let log = d.log_text();
    if log.contains(TOKEN) || log.contains(PROXY_PASS) {
        bad.push("the daemon log holds the token or the proxy password".into());
    }
    assert!(
        bad.is_empty(),
        "{}\nguest output:\n{out}\n{}",
        bad.join("\n"),
        d.log_tail(60)
    );
}
