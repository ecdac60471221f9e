//! A sandbox's policy: presets plus user rules, serde (kept in the store, shown by the API).
//!
//! Rule syntax (CLI, API, config): `TARGET[:PORTS]` where TARGET is a name (`example.com`), a
//! suffix (`*.example.com`: every name under it, not `example.com` itself), an IP or a CIDR
//! (`140.82.112.0/20`, `[2606:4700::/32]:443` with brackets when a port follows an IPv6 one),
//! and PORTS is `443`, `80,443` or a range `8000-8100`. Name rules only work on ports 80
//! and 443 (the only ports where the name can be checked: HTTP Host, TLS SNI), default both;
//! IP/CIDR rules default to every TCP port.

use std::fmt;
use std::net::IpAddr;
use std::str::FromStr;

use ipnet::IpNet;
use serde::{Deserialize, Serialize};

use super::PolicyError;
use super::host::{self, Host};

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Verdict {
    Allow,
    Deny,
}

/// What a rule matches.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Target {
    /// One name, normalised.
    Name(String),
    /// `*.suffix`: names strictly under `suffix`.
    Suffix(String),
    Net(IpNet),
}

impl Target {
    pub fn matches_name(&self, name: &str) -> bool {
        match self {
            Target::Name(n) => n == name,
            Target::Suffix(s) => name
                .strip_suffix(s.as_str())
                .is_some_and(|head| head.len() > 1 && head.ends_with('.')),
            Target::Net(_) => false,
        }
    }

    pub fn matches_ip(&self, ip: IpAddr) -> bool {
        match self {
            Target::Net(n) => n.contains(&host::canonical_ip(ip)),
            _ => false,
        }
    }

    pub fn is_name(&self) -> bool {
        !matches!(self, Target::Net(_))
    }
}

impl fmt::Display for Target {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Target::Name(n) => f.write_str(n),
            Target::Suffix(s) => write!(f, "*.{s}"),
            Target::Net(n) if n.prefix_len() == n.max_prefix_len() => write!(f, "{}", n.addr()),
            Target::Net(n) => write!(f, "{n}"),
        }
    }
}

/// Inclusive port ranges; empty = every port.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Ports(pub Vec<(u16, u16)>);

impl Ports {
    pub fn any() -> Ports {
        Ports(Vec::new())
    }
    pub fn web() -> Ports {
        Ports(vec![(80, 80), (443, 443)])
    }
    pub fn contains(&self, p: u16) -> bool {
        self.0.is_empty() || self.0.iter().any(|(a, b)| (*a..=*b).contains(&p))
    }
    fn parse(s: &str) -> Result<Ports, String> {
        let mut out = Vec::new();
        for part in s.split(',') {
            let num = |x: &str| {
                x.parse::<u16>()
                    .ok()
                    .filter(|p| *p != 0 && x.bytes().all(|b| b.is_ascii_digit()))
                    .ok_or_else(|| format!("`{x}` is not a port"))
            };
            let (a, b) = match part.split_once('-') {
                Some((a, b)) => (num(a)?, num(b)?),
                None => (num(part)?, num(part)?),
            };
            if a > b {
                return Err(format!("empty port range `{part}`"));
            }
            out.push((a, b));
        }
        Ok(Ports(out))
    }
}

impl fmt::Display for Ports {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let parts: Vec<String> = self
            .0
            .iter()
            .map(|(a, b)| {
                if a == b {
                    a.to_string()
                } else {
                    format!("{a}-{b}")
                }
            })
            .collect();
        f.write_str(&parts.join(","))
    }
}

/// One rule: `allow TARGET[:PORTS]` or `deny TARGET[:PORTS]`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Rule {
    pub verdict: Verdict,
    pub target: Target,
    pub ports: Ports,
}

impl Rule {
    /// Parse `TARGET[:PORTS]` (see the module docs).
    pub fn parse(verdict: Verdict, input: &str) -> Result<Rule, PolicyError> {
        let err = |m: String| PolicyError::Rule {
            input: input.to_owned(),
            message: m,
        };
        let s = input.trim();
        if s.is_empty() {
            return Err(err("empty".into()));
        }
        // Split the ports off: `[v6 or v6/len]:ports`, `v4/len:ports`, `name:ports`.
        let (target, ports) = if let Some(rest) = s.strip_prefix('[') {
            let (inner, after) = rest
                .split_once(']')
                .ok_or_else(|| err("unclosed `[`".into()))?;
            match after {
                "" => (inner, None),
                a => (
                    inner,
                    Some(
                        a.strip_prefix(':')
                            .ok_or_else(|| err("junk after `]`".into()))?,
                    ),
                ),
            }
        } else if s.matches(':').count() == 1 {
            let (t, p) = s.split_once(':').expect("one colon");
            (t, Some(p))
        } else {
            (s, None)
        };
        let ports = ports.map(Ports::parse).transpose().map_err(err)?;
        let target = if target == "*" || target.starts_with("*.") && target.len() <= 3 {
            return Err(err("`*` matches everything; name the hosts".into()));
        } else if let Some(suffix) = target.strip_prefix("*.") {
            let n = host::normalize_name(suffix).map_err(|e| err(e.to_string()))?;
            Target::Suffix(n)
        } else if target.contains('*') {
            return Err(err("`*` is only allowed as a leading `*.`".into()));
        } else if target.contains('/') {
            let net: IpNet = target
                .parse()
                .map_err(|e| err(format!("invalid CIDR: {e}")))?;
            let net = match net {
                IpNet::V6(v6) if v6.prefix_len() >= 96 && v6.addr().to_ipv4_mapped().is_some() => {
                    let v4 = v6.addr().to_ipv4_mapped().expect("mapped");
                    IpNet::new(IpAddr::V4(v4), v6.prefix_len() - 96).expect("valid prefix")
                }
                n => n,
            };
            Target::Net(net.trunc())
        } else {
            match host::normalize(target).map_err(|e| err(e.to_string()))? {
                Host::Name(n) => Target::Name(n),
                Host::Ip(ip) => Target::Net(IpNet::from(ip)),
            }
        };
        let ports = match (&target, ports) {
            (t, Some(p)) if t.is_name() => {
                if p.0
                    .iter()
                    .any(|(a, b)| !matches!((a, b), (80, 80) | (443, 443)))
                {
                    return Err(err(
                        "name rules work on ports 80 and 443 only (the name is checked in the \
                         HTTP Host / TLS SNI); use an IP or CIDR rule for other ports"
                            .into(),
                    ));
                }
                p
            }
            (t, None) if t.is_name() => Ports::web(),
            (_, Some(p)) => p,
            (_, None) => Ports::any(),
        };
        Ok(Rule {
            verdict,
            target,
            ports,
        })
    }

    pub fn matches_name(&self, name: &str, port: u16) -> bool {
        self.target.matches_name(name) && self.ports.contains(port)
    }

    pub fn matches_ip(&self, ip: IpAddr, port: u16) -> bool {
        self.target.matches_ip(ip) && self.ports.contains(port)
    }

    /// The rule as a `TARGET[:PORTS]` string (what [`Rule::parse`] reads back).
    pub fn target_string(&self) -> String {
        let t = match &self.target {
            Target::Net(n) if n.addr().is_ipv6() && !self.ports.0.is_empty() => {
                format!("[{}]", Target::Net(*n))
            }
            t => t.to_string(),
        };
        let default = if self.target.is_name() {
            Ports::web()
        } else {
            Ports::any()
        };
        if self.ports == default {
            t
        } else {
            format!("{t}:{}", self.ports)
        }
    }
}

impl fmt::Display for Rule {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let v = match self.verdict {
            Verdict::Allow => "allow",
            Verdict::Deny => "deny",
        };
        write!(f, "{v} {}", self.target_string())
    }
}

impl FromStr for Rule {
    type Err = PolicyError;
    /// `allow TARGET[:PORTS]` / `deny TARGET[:PORTS]`.
    fn from_str(s: &str) -> Result<Rule, PolicyError> {
        let (v, t) = s.trim().split_once(' ').ok_or_else(|| PolicyError::Rule {
            input: s.to_owned(),
            message: "expected `allow TARGET` or `deny TARGET`".into(),
        })?;
        let verdict = match v {
            "allow" => Verdict::Allow,
            "deny" => Verdict::Deny,
            _ => {
                return Err(PolicyError::Rule {
                    input: s.to_owned(),
                    message: "expected `allow` or `deny`".into(),
                });
            }
        };
        Rule::parse(verdict, t)
    }
}

impl Serialize for Rule {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

impl<'de> Deserialize<'de> for Rule {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Rule, D::Error> {
        let s = String::deserialize(d)?;
        s.parse().map_err(serde::de::Error::custom)
    }
}

/// Named rule sets.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, PartialOrd, Ord)]
#[serde(rename_all = "lowercase")]
pub enum Preset {
    /// Package registries: npm, PyPI, crates.io, Go modules, Debian and Ubuntu mirrors.
    Registries,
    /// GitHub: the site, its API, raw content, releases, codeload and its container registry.
    Github,
    /// Nothing.
    None,
}

/// Names every preset allows (ports 80 and 443). Kept short on purpose: a preset must be a
/// list a reader can audit. Documented in docs/NETWORK-POLICY.md.
const REGISTRIES: &[&str] = &[
    // npm
    "registry.npmjs.org",
    "registry.yarnpkg.com",
    // PyPI
    "pypi.org",
    "files.pythonhosted.org",
    // Rust
    "crates.io",
    "index.crates.io",
    "static.crates.io",
    "static.rust-lang.org",
    // Go modules
    "proxy.golang.org",
    "sum.golang.org",
    // Debian and Ubuntu
    "deb.debian.org",
    "security.debian.org",
    "archive.ubuntu.com",
    "security.ubuntu.com",
    "ports.ubuntu.com",
];

const GITHUB: &[&str] = &[
    "github.com",
    "api.github.com",
    "codeload.github.com",
    "objects.githubusercontent.com",
    "raw.githubusercontent.com",
    "*.githubusercontent.com",
    "ghcr.io",
    "pkg-containers.githubusercontent.com",
];

impl Preset {
    pub const ALL: &[Preset] = &[Preset::Registries, Preset::Github, Preset::None];

    pub fn name(self) -> &'static str {
        match self {
            Preset::Registries => "registries",
            Preset::Github => "github",
            Preset::None => "none",
        }
    }

    pub fn hosts(self) -> &'static [&'static str] {
        match self {
            Preset::Registries => REGISTRIES,
            Preset::Github => GITHUB,
            Preset::None => &[],
        }
    }

    pub fn rules(self) -> Vec<Rule> {
        self.hosts()
            .iter()
            .map(|h| Rule::parse(Verdict::Allow, h).expect("preset hosts are valid rules"))
            .collect()
    }
}

impl FromStr for Preset {
    type Err = PolicyError;
    fn from_str(s: &str) -> Result<Preset, PolicyError> {
        Preset::ALL
            .iter()
            .copied()
            .find(|p| p.name() == s.trim())
            .ok_or_else(|| PolicyError::UnknownPreset(s.to_owned()))
    }
}

/// A sandbox's policy. Evaluation: deny rules first, then allow rules (presets' and the
/// user's), default deny; the always-blocked ranges are checked before any of it by the gate.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct Policy {
    #[serde(default)]
    pub presets: Vec<Preset>,
    #[serde(default)]
    pub rules: Vec<Rule>,
}

/// Why a name or address was allowed or denied (the text goes into events).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Decision {
    Allow(String),
    Deny(String),
}

impl Policy {
    /// `registries,github,example.com:443` -> presets and allow rules.
    pub fn parse_list(list: &str) -> Result<Policy, PolicyError> {
        let mut p = Policy::default();
        for item in list.split(',').map(str::trim).filter(|s| !s.is_empty()) {
            match item.parse::<Preset>() {
                Ok(preset) => p.add_preset(preset),
                Err(_) if item.contains(['.', ':', '/']) => {
                    p.add_rule(Rule::parse(Verdict::Allow, item)?)
                }
                Err(e) => return Err(e),
            }
        }
        Ok(p)
    }

    pub fn add_preset(&mut self, p: Preset) {
        if p != Preset::None && !self.presets.contains(&p) {
            self.presets.push(p);
        }
    }

    /// Add a rule (an identical one is not added twice; an opposite one for the same target
    /// and ports is replaced).
    pub fn add_rule(&mut self, r: Rule) {
        self.rules
            .retain(|x| !(x.target == r.target && x.ports == r.ports));
        self.rules.push(r);
    }

    /// Every rule in force: the user's, then the presets'.
    pub fn effective_rules(&self) -> Vec<Rule> {
        let mut out = self.rules.clone();
        for p in &self.presets {
            out.extend(p.rules());
        }
        out
    }

    /// A name on a port (80/443): deny rules, then allow rules, default deny.
    pub fn decide_name(&self, name: &str, port: u16) -> Decision {
        let rules = self.effective_rules();
        if let Some(r) = rules
            .iter()
            .find(|r| r.verdict == Verdict::Deny && r.matches_name(name, port))
        {
            return Decision::Deny(format!("rule `{r}`"));
        }
        if let Some(r) = rules
            .iter()
            .find(|r| r.verdict == Verdict::Allow && r.matches_name(name, port))
        {
            return Decision::Allow(self.describe(r));
        }
        Decision::Deny(format!("no rule allows {name}:{port}"))
    }

    /// Whether the sandbox resolver may look a name up: it is allowed on port 80 or 443.
    pub fn decide_lookup(&self, name: &str) -> Decision {
        match self.decide_name(name, 443) {
            Decision::Allow(r) => Decision::Allow(r),
            Decision::Deny(d) => match self.decide_name(name, 80) {
                Decision::Allow(r) => Decision::Allow(r),
                Decision::Deny(_) => Decision::Deny(d),
            },
        }
    }

    /// An address on a port by IP/CIDR rules alone: `None` when no IP rule matches.
    pub fn decide_ip(&self, ip: IpAddr, port: u16) -> Option<Decision> {
        let rules = self.effective_rules();
        if let Some(r) = rules
            .iter()
            .find(|r| r.verdict == Verdict::Deny && r.matches_ip(ip, port))
        {
            return Some(Decision::Deny(format!("rule `{r}`")));
        }
        rules
            .iter()
            .find(|r| r.verdict == Verdict::Allow && r.matches_ip(ip, port))
            .map(|r| Decision::Allow(self.describe(r)))
    }

    fn describe(&self, r: &Rule) -> String {
        if self.rules.contains(r) {
            format!("rule `{r}`")
        } else {
            let p = self
                .presets
                .iter()
                .find(|p| p.rules().contains(r))
                .map_or("?", |p| p.name());
            format!("preset {p}: `{r}`")
        }
    }

    /// The policy as one line (`registries,github +example.com -*.ads.example`).
    pub fn summary(&self) -> String {
        let mut parts: Vec<String> = self.presets.iter().map(|p| p.name().to_owned()).collect();
        if parts.is_empty() {
            parts.push("none".into());
        }
        for r in &self.rules {
            parts.push(r.to_string());
        }
        parts.join(", ")
    }

    /// This policy widened with another (setup phase).
    pub fn union(&self, other: &Policy) -> Policy {
        let mut p = self.clone();
        for x in &other.presets {
            p.add_preset(*x);
        }
        for r in &other.rules {
            if !p.rules.contains(r) {
                p.rules.push(r.clone());
            }
        }
        p
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn allow(s: &str) -> Rule {
        Rule::parse(Verdict::Allow, s).unwrap_or_else(|e| panic!("{s}: {e}"))
    }

    fn policy(rules: &[&str]) -> Policy {
        let mut p = Policy::default();
        for r in rules {
            p.add_rule(r.parse().unwrap());
        }
        p
    }

    fn allowed(p: &Policy, name: &str, port: u16) -> bool {
        matches!(p.decide_name(name, port), Decision::Allow(_))
    }

    #[test]
    fn exact_and_suffix_names_match_only_what_they_say() {
        let p = policy(&["allow allowed.com", "allow *.cdn.example"]);
        assert!(allowed(&p, "allowed.com", 443));
        assert!(allowed(&p, "allowed.com", 80));
        assert!(!allowed(&p, "allowed.com", 8443));
        assert!(!allowed(&p, "allowed.com.evil.com", 443));
        assert!(!allowed(&p, "evilallowed.com", 443));
        assert!(!allowed(&p, "sub.allowed.com", 443));
        assert!(allowed(&p, "a.cdn.example", 443));
        assert!(allowed(&p, "a.b.cdn.example", 443));
        assert!(!allowed(&p, "cdn.example", 443));
        assert!(!allowed(&p, "xcdn.example", 443));
        assert!(!allowed(&p, "cdn.example.evil", 443));
    }

    #[test]
    fn rules_normalise_their_targets() {
        assert_eq!(
            allow("Allowed.COM.").target,
            Target::Name("allowed.com".into())
        );
        assert_eq!(
            allow("*.Bücher.example").target,
            Target::Suffix("xn--bcher-kva.example".into())
        );
        assert_eq!(
            allow("::ffff:1.2.3.4").target,
            Target::Net("1.2.3.4/32".parse().unwrap())
        );
        assert_eq!(
            allow("[::ffff:1.2.3.0/120]").target,
            Target::Net("1.2.3.0/24".parse().unwrap())
        );
        assert_eq!(
            allow("10.1.2.3/16").target,
            Target::Net("10.1.0.0/16".parse().unwrap())
        );
    }

    #[test]
    fn ports_parse_and_name_rules_stay_on_web_ports() {
        assert_eq!(allow("1.2.3.4:22").ports, Ports(vec![(22, 22)]));
        assert_eq!(allow("1.2.3.0/24:8000-8100,22").ports.0.len(), 2);
        assert_eq!(allow("[2606:4700::/32]:443").ports, Ports(vec![(443, 443)]));
        assert_eq!(allow("2606:4700::/32").ports, Ports::any());
        assert_eq!(allow("a.com:443").ports, Ports(vec![(443, 443)]));
        assert_eq!(allow("a.com").ports, Ports::web());
        for bad in [
            "a.com:22",
            "a.com:0",
            "a.com:80-443",
            "1.2.3.4:99999",
            "1.2.3.4:20-10",
            "*",
            "*.",
            "*.*.com",
            "a.*.com",
            "user@a.com",
            "[::1",
            "1.2.3.4/33",
            "",
        ] {
            assert!(Rule::parse(Verdict::Allow, bad).is_err(), "{bad:?} parsed");
        }
    }

    #[test]
    fn deny_wins_over_allow_and_default_is_deny() {
        let p = policy(&["allow *.example.com", "deny ads.example.com"]);
        assert!(allowed(&p, "www.example.com", 443));
        assert!(
            matches!(p.decide_name("ads.example.com", 443), Decision::Deny(r) if r.contains("deny"))
        );
        assert!(
            matches!(p.decide_name("other.org", 443), Decision::Deny(r) if r.contains("no rule"))
        );
        let p = policy(&["allow 1.2.3.0/24", "deny 1.2.3.4"]);
        assert!(matches!(
            p.decide_ip("1.2.3.5".parse().unwrap(), 22),
            Some(Decision::Allow(_))
        ));
        assert!(matches!(
            p.decide_ip("1.2.3.4".parse().unwrap(), 22),
            Some(Decision::Deny(_))
        ));
        assert!(p.decide_ip("1.2.4.4".parse().unwrap(), 22).is_none());
        assert!(matches!(
            p.decide_ip("::ffff:1.2.3.5".parse().unwrap(), 22),
            Some(Decision::Allow(_))
        ));
    }

    #[test]
    fn presets_cover_the_registries_and_github() {
        let p = Policy::parse_list("registries, github").unwrap();
        for h in [
            "registry.npmjs.org",
            "pypi.org",
            "files.pythonhosted.org",
            "index.crates.io",
            "static.crates.io",
            "deb.debian.org",
            "github.com",
            "codeload.github.com",
            "release-assets.githubusercontent.com",
        ] {
            assert!(allowed(&p, h, 443), "{h}");
        }
        assert!(!allowed(&p, "gist.github.com", 443));
        assert!(!allowed(&p, "evil.com", 443));
        let none = Policy::parse_list("none").unwrap();
        assert!(none.presets.is_empty());
        assert!(Policy::parse_list("registeries").is_err());
        let mixed = Policy::parse_list("github,example.com:443").unwrap();
        assert!(allowed(&mixed, "example.com", 443));
        assert!(!allowed(&mixed, "example.com", 80));
    }

    #[test]
    fn policy_round_trips_through_json() {
        let mut p = Policy::parse_list("registries").unwrap();
        p.add_rule("deny *.ads.example".parse().unwrap());
        p.add_rule("allow [2606:4700::/32]:443".parse().unwrap());
        p.add_rule("allow 1.2.3.4:22".parse().unwrap());
        let j = serde_json::to_string(&p).unwrap();
        assert!(j.contains("\"deny *.ads.example\""), "{j}");
        let back: Policy = serde_json::from_str(&j).unwrap();
        assert_eq!(back, p);
        assert!(serde_json::from_str::<Policy>(r#"{"rules":["allow *"]}"#).is_err());
    }

    #[test]
    fn adding_the_opposite_rule_replaces_it() {
        let mut p = policy(&["allow a.com"]);
        p.add_rule("deny a.com".parse().unwrap());
        assert_eq!(p.rules.len(), 1);
        assert!(!allowed(&p, "a.com", 443));
    }
}
