//! The stack's upstream connections through the explicit upstream proxy, against a real local
//! `CONNECT` proxy (`upstream_proxy_testkit`) and the fake guest of `tests.rs`: inspected flows
//! are tunnelled by the name the gate allowed, never before it allowed it; flows without
//! inspection by their address; a refusing or dead proxy resets the guest; a no-proxy name goes
//! directly.

use std::collections::HashMap;
use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::sync::atomic::Ordering;

use smoltcp::socket::tcp;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use super::StackConfig;
use super::tests::{Guest, TestGate, echo_server, refused_port, start};
use crate::network::gate::{FlowEvent, Inspect};
use crate::network::upstream_proxy::{self, UpstreamProxy};
use crate::network::upstream_proxy_testkit::{self as kit, Rules};

const AUTH: &str = "Basic dXNlcjpzM2NyZXQ="; // user:s3cret

/// A test gate whose egress goes through `proxy`.
fn gate_via(proxy: Arc<UpstreamProxy>) -> Arc<TestGate> {
    let gate = Arc::new(TestGate::default());
    *gate.proxy.lock().unwrap() = Some(proxy);
    gate
}

fn proxy_for(addr: SocketAddr, no_proxy: &[&str]) -> Arc<UpstreamProxy> {
    let np: Vec<String> = no_proxy.iter().map(|s| s.to_string()).collect();
    let url = format!("http://user:s3cret@{addr}");
    Arc::new(
        upstream_proxy::resolve(Some(&url), Some(&np), |_| None)
            .unwrap()
            .unwrap(),
    )
}

/// Send `msg` on `h` and read as many bytes back.
async fn round_trip(g: &mut Guest, h: smoltcp::iface::SocketHandle, msg: &[u8]) -> Vec<u8> {
    g.until("established", |g| g.t(h).state() == tcp::State::Established)
        .await;
    g.t(h).send_slice(msg).unwrap();
    let mut back = Vec::new();
    g.until("the echo", |g| {
        let s = g.t(h);
        while s.can_recv() {
            s.recv(|b| {
                back.extend_from_slice(b);
                (b.len(), ())
            })
            .unwrap();
        }
        back.len() >= msg.len()
    })
    .await;
    back
}

#[tokio::test]
async fn an_inspected_flow_is_tunnelled_by_the_allowed_name_only_after_the_gate_allowed_it() {
    let (echo, got) = echo_server().await;
    let proxy = kit::start(Rules {
        map: HashMap::from([("good.test:443".to_owned(), echo)]),
        require_auth: Some(AUTH.into()),
        ..Rules::default()
    })
    .await;
    let gate = gate_via(proxy_for(proxy.addr, &[]));
    // The gate's upstream is an address the host cannot reach: only the proxy's name works.
    gate.allow(
        "198.51.100.30:443",
        "192.0.2.30:443".parse().unwrap(),
        Inspect::TlsSni,
    );
    let (mut g, _) = start(gate.clone(), StackConfig::default());

    // Denied by its first bytes: the proxy was connected (connect-before-accept) but never
    // asked for a tunnel.
    let bad = g.tcp("198.51.100.30:443", 4096);
    g.until("established", |g| {
        g.t(bad).state() == tcp::State::Established
    })
    .await;
    g.t(bad).send_slice(b"BAD request").unwrap();
    g.until("reset", |g| g.t(bad).state() == tcp::State::Closed)
        .await;
    assert_eq!(proxy.seen.accepts.load(Ordering::SeqCst), 1);
    assert!(
        proxy.seen.connects().is_empty(),
        "{:?}",
        proxy.seen.connects()
    );

    // Allowed: CONNECT good.test:443 with the credentials, then the held bytes and the rest.
    let h = g.tcp("198.51.100.30:443", 4096);
    assert_eq!(round_trip(&mut g, h, b"GOOD hello").await, b"GOOD hello");
    assert_eq!(proxy.seen.connects(), vec!["good.test:443".to_owned()]);
    assert_eq!(
        proxy.seen.auths.lock().unwrap().clone(),
        vec![Some(AUTH.to_owned())]
    );
    assert_eq!(got.load(Ordering::Relaxed), 10);
    assert!(gate.events().iter().any(
        |e| matches!(e, FlowEvent::Allowed { host, .. } if host.as_deref() == Some("good.test"))
    ));

    // An intercepted flow's handler gets the tunnel too.
    let (echo2, _) = echo_server().await;
    let proxy2 = kit::start(Rules {
        map: HashMap::from([("take.test:443".to_owned(), echo2)]),
        ..Rules::default()
    })
    .await;
    *gate.proxy.lock().unwrap() = Some(proxy_for(proxy2.addr, &[]));
    let h = g.tcp("198.51.100.30:443", 4096);
    assert_eq!(round_trip(&mut g, h, b"TAKE me").await, b"HANDLED:TAKE me");
    assert_eq!(proxy2.seen.connects(), vec!["take.test:443".to_owned()]);
}

#[tokio::test]
async fn a_flow_without_inspection_is_tunnelled_by_its_address() {
    let (echo, _) = echo_server().await;
    let proxy = kit::start(Rules {
        map: HashMap::from([("192.0.2.31:8080".to_owned(), echo)]),
        ..Rules::default()
    })
    .await;
    let gate = gate_via(proxy_for(proxy.addr, &[]));
    gate.allow(
        "198.51.100.31:8080",
        "192.0.2.31:8080".parse().unwrap(),
        Inspect::Nothing,
    );
    let (mut g, _) = start(gate.clone(), StackConfig::default());
    let h = g.tcp("198.51.100.31:8080", 4096);
    assert_eq!(round_trip(&mut g, h, b"raw bytes").await, b"raw bytes");
    assert_eq!(proxy.seen.connects(), vec!["192.0.2.31:8080".to_owned()]);
}

#[tokio::test]
async fn a_refusing_or_dead_proxy_resets_the_guest_and_says_why_without_the_password() {
    let proxy = kit::start(Rules {
        refuse: HashMap::from([("good.test:443".to_owned(), 403)]),
        ..Rules::default()
    })
    .await;
    let gate = gate_via(proxy_for(proxy.addr, &[]));
    gate.allow(
        "198.51.100.32:443",
        "192.0.2.32:443".parse().unwrap(),
        Inspect::TlsSni,
    );
    let (mut g, _) = start(gate.clone(), StackConfig::default());
    let h = g.tcp("198.51.100.32:443", 4096);
    g.until("established", |g| g.t(h).state() == tcp::State::Established)
        .await;
    g.t(h).send_slice(b"GOOD hello").unwrap();
    g.until("reset", |g| g.t(h).state() == tcp::State::Closed)
        .await;
    let failed: Vec<String> = gate
        .events()
        .into_iter()
        .filter_map(|e| match e {
            FlowEvent::UpstreamFailed { error, .. } => Some(error),
            _ => None,
        })
        .collect();
    assert_eq!(failed.len(), 1, "{:?}", gate.events());
    assert!(
        failed[0].contains("403") && failed[0].contains("good.test:443"),
        "{failed:?}"
    );
    assert!(failed[0].contains("***@") && !failed[0].contains("s3cret"));

    // Nothing listens where the proxy should be: the guest's handshake never completes.
    *gate.proxy.lock().unwrap() = Some(proxy_for(refused_port(), &[]));
    let h = g.tcp("198.51.100.32:443", 4096);
    let mut seen_established = false;
    g.until("reset", |g| {
        seen_established |= g.t(h).state() == tcp::State::Established;
        g.t(h).state() == tcp::State::Closed
    })
    .await;
    assert!(!seen_established);
    let ev = gate.events();
    let last = ev.iter().rev().find_map(|e| match e {
        FlowEvent::UpstreamFailed { error, .. } => Some(error.clone()),
        _ => None,
    });
    let last = last.unwrap();
    assert!(
        last.contains("unreachable") && !last.contains("s3cret"),
        "{last}"
    );
}

/// A local address that is not loopback (loopback always bypasses the proxy), if the host has
/// one; found without sending a packet.
fn non_loopback_ip() -> Option<IpAddr> {
    let s = std::net::UdpSocket::bind("0.0.0.0:0").ok()?;
    s.connect("192.0.2.1:9").ok()?;
    let ip = s.local_addr().ok()?.ip();
    (!ip.is_loopback() && !ip.is_unspecified()).then_some(ip)
}

#[tokio::test]
async fn a_no_proxy_name_drops_the_proxy_connection_and_goes_directly() {
    let Some(ip) = non_loopback_ip() else {
        assert!(
            std::env::var_os("CI").is_none(),
            "under CI every test runs: the host needs a non-loopback IPv4 address"
        );
        println!(
            "skipped: the host has no non-loopback IPv4 address (loopback never goes through the proxy)"
        );
        return;
    };
    let l = tokio::net::TcpListener::bind((ip, 0)).await.unwrap();
    let direct = l.local_addr().unwrap();
    tokio::spawn(async move {
        while let Ok((mut s, _)) = l.accept().await {
            tokio::spawn(async move {
                let mut buf = [0u8; 64];
                while let Ok(n) = s.read(&mut buf).await {
                    if n == 0 || s.write_all(&buf[..n]).await.is_err() {
                        return;
                    }
                }
            });
        }
    });
    let proxy = kit::start(Rules::default()).await;
    let gate = gate_via(proxy_for(proxy.addr, &["good.test"]));
    gate.allow("198.51.100.33:443", direct, Inspect::TlsSni);
    let (mut g, _) = start(gate.clone(), StackConfig::default());
    let h = g.tcp("198.51.100.33:443", 4096);
    assert_eq!(round_trip(&mut g, h, b"GOOD direct").await, b"GOOD direct");
    // The proxy was connected at SYN time (the address is not exempt), never asked.
    assert!(
        proxy.seen.connects().is_empty(),
        "{:?}",
        proxy.seen.connects()
    );

    // Without the no-proxy entry the same flow goes to the proxy, which knows no such name.
    *gate.proxy.lock().unwrap() = Some(proxy_for(proxy.addr, &[]));
    let h = g.tcp("198.51.100.33:443", 4096);
    g.until("established", |g| g.t(h).state() == tcp::State::Established)
        .await;
    g.t(h).send_slice(b"GOOD direct").unwrap();
    g.until("reset", |g| g.t(h).state() == tcp::State::Closed)
        .await;
    assert_eq!(proxy.seen.connects(), vec!["good.test:443".to_owned()]);
}

#[tokio::test]
async fn a_synthetic_address_is_never_connected_directly() {
    let proxy = kit::start(Rules::default()).await;
    // A no-proxy CIDR that covers the synthetic range would send the flow directly.
    let gate = gate_via(proxy_for(proxy.addr, &["198.16.0.0/12"]));
    gate.allow(
        "198.19.0.5:443",
        "198.19.0.5:443".parse().unwrap(),
        Inspect::TlsSni,
    );
    let (mut g, _) = start(gate.clone(), StackConfig::default());
    let h = g.tcp("198.19.0.5:443", 4096);
    let mut seen_established = false;
    g.until("reset", |g| {
        seen_established |= g.t(h).state() == tcp::State::Established;
        g.t(h).state() == tcp::State::Closed
    })
    .await;
    assert!(!seen_established);
    assert!(
        gate.events().iter().any(
            |e| matches!(e, FlowEvent::UpstreamFailed { error, .. } if error.contains("synthetic"))
        ),
        "{:?}",
        gate.events()
    );
    assert_eq!(proxy.seen.accepts.load(Ordering::SeqCst), 0);
}
