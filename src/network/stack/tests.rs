//! The stack against a fake guest: a second smoltcp interface (10.0.2.15) talking the same
//! frame protocol over a socket pair, and real upstream servers on 127.0.0.1.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures_util::future::BoxFuture;
use smoltcp::iface::{Config, Interface, SocketHandle, SocketSet};
use smoltcp::socket::{tcp, udp};
use smoltcp::time::Instant;
use smoltcp::wire::{EthernetAddress, HardwareAddress, IpAddress, IpCidr, IpEndpoint, Ipv4Address};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, UnixStream};

use super::engine::Engine;
use super::frames::{FrameDevice, FrameReader};
use super::{GUEST_MAC, StackConfig, StackStats};
use crate::network::gate::*;

/// A gate for tests only: allows the destinations in `allow` (mapped to local upstreams),
/// denies everything else, records every event.
#[derive(Default)]
pub(super) struct TestGate {
    allow: Mutex<Vec<(SocketAddr, SocketAddr, Inspect)>>,
    events: Mutex<Vec<FlowEvent>>,
    inspected: AtomicUsize,
    dns_queries: AtomicUsize,
    /// What [`Gate::upstream_proxy`] answers.
    pub(super) proxy: Mutex<Option<Arc<crate::network::upstream_proxy::UpstreamProxy>>>,
}

impl TestGate {
    pub(super) fn allow(&self, dst: &str, upstream: SocketAddr, inspect: Inspect) {
        self.allow
            .lock()
            .unwrap()
            .push((dst.parse().unwrap(), upstream, inspect));
    }
    pub(super) fn events(&self) -> Vec<FlowEvent> {
        self.events.lock().unwrap().clone()
    }
}

impl Gate for TestGate {
    fn connect(&self, flow: &Flow) -> ConnectVerdict {
        match self.allow.lock().unwrap().iter().find(|a| a.0 == flow.dst) {
            Some(&(_, upstream, inspect)) => ConnectVerdict::Allow {
                upstream,
                inspect,
                rule: "test".into(),
            },
            None => ConnectVerdict::Deny {
                reason: "not in the test allowlist".into(),
            },
        }
    }
    fn inspect(&self, _: &Flow, first: &[u8]) -> InspectVerdict {
        self.inspected.fetch_add(1, Ordering::Relaxed);
        if first.len() < 4 {
            InspectVerdict::NeedMore
        } else if first.starts_with(b"TAKE") {
            InspectVerdict::Intercept {
                rule: "take".into(),
                host: Some("take.test".into()),
                handler: Handoff(Arc::new(|mut guest, mut up, _dial| {
                    Box::pin(async move {
                        // Prove both ends: the guest's bytes (held ones first) go through the
                        // upstream socket the stack connected, and come back tagged.
                        let mut buf = vec![0u8; 64];
                        let n = guest.read(&mut buf).await.unwrap();
                        up.write_all(&buf[..n]).await.unwrap();
                        let mut echo = vec![0u8; n];
                        up.read_exact(&mut echo).await.unwrap();
                        guest.write_all(b"HANDLED:").await.unwrap();
                        guest.write_all(&echo).await.unwrap();
                    })
                })),
            }
        } else if first.starts_with(b"GOOD") {
            InspectVerdict::Allow {
                rule: "good".into(),
                host: Some("good.test".into()),
            }
        } else {
            InspectVerdict::Deny {
                reason: "bad first bytes".into(),
                host: Some("bad.test".into()),
            }
        }
    }
    fn dns(&self, mut query: Vec<u8>) -> BoxFuture<'static, Option<Vec<u8>>> {
        // "Answer": the query with the response bit set.
        self.dns_queries.fetch_add(1, Ordering::Relaxed);
        if query.len() > 2 {
            query[2] |= 0x80;
        }
        Box::pin(async move { Some(query) })
    }
    fn record(&self, event: FlowEvent) {
        self.events.lock().unwrap().push(event);
    }
    fn upstream_proxy(&self) -> Option<Arc<crate::network::upstream_proxy::UpstreamProxy>> {
        self.proxy.lock().unwrap().clone()
    }
}

pub(super) struct Guest {
    iface: Interface,
    sockets: SocketSet<'static>,
    dev: FrameDevice,
    sock: UnixStream,
    reader: FrameReader,
    epoch: std::time::Instant,
    next_port: u16,
}

impl Guest {
    pub(super) fn new(sock: UnixStream) -> Guest {
        let mut dev = FrameDevice::default();
        let cfg = Config::new(HardwareAddress::Ethernet(EthernetAddress(GUEST_MAC)));
        let mut iface = Interface::new(cfg, &mut dev, Instant::from_micros(0));
        iface.update_ip_addrs(|a| {
            a.push(IpCidr::new(IpAddress::Ipv4(GUEST_V4), 24)).unwrap();
        });
        iface
            .routes_mut()
            .add_default_ipv4_route(GATEWAY_V4)
            .unwrap();
        Guest {
            iface,
            sockets: SocketSet::new(Vec::new()),
            dev,
            sock,
            reader: FrameReader::default(),
            epoch: std::time::Instant::now(),
            next_port: 40000,
        }
    }

    fn now(&self) -> Instant {
        Instant::from_micros(self.epoch.elapsed().as_micros() as i64)
    }

    pub(super) fn tcp(&mut self, dst: &str, rx: usize) -> SocketHandle {
        let dst: SocketAddr = dst.parse().unwrap();
        let mut s = tcp::Socket::new(
            tcp::SocketBuffer::new(vec![0; rx]),
            tcp::SocketBuffer::new(vec![0; 64 * 1024]),
        );
        let SocketAddr::V4(d) = dst else { panic!() };
        self.next_port += 1;
        s.connect(
            self.iface.context(),
            IpEndpoint::new(IpAddress::Ipv4(*d.ip()), d.port()),
            self.next_port,
        )
        .unwrap();
        self.sockets.add(s)
    }

    /// A socket listening on the guest's `port` (one connection each).
    pub(super) fn listen(&mut self, port: u16) -> SocketHandle {
        let mut s = tcp::Socket::new(
            tcp::SocketBuffer::new(vec![0; 64 * 1024]),
            tcp::SocketBuffer::new(vec![0; 64 * 1024]),
        );
        s.listen(port).unwrap();
        self.sockets.add(s)
    }

    pub(super) fn t(&mut self, h: SocketHandle) -> &mut tcp::Socket<'static> {
        self.sockets.get_mut::<tcp::Socket>(h)
    }

    /// One round: poll, send our frames, take the stack's frames (waiting briefly).
    pub(super) async fn turn(&mut self) {
        let now = self.now();
        self.iface.poll(now, &mut self.dev, &mut self.sockets);
        if !self.dev.tx.is_empty() {
            let out = self.dev.tx.split();
            self.sock.write_all(&out).await.unwrap();
        }
        let mut buf = vec![0u8; 256 * 1024];
        if let Ok(Ok(n)) =
            tokio::time::timeout(Duration::from_millis(2), self.sock.read(&mut buf)).await
        {
            assert!(n > 0, "the stack closed the socket");
            self.reader.spare(n).extend_from_slice(&buf[..n]);
            while let Some(f) = self.reader.next_frame().unwrap() {
                self.dev.rx.push_back(f);
            }
        }
        let now = self.now();
        self.iface.poll(now, &mut self.dev, &mut self.sockets);
    }

    pub(super) async fn until(&mut self, what: &str, mut cond: impl FnMut(&mut Guest) -> bool) {
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        while !cond(self) {
            assert!(std::time::Instant::now() < deadline, "timed out: {what}");
            self.turn().await;
        }
    }
}

pub(super) fn start(gate: Arc<TestGate>, cfg: StackConfig) -> (Guest, Arc<StackStats>) {
    let (a, b) = UnixStream::pair().unwrap();
    let stats = Arc::new(StackStats::default());
    tokio::spawn(Engine::new(gate, cfg, stats.clone()).run(a));
    (Guest::new(b), stats)
}

/// An upstream that echoes what it reads and counts it.
pub(super) async fn echo_server() -> (SocketAddr, Arc<AtomicU64>) {
    let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap();
    let got = Arc::new(AtomicU64::new(0));
    let g = got.clone();
    tokio::spawn(async move {
        loop {
            let Ok((mut s, _)) = l.accept().await else {
                return;
            };
            let g = g.clone();
            tokio::spawn(async move {
                let mut buf = vec![0u8; 4096];
                loop {
                    match s.read(&mut buf).await {
                        Ok(0) | Err(_) => return,
                        Ok(n) => {
                            g.fetch_add(n as u64, Ordering::Relaxed);
                            if s.write_all(&buf[..n]).await.is_err() {
                                return;
                            }
                        }
                    }
                }
            });
        }
    });
    (addr, got)
}

pub(super) fn refused_port() -> SocketAddr {
    // Bind and drop: nothing listens there right after.
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    l.local_addr().unwrap()
}

#[tokio::test]
async fn denied_syn_is_reset_at_once_and_recorded() {
    let gate = Arc::new(TestGate::default());
    let (mut g, _) = start(gate.clone(), StackConfig::default());
    let h = g.tcp("203.0.113.9:80", 4096);
    let t0 = std::time::Instant::now();
    let mut seen_established = false;
    g.until("the denied connect to end", |g| {
        seen_established |= g.t(h).state() == tcp::State::Established;
        g.t(h).state() == tcp::State::Closed
    })
    .await;
    assert!(!seen_established);
    assert!(t0.elapsed() < Duration::from_secs(2), "{:?}", t0.elapsed());
    let ev = gate.events();
    assert!(
        matches!(&ev[..], [FlowEvent::Denied { flow, .. }] if flow.dst == "203.0.113.9:80".parse().unwrap()),
        "{ev:?}"
    );
}

#[tokio::test]
async fn allowed_but_refused_upstream_resets_and_never_looks_open() {
    let gate = Arc::new(TestGate::default());
    gate.allow("198.51.100.1:80", refused_port(), Inspect::Nothing);
    let (mut g, stats) = start(gate.clone(), StackConfig::default());
    let h = g.tcp("198.51.100.1:80", 4096);
    let mut seen_established = false;
    g.until("the connect to fail", |g| {
        seen_established |= g.t(h).state() == tcp::State::Established;
        g.t(h).state() == tcp::State::Closed
    })
    .await;
    assert!(!seen_established, "the guest saw an open connection");
    assert!(
        gate.events()
            .iter()
            .any(|e| matches!(e, FlowEvent::UpstreamFailed { .. })),
        "{:?}",
        gate.events()
    );
    g.until("the flow to be forgotten", |_| stats.flows() == 0)
        .await;
}

#[tokio::test]
async fn allowed_flow_relays_both_ways_and_records_bytes() {
    let gate = Arc::new(TestGate::default());
    let (up, got) = echo_server().await;
    gate.allow("198.51.100.2:8080", up, Inspect::Nothing);
    let (mut g, stats) = start(gate.clone(), StackConfig::default());
    let h = g.tcp("198.51.100.2:8080", 64 * 1024);
    g.until("established", |g| g.t(h).state() == tcp::State::Established)
        .await;
    let msg: Vec<u8> = (0..100_000u32).map(|i| (i % 251) as u8).collect();
    let mut sent = 0;
    let mut back = Vec::new();
    g.until("the echo", |g| {
        let s = g.t(h);
        if sent < msg.len() && s.can_send() {
            sent += s.send_slice(&msg[sent..]).unwrap();
        }
        while s.can_recv() {
            s.recv(|b| {
                back.extend_from_slice(b);
                (b.len(), ())
            })
            .unwrap();
        }
        back.len() == msg.len()
    })
    .await;
    assert_eq!(back, msg);
    assert_eq!(got.load(Ordering::Relaxed), msg.len() as u64);
    g.t(h).close();
    g.until("closed", |g| {
        matches!(g.t(h).state(), tcp::State::Closed | tcp::State::TimeWait) && stats.flows() == 0
    })
    .await;
    let ev = gate.events();
    assert!(
        matches!(&ev[0], FlowEvent::Allowed { rule, .. } if rule == "test"),
        "{ev:?}"
    );
    assert!(
        ev.iter().any(
            |e| matches!(e, FlowEvent::Closed { bytes_up, bytes_down, .. }
            if *bytes_up == msg.len() as u64 && *bytes_down == msg.len() as u64)
        ),
        "{ev:?}"
    );
}

#[tokio::test]
async fn inspected_flow_forwards_nothing_until_allowed() {
    let gate = Arc::new(TestGate::default());
    let (up, got) = echo_server().await;
    gate.allow("198.51.100.3:443", up, Inspect::TlsSni);
    let (mut g, _) = start(gate.clone(), StackConfig::default());
    // Denied by its first bytes: RST, and the upstream never saw a byte.
    let bad = g.tcp("198.51.100.3:443", 4096);
    g.until("established", |g| {
        g.t(bad).state() == tcp::State::Established
    })
    .await;
    g.t(bad).send_slice(b"BA").unwrap();
    g.until("need more", |_| gate.inspected.load(Ordering::Relaxed) >= 1)
        .await;
    g.t(bad).send_slice(b"D request").unwrap();
    g.until("reset", |g| g.t(bad).state() == tcp::State::Closed)
        .await;
    assert_eq!(
        got.load(Ordering::Relaxed),
        0,
        "bytes of a denied flow went upstream"
    );
    assert!(
        gate.events()
            .iter()
            .any(|e| matches!(e, FlowEvent::Denied { reason, host, .. }
                if reason == "bad first bytes" && host.as_deref() == Some("bad.test")))
    );
    // Allowed by its first bytes: relayed from the first byte on.
    let good = g.tcp("198.51.100.3:443", 4096);
    g.until("established", |g| {
        g.t(good).state() == tcp::State::Established
    })
    .await;
    g.t(good).send_slice(b"GOOD hello").unwrap();
    let mut back = Vec::new();
    g.until("echo", |g| {
        let s = g.t(good);
        while s.can_recv() {
            s.recv(|b| {
                back.extend_from_slice(b);
                (b.len(), ())
            })
            .unwrap();
        }
        back.len() == 10
    })
    .await;
    assert_eq!(back, b"GOOD hello");
    // The events name what the first bytes showed.
    assert!(gate.events().iter().any(
        |e| matches!(e, FlowEvent::Allowed { host, .. } if host.as_deref() == Some("good.test"))
    ));
}

#[tokio::test]
async fn an_intercepted_flow_is_handed_to_its_handler_with_the_upstream() {
    let gate = Arc::new(TestGate::default());
    let (up, got) = echo_server().await;
    gate.allow("198.51.100.4:443", up, Inspect::TlsSni);
    let (mut g, _) = start(gate.clone(), StackConfig::default());
    let h = g.tcp("198.51.100.4:443", 4096);
    g.until("established", |g| g.t(h).state() == tcp::State::Established)
        .await;
    g.t(h).send_slice(b"TAKE me").unwrap();
    let mut back = Vec::new();
    g.until("handled", |g| {
        let s = g.t(h);
        while s.can_recv() {
            s.recv(|b| {
                back.extend_from_slice(b);
                (b.len(), ())
            })
            .unwrap();
        }
        back.len() >= 15
    })
    .await;
    assert_eq!(back, b"HANDLED:TAKE me");
    assert_eq!(got.load(Ordering::Relaxed), 7);
    assert!(gate.events().iter().any(
        |e| matches!(e, FlowEvent::Allowed { host, rule, .. } if host.as_deref() == Some("take.test") && rule == "take")
    ));
}

#[tokio::test]
async fn inspection_gives_up_at_the_cap() {
    let gate = Arc::new(TestGate::default());
    let (up, got) = echo_server().await;
    gate.allow("198.51.100.3:80", up, Inspect::HttpHost);
    struct Undecided(Arc<TestGate>);
    impl Gate for Undecided {
        fn connect(&self, f: &Flow) -> ConnectVerdict {
            self.0.connect(f)
        }
        fn inspect(&self, _: &Flow, _: &[u8]) -> InspectVerdict {
            InspectVerdict::NeedMore
        }
        fn dns(&self, q: Vec<u8>) -> BoxFuture<'static, Option<Vec<u8>>> {
            self.0.dns(q)
        }
        fn record(&self, e: FlowEvent) {
            self.0.record(e)
        }
    }
    let cfg = StackConfig {
        inspect_cap: 1000,
        ..StackConfig::default()
    };
    let (a, b) = UnixStream::pair().unwrap();
    tokio::spawn(Engine::new(Arc::new(Undecided(gate.clone())), cfg, Default::default()).run(a));
    let mut g = Guest::new(b);
    let h = g.tcp("198.51.100.3:80", 4096);
    g.until("established", |g| g.t(h).state() == tcp::State::Established)
        .await;
    g.t(h).send_slice(&[b'x'; 3000]).unwrap();
    g.until("reset", |g| g.t(h).state() == tcp::State::Closed)
        .await;
    assert_eq!(got.load(Ordering::Relaxed), 0);
}

#[tokio::test]
async fn a_guest_that_never_reads_throttles_the_upstream() {
    let gate = Arc::new(TestGate::default());
    let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let up = l.local_addr().unwrap();
    let written = Arc::new(AtomicU64::new(0));
    let w = written.clone();
    tokio::spawn(async move {
        let (mut s, _) = l.accept().await.unwrap();
        // Keep the kernel's buffers small so what is measured is the stack's buffering.
        let chunk = vec![7u8; 64 * 1024];
        loop {
            match s.write(&chunk).await {
                Ok(n) => {
                    w.fetch_add(n as u64, Ordering::Relaxed);
                }
                Err(_) => return,
            }
        }
    });
    gate.allow("198.51.100.4:9000", up, Inspect::Nothing);
    let (mut g, _) = start(gate.clone(), StackConfig::default());
    let h = g.tcp("198.51.100.4:9000", 4096);
    g.until("established", |g| g.t(h).state() == tcp::State::Established)
        .await;
    // The guest never reads. The upstream must stall: what it wrote stops growing.
    let mut last = 0;
    let mut stable = 0;
    g.until("the upstream to stall", |_| {
        let now = written.load(Ordering::Relaxed);
        stable = if now == last { stable + 1 } else { 0 };
        last = now;
        stable > 200
    })
    .await;
    // smoltcp buffer + channel chunks + the kernel's socket buffers on loopback.
    assert!(last < 32 * 1024 * 1024, "upstream wrote {last} bytes");
    let queued = g.t(h).recv_queue();
    assert!(queued <= 4096, "{queued}");
}

#[tokio::test]
async fn udp_only_reaches_the_resolver() {
    let gate = Arc::new(TestGate::default());
    let (mut g, _) = start(gate.clone(), StackConfig::default());
    let mut s = udp::Socket::new(
        udp::PacketBuffer::new(vec![udp::PacketMetadata::EMPTY; 8], vec![0; 8192]),
        udp::PacketBuffer::new(vec![udp::PacketMetadata::EMPTY; 8], vec![0; 8192]),
    );
    s.bind(5353).unwrap();
    let h = g.sockets.add(s);
    let query = b"\x12\x34\x01\x00\x00\x01\x00\x00\x00\x00\x00\x00\x01a\x00\x00\x01\x00\x01";
    let resolver = IpEndpoint::new(IpAddress::Ipv4(GATEWAY_V4), 53);
    let elsewhere = IpEndpoint::new(IpAddress::Ipv4(Ipv4Address::new(192, 0, 2, 53)), 53);
    let quic = IpEndpoint::new(IpAddress::Ipv4(Ipv4Address::new(192, 0, 2, 1)), 443);
    {
        let s = g.sockets.get_mut::<udp::Socket>(h);
        s.send_slice(query, elsewhere).unwrap();
        s.send_slice(b"quic", quic).unwrap();
        s.send_slice(query, resolver).unwrap();
    }
    let mut answers = Vec::new();
    g.until("the DNS answer", |g| {
        let s = g.sockets.get_mut::<udp::Socket>(h);
        while let Ok((data, meta)) = s.recv() {
            answers.push((data.to_vec(), meta.endpoint));
        }
        !answers.is_empty()
    })
    .await;
    // Give a stray answer from elsewhere time to show up.
    for _ in 0..50 {
        g.turn().await;
    }
    let s = g.sockets.get_mut::<udp::Socket>(h);
    while let Ok((data, meta)) = s.recv() {
        answers.push((data.to_vec(), meta.endpoint));
    }
    assert_eq!(answers.len(), 1, "{answers:?}");
    assert_eq!(answers[0].1, resolver);
    assert_eq!(answers[0].0[2] & 0x80, 0x80);
    let ev = gate.events();
    assert!(
        ev.iter()
            .any(|e| matches!(e, FlowEvent::Denied { flow, reason, .. }
        if flow.proto == Proto::Udp && flow.dst.port() == 443 && reason.contains("QUIC")))
    );
    assert!(ev.iter().any(|e| matches!(e, FlowEvent::Denied { flow, .. }
        if flow.proto == Proto::Udp && flow.dst == "192.0.2.53:53".parse().unwrap())));
}

#[tokio::test]
async fn gateway_answers_dns_over_tcp_and_refuses_other_ports() {
    let gate = Arc::new(TestGate::default());
    let (mut g, _) = start(gate.clone(), StackConfig::default());
    let ssh = g.tcp("10.0.2.2:22", 4096);
    g.until("reset", |g| g.t(ssh).state() == tcp::State::Closed)
        .await;
    let h = g.tcp("10.0.2.2:53", 4096);
    g.until("established", |g| g.t(h).state() == tcp::State::Established)
        .await;
    let q = b"\xab\xcd\x01\x00\x00\x01\x00\x00\x00\x00\x00\x00\x01b\x00\x00\x01\x00\x01";
    let mut framed = (q.len() as u16).to_be_bytes().to_vec();
    framed.extend_from_slice(q);
    g.t(h).send_slice(&framed).unwrap();
    let mut back = Vec::new();
    g.until("the answer", |g| {
        let s = g.t(h);
        while s.can_recv() {
            s.recv(|b| {
                back.extend_from_slice(b);
                (b.len(), ())
            })
            .unwrap();
        }
        back.len() == framed.len()
    })
    .await;
    assert_eq!(&back[..4], &[0, q.len() as u8, 0xab, 0xcd]);
    assert_eq!(back[4] & 0x80, 0x80);
}

#[tokio::test]
async fn dns_over_tcp_stops_reading_queries_while_the_guest_leaves_answers_unread() {
    let gate = Arc::new(TestGate::default());
    let cfg = StackConfig::default();
    let tcp_buffer = cfg.tcp_buffer;
    let (mut g, _) = start(gate.clone(), cfg);
    // A guest that asks and asks over one connection and never reads: a 4 KiB receive buffer
    // it never empties.
    let guest_rx = 4096;
    let h = g.tcp("10.0.2.2:53", guest_rx);
    g.until("established", |g| g.t(h).state() == tcp::State::Established)
        .await;
    let mut q = vec![0u8; 1000];
    q[..4].copy_from_slice(&[0xab, 0xcd, 0x01, 0x00]);
    let mut framed = (q.len() as u16).to_be_bytes().to_vec();
    framed.extend_from_slice(&q);
    let total = 2000;
    let (mut sent, mut stalled) = (0usize, 0);
    // Until every query went out (the stack reads without limit) or the guest's own send
    // buffer stays full for 300 turns (the stack stopped reading).
    g.until("all queries sent or the guest blocked", |g| {
        let s = g.t(h);
        let before = sent;
        while sent < total * framed.len() && s.can_send() {
            let off = sent % framed.len();
            let n = s.send_slice(&framed[off..]).unwrap();
            if n == 0 {
                break;
            }
            sent += n;
        }
        stalled = if sent == before { stalled + 1 } else { 0 };
        sent == total * framed.len() || stalled >= 300
    })
    .await;
    let answered = gate.dns_queries.load(Ordering::Relaxed);
    // What the stack may hold: the guest's window, its own send buffer and the pending cap,
    // plus the queries in flight.
    let bound = (guest_rx + tcp_buffer + super::dns::DNS_TCP_PENDING_MAX) / framed.len()
        + super::dns::DNS_TCP_INFLIGHT_PER_FLOW;
    assert!(
        answered <= bound,
        "{answered} of {total} queries answered for a guest that reads nothing (bound {bound})"
    );
    assert!(answered > 0);
    // Reading again releases the held answers and the stack reads queries again.
    let mut back = 0usize;
    g.until("more answers after reading", |g| {
        let s = g.t(h);
        while s.can_recv() {
            back += s.recv(|b| (b.len(), b.len())).unwrap();
        }
        gate.dns_queries.load(Ordering::Relaxed) > answered
    })
    .await;
    assert!(back > 0);
}

#[tokio::test]
async fn flows_past_the_limit_are_reset() {
    let gate = Arc::new(TestGate::default());
    let (up, _) = echo_server().await;
    gate.allow("198.51.100.5:80", up, Inspect::Nothing);
    let cfg = StackConfig {
        max_flows: 2,
        ..StackConfig::default()
    };
    let (mut g, _) = start(gate.clone(), cfg);
    let a = g.tcp("198.51.100.5:80", 4096);
    let b = g.tcp("198.51.100.5:80", 4096);
    g.until("two open", |g| {
        g.t(a).state() == tcp::State::Established && g.t(b).state() == tcp::State::Established
    })
    .await;
    let c = g.tcp("198.51.100.5:80", 4096);
    g.until("the third reset", |g| g.t(c).state() == tcp::State::Closed)
        .await;
    assert!(gate.events().iter().any(
        |e| matches!(e, FlowEvent::Denied { reason, .. } if reason.contains("connections at once"))
    ));
}

#[tokio::test]
async fn listening_socket_takes_a_new_qemu_after_a_disconnect() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("net.sock");
    let gate = Arc::new(TestGate::default());
    let (up, _) = echo_server().await;
    gate.allow("198.51.100.6:80", up, Inspect::Nothing);
    let stack = super::NetStack::listen(&path, gate.clone(), StackConfig::default()).unwrap();
    for round in 1..=2 {
        let mut g = Guest::new(UnixStream::connect(&path).await.unwrap());
        let h = g.tcp("198.51.100.6:80", 4096);
        g.until("established", |g| g.t(h).state() == tcp::State::Established)
            .await;
        assert_eq!(stack.stats().attaches(), round);
    }
}

#[test]
fn ipv6_icmp_and_spoofed_frames_never_reach_smoltcp() {
    use super::classify::{Class, classify};
    let mut f = vec![0u8; 14 + 40];
    f[12..14].copy_from_slice(&[0x86, 0xdd]);
    assert_eq!(classify(&f), Class::Drop("ipv6"));
    // IPv4 header: version/IHL, total length 28, TTL, protocol, src, dst.
    let ip = |proto: u8, src: [u8; 4]| {
        let mut f = vec![0u8; 14 + 28];
        f[12..14].copy_from_slice(&[0x08, 0x00]);
        f[14] = 0x45;
        f[16..18].copy_from_slice(&28u16.to_be_bytes());
        f[22] = 64;
        f[23] = proto;
        f[26..30].copy_from_slice(&src);
        f[30..34].copy_from_slice(&[192, 0, 2, 1]);
        f[38..40].copy_from_slice(&8u16.to_be_bytes());
        f
    };
    assert_eq!(classify(&ip(1, [10, 0, 2, 15])), Class::Drop("icmp"));
    assert_eq!(
        classify(&ip(17, [10, 0, 2, 99])),
        Class::Drop("ipv4 source is not the guest")
    );
    assert!(matches!(
        classify(&ip(17, [10, 0, 2, 15])),
        Class::Udp { .. }
    ));
}

#[test]
fn guest_agent_qemu_and_stack_agree_on_addresses() {
    assert_eq!(crate::guest::net::ADDR, GUEST_V4);
    assert_eq!(crate::guest::net::GATEWAY, GATEWAY_V4);
    let mask = u32::from(crate::guest::net::NETMASK);
    assert_eq!(mask.count_ones(), u32::from(PREFIX_LEN_V4));
    let mac: Vec<String> = GUEST_MAC.iter().map(|b| format!("{b:02x}")).collect();
    assert_eq!(mac.join(":"), crate::vmm::qemu::NIC_MAC);
}

#[tokio::test]
async fn slow_upstream_keeps_the_guest_waiting_then_resets() {
    // A listener whose accept queue is full: the kernel drops further SYNs, so a connect hangs.
    let sock = tokio::net::TcpSocket::new_v4().unwrap();
    sock.bind("127.0.0.1:0".parse().unwrap()).unwrap();
    let l = sock.listen(0).unwrap();
    let up = l.local_addr().unwrap();
    let mut fillers = Vec::new();
    for _ in 0..4 {
        if let Ok(Ok(s)) = tokio::time::timeout(
            Duration::from_millis(300),
            tokio::net::TcpStream::connect(up),
        )
        .await
        {
            fillers.push(s);
        }
    }
    let gate = Arc::new(TestGate::default());
    gate.allow("198.51.100.7:80", up, Inspect::Nothing);
    let cfg = StackConfig {
        connect_timeout: Duration::from_millis(1500),
        ..StackConfig::default()
    };
    let (mut g, _) = start(gate.clone(), cfg);
    let t0 = std::time::Instant::now();
    let h = g.tcp("198.51.100.7:80", 4096);
    let mut seen_established = false;
    g.until("the reset after the connect timeout", |g| {
        seen_established |= g.t(h).state() == tcp::State::Established;
        g.t(h).state() == tcp::State::Closed
    })
    .await;
    assert!(!seen_established, "the guest saw an open connection");
    assert!(
        t0.elapsed() >= Duration::from_millis(1400),
        "{:?}",
        t0.elapsed()
    );
    assert!(gate.events().iter().any(
        |e| matches!(e, FlowEvent::UpstreamFailed { error, .. } if error.contains("no answer"))
    ));
    drop((l, fillers));
}

/// A restored guest knows the gateway's MAC and does not ARP; the stack must not make it run
/// its ARP path either: the first frame it sends a guest whose first frame is a SYN to a
/// denied address is the reset, addressed to the guest's MAC, not an ARP request.
#[tokio::test]
async fn the_first_answer_to_a_silent_guest_needs_no_arp() {
    use smoltcp::phy::ChecksumCapabilities;
    use smoltcp::wire::{
        EthernetFrame, EthernetProtocol, EthernetRepr, IpProtocol, Ipv4Packet, Ipv4Repr,
        TcpControl, TcpPacket, TcpRepr, TcpSeqNumber,
    };
    let gate = Arc::new(TestGate::default());
    let (a, mut qemu) = UnixStream::pair().unwrap();
    tokio::spawn(
        Engine::new(
            gate.clone(),
            StackConfig::default(),
            Arc::new(StackStats::default()),
        )
        .run(a),
    );
    let dst = Ipv4Address::new(203, 0, 113, 9);
    let tcp = TcpRepr {
        src_port: 40000,
        dst_port: 80,
        control: TcpControl::Syn,
        seq_number: TcpSeqNumber(1000),
        ack_number: None,
        window_len: 64240,
        window_scale: None,
        max_seg_size: Some(1460),
        sack_permitted: false,
        sack_ranges: [None, None, None],
        timestamp: None,
        payload: &[],
    };
    let ip = Ipv4Repr {
        src_addr: GUEST_V4,
        dst_addr: dst,
        next_header: IpProtocol::Tcp,
        payload_len: tcp.header_len(),
        hop_limit: 64,
    };
    let eth = EthernetRepr {
        src_addr: EthernetAddress(GUEST_MAC),
        dst_addr: EthernetAddress(super::GATEWAY_MAC),
        ethertype: EthernetProtocol::Ipv4,
    };
    let mut frame = vec![0u8; eth.buffer_len() + ip.buffer_len() + tcp.header_len()];
    let caps = ChecksumCapabilities::default();
    let mut e = EthernetFrame::new_unchecked(&mut frame[..]);
    eth.emit(&mut e);
    let mut p = Ipv4Packet::new_unchecked(e.payload_mut());
    ip.emit(&mut p, &caps);
    tcp.emit(
        &mut TcpPacket::new_unchecked(p.payload_mut()),
        &GUEST_V4.into(),
        &dst.into(),
        &caps,
    );
    qemu.write_all(&(frame.len() as u32).to_be_bytes())
        .await
        .unwrap();
    qemu.write_all(&frame).await.unwrap();
    let mut len = [0u8; 4];
    tokio::time::timeout(Duration::from_secs(10), qemu.read_exact(&mut len))
        .await
        .expect("no answer from the stack")
        .unwrap();
    let mut first = vec![0u8; u32::from_be_bytes(len) as usize];
    qemu.read_exact(&mut first).await.unwrap();
    let e = EthernetFrame::new_checked(&first[..]).unwrap();
    assert_eq!(e.ethertype(), EthernetProtocol::Ipv4, "{e}");
    assert_eq!(e.dst_addr(), EthernetAddress(GUEST_MAC));
    let p = Ipv4Packet::new_checked(e.payload()).unwrap();
    let t = TcpPacket::new_checked(p.payload()).unwrap();
    assert!(t.rst() && t.dst_port() == 40000, "{t}");
}
