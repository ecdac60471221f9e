//! The per-VM userspace network stack: the packet side of the egress network.
//!
//! Owns: one listening unix socket per VM (`<vm dir>/net.sock`, QEMU's `-netdev stream` connects
//! to it), the Ethernet frames on it, a smoltcp [`Interface`](smoltcp::iface::Interface) that
//! plays the gateway `10.0.2.2`, the guest's TCP flows (connect-before-accept, relayed to real
//! upstream sockets with bounded buffers) and its DNS queries (handed to the [`Gate`]).
//! Never: decides policy (every TCP SYN goes through [`Gate::connect`], every first payload of an
//! inspected flow through [`Gate::inspect`]); forwards a byte upstream before the gate allowed
//! it; answers a guest handshake before the upstream connect succeeded; relays UDP other than
//! DNS to the gateway, ICMP or IPv6.
//!
//! Files: `frames.rs` (the length-prefixed frame codec and the smoltcp device), `classify.rs`
//! (looks at each guest frame before smoltcp does), `engine.rs` (the event loop), `flow.rs`
//! (one TCP flow and its upstream tasks), `inspect.rs` (a flow's first bytes, its upstream
//! connection directly or through the explicit upstream proxy), `dns.rs` (DNS over UDP and TCP to the gateway),
//! `ingress.rs` (connections into the guest from the gateway: port exposure).
//! The design is written down in docs/NETWORK.md.
//!
//! [`Gate`]: super::gate::Gate
//! [`Gate::connect`]: super::gate::Gate::connect
//! [`Gate::inspect`]: super::gate::Gate::inspect

mod classify;
mod dns;
mod engine;
mod flow;
mod frames;
#[cfg(any(test, fuzzing))]
pub mod fuzzing;
pub mod ingress;
#[cfg(test)]
mod ingress_tests;
mod inspect;
#[cfg(test)]
mod proxy_tests;
#[cfg(test)]
mod tests;

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use super::gate::SharedGate;

/// The gateway's MAC address (locally administered). Stable across daemon restarts, so a
/// guest's ARP cache stays right when the stack comes back.
pub const GATEWAY_MAC: [u8; 6] = [0x52, 0x54, 0x00, 0x0a, 0x00, 0x02];
/// The MAC address QEMU gives the guest's NIC.
pub const GUEST_MAC: [u8; 6] = [0x52, 0x54, 0x00, 0x0a, 0x00, 0x0f];

/// Limits of one VM's stack.
#[derive(Debug, Clone)]
pub struct StackConfig {
    /// TCP flows (connecting, open or closing) at once; SYNs past it get a RST.
    pub max_flows: usize,
    /// How long an upstream connect may take before the guest gets a RST.
    pub connect_timeout: Duration,
    /// Bytes of a flow's first payload buffered for [`Gate::inspect`](super::gate::Gate::inspect);
    /// a flow that has not been decided by then is denied.
    pub inspect_cap: usize,
    /// smoltcp receive and send buffer of each guest TCP connection (each direction).
    pub tcp_buffer: usize,
    /// DNS queries being answered at once; more are dropped (the guest retries).
    pub max_dns_inflight: usize,
    /// Connections into the guest ([`ingress`]) at once; more are refused.
    pub max_ingress: usize,
}

impl Default for StackConfig {
    fn default() -> Self {
        StackConfig {
            max_flows: 512,
            connect_timeout: Duration::from_secs(10),
            inspect_cap: 16 * 1024,
            tcp_buffer: 64 * 1024,
            max_dns_inflight: 64,
            max_ingress: 256,
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum StackError {
    #[error("cannot listen on the network socket {path}: {source}")]
    Listen {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
}

/// Live counters of one stack (tests and metrics read them).
#[derive(Debug, Default)]
pub struct StackStats {
    /// TCP flows in the table right now.
    pub flows: AtomicUsize,
    /// Connections QEMU made to the socket so far.
    pub attaches: AtomicUsize,
}

#[cfg(test)]
impl StackStats {
    pub fn flows(&self) -> usize {
        self.flows.load(Ordering::Relaxed)
    }
    pub fn attaches(&self) -> usize {
        self.attaches.load(Ordering::Relaxed)
    }
}

/// One VM's network stack. Dropping it stops the stack and every relayed connection.
pub struct NetStack {
    // Read by the tests (the accept loop has its own handle).
    #[cfg_attr(not(test), allow(dead_code))]
    stats: Arc<StackStats>,
    ingress: ingress::Ingress,
    task: tokio::task::JoinHandle<()>,
}

impl NetStack {
    /// Listen on `path` (replacing a stale socket file) and serve whichever QEMU connects; a
    /// new connection (a restarted or restored QEMU) replaces the previous one with a fresh
    /// stack. The socket exists when this returns, so QEMU can be started right after.
    pub fn listen(path: &Path, gate: SharedGate, cfg: StackConfig) -> Result<NetStack, StackError> {
        let err = |source| StackError::Listen {
            path: path.to_owned(),
            source,
        };
        match std::fs::remove_file(path) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => return Err(err(e)),
        }
        let listener = tokio::net::UnixListener::bind(path).map_err(err)?;
        let stats = Arc::new(StackStats::default());
        let ingress = ingress::Ingress::default();
        let task = tokio::spawn(accept_loop(
            listener,
            gate,
            cfg,
            (stats.clone(), ingress.clone()),
            path.to_owned(),
        ));
        Ok(NetStack {
            stats,
            ingress,
            task,
        })
    }

    #[cfg(test)]
    pub fn stats(&self) -> &Arc<StackStats> {
        &self.stats
    }

    /// Connections into the guest, through whichever QEMU connection is current.
    pub fn ingress(&self) -> &ingress::Ingress {
        &self.ingress
    }
}

impl Drop for NetStack {
    fn drop(&mut self) {
        self.task.abort();
    }
}

async fn accept_loop(
    listener: tokio::net::UnixListener,
    gate: SharedGate,
    cfg: StackConfig,
    (stats, ingress): (Arc<StackStats>, ingress::Ingress),
    path: PathBuf,
) {
    // The engine of the current connection; aborting it drops every flow it relays.
    let mut current: Option<AbortOnDrop> = None;
    loop {
        let stream = match listener.accept().await {
            Ok((s, _)) => s,
            Err(e) => {
                tracing::warn!(socket = %path.display(), error = %e, "network socket accept failed");
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
        };
        // Dropping the old engine aborts it.
        drop(current.take());
        stats.attaches.fetch_add(1, Ordering::Relaxed);
        tracing::debug!(socket = %path.display(), "VM NIC attached to the network stack");
        let engine = engine::Engine::new(gate.clone(), cfg.clone(), stats.clone());
        ingress.set(engine.ingress_sender());
        current = Some(AbortOnDrop(tokio::spawn(engine.run(stream))));
    }
}

/// A task that is aborted when its handle goes (a plain `JoinHandle` detaches instead).
pub(super) struct AbortOnDrop(pub tokio::task::JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}
