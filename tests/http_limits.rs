//! The daemon's listeners under hostile clients (issue 15, item 15): connection caps per
//! listener and per peer, the header-read timeout (streams exempt), TLS off loopback with a
//! pinned certificate, and no plain listener off loopback. No VM needed.
// This test binary is dynamically linked, so its own NSS lookups are safe (clippy.toml bans them
// for the static product binary).
#![allow(clippy::disallowed_methods)]

mod common;

use std::io::{ErrorKind, Read, Write};
use std::net::TcpStream;
use std::os::unix::net::UnixStream;
use std::os::unix::process::CommandExt;
use std::path::Path;
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::{BIN, Daemon, free_port, raw_http, wait_bounded};

/// What a connection the test holds has seen so far.
#[derive(Debug, PartialEq)]
enum Seen {
    Open,
    Closed(String),
}

/// Non-blocking look at a stream: still open (nothing to read), or closed by the daemon
/// (with whatever it wrote first).
fn look<S: Read>(s: &mut S, got: &mut Vec<u8>) -> Seen {
    let mut buf = [0u8; 4096];
    loop {
        match s.read(&mut buf) {
            Ok(0) => return Seen::Closed(String::from_utf8_lossy(got).into_owned()),
            Ok(n) => got.extend_from_slice(&buf[..n]),
            Err(e) if e.kind() == ErrorKind::WouldBlock => return Seen::Open,
            Err(e) if e.kind() == ErrorKind::ConnectionReset => {
                return Seen::Closed(String::from_utf8_lossy(got).into_owned());
            }
            Err(e) => panic!("read: {e}"),
        }
    }
}

#[test]
fn idle_connections_past_the_cap_are_refused_and_others_still_served() {
    let port = free_port();
    let d = Daemon::start(
        Some(&format!(
            "tcp_listen = \"127.0.0.1:{port}\"\n[http]\nmax_connections = 8\n\
             max_connections_per_peer = 3\nheader_timeout_s = 60\n"
        )),
        &[],
    );
    let token = String::from_utf8(d.cli(&["token"]).stdout)
        .unwrap()
        .trim()
        .to_owned();
    // One local user opens 20 idle connections and sends nothing.
    let mut hog: Vec<(TcpStream, Vec<u8>)> = (0..20)
        .map(|_| {
            let s = TcpStream::connect(("127.0.0.1", port)).unwrap();
            s.set_nonblocking(true).unwrap();
            (s, Vec::new())
        })
        .collect();
    let deadline = Instant::now() + Duration::from_secs(10);
    let refused = loop {
        let closed: Vec<String> = hog
            .iter_mut()
            .filter_map(|(s, got)| match look(s, got) {
                Seen::Closed(text) => Some(text),
                Seen::Open => None,
            })
            .collect();
        if closed.len() >= 17 || Instant::now() > deadline {
            break closed;
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    assert_eq!(
        refused.len(),
        17,
        "of 20 idle connections of one peer with max_connections_per_peer = 3, {} were refused",
        refused.len()
    );
    for text in &refused {
        assert!(text.starts_with("HTTP/1.1 503"), "refused with `{text}`");
        assert!(text.contains("too_many_connections"), "{text}");
    }
    // The three it holds stay open...
    let held = hog
        .iter_mut()
        .map(|(s, got)| look(s, got))
        .filter(|seen| *seen == Seen::Open)
        .count();
    assert_eq!(held, 3);
    // ...and everyone else is still served: the unix socket has its own budget,
    let r = d.request("GET", "/v1/health", None);
    assert_eq!(r.status, 200);
    // and another local user on the same TCP listener has its own per-uid budget.
    if !nix::unistd::geteuid().is_root() {
        common::skip_unless_ci(
            "the second-uid TCP client: needs root to run a client under another uid",
        );
        return;
    }
    let other_home = tempfile::tempdir().unwrap();
    let out = Command::new(BIN)
        .args(["ls"])
        .env("TRYBOXI_HOME", other_home.path())
        .env("TRYBOXI_URL", format!("http://127.0.0.1:{port}"))
        .env("TRYBOXI_TOKEN", &token)
        .uid(65534)
        .gid(65534)
        .stdin(Stdio::null())
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "uid 65534 was not served while uid {} held its cap: {}",
        nix::unistd::geteuid(),
        String::from_utf8_lossy(&out.stderr)
    );
    drop(hog);
}

#[test]
fn slowloris_is_cut_at_the_header_timeout_and_streams_are_not() {
    let d = Daemon::start(Some("[http]\nheader_timeout_s = 1\n"), &[]);
    // A client that trickles its header, one line every 300 ms, forever.
    let mut slow = UnixStream::connect(d.socket()).unwrap();
    slow.write_all(b"GET /v1/health HTTP/1.1\r\nHost: localhost\r\n")
        .unwrap();
    slow.set_nonblocking(true).unwrap();
    // A client that connects and says nothing.
    let mut idle = UnixStream::connect(d.socket()).unwrap();
    idle.set_nonblocking(true).unwrap();
    // A long stream: the events feed, whose response goes on past the timeout.
    let mut stream = UnixStream::connect(d.socket()).unwrap();
    stream
        .write_all(b"GET /v1/events?since=now HTTP/1.1\r\nHost: localhost\r\n\r\n")
        .unwrap();
    stream.set_nonblocking(true).unwrap();

    let started = Instant::now();
    let (mut slow_at, mut idle_at) = (None, None);
    let mut stream_got = Vec::new();
    let mut n = 0;
    while started.elapsed() < Duration::from_secs(6) {
        if slow_at.is_none() {
            let _ = slow.write_all(format!("X-Trickle-{n}: a\r\n").as_bytes());
            n += 1;
            if let Seen::Closed(_) = look(&mut slow, &mut Vec::new()) {
                slow_at = Some(started.elapsed());
            }
        }
        if idle_at.is_none()
            && let Seen::Closed(_) = look(&mut idle, &mut Vec::new())
        {
            idle_at = Some(started.elapsed());
        }
        if let Seen::Closed(text) = look(&mut stream, &mut stream_got) {
            panic!(
                "the events stream was cut after {:?}: {text}",
                started.elapsed()
            );
        }
        if slow_at.is_some() && idle_at.is_some() && started.elapsed() > Duration::from_secs(3) {
            break;
        }
        std::thread::sleep(Duration::from_millis(300));
    }
    let slow_at = slow_at.expect("a trickling header was still being read after 6 s");
    let idle_at = idle_at.expect("a silent connection was still open after 6 s");
    assert!(
        slow_at >= Duration::from_millis(900),
        "cut early: {slow_at:?}"
    );
    assert!(
        idle_at >= Duration::from_millis(900),
        "cut early: {idle_at:?}"
    );
    let head = String::from_utf8_lossy(&stream_got).into_owned();
    assert!(head.starts_with("HTTP/1.1 200"), "events answered `{head}`");
    assert!(started.elapsed() > Duration::from_secs(3));
    // The daemon still serves well-behaved clients.
    assert_eq!(d.request("GET", "/v1/health", None).status, 200);
}

/// One answer read off a kept-alive connection (by its Content-Length): its status.
fn keep_alive_get(s: &mut UnixStream, path: &str) -> std::io::Result<u16> {
    s.write_all(format!("GET {path} HTTP/1.1\r\nHost: localhost\r\n\r\n").as_bytes())?;
    let mut raw = Vec::new();
    let mut buf = [0u8; 4096];
    loop {
        let n = s.read(&mut buf)?;
        if n == 0 {
            return Err(std::io::Error::new(ErrorKind::UnexpectedEof, "closed"));
        }
        raw.extend_from_slice(&buf[..n]);
        let Some(end) = raw.windows(4).position(|w| w == b"\r\n\r\n") else {
            continue;
        };
        let head = String::from_utf8_lossy(&raw[..end]).to_ascii_lowercase();
        let len: usize = head
            .lines()
            .find_map(|l| l.strip_prefix("content-length:"))
            .and_then(|v| v.trim().parse().ok())
            .expect("an answer with a length");
        if raw.len() >= end + 4 + len {
            return Ok(head.split_whitespace().nth(1).unwrap().parse().unwrap());
        }
    }
}

/// Client pools keep idle connections longer than a slowloris bound (reqwest and Go: 90 s). The
/// daemon used to close them at the header timeout, so a request written on one as the daemon
/// closed it was reset (the E2B SDK's `run_code` after a timed-out one did exactly that).
#[test]
fn a_kept_alive_connection_waits_past_the_header_timeout_until_the_idle_timeout() {
    let d = Daemon::start(
        Some("[http]\nheader_timeout_s = 1\nidle_timeout_s = 4\n"),
        &[],
    );
    let mut c = UnixStream::connect(d.socket()).unwrap();
    c.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
    assert_eq!(keep_alive_get(&mut c, "/v1/health").unwrap(), 200);
    // Idle for twice the header timeout: still served.
    std::thread::sleep(Duration::from_secs(2));
    assert_eq!(
        keep_alive_get(&mut c, "/v1/health").expect("the idle connection was closed"),
        200
    );
    // Then closed at the idle timeout, counted from that answer.
    let t = Instant::now();
    c.set_nonblocking(true).unwrap();
    while look(&mut c, &mut Vec::new()) == Seen::Open {
        assert!(
            t.elapsed() < Duration::from_secs(10),
            "an idle connection was still open after 10 s"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    let at = t.elapsed();
    assert!(at >= Duration::from_millis(3500), "closed early: {at:?}");
}

#[test]
fn a_body_that_trickles_in_gets_408_at_the_body_timeout() {
    let d = Daemon::start(Some("[http]\nbody_timeout_s = 1\n"), &[]);
    let mut slow = UnixStream::connect(d.socket()).unwrap();
    slow.write_all(
        b"POST /v1/sandboxes HTTP/1.1\r\nHost: localhost\r\ncontent-type: application/json\r\n\
          Content-Length: 100000\r\n\r\n{",
    )
    .unwrap();
    slow.set_nonblocking(true).unwrap();
    let started = Instant::now();
    let mut got = Vec::new();
    let answer = loop {
        let _ = slow.write_all(b" ");
        if let Seen::Closed(text) = look(&mut slow, &mut got) {
            break text;
        }
        assert!(
            started.elapsed() < Duration::from_secs(6),
            "a body trickling in one byte per 200 ms was still being read after 6 s"
        );
        std::thread::sleep(Duration::from_millis(200));
    };
    assert!(answer.starts_with("HTTP/1.1 408"), "answered `{answer}`");
    assert!(answer.contains("body_timeout_s"), "{answer}");
    assert!(started.elapsed() >= Duration::from_millis(900));
    assert_eq!(d.request("GET", "/v1/health", None).status, 200);
}

/// A rustls client config that trusts only the certificate with this SHA-256.
fn pinned(fingerprint: &str) -> Arc<rustls::ClientConfig> {
    use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
    use rustls::pki_types::{CertificateDer, ServerName, UnixTime};
    use rustls::{DigitallySignedStruct, SignatureScheme};
    use sha2::Digest;

    #[derive(Debug)]
    struct Pin(Vec<u8>, rustls::crypto::WebPkiSupportedAlgorithms);
    impl ServerCertVerifier for Pin {
        fn verify_server_cert(
            &self,
            cert: &CertificateDer<'_>,
            _: &[CertificateDer<'_>],
            _: &ServerName<'_>,
            _: &[u8],
            _: UnixTime,
        ) -> Result<ServerCertVerified, rustls::Error> {
            if sha2::Sha256::digest(cert.as_ref()).as_slice() == self.0 {
                Ok(ServerCertVerified::assertion())
            } else {
                Err(rustls::Error::General("fingerprint mismatch".into()))
            }
        }
        fn verify_tls12_signature(
            &self,
            m: &[u8],
            c: &CertificateDer<'_>,
            d: &DigitallySignedStruct,
        ) -> Result<HandshakeSignatureValid, rustls::Error> {
            rustls::crypto::verify_tls12_signature(m, c, d, &self.1)
        }
        fn verify_tls13_signature(
            &self,
            m: &[u8],
            c: &CertificateDer<'_>,
            d: &DigitallySignedStruct,
        ) -> Result<HandshakeSignatureValid, rustls::Error> {
            rustls::crypto::verify_tls13_signature(m, c, d, &self.1)
        }
        fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
            self.1.supported_schemes()
        }
    }
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let hex_part = fingerprint.trim().trim_start_matches("sha256:");
    let pin = Pin(
        hex::decode(hex_part).expect("hex fingerprint"),
        provider.signature_verification_algorithms,
    );
    Arc::new(
        rustls::ClientConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .unwrap()
            .dangerous()
            .with_custom_certificate_verifier(Arc::new(pin))
            .with_no_client_auth(),
    )
}

fn tls_get(
    port: u16,
    config: Arc<rustls::ClientConfig>,
    token: &str,
) -> std::io::Result<common::Resp> {
    let name = rustls::pki_types::ServerName::try_from("127.0.0.1").unwrap();
    let conn = rustls::ClientConnection::new(config, name).map_err(std::io::Error::other)?;
    let tcp = TcpStream::connect(("127.0.0.1", port))?;
    tcp.set_read_timeout(Some(Duration::from_secs(30)))?;
    let mut tls = rustls::StreamOwned::new(conn, tcp);
    let host = format!("build-box.example:{port}");
    let bearer = format!("Bearer {token}");
    raw_http(
        &mut tls,
        "GET",
        "/v1/health",
        None,
        &[("Host", &host), ("Authorization", &bearer)],
    )
}

#[test]
fn tls_listener_off_loopback_serves_clients_that_pin_its_certificate() {
    let port = free_port();
    let d = Daemon::start(
        Some(&format!(
            "tcp_listen = \"0.0.0.0:{port}\"\ntcp_tls = true\n[http]\nheader_timeout_s = 1\n"
        )),
        &[],
    );
    let out = d.cli(&["token", "--fingerprint"]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let fingerprint = String::from_utf8(out.stdout).unwrap().trim().to_owned();
    assert!(fingerprint.starts_with("sha256:"), "{fingerprint}");
    let out = d.cli(&["token"]);
    let token = String::from_utf8(out.stdout).unwrap().trim().to_owned();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains(&fingerprint),
        "`tryboxi token` said: {stderr}"
    );
    for f in ["tls-cert.pem", "tls-key.pem"] {
        use std::os::unix::fs::PermissionsExt;
        let mode = std::fs::metadata(d.root().join(f))
            .unwrap()
            .permissions()
            .mode();
        assert_eq!(mode & 0o777, 0o600, "{f}");
    }

    // A rustls client pinning the fingerprint is served (any Host name: clients come from
    // other machines).
    let r = tls_get(port, pinned(&fingerprint), &token).unwrap();
    assert_eq!(r.status, 200, "{}", r.text());
    let r = tls_get(port, pinned(&fingerprint), "wrong").unwrap();
    assert_eq!(r.status, 401);
    // A client pinning another certificate never completes the handshake.
    let other = format!("sha256:{}", "00".repeat(32));
    assert!(tls_get(port, pinned(&other), &token).is_err());
    // Plain HTTP to the TLS port gets no HTTP answer.
    let mut plain = TcpStream::connect(("127.0.0.1", port)).unwrap();
    plain
        .set_read_timeout(Some(Duration::from_secs(30)))
        .unwrap();
    let host = format!("127.0.0.1:{port}");
    let bearer = format!("Bearer {token}");
    let r = raw_http(
        &mut plain,
        "GET",
        "/v1/health",
        None,
        &[("Host", &host), ("Authorization", &bearer)],
    );
    assert!(
        r.is_err() || r.as_ref().unwrap().status != 200,
        "plain HTTP was served: {r:?}"
    );

    // A client that never starts its handshake is closed at the header timeout.
    let mut silent = TcpStream::connect(("127.0.0.1", port)).unwrap();
    silent
        .set_read_timeout(Some(Duration::from_secs(10)))
        .unwrap();
    let started = Instant::now();
    let n = silent.read(&mut [0u8; 64]).unwrap_or(0);
    assert_eq!(n, 0, "the daemon wrote to a client that sent nothing");
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "a silent TLS client was held {:?}",
        started.elapsed()
    );

    // The CLI, from another data root, with the URL, the token and the fingerprint.
    let home = tempfile::tempdir().unwrap();
    let cli = |fp: &str| {
        Command::new(BIN)
            .args(["ls"])
            .env("TRYBOXI_HOME", home.path())
            .env("TRYBOXI_URL", format!("https://127.0.0.1:{port}"))
            .env("TRYBOXI_TOKEN", &token)
            .env("TRYBOXI_FINGERPRINT", fp)
            .stdin(Stdio::null())
            .output()
            .unwrap()
    };
    let out = cli(&fingerprint);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let out = cli(&other);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(err.contains("not the pinned TRYBOXI_FINGERPRINT"), "{err}");
    // Plain http:// to an address that is not loopback is refused by the client itself.
    let out = Command::new(BIN)
        .args(["ls"])
        .env("TRYBOXI_HOME", home.path())
        .env("TRYBOXI_URL", format!("http://192.0.2.1:{port}"))
        .env("TRYBOXI_TOKEN", &token)
        .stdin(Stdio::null())
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && err.contains("plain text"), "{err}");
}

#[test]
fn plain_tcp_off_loopback_is_refused_at_startup() {
    let home = tempfile::tempdir().unwrap();
    let port = free_port();
    std::fs::write(
        home.path().join("config.toml"),
        format!("tcp_listen = \"0.0.0.0:{port}\"\n[pool]\ngolden = false\nsize = 0\n"),
    )
    .unwrap();
    let log = home.path().join("daemon.log");
    let mut child = Command::new(BIN)
        .arg("serve")
        .env("TRYBOXI_HOME", home.path())
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(&log).unwrap())
        .spawn()
        .unwrap();
    let status = wait_bounded(&mut child, Duration::from_secs(30));
    let err = std::fs::read_to_string(&log).unwrap();
    assert!(!status.success(), "{err}");
    assert!(
        err.contains("is not a loopback address") && err.contains("tcp_tls = true"),
        "{err}"
    );
    assert!(
        TcpStream::connect(("127.0.0.1", port)).is_err(),
        "the plain listener was opened"
    );
}

/// A local user reaching the daemon over loopback TCP (with the token) is refused its own home
/// folder as a workspace, as over the unix socket: the socket's owner is looked up (sock_diag),
/// not taken to be the daemon's user. Needs root to run the client under another uid.
#[test]
fn a_loopback_tcp_client_is_refused_its_own_home_folder() {
    if !nix::unistd::geteuid().is_root() {
        common::skip_unless_ci("needs root to run a client under another uid");
        return;
    }
    // Another user whose home folder exists (and is not `/`, refused for its own reason).
    let Some(user) = (1..65534)
        .filter_map(|u| nix::unistd::User::from_uid(nix::unistd::Uid::from_raw(u)).ok()?)
        .filter(|u| u.dir.is_dir() && u.dir.canonicalize().is_ok_and(|d| d != Path::new("/")))
        .max_by_key(|u| u.uid.as_raw() >= 1000)
    else {
        common::skip_unless_ci("no user other than root has a home folder here");
        return;
    };
    let port = free_port();
    let d = Daemon::start(Some(&format!("tcp_listen = \"127.0.0.1:{port}\"\n")), &[]);
    let token = String::from_utf8(d.cli(&["token"]).stdout)
        .unwrap()
        .trim()
        .to_owned();
    let client_home = tempfile::tempdir().unwrap();
    let out = Command::new(BIN)
        .args(["create", "--vcpus", "0", "--workspace"])
        .arg(&user.dir)
        .env("TRYBOXI_HOME", client_home.path())
        .env("TRYBOXI_URL", format!("http://127.0.0.1:{port}"))
        .env("TRYBOXI_TOKEN", &token)
        .uid(user.uid.as_raw())
        .gid(user.gid.as_raw())
        .stdin(Stdio::null())
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "created: {err}");
    assert!(
        err.contains("home folder"),
        "uid {} over loopback TCP, workspace {}: {err}",
        user.uid,
        user.dir.display()
    );
}
