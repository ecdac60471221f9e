//! One guest TCP flow: its smoltcp socket handle, where it is in connect-before-accept, and the
//! two upstream tasks with the bounded channels between them and the engine.
//!
//! Memory per flow is bounded: smoltcp's two socket buffers ([`super::StackConfig::tcp_buffer`])
//! plus [`CHANNEL_CHUNKS`] chunks of at most [`CHUNK`] bytes each way. When a side stops
//! reading, the channel fills, the engine stops moving bytes, and the other side's TCP window
//! closes (smoltcp's toward the guest, the kernel's toward the upstream).

use std::sync::Arc;

use bytes::Bytes;
use smoltcp::iface::SocketHandle;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::sync::{Notify, mpsc};

use super::AbortOnDrop;
use crate::network::gate::{Flow, Handoff, Inspect};
use crate::network::upstream_proxy::UpstreamProxy;

/// Largest piece moved through a channel.
pub const CHUNK: usize = 16 * 1024;
/// Chunks a channel holds in each direction.
pub const CHANNEL_CHUNKS: usize = 4;

/// What the upstream reader sends toward the guest.
#[derive(Debug)]
pub enum Down {
    Data(Bytes),
    /// The upstream connection failed (not a clean EOF): the guest gets a RST.
    Reset,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Phase {
    /// The guest's SYN is held (SYN-ACK paused) while the upstream connect runs.
    Connecting,
    /// Upstream connected; the guest's first bytes are being collected for the gate.
    Inspecting,
    /// The gate allowed the first bytes; the `CONNECT` through the upstream proxy (or the
    /// direct connection of a no-proxy name) is under way. The guest's bytes wait.
    Tunneling,
    /// Relaying both ways.
    Open,
    /// DNS over TCP to the gateway (no upstream).
    Dns,
    /// A connection into the guest ([`super::ingress`]): SYN sent, waiting for the guest.
    IngressConnecting,
    /// A connection into the guest, relaying to the caller's pipe.
    Ingress,
}

impl Phase {
    pub fn is_ingress(&self) -> bool {
        matches!(self, Phase::IngressConnecting | Phase::Ingress)
    }
}

pub struct TcpFlow {
    pub handle: SocketHandle,
    pub flow: Flow,
    /// Distinguishes this flow from an earlier one with the same addresses.
    pub id: u64,
    pub phase: Phase,
    pub inspect: Inspect,
    pub rule: String,
    /// First bytes held for inspection, or DNS-over-TCP input.
    pub held: Vec<u8>,
    /// Guest -> upstream; `None` once the guest closed its side (the writer then shuts down).
    pub up: Option<mpsc::Sender<Bytes>>,
    pub down: Option<mpsc::Receiver<Down>>,
    /// Part of a chunk smoltcp had no room for yet.
    pub pending_down: Option<Bytes>,
    /// The upstream closed cleanly and everything it sent was queued to the guest.
    pub down_eof: bool,
    /// `close()` was called on the socket.
    pub closing: bool,
    pub allowed: bool,
    /// DNS over TCP: answers still being resolved.
    pub dns_pending: usize,
    /// The socket was seen closed at a previous reap.
    pub closed_seen: bool,
    pub bytes_up: u64,
    pub bytes_down: u64,
    pub tasks: Vec<AbortOnDrop>,
    /// The task writing the guest's bytes to the other side (kept apart: a flow whose guest
    /// closed is only forgotten once it has written everything, see [`TcpFlow::drained`]).
    pub writer: Option<AbortOnDrop>,
    /// An inspected flow's connected upstream socket, held until the gate decides whether it
    /// is spliced ([`TcpFlow::attach`]) or handed to an interceptor.
    pub upstream: Option<tokio::net::TcpStream>,
    /// A connection into the guest: whom to hand its pipe to once the guest accepted.
    pub ingress_reply: Option<super::ingress::Reply>,
    /// Where the upstream connection goes (after the gate's test mapping), once connected.
    pub upstream_addr: Option<std::net::SocketAddr>,
    /// `upstream` is a connection to this proxy, not yet asked for a tunnel.
    pub via_proxy: Option<Arc<UpstreamProxy>>,
    /// The gate's verdict on the first bytes, while the tunnel is being opened.
    pub opening: Option<Opening>,
}

/// What the gate allowed an inspected flow to become, kept while its tunnel opens.
pub struct Opening {
    pub rule: String,
    pub host: Option<String>,
    pub handler: Option<Handoff>,
}

impl TcpFlow {
    pub fn new(handle: SocketHandle, flow: Flow, id: u64, phase: Phase) -> TcpFlow {
        TcpFlow {
            handle,
            flow,
            id,
            phase,
            inspect: Inspect::Nothing,
            rule: String::new(),
            held: Vec::new(),
            up: None,
            down: None,
            pending_down: None,
            down_eof: false,
            closing: false,
            allowed: false,
            closed_seen: false,
            dns_pending: 0,
            bytes_up: 0,
            bytes_down: 0,
            tasks: Vec::new(),
            writer: None,
            upstream: None,
            ingress_reply: None,
            upstream_addr: None,
            via_proxy: None,
            opening: None,
        }
    }

    /// Everything the guest sent went out: its side is finished (the channel is closed) and
    /// the writer has written (or failed to write) all of it.
    pub fn drained(&self) -> bool {
        self.up.is_none() && self.writer.as_ref().is_none_or(|w| w.0.is_finished())
    }

    /// Start relaying over a connected upstream socket.
    pub fn attach(&mut self, stream: tokio::net::TcpStream, wake: Arc<Notify>) {
        let _ = stream.set_nodelay(true);
        self.attach_io(stream, wake);
    }

    /// Start relaying over any byte stream (the upstream socket, or the pipe to an
    /// interceptor).
    pub fn attach_io<S>(&mut self, stream: S, wake: Arc<Notify>)
    where
        S: AsyncRead + AsyncWrite + Send + 'static,
    {
        let (r, w) = tokio::io::split(stream);
        let (up_tx, up_rx) = mpsc::channel(CHANNEL_CHUNKS);
        let (down_tx, down_rx) = mpsc::channel(CHANNEL_CHUNKS);
        self.up = Some(up_tx);
        self.down = Some(down_rx);
        self.writer = Some(AbortOnDrop(tokio::spawn(writer(w, up_rx, wake.clone()))));
        self.tasks
            .push(AbortOnDrop(tokio::spawn(reader(r, down_tx, wake))));
    }
}

/// Guest bytes to the upstream. Ends (shutting the upstream's write side) when the engine drops
/// the sender (the guest closed its side); on a write error it just ends, and the engine sees
/// the channel closed.
async fn writer<W: AsyncWrite + Unpin>(mut w: W, mut rx: mpsc::Receiver<Bytes>, wake: Arc<Notify>) {
    while let Some(b) = rx.recv().await {
        // A chunk left the channel: the engine may move more.
        wake.notify_one();
        if w.write_all(&b).await.is_err() {
            return;
        }
    }
    let _ = w.shutdown().await;
    // The flow may be forgotten now.
    wake.notify_one();
}

/// Upstream bytes toward the guest. Reads only when the channel has room, so an upstream that
/// floods a guest that never reads is throttled by TCP.
async fn reader<R: AsyncRead + Unpin>(mut r: R, tx: mpsc::Sender<Down>, wake: Arc<Notify>) {
    let mut buf = vec![0u8; CHUNK];
    loop {
        let permit = match tx.reserve().await {
            Ok(p) => p,
            Err(_) => return,
        };
        match r.read(&mut buf).await {
            Ok(0) => break,
            Ok(n) => permit.send(Down::Data(Bytes::copy_from_slice(&buf[..n]))),
            Err(_) => {
                permit.send(Down::Reset);
                break;
            }
        }
        wake.notify_one();
    }
    drop(tx);
    wake.notify_one();
}
