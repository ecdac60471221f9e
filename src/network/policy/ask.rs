//! What an agent may ask to allow ("ask to allow"). A request becomes a rule only when the
//! user approves it (CLI / API); these checks refuse the hopeless and the dangerous outright,
//! before a user ever sees them: `*` and other wildcards over everything, bare TLDs and
//! public suffixes (`com`, `co.uk`, `github.io`, `*.com`), single-label names, IP literals and
//! CIDRs in (or overlapping) the always-blocked ranges, and names that resolve into them.

use std::time::Duration;

use super::PolicyError;
use super::blocked;
use super::gate::GateSettings;
use super::rules::{Rule, Target, Verdict};
use crate::network::dns::QType;

/// Parse and vet an agent's request (`HOST`, `*.HOST`, `IP`, `CIDR`, each with `:PORTS`).
pub fn vet(input: &str) -> Result<Rule, PolicyError> {
    let refuse = |reason: &str| PolicyError::NotAskable {
        host: input.to_owned(),
        reason: reason.to_owned(),
    };
    let t = input.trim();
    if t == "*" || t.starts_with("*:") || t.trim_start_matches("*.").contains('*') {
        return Err(refuse("wildcards over everything are never granted"));
    }
    let rule = Rule::parse(Verdict::Allow, t).map_err(|e| refuse(&e.to_string()))?;
    match &rule.target {
        Target::Name(n) | Target::Suffix(n) => {
            if !n.contains('.') {
                return Err(refuse("a single-label name or bare TLD is never granted"));
            }
            if is_public_suffix(n) {
                return Err(refuse(
                    "a public suffix (like com, co.uk or github.io) covers other people's \
                     domains; name a host under it",
                ));
            }
        }
        Target::Net(net) => {
            if let Some(why) = blocked::net_overlaps_blocked(net) {
                return Err(refuse(&format!("covers an always-blocked range ({why})")));
            }
            if net.prefix_len() < if net.addr().is_ipv4() { 16 } else { 32 } {
                return Err(refuse(
                    "a range this wide must be allowed by the user directly",
                ));
            }
        }
    }
    Ok(rule)
}

/// Whether `name` is itself a public suffix (`com`, `co.uk`, `github.io`...).
pub fn is_public_suffix(name: &str) -> bool {
    match psl::suffix(name.as_bytes()) {
        Some(s) => s.as_bytes() == name.as_bytes(),
        None => true,
    }
}

/// Resolve `name` (A and AAAA) the way the sandbox resolver would, and say whether any
/// answer points into an always-blocked range. Lookup failures are not a reason to refuse.
pub async fn resolves_into_blocked(settings: &GateSettings, name: &str) -> Option<String> {
    let host = settings.host_addrs.get();
    if let Some(ips) = settings.static_hosts.get(name) {
        return ips.iter().find_map(|ip| blocked::why_blocked(*ip, &host));
    }
    for qt in [QType::A, QType::Aaaa] {
        let lookup = settings.upstream.query(name, qt);
        if let Ok(Ok(a)) = tokio::time::timeout(Duration::from_secs(5), lookup).await
            && let Some(why) = a
                .ips()
                .into_iter()
                .find_map(|ip| blocked::why_blocked(ip, &host))
        {
            return Some(why);
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    fn refused(s: &str) -> bool {
        matches!(vet(s), Err(PolicyError::NotAskable { .. }))
    }

    #[test]
    fn wildcards_tlds_and_public_suffixes_are_refused() {
        for s in [
            "*",
            "*:443",
            "*.*",
            "*.com",
            "com",
            "com.",
            "co.uk",
            "*.co.uk",
            "github.io",
            "*.github.io",
            "localhost",
            "a*.example.com",
        ] {
            assert!(refused(s), "{s} accepted");
        }
    }

    #[test]
    fn blocked_ips_and_wide_ranges_are_refused() {
        for s in [
            "127.0.0.1",
            "::ffff:127.0.0.1",
            "169.254.169.254",
            "10.0.0.0/8",
            "192.168.1.10",
            "[fd00::1]",
            "0.0.0.0/0",
            "::/0",
            "1.0.0.0/8",
        ] {
            assert!(refused(s), "{s} accepted");
        }
    }

    #[test]
    fn ordinary_hosts_are_askable() {
        for s in [
            "example.com",
            "api.example.com:443",
            "*.example.com",
            "user.github.io",
            "203.0.113.10",
            "140.82.112.0/20:22",
        ] {
            assert!(vet(s).is_ok(), "{s}: {:?}", vet(s));
        }
    }

    #[tokio::test]
    async fn names_resolving_into_blocked_ranges_are_found() {
        struct Nope;
        impl crate::network::dns::Upstream for Nope {
            fn query(
                &self,
                _: &str,
                _: QType,
            ) -> futures_util::future::BoxFuture<
                'static,
                Result<crate::network::dns::Answer, crate::network::dns::DnsError>,
            > {
                Box::pin(async { Err(crate::network::dns::DnsError::NoResolver) })
            }
        }
        let mut s = GateSettings::new(std::sync::Arc::new(Nope));
        s.static_hosts
            .insert("rebind.test".into(), vec!["127.0.0.1".parse().unwrap()]);
        s.static_hosts
            .insert("fine.test".into(), vec!["203.0.113.1".parse().unwrap()]);
        assert!(resolves_into_blocked(&s, "rebind.test").await.is_some());
        assert!(resolves_into_blocked(&s, "fine.test").await.is_none());
        assert!(resolves_into_blocked(&s, "unknown.test").await.is_none());
    }
}
