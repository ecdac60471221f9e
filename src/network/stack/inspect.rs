//! An inspected flow from its first bytes to relaying, and the upstream connections of every
//! flow, directly or through the explicit upstream proxy.
//!
//! Owns: collecting a flow's first bytes for [`Gate::inspect`](crate::network::gate::Gate::inspect),
//! the SYN-time connection ([`first_connect`]: to the upstream, or to the proxy), the tunnel
//! after the gate allowed a name ([`Phase::Tunneling`]: `CONNECT <name>:<port>`, or a direct
//! connection when the no-proxy list names it), and opening the flow (splice or hand-off).
//! Never: sends a `CONNECT` (or any byte upstream) before the gate allowed the flow; asks the
//! proxy for an address when the gate checked a name; puts the proxy's credentials in an event
//! or a log line (errors come from [`DialError`]'s masked texts).

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use smoltcp::socket::tcp;
use tokio::net::TcpStream;
use tokio::sync::{Notify, mpsc};

use super::AbortOnDrop;
use super::engine::{Event, Key, guest_finished, relay_step};
use super::flow::{CHUNK, Opening, Phase, TcpFlow};
use crate::network::gate::{FlowEvent, Inspect, InspectVerdict, SharedGate};
use crate::network::policy::synthetic;
use crate::network::upstream_proxy::{Dial, DialError, UpstreamProxy};

/// What [`inspect_step`] needs from the engine.
pub(super) struct Ctx<'a> {
    pub gate: &'a SharedGate,
    pub wake: &'a Arc<Notify>,
    pub events: &'a mpsc::UnboundedSender<Event>,
    pub key: Key,
    pub cap: usize,
    pub timeout: Duration,
}

/// The connection made when the gate allowed a SYN (connect-before-accept). Without a proxy,
/// or for a destination the no-proxy list (or loopback) exempts: the upstream itself. With
/// one: the proxy; a flow without inspection asks it at once for `CONNECT <ip>:<port>`, an
/// inspected one is returned as `Some(proxy)` and tunnelled once the gate saw its name.
pub(super) async fn first_connect(
    upstream: SocketAddr,
    inspect: Inspect,
    proxy: Option<Arc<UpstreamProxy>>,
    timeout: Duration,
) -> Result<(TcpStream, Option<Arc<UpstreamProxy>>), String> {
    let route = Dial::route(upstream, None, proxy.as_ref());
    if proxy.is_some() && route.proxy.is_none() && synthetic::contains(upstream.ip()) {
        // Only the proxy knows the name behind it (a no-proxy CIDR covers the range).
        return Err(format!(
            "{upstream} is a synthetic answer for the upstream proxy; a no-proxy entry sends it              directly, where nothing can reach it"
        ));
    }
    let work = async {
        match &route.proxy {
            Some(p) if inspect != Inspect::Nothing => {
                p.connect_proxy().await.map(|s| (s, Some(p.clone())))
            }
            _ => route.connect().await.map(|s| (s, None)),
        }
    };
    match tokio::time::timeout(timeout, work).await {
        Ok(Ok(r)) => Ok(r),
        Ok(Err(e)) => Err(e.to_string()),
        Err(_) => Err(match &route.proxy {
            Some(p) => format!("proxy {}: no answer in {timeout:?}", p.display()),
            None => format!("connect {upstream}: no answer in {timeout:?}"),
        }),
    }
}

/// The tunnel of an inspected flow whose name `host` the gate allowed: `CONNECT host:port` on
/// the proxy connection `sock` (`port`: the one the guest connected to), or, when the no-proxy
/// list names `host`, a direct connection to `addr` (the proxy connection is dropped unused).
async fn tunnel(
    sock: TcpStream,
    proxy: Arc<UpstreamProxy>,
    (addr, port): (SocketAddr, u16),
    host: Option<String>,
    timeout: Duration,
) -> Result<(TcpStream, Dial), String> {
    let mut dial = Dial::route(addr, host.as_deref(), Some(&proxy));
    if dial.via_proxy() {
        // The name and port the policy allowed (a test override may map the address).
        dial.addr.set_port(port);
    }
    let work = async {
        if dial.via_proxy() {
            proxy
                .tunnel(sock, &dial.target_host(), dial.addr.port())
                .await
        } else {
            drop(sock);
            dial.connect().await
        }
    };
    match tokio::time::timeout(timeout, work).await {
        Ok(Ok(s)) => Ok((s, dial)),
        Ok(Err(e)) => Err(e.to_string()),
        Err(_) => Err(DialError::Unreachable {
            proxy: proxy.display(),
            why: format!("no answer to CONNECT {} in {timeout:?}", dial.target_host()),
        }
        .to_string()),
    }
}

/// The upstream (or the proxy) failed: RST to the guest, an `UpstreamFailed` event.
pub(super) fn upstream_failed(
    f: &mut TcpFlow,
    s: &mut tcp::Socket,
    gate: &SharedGate,
    error: String,
) {
    if error.starts_with("proxy ") {
        tracing::warn!(flow = ?f.flow, %error, "upstream proxy failed; the guest gets a reset");
    } else {
        tracing::debug!(flow = ?f.flow, %error, "upstream connect failed");
    }
    s.abort();
    f.up = None;
    f.down = None;
    f.upstream = None;
    f.via_proxy = None;
    f.opening = None;
    gate.record(FlowEvent::UpstreamFailed {
        flow: f.flow,
        error,
    });
}

/// Collect the first bytes of an inspected flow and ask the gate; nothing goes upstream and
/// nothing comes back until it allows.
pub(super) fn inspect_step(f: &mut TcpFlow, s: &mut tcp::Socket, ctx: &Ctx<'_>) {
    let (gate, cap) = (ctx.gate, ctx.cap);
    let before = f.held.len();
    while s.can_recv() && f.held.len() < cap {
        let room = cap - f.held.len();
        let _ = s.recv(|b| {
            let n = b.len().min(room);
            f.held.extend_from_slice(&b[..n]);
            (n, ())
        });
    }
    let guest_done = guest_finished(s);
    if f.held.len() == before && !guest_done {
        return;
    }
    let verdict = if f.held.is_empty() {
        InspectVerdict::NeedMore
    } else {
        gate.inspect(&f.flow, &f.held)
    };
    let deny = |f: &mut TcpFlow, s: &mut tcp::Socket, reason: String, host: Option<String>| {
        s.abort();
        f.up = None;
        f.down = None;
        f.upstream = None;
        f.via_proxy = None;
        f.tasks.clear();
        f.writer = None;
        gate.record(FlowEvent::Denied {
            flow: f.flow,
            host,
            reason,
        });
    };
    let opening = match verdict {
        InspectVerdict::NeedMore if f.held.len() >= cap => {
            let reason = format!("the first {cap} bytes did not show an allowed host");
            return deny(f, s, reason, None);
        }
        InspectVerdict::NeedMore if guest_done => {
            return deny(
                f,
                s,
                "the connection closed before its first bytes showed an allowed host".into(),
                None,
            );
        }
        InspectVerdict::NeedMore => return,
        InspectVerdict::Deny { reason, host } => return deny(f, s, reason, host),
        InspectVerdict::Intercept {
            rule,
            host,
            handler,
        } => Opening {
            rule,
            host,
            handler: Some(handler),
        },
        InspectVerdict::Allow { rule, host } => Opening {
            rule,
            host,
            handler: None,
        },
    };
    let (Some(up), Some(addr)) = (f.upstream.take(), f.upstream_addr) else {
        return deny(f, s, "no upstream connection".into(), opening.host);
    };
    match f.via_proxy.take() {
        // Now that the gate allowed the name, the proxy is asked for it.
        Some(proxy) => {
            let host = opening.host.clone();
            f.opening = Some(opening);
            f.phase = Phase::Tunneling;
            let (tx, key, id, timeout) = (ctx.events.clone(), ctx.key, f.id, ctx.timeout);
            let port = f.flow.dst.port();
            let task = tokio::spawn(async move {
                let result = tunnel(up, proxy, (addr, port), host, timeout).await;
                let _ = tx.send(Event::Tunneled { key, id, result });
            });
            f.tasks.push(AbortOnDrop(task));
        }
        None => {
            let dial = Dial::direct(addr, opening.host.as_deref());
            f.opening = Some(opening);
            open(f, s, gate, ctx.wake, up, dial);
        }
    }
}

/// Open an inspected flow the gate allowed ([`TcpFlow::opening`]) over its upstream
/// connection `up`: splice it, or hand it (with `dial`, for later connections) to the
/// interceptor; then the held first bytes go upstream.
pub(super) fn open(
    f: &mut TcpFlow,
    s: &mut tcp::Socket,
    gate: &SharedGate,
    wake: &Arc<Notify>,
    up: TcpStream,
    dial: Dial,
) {
    let Some(Opening {
        rule,
        host,
        handler,
    }) = f.opening.take()
    else {
        return;
    };
    match handler {
        Some(handler) => {
            // The guest's bytes go to the handler over a pipe; it gets the upstream.
            let (ours, theirs) = tokio::io::duplex(2 * CHUNK);
            f.attach_io(ours, wake.clone());
            let _ = up.set_nodelay(true);
            f.tasks
                .push(AbortOnDrop(tokio::spawn((handler.0)(theirs, up, dial))));
        }
        None => f.attach(up, wake.clone()),
    }
    f.rule = rule;
    f.phase = Phase::Open;
    f.allowed = true;
    let first = Bytes::from(std::mem::take(&mut f.held));
    f.bytes_up += first.len() as u64;
    // The channel is new and empty: the first chunk always fits.
    if let Some(up) = &f.up {
        let _ = up.try_send(first);
    }
    gate.record(FlowEvent::Allowed {
        flow: f.flow,
        host,
        rule: f.rule.clone(),
    });
    relay_step(f, s);
}
