//! The network fuzz targets' seed corpora (written by `write_network_seed_corpus`, checked for
//! staleness) and CI's replay of every saved input (`saved_corpora_replay_cleanly`).

use std::net::SocketAddrV4;
use std::path::PathBuf;

use hickory_proto::rr::RecordType;
use smoltcp::phy::ChecksumCapabilities;
use smoltcp::wire::{
    ArpOperation, ArpPacket, ArpRepr, EthernetAddress, EthernetFrame, EthernetProtocol,
    EthernetRepr, IpProtocol, Ipv4Address, Ipv4Packet, Ipv4Repr, TcpControl, TcpPacket, TcpRepr,
    TcpSeqNumber, UdpPacket, UdpRepr,
};

use super::*;
use crate::network::dns::testing::query;
use crate::network::gate::{GATEWAY_V4, GUEST_V4};
use crate::network::sniff::testing::{client_hello, client_hello_with, sni_ext};
use crate::network::stack::fuzzing::stack_frames_capture;
use crate::network::stack::{GATEWAY_MAC, GUEST_MAC};

/// A target's name and check.
type Target = (&'static str, fn(&[u8]));
/// Named inputs.
type Seeds = Vec<(String, Vec<u8>)>;

/// The network targets and their checks.
pub const TARGETS: &[Target] = &[
    ("sniff", sniff),
    ("dns_msg", dns_msg),
    ("stack_frames", stack_frames),
    ("placeholders", placeholders),
];

fn corpus(target: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("fuzz/corpus")
        .join(target)
}

fn sniff_seeds() -> Seeds {
    let tls = |pick: u8, b: Vec<u8>| [vec![pick], b].concat();
    let mut out = vec![
        ("tls-sni".into(), tls(0, client_hello("example.com"))),
        (
            "tls-sni-upper-dot".into(),
            tls(0, client_hello("WWW.Example.COM.")),
        ),
        ("tls-sni-ip".into(), tls(0, client_hello("93.184.216.34"))),
        (
            "tls-sni-idn".into(),
            tls(0, client_hello("xn--bcher-kva.example")),
        ),
        (
            "tls-two-names".into(),
            tls(0, client_hello_with(&[sni_ext(&["a.com", "b.com"])])),
        ),
        (
            "tls-ech".into(),
            tls(
                0,
                client_hello_with(&[(0xfe0d, vec![1, 2, 3]), sni_ext(&["a.com"])]),
            ),
        ),
        (
            "tls-dup-ext".into(),
            tls(
                0,
                client_hello_with(&[sni_ext(&["a.com"]), sni_ext(&["a.com"])]),
            ),
        ),
        (
            "tls-no-sni".into(),
            tls(0, client_hello_with(&[(0x000a, vec![0, 2, 0, 0x1d])])),
        ),
        (
            "tls-not-tls".into(),
            tls(0, b"SSH-2.0-OpenSSH_9.6\r\n".to_vec()),
        ),
    ];
    // One ClientHello split over three handshake records.
    let whole = client_hello("split.example.org");
    let hs = &whole[5..];
    let mut split = vec![0u8];
    for part in [&hs[..3], &hs[3..20], &hs[20..]] {
        split.extend([0x16, 0x03, 0x01]);
        split.extend((part.len() as u16).to_be_bytes());
        split.extend(part);
    }
    out.push(("tls-split-records".into(), split));
    let http =
        |port80: bool, s: &str| [vec![if port80 { 1 } else { 3 }], s.as_bytes().to_vec()].concat();
    for (name, port80, req) in [
        (
            "http-get",
            true,
            "GET / HTTP/1.1\r\nHost: example.com\r\n\r\n",
        ),
        (
            "http-port",
            false,
            "GET /x HTTP/1.1\r\nHost: example.com:8080\r\nAccept: */*\r\n\r\n",
        ),
        (
            "http-wrong-port",
            true,
            "GET / HTTP/1.1\r\nHost: example.com:8080\r\n\r\n",
        ),
        (
            "http-absolute",
            true,
            "GET http://example.com/a?b HTTP/1.1\r\nHost: example.com\r\n\r\n",
        ),
        (
            "http-absolute-other",
            true,
            "GET http://evil.com/ HTTP/1.1\r\nHost: example.com\r\n\r\n",
        ),
        (
            "http-two-hosts",
            true,
            "GET / HTTP/1.1\r\nHost: a.com\r\nhost: b.com\r\n\r\n",
        ),
        ("http-no-host", true, "GET / HTTP/1.0\r\n\r\n"),
        (
            "http-connect",
            true,
            "CONNECT example.com:443 HTTP/1.1\r\nHost: example.com:443\r\n\r\n",
        ),
        ("http-h2", true, "PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"),
        ("http-ipv6", true, "GET / HTTP/1.1\r\nHost: [::1]\r\n\r\n"),
        ("http-partial", true, "GET / HTTP/1.1\r\nHo"),
    ] {
        out.push((name.into(), http(port80, req)));
    }
    out
}

fn dns_seeds() -> Seeds {
    let mut out = vec![
        ("a-allowed".into(), query(1, "example.com.", RecordType::A)),
        (
            "aaaa-allowed".into(),
            query(2, "api.github.com.", RecordType::AAAA),
        ),
        ("a-denied".into(), query(3, "evil.test.", RecordType::A)),
        ("mx".into(), query(4, "example.com.", RecordType::MX)),
        ("static".into(), query(5, "static.test.", RecordType::A)),
        ("root".into(), query(6, ".", RecordType::NS)),
    ];
    // EDNS with a large payload, the CH class, a response, a non-query opcode, two questions.
    let mut edns = query(7, "example.com.", RecordType::A);
    edns[11] = 1;
    edns.extend([0, 0, 41, 0x10, 0, 0, 0, 0, 0, 0, 0]);
    out.push(("edns-4096".into(), edns));
    let mut ch = query(8, "version.bind.", RecordType::TXT);
    let n = ch.len();
    ch[n - 1] = 3;
    out.push(("class-ch".into(), ch));
    let mut resp = query(9, "example.com.", RecordType::A);
    resp[2] |= 0x80;
    // An answer: a pointer to the question's name, A, IN, TTL, 4 bytes.
    resp[7] = 1;
    resp.extend([0xc0, 12, 0, 1, 0, 1, 0, 0, 0, 60, 0, 4, 93, 184, 216, 34]);
    out.push(("response-a".into(), resp));
    let mut notify = query(10, "example.com.", RecordType::A);
    notify[2] = 4 << 3;
    out.push(("opcode-notify".into(), notify));
    let mut two = query(11, "a.com.", RecordType::A);
    two[5] = 2;
    two.extend(b"\x01b\x03com\x00\x00\x01\x00\x01");
    out.push(("two-questions".into(), two));
    // Hostile: a compression pointer to itself, a label running past the end, a header alone,
    // 65535 questions declared.
    let mut lp = vec![0, 12, 1, 0, 0, 1, 0, 0, 0, 0, 0, 0];
    lp.extend([0xc0, 12, 0, 1, 0, 1]);
    out.push(("hostile-pointer-loop".into(), lp));
    let mut long = vec![0, 13, 1, 0, 0, 1, 0, 0, 0, 0, 0, 0, 63];
    long.extend(b"abc");
    out.push(("hostile-label-past-end".into(), long));
    out.push((
        "hostile-header-only".into(),
        vec![0, 14, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0],
    ));
    out.push((
        "hostile-qdcount-max".into(),
        vec![0, 15, 1, 0, 0xff, 0xff, 0, 0, 0, 0, 0, 0, 0, 0, 1, 0, 1],
    ));
    out
}

// ---- Ethernet frames from the guest, as QEMU's socket carries them ----

fn framed(frames: &[Vec<u8>]) -> Vec<u8> {
    let mut out = Vec::new();
    for f in frames {
        out.extend((f.len() as u32).to_be_bytes());
        out.extend(f);
    }
    out
}

fn eth(ethertype: EthernetProtocol, payload_len: usize, fill: impl FnOnce(&mut [u8])) -> Vec<u8> {
    let repr = EthernetRepr {
        src_addr: EthernetAddress(GUEST_MAC),
        dst_addr: EthernetAddress(GATEWAY_MAC),
        ethertype,
    };
    let mut buf = vec![0u8; repr.buffer_len() + payload_len];
    let mut f = EthernetFrame::new_unchecked(&mut buf[..]);
    repr.emit(&mut f);
    fill(f.payload_mut());
    buf
}

fn ipv4(
    proto: IpProtocol,
    dst: Ipv4Address,
    l4_len: usize,
    fill: impl FnOnce(&mut [u8]),
) -> Vec<u8> {
    let repr = Ipv4Repr {
        src_addr: GUEST_V4,
        dst_addr: dst,
        next_header: proto,
        payload_len: l4_len,
        hop_limit: 64,
    };
    eth(EthernetProtocol::Ipv4, repr.buffer_len() + l4_len, |b| {
        let mut p = Ipv4Packet::new_unchecked(b);
        repr.emit(&mut p, &ChecksumCapabilities::default());
        fill(p.payload_mut());
    })
}

fn udp(src_port: u16, dst: SocketAddrV4, payload: &[u8]) -> Vec<u8> {
    let repr = UdpRepr {
        src_port,
        dst_port: dst.port(),
    };
    ipv4(
        IpProtocol::Udp,
        *dst.ip(),
        repr.header_len() + payload.len(),
        |b| {
            repr.emit(
                &mut UdpPacket::new_unchecked(b),
                &GUEST_V4.into(),
                &(*dst.ip()).into(),
                payload.len(),
                |p| p.copy_from_slice(payload),
                &ChecksumCapabilities::default(),
            );
        },
    )
}

fn tcp(
    src_port: u16,
    dst: SocketAddrV4,
    control: TcpControl,
    seq: u32,
    ack: Option<u32>,
    payload: &[u8],
) -> Vec<u8> {
    let repr = TcpRepr {
        src_port,
        dst_port: dst.port(),
        control,
        seq_number: TcpSeqNumber(seq as i32),
        ack_number: ack.map(|a| TcpSeqNumber(a as i32)),
        window_len: 64240,
        window_scale: None,
        max_seg_size: (control == TcpControl::Syn).then_some(1460),
        sack_permitted: false,
        sack_ranges: [None; 3],
        timestamp: None,
        payload,
    };
    ipv4(IpProtocol::Tcp, *dst.ip(), repr.buffer_len(), |b| {
        repr.emit(
            &mut TcpPacket::new_unchecked(b),
            &GUEST_V4.into(),
            &(*dst.ip()).into(),
            &ChecksumCapabilities::default(),
        );
    })
}

fn arp_request() -> Vec<u8> {
    let repr = ArpRepr::EthernetIpv4 {
        operation: ArpOperation::Request,
        source_hardware_addr: EthernetAddress(GUEST_MAC),
        source_protocol_addr: GUEST_V4,
        target_hardware_addr: EthernetAddress([0; 6]),
        target_protocol_addr: GATEWAY_V4,
    };
    eth(EthernetProtocol::Arp, repr.buffer_len(), |b| {
        repr.emit(&mut ArpPacket::new_unchecked(b))
    })
}

/// The sequence number the stack's SYN-ACK to `port` carries, when `before` is replayed.
fn syn_ack_seq(before: &[Vec<u8>], port: u16) -> Option<u32> {
    stack_frames_capture(&framed(before)).iter().find_map(|f| {
        let e = EthernetFrame::new_checked(&f[..]).ok()?;
        let ip = Ipv4Packet::new_checked(e.payload()).ok()?;
        let t = TcpPacket::new_checked(ip.payload()).ok()?;
        (t.syn() && t.ack() && t.dst_port() == port).then(|| t.seq_number().0 as u32)
    })
}

/// A whole TCP exchange: SYN, the ACK of the stack's SYN-ACK (its sequence number comes from
/// a replay: the engine's randomness is fixed), the payload, FIN.
fn tcp_session(before: Vec<Vec<u8>>, port: u16, dst: SocketAddrV4, payload: &[u8]) -> Vec<u8> {
    let isn = 1000;
    let mut frames = before;
    frames.push(tcp(port, dst, TcpControl::Syn, isn, None, &[]));
    let Some(s) = syn_ack_seq(&frames, port) else {
        panic!("no SYN-ACK to {dst}");
    };
    let ack = Some(s.wrapping_add(1));
    frames.push(tcp(port, dst, TcpControl::None, isn + 1, ack, &[]));
    frames.push(tcp(port, dst, TcpControl::Psh, isn + 1, ack, payload));
    let fin = isn + 1 + payload.len() as u32;
    frames.push(tcp(port, dst, TcpControl::Fin, fin, ack, &[]));
    framed(&frames)
}

fn stack_seeds() -> Seeds {
    let gw = |port| SocketAddrV4::new(GATEWAY_V4, port);
    let web = |port| SocketAddrV4::new(Ipv4Address::new(93, 184, 216, 34), port);
    let q = query(0x1234, "example.com.", RecordType::A);
    let mut dns_tcp = (q.len() as u16).to_be_bytes().to_vec();
    dns_tcp.extend(&q);
    dns_tcp.extend((q.len() as u16).to_be_bytes());
    dns_tcp.extend(&q);
    let mut ipv6 = eth(EthernetProtocol::Ipv6, 40, |_| {});
    ipv6[14] = 0x60;
    let mut bad_sum = tcp(40001, web(443), TcpControl::Syn, 7, None, &[]);
    let last = bad_sum.len() - 1;
    bad_sum[14 + 20 + 16] ^= 0xff;
    bad_sum[last] ^= 0;
    let mut frag = udp(40002, gw(53), &q);
    frag[14 + 6] = 0x20; // more fragments
    let mut spoofed = udp(40003, gw(53), &q);
    spoofed[14 + 12..14 + 16].copy_from_slice(&[10, 0, 2, 99]);
    vec![
        ("arp".into(), framed(&[arp_request()])),
        (
            "dns-udp".into(),
            framed(&[arp_request(), udp(40000, gw(53), &q)]),
        ),
        (
            "dns-udp-big".into(),
            framed(&[udp(40000, gw(53), &query(7, "big.example.", RecordType::A))]),
        ),
        (
            "udp-denied-quic".into(),
            framed(&[udp(40000, web(443), b"quic"), udp(40000, web(123), b"ntp")]),
        ),
        (
            "syn-denied".into(),
            framed(&[tcp(40000, web(25), TcpControl::Syn, 1, None, &[])]),
        ),
        (
            "syn-gateway-80".into(),
            framed(&[tcp(40000, gw(80), TcpControl::Syn, 1, None, &[])]),
        ),
        ("ipv6".into(), framed(&[ipv6])),
        ("bad-checksum".into(), framed(&[bad_sum])),
        ("fragment".into(), framed(&[frag])),
        ("spoofed-source".into(), framed(&[spoofed])),
        ("empty-frame".into(), framed(&[vec![]])),
        (
            "frame-too-large".into(),
            (1u32 << 20).to_be_bytes().to_vec(),
        ),
        (
            "dns-tcp".into(),
            tcp_session(vec![], 40010, gw(53), &dns_tcp),
        ),
        (
            "tls-allowed".into(),
            tcp_session(vec![], 40011, web(443), &client_hello("example.com")),
        ),
        (
            "http-allowed".into(),
            tcp_session(
                vec![],
                40012,
                web(80),
                b"GET / HTTP/1.1\r\nHost: example.com\r\n\r\n",
            ),
        ),
        (
            "http-refused".into(),
            tcp_session(vec![], 40013, web(80), b"CONNECT x:1 HTTP/1.1\r\n\r\n"),
        ),
        (
            "ssh-relayed".into(),
            tcp_session(vec![], 40014, web(22), b"SSH-2.0-x\r\n"),
        ),
    ]
}

fn seeds() -> Vec<(&'static str, Seeds)> {
    vec![
        ("sniff", sniff_seeds()),
        ("dns_msg", dns_seeds()),
        ("stack_frames", stack_seeds()),
        ("placeholders", placeholder_seeds()),
    ]
}

fn placeholder_seeds() -> Seeds {
    use base64::Engine as _;
    let ph = FUZZ_PLACEHOLDER;
    let b64 = base64::engine::general_purpose::STANDARD.encode(format!("u:{ph}"));
    let heads = [
        (
            "bearer",
            format!("GET / HTTP/1.1\r\nHost: other.test\r\nAuthorization: Bearer {ph}\r\n\r\n"),
        ),
        (
            "basic",
            format!("GET / HTTP/1.1\r\nHost: other.test\r\nAuthorization: Basic {b64}\r\n\r\n"),
        ),
        (
            "query",
            format!("GET /x?key={ph}&a=1 HTTP/1.1\r\nHost: other.test\r\n\r\n"),
        ),
        (
            "extra",
            format!(
                "POST / HTTP/1.1\r\nHost: other.test\r\nX-Extra: %74bx_{}\r\n\r\n",
                &ph[4..]
            ),
        ),
        (
            "value",
            "HTTP/1.1 200 OK\r\n\r\n{\"k\":\"sk-live/+=\\\"value\"}".to_string(),
        ),
    ];
    heads
        .into_iter()
        .enumerate()
        .map(|(i, (n, h))| {
            let mut v = vec![(i * 7) as u8];
            v.extend_from_slice(h.as_bytes());
            (n.to_string(), v)
        })
        .collect()
}

/// Rewrites the seeds under `fuzz/corpus/{sniff,dns_msg,stack_frames,placeholders}/`:
/// `cargo test --lib write_network_seed_corpus -- --ignored`.
#[test]
#[ignore = "writes the seed corpus into the source tree"]
fn write_network_seed_corpus() {
    for (target, list) in seeds() {
        let dir = corpus(target);
        std::fs::create_dir_all(&dir).unwrap();
        for (name, bytes) in list {
            std::fs::write(dir.join(format!("seed-{name}")), bytes).unwrap();
        }
    }
}

#[test]
fn saved_network_seeds_are_current() {
    for (target, list) in seeds() {
        for (name, bytes) in list {
            let p = corpus(target).join(format!("seed-{name}"));
            let saved = std::fs::read(&p)
                .unwrap_or_else(|e| panic!("{}: {e}; run write_network_seed_corpus", p.display()));
            assert_eq!(
                saved,
                bytes,
                "{} is stale; run write_network_seed_corpus",
                p.display()
            );
        }
    }
}

/// The TCP seeds really complete their handshakes (a stale sequence number would only test
/// the reset path): each answers with more than the SYN-ACK.
#[test]
fn tcp_seeds_reach_the_established_state() {
    for (name, bytes) in stack_seeds() {
        if !["dns-tcp", "tls-allowed", "http-allowed", "ssh-relayed"].contains(&name.as_str()) {
            continue;
        }
        let out = stack_frames_capture(&bytes);
        // (RST, payload bytes) of every TCP segment the stack sent.
        let segs: Vec<(bool, usize)> = out
            .iter()
            .filter_map(|f| {
                let e = EthernetFrame::new_checked(&f[..]).ok()?;
                let ip = Ipv4Packet::new_checked(e.payload()).ok()?;
                let t = TcpPacket::new_checked(ip.payload()).ok()?;
                Some((t.rst(), t.payload().len()))
            })
            .collect();
        assert!(
            segs.iter().all(|(rst, _)| !rst),
            "{name}: the stack reset the seeded connection: {segs:?}"
        );
        if name == "dns-tcp" {
            let answered: usize = segs.iter().map(|(_, n)| n).sum();
            assert!(
                answered > 2 * 30,
                "{name}: two DNS answers expected, got {segs:?}"
            );
        }
    }
}

/// CI's fuzzing: every saved input of every network target (seeds and what fuzz runs added).
#[test]
fn saved_corpora_replay_cleanly() {
    for (target, run) in TARGETS {
        let rd = std::fs::read_dir(corpus(target))
            .unwrap_or_else(|e| panic!("fuzz/corpus/{target}: {e}"));
        let mut n = 0;
        for e in rd {
            let p = e.unwrap().path();
            run(&std::fs::read(&p).unwrap());
            n += 1;
        }
        assert!(n > 0, "no saved corpus for {target}");
    }
}

/// The placeholder seeds reach the block path (so the fuzzer starts from inputs that block).
#[test]
fn placeholder_seeds_are_blocked_for_another_host() {
    use crate::network::intercept::swap::find_blocked_in_http1;
    use crate::secrets::{Binding, Snapshot, Value};
    let snap = Snapshot {
        bindings: vec![Binding {
            name: "KEY".into(),
            hosts: vec!["api.test".into()],
            headers: vec!["x-extra".into()],
            in_body: false,
            placeholder: FUZZ_PLACEHOLDER.into(),
            value: Value::new(b"v".to_vec()),
        }],
        git: vec![],
    };
    for (name, seed) in placeholder_seeds() {
        let blocked = find_blocked_in_http1(&seed[1..], &snap, "other.test").is_some();
        assert_eq!(blocked, name != "value", "{name}");
        placeholders(&seed);
    }
}
