//! The sandbox resolver's message handling: parse the guest's query, build replies, and the
//! [`Upstream`] resolvers allowed names are looked up with. The decisions (which names, which
//! answers) are made by the policy gate (`network::policy::gate`).
//!
//! Owns: DNS wire format (through `hickory-proto`), the upstream lookup (`upstream.rs`:
//! UDP with TCP fallback to the host's resolver from /etc/resolv.conf or the configured one).
//! What goes upstream is a fresh query for one name and one type, with a new id and no guest
//! EDNS options or extra records, so nothing but the (allowed) name leaves the sandbox.
//!
//! Supported: one question, class IN, opcode QUERY. Other opcodes -> NOTIMP, several
//! questions or garbage -> FORMERR, other classes -> REFUSED.

pub mod upstream;

use std::fmt;
use std::net::IpAddr;

use futures_util::future::BoxFuture;
use hickory_proto::op::{Edns, Message, MessageType, OpCode, Query, ResponseCode};
use hickory_proto::rr::rdata::{A, AAAA, CNAME};
use hickory_proto::rr::{DNSClass, Name, RData, Record, RecordType};

pub use upstream::{UdpUpstream, resolv_conf_nameserver};

#[derive(Debug, thiserror::Error)]
pub enum DnsError {
    #[error("DNS upstream {0}: {1}")]
    Io(std::net::SocketAddr, std::io::Error),
    #[error("DNS upstream {0} did not answer in time")]
    Timeout(std::net::SocketAddr),
    #[error("DNS message: {0}")]
    Proto(String),
    #[error("no upstream DNS resolver configured (no nameserver in /etc/resolv.conf)")]
    NoResolver,
}

/// The question types the gate tells apart.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum QType {
    A,
    Aaaa,
    Other(u16),
}

impl fmt::Display for QType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            QType::A => f.write_str("A"),
            QType::Aaaa => f.write_str("AAAA"),
            QType::Other(n) => write!(f, "{}", RecordType::from(*n)),
        }
    }
}

impl QType {
    fn record_type(self) -> RecordType {
        match self {
            QType::A => RecordType::A,
            QType::Aaaa => RecordType::AAAA,
            QType::Other(n) => RecordType::from(n),
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Rcode {
    NoError,
    FormErr,
    ServFail,
    NxDomain,
    NotImp,
    Refused,
}

impl Rcode {
    fn code(self) -> ResponseCode {
        match self {
            Rcode::NoError => ResponseCode::NoError,
            Rcode::FormErr => ResponseCode::FormErr,
            Rcode::ServFail => ResponseCode::ServFail,
            Rcode::NxDomain => ResponseCode::NXDomain,
            Rcode::NotImp => ResponseCode::NotImp,
            Rcode::Refused => ResponseCode::Refused,
        }
    }

    fn from_code(c: ResponseCode) -> Rcode {
        match c {
            ResponseCode::NoError => Rcode::NoError,
            ResponseCode::NXDomain => Rcode::NxDomain,
            ResponseCode::Refused => Rcode::Refused,
            ResponseCode::FormErr => Rcode::FormErr,
            ResponseCode::NotImp => Rcode::NotImp,
            _ => Rcode::ServFail,
        }
    }
}

/// One answer record the resolver passes on.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Rec {
    /// Owner name, normalised (lowercase, no trailing dot).
    pub name: String,
    pub ttl: u32,
    pub data: RecData,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RecData {
    Ip(IpAddr),
    Cname(String),
}

/// An upstream's answer: its rcode and the A/AAAA/CNAME records of the answer section.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Answer {
    pub rcode: Rcode,
    pub records: Vec<Rec>,
}

impl Answer {
    /// An answer made from a static list (`test_hosts`): the addresses of the asked family.
    pub fn from_ips(name: &str, qtype: QType, ips: &[IpAddr], ttl: u32) -> Answer {
        let records = ips
            .iter()
            .filter(|ip| match qtype {
                QType::A => ip.is_ipv4(),
                QType::Aaaa => ip.is_ipv6(),
                QType::Other(_) => false,
            })
            .map(|ip| Rec {
                name: name.to_owned(),
                ttl,
                data: RecData::Ip(*ip),
            })
            .collect();
        Answer {
            rcode: Rcode::NoError,
            records,
        }
    }

    /// Split off the address records `blocked` refuses: `(kept answer, descriptions)`.
    pub fn filter(&self, blocked: impl Fn(IpAddr) -> Option<String>) -> (Answer, Vec<String>) {
        let mut dropped = Vec::new();
        let records = self
            .records
            .iter()
            .filter(|r| match &r.data {
                RecData::Ip(ip) => match blocked(*ip) {
                    Some(why) => {
                        dropped.push(why);
                        false
                    }
                    None => true,
                },
                RecData::Cname(_) => true,
            })
            .cloned()
            .collect();
        (
            Answer {
                rcode: self.rcode,
                records,
            },
            dropped,
        )
    }

    pub fn ips(&self) -> Vec<IpAddr> {
        self.records
            .iter()
            .filter_map(|r| match r.data {
                RecData::Ip(ip) => Some(ip),
                RecData::Cname(_) => None,
            })
            .collect()
    }

    pub fn min_ttl(&self) -> u32 {
        self.records.iter().map(|r| r.ttl).min().unwrap_or(0)
    }
}

/// Looks a name up for the resolver. Implementations: [`UdpUpstream`]; tests use fakes.
pub trait Upstream: Send + Sync + 'static {
    fn query(&self, name: &str, qtype: QType) -> BoxFuture<'static, Result<Answer, DnsError>>;
}

/// A parsed guest query.
#[derive(Debug, Clone)]
pub struct GuestQuery {
    pub id: u16,
    /// The name as asked (not normalised; may be empty for the root).
    pub name: String,
    pub qtype: QType,
    query: Query,
    recursion_desired: bool,
    /// The guest's EDNS payload size, if it sent EDNS.
    edns_payload: Option<u16>,
}

/// Parse a guest query; `Err(reply)` is what to send back instead (or drop, when `None`).
pub fn parse_query(bytes: &[u8]) -> Result<GuestQuery, Option<Vec<u8>>> {
    let msg = match Message::from_vec(bytes) {
        Ok(m) => m,
        Err(_) => return Err(header_only_reply(bytes, 1)),
    };
    if msg.message_type() != MessageType::Query {
        return Err(None);
    }
    if msg.op_code() != OpCode::Query {
        return Err(header_only_reply(bytes, 4));
    }
    let [query] = msg.queries() else {
        return Err(header_only_reply(bytes, 1));
    };
    let edns_payload = msg.extensions().as_ref().map(|e| e.max_payload());
    let q = GuestQuery {
        id: msg.id(),
        name: query.name().to_ascii().trim_end_matches('.').to_owned(),
        qtype: match query.query_type() {
            RecordType::A => QType::A,
            RecordType::AAAA => QType::Aaaa,
            t => QType::Other(u16::from(t)),
        },
        query: query.clone(),
        recursion_desired: msg.recursion_desired(),
        edns_payload,
    };
    if query.query_class() != DNSClass::IN {
        return Err(Some(reply(&q, Rcode::Refused, &[])));
    }
    Ok(q)
}

/// A reply without the question: only when the query cannot be parsed (id and opcode copied).
fn header_only_reply(bytes: &[u8], rcode: u8) -> Option<Vec<u8>> {
    if bytes.len() < 12 || bytes[2] & 0x80 != 0 {
        return None;
    }
    let mut h = vec![0u8; 12];
    h[0] = bytes[0];
    h[1] = bytes[1];
    h[2] = 0x80 | (bytes[2] & 0x78); // QR + the opcode
    h[3] = rcode & 0x0f;
    Some(h)
}

/// The reply to `q` with these answer records, trimmed to fit the guest's UDP size.
pub fn reply(q: &GuestQuery, rcode: Rcode, records: &[Rec]) -> Vec<u8> {
    let limit = q
        .edns_payload
        .map_or(512, |p| usize::from(p.clamp(512, 1232)));
    // The most records that fit: no record takes less than 12 bytes on the wire (a compressed
    // owner, type, class, TTL, length), and the size grows with every record kept, so a binary
    // search over that range finds it in a few builds (dropping one record per build took
    // seconds for a 64 KiB upstream answer).
    let (mut lo, mut hi) = (0, records.len().min(limit / 12));
    let fits = |n: usize| {
        let b = build_reply(q, rcode, &records[..n]);
        (b.len() <= limit).then_some(b)
    };
    if let Some(b) = fits(hi) {
        return b;
    }
    // Invariant: `lo` records fit (or lo == 0), `hi` records do not.
    while hi - lo > 1 {
        let mid = lo + (hi - lo) / 2;
        if fits(mid).is_some() {
            lo = mid;
        } else {
            hi = mid;
        }
    }
    build_reply(q, rcode, &records[..lo])
}

fn build_reply(q: &GuestQuery, rcode: Rcode, records: &[Rec]) -> Vec<u8> {
    let mut m = Message::new();
    m.set_id(q.id)
        .set_message_type(MessageType::Response)
        .set_op_code(OpCode::Query)
        .set_recursion_desired(q.recursion_desired)
        .set_recursion_available(true)
        .set_response_code(rcode.code());
    m.add_query(q.query.clone());
    for r in records {
        let Ok(name) = Name::from_ascii(format!("{}.", r.name)) else {
            continue;
        };
        let data = match &r.data {
            RecData::Ip(IpAddr::V4(v4)) => RData::A(A(*v4)),
            RecData::Ip(IpAddr::V6(v6)) => RData::AAAA(AAAA(*v6)),
            RecData::Cname(t) => match Name::from_ascii(format!("{t}.")) {
                Ok(n) => RData::CNAME(CNAME(n)),
                Err(_) => continue,
            },
        };
        m.add_answer(Record::from_rdata(name, r.ttl.min(86_400), data));
    }
    if let Some(p) = q.edns_payload {
        let mut e = Edns::new();
        e.set_max_payload(p.clamp(512, 1232));
        m.set_edns(e);
    }
    m.to_vec().unwrap_or_else(|_| {
        header_only_reply(
            &[(q.id >> 8) as u8, q.id as u8, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0],
            2,
        )
        .expect("12 bytes")
    })
}

/// The query message an upstream gets: one question, RD, a fresh id.
pub fn upstream_query(id: u16, name: &str, qtype: QType) -> Result<Vec<u8>, DnsError> {
    let n = Name::from_ascii(format!("{name}.")).map_err(|e| DnsError::Proto(e.to_string()))?;
    let mut m = Message::new();
    m.set_id(id)
        .set_message_type(MessageType::Query)
        .set_op_code(OpCode::Query)
        .set_recursion_desired(true);
    m.add_query(Query::query(n, qtype.record_type()));
    m.to_vec().map_err(|e| DnsError::Proto(e.to_string()))
}

/// Read an upstream reply to [`upstream_query`]: `None` if it does not answer that query (wrong
/// id or question: ignored, as a spoofing attempt or a stale reply). `Some(Err)` if truncated.
pub fn read_upstream_reply(
    bytes: &[u8],
    id: u16,
    name: &str,
    qtype: QType,
) -> Option<Result<Answer, DnsError>> {
    let m = Message::from_vec(bytes).ok()?;
    if m.id() != id || m.message_type() != MessageType::Response {
        return None;
    }
    let [q] = m.queries() else { return None };
    if !q
        .name()
        .to_ascii()
        .trim_end_matches('.')
        .eq_ignore_ascii_case(name)
        || q.query_type() != qtype.record_type()
    {
        return None;
    }
    if m.truncated() {
        return Some(Err(DnsError::Proto("truncated".into())));
    }
    let records = m
        .answers()
        .iter()
        .filter_map(|r| {
            let owner = r
                .name()
                .to_ascii()
                .trim_end_matches('.')
                .to_ascii_lowercase();
            let data = match r.data() {
                RData::A(a) => RecData::Ip(IpAddr::V4(a.0)),
                RData::AAAA(a) => RecData::Ip(IpAddr::V6(a.0)),
                RData::CNAME(c) => {
                    RecData::Cname(c.0.to_ascii().trim_end_matches('.').to_ascii_lowercase())
                }
                _ => return None,
            };
            Some(Rec {
                name: owner,
                ttl: r.ttl(),
                data,
            })
        })
        .collect();
    Some(Ok(Answer {
        rcode: Rcode::from_code(m.response_code()),
        records,
    }))
}

/// Test helpers: guest queries and reply readers.
#[cfg(test)]
pub mod testing {
    use super::*;

    pub fn query(id: u16, name: &str, rt: RecordType) -> Vec<u8> {
        let mut m = Message::new();
        m.set_id(id)
            .set_message_type(MessageType::Query)
            .set_recursion_desired(true);
        m.add_query(Query::query(Name::from_ascii(name).unwrap(), rt));
        m.to_vec().unwrap()
    }

    /// (rcode, answer IPs) of a reply.
    pub fn read(reply: &[u8]) -> (ResponseCode, Vec<IpAddr>) {
        let m = Message::from_vec(reply).unwrap();
        let ips = m
            .answers()
            .iter()
            .filter_map(|r| match r.data() {
                RData::A(a) => Some(IpAddr::V4(a.0)),
                RData::AAAA(a) => Some(IpAddr::V6(a.0)),
                _ => None,
            })
            .collect();
        (m.response_code(), ips)
    }
}

#[cfg(test)]
mod tests {
    use super::testing::*;
    use super::*;

    #[test]
    fn query_parses_and_reply_round_trips() {
        let q = parse_query(&query(7, "Allowed.Test.", RecordType::A)).unwrap();
        assert_eq!((q.id, q.qtype), (7, QType::A));
        assert_eq!(q.name, "Allowed.Test");
        let recs = [Rec {
            name: "allowed.test".into(),
            ttl: 30,
            data: RecData::Ip("203.0.113.10".parse().unwrap()),
        }];
        let r = reply(&q, Rcode::NoError, &recs);
        let (code, ips) = read(&r);
        assert_eq!(code, ResponseCode::NoError);
        assert_eq!(ips, vec!["203.0.113.10".parse::<IpAddr>().unwrap()]);
        assert_eq!(u16::from_be_bytes([r[0], r[1]]), 7);
    }

    #[test]
    fn garbage_gets_formerr_or_nothing() {
        assert_eq!(parse_query(b"xx").unwrap_err(), None);
        let mut bad = query(9, "a.test.", RecordType::A);
        bad.truncate(14);
        let reply = parse_query(&bad).unwrap_err().expect("a FORMERR reply");
        assert_eq!((reply[0], reply[1], reply[3] & 0x0f), (0, 9, 1));
        // A response sent to the resolver is dropped.
        let mut resp = query(9, "a.test.", RecordType::A);
        resp[2] |= 0x80;
        assert_eq!(parse_query(&resp).unwrap_err(), None);
    }

    #[test]
    fn large_answers_are_trimmed_to_512_bytes_without_edns() {
        let q = parse_query(&query(1, "many.test.", RecordType::A)).unwrap();
        let recs: Vec<Rec> = (0..100u8)
            .map(|i| Rec {
                name: "many.test".into(),
                ttl: 60,
                data: RecData::Ip(IpAddr::from([203, 0, 113, i])),
            })
            .collect();
        let r = reply(&q, Rcode::NoError, &recs);
        assert!(r.len() <= 512, "{}", r.len());
        assert!(read(&r).1.len() > 10);
    }

    /// A TCP upstream answer can carry ~4,000 A records (64 KiB); trimming it to the guest's
    /// UDP size must not rebuild the reply once per dropped record (that took seconds of a
    /// runtime worker per query), and still keeps as many records as fit.
    #[test]
    fn a_huge_upstream_answer_is_trimmed_quickly_and_fully() {
        let q = parse_query(&query(1, "many.test.", RecordType::A)).unwrap();
        let recs: Vec<Rec> = (0..4000u32)
            .map(|i| Rec {
                name: "many.test".into(),
                ttl: 60,
                data: RecData::Ip(IpAddr::from((0xcb00_7100u32 + i).to_be_bytes())),
            })
            .collect();
        let t = std::time::Instant::now();
        let r = reply(&q, Rcode::NoError, &recs);
        let took = t.elapsed();
        assert!(r.len() <= 512, "{}", r.len());
        let kept = read(&r).1.len();
        let one_more = build_reply(&q, Rcode::NoError, &recs[..kept + 1]);
        assert!(
            one_more.len() > 512,
            "kept {kept} records but one more fits"
        );
        assert!(
            took < std::time::Duration::from_millis(500),
            "trimming took {took:?}"
        );
    }

    #[test]
    fn upstream_reply_must_match_id_and_question() {
        let q = upstream_query(42, "a.test", QType::A).unwrap();
        let gq = parse_query(&q).unwrap();
        let recs = [Rec {
            name: "a.test".into(),
            ttl: 5,
            data: RecData::Ip("203.0.113.1".parse().unwrap()),
        }];
        let r = reply(&gq, Rcode::NoError, &recs);
        let a = read_upstream_reply(&r, 42, "a.test", QType::A)
            .unwrap()
            .unwrap();
        assert_eq!(a.ips(), vec!["203.0.113.1".parse::<IpAddr>().unwrap()]);
        assert!(read_upstream_reply(&r, 43, "a.test", QType::A).is_none());
        assert!(read_upstream_reply(&r, 42, "b.test", QType::A).is_none());
        assert!(read_upstream_reply(&r, 42, "a.test", QType::Aaaa).is_none());
    }
}
