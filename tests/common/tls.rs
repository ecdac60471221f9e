//! Test TLS upstreams: a fresh test CA (its certificate written as PEM where the test says)
//! and a rustls server configuration for some names, signed by it; an HTTPS upstream answering
//! through a handler and handing over what it saw; the daemon config that pins test hosts to it.

use std::io::{BufRead, BufReader, Read as _, Write as _};
use std::net::{SocketAddr, TcpListener};
use std::path::Path;
use std::sync::{Arc, mpsc};
use std::time::{Duration, Instant};

use rcgen::{
    BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair,
    KeyUsagePurpose,
};

/// A new CA (common name `ca_cn`, if any) written to `ca_pem_path`, and a server config (ALPN
/// `http/1.1`) whose certificate for `hosts` that CA signed.
pub fn ca_signed_server(
    ca_pem_path: &Path,
    ca_cn: Option<&str>,
    hosts: &[&str],
) -> Arc<rustls::ServerConfig> {
    let ca_key = KeyPair::generate().unwrap();
    let mut p = CertificateParams::default();
    if let Some(cn) = ca_cn {
        p.distinguished_name.push(DnType::CommonName, cn);
    }
    p.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    // What a strict verifier (Python 3.13's default `VERIFY_X509_STRICT`, as in the trixie
    // guest) asks of a CA and its leaf: key usages, and the leaf's authority key identifier.
    p.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
    let ca_cert = p.self_signed(&ca_key).unwrap();
    std::fs::write(ca_pem_path, ca_cert.pem()).unwrap();
    let issuer = Issuer::new(p, ca_key);
    let key = KeyPair::generate().unwrap();
    let mut leaf =
        CertificateParams::new(hosts.iter().map(|h| h.to_string()).collect::<Vec<_>>()).unwrap();
    leaf.use_authority_key_identifier_extension = true;
    leaf.key_usages = vec![KeyUsagePurpose::DigitalSignature];
    leaf.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth];
    let cert = leaf.signed_by(&key, &issuer).unwrap();
    let mut cfg = rustls::ServerConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()
    .unwrap()
    .with_no_client_auth()
    .with_single_cert(
        vec![cert.der().clone()],
        rustls::pki_types::PrivateKeyDer::Pkcs8(key.serialize_der().into()),
    )
    .unwrap();
    cfg.alpn_protocols = vec![b"http/1.1".to_vec()];
    Arc::new(cfg)
}

/// One request an upstream answered: method, path, and its `Authorization` value ("" if none).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Seen {
    pub method: String,
    pub path: String,
    pub auth: String,
}

/// What an upstream's handler answers: status, content type, body and (for a redirect) a
/// `Location`.
pub struct Reply {
    pub status: u16,
    pub content_type: &'static str,
    pub body: Vec<u8>,
    pub location: Option<String>,
}

impl Reply {
    pub fn ok(content_type: &'static str, body: impl Into<Vec<u8>>) -> Reply {
        Reply {
            status: 200,
            content_type,
            body: body.into(),
            location: None,
        }
    }

    pub fn status(status: u16) -> Reply {
        Reply {
            status,
            content_type: "text/plain",
            body: format!("{status}\n").into_bytes(),
            location: None,
        }
    }

    /// A `302 Found` to `to`.
    pub fn redirect(to: &str) -> Reply {
        Reply {
            location: Some(to.to_owned()),
            ..Reply::status(302)
        }
    }
}

/// Reads one request head (bounded, its body, if any, skipped): `None` at the end of the
/// connection, else what was asked and whether the client wants the connection closed.
pub fn read_request<R: BufRead>(r: &mut R) -> Option<(Seen, bool)> {
    let mut line = String::new();
    if r.read_line(&mut line).ok()? == 0 {
        return None;
    }
    let mut parts = line.split_whitespace();
    let method = parts.next()?.to_owned();
    let path = parts.next()?.to_owned();
    let (mut auth, mut close, mut body_len) = (String::new(), false, 0u64);
    for _ in 0..200 {
        line.clear();
        if r.read_line(&mut line).ok()? == 0 || line == "\r\n" {
            break;
        }
        let Some((k, v)) = line.split_once(':') else {
            continue;
        };
        let v = v.trim();
        if k.eq_ignore_ascii_case("authorization") {
            v.clone_into(&mut auth);
        } else if k.eq_ignore_ascii_case("connection") {
            close = v.eq_ignore_ascii_case("close");
        } else if k.eq_ignore_ascii_case("content-length") {
            body_len = v.parse().unwrap_or(0);
        }
    }
    std::io::copy(&mut r.take(body_len), &mut std::io::sink()).ok()?;
    Some((Seen { method, path, auth }, close))
}

/// An HTTPS upstream (HTTP/1.1, keep-alive) for `hosts` with a certificate from a fresh test
/// CA (written to `ca_pem_path`): `handler` answers each request, which is then handed over.
pub fn https_upstream(
    ca_pem_path: &Path,
    hosts: &[&str],
    handler: impl Fn(&Seen) -> Reply + Send + Sync + 'static,
) -> (SocketAddr, mpsc::Receiver<Seen>) {
    let cfg = ca_signed_server(ca_pem_path, None, hosts);
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap();
    let (tx, rx) = mpsc::channel();
    let handler = Arc::new(handler);
    std::thread::spawn(move || {
        for conn in l.incoming() {
            let Ok(tcp) = conn else { return };
            let (cfg, tx, handler) = (cfg.clone(), tx.clone(), handler.clone());
            std::thread::spawn(move || {
                let _ = tcp.set_read_timeout(Some(Duration::from_secs(60)));
                let Ok(conn) = rustls::ServerConnection::new(cfg) else {
                    return;
                };
                let mut s = BufReader::new(rustls::StreamOwned::new(conn, tcp));
                while let Some((seen, close)) = read_request(&mut (&mut s).take(64 << 10)) {
                    let r = handler(&seen);
                    let w = s.get_mut();
                    let head = format!(
                        "HTTP/1.1 {} X\r\nContent-Type: {}\r\nContent-Length: {}\r\n{}{}\r\n",
                        r.status,
                        r.content_type,
                        r.body.len(),
                        r.location
                            .as_ref()
                            .map(|l| format!("Location: {l}\r\n"))
                            .unwrap_or_default(),
                        if close { "Connection: close\r\n" } else { "" }
                    );
                    let sent = w
                        .write_all(head.as_bytes())
                        .and_then(|()| w.write_all(&r.body));
                    let _ = w.flush();
                    let _ = tx.send(seen);
                    if close || sent.is_err() {
                        break;
                    }
                }
                let w = s.get_mut();
                w.conn.send_close_notify();
                let _ = w.flush();
            });
        }
    });
    (addr, rx)
}

/// The daemon config's `[network]` section for intercepted test hosts: no default policy, no
/// real DNS, `extra_ca` trusted upstream, each `(host, test address, port, local upstream)`
/// pinned and relayed.
pub fn intercept_config(extra_ca: &Path, pins: &[(&str, &str, u16, SocketAddr)]) -> String {
    let mut hosts = String::from("[network.test_hosts]\n");
    let mut map = String::from("[network.test_upstream_map]\n");
    for (host, ip, port, upstream) in pins {
        if !hosts.contains(&format!("\"{host}\" =")) {
            hosts.push_str(&format!("\"{host}\" = [\"{ip}\"]\n"));
        }
        map.push_str(&format!("\"{ip}:{port}\" = \"{upstream}\"\n"));
    }
    format!(
        "[network]\ndefault_policy = []\nupstream_dns = \"127.0.0.1:9\"\n\
         intercept_extra_ca = \"{}\"\n{hosts}{map}",
        extra_ca.display()
    )
}

/// The next request the upstream saw for `path` within `wait` (earlier ones are skipped).
pub fn seen_path(rx: &mpsc::Receiver<Seen>, path: &str, wait: Duration) -> Option<Seen> {
    let deadline = Instant::now() + wait;
    while let Some(left) = deadline.checked_duration_since(Instant::now()) {
        match rx.recv_timeout(left) {
            Ok(s) if s.path == path => return Some(s),
            Ok(_) => {}
            Err(_) => return None,
        }
    }
    None
}

/// In sandbox `id`, a placeholder `ph` that is not its own (another sandbox's, or its fork
/// parent's) sent to `https://api.test{path}` must stay the string it is: what went wrong
/// (the upstream saw `value`, or `value` came back into the VM), each naming `who`.
pub fn foreign_placeholder_stays_a_string(
    d: &super::Daemon,
    id: &str,
    ph: &str,
    rx: &mpsc::Receiver<Seen>,
    path: &str,
    value: &str,
    who: &str,
) -> Vec<String> {
    let mut bad = Vec::new();
    let out = super::bash(
        d,
        id,
        &format!("curl -sS -m 60 -H 'Authorization: Bearer {ph}' https://api.test{path}"),
    );
    // Passed as the string it is (or refused): never swapped.
    if let Some(s) = seen_path(rx, path, Duration::from_secs(10))
        && s.auth.contains(value)
    {
        bad.push(format!("{who}: a placeholder not its own was swapped"));
    }
    if out.contains(value) {
        bad.push(format!("{who}: the value reached the VM"));
    }
    bad
}
