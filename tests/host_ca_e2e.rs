//! End to end with real VMs (issue 18, item 12): the guest trusts the host's locally added CA
//! certificates, so that a TLS-inspecting proxy the host trusts works from inside a sandbox.
//!
//! 1. A VM reaches a loopback HTTPS upstream whose certificate is signed by a test CA that only
//!    a temporary CA directory holds (`[network] host_ca_dirs`; the host's own trust store is
//!    never touched): curl and Python `urllib` succeed, through the CA env vars and through the
//!    guest's trust store alone, and again in a fork. With `trust_host_cas = false` the same
//!    requests fail verification and the guest's bundle is left alone.
//! 2. The spec's first example: a sandbox from the python template on a small Python project
//!    (a package and its pytest suite) installs its test dependency from the real registry
//!    through the default egress policy and its suite passes. On a host behind a TLS-inspecting
//!    proxy (the host's local CA directory holds the proxy's CA) this fails without item 1.
//!
//! `local.test` is pinned to a test address that the stack relays to the loopback upstream
//! (`test_hosts` + `test_upstream_map`). Uses the guest images from `TRYBOXI_ARTIFACTS` or
//! `_out/` (skips without them, except under CI).

mod common;

use std::io::{BufRead as _, BufReader, Write as _};
use std::net::{SocketAddr, TcpListener};
use std::process::Output;
use std::time::Duration;

use common::{Daemon, SMALL_VMS, artifacts, create_with, first_word, vm_daemon};

const HOST: &str = "local.test";
const CA_CN: &str = "tryboxi e2e local CA";
const BODY: &str = "hello from the local upstream";

fn text(o: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

/// `bash -c <script>` in the sandbox: exit code and stdout+stderr.
fn bash(d: &Daemon, id: &str, script: &str) -> (Option<i32>, String) {
    let o = d.cli(&["exec", id, "--", "bash", "-c", script]);
    (o.status.code(), text(&o))
}

/// An HTTPS upstream for [`HOST`] whose certificate comes from a fresh test CA, written (PEM)
/// to `ca_dir/local-test-ca.crt`. Answers every request with [`BODY`].
fn tls_upstream(ca_dir: &std::path::Path) -> SocketAddr {
    let cfg =
        common::tls::ca_signed_server(&ca_dir.join("local-test-ca.crt"), Some(CA_CN), &[HOST]);
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap();
    std::thread::spawn(move || {
        for conn in l.incoming() {
            let Ok(tcp) = conn else { return };
            let cfg = cfg.clone();
            std::thread::spawn(move || {
                let _ = tcp.set_read_timeout(Some(Duration::from_secs(60)));
                let Ok(conn) = rustls::ServerConnection::new(cfg) else {
                    return;
                };
                let mut s = rustls::StreamOwned::new(conn, tcp);
                // The request head (bounded); a client that rejects the certificate ends here.
                let mut r = BufReader::new(std::io::Read::take(&mut s, 64 << 10));
                let mut line = String::new();
                while r.read_line(&mut line).unwrap_or(0) > 0 && line != "\r\n" {
                    line.clear();
                }
                drop(r);
                let _ = write!(
                    s,
                    "HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nContent-Length: {}\r\n\
                     Connection: close\r\n\r\n{BODY}\n",
                    BODY.len() + 1
                );
                let _ = s.flush();
                s.conn.send_close_notify();
                let _ = s.flush();
            });
        }
    });
    addr
}

fn config(ca_dir: &std::path::Path, upstream: SocketAddr, on: bool) -> String {
    format!(
        "{SMALL_VMS}[network]\ndefault_policy = []\nupstream_dns = \"127.0.0.1:9\"\n\
         trust_host_cas = {on}\nhost_ca_dirs = [\"{}\"]\n\
         [network.test_hosts]\n\"{HOST}\" = [\"203.0.113.20\"]\n\
         [network.test_upstream_map]\n\"203.0.113.20:443\" = \"{upstream}\"\n",
        ca_dir.display()
    )
}

const CURL: &str = "curl -sS -m 60 https://local.test/curl; echo curl-rc=$?";
const PYTHON: &str = "python3 -c \"\nimport urllib.request\n\
     print(urllib.request.urlopen('https://local.test/py', timeout=60).read().decode())\n\"; \
     echo py-rc=$?";
/// The same two, with every CA variable removed: only the guest's trust store is left.
const STORE_ONLY: &str = "env -u SSL_CERT_FILE -u REQUESTS_CA_BUNDLE -u CURL_CA_BUNDLE \
     curl -sS -m 60 https://local.test/store; echo store-curl-rc=$?; \
     env -u SSL_CERT_FILE -u REQUESTS_CA_BUNDLE python3 -c \"\nimport urllib.request\n\
     print(urllib.request.urlopen('https://local.test/store', timeout=60).read().decode())\n\"; \
     echo store-py-rc=$?";

/// Where the sandbox stands: the CA variables, the kept distribution bundle, our CA.
const STATE: &str = "printf 'SSL_CERT_FILE=%s\\n' \"$SSL_CERT_FILE\"; \
     printf 'NODE_EXTRA_CA_CERTS=%s\\n' \"$NODE_EXTRA_CA_CERTS\"; \
     test -s /etc/ssl/certs/ca-certificates.crt.distro && echo DISTRO-KEPT; \
     grep -c 'tryboxi e2e local CA' /etc/ssl/certs/ca-certificates.crt";

fn served(out: &str, marker: &str) -> bool {
    out.contains(BODY) && out.contains(&format!("{marker}=0"))
}

#[test]
fn the_guest_trusts_a_ca_that_only_the_configured_host_ca_dir_holds() {
    let ca_dir = tempfile::tempdir().unwrap();
    let upstream = tls_upstream(ca_dir.path());
    let mut bad: Vec<String> = Vec::new();

    // On (the default; the directory is the test's own).
    {
        let Some(d) = vm_daemon(&config(ca_dir.path(), upstream, true)) else {
            return;
        };
        let ws = tempfile::tempdir().unwrap();
        let id = create_with(&d, ws.path(), &[]);
        let o = d.cli(&["net", "allow", &id, HOST]);
        assert!(o.status.success(), "net allow: {}", text(&o));

        let t = std::time::Instant::now();
        let (_, out) = bash(&d, &id, STATE);
        eprintln!("on: first exec (writes the bundle) {:?}", t.elapsed());
        let t = std::time::Instant::now();
        let _ = bash(&d, &id, "true");
        eprintln!("on: second exec {:?}", t.elapsed());
        if !out.contains("SSL_CERT_FILE=/etc/ssl/certs/ca-certificates.crt\n")
            || !out.contains("NODE_EXTRA_CA_CERTS=/etc/ssl/certs/ca-certificates.crt\n")
        {
            bad.push(format!("on: the CA variables are not set: {out}"));
        }
        if !out.contains("DISTRO-KEPT") || !out.trim_end().ends_with("\n1") {
            bad.push(format!("on: the guest bundle: {out}"));
        }
        for (what, script, marker) in [
            ("curl", CURL, "curl-rc"),
            ("python urllib", PYTHON, "py-rc"),
        ] {
            let (_, out) = bash(&d, &id, script);
            if !served(&out, marker) {
                bad.push(format!("on: {what}: {out}"));
            }
        }
        let (_, out) = bash(&d, &id, STORE_ONLY);
        if !served(&out, "store-curl-rc") || !served(&out, "store-py-rc") {
            bad.push(format!("on: the trust store alone: {out}"));
        }

        // A restore of a snapshot taken after the bundle was written: the snapshot carries
        // the bundle's state, so the restored VM's first exec does not look at it again
        // (`GuestTrust::carry_over`), and the CA is trusted there.
        let o = d.cli(&["snapshot", "create", &id, "--name", "trusted"]);
        assert!(o.status.success(), "snapshot: {}", text(&o));
        let o = d.cli(&["restore", &id, "trusted"]);
        assert!(o.status.success(), "restore: {}", text(&o));
        let (_, out) = bash(&d, &id, CURL);
        if !served(&out, "curl-rc") {
            bad.push(format!("on: curl after a restore: {out}"));
        }

        // A fork is a new VM: its first exec gets the bundle and the variables as well. The
        // parent's bundle is first put back to the distribution's (as `update-ca-certificates`
        // would): the child's bundle no longer matches the stamp of what tryboxi wrote, so it
        // is written again (an unchanged one is not).
        let (code, _) = bash(
            &d,
            &id,
            "cp /etc/ssl/certs/ca-certificates.crt.distro /etc/ssl/certs/ca-certificates.crt",
        );
        assert_eq!(code, Some(0));
        let o = d.cli(&["fork", &id]);
        assert!(o.status.success(), "fork: {}", text(&o));
        let child = first_word(&o);
        let (_, out) = bash(&d, &child, CURL);
        if !served(&out, "curl-rc") {
            bad.push(format!("on: curl in a fork: {out}"));
        }
        assert!(d.cli(&["rm", &child]).status.success());
        assert!(d.cli(&["rm", &id]).status.success());
    }

    // Off: the same requests fail verification, and the guest is left as its image made it.
    {
        let d = vm_daemon(&config(ca_dir.path(), upstream, false)).unwrap();
        let ws = tempfile::tempdir().unwrap();
        let id = create_with(&d, ws.path(), &[]);
        let o = d.cli(&["net", "allow", &id, HOST]);
        assert!(o.status.success(), "net allow: {}", text(&o));
        let t = std::time::Instant::now();
        let (_, out) = bash(&d, &id, STATE);
        eprintln!("off: first exec {:?}", t.elapsed());
        if out.contains("SSL_CERT_FILE=/") || out.contains("DISTRO-KEPT") {
            bad.push(format!("off: the guest was touched: {out}"));
        }
        let (_, out) = bash(&d, &id, CURL);
        // curl: 60 = the peer's certificate cannot be verified.
        if out.contains(BODY) || !out.contains("curl-rc=60") {
            bad.push(format!("off: curl did not fail verification: {out}"));
        }
        let (_, out) = bash(&d, &id, PYTHON);
        if out.contains(BODY) || !out.contains("CERTIFICATE_VERIFY_FAILED") {
            bad.push(format!("off: python did not fail verification: {out}"));
        }
        assert!(d.cli(&["rm", &id]).status.success());
    }
    assert!(bad.is_empty(), "{}", bad.join("\n"));
}

/// The host's pip index, if its pip configuration names one (`PIP_INDEX_URL`, or
/// `pip config get global.index-url`); otherwise pip's default, the real PyPI.
fn host_index_url() -> Option<String> {
    if let Ok(u) = std::env::var("PIP_INDEX_URL")
        && !u.is_empty()
    {
        return Some(u);
    }
    let o = std::process::Command::new("python3")
        .args(["-m", "pip", "config", "get", "global.index-url"])
        .output()
        .ok()?;
    let u = String::from_utf8_lossy(&o.stdout).trim().to_owned();
    (o.status.success() && !u.is_empty()).then_some(u)
}

/// The host part of an `http(s)://[user@]host[:port]/...` URL.
fn url_host(url: &str) -> Option<String> {
    let rest = url.split_once("://")?.1;
    let auth = rest.split('/').next()?;
    let hostport = auth.rsplit('@').next()?;
    Some(hostport.split(':').next()?.to_owned()).filter(|h| !h.is_empty())
}

/// Whether `host:443` accepts a TCP connection from here within a few seconds.
fn reachable(host: &str) -> bool {
    use std::net::ToSocketAddrs as _;
    let Ok(addrs) = (host, 443).to_socket_addrs() else {
        return false;
    };
    addrs
        .into_iter()
        .any(|a| std::net::TcpStream::connect_timeout(&a, Duration::from_secs(5)).is_ok())
}

const PROJECT: [(&str, &str); 5] = [
    (
        "pyproject.toml",
        "[build-system]\nrequires = [\"setuptools>=61\"]\nbuild-backend = \"setuptools.build_meta\"\n\n\
         [project]\nname = \"tinycalc\"\nversion = \"0.1.0\"\nrequires-python = \">=3.9\"\n\n\
         [project.optional-dependencies]\ntest = [\"pytest>=7\"]\n\n\
         [tool.pytest.ini_options]\npythonpath = [\"src\"]\ntestpaths = [\"tests\"]\n",
    ),
    ("requirements-test.txt", "pytest>=7\n"),
    (
        "src/tinycalc/__init__.py",
        "\"\"\"A tiny calculator.\"\"\"\n\n\ndef add(a, b):\n    return a + b\n\n\n\
         def mean(xs):\n    if not xs:\n        raise ValueError(\"mean of nothing\")\n    \
         return sum(xs) / len(xs)\n",
    ),
    (
        "tests/test_tinycalc.py",
        "import pytest\n\nfrom tinycalc import add, mean\n\n\ndef test_add():\n    \
         assert add(2, 3) == 5\n\n\n@pytest.mark.parametrize(\"xs,want\", [([1, 2, 3], 2), ([4], 4)])\n\
         def test_mean(xs, want):\n    assert mean(xs) == want\n\n\ndef test_mean_of_nothing():\n    \
         with pytest.raises(ValueError):\n        mean([])\n",
    ),
    (
        "README.md",
        "# tinycalc\n\n`pip install -r requirements-test.txt && pytest`\n",
    ),
];

#[test]
fn pip_installs_the_test_dependencies_from_the_registry_and_the_suite_passes() {
    let Some(art) = artifacts() else { return };
    let manifest = std::fs::read_to_string(art.join("images/manifest.json")).unwrap_or_default();
    if !manifest.contains("\"template.python\"") {
        common::skip_unless_ci(&format!(
            "no python template in the images at {} (`cargo xtask images`)",
            art.display()
        ));
        return;
    }
    let index = host_index_url();
    let index_host = index
        .as_deref()
        .and_then(url_host)
        .unwrap_or_else(|| "pypi.org".into());
    if !reachable(&index_host) {
        common::skip_unless_ci(&format!("the package index {index_host} is unreachable"));
        return;
    }
    // The default egress policy and the default host CA directories: what a user gets.
    let d = Daemon::start(
        Some(&format!("{SMALL_VMS}exec_timeout_s = 600\n")),
        &["--artifacts", art.to_str().unwrap()],
    );
    let ws = tempfile::tempdir().unwrap();
    for (path, body) in PROJECT {
        let p = ws.path().join(path);
        std::fs::create_dir_all(p.parent().unwrap()).unwrap();
        std::fs::write(p, body).unwrap();
    }
    let id = create_with(&d, ws.path(), &["--template", "python"]);
    let mut env: Vec<String> = Vec::new();
    if let Some(u) = &index {
        // A mirror the host's pip names must be allowed as well (the registries preset
        // holds PyPI's own hosts).
        if index_host != "pypi.org" {
            let o = d.cli(&["net", "allow", &id, &index_host]);
            assert!(o.status.success(), "net allow {index_host}: {}", text(&o));
        }
        env.push(format!("PIP_INDEX_URL={u}"));
    }
    let mut args = vec!["exec", &id];
    for e in &env {
        args.extend(["-e", e]);
    }
    args.extend([
        "--",
        "bash",
        "-c",
        "set -e; cd /workspace; python3 -m venv /tmp/venv; \
         /tmp/venv/bin/pip install --disable-pip-version-check --no-input -q \
         -r requirements-test.txt; /tmp/venv/bin/python -m pytest -q -p no:cacheprovider",
    ]);
    let o = d.cli(&args);
    let out = text(&o);
    eprintln!("{out}");
    assert!(
        o.status.success() && out.contains("4 passed"),
        "pip install + pytest in the sandbox: {out}\n{}",
        d.log_tail(40)
    );
    assert!(d.cli(&["rm", &id]).status.success());
}
