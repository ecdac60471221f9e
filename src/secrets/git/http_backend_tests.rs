//! Real git against the git proxy's decisions, no VM: `git http-backend` (CGI) behind a small
//! HTTP/1.1 server in this test that calls [`classify`], checks the injected `Authorization`,
//! and screens `git-receive-pack` bodies with the [`Screener`] (fed in small chunks), answering
//! a refusal with [`pktline::Rejection::report`]. Then `git clone`, `git push` to `agent/x` (accepted)
//! and to `main` (refused: git prints the reason), and a mixed push (nothing lands).

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use super::*;
use crate::secrets::{Binding, GitGrant, Snapshot, Value};

const TOKEN: &[u8] = b"ghs_integration_token_0123456789";

fn snapshot() -> Snapshot {
    Snapshot {
        bindings: vec![Binding {
            name: "GH".into(),
            hosts: vec!["github.com".into()],
            headers: vec![],
            in_body: false,
            placeholder: "tbx_gh".into(),
            value: Value::new(TOKEN.to_vec()),
        }],
        git: vec![
            GitGrant {
                repo: "github.com/o/r".into(),
                push: vec!["agent/*".into()],
                token_secret: "GH".into(),
            },
            GitGrant {
                repo: "github.com/o/ro".into(),
                push: vec![],
                token_secret: "GH".into(),
            },
        ],
    }
}

pub(crate) fn http_backend() -> Option<PathBuf> {
    let out = Command::new("git").arg("--exec-path").output().ok()?;
    let p = PathBuf::from(String::from_utf8(out.stdout).ok()?.trim()).join("git-http-backend");
    p.exists().then_some(p)
}

/// (method, target, headers lowercased, body de-chunked).
type Request = (String, String, Vec<(String, String)>, Vec<u8>);

/// Reads one request.
fn read_request(r: &mut BufReader<TcpStream>) -> Option<Request> {
    let mut head = String::new();
    loop {
        let mut line = String::new();
        if r.read_line(&mut line).ok()? == 0 {
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
    }
    let mut body = Vec::new();
    if get("transfer-encoding").is_some_and(|t| t.eq_ignore_ascii_case("chunked")) {
        loop {
            let mut size = String::new();
            r.read_line(&mut size).ok()?;
            let n = usize::from_str_radix(size.trim().split(';').next()?, 16).ok()?;
            let mut chunk = vec![0; n + 2];
            r.read_exact(&mut chunk).ok()?;
            if n == 0 {
                break;
            }
            body.extend_from_slice(&chunk[..n]);
        }
    } else if let Some(n) = get("content-length") {
        body.resize(n.parse().ok()?, 0);
        r.read_exact(&mut body).ok()?;
    }
    Some((method, target, headers, body))
}

fn respond(s: &mut TcpStream, status: u16, headers: &[(String, String)], body: &[u8]) {
    let mut out = format!(
        "HTTP/1.1 {status} X\r\nContent-Length: {}\r\nConnection: close\r\n",
        body.len()
    );
    for (k, v) in headers {
        out.push_str(&format!("{k}: {v}\r\n"));
    }
    out.push_str("\r\n");
    let _ = s.write_all(out.as_bytes());
    let _ = s.write_all(body);
}

/// Runs `git http-backend` for one request; returns its status, headers and body.
pub(crate) fn cgi(
    backend: &Path,
    root: &Path,
    method: &str,
    path: &str,
    query: &str,
    headers: &[(String, String)],
    body: &[u8],
) -> (u16, Vec<(String, String)>, Vec<u8>) {
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
    let input = body.to_vec();
    let writer = std::thread::spawn(move || {
        let _ = stdin.write_all(&input);
    });
    let out = child.wait_with_output().unwrap();
    writer.join().unwrap();
    let split = out
        .stdout
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .map(|i| (i, 4));
    let split = split.or_else(|| {
        out.stdout
            .windows(2)
            .position(|w| w == b"\n\n")
            .map(|i| (i, 2))
    });
    let (i, n) = split.expect("CGI headers");
    let head = String::from_utf8_lossy(&out.stdout[..i]).into_owned();
    let mut status = 200;
    let mut hs = Vec::new();
    for l in head.lines() {
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

/// One connection: the interceptor's part (classify, inject, screen), then the backend.
fn serve(mut conn: TcpStream, backend: PathBuf, root: PathBuf, snap: Snapshot) {
    let mut r = BufReader::new(conn.try_clone().unwrap());
    let Some((method, target, headers, body)) = read_request(&mut r) else {
        return;
    };
    let (path, query) = target.split_once('?').unwrap_or((&target, ""));
    let get = |k: &str| headers.iter().find(|(n, _)| n == k).map(|(_, v)| v.clone());
    let head = RequestHead {
        method: method.clone(),
        host: "github.com".into(),
        path: path.into(),
        query: (!query.is_empty()).then(|| query.into()),
        content_type: get("content-type"),
        content_encoding: get("content-encoding"),
        secrets: vec![],
    };
    let (auth, push) = match classify(&snap, &head) {
        Verdict::Inject {
            authorization,
            push,
            ..
        } => (Some(authorization), push),
        // Passed through as it is (a real interceptor adds no token).
        Verdict::NotGit => (None, None),
        Verdict::Refuse(r) => {
            let h = [("Content-Type".to_owned(), "text/plain".to_owned())];
            return respond(
                &mut conn,
                r.status,
                &h,
                format!("{}\n", r.message).as_bytes(),
            );
        }
        v => panic!("{method} {target}: {v:?}"),
    };
    if let Some(a) = auth {
        assert!(a.ct_eq(authorization(&Value::new(TOKEN.to_vec())).bytes()));
    }
    if let Some(mut screener) = push {
        let mut decision = Screen::NeedMore;
        for c in body.chunks(7) {
            decision = screener.feed(c);
            if decision != Screen::NeedMore {
                break;
            }
        }
        if decision == Screen::NeedMore {
            decision = screener.finish();
        }
        if let Screen::Refuse(rej) = decision {
            let h = [(
                "Content-Type".to_owned(),
                "application/x-git-receive-pack-result".to_owned(),
            )];
            return respond(&mut conn, 200, &h, &rej.report());
        }
    }
    // The forge routes repositories in any case; the backend's directories are lowercase.
    let path = path.to_ascii_lowercase();
    let (status, hs, out) = cgi(&backend, &root, &method, &path, query, &headers, &body);
    respond(&mut conn, status, &hs, &out);
}

pub(crate) fn git(dir: &Path, home: &Path, args: &[&str]) -> std::process::Output {
    Command::new("git")
        .args([
            "-c",
            "user.name=t",
            "-c",
            "user.email=t@example.com",
            "-c",
            "init.defaultBranch=main",
        ])
        .args(args)
        .current_dir(dir)
        .env("HOME", home)
        .env("GIT_CONFIG_NOSYSTEM", "1")
        .env("GIT_TERMINAL_PROMPT", "0")
        .env_remove("GIT_DIR")
        .output()
        .unwrap()
}

pub(crate) fn ok(o: std::process::Output) -> String {
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    );
    assert!(o.status.success(), "{text}");
    text
}

#[test]
fn real_git_pushes_through_the_screener() {
    let Some(backend) = http_backend() else {
        assert!(
            std::env::var_os("CI").is_none(),
            "git-http-backend is missing under CI"
        );
        eprintln!("skipped: no git-http-backend");
        return;
    };
    let tmp = tempfile::tempdir().unwrap();
    let (root, home, seed) = (
        tmp.path().join("srv"),
        tmp.path().join("home"),
        tmp.path().join("seed"),
    );
    for d in [&root, &home, &seed] {
        std::fs::create_dir_all(d).unwrap();
    }
    let bare = root.join("o/r.git");
    ok(git(
        tmp.path(),
        &home,
        &["init", "--bare", "-q", bare.to_str().unwrap()],
    ));
    ok(git(&seed, &home, &["init", "-q"]));
    std::fs::write(seed.join("a.txt"), "one\n").unwrap();
    ok(git(&seed, &home, &["add", "a.txt"]));
    ok(git(&seed, &home, &["commit", "-q", "-m", "one"]));
    ok(git(
        &seed,
        &home,
        &["push", "-q", bare.to_str().unwrap(), "HEAD:refs/heads/main"],
    ));

    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    let (b, r) = (backend.clone(), root.clone());
    std::thread::spawn(move || {
        for c in listener.incoming().flatten() {
            let (b, r) = (b.clone(), r.clone());
            std::thread::spawn(move || serve(c, b, r, snapshot()));
        }
    });

    let url = format!("http://127.0.0.1:{port}/O/R.git");
    ok(git(tmp.path(), &home, &["clone", "-q", &url, "w"]));
    let w = tmp.path().join("w");
    std::fs::write(w.join("a.txt"), "two\n").unwrap();
    ok(git(&w, &home, &["commit", "-q", "-am", "two"]));
    let main_before = ok(git(&bare, &home, &["rev-parse", "refs/heads/main"]));

    // An allowed branch lands.
    ok(git(
        &w,
        &home,
        &["push", "origin", "HEAD:refs/heads/agent/x"],
    ));
    let head = ok(git(&w, &home, &["rev-parse", "HEAD"]));
    assert_eq!(
        ok(git(&bare, &home, &["rev-parse", "refs/heads/agent/x"])),
        head
    );

    // main is refused, and git says why.
    let out = git(&w, &home, &["push", "origin", "HEAD:main"]);
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(!out.status.success(), "{text}");
    assert!(
        text.contains("! [remote rejected] HEAD -> main (tryboxi: push to main is not allowed; allowed: agent/*)"),
        "{text}"
    );
    assert!(
        text.contains("remote: tryboxi: push to main is not allowed"),
        "{text}"
    );
    assert_eq!(
        ok(git(&bare, &home, &["rev-parse", "refs/heads/main"])),
        main_before
    );

    // All or nothing: an allowed ref beside a refused one does not land either.
    let out = git(
        &w,
        &home,
        &[
            "push",
            "origin",
            "HEAD:refs/heads/agent/y",
            "HEAD:refs/tags/v1",
        ],
    );
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(!out.status.success(), "{text}");
    assert!(
        text.contains("HEAD -> agent/y (tryboxi: refused with the rest of the push)"),
        "{text}"
    );
    assert!(
        text.contains("HEAD -> v1 (tryboxi: push to v1 is not allowed"),
        "{text}"
    );
    assert!(
        !git(
            &bare,
            &home,
            &["rev-parse", "--verify", "-q", "refs/heads/agent/y"]
        )
        .status
        .success()
    );

    // Deleting an allowed branch is an update like any other.
    ok(git(&w, &home, &["push", "origin", ":refs/heads/agent/x"]));
    assert!(
        !git(
            &bare,
            &home,
            &["rev-parse", "--verify", "-q", "refs/heads/agent/x"]
        )
        .status
        .success()
    );

    // A grant without push patterns: git is told so before it sends anything.
    let ro = root.join("o/ro.git");
    ok(git(
        tmp.path(),
        &home,
        &["init", "--bare", "-q", ro.to_str().unwrap()],
    ));
    let ro_url = format!("http://127.0.0.1:{port}/o/ro.git");
    let out = git(&w, &home, &["push", &ro_url, "HEAD:refs/heads/agent/x"]);
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(!out.status.success(), "{text}");
    assert!(
        text.contains("pushes to github.com/o/ro are not allowed (no --push patterns)"),
        "{text}"
    );
    assert!(
        !git(
            &ro,
            &home,
            &["rev-parse", "--verify", "-q", "refs/heads/agent/x"]
        )
        .status
        .success()
    );
}
