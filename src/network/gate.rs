//! The contract between the userspace stack and the egress policy.
//!
//! The stack (packets, TCP state, relaying) knows nothing about names or rules; the policy
//! side knows nothing about packets. For every guest flow the stack asks the [`Gate`]:
//!
//! 1. [`Gate::connect`] when a TCP SYN (or the first UDP datagram of a flow) arrives, *before*
//!    anything is answered to the guest. `Deny` -> the guest gets a RST / ICMP unreachable at
//!    once. `Allow` -> the stack connects to `upstream`; only if that connect succeeds does it
//!    complete the guest's handshake (connect-before-accept), else RST.
//! 2. [`Gate::inspect`] with the first bytes the guest sends on an allowed TCP flow whose verdict
//!    asked for inspection (TLS ClientHello SNI on :443, HTTP Host on :80). Nothing is forwarded
//!    upstream until it returns `Allow`; `Deny` -> RST to the guest, upstream closed.
//! 3. [`Gate::dns`] for every DNS query the guest sends to the sandbox resolver address
//!    (UDP or TCP port 53 on [`GATEWAY_V4`]); the answer bytes go back to the guest verbatim.
//! 4. [`Gate::record`] once per flow outcome, for events and metrics.
//!
//! When [`Gate::upstream_proxy`] gives a proxy, the stack's upstream connection goes to the
//! proxy instead: at SYN time a TCP connection to the proxy (so a dead proxy is still a RST
//! before the guest's handshake), and `CONNECT <name the gate allowed>:<port>` once
//! [`Gate::inspect`] allowed the name (flows without inspection: `CONNECT <ip>:<port>` at once).
//!
//! An inspected flow the gate allows may instead be handed off ([`InspectVerdict::Intercept`]):
//! the stack then relays the guest's bytes (the held first bytes included) to the handler over
//! an in-memory pipe and gives it the already-connected upstream socket, instead of splicing the
//! two (the TLS-terminating interceptor of `network::intercept`).
//!
//! Decisions (1, 2) are synchronous and use only in-memory state (rules, DNS pins), so the
//! stack can call them from its event loop. DNS (3) is async: it may ask an upstream resolver.

use std::net::{Ipv4Addr, SocketAddr};
use std::sync::Arc;

use futures_util::future::BoxFuture;

use super::upstream_proxy::{Dial, UpstreamProxy};

pub const PREFIX_LEN_V4: u8 = 24;
/// The gateway; also the sandbox's DNS resolver. Nothing else on it answers.
pub const GATEWAY_V4: Ipv4Addr = Ipv4Addr::new(10, 0, 2, 2);
/// The guest's own address.
pub const GUEST_V4: Ipv4Addr = Ipv4Addr::new(10, 0, 2, 15);

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Proto {
    Tcp,
    Udp,
}

/// One guest flow: `dst` is the address the guest asked for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Flow {
    pub proto: Proto,
    pub src: SocketAddr,
    pub dst: SocketAddr,
}

/// What the first bytes of a TCP flow must show before anything goes upstream.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Inspect {
    /// Forward at once (CIDR rules on other ports).
    Nothing,
    /// A TLS ClientHello whose SNI the policy allows for this destination.
    TlsSni,
    /// An HTTP/1 request whose Host the policy allows for this destination.
    HttpHost,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ConnectVerdict {
    Allow {
        /// Where the stack connects. Normally `flow.dst`; test configurations may map it.
        upstream: SocketAddr,
        inspect: Inspect,
        /// The rule that allowed it (for events).
        rule: String,
    },
    Deny {
        reason: String,
    },
}

/// The handler of an intercepted flow: `(guest side of the pipe, connected upstream socket (a
/// tunnel when the flow goes through the upstream proxy), how to open more like it)`.
pub type HandoffFn = dyn Fn(tokio::io::DuplexStream, tokio::net::TcpStream, Dial) -> BoxFuture<'static, ()>
    + Send
    + Sync;

/// A flow handler (compared by identity).
#[derive(Clone)]
pub struct Handoff(pub Arc<HandoffFn>);

impl std::fmt::Debug for Handoff {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Handoff")
    }
}

impl PartialEq for Handoff {
    fn eq(&self, other: &Self) -> bool {
        Arc::ptr_eq(&self.0, &other.0)
    }
}

impl Eq for Handoff {}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum InspectVerdict {
    /// Not enough bytes yet to decide; call again with more (the stack caps how much it buffers
    /// and treats a flow that exceeds the cap as `Deny`).
    NeedMore,
    Allow {
        rule: String,
        /// The name the first bytes showed (SNI or Host), for events.
        host: Option<String>,
    },
    Deny {
        reason: String,
        /// The name the first bytes showed, if any: the one the guest tried to reach (the
        /// destination's pinned names may be others).
        host: Option<String>,
    },
    /// Allowed, and handed to `handler` instead of being spliced to the upstream socket.
    Intercept {
        rule: String,
        host: Option<String>,
        handler: Handoff,
    },
}

/// A flow's outcome, reported once per flow.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum FlowEvent {
    Allowed {
        flow: Flow,
        host: Option<String>,
        rule: String,
    },
    Denied {
        flow: Flow,
        host: Option<String>,
        reason: String,
    },
    /// Allowed by policy but the upstream connect failed (refused, unreachable, timeout).
    UpstreamFailed { flow: Flow, error: String },
    Closed {
        flow: Flow,
        bytes_up: u64,
        bytes_down: u64,
    },
}

/// The policy side of one sandbox's network. Shared by the stack's tasks.
pub trait Gate: Send + Sync + 'static {
    fn connect(&self, flow: &Flow) -> ConnectVerdict;
    fn inspect(&self, flow: &Flow, first_bytes: &[u8]) -> InspectVerdict;
    /// A DNS query message from the guest; returns the response message, or `None` to drop it.
    fn dns(&self, query: Vec<u8>) -> BoxFuture<'static, Option<Vec<u8>>>;
    fn record(&self, event: FlowEvent);
    /// The explicit upstream proxy allowed flows go through (unless its no-proxy list or
    /// loopback exempts them), if the daemon has one.
    fn upstream_proxy(&self) -> Option<Arc<UpstreamProxy>> {
        None
    }
}

pub type SharedGate = Arc<dyn Gate>;
