//! Host normalisation: every name the policy compares (rules, SNI, HTTP Host, DNS questions,
//! agent requests) goes through [`normalize`] first, so matching tricks cannot slip past.
//!
//! What it does: lowercases; strips one trailing dot (`a.com.` = `a.com`); maps Unicode names
//! to their ASCII (punycode) form with IDNA/UTS 46 and checks `xn--` labels decode; turns IP
//! literals (`1.2.3.4`, `[::1]`, `::ffff:127.0.0.1`) into [`Host::Ip`] (IPv4-mapped IPv6 folds
//! to IPv4); refuses userinfo (`a.com@b.com`), empty labels, over-long names, characters that
//! are not letters/digits/`-`/`_`, and all-numeric last labels (`127.1`, `0x7f.1`,
//! `2130706433`, which URL parsers read as IPv4). Ports are split off by [`split_host_port`].

use std::net::IpAddr;

#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Host {
    /// A DNS name: lowercase ASCII, no trailing dot.
    Name(String),
    Ip(IpAddr),
}

impl std::fmt::Display for Host {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Host::Name(n) => f.write_str(n),
            Host::Ip(ip) => write!(f, "{ip}"),
        }
    }
}

#[derive(Debug, Clone, thiserror::Error, PartialEq, Eq)]
pub enum HostError {
    #[error("`{0}` is empty or not a host name")]
    Empty(String),
    #[error("`{0}` carries userinfo (`@`); give the host alone")]
    Userinfo(String),
    #[error("`{0}` is not a valid host name: {1}")]
    Invalid(String, &'static str),
    #[error("`{0}` has an invalid port")]
    Port(String),
}

/// The IPv4 address inside an IPv4-mapped IPv6 address (`::ffff:a.b.c.d`), else the address.
pub fn canonical_ip(ip: IpAddr) -> IpAddr {
    match ip {
        IpAddr::V6(v6) => match v6.to_ipv4_mapped() {
            Some(v4) => IpAddr::V4(v4),
            None => IpAddr::V6(v6),
        },
        v4 => v4,
    }
}

/// Split `host[:port]` / `[v6][:port]`. A bare IPv6 literal (two or more colons, no brackets)
/// has no port.
pub fn split_host_port(s: &str) -> Result<(&str, Option<u16>), HostError> {
    let port = |p: &str| -> Result<u16, HostError> {
        if p.is_empty() || !p.bytes().all(|b| b.is_ascii_digit()) || p.len() > 5 {
            return Err(HostError::Port(s.to_owned()));
        }
        p.parse::<u16>()
            .ok()
            .filter(|p| *p != 0)
            .ok_or_else(|| HostError::Port(s.to_owned()))
    };
    if let Some(rest) = s.strip_prefix('[') {
        let (inner, after) = rest
            .split_once(']')
            .ok_or(HostError::Invalid(s.to_owned(), "unclosed `[`"))?;
        return match after {
            "" => Ok((inner, None)),
            a => match a.strip_prefix(':') {
                Some(p) => Ok((inner, Some(port(p)?))),
                None => Err(HostError::Invalid(s.to_owned(), "junk after `]`")),
            },
        };
    }
    match s.matches(':').count() {
        0 => Ok((s, None)),
        1 => {
            let (h, p) = s.split_once(':').expect("one colon");
            Ok((h, Some(port(p)?)))
        }
        _ => Ok((s, None)),
    }
}

/// Normalise a host (no port). See the module docs for what is refused.
pub fn normalize(input: &str) -> Result<Host, HostError> {
    let bad = |why| HostError::Invalid(input.to_owned(), why);
    if input.is_empty() {
        return Err(HostError::Empty(input.to_owned()));
    }
    if input.contains('@') {
        return Err(HostError::Userinfo(input.to_owned()));
    }
    if input.len() > 1024 {
        return Err(bad("too long"));
    }
    let unbracketed = input
        .strip_prefix('[')
        .and_then(|s| s.strip_suffix(']'))
        .unwrap_or(input);
    if let Ok(ip) = unbracketed.parse::<IpAddr>() {
        return Ok(Host::Ip(canonical_ip(ip)));
    }
    if input
        .chars()
        .any(|c| c.is_control() || c.is_whitespace() || "/\\?#%[]<>\"'`|^{}".contains(c))
    {
        return Err(bad("forbidden character"));
    }
    if input.contains(':') {
        // Not a valid IPv6 literal (e.g. with a zone `%eth0`, refused above) and not a name.
        return Err(bad("colon in a host name"));
    }
    let trimmed = input.strip_suffix('.').unwrap_or(input);
    if trimmed.is_empty() || trimmed.ends_with('.') {
        return Err(bad("empty label"));
    }
    let ascii = idna::domain_to_ascii(trimmed).map_err(|_| bad("IDNA conversion failed"))?;
    // UTS 46 maps full-width dots and the like; check the result ourselves.
    if ascii.is_empty() || ascii.len() > 253 {
        return Err(bad("length"));
    }
    let labels: Vec<&str> = ascii.split('.').collect();
    for l in &labels {
        if l.is_empty() {
            return Err(bad("empty label"));
        }
        if l.len() > 63 {
            return Err(bad("label longer than 63"));
        }
        if !l
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-' || b == b'_')
        {
            return Err(bad("character outside [a-z0-9-_]"));
        }
        if l.starts_with('-') || l.ends_with('-') {
            return Err(bad("label starts or ends with `-`"));
        }
        if let Some(puny) = l.strip_prefix("xn--") {
            // A label that claims to be punycode must decode (idna checked it, unless the
            // input was already ASCII and passed through).
            if puny.is_empty() || idna::punycode::decode_to_string(puny).is_none() {
                return Err(bad("invalid punycode label"));
            }
        }
    }
    let last = labels.last().expect("at least one label");
    if looks_numeric(last) {
        return Err(bad("numeric last label (an IPv4 address in disguise)"));
    }
    Ok(Host::Name(ascii))
}

/// `123`, `0x7f`, `0177`: what URL parsers accept as IPv4 parts.
fn looks_numeric(label: &str) -> bool {
    let hex = label
        .strip_prefix("0x")
        .is_some_and(|h| h.bytes().all(|b| b.is_ascii_hexdigit()));
    hex || label.bytes().all(|b| b.is_ascii_digit())
}

/// A name only (IP literals refused), normalised.
pub fn normalize_name(input: &str) -> Result<String, HostError> {
    match normalize(input)? {
        Host::Name(n) => Ok(n),
        Host::Ip(_) => Err(HostError::Invalid(
            input.to_owned(),
            "an IP address where a name is needed",
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn name(s: &str) -> String {
        match normalize(s).unwrap_or_else(|e| panic!("{s}: {e}")) {
            Host::Name(n) => n,
            h => panic!("{s} gave {h:?}"),
        }
    }

    #[test]
    fn case_and_trailing_dot_fold() {
        assert_eq!(name("GitHub.COM"), "github.com");
        assert_eq!(name("github.com."), "github.com");
        assert!(normalize("github.com..").is_err());
        assert!(normalize(".").is_err());
        assert!(normalize("a..b").is_err());
        assert!(normalize(".a.com").is_err());
    }

    #[test]
    fn unicode_becomes_punycode_and_lookalikes_differ() {
        assert_eq!(name("bücher.example"), "xn--bcher-kva.example");
        assert_eq!(name("XN--BCHER-KVA.example"), "xn--bcher-kva.example");
        // Cyrillic `і` in "gіthub.com" must not equal github.com.
        let spoof = name("g\u{0456}thub.com");
        assert_ne!(spoof, "github.com");
        assert!(spoof.starts_with("xn--"), "{spoof}");
        // Full-width dot is a dot after UTS 46 mapping.
        assert_eq!(name("github\u{ff0e}com"), "github.com");
    }

    #[test]
    fn invalid_punycode_is_refused() {
        assert!(normalize("xn--.com").is_err());
        assert!(normalize("xn--zz-%.com").is_err());
    }

    #[test]
    fn userinfo_and_junk_are_refused() {
        assert!(matches!(
            normalize("github.com@evil.com"),
            Err(HostError::Userinfo(_))
        ));
        for s in [
            "a b.com",
            "a/b.com",
            "a\\b.com",
            "a.com\0",
            "a.com#x",
            "a.com?x",
            "",
            "-a.com",
            "a-.com",
            "a.com:443",
            "fe80::1%eth0",
        ] {
            assert!(normalize(s).is_err(), "{s:?} accepted");
        }
    }

    #[test]
    fn ip_literals_become_ips_and_mapped_forms_fold() {
        assert_eq!(
            normalize("127.0.0.1").unwrap(),
            Host::Ip("127.0.0.1".parse().unwrap())
        );
        assert_eq!(
            normalize("[::1]").unwrap(),
            Host::Ip("::1".parse().unwrap())
        );
        assert_eq!(
            normalize("::ffff:127.0.0.1").unwrap(),
            Host::Ip("127.0.0.1".parse().unwrap())
        );
        assert_eq!(
            normalize("[::ffff:7f00:1]").unwrap(),
            Host::Ip("127.0.0.1".parse().unwrap())
        );
        assert!(normalize_name("10.0.0.1").is_err());
    }

    #[test]
    fn numeric_disguises_of_ipv4_are_refused() {
        for s in [
            "127.1",
            "2130706433",
            "0x7f.1",
            "0x7f000001",
            "1.2.3.04",
            "a.123",
        ] {
            assert!(normalize(s).is_err(), "{s} accepted as a name");
        }
        assert_eq!(name("1password.com"), "1password.com");
        assert_eq!(name("a.b2"), "a.b2");
    }

    #[test]
    fn host_port_splits() {
        assert_eq!(
            split_host_port("a.com:8080").unwrap(),
            ("a.com", Some(8080))
        );
        assert_eq!(split_host_port("a.com").unwrap(), ("a.com", None));
        assert_eq!(split_host_port("[::1]:443").unwrap(), ("::1", Some(443)));
        assert_eq!(split_host_port("::1").unwrap(), ("::1", None));
        assert!(split_host_port("a.com:").is_err());
        assert!(split_host_port("a.com:0").is_err());
        assert!(split_host_port("a.com:65536").is_err());
        assert!(split_host_port("a.com:+80").is_err());
        assert!(split_host_port("[::1]x").is_err());
    }

    #[test]
    fn too_long_names_are_refused() {
        let label = "a".repeat(64);
        assert!(normalize(&format!("{label}.com")).is_err());
        let long = vec!["abcdefghi"; 30].join(".") + ".com";
        assert!(normalize(&long).is_err());
    }
}
