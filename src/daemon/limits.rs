//! Connection budgets of one listener: a cap on open connections and a cap per peer, so a
//! client holding thousands of idle connections cannot stop others.
//!
//! Owns: counting open connections per listener and per peer ([`ConnLimiter`], released when
//! the [`ConnPermit`] drops), naming the peer of an accepted connection ([`PeerKey`]: the uid
//! on the unix socket and for loopback TCP, looked up with `sock_diag`; the IP otherwise), and
//! the canned 503 a refused connection gets.
//! Never: request parsing or access rules (`middleware`).

use std::collections::HashMap;
use std::net::{IpAddr, SocketAddr};
use std::sync::{Arc, Mutex};

/// Who holds a connection, for the per-peer cap.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum PeerKey {
    Uid(u32),
    Ip(IpAddr),
}

impl std::fmt::Display for PeerKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            PeerKey::Uid(u) => write!(f, "uid {u}"),
            PeerKey::Ip(ip) => write!(f, "{ip}"),
        }
    }
}

/// Why a connection was refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum LimitHit {
    #[error("{open} connections are open on this listener (max_connections)")]
    Listener { open: usize },
    #[error("{peer} holds {open} connections on this listener (max_connections_per_peer)")]
    Peer { peer: PeerKey, open: usize },
}

#[derive(Debug, Default)]
struct Counts {
    total: usize,
    per_peer: HashMap<PeerKey, usize>,
}

/// The budget of one listener.
#[derive(Debug)]
pub struct ConnLimiter {
    max_total: usize,
    max_per_peer: usize,
    counts: Mutex<Counts>,
}

/// One open connection's place in its listener's budget; released on drop.
#[derive(Debug)]
pub struct ConnPermit {
    limiter: Arc<ConnLimiter>,
    peer: PeerKey,
}

impl ConnLimiter {
    pub fn new(max_total: usize, max_per_peer: usize) -> Arc<ConnLimiter> {
        Arc::new(ConnLimiter {
            max_total: max_total.max(1),
            max_per_peer: max_per_peer.max(1),
            counts: Mutex::new(Counts::default()),
        })
    }

    /// Take a place for a connection of `peer`, or say which cap it hit.
    pub fn try_acquire(self: &Arc<Self>, peer: PeerKey) -> Result<ConnPermit, LimitHit> {
        let mut c = self.counts.lock().unwrap_or_else(|p| p.into_inner());
        if c.total >= self.max_total {
            return Err(LimitHit::Listener { open: c.total });
        }
        let mine = c.per_peer.get(&peer).copied().unwrap_or(0);
        if mine >= self.max_per_peer {
            return Err(LimitHit::Peer { peer, open: mine });
        }
        c.total += 1;
        *c.per_peer.entry(peer).or_insert(0) += 1;
        Ok(ConnPermit {
            limiter: self.clone(),
            peer,
        })
    }

    /// Open connections on this listener.
    #[cfg(test)]
    pub fn open(&self) -> usize {
        self.counts.lock().unwrap_or_else(|p| p.into_inner()).total
    }
}

impl Drop for ConnPermit {
    fn drop(&mut self) {
        let mut c = self
            .limiter
            .counts
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        c.total = c.total.saturating_sub(1);
        if let Some(n) = c.per_peer.get_mut(&self.peer) {
            *n -= 1;
            if *n == 0 {
                c.per_peer.remove(&self.peer);
            }
        }
    }
}

/// The answer a refused connection gets before it is closed (written without waiting: a
/// client that does not read it loses it).
pub const REFUSED_RESPONSE: &[u8] = b"HTTP/1.1 503 Service Unavailable\r\n\
content-type: application/json\r\nconnection: close\r\ncontent-length: 92\r\n\r\n\
{\"error\":{\"code\":\"too_many_connections\",\"message\":\"too many open connections; retry later\"}}";

/// The peer key of a TCP client: its socket owner's uid when it is on this machine (a loopback
/// address on both ends), else its IP address.
pub fn tcp_peer(local: SocketAddr, peer: SocketAddr) -> PeerKey {
    if peer.ip().is_loopback()
        && let Some(uid) = sock_diag::owner_uid(peer, local)
    {
        return PeerKey::Uid(uid);
    }
    PeerKey::Ip(peer.ip())
}

/// Finding the owner of the client end of a loopback TCP connection with one
/// `SOCK_DIAG_BY_FAMILY` request (an exact lookup, not a dump: cost does not grow with the
/// number of sockets).
mod sock_diag {
    use std::net::SocketAddr;

    use nix::sys::socket::{
        AddressFamily, MsgFlags, NetlinkAddr, SockFlag, SockProtocol, SockType, recv, sendto,
        setsockopt, socket, sockopt,
    };
    use nix::sys::time::TimeVal;

    const SOCK_DIAG_BY_FAMILY: u16 = 20;
    const NLM_F_REQUEST: u16 = 1;
    const NLMSG_HDRLEN: usize = 16;
    /// `struct inet_diag_req_v2`: family, protocol, ext, pad, states, then `inet_diag_sockid`.
    const REQ_LEN: usize = 8 + SOCKID_LEN;
    /// `struct inet_diag_sockid`: sport, dport (big endian), src[4], dst[4], if, cookie[2].
    const SOCKID_LEN: usize = 4 + 16 + 16 + 4 + 8;
    /// Offset of `idiag_uid` in `struct inet_diag_msg` (4 bytes, sockid, expires, rqueue, wqueue).
    const UID_OFFSET: usize = 4 + SOCKID_LEN + 12;

    /// The uid owning the socket whose local end is `client` and remote end is `server`.
    pub fn owner_uid(client: SocketAddr, server: SocketAddr) -> Option<u32> {
        let fd = socket(
            AddressFamily::Netlink,
            SockType::Datagram,
            SockFlag::SOCK_CLOEXEC,
            SockProtocol::NetlinkSockDiag,
        )
        .ok()?;
        setsockopt(&fd, sockopt::ReceiveTimeout, &TimeVal::new(1, 0)).ok()?;
        let req = request(client, server)?;
        sendto(
            std::os::fd::AsRawFd::as_raw_fd(&fd),
            &req,
            &NetlinkAddr::new(0, 0),
            MsgFlags::empty(),
        )
        .ok()?;
        let mut buf = [0u8; 1024];
        let n = recv(
            std::os::fd::AsRawFd::as_raw_fd(&fd),
            &mut buf,
            MsgFlags::empty(),
        )
        .ok()?;
        parse_reply(&buf[..n])
    }

    fn request(client: SocketAddr, server: SocketAddr) -> Option<Vec<u8>> {
        let (family, src, dst) = match (client, server) {
            (SocketAddr::V4(c), SocketAddr::V4(s)) => {
                let mut src = [0u8; 16];
                src[..4].copy_from_slice(&c.ip().octets());
                let mut dst = [0u8; 16];
                dst[..4].copy_from_slice(&s.ip().octets());
                (libc::AF_INET as u8, src, dst)
            }
            (SocketAddr::V6(c), SocketAddr::V6(s)) => {
                (libc::AF_INET6 as u8, c.ip().octets(), s.ip().octets())
            }
            _ => return None,
        };
        let len = NLMSG_HDRLEN + REQ_LEN;
        let mut m = Vec::with_capacity(len);
        m.extend_from_slice(&(len as u32).to_ne_bytes());
        m.extend_from_slice(&SOCK_DIAG_BY_FAMILY.to_ne_bytes());
        m.extend_from_slice(&NLM_F_REQUEST.to_ne_bytes());
        m.extend_from_slice(&1u32.to_ne_bytes()); // seq
        m.extend_from_slice(&0u32.to_ne_bytes()); // pid
        m.push(family);
        m.push(libc::IPPROTO_TCP as u8);
        m.push(0); // ext
        m.push(0); // pad
        m.extend_from_slice(&u32::MAX.to_ne_bytes()); // every state
        m.extend_from_slice(&client.port().to_be_bytes());
        m.extend_from_slice(&server.port().to_be_bytes());
        m.extend_from_slice(&src);
        m.extend_from_slice(&dst);
        m.extend_from_slice(&0u32.to_ne_bytes()); // interface
        m.extend_from_slice(&u32::MAX.to_ne_bytes()); // INET_DIAG_NOCOOKIE
        m.extend_from_slice(&u32::MAX.to_ne_bytes());
        debug_assert_eq!(m.len(), len);
        Some(m)
    }

    pub(super) fn parse_reply(buf: &[u8]) -> Option<u32> {
        let len = u32::from_ne_bytes(buf.get(..4)?.try_into().ok()?) as usize;
        let kind = u16::from_ne_bytes(buf.get(4..6)?.try_into().ok()?);
        // NLMSG_ERROR: no such socket (it closed meanwhile) or no sock_diag in this kernel.
        if kind != SOCK_DIAG_BY_FAMILY || len > buf.len() {
            return None;
        }
        let at = NLMSG_HDRLEN + UID_OFFSET;
        Some(u32::from_ne_bytes(buf.get(at..at + 4)?.try_into().ok()?))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn per_peer_cap_leaves_room_for_others_and_permits_release() {
        let l = ConnLimiter::new(10, 2);
        let hog = PeerKey::Uid(1000);
        let a = l.try_acquire(hog).unwrap();
        let _b = l.try_acquire(hog).unwrap();
        assert_eq!(
            l.try_acquire(hog).unwrap_err(),
            LimitHit::Peer { peer: hog, open: 2 }
        );
        let other = l.try_acquire(PeerKey::Uid(1001));
        assert!(other.is_ok());
        drop(a);
        assert!(l.try_acquire(hog).is_ok());
    }

    #[test]
    fn listener_cap_holds_across_peers() {
        let l = ConnLimiter::new(3, 3);
        let held: Vec<_> = (0..3)
            .map(|i| l.try_acquire(PeerKey::Uid(i)).unwrap())
            .collect();
        assert_eq!(
            l.try_acquire(PeerKey::Uid(9)).unwrap_err(),
            LimitHit::Listener { open: 3 }
        );
        drop(held);
        assert_eq!(l.open(), 0);
        assert!(l.try_acquire(PeerKey::Uid(9)).is_ok());
    }

    #[test]
    fn refused_response_is_well_formed() {
        let text = std::str::from_utf8(REFUSED_RESPONSE).unwrap();
        let (head, body) = text.split_once("\r\n\r\n").unwrap();
        assert!(
            head.contains(&format!("content-length: {}", body.len())),
            "{head}"
        );
        let v: serde_json::Value = serde_json::from_str(body).unwrap();
        assert_eq!(v["error"]["code"], "too_many_connections");
    }

    #[test]
    fn loopback_tcp_peer_is_named_by_its_uid() {
        let server = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let client = std::net::TcpStream::connect(server.local_addr().unwrap()).unwrap();
        let (accepted, peer) = server.accept().unwrap();
        let key = tcp_peer(accepted.local_addr().unwrap(), peer);
        assert_eq!(key, PeerKey::Uid(nix::unistd::geteuid().as_raw()));
        drop(client);
    }

    #[test]
    fn loopback_tcp6_peer_is_named_by_its_uid() {
        let server = match std::net::TcpListener::bind("[::1]:0") {
            Ok(s) => s,
            Err(e) => {
                // Every test runs under CI: a CI host without IPv6 loopback is a failure.
                assert!(
                    std::env::var_os("CI").is_none(),
                    "no IPv6 loopback under CI: {e}"
                );
                eprintln!("skipped: no IPv6 loopback on this host ({e})");
                return;
            }
        };
        let client = std::net::TcpStream::connect(server.local_addr().unwrap()).unwrap();
        let (accepted, peer) = server.accept().unwrap();
        let key = tcp_peer(accepted.local_addr().unwrap(), peer);
        assert_eq!(key, PeerKey::Uid(nix::unistd::geteuid().as_raw()));
        drop(client);
    }

    #[test]
    fn sock_diag_error_reply_gives_no_uid() {
        let mut err = vec![0u8; 36];
        err[..4].copy_from_slice(&36u32.to_ne_bytes());
        err[4..6].copy_from_slice(&2u16.to_ne_bytes()); // NLMSG_ERROR
        assert_eq!(sock_diag::parse_reply(&err), None);
        assert_eq!(sock_diag::parse_reply(&[1, 2]), None);
    }
}
