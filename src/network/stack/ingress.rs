//! Connections *into* the guest (port exposure: `tryboxi port`, the E2B face's proxy). The
//! stack opens a TCP connection from the gateway address (`10.0.2.2`, an ephemeral port) to a
//! guest port and hands the caller one end of an in-memory pipe; the engine relays the other
//! end with the same bounded buffers as an egress flow ([`super::flow`]). The caller gets the
//! pipe only once the guest completed the handshake; a guest RST is
//! [`IngressError::Refused`] ("port is not open"). Ingress only: the guest cannot use these
//! connections to reach anything (they end in the caller's pipe, never at a host socket the
//! gate did not allow), and nothing here changes the egress policy.
//!
//! Bounded: at most [`super::StackConfig::max_ingress`] ingress connections per VM (on top of
//! the flow limit they also count against), [`QUEUE`] requests waiting for the engine.

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use smoltcp::socket::tcp;
use smoltcp::wire::{IpAddress, IpEndpoint, IpListenEndpoint};
use tokio::io::DuplexStream;
use tokio::sync::{Notify, mpsc, oneshot};

use super::engine::{Engine, relay_step};
use super::flow::{CHUNK, Phase, TcpFlow};
use crate::network::gate::{Flow, GATEWAY_V4, GUEST_V4, Proto};

/// Connection requests waiting for the engine; more are refused as [`IngressError::TooMany`].
pub const QUEUE: usize = 64;
/// The gateway ports ingress connections come from (the guest sees `10.0.2.2:<port>`).
const LOCAL_PORTS: std::ops::RangeInclusive<u16> = 32768..=60999;

#[derive(Debug, thiserror::Error)]
pub enum IngressError {
    /// The guest answered with a RST: nothing listens on that port. The phrase "port is not
    /// open" is what the E2B SDK looks for in a 502 body.
    #[error("port is not open: nothing in the sandbox accepts connections on port {0}")]
    Refused(u16),
    /// No answer in time (a guest that drops the SYN, or a VM that does not run): to the
    /// client it is as unreachable as a refused port, hence the same phrase.
    #[error("port is not open: port {port} in the sandbox did not answer within {secs} s")]
    Timeout { port: u16, secs: u64 },
    #[error("too many connections into the sandbox at once (at most {0})")]
    TooMany(usize),
    #[error("the sandbox's network is not attached (its VM is not running)")]
    NotAttached,
    #[error("port 0 cannot be connected to")]
    BadPort,
}

/// Where the engine answers a connection request.
pub type Reply = oneshot::Sender<Result<DuplexStream, IngressError>>;

/// A request to the engine: connect to the guest's `port`, answer on `reply`.
pub struct IngressRequest {
    pub port: u16,
    pub reply: Reply,
}

/// Where connection requests go: the engine of the VM's current QEMU connection (replaced on
/// every new connection: boot, restore, resume, daemon restart). Cheap to clone.
#[derive(Clone, Default)]
pub struct Ingress {
    current: Arc<Mutex<Option<mpsc::Sender<IngressRequest>>>>,
}

impl Ingress {
    pub(super) fn set(&self, tx: mpsc::Sender<IngressRequest>) {
        *self.current.lock().unwrap_or_else(|p| p.into_inner()) = Some(tx);
    }

    /// A connection to the guest's `port`, once the guest accepted it (within `timeout`).
    pub async fn connect(
        &self,
        port: u16,
        timeout: Duration,
    ) -> Result<DuplexStream, IngressError> {
        if port == 0 {
            return Err(IngressError::BadPort);
        }
        let tx = (self.current.lock().unwrap_or_else(|p| p.into_inner()))
            .clone()
            .ok_or(IngressError::NotAttached)?;
        let (reply, rx) = oneshot::channel();
        tx.try_send(IngressRequest { port, reply })
            .map_err(|e| match e {
                mpsc::error::TrySendError::Full(_) => IngressError::TooMany(QUEUE),
                mpsc::error::TrySendError::Closed(_) => IngressError::NotAttached,
            })?;
        // On a timeout `rx` is dropped: the engine sees it and aborts the half-open socket.
        match tokio::time::timeout(timeout, rx).await {
            Ok(Ok(r)) => r,
            Ok(Err(_)) => Err(IngressError::NotAttached),
            Err(_) => Err(IngressError::Timeout {
                port,
                secs: timeout.as_secs(),
            }),
        }
    }
}

impl Engine {
    /// Start a connection from the gateway to the guest (SYN sent at the next poll).
    pub(super) fn ingress(&mut self, req: IngressRequest) {
        if req.reply.is_closed() {
            return;
        }
        let open = self.flows.values().filter(|f| f.phase.is_ingress()).count();
        if open >= self.cfg.max_ingress || self.flows.len() >= self.cfg.max_flows {
            let _ = req
                .reply
                .send(Err(IngressError::TooMany(self.cfg.max_ingress)));
            return;
        }
        let guest = SocketAddr::from((GUEST_V4, req.port));
        let Some(local) = self.free_local_port(guest) else {
            let _ = req
                .reply
                .send(Err(IngressError::TooMany(LOCAL_PORTS.len())));
            return;
        };
        let gw = SocketAddr::from((GATEWAY_V4, local));
        let n = self.cfg.tcp_buffer;
        let mut s = tcp::Socket::new(
            tcp::SocketBuffer::new(vec![0; n]),
            tcp::SocketBuffer::new(vec![0; n]),
        );
        s.set_nagle_enabled(false);
        let remote = IpEndpoint::new(IpAddress::Ipv4(GUEST_V4), req.port);
        let from = IpListenEndpoint {
            addr: Some(IpAddress::Ipv4(GATEWAY_V4)),
            port: local,
        };
        if let Err(e) = s.connect(self.iface.context(), remote, from) {
            tracing::warn!(port = req.port, error = %e, "cannot open a connection into the guest");
            let _ = req.reply.send(Err(IngressError::NotAttached));
            return;
        }
        let handle = self.sockets.add(s);
        let id = self.new_flow_id();
        // Keyed like a guest flow (guest side first), so the tables stay one.
        let flow = Flow {
            proto: Proto::Tcp,
            src: guest,
            dst: gw,
        };
        let mut f = TcpFlow::new(handle, flow, id, Phase::IngressConnecting);
        f.ingress_reply = Some(req.reply);
        self.flows.insert((guest, gw), f);
        tracing::debug!(port = req.port, local, "connecting into the guest");
    }

    /// A gateway port no flow to `guest` uses now.
    fn free_local_port(&mut self, guest: SocketAddr) -> Option<u16> {
        for _ in 0..LOCAL_PORTS.len() {
            let p = self.next_local_port;
            self.next_local_port = if p >= *LOCAL_PORTS.end() {
                *LOCAL_PORTS.start()
            } else {
                p + 1
            };
            if !self
                .flows
                .contains_key(&(guest, SocketAddr::from((GATEWAY_V4, p))))
            {
                return Some(p);
            }
        }
        None
    }
}

/// An ingress connection waiting for the guest's answer: established -> the caller gets its
/// pipe and relaying starts; the caller gave up -> the socket is aborted. (A guest RST closes
/// the socket; the flow's removal answers [`IngressError::Refused`].)
pub(super) fn connecting_step(f: &mut TcpFlow, s: &mut tcp::Socket, wake: &Arc<Notify>) {
    let Some(reply) = f.ingress_reply.take() else {
        return;
    };
    match s.state() {
        tcp::State::SynSent | tcp::State::SynReceived if !reply.is_closed() => {
            f.ingress_reply = Some(reply);
        }
        tcp::State::Established => {
            let (ours, theirs) = tokio::io::duplex(2 * CHUNK);
            if reply.send(Ok(theirs)).is_ok() {
                f.attach_io(ours, wake.clone());
                f.phase = Phase::Ingress;
                relay_step(f, s);
            } else {
                s.abort();
            }
        }
        tcp::State::SynSent | tcp::State::SynReceived => s.abort(),
        _ => {
            let _ = reply.send(Err(IngressError::Refused(f.flow.src.port())));
            s.abort();
        }
    }
}
