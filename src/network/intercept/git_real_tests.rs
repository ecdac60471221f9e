//! Real `git` on the host through the interceptor, no VM: git (trusting the sandbox CA, as
//! `GIT_SSL_CAINFO` makes it in a guest) connects to a local listener that hands each flow to
//! [`Interceptor::serve`]; the upstream is `git http-backend` behind a rustls + hyper server
//! for `git.test` (certificate from a test CA the interceptor is told to trust) that, like a
//! forge with private repositories, answers 401 unless it gets the token. The sandbox holds a
//! grant `git.test/o/r` with push `agent/*`.

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use http_body_util::BodyExt as _;
use hyper::{Request, Response};
use hyper_util::rt::{TokioExecutor, TokioIo};
use tokio::net::{TcpListener, TcpStream};

use super::body::{ProxyBody, full};
use super::tests::{TestCa, binding, server_tls, test_ca};
use super::*;
use crate::secrets::git::http_backend_tests::{cgi, git, http_backend, ok};
use crate::secrets::{GitGrant, Snapshot};

const GHOST: &str = "git.test";
const TOKEN: &str = "ghs_real_git_token_0123456789abcdef";
const GPH: &str = "tbx_qqqqrrrrsssstttt22223333444455556";

/// `(method path, authorization)` of every request the forge saw.
type Seen = Arc<Mutex<Vec<(String, String)>>>;

fn expected_auth() -> String {
    use base64::Engine as _;
    format!(
        "Basic {}",
        base64::engine::general_purpose::STANDARD.encode(format!("x-access-token:{TOKEN}"))
    )
}

async fn forge(
    req: Request<hyper::body::Incoming>,
    backend: PathBuf,
    root: PathBuf,
    seen: Seen,
) -> Response<ProxyBody> {
    let (parts, body) = req.into_parts();
    let body = body
        .collect()
        .await
        .map(|b| b.to_bytes().to_vec())
        .unwrap_or_default();
    let auth = parts
        .headers
        .get("authorization")
        .map(|v| String::from_utf8_lossy(v.as_bytes()).into_owned())
        .unwrap_or_default();
    seen.lock().unwrap().push((
        format!("{} {}", parts.method, parts.uri.path()),
        auth.clone(),
    ));
    if auth != expected_auth() {
        let mut r = Response::new(full("authentication required\n"));
        *r.status_mut() = hyper::StatusCode::UNAUTHORIZED;
        r.headers_mut()
            .insert("www-authenticate", "Basic realm=\"forge\"".parse().unwrap());
        return r;
    }
    let headers: Vec<(String, String)> = parts
        .headers
        .iter()
        .map(|(k, v)| {
            (
                k.as_str().to_owned(),
                String::from_utf8_lossy(v.as_bytes()).into_owned(),
            )
        })
        .collect();
    let path = parts.uri.path().to_ascii_lowercase();
    let query = parts.uri.query().unwrap_or("").to_owned();
    let method = parts.method.to_string();
    let (status, hs, out) = tokio::task::spawn_blocking(move || {
        cgi(&backend, &root, &method, &path, &query, &headers, &body)
    })
    .await
    .unwrap();
    let mut r = Response::new(full(out));
    *r.status_mut() = hyper::StatusCode::from_u16(status).unwrap();
    for (k, v) in hs {
        if let (Ok(k), Ok(v)) = (
            hyper::header::HeaderName::from_bytes(k.as_bytes()),
            v.parse::<hyper::header::HeaderValue>(),
        ) {
            r.headers_mut().append(k, v);
        }
    }
    r
}

/// The forge: TLS for `git.test` (HTTP/1.1 and h2), `git http-backend` behind it.
async fn forge_server(
    ca: &TestCa,
    backend: PathBuf,
    root: PathBuf,
) -> (std::net::SocketAddr, Seen) {
    let acceptor = server_tls(ca, GHOST, &[b"h2", b"http/1.1"]);
    let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap();
    let seen: Seen = Arc::default();
    let s2 = seen.clone();
    tokio::spawn(async move {
        while let Ok((tcp, _)) = l.accept().await {
            let (acceptor, seen) = (acceptor.clone(), s2.clone());
            let (backend, root) = (backend.clone(), root.clone());
            tokio::spawn(async move {
                let Ok(tls) = acceptor.accept(tcp).await else {
                    return;
                };
                let svc = hyper::service::service_fn(move |req| {
                    let (b, r, s) = (backend.clone(), root.clone(), seen.clone());
                    async move { Ok::<_, std::convert::Infallible>(forge(req, b, r, s).await) }
                });
                let _ = hyper_util::server::conn::auto::Builder::new(TokioExecutor::new())
                    .serve_connection(TokioIo::new(tls), svc)
                    .await;
            });
        }
    });
    (addr, seen)
}

/// git as the guest runs it: `GIT_SSL_CAINFO` is the sandbox CA (`home` holds the CA file).
fn run(dir: &Path, home: &Path, args: &[&str]) -> (bool, String) {
    let o = std::process::Command::new("git")
        .args(["-c", "user.name=t", "-c", "user.email=t@example.com"])
        .args(args)
        .current_dir(dir)
        .env("HOME", home)
        .env("GIT_CONFIG_NOSYSTEM", "1")
        .env("GIT_TERMINAL_PROMPT", "0")
        .env("GIT_SSL_CAINFO", home.join("sandbox-ca.pem"))
        .env_remove("GIT_DIR")
        .output()
        .unwrap();
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    );
    assert!(
        !text.contains(TOKEN),
        "the token reached the guest's git: {text}"
    );
    (o.status.success(), text)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn real_git_clones_and_pushes_through_the_interceptor() {
    let Some(backend) = http_backend() else {
        assert!(
            std::env::var_os("CI").is_none(),
            "git-http-backend is missing under CI"
        );
        eprintln!("skipped: no git-http-backend");
        return;
    };
    let tmp = tempfile::tempdir().unwrap();
    let (root, home, seed, sbx) = (
        tmp.path().join("srv"),
        tmp.path().join("home"),
        tmp.path().join("seed"),
        tmp.path().join("sandbox"),
    );
    for d in [&root, &home, &seed, &sbx] {
        std::fs::create_dir_all(d).unwrap();
    }
    let bare = root.join("o/r.git");
    let other = root.join("o/other.git");
    for b in [&bare, &other] {
        ok(git(
            tmp.path(),
            &home,
            &["init", "--bare", "-q", b.to_str().unwrap()],
        ));
    }
    ok(git(&seed, &home, &["init", "-q"]));
    std::fs::write(seed.join("a.txt"), "one\n").unwrap();
    ok(git(&seed, &home, &["add", "a.txt"]));
    ok(git(&seed, &home, &["commit", "-q", "-m", "one"]));
    for b in [&bare, &other] {
        ok(git(
            &seed,
            &home,
            &["push", "-q", b.to_str().unwrap(), "HEAD:refs/heads/main"],
        ));
    }

    // The forge, and the sandbox's interceptor trusting the forge's CA.
    let up_ca = test_ca();
    let (up_addr, seen) = forge_server(&up_ca, backend, root.clone()).await;
    let extra = tmp.path().join("extra-ca.pem");
    std::fs::write(&extra, &up_ca.pem).unwrap();
    let secrets = SandboxSecrets::default();
    secrets.publish(Snapshot {
        bindings: vec![binding("GH", GHOST, GPH, TOKEN, false)],
        git: vec![GitGrant {
            repo: format!("{GHOST}/o/r"),
            push: vec!["agent/*".into()],
            token_secret: "GH".into(),
        }],
    });
    let ca = SandboxCa::load_or_create(&sbx, &secrets.current().intercepted_hosts()).unwrap();
    let ca_file = home.join("sandbox-ca.pem");
    std::fs::write(&ca_file, ca.cert_pem().unwrap()).unwrap();
    let sink: BlockSink = Arc::new(|_: &Blocked, _: &str| {});
    let icpt = Interceptor::new(
        secrets,
        ca,
        tls::upstream_client_config(&[&extra]).unwrap(),
        sink,
    );
    // The guest's network: each connection is one intercepted flow to the forge.
    let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = l.local_addr().unwrap().port();
    tokio::spawn(async move {
        while let Ok((guest, _)) = l.accept().await {
            let up = TcpStream::connect(up_addr).await.unwrap();
            tokio::spawn({
                let dial = crate::network::upstream_proxy::Dial::direct(
                    up.peer_addr().unwrap(),
                    Some(GHOST),
                );
                icpt.clone().serve(guest, up, dial, GHOST.to_string())
            });
        }
    });
    // git trusts only the sandbox CA and resolves git.test to the listener.
    std::fs::write(
        home.join(".gitconfig"),
        format!("[http]\n\tcurloptResolve = {GHOST}:{port}:127.0.0.1\n"),
    )
    .unwrap();

    let (home2, sbx2, bare2, other2) = (home.clone(), sbx.clone(), bare.clone(), other.clone());
    let url = format!("https://{GHOST}:{port}/o/r.git");
    let other_url = format!("https://{GHOST}:{port}/o/other.git");
    tokio::task::spawn_blocking(move || {
        let (home, sbx, bare, other) = (home2, sbx2, bare2, other2);
        // Clone: every request gets the token (git's first one has none of its own).
        let (good, text) = run(&sbx, &home, &["clone", "-q", &url, "w"]);
        assert!(good, "{text}");
        let w = sbx.join("w");
        std::fs::write(w.join("a.txt"), "two\n").unwrap();
        ok(git(&w, &home, &["commit", "-q", "-am", "two"]));
        // agent/x lands.
        let (good, text) = run(&w, &home, &["push", "origin", "HEAD:refs/heads/agent/x"]);
        assert!(good, "{text}");
        let head = ok(git(&w, &home, &["rev-parse", "HEAD"]));
        assert_eq!(ok(git(&bare, &home, &["rev-parse", "refs/heads/agent/x"])), head);
        // main is refused with git's own output, and nothing lands.
        let main_before = ok(git(&bare, &home, &["rev-parse", "refs/heads/main"]));
        let (good, text) = run(&w, &home, &["push", "origin", "HEAD:main"]);
        assert!(!good, "{text}");
        assert!(
            text.contains(
                "! [remote rejected] HEAD -> main (tryboxi: push to main is not allowed; allowed: agent/*)"
            ),
            "{text}"
        );
        assert_eq!(ok(git(&bare, &home, &["rev-parse", "refs/heads/main"])), main_before);
        // Another repository of the same forge gets no token: the forge turns it away.
        let (good, text) = run(&sbx, &home, &["clone", "-q", &other_url, "o2"]);
        assert!(!good, "{text}");
        assert!(other.join("HEAD").exists());
    })
    .await
    .unwrap();

    let seen = seen.lock().unwrap();
    let (r, o): (Vec<_>, Vec<_>) = seen
        .iter()
        .partition(|(what, _)| what.contains("/o/r.git/"));
    assert!(r.len() >= 4, "{seen:?}");
    assert!(r.iter().all(|(_, a)| *a == expected_auth()), "{seen:?}");
    // The refused push never reached the forge: one receive-pack POST (agent/x) only.
    assert_eq!(
        r.iter()
            .filter(|(w, _)| w.starts_with("POST") && w.ends_with("git-receive-pack"))
            .count(),
        1,
        "{seen:?}"
    );
    assert!(!o.is_empty(), "{seen:?}");
    assert!(o.iter().all(|(_, a)| a.is_empty()), "{seen:?}");
}
