//! The interceptor driven from a native peer: a rustls client that trusts the sandbox CA talks
//! through [`Interceptor::serve`] to a local rustls + hyper upstream on 127.0.0.1 whose
//! certificate comes from a test CA given as the extra CA.

use std::io::Write as _;
use std::sync::{Arc, Mutex};

use base64::Engine as _;
use base64::engine::general_purpose::STANDARD;
use bytes::Bytes;
use http_body_util::{BodyExt as _, StreamBody};
use hyper::body::Frame;
use hyper::{Request, Response, StatusCode};
use hyper_util::rt::{TokioExecutor, TokioIo};
use rcgen::{BasicConstraints, CertificateParams, IsCa, Issuer, KeyPair};
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
use tokio::net::{TcpListener, TcpStream};

use super::body::{ProxyBody, boxed, full};
use super::*;
use crate::secrets::{Binding, Snapshot, Value};

pub(super) const HOST: &str = "api.test";
pub(super) const PH: &str = "tbx_aaaabbbbccccddddeeeeffffgggghhhh";
pub(super) const VAL: &str = "sk-live-SECRET-0123456789";
pub(super) const PH2: &str = "tbx_zzzzyyyyxxxxwwwwvvvvuuuuttttssss";

pub(super) struct TestCa {
    pub(super) issuer: Issuer<'static, KeyPair>,
    pub(super) pem: String,
}

pub(super) fn test_ca() -> TestCa {
    let key = KeyPair::generate().unwrap();
    let mut p = CertificateParams::default();
    p.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    let cert = p.self_signed(&key).unwrap();
    TestCa {
        pem: cert.pem(),
        issuer: Issuer::new(p, key),
    }
}

/// What the upstream saw: the authorization-like headers and the URL of each request.
pub(super) type Seen = Arc<Mutex<Vec<String>>>;

fn echo_text(req: &hyper::http::request::Parts, body: &[u8]) -> String {
    let h = |n: &str| {
        req.headers
            .get(n)
            .map(|v| String::from_utf8_lossy(v.as_bytes()).into_owned())
            .unwrap_or_default()
    };
    format!(
        "uri={} auth={} key={} ae={} body={}",
        req.uri,
        h("authorization"),
        h("x-api-key"),
        h("accept-encoding"),
        String::from_utf8_lossy(body)
    )
}

async fn echo(req: Request<hyper::body::Incoming>, seen: Seen) -> Response<ProxyBody> {
    let (parts, body) = req.into_parts();
    let body = body
        .collect()
        .await
        .map(|b| b.to_bytes())
        .unwrap_or_default();
    let text = echo_text(&parts, &body);
    seen.lock().unwrap().push(text.clone());
    let auth = parts.headers.get("authorization").cloned();
    let mut resp = match parts.uri.path() {
        "/gzip" => {
            let mut e = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
            e.write_all(text.as_bytes()).unwrap();
            let mut r = Response::new(full(e.finish().unwrap()));
            r.headers_mut()
                .insert("content-encoding", "gzip".parse().unwrap());
            r
        }
        "/redirect" => {
            // A redirect that carries the key it was sent (as some OAuth flows do).
            let key = parts
                .headers
                .get("x-api-key")
                .map(|v| String::from_utf8_lossy(v.as_bytes()).into_owned())
                .unwrap_or_default();
            let mut r = Response::new(full(""));
            *r.status_mut() = StatusCode::FOUND;
            r.headers_mut().insert(
                "location",
                format!("https://evil.test/cb?k={key}").parse().unwrap(),
            );
            r
        }
        "/br" => {
            let mut out = Vec::new();
            {
                let mut w = brotli::CompressorWriter::new(&mut out, 4096, 5, 22);
                w.write_all(text.as_bytes()).unwrap();
            }
            let mut r = Response::new(full(out));
            r.headers_mut()
                .insert("content-encoding", "br".parse().unwrap());
            r
        }
        "/zstd" => {
            let mut r = Response::new(full(text));
            r.headers_mut()
                .insert("content-encoding", "zstd".parse().unwrap());
            r
        }
        "/evil-encoding" => {
            // An encoding name that echoes the key: the refusal must not carry it.
            let mut r = Response::new(full(text));
            let key = parts.headers.get("x-api-key").cloned();
            if let Some(k) = key {
                r.headers_mut().insert("content-encoding", k);
            }
            r
        }
        "/chunks" => {
            // Three bytes a frame: the value is split across many chunks.
            let frames: Vec<Result<Frame<Bytes>, super::BoxError>> = text
                .into_bytes()
                .chunks(3)
                .map(|c| Ok(Frame::data(Bytes::copy_from_slice(c))))
                .collect();
            Response::new(boxed(StreamBody::new(futures_util::stream::iter(frames))))
        }
        "/trailers" => {
            let mut tr = hyper::HeaderMap::new();
            tr.insert("grpc-status", "0".parse().unwrap());
            if let Some(a) = &auth {
                tr.insert("x-echo-auth", a.clone());
            }
            let frames: Vec<Result<Frame<Bytes>, super::BoxError>> =
                vec![Ok(Frame::data(Bytes::from(text))), Ok(Frame::trailers(tr))];
            Response::new(boxed(StreamBody::new(futures_util::stream::iter(frames))))
        }
        _ => Response::new(full(text)),
    };
    if let Some(a) = auth {
        resp.headers_mut().insert("x-echo-auth", a);
    }
    resp
}

/// A TLS acceptor for `host` with a certificate from the test CA, offering `alpn`.
pub(super) fn server_tls(ca: &TestCa, host: &str, alpn: &[&[u8]]) -> tokio_rustls::TlsAcceptor {
    let key = KeyPair::generate().unwrap();
    let cert = CertificateParams::new(vec![host.to_string()])
        .unwrap()
        .signed_by(&key, &ca.issuer)
        .unwrap();
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
    cfg.alpn_protocols = alpn.iter().map(|p| p.to_vec()).collect();
    tokio_rustls::TlsAcceptor::from(Arc::new(cfg))
}

/// Serves `handle` on 127.0.0.1 behind `acceptor` (HTTP/1.1 with upgrades, or h2 by ALPN);
/// returns its address and what the handler recorded.
pub(super) async fn serve_tls<F, Fut>(
    acceptor: tokio_rustls::TlsAcceptor,
    handle: F,
) -> (std::net::SocketAddr, Seen)
where
    F: Fn(Request<hyper::body::Incoming>, Seen) -> Fut + Clone + Send + Sync + 'static,
    Fut: std::future::Future<Output = Response<ProxyBody>> + Send + 'static,
{
    let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap();
    let seen: Seen = Arc::default();
    let s2 = seen.clone();
    tokio::spawn(async move {
        while let Ok((tcp, _)) = l.accept().await {
            let (acceptor, seen, handle) = (acceptor.clone(), s2.clone(), handle.clone());
            tokio::spawn(async move {
                let Ok(tls) = acceptor.accept(tcp).await else {
                    return;
                };
                let svc = hyper::service::service_fn(move |req| {
                    let (seen, handle) = (seen.clone(), handle.clone());
                    async move { Ok::<_, std::convert::Infallible>(handle(req, seen).await) }
                });
                let _ = hyper_util::server::conn::auto::Builder::new(TokioExecutor::new())
                    .serve_connection_with_upgrades(TokioIo::new(tls), svc)
                    .await;
            });
        }
    });
    (addr, seen)
}

/// A TLS + HTTP echo server for `HOST` on 127.0.0.1 (ALPN h2 and http/1.1 unless `h1_only`).
async fn upstream(ca: &TestCa, h1_only: bool) -> (std::net::SocketAddr, Seen) {
    let alpn: &[&[u8]] = if h1_only {
        &[b"http/1.1"]
    } else {
        &[b"h2", b"http/1.1"]
    };
    serve_tls(server_tls(ca, HOST, alpn), |req, seen| async move {
        echo(req, seen).await
    })
    .await
}

pub(super) fn binding(name: &str, host: &str, ph: &str, val: &str, in_body: bool) -> Binding {
    Binding {
        name: name.into(),
        hosts: vec![host.into()],
        headers: vec![],
        in_body,
        placeholder: ph.into(),
        value: Value::new(val.as_bytes().to_vec()),
    }
}

pub(super) struct Harness {
    pub(super) icpt: Arc<Interceptor>,
    ca_pem: String,
    pub(super) addr: std::net::SocketAddr,
    pub(super) seen: Seen,
    /// `(secret, host)` of refused placeholders.
    pub(super) blocked: Arc<Mutex<Vec<(String, String)>>>,
    /// `(secret, host)` of audited ones (in bodies).
    pub(super) audited: Arc<Mutex<Vec<(String, String)>>>,
    _dir: tempfile::TempDir,
}

pub(super) async fn harness_with(h1_only: bool, trust_upstream: bool) -> Harness {
    let up_ca = test_ca();
    let (addr, seen) = upstream(&up_ca, h1_only).await;
    let trusted = if trust_upstream {
        up_ca.pem.clone()
    } else {
        test_ca().pem
    };
    harness_at(trusted, addr, seen)
}

/// The interceptor for an upstream at `addr` whose certificate chains to `trusted` (PEM).
pub(super) fn harness_at(trusted: String, addr: std::net::SocketAddr, seen: Seen) -> Harness {
    let dir = tempfile::tempdir().unwrap();
    let extra = dir.path().join("extra-ca.pem");
    std::fs::write(&extra, trusted).unwrap();
    let tls = tls::upstream_client_config(&[&extra]).unwrap();
    let secrets = SandboxSecrets::default();
    secrets.publish(Snapshot {
        bindings: vec![
            binding("KEY", HOST, PH, VAL, true),
            binding("OTHER", "other.test", PH2, "other-secret-value-42", false),
        ],
        git: vec![],
    });
    let ca = SandboxCa::load_or_create(dir.path(), &secrets.current().intercepted_hosts()).unwrap();
    let blocked: Arc<Mutex<Vec<(String, String)>>> = Arc::default();
    let audited: Arc<Mutex<Vec<(String, String)>>> = Arc::default();
    let (b2, a2) = (blocked.clone(), audited.clone());
    let sink: BlockSink = Arc::new(move |b: &Blocked, host: &str| {
        let to = if b.refused { &b2 } else { &a2 };
        to.lock().unwrap().push((b.secret.clone(), host.to_owned()))
    });
    let icpt = Interceptor::new(secrets, ca.clone(), tls, sink);
    Harness {
        icpt,
        ca_pem: ca.cert_pem().unwrap(),
        addr,
        seen,
        blocked,
        audited,
        _dir: dir,
    }
}

/// The guest's end: TLS trusting the sandbox CA, through `serve`, with the given ALPN.
pub(super) async fn guest_tls(
    h: &Harness,
    alpn: &[&[u8]],
) -> std::io::Result<(
    tokio_rustls::client::TlsStream<tokio::io::DuplexStream>,
    tokio::task::JoinHandle<Result<(), InterceptError>>,
)> {
    let tcp = TcpStream::connect(h.addr).await.unwrap();
    let dial = crate::network::upstream_proxy::Dial::direct(h.addr, Some(HOST));
    guest_tls_over(h, alpn, tcp, dial).await
}

/// A guest's TLS connection to [`HOST`] at `h`, intercepted, with the daemon behind an upstream
/// CONNECT proxy (in-process, mapping `HOST:443` to `h`): the first tunnel by name, as the stack
/// hands it over, and the route for more (an address the host cannot reach: only the proxy's
/// name works). Returns the proxy (what it saw), the guest's TLS stream and the flow's task.
pub(super) async fn guest_tls_behind_proxy(
    h: &Harness,
    alpn: &[&[u8]],
) -> (
    crate::network::upstream_proxy_testkit::TestProxy,
    tokio_rustls::client::TlsStream<tokio::io::DuplexStream>,
    tokio::task::JoinHandle<Result<(), InterceptError>>,
) {
    use crate::network::upstream_proxy::{self as up, Dial};
    use crate::network::upstream_proxy_testkit::{self as kit, Rules};
    let proxy = kit::start(Rules {
        map: std::collections::HashMap::from([(format!("{HOST}:443"), h.addr)]),
        ..Rules::default()
    })
    .await;
    let p = std::sync::Arc::new(
        up::resolve(Some(&format!("http://{}", proxy.addr)), Some(&[]), |_| None)
            .unwrap()
            .unwrap(),
    );
    let first = p
        .tunnel(p.connect_proxy().await.unwrap(), HOST, 443)
        .await
        .unwrap();
    let dial = Dial::route("192.0.2.50:443".parse().unwrap(), Some(HOST), Some(&p));
    assert!(dial.via_proxy());
    let (tls, task) = guest_tls_over(h, alpn, first, dial).await.unwrap();
    (proxy, tls, task)
}

/// [`guest_tls`] with the stack's part given: the first upstream connection and the route of
/// later ones (e.g. a tunnel through an upstream proxy).
pub(super) async fn guest_tls_over(
    h: &Harness,
    alpn: &[&[u8]],
    tcp: TcpStream,
    dial: crate::network::upstream_proxy::Dial,
) -> std::io::Result<(
    tokio_rustls::client::TlsStream<tokio::io::DuplexStream>,
    tokio::task::JoinHandle<Result<(), InterceptError>>,
)> {
    let (ours, theirs) = tokio::io::duplex(64 * 1024);
    let task = tokio::spawn(h.icpt.clone().serve(theirs, tcp, dial, HOST.to_string()));
    let mut roots = rustls::RootCertStore::empty();
    use rustls::pki_types::pem::PemObject as _;
    roots
        .add(rustls::pki_types::CertificateDer::from_pem_slice(h.ca_pem.as_bytes()).unwrap())
        .unwrap();
    let mut cfg = rustls::ClientConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()
    .unwrap()
    .with_root_certificates(roots)
    .with_no_client_auth();
    cfg.alpn_protocols = alpn.iter().map(|p| p.to_vec()).collect();
    let name = rustls::pki_types::ServerName::try_from(HOST).unwrap();
    let s = tokio_rustls::TlsConnector::from(Arc::new(cfg))
        .connect(name, ours)
        .await?;
    Ok((s, task))
}

pub(super) enum Client {
    H1(hyper::client::conn::http1::SendRequest<ProxyBody>),
    H2(hyper::client::conn::http2::SendRequest<ProxyBody>),
}

pub(super) async fn client(h: &Harness, h2: bool) -> Client {
    let alpn: &[&[u8]] = if h2 { &[b"h2"] } else { &[b"http/1.1"] };
    let (tls, _task) = guest_tls(h, alpn).await.unwrap();
    assert_eq!(
        tls.get_ref().1.alpn_protocol(),
        Some(if h2 { &b"h2"[..] } else { b"http/1.1" })
    );
    let io = TokioIo::new(tls);
    if h2 {
        let (s, c) = hyper::client::conn::http2::Builder::new(TokioExecutor::new())
            .handshake(io)
            .await
            .unwrap();
        tokio::spawn(c);
        Client::H2(s)
    } else {
        let (s, c) = hyper::client::conn::http1::handshake(io).await.unwrap();
        tokio::spawn(c);
        Client::H1(s)
    }
}

pub(super) struct Got {
    pub(super) status: StatusCode,
    pub(super) headers: hyper::HeaderMap,
    pub(super) body: String,
    trailers: Option<hyper::HeaderMap>,
}

impl Client {
    pub(super) async fn send(&mut self, mut req: Request<ProxyBody>) -> Got {
        let resp = match self {
            Client::H1(s) => {
                s.ready().await.unwrap();
                s.send_request(req).await.unwrap()
            }
            Client::H2(s) => {
                *req.version_mut() = hyper::Version::HTTP_2;
                s.send_request(req).await.unwrap()
            }
        };
        let (p, b) = resp.into_parts();
        let c = b.collect().await.unwrap();
        let trailers = c.trailers().cloned();
        Got {
            status: p.status,
            headers: p.headers,
            body: String::from_utf8_lossy(&c.to_bytes()).into_owned(),
            trailers,
        }
    }

    pub(super) async fn get(&mut self, path: &str, hdrs: &[(&str, &str)]) -> Got {
        let h2 = matches!(self, Client::H2(_));
        let mut b = Request::builder().method("GET");
        b = if h2 {
            b.uri(format!("https://{HOST}{path}"))
        } else {
            b.uri(path).header("host", HOST)
        };
        for (k, v) in hdrs {
            b = b.header(*k, *v);
        }
        self.send(b.body(full("")).unwrap()).await
    }
}

pub(super) fn assert_no_value(g: &Got) {
    let all = format!("{:?} {} {:?}", g.headers, g.body, g.trailers);
    assert!(!all.contains(VAL), "value leaked to the guest: {all}");
    assert!(
        !all.contains(&STANDARD.encode(VAL)),
        "base64 value leaked: {all}"
    );
}

#[tokio::test]
async fn h1_swaps_every_position_and_scrubs_every_response() {
    let h = harness_with(true, true).await;
    // Each swap is reported by name (`secret ls`'s "last used"), never with the value.
    let used: Arc<Mutex<Vec<String>>> = Default::default();
    let u = used.clone();
    h.icpt.set_used_sink(Arc::new(move |name: &str| {
        u.lock().unwrap().push(name.to_owned())
    }));
    let mut c = client(&h, false).await;
    let basic = STANDARD.encode(format!("me:{PH}"));
    let bearer = format!("Bearer {PH}");
    for path in ["/plain", "/gzip", "/br", "/chunks"] {
        let g = c
            .get(
                &format!("{path}?key={PH}"),
                &[("authorization", &bearer), ("x-api-key", PH)],
            )
            .await;
        assert_eq!(g.status, 200, "{path}: {}", g.body);
        let seen = h.seen.lock().unwrap().last().cloned().unwrap();
        assert!(seen.contains(&format!("auth=Bearer {VAL}")), "{seen}");
        assert!(seen.contains(&format!("key={VAL}")), "{seen}");
        assert!(seen.contains(&format!("?key={VAL}")), "{seen}");
        assert!(seen.contains("ae=identity"), "{seen}");
        assert_no_value(&g);
        // The guest sees its own placeholder where the value was echoed.
        assert!(
            g.body.contains(&format!("auth=Bearer {PH}")),
            "{path}: {}",
            g.body
        );
        assert_eq!(g.headers["x-echo-auth"], bearer.as_str());
    }
    {
        let used = used.lock().unwrap();
        assert_eq!(used.len(), 4, "one report per swapped request: {used:?}");
        assert!(used.iter().all(|n| n == "KEY"), "{used:?}");
    }
    // Basic: decoded, swapped, re-encoded; the echoed Basic form comes back as the placeholder's.
    let g = c
        .get("/plain", &[("authorization", &format!("Basic {basic}"))])
        .await;
    let seen = h.seen.lock().unwrap().last().cloned().unwrap();
    let want = STANDARD.encode(format!("me:{VAL}"));
    assert!(seen.contains(&want), "{seen}");
    assert_no_value(&g);
    assert!(!g.body.contains(&want), "{}", g.body);
    assert!(g.body.contains(&basic), "{}", g.body);
    // A redirect is passed back (not followed), its Location scrubbed.
    let g = c.get("/redirect", &[("x-api-key", PH)]).await;
    assert_eq!(g.status, StatusCode::FOUND);
    assert_eq!(
        g.headers["location"],
        format!("https://evil.test/cb?k={PH}").as_str()
    );
    assert_no_value(&g);
    // Unknown content encoding of a scrubbed response: fail closed.
    let g = c.get("/zstd", &[("authorization", &bearer)]).await;
    assert_eq!(g.status, 502);
    assert_no_value(&g);
    let g = c.get("/evil-encoding", &[("x-api-key", PH)]).await;
    assert_eq!(g.status, 502);
    assert_no_value(&g);
}

#[tokio::test]
async fn h2_works_with_trailers_and_bodies() {
    let h = harness_with(false, true).await;
    let mut c = client(&h, true).await;
    let bearer = format!("Bearer {PH}");
    let g = c
        .get(
            "/trailers",
            &[("authorization", &bearer), ("te", "trailers")],
        )
        .await;
    assert_eq!(g.status, 200, "{}", g.body);
    let tr = g.trailers.clone().expect("trailers reach the guest");
    assert_eq!(tr["grpc-status"], "0");
    assert_eq!(tr["x-echo-auth"], bearer.as_str());
    assert_no_value(&g);
    let seen = h.seen.lock().unwrap().last().cloned().unwrap();
    assert!(seen.contains(&format!("auth=Bearer {VAL}")), "{seen}");
    // A body (in_body) split across frames is swapped upstream and scrubbed back.
    let frames: Vec<Result<Frame<Bytes>, super::BoxError>> = format!("{{\"k\":\"{PH}\"}}")
        .into_bytes()
        .chunks(5)
        .map(|c| Ok(Frame::data(Bytes::copy_from_slice(c))))
        .collect();
    let req = Request::builder()
        .method("POST")
        .uri(format!("https://{HOST}/gzip"))
        .body(boxed(StreamBody::new(futures_util::stream::iter(frames))))
        .unwrap();
    let g = c.send(req).await;
    assert_eq!(g.status, 200);
    let seen = h.seen.lock().unwrap().last().cloned().unwrap();
    assert!(
        seen.contains(&format!("body={{\"k\":\"{VAL}\"}}")),
        "{seen}"
    );
    assert_no_value(&g);
    assert!(g.body.contains(PH), "{}", g.body);
    // Several requests at once on one connection.
    let mut tasks = Vec::new();
    for i in 0..4 {
        let Client::H2(s) = &c else { unreachable!() };
        let mut s = s.clone();
        let bearer = bearer.clone();
        tasks.push(tokio::spawn(async move {
            let req = Request::builder()
                .uri(format!("https://{HOST}/n{i}"))
                .header("authorization", bearer)
                .body(full(""))
                .unwrap();
            s.send_request(req).await.unwrap().status()
        }));
    }
    for t in tasks {
        assert_eq!(t.await.unwrap(), 200);
    }
}

#[tokio::test]
async fn host_mismatch_and_foreign_placeholders_are_refused() {
    let h = harness_with(false, true).await;
    for h2 in [false, true] {
        let mut c = client(&h, h2).await;
        let before = h.seen.lock().unwrap().len();
        let req = if h2 {
            Request::builder().uri("https://other.test/")
        } else {
            Request::builder().uri("/").header("host", "other.test")
        }
        .header("authorization", format!("Bearer {PH}"))
        .body(full(""))
        .unwrap();
        let g = c.send(req).await;
        assert_eq!(g.status, StatusCode::MISDIRECTED_REQUEST, "h2={h2}");
        // A port on Host is fine.
        if !h2 {
            let g = c.get("/", &[]).await;
            assert_eq!(g.status, 200);
        }
        // OTHER's placeholder (in its base64 form too) to api.test: blocked, with an event.
        for auth in [
            format!("Bearer {PH2}"),
            format!("Basic {}", STANDARD.encode(format!("u:{PH2}"))),
        ] {
            let g = c.get("/", &[("authorization", &auth)]).await;
            assert_eq!(g.status, StatusCode::FORBIDDEN, "{}", g.body);
            assert!(g.body.contains("OTHER"), "{}", g.body);
        }
        let g = c.get(&format!("/?q={PH2}"), &[]).await;
        assert_eq!(g.status, StatusCode::FORBIDDEN);
        // In a body it is allowed.
        let g = c.get("/", &[("x-note", PH2)]).await;
        assert_eq!(g.status, 200);
        let seen = h.seen.lock().unwrap();
        assert_eq!(seen.len(), before + 1 + usize::from(!h2), "{seen:?}");
        assert!(seen.iter().all(|s| !s.contains("other-secret-value")));
    }
    {
        let b = h.blocked.lock().unwrap();
        assert_eq!(b.len(), 6);
        assert!(b.iter().all(|(s, host)| s == "OTHER" && host == HOST));
    }
    // CONNECT and TRACE are refused.
    let mut c = client(&h, false).await;
    let req = Request::builder()
        .method("TRACE")
        .uri("/")
        .header("host", HOST)
        .body(full(""))
        .unwrap();
    assert_eq!(c.send(req).await.status, StatusCode::METHOD_NOT_ALLOWED);
    // A foreign placeholder in a request body (split across frames): allowed, and audited.
    assert!(h.audited.lock().unwrap().is_empty());
    let frames: Vec<Result<Frame<Bytes>, super::BoxError>> = format!("{{\"echo\":\"{PH2}\"}}")
        .into_bytes()
        .chunks(4)
        .map(|c| Ok(Frame::data(Bytes::copy_from_slice(c))))
        .collect();
    let req = Request::builder()
        .method("POST")
        .uri("/")
        .header("host", HOST)
        .body(boxed(StreamBody::new(futures_util::stream::iter(frames))))
        .unwrap();
    let g = c.send(req).await;
    assert_eq!(g.status, 200);
    assert!(g.body.contains(PH2), "{}", g.body);
    assert_eq!(
        h.audited.lock().unwrap().as_slice(),
        [("OTHER".to_string(), HOST.to_string())]
    );
    assert_eq!(h.blocked.lock().unwrap().len(), 6);
}

#[tokio::test]
async fn an_untrusted_upstream_certificate_fails() {
    let h = harness_with(false, false).await;
    // Upstream first: the serve task must fail on the upstream certificate by itself, without
    // ever answering the guest (a skipped verification would wait for the guest's handshake).
    let (ours, theirs) = tokio::io::duplex(64 * 1024);
    let tcp = TcpStream::connect(h.addr).await.unwrap();
    let dial = crate::network::upstream_proxy::Dial::direct(h.addr, Some(HOST));
    let task = tokio::spawn(h.icpt.clone().serve(theirs, tcp, dial, HOST.to_string()));
    let r = tokio::time::timeout(std::time::Duration::from_secs(5), task)
        .await
        .expect("serve gave up on the untrusted upstream")
        .unwrap();
    let e = r.unwrap_err();
    assert!(matches!(e, InterceptError::UpstreamTls(_)), "{e}");
    // And a guest connecting gets no handshake.
    drop(ours);
    assert!(guest_tls(&h, &[b"h2"]).await.is_err());
    assert!(h.seen.lock().unwrap().is_empty());
}

#[tokio::test]
async fn malformed_requests_do_not_panic() {
    let h = harness_with(true, true).await;
    let mut cases: Vec<Vec<u8>> = vec![
        b"GET / HTTP/1.1\r\n\r\n".to_vec(),
        b"GET / HTTP/1.1\r\nHost: api.test\r\nHost: api.test\r\n\r\n".to_vec(),
        b"\r\nGET / HTTP/1.1\r\nHost: api.test\r\n\r\n".to_vec(),
        b"GET http://other.test/ HTTP/1.1\r\nHost: api.test\r\n\r\n".to_vec(),
        b"POST / HTTP/1.1\r\nHost: api.test\r\nContent-Length: 99999999999999999999\r\n\r\n"
            .to_vec(),
        b"POST / HTTP/1.1\r\nHost: api.test\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n".to_vec(),
        b"GET / HTTP/1.1\r\nHost: \xff\xfe\r\nAuthorization: Basic !!!!\r\n\r\n".to_vec(),
        b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n\x00\x00".to_vec(),
        format!("GET /?{PH}%zz HTTP/1.1\r\nHost: api.test:99999\r\n\r\n").into_bytes(),
    ];
    // Deterministic junk.
    let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
    for n in [1usize, 17, 200, 3000] {
        let mut v = b"GET /".to_vec();
        for _ in 0..n {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            v.push((x & 0xff) as u8);
        }
        cases.push(v);
    }
    for case in cases {
        let (mut s, task) = guest_tls(&h, &[b"http/1.1"]).await.unwrap();
        let _ = s.write_all(&case).await;
        let _ = s.flush().await;
        let mut out = Vec::new();
        let _ = tokio::time::timeout(
            std::time::Duration::from_millis(500),
            s.read_to_end(&mut out),
        )
        .await;
        drop(s);
        let r = tokio::time::timeout(std::time::Duration::from_secs(5), task).await;
        if let Ok(j) = r {
            assert!(!j.is_err_and(|e| e.is_panic()), "panicked on {case:?}");
        }
    }
}

/// A plain HTTP/1 echo server on 127.0.0.1.
async fn plain_upstream() -> (std::net::SocketAddr, Seen) {
    let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap();
    let seen: Seen = Arc::default();
    let s2 = seen.clone();
    tokio::spawn(async move {
        while let Ok((tcp, _)) = l.accept().await {
            let seen = s2.clone();
            tokio::spawn(async move {
                let svc = hyper::service::service_fn(move |req| {
                    let seen = seen.clone();
                    async move { Ok::<_, std::convert::Infallible>(echo(req, seen).await) }
                });
                let _ = hyper::server::conn::http1::Builder::new()
                    .serve_connection(TokioIo::new(tcp), svc)
                    .await;
            });
        }
    });
    (addr, seen)
}

#[tokio::test]
async fn plaintext_flows_check_every_request_and_never_swap() {
    let h = harness_with(true, true).await;
    let (addr, seen) = plain_upstream().await;
    let (ours, theirs) = tokio::io::duplex(64 * 1024);
    let tcp = TcpStream::connect(addr).await.unwrap();
    tokio::spawn({
        let dial =
            crate::network::upstream_proxy::Dial::direct(tcp.peer_addr().unwrap(), Some(HOST));
        h.icpt
            .clone()
            .serve_plain(theirs, tcp, dial, HOST.to_string())
    });
    let (s, conn) = hyper::client::conn::http1::handshake(TokioIo::new(ours))
        .await
        .unwrap();
    tokio::spawn(conn);
    let mut c = Client::H1(s);
    // Its own secret's placeholder in plaintext: passed as it is, never swapped.
    let g = c
        .get("/", &[("authorization", &format!("Bearer {PH}"))])
        .await;
    assert_eq!(g.status, 200);
    assert!(seen.lock().unwrap()[0].contains(&format!("auth=Bearer {PH}")));
    // A later request on the same connection with another secret's placeholder: refused.
    let g = c.get("/", &[("x-api-key", PH2)]).await;
    assert_eq!(g.status, StatusCode::FORBIDDEN);
    assert_eq!(
        h.blocked.lock().unwrap().as_slice(),
        [("OTHER".to_string(), HOST.to_string())]
    );
    // Switching Host mid-connection: refused.
    let req = Request::builder()
        .uri("/")
        .header("host", "other.test")
        .body(full(""))
        .unwrap();
    assert_eq!(c.send(req).await.status, StatusCode::MISDIRECTED_REQUEST);
    assert_eq!(seen.lock().unwrap().len(), 1);
    assert!(seen.lock().unwrap().iter().all(|s| !s.contains(VAL)));
}

#[tokio::test]
async fn h1_body_swap_fixes_a_declared_content_length() {
    let h = harness_with(true, true).await;
    let mut c = client(&h, false).await;
    // The guest declares the placeholder body's length (a longer one than the value's) and
    // sends it in pieces that split the placeholder; the upstream must get a well-framed body.
    let body = format!("{{\"k\":\"{PH}\",\"n\":1}}");
    let frames: Vec<Result<Frame<Bytes>, super::BoxError>> = body
        .as_bytes()
        .chunks(7)
        .map(|c| Ok(Frame::data(Bytes::copy_from_slice(c))))
        .collect();
    let req = Request::builder()
        .method("POST")
        .uri("/plain")
        .header("host", HOST)
        .header("content-length", body.len())
        .body(boxed(StreamBody::new(futures_util::stream::iter(frames))))
        .unwrap();
    let wait = std::time::Duration::from_secs(10);
    let g = tokio::time::timeout(wait, c.send(req))
        .await
        .expect("the upstream got a complete body (no stale Content-Length)");
    assert_eq!(g.status, 200, "{}", g.body);
    let seen = h.seen.lock().unwrap().last().cloned().unwrap();
    assert!(
        seen.ends_with(&format!("body={{\"k\":\"{VAL}\",\"n\":1}}")),
        "{seen}"
    );
    assert_no_value(&g);
    // The connection stays usable: the next request is framed right too.
    let g = tokio::time::timeout(wait, c.get("/plain", &[("x-api-key", PH)]))
        .await
        .unwrap();
    assert_eq!(g.status, 200);
    assert!(h.blocked.lock().unwrap().is_empty());
}
