//! Connections into the guest ([`super::ingress`]) against the fake guest of `tests.rs` (a
//! second smoltcp interface over a socket pair): bytes both ways through the caller's pipe, a
//! closed port refused at once with "port is not open", a silent port timing out without a
//! leftover flow, and the per-VM bound.

use std::sync::Arc;
use std::time::Duration;

use smoltcp::socket::tcp;
use smoltcp::wire::{IpAddress, IpEndpoint};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::UnixStream;

use super::engine::Engine;
use super::ingress::{Ingress, IngressError};
use super::tests::{Guest, TestGate};
use super::{StackConfig, StackStats};
use crate::network::gate::GATEWAY_V4;

fn start(cfg: StackConfig) -> (Guest, Ingress, Arc<StackStats>, Arc<TestGate>) {
    let (a, b) = UnixStream::pair().unwrap();
    let stats = Arc::new(StackStats::default());
    let gate = Arc::new(TestGate::default());
    let engine = Engine::new(gate.clone(), cfg, stats.clone());
    let ingress = Ingress::default();
    ingress.set(engine.ingress_sender());
    tokio::spawn(engine.run(a));
    (Guest::new(b), ingress, stats, gate)
}

#[tokio::test]
async fn bytes_round_trip_both_ways_through_a_connection_into_the_guest() {
    let (mut g, ingress, stats, gate) = start(StackConfig::default());
    let l = g.listen(3000);
    let msg: Vec<u8> = (0..100_000u32).map(|i| (i % 251) as u8).collect();
    let m2 = msg.clone();
    let host = tokio::spawn(async move {
        let mut c = ingress.connect(3000, Duration::from_secs(10)).await?;
        c.write_all(&m2).await.unwrap();
        // Our half-close reaches the guest as a FIN.
        c.shutdown().await.unwrap();
        let mut back = Vec::new();
        c.read_to_end(&mut back).await.unwrap();
        Ok::<_, IngressError>(back)
    });
    // The guest echoes until the host's FIN, then closes its side too.
    let mut got = Vec::new();
    let mut echoed = 0;
    let mut peer = None;
    g.until("the host's bytes and FIN", |g| {
        let s = g.t(l);
        if s.state() == tcp::State::Established || s.state() == tcp::State::CloseWait {
            peer = s.remote_endpoint();
        }
        while s.can_recv() {
            s.recv(|b| {
                got.extend_from_slice(b);
                (b.len(), ())
            })
            .unwrap();
        }
        if echoed < got.len() && s.can_send() {
            echoed += s.send_slice(&got[echoed..]).unwrap();
        }
        s.state() == tcp::State::CloseWait && echoed == got.len() && got.len() == msg.len()
    })
    .await;
    assert_eq!(got, msg);
    // The connection comes from the gateway, not from anything outside.
    let peer = peer.expect("the guest saw its peer");
    assert_eq!(peer.addr, IpAddress::Ipv4(GATEWAY_V4), "{peer}");
    g.t(l).close();
    g.until("the host read everything", |_| host.is_finished())
        .await;
    let back = host.await.unwrap().expect("connected");
    assert_eq!(back.len(), msg.len());
    assert!(back == msg, "the echo differs");
    g.until("the flow to be forgotten", |g| {
        matches!(g.t(l).state(), tcp::State::Closed | tcp::State::TimeWait) && stats.flows() == 0
    })
    .await;
    // Ingress is not egress: the gate saw nothing.
    assert!(gate.events().is_empty(), "{:?}", gate.events());
}

#[tokio::test]
async fn a_closed_port_is_refused_at_once_and_a_silent_one_times_out() {
    let (mut g, ingress, stats, _) = start(StackConfig::default());
    let i2 = ingress.clone();
    let t0 = std::time::Instant::now();
    let host = tokio::spawn(async move { i2.connect(3001, Duration::from_secs(10)).await });
    g.until("the refusal", |_| host.is_finished()).await;
    let e = host.await.unwrap().unwrap_err();
    assert!(matches!(e, IngressError::Refused(3001)), "{e:?}");
    assert!(e.to_string().contains("port is not open"), "{e}");
    assert!(t0.elapsed() < Duration::from_secs(3), "{:?}", t0.elapsed());
    g.until("no flow left", |_| stats.flows() == 0).await;

    // A guest that never answers (not driven): a timeout, and the half-open socket goes.
    let e = ingress
        .connect(3000, Duration::from_millis(300))
        .await
        .unwrap_err();
    assert!(
        matches!(e, IngressError::Timeout { port: 3000, .. }),
        "{e:?}"
    );
    assert_eq!(stats.flows(), 1, "the SYN is still out");
    // The engine notices the caller left at its next wake-up (the SYN retransmission).
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while stats.flows() != 0 {
        assert!(
            std::time::Instant::now() < deadline,
            "the half-open flow stayed"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }

    // No engine attached: said so.
    let e = Ingress::default()
        .connect(3000, Duration::from_secs(1))
        .await
        .unwrap_err();
    assert!(matches!(e, IngressError::NotAttached), "{e:?}");
    assert!(matches!(
        ingress.connect(0, Duration::from_secs(1)).await,
        Err(IngressError::BadPort)
    ));
}

#[tokio::test]
async fn connections_into_the_guest_are_bounded() {
    let cfg = StackConfig {
        max_ingress: 2,
        ..StackConfig::default()
    };
    let (mut g, ingress, stats, _) = start(cfg);
    let socks = [g.listen(3000), g.listen(3000), g.listen(3000)];
    let mut tasks = Vec::new();
    for _ in 0..2 {
        let i = ingress.clone();
        tasks.push(tokio::spawn(async move {
            i.connect(3000, Duration::from_secs(10)).await
        }));
    }
    g.until("two connections", |_| tasks.iter().all(|t| t.is_finished()))
        .await;
    let mut conns = Vec::new();
    for t in tasks {
        conns.push(t.await.unwrap().expect("within the bound"));
    }
    let i = ingress.clone();
    let third = tokio::spawn(async move { i.connect(3000, Duration::from_secs(10)).await });
    g.until("the third answered", |_| third.is_finished()).await;
    let e = third.await.unwrap().unwrap_err();
    assert!(matches!(e, IngressError::TooMany(2)), "{e:?}");
    assert!(e.to_string().contains("at most 2"), "{e}");
    assert_eq!(
        socks
            .iter()
            .filter(|h| g.t(**h).state() == tcp::State::Established)
            .count(),
        2
    );
    // One closes: room for another.
    drop(conns.pop());
    g.until("one flow gone", |g| {
        for h in socks {
            if g.t(h).state() == tcp::State::CloseWait {
                g.t(h).close();
            }
        }
        stats.flows() == 1
    })
    .await;
    let spare = socks
        .iter()
        .copied()
        .find(|h| g.t(*h).state() == tcp::State::Listen)
        .expect("a listening socket left");
    let i = ingress.clone();
    let again = tokio::spawn(async move { i.connect(3000, Duration::from_secs(10)).await });
    g.until("the next one", |_| again.is_finished()).await;
    assert!(again.await.unwrap().is_ok());
    assert_eq!(g.t(spare).state(), tcp::State::Established);
    let _ = IpEndpoint::new(IpAddress::Ipv4(GATEWAY_V4), 0);
}
