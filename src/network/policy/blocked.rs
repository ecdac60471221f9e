//! The always-blocked ranges: no rule, preset or approval opens them, and DNS answers pointing
//! into them are dropped (anti-rebinding).
//!
//! IPv4: 0/8, 10/8, 100.64/10 (CGNAT; also cloud metadata such as 100.100.100.200),
//! 127/8, 169.254/16 (link-local; cloud metadata 169.254.169.254), 172.16/12, 192.0.0/24,
//! 192.168/16, 198.18/15, 224/4 (multicast), 240/4 (reserved and broadcast).
//! IPv6: ::/128, ::1, ::/96 (IPv4-compatible), 100::/64 (discard), 64:ff9b:1::/48,
//! 2001::/32 (Teredo), fc00::/7 (ULA; fd00:ec2::254 metadata), fe80::/10, fec0::/10, ff00::/8.
//! Addresses that carry an IPv4 address (IPv4-mapped `::ffff:a.b.c.d`, NAT64 `64:ff9b::/96`,
//! 6to4 `2002::/16`) are judged by the IPv4 address inside. The host's own interface addresses
//! are blocked too ([`HostAddrs`]).

use std::net::{IpAddr, Ipv4Addr};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use ipnet::{IpNet, Ipv4Net, Ipv6Net};

/// `(range, why)`: the why shows in deny events.
const V4: &[(&str, &str)] = &[
    ("0.0.0.0/8", "this-network"),
    ("10.0.0.0/8", "private (RFC 1918)"),
    ("100.64.0.0/10", "CGNAT"),
    ("127.0.0.0/8", "loopback"),
    ("169.254.0.0/16", "link-local / metadata"),
    ("172.16.0.0/12", "private (RFC 1918)"),
    ("192.0.0.0/24", "IETF protocol assignments"),
    ("192.168.0.0/16", "private (RFC 1918)"),
    ("198.18.0.0/15", "benchmarking"),
    ("224.0.0.0/4", "multicast"),
    ("240.0.0.0/4", "reserved / broadcast"),
];

const V6: &[(&str, &str)] = &[
    ("::/128", "unspecified"),
    ("::1/128", "loopback"),
    ("::/96", "IPv4-compatible"),
    ("100::/64", "discard"),
    ("64:ff9b:1::/48", "local NAT64"),
    ("2001::/32", "Teredo"),
    ("fc00::/7", "unique local (ULA)"),
    ("fe80::/10", "link-local"),
    ("fec0::/10", "site-local"),
    ("ff00::/8", "multicast"),
];

/// Why `ip` is always blocked, or `None` when it is a public address (that rules may open).
/// `host` is the host's own addresses.
pub fn why_blocked(ip: IpAddr, host: &[IpAddr]) -> Option<String> {
    let ip = embedded_v4(ip).map(IpAddr::V4).unwrap_or(ip);
    if host
        .iter()
        .any(|h| embedded_v4(*h).map(IpAddr::V4).unwrap_or(*h) == ip)
    {
        return Some(format!("{ip} is an address of the host"));
    }
    let hit = match ip {
        IpAddr::V4(v4) => V4.iter().find(|(net, _)| {
            net.parse::<Ipv4Net>()
                .expect("valid table entry")
                .contains(&v4)
        }),
        IpAddr::V6(v6) => V6.iter().find(|(net, _)| {
            net.parse::<Ipv6Net>()
                .expect("valid table entry")
                .contains(&v6)
        }),
    };
    hit.map(|(net, why)| format!("{ip} is in {net} ({why})"))
}

#[cfg(test)]
pub fn is_blocked(ip: IpAddr, host: &[IpAddr]) -> bool {
    why_blocked(ip, host).is_some()
}

/// Whether a whole CIDR overlaps a blocked range (rules that would cover one are refused).
pub fn net_overlaps_blocked(net: &IpNet) -> Option<&'static str> {
    let overlaps = |a: &IpNet, b: &IpNet| a.contains(&b.network()) || b.contains(&a.network());
    let tables: &[(&str, &str)] = match net {
        IpNet::V4(_) => V4,
        IpNet::V6(_) => V6,
    };
    for (r, why) in tables {
        let r: IpNet = r.parse().expect("valid table entry");
        if overlaps(&r, net) {
            return Some(why);
        }
    }
    if let IpNet::V6(v6) = net {
        // Nets carrying IPv4 addresses.
        for r in ["::ffff:0:0/96", "64:ff9b::/96", "2002::/16"] {
            let r: IpNet = r.parse().expect("valid");
            if overlaps(&r, &IpNet::V6(*v6)) {
                return Some("carries IPv4 addresses");
            }
        }
    }
    None
}

/// The IPv4 address carried by an IPv4-mapped, NAT64 (64:ff9b::/96) or 6to4 (2002::/16)
/// address.
pub fn embedded_v4(ip: IpAddr) -> Option<Ipv4Addr> {
    let IpAddr::V6(v6) = ip else { return None };
    if let Some(v4) = v6.to_ipv4_mapped() {
        return Some(v4);
    }
    let s = v6.segments();
    let o = v6.octets();
    if s[0] == 0x64 && s[1] == 0xff9b && s[2..6] == [0, 0, 0, 0] {
        return Some(Ipv4Addr::new(o[12], o[13], o[14], o[15]));
    }
    if s[0] == 0x2002 {
        return Some(Ipv4Addr::new(o[2], o[3], o[4], o[5]));
    }
    None
}

/// The host's own interface addresses, re-read at most every 30 s (interfaces change).
#[derive(Default)]
pub struct HostAddrs {
    cached: Mutex<Option<(Instant, Arc<Vec<IpAddr>>)>>,
}

const HOST_ADDRS_TTL: Duration = Duration::from_secs(30);

impl HostAddrs {
    pub fn get(&self) -> Arc<Vec<IpAddr>> {
        let mut c = self.cached.lock().unwrap_or_else(|p| p.into_inner());
        if let Some((at, v)) = c.as_ref()
            && at.elapsed() < HOST_ADDRS_TTL
        {
            return v.clone();
        }
        let v = Arc::new(read_host_addrs());
        *c = Some((Instant::now(), v.clone()));
        v
    }
}

fn read_host_addrs() -> Vec<IpAddr> {
    let mut out = Vec::new();
    match nix::ifaddrs::getifaddrs() {
        Ok(addrs) => {
            for a in addrs {
                let Some(sa) = a.address else { continue };
                if let Some(v4) = sa.as_sockaddr_in() {
                    out.push(IpAddr::V4(v4.ip()));
                } else if let Some(v6) = sa.as_sockaddr_in6() {
                    out.push(IpAddr::V6(v6.ip()));
                }
            }
        }
        Err(e) => tracing::warn!(error = %e, "cannot list the host's addresses"),
    }
    out.sort();
    out.dedup();
    out
}

/// For tests: an IPv6 address from its text.
#[cfg(test)]
fn v6(s: &str) -> IpAddr {
    IpAddr::V6(s.parse::<std::net::Ipv6Addr>().unwrap())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn blocked(s: &str) -> bool {
        is_blocked(s.parse().unwrap(), &[])
    }

    #[test]
    fn every_blocked_range_is_blocked_at_its_edges() {
        for s in [
            "0.0.0.0",
            "10.0.0.1",
            "10.255.255.255",
            "10.0.2.2",
            "100.64.0.0",
            "100.127.255.255",
            "100.100.100.200",
            "127.0.0.1",
            "127.255.255.254",
            "169.254.169.254",
            "172.16.0.1",
            "172.31.255.255",
            "192.168.1.1",
            "192.0.0.170",
            "198.18.0.1",
            "224.0.0.1",
            "239.255.255.250",
            "255.255.255.255",
            "::",
            "::1",
            "::127.0.0.1",
            "fc00::1",
            "fd00:ec2::254",
            "fe80::1",
            "febf::1",
            "fec0::1",
            "ff02::1",
            "2001::1",
            "100::1",
        ] {
            assert!(blocked(s), "{s} not blocked");
        }
    }

    #[test]
    fn public_addresses_pass() {
        for s in [
            "1.1.1.1",
            "8.8.8.8",
            "100.63.255.255",
            "100.128.0.0",
            "172.15.255.255",
            "172.32.0.0",
            "203.0.113.10",
            "140.82.112.3",
            "2606:4700::1111",
            "2001:4860:4860::8888",
        ] {
            assert!(!blocked(s), "{s} blocked");
        }
    }

    #[test]
    fn ipv4_carried_in_ipv6_is_judged_by_the_ipv4() {
        for s in [
            "::ffff:127.0.0.1",
            "::ffff:10.0.0.1",
            "::ffff:169.254.169.254",
            "::ffff:100.64.0.1",
            "64:ff9b::7f00:1",
            "64:ff9b::a9fe:a9fe",
            "2002:7f00:1::",
            "2002:c0a8:101::1",
        ] {
            assert!(blocked(s), "{s} not blocked");
        }
        assert!(!blocked("::ffff:1.1.1.1"));
        assert!(!blocked("64:ff9b::101:101"));
        assert_eq!(
            embedded_v4(v6("::ffff:127.0.0.1")),
            Some(Ipv4Addr::LOCALHOST)
        );
    }

    #[test]
    fn host_addresses_are_blocked_in_any_form() {
        let host = vec!["203.0.113.7".parse().unwrap()];
        assert!(is_blocked("203.0.113.7".parse().unwrap(), &host));
        assert!(is_blocked(v6("::ffff:203.0.113.7"), &host));
        assert!(!is_blocked("203.0.113.8".parse().unwrap(), &host));
        let real = HostAddrs::default().get();
        assert!(
            real.iter().any(|a| a.is_loopback()),
            "getifaddrs lists lo: {real:?}"
        );
    }

    #[test]
    fn cidrs_overlapping_blocked_ranges_are_found() {
        for s in [
            "0.0.0.0/0",
            "10.1.0.0/16",
            "8.0.0.0/4",
            "::/0",
            "::ffff:0:0/104",
            "fd00::/8",
        ] {
            assert!(
                net_overlaps_blocked(&s.parse().unwrap()).is_some(),
                "{s} not found"
            );
        }
        for s in ["1.1.1.0/24", "140.82.112.0/20", "2606:4700::/32"] {
            assert!(
                net_overlaps_blocked(&s.parse().unwrap()).is_none(),
                "{s} flagged"
            );
        }
    }
}
