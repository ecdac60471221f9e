//! PolicyGate: every decision path, with a fake upstream resolver that counts its queries.

use std::collections::HashMap;
use std::net::{IpAddr, SocketAddr};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use futures_util::future::BoxFuture;
use hickory_proto::op::ResponseCode;
use hickory_proto::rr::RecordType;

use super::*;
use crate::network::dns::testing::{query, read};
use crate::network::dns::{Answer, DnsError, QType, Rcode, Upstream};
use crate::network::gate::{GATEWAY_V4, GUEST_V4};
use crate::network::sniff::testing::client_hello;

/// Answers from a table; counts every query it is asked.
#[derive(Default)]
struct FakeUpstream {
    table: HashMap<String, Vec<IpAddr>>,
    asked: Arc<Mutex<Vec<String>>>,
    count: Arc<AtomicUsize>,
}

impl Upstream for FakeUpstream {
    fn query(&self, name: &str, qtype: QType) -> BoxFuture<'static, Result<Answer, DnsError>> {
        self.count.fetch_add(1, Ordering::SeqCst);
        self.asked.lock().unwrap().push(name.to_owned());
        let a = match self.table.get(name) {
            Some(ips) => Answer::from_ips(name, qtype, ips, 30),
            None => Answer {
                rcode: Rcode::NxDomain,
                records: vec![],
            },
        };
        Box::pin(async move { Ok(a) })
    }
}

struct T {
    gate: Arc<PolicyGate>,
    asked: Arc<Mutex<Vec<String>>>,
    count: Arc<AtomicUsize>,
    events: Arc<Mutex<Vec<NetEvent>>>,
}

fn ips(list: &[&str]) -> Vec<IpAddr> {
    list.iter().map(|s| s.parse().unwrap()).collect()
}

fn setup(policy: &str, table: &[(&str, &[&str])]) -> T {
    setup_with(policy, table, |_| {})
}

fn setup_with(policy: &str, table: &[(&str, &[&str])], f: impl FnOnce(&mut GateSettings)) -> T {
    let up = FakeUpstream {
        table: table.iter().map(|(n, a)| (n.to_string(), ips(a))).collect(),
        ..Default::default()
    };
    let (asked, count) = (up.asked.clone(), up.count.clone());
    let mut settings = GateSettings::new(Arc::new(up));
    f(&mut settings);
    let events = Arc::new(Mutex::new(Vec::new()));
    let ev = events.clone();
    let sink: NetEventSink = Arc::new(move |sbx: &str, e: NetEvent| {
        assert_eq!(sbx, "sbx_test");
        ev.lock().unwrap().push(e);
    });
    let mut p = Policy::default();
    for r in policy.split(';').map(str::trim).filter(|s| !s.is_empty()) {
        p.add_rule(r.parse().unwrap());
    }
    T {
        gate: PolicyGate::new("sbx_test", p, Arc::new(settings), sink),
        asked,
        count,
        events,
    }
}

fn tcp(dst: &str) -> Flow {
    Flow {
        proto: Proto::Tcp,
        src: SocketAddr::new(IpAddr::V4(GUEST_V4), 40000),
        dst: dst.parse().unwrap(),
    }
}

fn udp(dst: &str) -> Flow {
    Flow {
        proto: Proto::Udp,
        ..tcp(dst)
    }
}

async fn resolve(t: &T, name: &str) -> (ResponseCode, Vec<IpAddr>) {
    let r = t
        .gate
        .dns(query(1, name, RecordType::A))
        .await
        .expect("a reply");
    read(&r)
}

fn denied(v: ConnectVerdict) -> String {
    match v {
        ConnectVerdict::Deny { reason } => reason,
        a => panic!("allowed: {a:?}"),
    }
}

#[tokio::test]
async fn allowed_name_resolves_pins_and_connects_with_inspection() {
    let t = setup("allow allowed.test", &[("allowed.test", &["203.0.113.10"])]);
    assert_eq!(
        resolve(&t, "allowed.test.").await,
        (ResponseCode::NoError, ips(&["203.0.113.10"]))
    );
    let v = t.gate.connect(&tcp("203.0.113.10:443"));
    let ConnectVerdict::Allow {
        upstream, inspect, ..
    } = v
    else {
        panic!("{v:?}")
    };
    assert_eq!(
        (upstream, inspect),
        ("203.0.113.10:443".parse().unwrap(), Inspect::TlsSni)
    );
    assert!(matches!(
        t.gate.connect(&tcp("203.0.113.10:80")),
        ConnectVerdict::Allow {
            inspect: Inspect::HttpHost,
            ..
        }
    ));
    let flow = tcp("203.0.113.10:443");
    assert!(matches!(
        t.gate.inspect(&flow, &client_hello("ALLOWED.test.")),
        InspectVerdict::Allow { .. }
    ));
    let ch = client_hello("allowed.test");
    assert_eq!(t.gate.inspect(&flow, &ch[..30]), InspectVerdict::NeedMore);
    let http = tcp("203.0.113.10:80");
    assert!(matches!(
        t.gate
            .inspect(&http, b"GET / HTTP/1.1\r\nHost: allowed.test\r\n\r\n"),
        InspectVerdict::Allow { .. }
    ));
}

#[tokio::test]
async fn denied_names_never_reach_the_upstream() {
    let t = setup("allow allowed.test", &[("evil.test", &["203.0.113.66"])]);
    for n in [
        "evil.test.",
        "allowed.test.evil.test.",
        "secret-data.exfil.evil.test.",
        "xallowed.test.",
    ] {
        let (code, a) = resolve(&t, n).await;
        assert_eq!((code, a.len()), (ResponseCode::NXDomain, 0), "{n}");
    }
    // TXT for a denied name: also not asked.
    let r = t
        .gate
        .dns(query(2, "evil.test.", RecordType::TXT))
        .await
        .unwrap();
    assert_eq!(read(&r).0, ResponseCode::NXDomain);
    assert_eq!(t.count.load(Ordering::SeqCst), 0, "{:?}", t.asked);
    assert!(
        t.events
            .lock()
            .unwrap()
            .iter()
            .any(|e| matches!(e, NetEvent::DnsDenied { name, .. } if name == "evil.test"))
    );
}

#[tokio::test]
async fn other_query_types_for_allowed_names_get_an_empty_answer_without_upstream() {
    let t = setup("allow allowed.test", &[("allowed.test", &["203.0.113.10"])]);
    for rt in [
        RecordType::TXT,
        RecordType::HTTPS,
        RecordType::MX,
        RecordType::ANY,
    ] {
        let r = t.gate.dns(query(3, "allowed.test.", rt)).await.unwrap();
        assert_eq!(read(&r), (ResponseCode::NoError, vec![]), "{rt}");
    }
    assert_eq!(t.count.load(Ordering::SeqCst), 0);
}

#[tokio::test]
async fn rebinding_answers_into_every_blocked_range_are_dropped() {
    for bad in [
        "127.0.0.1",
        "10.0.2.2",
        "10.1.2.3",
        "172.16.0.1",
        "192.168.1.1",
        "100.64.0.1",
        "169.254.169.254",
        "0.0.0.0",
        "::1",
        "::ffff:127.0.0.1",
        "::ffff:169.254.169.254",
        "fd00::1",
        "fe80::1",
        "64:ff9b::7f00:1",
    ] {
        let t = setup("allow rebind.test", &[("rebind.test", &[bad])]);
        let qt = if bad.contains(':') {
            RecordType::AAAA
        } else {
            RecordType::A
        };
        let r = t.gate.dns(query(4, "rebind.test.", qt)).await.unwrap();
        assert_eq!(read(&r), (ResponseCode::NXDomain, vec![]), "{bad}");
        let dst = SocketAddr::new(bad.parse().unwrap(), 443);
        assert!(matches!(
            t.gate.connect(&Flow {
                dst,
                ..tcp("1.1.1.1:443")
            }),
            ConnectVerdict::Deny { .. }
        ));
    }
    // Mixed answers keep the public address only.
    let t = setup(
        "allow mixed.test",
        &[("mixed.test", &["127.0.0.1", "203.0.113.7"])],
    );
    assert_eq!(
        resolve(&t, "mixed.test.").await,
        (ResponseCode::NoError, ips(&["203.0.113.7"]))
    );
}

#[test]
fn hard_coded_ips_and_unresolved_addresses_are_denied() {
    let t = setup("allow allowed.test", &[]);
    let r = denied(t.gate.connect(&tcp("203.0.113.10:443")));
    assert!(r.contains("hard-coded"), "{r}");
    assert!(matches!(
        t.gate.connect(&tcp("203.0.113.10:22")),
        ConnectVerdict::Deny { .. }
    ));
}

#[tokio::test]
async fn allowed_sni_to_another_address_is_denied() {
    let t = setup(
        "allow allowed.test; allow other.test",
        &[
            ("allowed.test", &["203.0.113.10"]),
            ("other.test", &["203.0.113.20"]),
        ],
    );
    resolve(&t, "allowed.test.").await;
    resolve(&t, "other.test.").await;
    // Connect to other.test's IP (pinned, allowed) but claim allowed.test in the SNI.
    let flow = tcp("203.0.113.20:443");
    assert!(matches!(
        t.gate.connect(&flow),
        ConnectVerdict::Allow { .. }
    ));
    let InspectVerdict::Deny { reason, host } =
        t.gate.inspect(&flow, &client_hello("allowed.test"))
    else {
        panic!("allowed")
    };
    assert!(reason.contains("never answered"), "{reason}");
    // The event names the name the guest sent, not the one pinned to the address.
    assert_eq!(host.as_deref(), Some("allowed.test"));
    // Same with a Host header on :80.
    let v = t.gate.inspect(
        &tcp("203.0.113.20:80"),
        b"GET / HTTP/1.1\r\nHost: allowed.test\r\n\r\n",
    );
    assert!(matches!(v, InspectVerdict::Deny { .. }), "{v:?}");
}

#[tokio::test]
async fn sni_of_a_denied_name_on_an_allowed_address_is_denied() {
    let t = setup(
        "allow allowed.test; deny bad.allowed.test",
        &[("allowed.test", &["203.0.113.10"])],
    );
    resolve(&t, "allowed.test.").await;
    let flow = tcp("203.0.113.10:443");
    for sni in [
        "evil.test",
        "bad.allowed.test",
        "allowed.test.evil.test",
        "203.0.113.10",
    ] {
        assert!(
            matches!(
                t.gate.inspect(&flow, &client_hello(sni)),
                InspectVerdict::Deny { .. }
            ),
            "{sni}"
        );
    }
    // The denial names the SNI, not allowed.test (the name pinned to the address).
    assert!(matches!(
        t.gate.inspect(&flow, &client_hello("evil.test")),
        InspectVerdict::Deny { host: Some(h), .. } if h == "evil.test"
    ));
}

#[tokio::test]
async fn policy_changes_apply_to_the_next_decision() {
    let t = setup("allow allowed.test", &[("allowed.test", &["203.0.113.10"])]);
    resolve(&t, "allowed.test.").await;
    let flow = tcp("203.0.113.10:443");
    assert!(matches!(
        t.gate.connect(&flow),
        ConnectVerdict::Allow { .. }
    ));
    let mut p = (*t.gate.policy()).clone();
    p.add_rule("deny allowed.test".parse().unwrap());
    t.gate.set_policy(p);
    assert!(matches!(t.gate.connect(&flow), ConnectVerdict::Deny { .. }));
    assert!(matches!(
        t.gate.inspect(&flow, &client_hello("allowed.test")),
        InspectVerdict::Deny { .. }
    ));
    assert_eq!(resolve(&t, "allowed.test.").await.0, ResponseCode::NXDomain);
}

#[test]
fn blocked_ranges_win_over_every_rule() {
    let t = setup(
        "allow 0.0.0.0/0; allow ::/0; allow 127.0.0.1; allow 169.254.169.254:80",
        &[],
    );
    for dst in [
        "127.0.0.1:80",
        "[::ffff:127.0.0.1]:80",
        "169.254.169.254:80",
        "10.0.2.2:80",
        "10.0.2.2:22",
        "192.168.1.1:443",
        "100.100.100.200:80",
        "[fe80::1]:443",
        "[fd00:ec2::254]:80",
        "[::1]:443",
    ] {
        let r = denied(t.gate.connect(&tcp(dst)));
        assert!(r.contains("always blocked"), "{dst}: {r}");
    }
    assert!(matches!(
        t.gate.connect(&tcp("1.1.1.1:22")),
        ConnectVerdict::Allow {
            inspect: Inspect::Nothing,
            ..
        }
    ));
}

#[test]
fn host_addresses_are_blocked() {
    let t = setup("allow 0.0.0.0/0", &[]);
    let own = t.gate.inner.settings.host_addrs.get();
    for ip in own.iter().filter(|ip| !ip.is_loopback()) {
        let r = denied(t.gate.connect(&Flow {
            dst: SocketAddr::new(*ip, 443),
            ..tcp("1.1.1.1:443")
        }));
        assert!(r.contains("always blocked"), "{ip}: {r}");
    }
}

#[test]
fn udp_quic_and_direct_resolvers_are_refused() {
    let t = setup("allow 0.0.0.0/0", &[]);
    for f in [
        udp("8.8.8.8:53"),
        udp("1.1.1.1:443"),
        udp("1.1.1.1:123"),
        tcp("8.8.8.8:53"),
        tcp("1.1.1.1:853"),
        udp(&format!("{GATEWAY_V4}:53")),
    ] {
        assert!(
            matches!(t.gate.connect(&f), ConnectVerdict::Deny { .. }),
            "{f:?}"
        );
    }
}

#[test]
fn cidr_rules_with_ports_open_exactly_those_ports() {
    let t = setup("allow 203.0.113.0/24:22; deny 203.0.113.9", &[]);
    assert!(matches!(
        t.gate.connect(&tcp("203.0.113.5:22")),
        ConnectVerdict::Allow { .. }
    ));
    assert!(matches!(
        t.gate.connect(&tcp("203.0.113.5:23")),
        ConnectVerdict::Deny { .. }
    ));
    assert!(matches!(
        t.gate.connect(&tcp("203.0.113.9:22")),
        ConnectVerdict::Deny { .. }
    ));
}

#[tokio::test]
async fn test_overrides_answer_names_and_map_upstreams_after_the_policy() {
    let t = setup_with("allow allowed.test", &[], |s| {
        s.static_hosts
            .insert("allowed.test".into(), ips(&["203.0.113.10"]));
        s.upstream_map.insert(
            "203.0.113.10:80".parse().unwrap(),
            "127.0.0.1:8080".parse().unwrap(),
        );
    });
    assert_eq!(
        resolve(&t, "allowed.test.").await,
        (ResponseCode::NoError, ips(&["203.0.113.10"]))
    );
    assert_eq!(
        t.count.load(Ordering::SeqCst),
        0,
        "static hosts skip the upstream"
    );
    let ConnectVerdict::Allow { upstream, .. } = t.gate.connect(&tcp("203.0.113.10:80")) else {
        panic!()
    };
    assert_eq!(upstream, "127.0.0.1:8080".parse().unwrap());
    // The mapped loopback target itself stays unreachable for the guest.
    assert!(matches!(
        t.gate.connect(&tcp("127.0.0.1:8080")),
        ConnectVerdict::Deny { .. }
    ));
}

#[test]
fn flow_outcomes_become_events_with_the_pinned_host() {
    let t = setup("allow allowed.test", &[]);
    t.gate.inner.pins.lock().unwrap().add(
        "allowed.test",
        &ips(&["203.0.113.10"]),
        std::time::Duration::from_secs(60),
        std::time::Instant::now(),
    );
    let flow = tcp("203.0.113.10:443");
    t.gate.record(FlowEvent::Denied {
        flow,
        host: None,
        reason: "x".into(),
    });
    let ev = t.events.lock().unwrap().pop().unwrap();
    assert!(
        matches!(ev, NetEvent::Flow(FlowEvent::Denied { host: Some(ref h), .. }) if h == "allowed.test"),
        "{ev:?}"
    );
}

#[test]
fn a_flood_of_events_is_rate_limited_and_counted() {
    let t = setup_with("", &[], |s| s.events_per_sec = 5);
    for _ in 0..100 {
        t.gate.record(FlowEvent::Denied {
            flow: tcp("203.0.113.10:443"),
            host: None,
            reason: "x".into(),
        });
    }
    let n = t.events.lock().unwrap().len();
    assert!((5..=12).contains(&n), "{n} events out of 100");
}

#[tokio::test]
async fn upstream_failures_are_servfail() {
    struct Failing;
    impl Upstream for Failing {
        fn query(&self, _: &str, _: QType) -> BoxFuture<'static, Result<Answer, DnsError>> {
            Box::pin(async { Err(DnsError::NoResolver) })
        }
    }
    let settings = GateSettings::new(Arc::new(Failing));
    let mut p = Policy::default();
    p.add_rule("allow a.test".parse().unwrap());
    let gate = PolicyGate::new("sbx_x", p, Arc::new(settings), Arc::new(|_: &str, _| {}));
    let r = gate.dns(query(5, "a.test.", RecordType::A)).await.unwrap();
    assert_eq!(read(&r).0, ResponseCode::ServFail);
}

#[tokio::test]
async fn secrets_turn_interception_on_and_placeholders_elsewhere_are_blocked() {
    use crate::network::intercept::{SandboxCa, tls};
    use crate::secrets::{Binding, SandboxSecrets, Snapshot, Value};
    const PH: &str = "tbx_aaaabbbbccccddddeeeeffffgggghhhh";
    let dir = tempfile::tempdir().unwrap();
    let any_ca = rcgen::generate_simple_self_signed(vec!["ca.test".into()]).unwrap();
    let bundle = dir.path().join("ca.pem");
    std::fs::write(&bundle, any_ca.cert.pem()).unwrap();
    let t = setup_with(
        "allow api.test; allow other.test",
        &[
            ("api.test", &["203.0.113.10"]),
            ("other.test", &["203.0.113.20"]),
        ],
        |s| s.intercept_tls = Some(tls::upstream_client_config(&[&bundle]).unwrap()),
    );
    resolve(&t, "api.test.").await;
    resolve(&t, "other.test.").await;
    let secrets = SandboxSecrets::default();
    let ca = SandboxCa::load_or_create(dir.path(), &[]).unwrap();
    assert!(t.gate.set_interception(secrets.clone(), ca.clone()));
    let api = tcp("203.0.113.10:443");
    // No secret yet: pass-through.
    let v = t.gate.inspect(&api, &client_hello("api.test"));
    assert!(matches!(v, InspectVerdict::Allow { .. }), "{v:?}");
    // A secret added while running: the next flow to its host is intercepted, others are not.
    secrets.publish(Snapshot {
        bindings: vec![Binding {
            name: "KEY".into(),
            hosts: vec!["api.test".into()],
            headers: vec![],
            in_body: false,
            placeholder: PH.into(),
            value: Value::new(b"sk-live-value-123".to_vec()),
        }],
        git: vec![],
    });
    let v = t.gate.inspect(&api, &client_hello("api.test"));
    assert!(
        matches!(v, InspectVerdict::Intercept { ref host, .. } if host.as_deref() == Some("api.test")),
        "{v:?}"
    );
    assert!(
        ca.covers("api.test"),
        "the CA was re-issued for the new host"
    );
    let v = t
        .gate
        .inspect(&tcp("203.0.113.20:443"), &client_hello("other.test"));
    assert!(matches!(v, InspectVerdict::Allow { .. }), "{v:?}");
    // Plaintext HTTP to another host with the placeholder in the query: refused, with an event.
    let head = format!("GET /?k={PH} HTTP/1.1\r\nHost: other.test\r\n\r\n");
    let v = t.gate.inspect(&tcp("203.0.113.20:80"), head.as_bytes());
    assert!(matches!(v, InspectVerdict::Deny { .. }), "{v:?}");
    let blocked = |t: &T| {
        t.events
            .lock()
            .unwrap()
            .iter()
            .filter_map(|e| match e {
                NetEvent::SecretBlocked {
                    secret,
                    host,
                    position,
                } => Some(format!("{secret} {host} {position}")),
                _ => None,
            })
            .collect::<Vec<_>>()
    };
    assert_eq!(blocked(&t), ["KEY other.test query"]);
    // A plain request without it passes, handed to the checker for the requests after it.
    let v = t.gate.inspect(
        &tcp("203.0.113.20:80"),
        b"GET / HTTP/1.1\r\nHost: other.test\r\n\r\n",
    );
    assert!(matches!(v, InspectVerdict::Intercept { .. }), "{v:?}");
    // A DNS name carrying the placeholder: NXDOMAIN, upstream never asked, event.
    let before = t.count.load(Ordering::SeqCst);
    let (code, _) = resolve(&t, &format!("{PH}.other.test.")).await;
    assert_eq!(code, ResponseCode::NXDomain);
    assert_eq!(t.count.load(Ordering::SeqCst), before);
    assert_eq!(blocked(&t).len(), 2);
    assert!(blocked(&t)[1].ends_with("dns name"), "{:?}", blocked(&t));
    // The placeholder in a header of a head that arrives in pieces (the stack asks again with
    // every byte more): no prefix is let through raw, and the whole head is refused.
    let head = format!("GET / HTTP/1.1\r\nHost: other.test\r\nX-Api-Key: {PH}\r\n\r\n");
    let plain = tcp("203.0.113.20:80");
    for cut in 1..head.len() {
        let v = t.gate.inspect(&plain, &head.as_bytes()[..cut]);
        assert!(
            matches!(
                v,
                InspectVerdict::NeedMore | InspectVerdict::Intercept { .. }
            ),
            "cut {cut}: {v:?}"
        );
    }
    assert_eq!(blocked(&t).len(), 2, "{:?}", blocked(&t));
    let v = t.gate.inspect(&plain, head.as_bytes());
    assert!(matches!(v, InspectVerdict::Deny { .. }), "{v:?}");
    assert_eq!(
        blocked(&t).last().map(String::as_str),
        Some("KEY other.test header x-api-key")
    );
}

fn with_proxy(no_proxy: &[&str]) -> impl FnOnce(&mut GateSettings) {
    let np: Vec<String> = no_proxy.iter().map(|s| s.to_string()).collect();
    move |s: &mut GateSettings| {
        let p = crate::network::upstream_proxy::resolve(
            Some("http://127.0.0.1:3128"),
            Some(&np),
            |_| None,
        );
        s.upstream_proxy = Some(Arc::new(p.unwrap().unwrap()));
    }
}

#[tokio::test]
async fn behind_a_proxy_an_allowed_name_the_host_cannot_resolve_gets_a_pinned_synthetic_address() {
    let policy = "allow only.test; allow other.test; allow direct.test; allow internal.test";
    let table: &[(&str, &[&str])] = &[
        ("other.test", &["203.0.113.20"]),
        ("internal.test", &["10.0.0.5"]),
    ];
    // Without a proxy: NXDOMAIN, as the host resolver said.
    let plain = setup(policy, table);
    assert_eq!(
        resolve(&plain, "only.test.").await.0,
        ResponseCode::NXDomain
    );
    assert!(plain.gate.upstream_proxy().is_none());

    let t = setup_with(policy, table, with_proxy(&["direct.test"]));
    assert!(t.gate.upstream_proxy().is_some());
    let (code, got) = resolve(&t, "only.test.").await;
    assert_eq!(code, ResponseCode::NoError);
    assert_eq!(got, ips(&["198.19.0.1"]));
    // Stable, and only A gets an address.
    assert_eq!(resolve(&t, "only.test.").await.1, got);
    let r = t
        .gate
        .dns(query(2, "only.test.", RecordType::AAAA))
        .await
        .unwrap();
    assert_eq!(read(&r), (ResponseCode::NoError, vec![]));
    // A name the host resolves keeps its real answer (the proxy still gets the name later).
    assert_eq!(resolve(&t, "other.test.").await.1, ips(&["203.0.113.20"]));
    // Unlisted: refused before any lookup; no-proxy name: what the host said; an answer
    // dropped as rebinding is never replaced by a synthetic one.
    let before = t.count.load(Ordering::SeqCst);
    assert_eq!(
        resolve(&t, "unlisted.test.").await,
        (ResponseCode::NXDomain, vec![])
    );
    assert_eq!(t.count.load(Ordering::SeqCst), before);
    assert_eq!(
        resolve(&t, "direct.test.").await,
        (ResponseCode::NXDomain, vec![])
    );
    assert_eq!(
        resolve(&t, "internal.test.").await,
        (ResponseCode::NXDomain, vec![])
    );

    // The synthetic address is decided like a real answer: by the pinned name, inspected.
    let v = t.gate.connect(&tcp("198.19.0.1:443"));
    assert!(
        matches!(
            v,
            ConnectVerdict::Allow {
                inspect: Inspect::TlsSni,
                ..
            }
        ),
        "{v:?}"
    );
    let v = t
        .gate
        .inspect(&tcp("198.19.0.1:443"), &client_hello("only.test"));
    assert!(matches!(v, InspectVerdict::Allow { .. }), "{v:?}");
    // An allowed name never answered with this address: refused (the pin check is as strict).
    let v = t
        .gate
        .inspect(&tcp("198.19.0.1:443"), &client_hello("other.test"));
    assert!(matches!(v, InspectVerdict::Deny { .. }), "{v:?}");
    // Other ports, unassigned synthetic addresses and other sandboxes' ones stay blocked.
    assert!(denied(t.gate.connect(&tcp("198.19.0.1:22"))).contains("no rule"));
    assert!(denied(t.gate.connect(&tcp("198.19.0.2:443"))).contains("always blocked"));
    let other = setup_with(policy, table, with_proxy(&[]));
    assert!(denied(other.gate.connect(&tcp("198.19.0.1:443"))).contains("always blocked"));

    // A failing host resolver (error, not NXDOMAIN) behind a proxy: a synthetic answer too.
    struct Failing;
    impl Upstream for Failing {
        fn query(&self, _: &str, _: QType) -> BoxFuture<'static, Result<Answer, DnsError>> {
            Box::pin(async { Err(DnsError::NoResolver) })
        }
    }
    let mut settings = GateSettings::new(Arc::new(Failing));
    with_proxy(&[])(&mut settings);
    let mut p = Policy::default();
    p.add_rule("allow a.test".parse().unwrap());
    let gate = PolicyGate::new("sbx_x", p, Arc::new(settings), Arc::new(|_: &str, _| {}));
    let r = gate.dns(query(5, "a.test.", RecordType::A)).await.unwrap();
    assert_eq!(read(&r), (ResponseCode::NoError, ips(&["198.19.0.1"])));
}
