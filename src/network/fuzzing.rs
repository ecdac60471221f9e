//! What the network fuzz targets check on one input, shared with the unit tests that replay the
//! saved corpora (`fuzz/corpus/<target>/`, replayed by `cargo test` in CI; `cargo xtask fuzz`
//! grows them). Compiled both here and, by path, into the fuzz crate (which compiles the whole
//! `network` module from `src/network/mod.rs`): it may only use `crate::network` (and
//! `crate::telemetry::metrics`, which the fuzz crate stubs).
//!
//! Targets: `sniff` (the TLS ClientHello and HTTP/1 Host sniffers the policy reads a flow's first
//! bytes with), `dns_msg` (a guest DNS query through the parser, the reply builder and the
//! policy gate's resolver; the same bytes as an upstream reply and as a UDP answer to cut down)
//! `stack_frames` (in [`super::stack::fuzzing`]: bytes from QEMU's netdev socket into a
//! whole stack) and `placeholders` (an HTTP/1 request head through the interceptor's block check
//! and placeholder finder, and through the streaming scrubber split at a chosen offset).
//!
//! Every check panics on a violation: a parser that panics, allocates without bound (the
//! fuzzer's memory limit catches that) or answers something that breaks the contract below.

use std::collections::HashMap;
use std::net::{IpAddr, Ipv4Addr};
use std::sync::{Arc, OnceLock};

use futures_util::future::BoxFuture;
use hickory_proto::op::{Message, MessageType};

use super::dns::{self, Answer, DnsError, QType, Rcode, Rec, RecData, Upstream};
use super::gate::Gate;
use super::policy::{GateSettings, NetEvent, NetEventSink, Policy, PolicyGate, host};
use super::sniff::{self, Sniffed};

#[allow(unused_imports)] // the fuzz targets and the corpus replay use it
pub use super::stack::fuzzing::stack_frames;

/// A name a sniffer returns must be what the policy would store: normalised, a name (never an
/// IP literal), and bounded.
fn check_host(n: &str) {
    assert!(!n.is_empty() && n.len() <= 253, "host name {n:?}");
    assert_eq!(
        host::normalize(n).ok(),
        Some(host::Host::Name(n.to_owned())),
        "a sniffed host is already normalised: {n:?}"
    );
}

/// `sniff`: the first byte picks the sniffer (bit 0: TLS or HTTP) and the HTTP connection's port
/// (bit 1: 80 or 8080); the rest are the flow's first bytes. Both must decide (or ask for more)
/// without panicking; a name must be normalised; every prefix of the input must be answered
/// too (the stack calls the sniffer again as bytes arrive), and once a prefix is decided a
/// longer input never turns back into "need more".
pub fn sniff(data: &[u8]) {
    let Some((&pick, rest)) = data.split_first() else {
        return;
    };
    let port = if pick & 2 == 0 { 80 } else { 8080 };
    let run = |b: &[u8]| {
        if pick & 1 == 0 {
            sniff::tls_sni(b)
        } else {
            sniff::http_host(b, port)
        }
    };
    let whole = run(rest);
    if let Sniffed::Host(n) = &whole {
        check_host(n);
    }
    // The stack feeds segments as they come: try a few cut points, as a slow guest would.
    for cut in [1, 5, 9, rest.len() / 2, rest.len().saturating_sub(1)] {
        if cut >= rest.len() {
            continue;
        }
        let part = run(&rest[..cut]);
        if let Sniffed::Host(n) = &part {
            check_host(n);
        }
        if pick & 1 == 0 && part != Sniffed::NeedMore {
            // A ClientHello is decided by its own length fields: more bytes change nothing.
            assert_eq!(
                part, whole,
                "TLS sniff of a prefix ({cut} bytes) decided differently"
            );
        }
    }
}

/// An upstream that knows every name: two addresses (one public, one the policy must strip:
/// a private address) and a CNAME.
struct FuzzUpstream;

impl Upstream for FuzzUpstream {
    fn query(&self, name: &str, qtype: QType) -> BoxFuture<'static, Result<Answer, DnsError>> {
        let mut a = Answer::from_ips(
            name,
            qtype,
            &[
                IpAddr::V4(Ipv4Addr::new(93, 184, 216, 34)),
                IpAddr::V4(Ipv4Addr::new(10, 0, 0, 1)),
                "2606:2800::1".parse().expect("literal"),
            ],
            30,
        );
        a.records.push(Rec {
            name: name.to_owned(),
            ttl: 5,
            data: RecData::Cname(format!("cdn.{name}")),
        });
        Box::pin(async move { Ok(a) })
    }
}

/// The policy gate the DNS target asks, with a policy allowing a few names (so both the
/// "refused" and the "resolved and filtered" paths run). Its pins grow with every answered
/// name; that map is the gate's own bounded state, and it is shared across inputs.
fn dns_gate() -> &'static (Arc<PolicyGate>, tokio::runtime::Runtime) {
    static GATE: OnceLock<(Arc<PolicyGate>, tokio::runtime::Runtime)> = OnceLock::new();
    GATE.get_or_init(|| {
        let mut p = Policy::default();
        for r in ["allow example.com", "allow *.github.com", "allow a.b"] {
            p.add_rule(r.parse().expect("a valid rule"));
        }
        let mut settings = GateSettings::new(Arc::new(FuzzUpstream));
        settings.static_hosts = HashMap::from([(
            "static.test".to_owned(),
            vec![IpAddr::V4(Ipv4Addr::new(203, 0, 113, 1))],
        )]);
        let sink: NetEventSink = Arc::new(|_: &str, _: NetEvent| {});
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_time()
            .build()
            .expect("a current-thread runtime");
        (PolicyGate::new("sbx_fuzz", p, Arc::new(settings), sink), rt)
    })
}

/// A reply the resolver sends to the guest must parse, answer the query it was given, and fit
/// the guest's UDP size.
fn check_reply(q: &dns::GuestQuery, reply: &[u8]) {
    let m = Message::from_vec(reply).expect("our reply parses");
    assert_eq!(m.id(), q.id);
    assert_eq!(m.message_type(), MessageType::Response);
    assert!(m.queries().len() <= 1);
    assert!(reply.len() <= 1232, "reply of {} bytes", reply.len());
}

/// `dns_msg`: the bytes as a guest query (parser, reply builder, the policy gate's resolver),
/// as an upstream's reply (to the query the same bytes ask, so the "it answers us" path runs),
/// and as an answer the stack must cut down for UDP.
pub fn dns_msg(data: &[u8]) {
    match dns::parse_query(data) {
        Ok(q) => {
            let recs = [
                Rec {
                    name: q.name.clone(),
                    ttl: u32::MAX,
                    data: RecData::Ip(IpAddr::V4(Ipv4Addr::LOCALHOST)),
                },
                Rec {
                    name: q.name.clone(),
                    ttl: 1,
                    data: RecData::Cname(format!("x.{}", q.name)),
                },
            ];
            for rcode in [Rcode::NoError, Rcode::NxDomain, Rcode::Refused] {
                check_reply(&q, &dns::reply(&q, rcode, &recs));
            }
            let many = vec![recs[0].clone(); 200];
            check_reply(&q, &dns::reply(&q, Rcode::NoError, &many));
        }
        Err(Some(r)) => {
            // A bare header (unparsable) or a refusal: a response with the query's id.
            let m = Message::from_vec(&r).expect("our refusal parses");
            assert_eq!(m.id().to_be_bytes(), data[..2], "with the query's id");
            assert_eq!(m.message_type(), MessageType::Response);
            assert!(r.len() <= 1232, "refusal of {} bytes", r.len());
        }
        Err(None) => {}
    }
    // The policy gate's whole resolver path: its answer (if any) goes to the guest verbatim.
    let (gate, rt) = dns_gate();
    if let Some(reply) = rt.block_on(gate.dns(data.to_vec())) {
        let m = Message::from_vec(&reply).expect("the gate's reply parses");
        assert_eq!(m.message_type(), MessageType::Response);
        assert!(reply.len() <= 1232, "gate reply of {} bytes", reply.len());
    }
    // As an upstream's reply: answer the question it carries, with its own id.
    if let Ok(m) = Message::from_vec(data)
        && let [q] = m.queries()
    {
        let name = q.name().to_ascii();
        let name = name.trim_end_matches('.');
        for qtype in [QType::A, QType::Aaaa] {
            if let Some(Ok(a)) = dns::read_upstream_reply(data, m.id(), name, qtype) {
                let (kept, _) = a.filter(|ip| ip.is_loopback().then(|| "loopback".into()));
                assert!(kept.records.len() <= a.records.len());
                let _ = (a.ips(), a.min_ttl());
            }
        }
    }
    super::stack::fuzzing::dns_truncated(data);
}

/// The placeholder of the `placeholders` target's one secret (for api.test).
pub const FUZZ_PLACEHOLDER: &str = "tbx_aaaabbbbccccddddeeeeffffgggghhhh";

/// `placeholders`: the first byte picks where the rest is split for the streaming scrubber; the
/// rest is an HTTP/1 request head (or anything). Nothing may panic; a block must be explained by
/// the placeholder finder; the streamed scrub must equal the one-shot scrub.
pub fn placeholders(data: &[u8]) {
    use super::intercept::scrub::{Replacer, StreamReplace, rendered_forms};
    use super::intercept::swap;
    use crate::secrets::{Binding, Snapshot, Value};
    let Some((&pick, rest)) = data.split_first() else {
        return;
    };
    let value = b"sk-live/+=\"value";
    let snap = Snapshot {
        bindings: vec![Binding {
            name: "KEY".into(),
            hosts: vec!["api.test".into()],
            headers: vec!["x-extra".into()],
            in_body: false,
            placeholder: FUZZ_PLACEHOLDER.into(),
            value: Value::new(value.to_vec()),
        }],
        git: vec![],
    };
    if let Some(b) = swap::find_blocked_in_http1(rest, &snap, "other.test") {
        assert_eq!(b.secret, "KEY");
        assert!(swap::contains_placeholder(rest, FUZZ_PLACEHOLDER));
    }
    assert!(swap::find_blocked_in_http1(rest, &snap, "api.test").is_none());
    let _ = swap::find_in_dns_name(&snap, &String::from_utf8_lossy(rest));
    let r = Replacer::new(rendered_forms(
        value,
        FUZZ_PLACEHOLDER.as_bytes(),
        &[(b"u:sk".to_vec(), b"u:tbx".to_vec())],
    ))
    .expect("patterns");
    let whole = r.replace_all(rest);
    let cut = usize::from(pick) % (rest.len() + 1);
    let mut s = StreamReplace::new(r);
    let mut out = s.push(&rest[..cut]);
    out.extend(s.push(&rest[cut..]));
    out.extend(s.finish());
    assert_eq!(out, whole, "streamed scrub differs (split at {cut})");
}

#[cfg(test)]
#[path = "fuzzing_tests.rs"]
mod tests;
