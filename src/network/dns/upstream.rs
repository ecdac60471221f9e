//! The upstream resolver allowed names are looked up with: UDP, then TCP when the reply is
//! truncated. Default: the first `nameserver` of the host's /etc/resolv.conf (port 53); the
//! daemon runs on the host, so a loopback resolver such as systemd-resolved's 127.0.0.53 is
//! fine here (the guest never reaches it: the gate blocks loopback).

use std::net::{IpAddr, SocketAddr};
use std::path::Path;
use std::time::Duration;

use futures_util::future::BoxFuture;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use super::{Answer, DnsError, QType, Upstream, read_upstream_reply, upstream_query};

/// Per try; two UDP tries, then TCP if truncated.
const TRY_TIMEOUT: Duration = Duration::from_millis(1500);

pub struct UdpUpstream {
    pub server: Option<SocketAddr>,
}

impl UdpUpstream {
    pub fn new(server: Option<SocketAddr>) -> UdpUpstream {
        UdpUpstream { server }
    }
}

impl Upstream for UdpUpstream {
    fn query(&self, name: &str, qtype: QType) -> BoxFuture<'static, Result<Answer, DnsError>> {
        let server = self.server;
        let name = name.to_owned();
        Box::pin(async move {
            let server = server.ok_or(DnsError::NoResolver)?;
            lookup(server, &name, qtype).await
        })
    }
}

fn random_id() -> u16 {
    let mut b = [0u8; 2];
    let _ = getrandom::fill(&mut b);
    u16::from_ne_bytes(b)
}

async fn lookup(server: SocketAddr, name: &str, qtype: QType) -> Result<Answer, DnsError> {
    let io = |e| DnsError::Io(server, e);
    let bind: SocketAddr = if server.is_ipv4() {
        "0.0.0.0:0".parse().expect("literal")
    } else {
        "[::]:0".parse().expect("literal")
    };
    let sock = tokio::net::UdpSocket::bind(bind).await.map_err(io)?;
    sock.connect(server).await.map_err(io)?;
    let mut buf = vec![0u8; 4096];
    for _ in 0..2 {
        let id = random_id();
        let q = upstream_query(id, name, qtype)?;
        sock.send(&q).await.map_err(io)?;
        let deadline = tokio::time::Instant::now() + TRY_TIMEOUT;
        loop {
            let n = match tokio::time::timeout_at(deadline, sock.recv(&mut buf)).await {
                Err(_) => break,
                Ok(r) => r.map_err(io)?,
            };
            match read_upstream_reply(&buf[..n], id, name, qtype) {
                None => continue, // not ours: keep waiting
                Some(Ok(a)) => return Ok(a),
                Some(Err(_truncated)) => return lookup_tcp(server, name, qtype).await,
            }
        }
    }
    Err(DnsError::Timeout(server))
}

async fn lookup_tcp(server: SocketAddr, name: &str, qtype: QType) -> Result<Answer, DnsError> {
    let io = |e| DnsError::Io(server, e);
    let work = async {
        let mut s = tokio::net::TcpStream::connect(server).await.map_err(io)?;
        let id = random_id();
        let q = upstream_query(id, name, qtype)?;
        let mut framed = (q.len() as u16).to_be_bytes().to_vec();
        framed.extend(q);
        s.write_all(&framed).await.map_err(io)?;
        let len = s.read_u16().await.map_err(io)? as usize;
        let mut buf = vec![0u8; len];
        s.read_exact(&mut buf).await.map_err(io)?;
        match read_upstream_reply(&buf, id, name, qtype) {
            Some(r) => r,
            None => Err(DnsError::Proto("TCP reply does not match the query".into())),
        }
    };
    tokio::time::timeout(TRY_TIMEOUT * 2, work)
        .await
        .map_err(|_| DnsError::Timeout(server))?
}

/// The first `nameserver` of a resolv.conf file, port 53.
pub fn resolv_conf_nameserver(path: &Path) -> Option<SocketAddr> {
    let text = std::fs::read_to_string(path).ok()?;
    text.lines()
        .filter_map(|l| l.trim().strip_prefix("nameserver"))
        .filter_map(|rest| {
            let ip = rest.trim();
            let ip = ip.split('%').next().unwrap_or(ip);
            ip.parse::<IpAddr>().ok()
        })
        .map(|ip| SocketAddr::new(ip, 53))
        .next()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::network::dns::{GuestQuery, Rcode, Rec, RecData, parse_query, reply};

    #[test]
    fn resolv_conf_gives_the_first_nameserver() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("resolv.conf");
        std::fs::write(
            &p,
            "# comment\nsearch x\nnameserver 127.0.0.53\nnameserver 1.1.1.1\n",
        )
        .unwrap();
        assert_eq!(
            resolv_conf_nameserver(&p),
            Some("127.0.0.53:53".parse().unwrap())
        );
        std::fs::write(&p, "nameserver fe80::1%eth0\n").unwrap();
        assert_eq!(
            resolv_conf_nameserver(&p),
            Some("[fe80::1]:53".parse().unwrap())
        );
        std::fs::write(&p, "search x\n").unwrap();
        assert_eq!(resolv_conf_nameserver(&p), None);
    }

    /// A one-shot UDP DNS server on loopback answering every query with one A record; it
    /// first sends a reply with a wrong id (which must be ignored).
    #[tokio::test]
    async fn udp_lookup_ignores_spoofed_replies_and_reads_the_answer() {
        let srv = tokio::net::UdpSocket::bind("127.0.0.1:0").await.unwrap();
        let addr = srv.local_addr().unwrap();
        tokio::spawn(async move {
            let mut buf = vec![0u8; 1500];
            let (n, peer) = srv.recv_from(&mut buf).await.unwrap();
            let q: GuestQuery = parse_query(&buf[..n]).unwrap();
            let recs = [Rec {
                name: "a.test".into(),
                ttl: 30,
                data: RecData::Ip("203.0.113.5".parse().unwrap()),
            }];
            let mut wrong = reply(&q, Rcode::NoError, &recs);
            wrong[0] ^= 0xff;
            srv.send_to(&wrong, peer).await.unwrap();
            srv.send_to(&reply(&q, Rcode::NoError, &recs), peer)
                .await
                .unwrap();
        });
        let a = UdpUpstream::new(Some(addr))
            .query("a.test", QType::A)
            .await
            .unwrap();
        assert_eq!(a.ips(), vec!["203.0.113.5".parse::<IpAddr>().unwrap()]);
    }

    #[tokio::test]
    async fn no_resolver_is_an_error() {
        assert!(matches!(
            UdpUpstream::new(None).query("a.test", QType::A).await,
            Err(DnsError::NoResolver)
        ));
    }
}
