//! DNS pins: which IPs the sandbox resolver answered for which name, to this sandbox, and
//! until when. A domain rule opens a connection only to an IP pinned for an allowed name, so a
//! hard-coded IP, or an allowed SNI sent to an address the name never resolved to, fails.
//!
//! Bounded: at most [`MAX_PINS`] (name, IP) pairs; expired ones go first, then the oldest.

use std::collections::HashMap;
use std::net::IpAddr;
use std::time::{Duration, Instant};

use super::host::canonical_ip;

pub const MAX_PINS: usize = 4096;
/// A pin outlives a short DNS TTL: programs cache answers longer than the TTL says.
pub const MIN_PIN: Duration = Duration::from_secs(300);
pub const MAX_PIN: Duration = Duration::from_secs(24 * 3600);

#[derive(Default, Debug)]
pub struct Pins {
    /// ip -> (name, expiry)
    by_ip: HashMap<IpAddr, Vec<(String, Instant)>>,
    len: usize,
}

impl Pins {
    /// Remember that `name` resolved to `ips` with this TTL.
    pub fn add(&mut self, name: &str, ips: &[IpAddr], ttl: Duration, now: Instant) {
        let until = now + ttl.clamp(MIN_PIN, MAX_PIN);
        for ip in ips {
            let ip = canonical_ip(*ip);
            let list = self.by_ip.entry(ip).or_default();
            match list.iter_mut().find(|(n, _)| n == name) {
                Some((_, t)) => *t = (*t).max(until),
                None => {
                    list.push((name.to_owned(), until));
                    self.len += 1;
                }
            }
        }
        if self.len > MAX_PINS {
            self.shrink(now);
        }
    }

    /// Names pinned to `ip` now.
    pub fn names(&self, ip: IpAddr, now: Instant) -> Vec<&str> {
        self.by_ip
            .get(&canonical_ip(ip))
            .map(|l| {
                l.iter()
                    .filter(|(_, t)| *t > now)
                    .map(|(n, _)| n.as_str())
                    .collect()
            })
            .unwrap_or_default()
    }

    pub fn has(&self, name: &str, ip: IpAddr, now: Instant) -> bool {
        self.names(ip, now).contains(&name)
    }

    #[cfg(test)]
    pub fn len(&self) -> usize {
        self.len
    }

    fn shrink(&mut self, now: Instant) {
        for l in self.by_ip.values_mut() {
            l.retain(|(_, t)| *t > now);
        }
        self.by_ip.retain(|_, l| !l.is_empty());
        self.len = self.by_ip.values().map(Vec::len).sum();
        if self.len <= MAX_PINS {
            return;
        }
        let mut all: Vec<(Instant, IpAddr, String)> = self
            .by_ip
            .iter()
            .flat_map(|(ip, l)| l.iter().map(|(n, t)| (*t, *ip, n.clone())))
            .collect();
        all.sort();
        for (_, ip, name) in all.into_iter().take(self.len - MAX_PINS) {
            if let Some(l) = self.by_ip.get_mut(&ip) {
                l.retain(|(n, _)| *n != name);
            }
        }
        self.by_ip.retain(|_, l| !l.is_empty());
        self.len = self.by_ip.values().map(Vec::len).sum();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ip(s: &str) -> IpAddr {
        s.parse().unwrap()
    }

    #[test]
    fn pins_match_name_and_ip_and_expire() {
        let mut p = Pins::default();
        let t0 = Instant::now();
        p.add("a.com", &[ip("1.1.1.1")], Duration::from_secs(1), t0);
        assert!(p.has("a.com", ip("1.1.1.1"), t0));
        assert!(p.has("a.com", ip("::ffff:1.1.1.1"), t0));
        assert!(!p.has("a.com", ip("1.1.1.2"), t0));
        assert!(!p.has("b.com", ip("1.1.1.1"), t0));
        // A 1 s TTL is held for MIN_PIN.
        assert!(p.has("a.com", ip("1.1.1.1"), t0 + Duration::from_secs(60)));
        assert!(!p.has(
            "a.com",
            ip("1.1.1.1"),
            t0 + MIN_PIN + Duration::from_secs(1)
        ));
    }

    #[test]
    fn pins_are_bounded() {
        let mut p = Pins::default();
        let t0 = Instant::now();
        for i in 0..(MAX_PINS as u32 + 100) {
            let a = std::net::Ipv4Addr::from(0x0101_0000 + i);
            p.add(
                &format!("h{i}.com"),
                &[IpAddr::V4(a)],
                MIN_PIN,
                t0 + Duration::from_millis(i.into()),
            );
        }
        assert!(p.len() <= MAX_PINS);
        // The newest survive.
        let last = MAX_PINS as u32 + 99;
        assert!(p.has(
            &format!("h{last}.com"),
            IpAddr::V4(std::net::Ipv4Addr::from(0x0101_0000 + last)),
            t0
        ));
    }
}
