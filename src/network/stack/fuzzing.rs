//! The stack's fuzz checks (see `network::fuzzing`): `stack_frames` feeds bytes as QEMU's
//! `-netdev stream` socket would deliver them into a whole [`Engine`] with a fake gate, and
//! `dns_truncated` checks the cut-down of oversized UDP DNS answers.
//!
//! The engine's smoltcp randomness is fixed ([`Engine::with_seed`]), so a saved input that
//! completes a TCP handshake replays the same way. Allowed flows connect to a real listener on
//! 127.0.0.1 (never accepted: the kernel completes the handshake, nothing answers), so the
//! inspect and relay phases run without any traffic off the machine.

use std::cell::RefCell;
use std::net::{Ipv4Addr, SocketAddr};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use futures_util::future::BoxFuture;

use super::dns::DNS_TCP_PENDING_MAX;
use super::engine::{DNS_UDP_MAX, Engine, UDP_DENIED_MEMORY};
use super::flow::Phase;
use super::frames::{FrameReader, MTU, TX_CAP};
use super::{StackConfig, StackStats};
use crate::network::dns::{self, Rcode, Rec, RecData};
use crate::network::gate::{ConnectVerdict, Flow, FlowEvent, Gate, Inspect, InspectVerdict};
use crate::network::sniff::{self, Sniffed};

/// The limits of the fuzzed stack: small, so the fuzzer reaches them with small inputs.
pub fn fuzz_config() -> StackConfig {
    StackConfig {
        max_flows: 8,
        connect_timeout: Duration::from_millis(200),
        inspect_cap: 2048,
        tcp_buffer: 4096,
        max_dns_inflight: 4,
        max_ingress: 4,
    }
}

/// The engine's fixed smoltcp seed.
pub const SEED: u64 = 0x7472_7962_6f78_6921;

/// Allows 443 (SNI inspected), 80 (Host inspected) and 22 (nothing inspected) to `upstream`,
/// denies the rest; answers every DNS query (names starting with `big` with an answer too big
/// for UDP); counts the events it is given.
struct FuzzGate {
    upstream: SocketAddr,
    events: AtomicUsize,
}

impl Gate for FuzzGate {
    fn connect(&self, flow: &Flow) -> ConnectVerdict {
        let inspect = match flow.dst.port() {
            443 => Inspect::TlsSni,
            80 => Inspect::HttpHost,
            22 => Inspect::Nothing,
            _ => {
                return ConnectVerdict::Deny {
                    reason: "not allowed".into(),
                };
            }
        };
        ConnectVerdict::Allow {
            upstream: self.upstream,
            inspect,
            rule: "fuzz".into(),
        }
    }

    fn inspect(&self, flow: &Flow, first_bytes: &[u8]) -> InspectVerdict {
        let s = if flow.dst.port() == 443 {
            sniff::tls_sni(first_bytes)
        } else {
            sniff::http_host(first_bytes, flow.dst.port())
        };
        match s {
            Sniffed::NeedMore => InspectVerdict::NeedMore,
            Sniffed::Host(h) => InspectVerdict::Allow {
                rule: "fuzz".into(),
                host: Some(h),
            },
            Sniffed::Refused(reason) => InspectVerdict::Deny { reason, host: None },
        }
    }

    fn dns(&self, query: Vec<u8>) -> BoxFuture<'static, Option<Vec<u8>>> {
        let reply = match dns::parse_query(&query) {
            Ok(q) if q.name.starts_with("big") => {
                // Header and question as asked, then more than a datagram of answer bytes.
                let mut r = query.clone();
                r[2] |= 0x80;
                r.extend(std::iter::repeat_n(0u8, 2 * DNS_UDP_MAX));
                Some(r)
            }
            Ok(q) => {
                let rec = Rec {
                    name: q.name.clone(),
                    ttl: 30,
                    data: RecData::Ip(Ipv4Addr::new(93, 184, 216, 34).into()),
                };
                Some(dns::reply(&q, Rcode::NoError, &[rec]))
            }
            Err(r) => r,
        };
        Box::pin(async move { reply })
    }

    fn record(&self, _: FlowEvent) {
        self.events.fetch_add(1, Ordering::Relaxed);
    }
}

thread_local! {
    static RT: RefCell<Option<tokio::runtime::Runtime>> = const { RefCell::new(None) };
}

fn with_runtime<R>(f: impl FnOnce(&tokio::runtime::Runtime) -> R) -> R {
    RT.with(|rt| {
        let mut rt = rt.borrow_mut();
        let rt = rt.get_or_insert_with(|| {
            tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .expect("a current-thread runtime")
        });
        f(rt)
    })
}

/// The engine's state stays within its limits whatever the guest sends.
fn check_bounds(e: &Engine, cfg: &StackConfig) {
    assert!(e.flows.len() <= cfg.max_flows, "{} flows", e.flows.len());
    assert!(
        e.dev.rx.len() <= 256,
        "{} frames queued for smoltcp",
        e.dev.rx.len()
    );
    assert!(e.dns_inflight <= cfg.max_dns_inflight);
    assert!(e.udp_denied_len() <= UDP_DENIED_MEMORY);
    for f in e.flows.values() {
        assert!(
            f.held.len() <= cfg.inspect_cap.max(65_535 + 2),
            "{} bytes held",
            f.held.len()
        );
        if f.phase == Phase::Dns {
            let pending = f.pending_down.as_ref().map_or(0, |b| b.len());
            assert!(
                pending <= DNS_TCP_PENDING_MAX,
                "{pending} DNS answer bytes queued"
            );
        }
    }
    // Everything queued for QEMU is whole frames no bigger than the MTU allows.
    assert!(
        e.dev.tx.len() <= TX_CAP + 4 + MTU + 14,
        "{} bytes for QEMU",
        e.dev.tx.len()
    );
    let mut rest = &e.dev.tx[..];
    while !rest.is_empty() {
        assert!(rest.len() >= 4, "a cut length prefix");
        let n = u32::from_be_bytes([rest[0], rest[1], rest[2], rest[3]]) as usize;
        assert!(
            n <= MTU + 14 && rest.len() >= 4 + n,
            "a frame of {n} bytes to QEMU"
        );
        rest = &rest[4 + n..];
    }
}

/// `stack_frames`: `data` is the byte stream from QEMU's socket (4-byte big-endian length, then
/// an Ethernet frame, repeated). Each frame goes through the classifier and smoltcp, the tasks
/// it starts (DNS answers, upstream connects) get to run, QEMU reads everything written back;
/// the engine must never panic, and its queues and tables stay within their limits.
pub fn stack_frames(data: &[u8]) {
    with_runtime(|rt| rt.block_on(run_frames(data, None)));
}

/// [`stack_frames`], returning every frame the stack wrote to QEMU (the seed corpus is made
/// with it: a handshake's ACK needs the stack's sequence number).
#[cfg(test)]
pub(crate) fn stack_frames_capture(data: &[u8]) -> Vec<Vec<u8>> {
    let mut out = Vec::new();
    with_runtime(|rt| rt.block_on(run_frames(data, Some(&mut out))));
    out
}

async fn run_frames(data: &[u8], mut out: Option<&mut Vec<Vec<u8>>>) {
    let Ok(listener) = tokio::net::TcpListener::bind("127.0.0.1:0").await else {
        return;
    };
    let Ok(upstream) = listener.local_addr() else {
        return;
    };
    let gate = Arc::new(FuzzGate {
        upstream,
        events: AtomicUsize::new(0),
    });
    let cfg = fuzz_config();
    let mut e = Engine::with_seed(
        gate.clone(),
        cfg.clone(),
        Arc::new(StackStats::default()),
        SEED,
    );
    e.learn_guest();
    let mut reader = FrameReader::default();
    reader.spare(data.len()).extend_from_slice(data);
    let mut frames = 0usize;
    // Stops at the end of the input, or at a frame too large (the engine detaches there).
    while let Ok(Some(f)) = reader.next_frame() {
        e.ingest(f);
        frames += 1;
        turn(&mut e, &cfg, out.as_deref_mut()).await;
    }
    // Let answers and connects still under way arrive, as the loop would.
    for _ in 0..3 {
        turn(&mut e, &cfg, out.as_deref_mut()).await;
    }
    // At most a few events per frame (a flow's verdict and its close; one per denied UDP flow).
    assert!(gate.events.load(Ordering::Relaxed) <= 3 * frames + 8);
    drop(listener);
}

/// One turn of the loop: smoltcp and the flows, the tasks, their results, and QEMU reading.
async fn turn(e: &mut Engine, cfg: &StackConfig, out: Option<&mut Vec<Vec<u8>>>) {
    e.step();
    check_bounds(e, cfg);
    for _ in 0..4 {
        tokio::task::yield_now().await;
    }
    if e.pump_events() > 0 {
        e.step();
        check_bounds(e, cfg);
    }
    if let Some(out) = out {
        let mut rest = &e.dev.tx[..];
        while rest.len() >= 4 {
            let n = u32::from_be_bytes([rest[0], rest[1], rest[2], rest[3]]) as usize;
            out.push(rest[4..4 + n].to_vec());
            rest = &rest[4 + n..];
        }
    }
    e.dev.tx.clear();
}

/// `dns_msg`'s UDP cut-down: an answer cut to header and question is one datagram with the
/// TC bit set and no records, and the question is the original's.
pub fn dns_truncated(data: &[u8]) {
    if let Some(t) = super::dns::truncated(data) {
        assert!(t.len() >= 12 && t.len() <= DNS_UDP_MAX && t.len() <= data.len());
        assert_eq!(t[2] & 0x02, 0x02, "TC set");
        assert_eq!(t[6..12], [0; 6]);
        assert_eq!(t[12..], data[12..t.len()]);
    }
}
