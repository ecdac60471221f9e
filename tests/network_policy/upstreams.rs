//! Local upstreams for tests/network_policy_e2e.rs, all on loopback: HTTP and HTTPS servers
//! that log every connection (bytes received, SNI, Host), a counting listener, a test CA, and
//! a fake upstream resolver that answers names with addresses in the always-blocked ranges.

use std::io::{Read, Write};
use std::net::{IpAddr, SocketAddr, TcpListener, TcpStream, UdpSocket};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

#[derive(Debug, Clone)]
pub struct Conn {
    /// Accept order (0, 1, ...).
    pub seq: usize,
    pub bytes_in: usize,
    pub sni: Option<String>,
    pub host: Option<String>,
}

#[derive(Default)]
pub struct Seen {
    accepted: AtomicUsize,
    conns: Mutex<Vec<Conn>>,
}

impl Seen {
    pub fn mark(&self) -> usize {
        self.accepted.load(Ordering::SeqCst)
    }

    /// The connections accepted from `mark` on, once every accepted one has ended (bounded).
    pub fn since(&self, mark: usize) -> Vec<Conn> {
        let deadline = Instant::now() + Duration::from_secs(15);
        loop {
            {
                let c = self.conns.lock().unwrap();
                if c.len() == self.accepted.load(Ordering::SeqCst) {
                    return c.iter().filter(|c| c.seq >= mark).cloned().collect();
                }
            }
            assert!(
                Instant::now() < deadline,
                "an upstream connection stayed open for 15 s"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Serve each connection on its own thread; log it when it ends.
    fn accept_loop(
        self: &Arc<Self>,
        l: TcpListener,
        serve: fn(TcpStream, &mut Conn, &Ctx),
        ctx: Ctx,
    ) {
        let me = self.clone();
        let ctx = Arc::new(ctx);
        std::thread::spawn(move || {
            for s in l.incoming() {
                let Ok(s) = s else { return };
                let seq = me.accepted.fetch_add(1, Ordering::SeqCst);
                let (me, ctx) = (me.clone(), ctx.clone());
                std::thread::spawn(move || {
                    let _ = s.set_read_timeout(Some(Duration::from_secs(10)));
                    let mut c = Conn {
                        seq,
                        bytes_in: 0,
                        sni: None,
                        host: None,
                    };
                    serve(s, &mut c, &ctx);
                    me.conns.lock().unwrap().push(c);
                });
            }
        });
    }
}

#[derive(Default)]
struct Ctx {
    tls: Option<Arc<rustls::ServerConfig>>,
    body: &'static str,
}

/// Counts the bytes read through it.
struct Counting<'a> {
    inner: TcpStream,
    n: &'a mut usize,
}

impl Read for Counting<'_> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        let n = self.inner.read(buf)?;
        *self.n += n;
        Ok(n)
    }
}

impl Write for Counting<'_> {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.inner.write(buf)
    }
    fn flush(&mut self) -> std::io::Result<()> {
        self.inner.flush()
    }
}

/// Read an HTTP/1 request head; its `Host`.
fn read_head(r: &mut impl Read) -> Option<String> {
    let mut head = Vec::new();
    let mut b = [0u8; 1024];
    while !head.windows(4).any(|w| w == b"\r\n\r\n") {
        let n = r.read(&mut b).ok()?;
        if n == 0 || head.len() > 16384 {
            return None;
        }
        head.extend_from_slice(&b[..n]);
    }
    let text = String::from_utf8_lossy(&head).to_ascii_lowercase();
    text.lines()
        .find_map(|l| l.strip_prefix("host:"))
        .map(|h| h.trim().to_owned())
}

fn respond(w: &mut impl Write, body: &str) {
    let _ = write!(
        w,
        "HTTP/1.1 200 OK\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    );
    let _ = w.flush();
}

fn serve_http(s: TcpStream, c: &mut Conn, ctx: &Ctx) {
    let mut n = 0;
    let mut io = Counting {
        inner: s,
        n: &mut n,
    };
    c.host = read_head(&mut io);
    if c.host.is_some() {
        respond(&mut io, ctx.body);
    }
    drop(io);
    c.bytes_in = n;
}

fn serve_tls(s: TcpStream, c: &mut Conn, ctx: &Ctx) {
    let cfg = ctx.tls.clone().expect("a TLS config");
    let mut n = 0;
    let conn = rustls::ServerConnection::new(cfg).expect("server connection");
    let mut tls = rustls::StreamOwned::new(
        conn,
        Counting {
            inner: s,
            n: &mut n,
        },
    );
    c.host = read_head(&mut tls);
    c.sni = tls.conn.server_name().map(str::to_owned);
    if c.host.is_some() {
        respond(&mut tls, ctx.body);
        tls.conn.send_close_notify();
        let _ = tls.flush();
    }
    drop(tls);
    c.bytes_in = n;
}

pub fn http_server(body: &'static str) -> (SocketAddr, Arc<Seen>) {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap();
    let seen = Arc::new(Seen::default());
    seen.accept_loop(l, serve_http, Ctx { tls: None, body });
    (addr, seen)
}

pub fn tls_server(cfg: Arc<rustls::ServerConfig>, body: &'static str) -> (SocketAddr, Arc<Seen>) {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap();
    let seen = Arc::new(Seen::default());
    seen.accept_loop(
        l,
        serve_tls,
        Ctx {
            tls: Some(cfg),
            body,
        },
    );
    (addr, seen)
}

/// A listener on every host address (0.0.0.0) that only counts: what the guest must never
/// reach through the gateway or the blocked ranges.
pub fn host_listener() -> (u16, Arc<Seen>) {
    let l = TcpListener::bind("0.0.0.0:0").unwrap();
    let port = l.local_addr().unwrap().port();
    let seen = Arc::new(Seen::default());
    seen.accept_loop(l, |_, _, _| {}, Ctx::default());
    (port, seen)
}

/// A test CA and a server config whose leaf covers allowed.test, other.test and denied.test.
pub fn test_pki() -> (String, Arc<rustls::ServerConfig>) {
    use rcgen::{
        BasicConstraints, CertificateParams, DnType, IsCa, Issuer, KeyPair, KeyUsagePurpose,
    };
    let ca_key = KeyPair::generate().unwrap();
    let mut ca = CertificateParams::new(Vec::<String>::new()).unwrap();
    ca.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    ca.key_usages = vec![
        KeyUsagePurpose::KeyCertSign,
        KeyUsagePurpose::CrlSign,
        KeyUsagePurpose::DigitalSignature,
    ];
    ca.distinguished_name
        .push(DnType::CommonName, "tryboxi e2e test CA");
    let ca_cert = ca.self_signed(&ca_key).unwrap();
    let issuer = Issuer::new(ca, ca_key);
    let leaf_key = KeyPair::generate().unwrap();
    let leaf = CertificateParams::new(vec![
        "allowed.test".to_owned(),
        "other.test".to_owned(),
        "denied.test".to_owned(),
    ])
    .unwrap()
    .signed_by(&leaf_key, &issuer)
    .unwrap();
    let key = rustls::pki_types::PrivateKeyDer::Pkcs8(leaf_key.serialize_der().into());
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let cfg = rustls::ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_no_client_auth()
        .with_single_cert(vec![leaf.der().clone()], key)
        .unwrap();
    (ca_cert.pem(), Arc::new(cfg))
}

// The fake upstream resolver.

pub const BLOCKED_V4: [&str; 6] = [
    "127.0.0.1",
    "10.1.2.3",
    "172.16.5.4",
    "192.168.1.1",
    "100.64.0.1",
    "169.254.169.254",
];
const BLOCKED_V6: [&str; 4] = ["::1", "fc00::1", "fe80::1", "::ffff:127.0.0.1"];

fn fake_answer(name: &str, aaaa: bool) -> Option<Vec<IpAddr>> {
    let ips = |list: &[&str]| list.iter().map(|s| s.parse().unwrap()).collect::<Vec<_>>();
    let blocked = if aaaa {
        ips(&BLOCKED_V6)
    } else {
        ips(&BLOCKED_V4)
    };
    match name {
        "all.rebind.test" => Some(blocked),
        "mixed.rebind.test" => {
            let public: IpAddr = if aaaa { "2001:db8::20" } else { "203.0.113.20" }
                .parse()
                .unwrap();
            let mut v = blocked;
            v.insert(2, public);
            Some(v)
        }
        n if n.ends_with(".evil.test") => Some(if aaaa {
            ips(&["::1"])
        } else {
            ips(&["127.0.0.1"])
        }),
        _ => None,
    }
}

/// UDP on 127.0.0.1; logs every question as `name/TYPE`.
pub fn fake_dns() -> (SocketAddr, Arc<Mutex<Vec<String>>>) {
    use hickory_proto::op::{Message, MessageType, OpCode, ResponseCode};
    use hickory_proto::rr::rdata::{A, AAAA};
    use hickory_proto::rr::{RData, Record, RecordType};
    let sock = UdpSocket::bind("127.0.0.1:0").unwrap();
    let addr = sock.local_addr().unwrap();
    let log = Arc::new(Mutex::new(Vec::new()));
    let seen = log.clone();
    std::thread::spawn(move || {
        let mut buf = [0u8; 4096];
        loop {
            let Ok((n, peer)) = sock.recv_from(&mut buf) else {
                return;
            };
            let Ok(q) = Message::from_vec(&buf[..n]) else {
                continue;
            };
            let [query] = q.queries() else { continue };
            let name = query.name().to_ascii();
            let name = name.trim_end_matches('.').to_ascii_lowercase();
            let aaaa = query.query_type() == RecordType::AAAA;
            seen.lock()
                .unwrap()
                .push(format!("{name}/{}", query.query_type()));
            let answer = fake_answer(&name, aaaa);
            let mut m = Message::new();
            m.set_id(q.id())
                .set_message_type(MessageType::Response)
                .set_op_code(OpCode::Query)
                .set_recursion_desired(true)
                .set_recursion_available(true)
                .set_response_code(match answer {
                    Some(_) => ResponseCode::NoError,
                    None => ResponseCode::NXDomain,
                });
            m.add_query(query.clone());
            for ip in answer.unwrap_or_default() {
                let data = match ip {
                    IpAddr::V4(v4) if !aaaa => RData::A(A(v4)),
                    IpAddr::V6(v6) if aaaa => RData::AAAA(AAAA(v6)),
                    _ => continue,
                };
                m.add_answer(Record::from_rdata(query.name().clone(), 60, data));
            }
            let _ = sock.send_to(&m.to_vec().unwrap(), peer);
        }
    });
    (addr, log)
}
