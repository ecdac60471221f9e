//! The event loop of one VM's stack: reads guest frames from QEMU, classifies them, drives the
//! smoltcp interface, moves bytes between smoltcp sockets and the flows' channels, and writes
//! frames back. It sleeps until something happens: the socket is readable (or writable while
//! frames wait), an upstream connect or DNS answer arrives, a flow task made progress, or
//! smoltcp's own timer (`poll_delay`) fires. No fixed polling interval.

use std::collections::{HashMap, HashSet};
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use bytes::Bytes;
use smoltcp::iface::{Config, Interface, SocketHandle, SocketSet};
use smoltcp::socket::{tcp, udp};
use smoltcp::time::Instant;
use smoltcp::wire::{EthernetAddress, HardwareAddress, IpAddress, IpCidr, IpListenEndpoint};
use tokio::net::{TcpStream, UnixStream};
use tokio::sync::{Notify, mpsc};

use super::classify::{Class, classify};
use super::flow::{CHUNK, Down, Phase, TcpFlow};
use super::frames::{FrameDevice, FrameReader};
use super::ingress::{IngressError, IngressRequest};
use super::{AbortOnDrop, GATEWAY_MAC, GUEST_MAC, StackConfig, StackStats};
use crate::network::gate::{
    ConnectVerdict, Flow, FlowEvent, GATEWAY_V4, Inspect, PREFIX_LEN_V4, Proto, SharedGate,
};
use crate::network::upstream_proxy::{Dial, UpstreamProxy};

pub(super) type Key = (SocketAddr, SocketAddr);

/// How long a DNS answer may take before the query is dropped (the guest retries).
const DNS_TIMEOUT: Duration = Duration::from_secs(5);
pub(super) fn dns_timeout() -> Duration {
    DNS_TIMEOUT
}

/// Largest DNS message over UDP we send back: one unfragmented datagram.
pub(super) const DNS_UDP_MAX: usize = 1500 - 20 - 8;
/// Distinct denied UDP flows remembered, so a flood records one event per flow, not per packet.
pub(super) const UDP_DENIED_MEMORY: usize = 1024;

/// Results that tasks send back to the loop.
pub(super) enum Event {
    /// The SYN-time connection: to the upstream, or to the proxy (then `Some(proxy)` while the
    /// `CONNECT` waits for the gate's inspection).
    Connected {
        key: Key,
        id: u64,
        result: Result<(TcpStream, SocketAddr, Option<Arc<UpstreamProxy>>), String>,
    },
    /// An inspected flow's tunnel through the proxy (or its direct connection, for a name the
    /// no-proxy list exempts) after the gate allowed it.
    Tunneled {
        key: Key,
        id: u64,
        result: Result<(TcpStream, Dial), String>,
    },
    DnsUdp {
        reply: Option<Vec<u8>>,
        to: smoltcp::wire::IpEndpoint,
    },
    DnsTcp {
        key: Key,
        id: u64,
        reply: Option<Vec<u8>>,
    },
}

/// Why the loop woke up.
enum Woke {
    Readable(std::io::Result<()>),
    Writable(std::io::Result<()>),
    Event(Event),
    Ingress(IngressRequest),
    Other,
}

pub(super) struct Engine {
    pub(super) gate: SharedGate,
    pub(super) cfg: StackConfig,
    stats: Arc<StackStats>,
    pub(super) dev: FrameDevice,
    pub(super) iface: Interface,
    pub(super) sockets: SocketSet<'static>,
    pub(super) flows: HashMap<Key, TcpFlow>,
    next_id: u64,
    pub(super) dns_udp: SocketHandle,
    pub(super) dns_inflight: usize,
    pub(super) events_tx: mpsc::UnboundedSender<Event>,
    events_rx: mpsc::UnboundedReceiver<Event>,
    pub(super) wake: Arc<Notify>,
    epoch: std::time::Instant,
    udp_denied: HashSet<Flow>,
    ingress_tx: mpsc::Sender<IngressRequest>,
    ingress_rx: mpsc::Receiver<IngressRequest>,
    pub(super) next_local_port: u16,
}

impl Engine {
    pub fn new(gate: SharedGate, cfg: StackConfig, stats: Arc<StackStats>) -> Engine {
        let mut seed = [0u8; 8];
        let _ = getrandom::fill(&mut seed);
        Engine::with_seed(gate, cfg, stats, u64::from_le_bytes(seed))
    }

    /// An engine whose smoltcp randomness (TCP initial sequence numbers, IP ids) comes from
    /// `seed`: the fuzz target uses a fixed one, so a saved input that completes a handshake
    /// replays the same way.
    pub(super) fn with_seed(
        gate: SharedGate,
        cfg: StackConfig,
        stats: Arc<StackStats>,
        seed: u64,
    ) -> Engine {
        let mut dev = FrameDevice::default();
        let mut config = Config::new(HardwareAddress::Ethernet(EthernetAddress(GATEWAY_MAC)));
        config.random_seed = seed;
        let epoch = std::time::Instant::now();
        let mut iface = Interface::new(config, &mut dev, Instant::from_micros(0));
        iface.update_ip_addrs(|a| {
            let _ = a.push(IpCidr::new(IpAddress::Ipv4(GATEWAY_V4), PREFIX_LEN_V4));
        });
        // Accept packets for every destination: the guest's "internet" is this interface.
        iface.set_any_ip(true);
        let _ = iface.routes_mut().add_default_ipv4_route(GATEWAY_V4);
        let mut sockets = SocketSet::new(Vec::new());
        let mut dns = udp::Socket::new(
            udp::PacketBuffer::new(vec![udp::PacketMetadata::EMPTY; 32], vec![0; 64 * 1024]),
            udp::PacketBuffer::new(vec![udp::PacketMetadata::EMPTY; 32], vec![0; 64 * 1024]),
        );
        dns.bind(IpListenEndpoint {
            addr: Some(IpAddress::Ipv4(GATEWAY_V4)),
            port: 53,
        })
        .expect("binding a fresh UDP socket to a fixed endpoint cannot fail");
        let dns_udp = sockets.add(dns);
        let (events_tx, events_rx) = mpsc::unbounded_channel();
        let (ingress_tx, ingress_rx) = mpsc::channel(super::ingress::QUEUE);
        Engine {
            gate,
            cfg,
            stats,
            dev,
            iface,
            sockets,
            flows: HashMap::new(),
            next_id: 0,
            dns_udp,
            dns_inflight: 0,
            events_tx,
            events_rx,
            wake: Arc::new(Notify::new()),
            epoch,
            udp_denied: HashSet::new(),
            ingress_tx,
            ingress_rx,
            next_local_port: 32768 + (seed % 28000) as u16,
        }
    }

    /// Where connection requests into the guest go ([`super::ingress::Ingress`]).
    pub(super) fn ingress_sender(&self) -> mpsc::Sender<IngressRequest> {
        self.ingress_tx.clone()
    }

    pub(super) fn new_flow_id(&mut self) -> u64 {
        self.next_id += 1;
        self.next_id
    }

    pub(super) fn now(&self) -> Instant {
        Instant::from_micros(self.epoch.elapsed().as_micros() as i64)
    }

    /// Serve one QEMU connection until it closes.
    pub async fn run(mut self, stream: UnixStream) {
        let mut reader = FrameReader::default();
        // After a daemon restart or a restore the guest still knows the gateway's MAC and will
        // not ARP for it, while this fresh interface does not know the guest's: learn it at
        // once, so the first answer (even a RST) does not wait for an ARP round trip.
        self.learn_guest();
        loop {
            self.step();
            if !self.dev.tx.is_empty() {
                match stream.try_write(&self.dev.tx) {
                    Ok(n) => self.dev.written(n),
                    Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
                    Err(e) => {
                        tracing::debug!(error = %e, "network socket write failed; detaching");
                        return;
                    }
                }
            }
            let read_ok = self.dev.accepts_input();
            let write_wait = !self.dev.tx.is_empty();
            // While frames wait for the socket, smoltcp may want to send "now" forever; the
            // writable wake-up covers that case.
            let delay = if write_wait {
                None
            } else {
                let now = self.now();
                self.iface.poll_delay(now, &self.sockets)
            }
            .map(|d| Duration::from_micros(d.total_micros()))
            .unwrap_or(Duration::from_secs(3600));
            let woke = tokio::select! {
                r = stream.readable(), if read_ok => Woke::Readable(r),
                r = stream.writable(), if write_wait => Woke::Writable(r),
                Some(ev) = self.events_rx.recv() => Woke::Event(ev),
                Some(req) = self.ingress_rx.recv() => Woke::Ingress(req),
                _ = self.wake.notified() => Woke::Other,
                _ = tokio::time::sleep(delay) => Woke::Other,
            };
            match woke {
                Woke::Readable(Err(_)) | Woke::Writable(Err(_)) => return,
                Woke::Readable(Ok(())) => match stream.try_read_buf(reader.spare(64 * 1024)) {
                    Ok(0) => {
                        tracing::debug!("QEMU closed the network socket");
                        return;
                    }
                    Ok(_) => loop {
                        match reader.next_frame() {
                            Ok(Some(f)) => self.ingest(f),
                            Ok(None) => break,
                            Err(e) => {
                                tracing::warn!(error = %e, "detaching the network socket");
                                return;
                            }
                        }
                    },
                    Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
                    Err(e) => {
                        tracing::debug!(error = %e, "network socket read failed; detaching");
                        return;
                    }
                },
                Woke::Writable(Ok(())) | Woke::Other => {}
                Woke::Event(ev) => self.handle_event(ev),
                Woke::Ingress(req) => self.ingress(req),
            }
        }
    }

    /// Teach the interface the guest's MAC without asking the guest: an ARP reply "the guest's
    /// address is at [`GUEST_MAC`]" (the MAC QEMU's command line gives its NIC) goes into the
    /// receive queue as if the guest had sent it. Asking instead (an ARP request on every QEMU
    /// connection) made every restored or forked guest run its ARP path before its first
    /// answer, ~300 blocks of kernel code to translate under TCG. A guest that changed its MAC
    /// is learned again from its own ARP traffic (smoltcp fills its cache from every ARP packet
    /// aimed at the gateway, and Linux revalidates its gateway entry by ARP).
    pub(super) fn learn_guest(&mut self) {
        use smoltcp::wire::{ArpOperation, ArpPacket, ArpRepr, EthernetFrame, EthernetProtocol};
        let arp = ArpRepr::EthernetIpv4 {
            operation: ArpOperation::Reply,
            source_hardware_addr: EthernetAddress(GUEST_MAC),
            source_protocol_addr: crate::network::gate::GUEST_V4,
            target_hardware_addr: EthernetAddress(GATEWAY_MAC),
            target_protocol_addr: GATEWAY_V4,
        };
        let mut frame = vec![0u8; 14 + arp.buffer_len()];
        let mut eth = EthernetFrame::new_unchecked(&mut frame[..]);
        eth.set_src_addr(EthernetAddress(GUEST_MAC));
        eth.set_dst_addr(EthernetAddress(GATEWAY_MAC));
        eth.set_ethertype(EthernetProtocol::Arp);
        arp.emit(&mut ArpPacket::new_unchecked(eth.payload_mut()));
        self.dev.rx.push_back(frame);
    }

    /// Let smoltcp process input and timers, move bytes for every flow, let smoltcp send, and
    /// forget finished flows.
    pub(super) fn step(&mut self) {
        let now = self.now();
        self.iface.poll(now, &mut self.dev, &mut self.sockets);
        self.service_dns_udp();
        let keys: Vec<Key> = self.flows.keys().copied().collect();
        for k in &keys {
            self.service_flow(k);
        }
        let now = self.now();
        self.iface.poll(now, &mut self.dev, &mut self.sockets);
        self.reap();
        self.stats.flows.store(self.flows.len(), Ordering::Relaxed);
    }

    /// One frame from the guest.
    pub(super) fn ingest(&mut self, frame: Vec<u8>) {
        match classify(&frame) {
            Class::Drop(why) => tracing::trace!(why, "dropped a guest frame"),
            Class::Arp => self.dev.rx.push_back(frame),
            Class::Udp { src, dst } => {
                if dst != dns_endpoint() {
                    self.deny_udp(src, dst);
                }
                // To the resolver: its socket takes it. Anything else: no socket matches and
                // smoltcp answers ICMP port unreachable, so the guest fails fast.
                self.dev.rx.push_back(frame);
            }
            Class::Tcp {
                src,
                dst,
                syn: true,
            } => self.syn(src, dst, frame),
            // Segments of existing flows; smoltcp resets anything it has no socket for.
            Class::Tcp { syn: false, .. } => self.dev.rx.push_back(frame),
        }
    }

    fn deny_udp(&mut self, src: SocketAddr, dst: SocketAddr) {
        let flow = Flow {
            proto: Proto::Udp,
            src,
            dst,
        };
        if self.udp_denied.len() >= UDP_DENIED_MEMORY {
            self.udp_denied.clear();
        }
        if self.udp_denied.insert(flow) {
            let reason = if dst.port() == 443 {
                "QUIC (UDP 443) is blocked".to_owned()
            } else {
                format!("UDP is allowed only for DNS to {}", dns_endpoint())
            };
            self.gate.record(FlowEvent::Denied {
                flow,
                host: None,
                reason,
            });
        }
    }

    /// A guest connection request: decide it before anything is answered.
    fn syn(&mut self, src: SocketAddr, dst: SocketAddr, frame: Vec<u8>) {
        let key = (src, dst);
        if let Some(f) = self.flows.get(&key) {
            let st = self.sockets.get::<tcp::Socket>(f.handle).state();
            if !matches!(st, tcp::State::TimeWait | tcp::State::Closed) {
                // A retransmitted SYN: smoltcp knows the connection (and stays quiet while
                // the upstream connect runs).
                self.dev.rx.push_back(frame);
                return;
            }
            self.remove_flow(&key);
        }
        let flow = Flow {
            proto: Proto::Tcp,
            src,
            dst,
        };
        let deny = |this: &mut Engine, reason: String, frame: Vec<u8>| {
            this.gate.record(FlowEvent::Denied {
                flow,
                host: None,
                reason,
            });
            // No socket listens for it: smoltcp answers the SYN with a RST.
            this.dev.rx.push_back(frame);
        };
        if self.flows.len() >= self.cfg.max_flows {
            let reason = format!("more than {} connections at once", self.cfg.max_flows);
            return deny(self, reason, frame);
        }
        if dst.ip() == std::net::IpAddr::V4(GATEWAY_V4) {
            if dst.port() == 53 {
                self.open_socket(flow, frame, Phase::Dns);
            } else {
                let reason = format!("the gateway {GATEWAY_V4} only answers DNS on port 53");
                deny(self, reason, frame);
            }
            return;
        }
        match self.gate.connect(&flow) {
            ConnectVerdict::Deny { reason } => deny(self, reason, frame),
            ConnectVerdict::Allow {
                upstream,
                inspect,
                rule,
            } => {
                let Some(id) = self.open_socket(flow, frame, Phase::Connecting) else {
                    return;
                };
                let tx = self.events_tx.clone();
                let timeout = self.cfg.connect_timeout;
                let proxy = self.gate.upstream_proxy();
                let task = tokio::spawn(async move {
                    let result = super::inspect::first_connect(upstream, inspect, proxy, timeout)
                        .await
                        .map(|(s, via)| (s, upstream, via));
                    let _ = tx.send(Event::Connected { key, id, result });
                });
                if let Some(f) = self.flows.get_mut(&key) {
                    f.inspect = inspect;
                    f.rule = rule;
                    f.tasks.push(AbortOnDrop(task));
                }
            }
        }
    }

    /// Create the flow's smoltcp socket and hand it the SYN at once, while it is the only
    /// listening socket for that endpoint (so it cannot take another flow's SYN).
    fn open_socket(&mut self, flow: Flow, frame: Vec<u8>, phase: Phase) -> Option<u64> {
        let n = self.cfg.tcp_buffer;
        let mut s = tcp::Socket::new(
            tcp::SocketBuffer::new(vec![0; n]),
            tcp::SocketBuffer::new(vec![0; n]),
        );
        s.listen(IpListenEndpoint {
            addr: Some(ip_of(flow.dst)),
            port: flow.dst.port(),
        })
        .ok()?;
        s.set_nagle_enabled(false);
        // Connect-before-accept: no SYN-ACK until the upstream answered.
        s.pause_synack(phase == Phase::Connecting);
        let handle = self.sockets.add(s);
        self.dev.rx.push_back(frame);
        let now = self.now();
        self.iface.poll(now, &mut self.dev, &mut self.sockets);
        let s = self.sockets.get_mut::<tcp::Socket>(handle);
        let remote = s.remote_endpoint().map(|e| (e.addr, e.port));
        if s.state() != tcp::State::SynReceived
            || remote != Some((ip_of(flow.src), flow.src.port()))
        {
            // The SYN did not land (bad checksum...): never leave a listening socket behind.
            s.abort();
            self.sockets.remove(handle);
            return None;
        }
        let id = self.new_flow_id();
        self.flows
            .insert((flow.src, flow.dst), TcpFlow::new(handle, flow, id, phase));
        Some(id)
    }

    /// Handle every result the tasks sent so far (the fuzz target's stand-in for the loop's
    /// wake-ups); returns how many there were.
    #[cfg(any(test, fuzzing))]
    pub(super) fn pump_events(&mut self) -> usize {
        let mut n = 0;
        while let Ok(ev) = self.events_rx.try_recv() {
            self.handle_event(ev);
            n += 1;
        }
        n
    }

    /// Distinct denied UDP flows remembered (bounded by `UDP_DENIED_MEMORY`).
    #[cfg(any(test, fuzzing))]
    pub(super) fn udp_denied_len(&self) -> usize {
        self.udp_denied.len()
    }

    pub(super) fn handle_event(&mut self, ev: Event) {
        match ev {
            Event::Connected { key, id, result } => self.connected(key, id, result),
            Event::Tunneled { key, id, result } => self.tunneled(key, id, result),
            Event::DnsUdp { reply, to } => self.dns_udp_reply(reply, to),
            Event::DnsTcp { key, id, reply } => self.dns_tcp_reply(key, id, reply),
        }
    }

    fn connected(
        &mut self,
        key: Key,
        id: u64,
        result: Result<(TcpStream, SocketAddr, Option<Arc<UpstreamProxy>>), String>,
    ) {
        let Some(f) = self.flows.get_mut(&key) else {
            return;
        };
        if f.id != id || f.phase != Phase::Connecting {
            return;
        }
        let s = self.sockets.get_mut::<tcp::Socket>(f.handle);
        match result {
            Ok((stream, addr, via)) if s.state() == tcp::State::SynReceived => {
                s.pause_synack(false);
                f.upstream_addr = Some(addr);
                if f.inspect == Inspect::Nothing {
                    f.attach(stream, self.wake.clone());
                    f.phase = Phase::Open;
                    f.allowed = true;
                    self.gate.record(FlowEvent::Allowed {
                        flow: f.flow,
                        host: None,
                        rule: f.rule.clone(),
                    });
                } else {
                    // Spliced, tunnelled or handed off once the gate has seen the first bytes.
                    f.upstream = Some(stream);
                    f.via_proxy = via;
                    f.phase = Phase::Inspecting;
                }
            }
            // The guest gave up meanwhile; the flow is reaped.
            Ok(_) => {}
            Err(error) => super::inspect::upstream_failed(f, s, &self.gate, error),
        }
    }

    fn tunneled(&mut self, key: Key, id: u64, result: Result<(TcpStream, Dial), String>) {
        let Some(f) = self.flows.get_mut(&key) else {
            return;
        };
        if f.id != id || f.phase != Phase::Tunneling {
            return;
        }
        let s = self.sockets.get_mut::<tcp::Socket>(f.handle);
        match result {
            Ok((stream, dial)) => super::inspect::open(f, s, &self.gate, &self.wake, stream, dial),
            Err(error) => super::inspect::upstream_failed(f, s, &self.gate, error),
        }
    }

    fn service_flow(&mut self, key: &Key) {
        let Some(f) = self.flows.get_mut(key) else {
            return;
        };
        let s = self.sockets.get_mut::<tcp::Socket>(f.handle);
        match f.phase {
            Phase::Connecting | Phase::Tunneling => {}
            Phase::Inspecting => {
                let ctx = super::inspect::Ctx {
                    gate: &self.gate,
                    wake: &self.wake,
                    events: &self.events_tx,
                    key: *key,
                    cap: self.cfg.inspect_cap,
                    timeout: self.cfg.connect_timeout,
                };
                super::inspect::inspect_step(f, s, &ctx)
            }
            Phase::Open | Phase::Ingress => relay_step(f, s),
            Phase::IngressConnecting => super::ingress::connecting_step(f, s, &self.wake),
            Phase::Dns => {
                let (gate, tx) = (self.gate.clone(), self.events_tx.clone());
                super::dns::tcp_step(
                    f,
                    s,
                    &gate,
                    &tx,
                    &mut self.dns_inflight,
                    self.cfg.max_dns_inflight,
                );
            }
        }
    }

    /// Forget flows whose socket is closed (after the RST, if any, went out).
    fn reap(&mut self) {
        let mut done = Vec::new();
        for (k, f) in self.flows.iter_mut() {
            let s = self.sockets.get::<tcp::Socket>(f.handle);
            let gone = match s.state() {
                // An aborted socket forgets its peer once its RST went out; give it one more
                // poll in case the device was full.
                tcp::State::Closed => s.remote_endpoint().is_none() || f.closed_seen,
                // Both sides closed; the guest's last bytes may still be on their way out
                // (smoltcp's TIME-WAIT timer bounds the wait: the socket is closed after it).
                tcp::State::TimeWait => f.drained(),
                _ => false,
            };
            if s.state() == tcp::State::Closed {
                f.closed_seen = true;
            }
            if gone {
                done.push(*k);
            }
        }
        for k in done {
            self.remove_flow(&k);
        }
    }

    fn remove_flow(&mut self, key: &Key) {
        if let Some(mut f) = self.flows.remove(key) {
            self.sockets.remove(f.handle);
            // A connection into the guest that closed before it was established: the guest
            // reset it (nothing listens there).
            if let Some(reply) = f.ingress_reply.take() {
                let _ = reply.send(Err(IngressError::Refused(f.flow.src.port())));
            }
            if f.allowed {
                self.gate.record(FlowEvent::Closed {
                    flow: f.flow,
                    bytes_up: f.bytes_up,
                    bytes_down: f.bytes_down,
                });
            }
            // Dropping `f` aborts its upstream tasks and closes the upstream socket.
        }
    }
}

/// Move bytes both ways as far as the buffers allow.
pub(super) fn relay_step(f: &mut TcpFlow, s: &mut tcp::Socket) {
    // Guest -> upstream: only as much as the channel takes; the rest stays in smoltcp's
    // receive buffer and the guest's window shrinks.
    if let Some(up) = &f.up {
        while s.can_recv() {
            match up.try_reserve() {
                Ok(permit) => {
                    let chunk = s.recv(|b| {
                        let n = b.len().min(CHUNK);
                        (n, Bytes::copy_from_slice(&b[..n]))
                    });
                    if let Ok(chunk) = chunk {
                        f.bytes_up += chunk.len() as u64;
                        permit.send(chunk);
                    }
                }
                Err(mpsc::error::TrySendError::Full(())) => break,
                Err(mpsc::error::TrySendError::Closed(())) => {
                    // The upstream write failed.
                    s.abort();
                    return;
                }
            }
        }
        if guest_finished(s) && s.recv_queue() == 0 {
            // The guest closed its side: the writer shuts down the upstream's write side.
            f.up = None;
        }
    }
    // Upstream -> guest: only as much as smoltcp's send buffer takes.
    loop {
        if f.pending_down.is_none() {
            let Some(down) = &mut f.down else { break };
            match down.try_recv() {
                Ok(Down::Data(b)) => f.pending_down = Some(b),
                Ok(Down::Reset) => {
                    s.abort();
                    return;
                }
                Err(mpsc::error::TryRecvError::Empty) => break,
                Err(mpsc::error::TryRecvError::Disconnected) => {
                    f.down = None;
                    f.down_eof = true;
                    break;
                }
            }
        }
        let Some(b) = f.pending_down.take() else {
            break;
        };
        if !s.can_send() {
            f.pending_down = Some(b);
            break;
        }
        let n = s.send_slice(&b).unwrap_or(0);
        f.bytes_down += n as u64;
        if n < b.len() {
            f.pending_down = Some(b.slice(n..));
            break;
        }
    }
    if f.down_eof && f.pending_down.is_none() && !f.closing {
        f.closing = true;
        s.close();
    }
}

/// The guest sent its FIN (or the connection is gone): it will send no more bytes.
/// (`may_recv` is also false before the handshake completes, so it cannot be used here.)
pub(super) fn guest_finished(s: &tcp::Socket) -> bool {
    use tcp::State::*;
    matches!(s.state(), CloseWait | LastAck | Closing | TimeWait | Closed)
}

fn ip_of(a: SocketAddr) -> IpAddress {
    match a {
        SocketAddr::V4(v4) => IpAddress::Ipv4(*v4.ip()),
        // Guest flows are IPv4 only (the classifier drops IPv6).
        SocketAddr::V6(_) => IpAddress::Ipv4(std::net::Ipv4Addr::UNSPECIFIED),
    }
}

pub(super) fn dns_endpoint() -> SocketAddr {
    SocketAddr::from((GATEWAY_V4, 53))
}
