//! Synthetic DNS answers for names only the upstream proxy can reach.
//!
//! Behind an explicit proxy the host's own resolver often cannot resolve public names (only
//! the proxy can). When an upstream proxy carries a name and the host's lookup gave no address
//! (error, timeout, NXDOMAIN or an empty answer), the sandbox resolver answers an A query with
//! an address of its own from [`RANGE`], pinned to that name like a real answer. A flow to it
//! is decided exactly as any other (policy on the name, DNS pin, SNI/Host checked against the
//! pin) and then goes to the proxy as `CONNECT <name>:<port>`; nothing is ever connected to
//! the synthetic address itself.
//!
//! Owns: the per-sandbox table name <-> synthetic address, bounded by [`MAX_NAMES`] (past it a
//! lookup gets SERVFAIL, as when the host resolver fails without a proxy).
//! Never: hands out an address outside [`RANGE`] (a range the gate otherwise always blocks,
//! benchmarking 198.18.0.0/15, so no real answer can collide with one).

use std::collections::HashMap;
use std::net::{IpAddr, Ipv4Addr};

/// The synthetic addresses: 198.19.0.0/16 (the upper half of the blocked benchmarking range).
pub const RANGE: (Ipv4Addr, u8) = (Ipv4Addr::new(198, 19, 0, 0), 16);
/// Distinct names one sandbox gets synthetic addresses for.
pub const MAX_NAMES: usize = 4096;

/// Whether `ip` is in [`RANGE`].
pub fn contains(ip: IpAddr) -> bool {
    match ip {
        IpAddr::V4(v4) => u32::from(v4) >> (32 - RANGE.1) == u32::from(RANGE.0) >> (32 - RANGE.1),
        IpAddr::V6(v6) => v6
            .to_ipv4_mapped()
            .is_some_and(|v4| contains(IpAddr::V4(v4))),
    }
}

#[derive(Default, Debug)]
pub struct Synthetic {
    by_name: HashMap<String, Ipv4Addr>,
    by_ip: HashMap<Ipv4Addr, String>,
}

impl Synthetic {
    /// The address of `name` (normalised), assigning the next free one; `None` when the table
    /// is full.
    pub fn assign(&mut self, name: &str) -> Option<Ipv4Addr> {
        if let Some(ip) = self.by_name.get(name) {
            return Some(*ip);
        }
        if self.by_name.len() >= MAX_NAMES {
            return None;
        }
        // .0.1 onwards: never the network address.
        let n = u32::try_from(self.by_name.len()).ok()? + 1;
        let ip = Ipv4Addr::from(u32::from(RANGE.0) + n);
        self.by_name.insert(name.to_owned(), ip);
        self.by_ip.insert(ip, name.to_owned());
        Some(ip)
    }

    /// Whether `ip` is one of this sandbox's synthetic addresses.
    pub fn is_assigned(&self, ip: IpAddr) -> bool {
        match ip {
            IpAddr::V4(v4) => self.by_ip.contains_key(&v4),
            IpAddr::V6(_) => false,
        }
    }

    #[cfg(test)]
    pub fn name_of(&self, ip: Ipv4Addr) -> Option<&str> {
        self.by_ip.get(&ip).map(String::as_str)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_get_stable_distinct_addresses_in_the_range_up_to_the_bound() {
        let mut s = Synthetic::default();
        let a = s.assign("a.test").unwrap();
        let b = s.assign("b.test").unwrap();
        assert_ne!(a, b);
        assert_eq!(s.assign("a.test"), Some(a));
        assert_eq!(s.name_of(b), Some("b.test"));
        let net = ipnet::Ipv4Net::new(RANGE.0, RANGE.1).unwrap();
        assert!(net.contains(&a) && net.contains(&b) && a != RANGE.0);
        assert!(s.is_assigned(IpAddr::V4(a)));
        assert!(!s.is_assigned(IpAddr::V4(Ipv4Addr::new(198, 19, 200, 1))));
        assert!(contains(IpAddr::V4(a)) && contains("::ffff:198.19.3.4".parse().unwrap()));
        assert!(
            !contains("198.18.0.1".parse().unwrap()) && !contains("198.20.0.1".parse().unwrap())
        );
        for i in 2..MAX_NAMES {
            let ip = s.assign(&format!("n{i}.test")).unwrap();
            assert!(net.contains(&ip), "{ip}");
        }
        assert_eq!(s.assign("one-too-many.test"), None);
        assert_eq!(s.assign("a.test"), Some(a));
    }
}
