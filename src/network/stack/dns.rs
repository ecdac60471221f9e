//! DNS to the gateway `10.0.2.2:53`, over UDP (a smoltcp UDP socket) and TCP (2-byte length
//! framing on a smoltcp TCP socket). Every query goes to [`Gate::dns`]; its answer goes back
//! verbatim, except that a UDP answer too big for one datagram is cut to its header and
//! question with the TC bit set, so the guest asks again over TCP.
//!
//! [`Gate::dns`]: crate::network::gate::Gate::dns

use bytes::Bytes;
use smoltcp::socket::{tcp, udp};
use smoltcp::wire::IpEndpoint;
use tokio::sync::mpsc;

use super::engine::{DNS_UDP_MAX, Engine, Event, Key};
use super::flow::TcpFlow;
use crate::network::gate::SharedGate;

/// Largest DNS message (the 2-byte length allows 65535).
const DNS_MAX: usize = 65_535;
/// DNS over TCP: answer bytes queued for a guest that does not read them fast enough. While a
/// flow holds [`DNS_TCP_READ_PAUSE`] or more, no further query is read (the guest's sends back
/// up into its own socket); an answer that would take the queue past this cap is dropped (the
/// guest's resolver times out and asks again), so a guest that never reads holds at most this
/// much of the daemon's memory per flow.
pub(super) const DNS_TCP_PENDING_MAX: usize = 128 * 1024;
/// See [`DNS_TCP_PENDING_MAX`].
pub(super) const DNS_TCP_READ_PAUSE: usize = 64 * 1024;
/// DNS over TCP: queries of one flow being answered at once; no more are read meanwhile.
pub(super) const DNS_TCP_INFLIGHT_PER_FLOW: usize = 8;

impl Engine {
    /// Take the guest's UDP queries and start answering them.
    pub(super) fn service_dns_udp(&mut self) {
        let s = self.sockets.get_mut::<udp::Socket>(self.dns_udp);
        while let Ok((query, meta)) = s.recv() {
            if self.dns_inflight >= self.cfg.max_dns_inflight {
                tracing::debug!("too many DNS queries in flight; dropping one");
                continue;
            }
            self.dns_inflight += 1;
            let fut = self.gate.dns(query.to_vec());
            let tx = self.events_tx.clone();
            let to = meta.endpoint;
            tokio::spawn(async move {
                let reply = tokio::time::timeout(super::engine::dns_timeout(), fut)
                    .await
                    .ok()
                    .flatten();
                let _ = tx.send(Event::DnsUdp { reply, to });
            });
        }
    }

    pub(super) fn dns_udp_reply(&mut self, reply: Option<Vec<u8>>, to: IpEndpoint) {
        self.dns_inflight = self.dns_inflight.saturating_sub(1);
        let Some(mut reply) = reply else { return };
        if reply.len() > DNS_UDP_MAX {
            match truncated(&reply) {
                Some(t) => reply = t,
                None => return,
            }
        }
        let s = self.sockets.get_mut::<udp::Socket>(self.dns_udp);
        if let Err(e) = s.send_slice(&reply, to) {
            tracing::debug!(error = %e, "cannot queue a DNS answer");
        }
    }

    pub(super) fn dns_tcp_reply(&mut self, key: Key, id: u64, reply: Option<Vec<u8>>) {
        self.dns_inflight = self.dns_inflight.saturating_sub(1);
        let Some(f) = self.flows.get_mut(&key) else {
            return;
        };
        if f.id != id {
            return;
        }
        f.dns_pending = f.dns_pending.saturating_sub(1);
        let Some(reply) = reply else { return };
        if reply.len() > DNS_MAX {
            return;
        }
        let queued = f.pending_down.as_ref().map_or(0, Bytes::len);
        if queued + 2 + reply.len() > DNS_TCP_PENDING_MAX {
            tracing::debug!(
                queued,
                answer = reply.len(),
                "the guest does not read its DNS-over-TCP answers; dropping one"
            );
            return;
        }
        let mut out = f
            .pending_down
            .take()
            .map(|b| b.to_vec())
            .unwrap_or_default();
        out.extend_from_slice(&(reply.len() as u16).to_be_bytes());
        out.extend_from_slice(&reply);
        f.pending_down = Some(Bytes::from(out));
    }
}

/// One turn of a DNS-over-TCP connection: read whole queries, start them, write answers.
pub(super) fn tcp_step(
    f: &mut TcpFlow,
    s: &mut tcp::Socket,
    gate: &SharedGate,
    tx: &mpsc::UnboundedSender<Event>,
    inflight: &mut usize,
    max_inflight: usize,
) {
    flush(f, s);
    // Input is bounded by one message plus its length, and not read at all while the guest
    // leaves its answers unread or many of its queries are still being answered.
    let backlogged = |f: &TcpFlow| {
        f.pending_down.as_ref().map_or(0, Bytes::len) >= DNS_TCP_READ_PAUSE
            || f.dns_pending >= DNS_TCP_INFLIGHT_PER_FLOW
    };
    while s.can_recv() && f.held.len() < DNS_MAX + 2 && !backlogged(f) {
        let room = DNS_MAX + 2 - f.held.len();
        let _ = s.recv(|b| {
            let n = b.len().min(room);
            f.held.extend_from_slice(&b[..n]);
            (n, ())
        });
    }
    while f.held.len() >= 2 && !backlogged(f) {
        let len = u16::from_be_bytes([f.held[0], f.held[1]]) as usize;
        if f.held.len() < 2 + len {
            break;
        }
        let query: Vec<u8> = f.held[2..2 + len].to_vec();
        f.held.drain(..2 + len);
        if *inflight >= max_inflight {
            continue;
        }
        *inflight += 1;
        f.dns_pending += 1;
        let fut = gate.dns(query);
        let (tx, key, id) = (tx.clone(), (f.flow.src, f.flow.dst), f.id);
        tokio::spawn(async move {
            let reply = tokio::time::timeout(super::engine::dns_timeout(), fut)
                .await
                .ok()
                .flatten();
            let _ = tx.send(Event::DnsTcp { key, id, reply });
        });
    }
    flush(f, s);
    // The guest is done asking and every answer went out.
    if super::engine::guest_finished(s)
        && f.dns_pending == 0
        && f.pending_down.is_none()
        && !f.closing
    {
        f.closing = true;
        s.close();
    }
}

/// Queue as much of the pending answers as the guest's socket takes.
fn flush(f: &mut TcpFlow, s: &mut tcp::Socket) {
    if let Some(b) = f.pending_down.take() {
        let n = if s.can_send() {
            s.send_slice(&b).unwrap_or(0)
        } else {
            0
        };
        if n < b.len() {
            f.pending_down = Some(b.slice(n..));
        }
    }
}

/// `msg` cut to its header and question section, with TC set and the other counts zeroed.
pub(super) fn truncated(msg: &[u8]) -> Option<Vec<u8>> {
    if msg.len() < 12 {
        return None;
    }
    let qdcount = u16::from_be_bytes([msg[4], msg[5]]);
    let mut i = 12;
    for _ in 0..qdcount {
        loop {
            let l = *msg.get(i)? as usize;
            if l == 0 {
                i += 1;
                break;
            }
            if l & 0xc0 == 0xc0 {
                i += 2;
                break;
            }
            i += 1 + l;
        }
        i += 4;
    }
    if i > msg.len() || i > DNS_UDP_MAX {
        return None;
    }
    let mut out = msg[..i].to_vec();
    out[2] |= 0x02;
    out[6..12].fill(0);
    Some(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn oversized_udp_answer_becomes_a_truncated_one_with_the_question() {
        // Header: id 0x1234, flags 0x8180, 1 question, 50 answers.
        let mut m = vec![0x12, 0x34, 0x81, 0x80, 0, 1, 0, 50, 0, 0, 0, 0];
        m.extend_from_slice(b"\x07example\x03com\x00\x00\x01\x00\x01");
        let qend = m.len();
        m.extend(std::iter::repeat_n(0xaa, 3000));
        let t = truncated(&m).unwrap();
        assert_eq!(t.len(), qend);
        assert_eq!(t[2] & 0x02, 0x02, "TC bit set");
        assert_eq!(&t[6..12], &[0; 6]);
        assert_eq!(&t[12..], &m[12..qend]);
        assert!(truncated(&m[..15]).is_none());
    }
}
