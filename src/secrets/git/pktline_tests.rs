//! The receive-pack screener and report: every-offset splits, malformed and oversized bodies,
//! push certificates, shallow lines, the probe, deny-wins; the fuzz target's saved corpus
//! (`fuzz/corpus/receive_pack/`) and a bounded run of random inputs.

use std::path::PathBuf;

use super::fuzzing::{read_pkts, read_report, receive_pack, screen_in_chunks};
use super::pktline::*;

const Z: &str = "0000000000000000000000000000000000000000";
const A: &str = "1111111111111111111111111111111111111111";
const B: &str = "2222222222222222222222222222222222222222";
const CAPS: &str = " report-status-v2 side-band-64k quiet object-format=sha1 agent=git/2.47.3";

fn pats(p: &[&str]) -> Vec<String> {
    p.iter().map(|s| s.to_string()).collect()
}

/// A push body as git sends it: commands (caps on the first), flush, then a pack.
fn push_body(refs: &[&str], caps: &str) -> Vec<u8> {
    let mut b = Vec::new();
    for (i, r) in refs.iter().enumerate() {
        let line = if i == 0 {
            format!("{Z} {A} {r}\0{caps}")
        } else {
            format!("{A} {B} {r}\n")
        };
        b.extend(pkt(line.as_bytes()));
    }
    b.extend(b"0000");
    b.extend(b"PACK\0\0\0\x02\0\0\0\x03 and pack bytes that are never read");
    b
}

fn refused(s: Screen) -> Rejection {
    match s {
        Screen::Refuse(r) => r,
        other => panic!("expected a refusal, got {other:?}"),
    }
}

fn allowed_refs(s: Screen) -> Vec<String> {
    match s {
        Screen::Allow { commands } => commands.into_iter().map(|c| c.name).collect(),
        other => panic!("expected an allow, got {other:?}"),
    }
}

#[test]
fn a_push_split_at_every_offset_decides_the_same() {
    let p = pats(&["agent/*"]);
    let good = push_body(&["refs/heads/agent/x", "refs/heads/agent/y"], CAPS);
    let bad = push_body(&["refs/heads/agent/x", "refs/heads/main"], CAPS);
    for (body, want_allow) in [(&good, true), (&bad, false)] {
        let whole = screen_in_chunks(&p, body, body.len());
        assert_eq!(
            matches!(whole, Screen::Allow { .. }),
            want_allow,
            "{whole:?}"
        );
        for cut in 0..=body.len() {
            let mut s = Screener::new(p.clone());
            let first = s.feed(&body[..cut]);
            // Nothing is decided before the flush has arrived.
            let flush_end = body.len() - read_pkts(body).unwrap().1.len();
            assert_eq!(first == Screen::NeedMore, cut < flush_end, "cut {cut}");
            let second = s.feed(&body[cut..]);
            assert_eq!(second, whole, "split at {cut}");
            assert_eq!(s.finish(), whole, "split at {cut}");
        }
    }
    assert_eq!(
        allowed_refs(screen_in_chunks(&p, &good, 3)),
        ["refs/heads/agent/x", "refs/heads/agent/y"]
    );
}

#[test]
fn deny_wins_and_every_ref_is_reported() {
    let p = pats(&["agent/*"]);
    let body = push_body(
        &[
            "refs/heads/agent/x",
            "refs/heads/main",
            "refs/heads/agent/y",
            "refs/tags/v1",
        ],
        " report-status",
    );
    let r = refused(screen_in_chunks(&p, &body, 5));
    let reasons: Vec<bool> = r.refs.iter().map(|s| s.reason.is_some()).collect();
    assert_eq!(reasons, [false, true, false, true]);
    assert_eq!(
        r.message,
        "tryboxi: push to main is not allowed; allowed: agent/* (and 1 more refused refs)"
    );
    let lines = read_report(&r.report(), &r.capabilities).unwrap();
    assert_eq!(
        lines,
        [
            "unpack ok",
            "ng refs/heads/agent/x tryboxi: refused with the rest of the push",
            "ng refs/heads/main tryboxi: push to main is not allowed; allowed: agent/*",
            "ng refs/heads/agent/y tryboxi: refused with the rest of the push",
            "ng refs/tags/v1 tryboxi: push to v1 is not allowed; allowed: agent/*",
        ]
    );
    // A deny pattern refuses a ref an allow pattern matches.
    let p = pats(&["agent/**", "!agent/release/*"]);
    let body = push_body(&["refs/heads/agent/x", "refs/heads/agent/release/1"], CAPS);
    let r = refused(screen_in_chunks(&p, &body, 1));
    assert!(
        r.message.contains("denied by !agent/release/*"),
        "{}",
        r.message
    );
}

#[test]
fn the_report_is_byte_exact_without_side_band() {
    let r = [RefStatus {
        name: "refs/heads/main".into(),
        reason: Some("tryboxi: no".into()),
    }];
    let caps = Capabilities::parse("report-status");
    assert_eq!(
        report("tryboxi: no", &r, &caps),
        b"000eunpack ok\n0023ng refs/heads/main tryboxi: no\n0000"
    );
    // No report asked for: nothing to say.
    assert!(report("x", &r, &Capabilities::default()).is_empty());
}

#[test]
fn the_report_is_side_band_framed_when_asked() {
    let r = [RefStatus {
        name: "refs/heads/main".into(),
        reason: Some("tryboxi: no".into()),
    }];
    let caps = Capabilities::parse("report-status side-band-64k");
    let body = report("tryboxi: push to main\nis not allowed", &r, &caps);
    let (pkts, rest) = read_pkts(&body).unwrap();
    assert!(rest.is_empty());
    // Band 2 first (git prints it as `remote: ...`), on one line.
    assert_eq!(pkts[0], b"\x02tryboxi: push to main is not allowed\n");
    assert_eq!(pkts[1][0], 1);
    assert_eq!(
        &pkts[1][1..],
        b"000eunpack ok\n0023ng refs/heads/main tryboxi: no\n0000"
    );
    // side-band (not 64k) cuts band 1 into packets of at most 1000 bytes.
    let many: Vec<RefStatus> = (0..100)
        .map(|i| RefStatus {
            name: format!("refs/heads/b{i}"),
            reason: None,
        })
        .collect();
    let caps = Capabilities::parse("report-status side-band");
    let body = report("m", &many, &caps);
    let (pkts, _) = read_pkts(&body).unwrap();
    assert!(pkts.len() > 3);
    assert!(
        pkts.iter().all(|p| p.len() + 4 <= 1000),
        "side-band packets fit 1000 bytes"
    );
    let lines = read_report(&body, &caps).unwrap();
    assert_eq!(lines.len(), 101);
}

#[test]
fn the_probe_and_an_empty_body_are_allowed() {
    let mut s = Screener::new(pats(&["agent/*"]));
    assert_eq!(s.feed(b"0000"), Screen::Allow { commands: vec![] });
    let mut s = Screener::new(pats(&["agent/*"]));
    assert_eq!(s.feed(b""), Screen::NeedMore);
    assert_eq!(s.finish(), Screen::Allow { commands: vec![] });
    // Even with no patterns: a probe updates nothing.
    let mut s = Screener::new(vec![]);
    assert_eq!(s.feed(b"00"), Screen::NeedMore);
    assert_eq!(s.feed(b"00"), Screen::Allow { commands: vec![] });
    // A body cut inside the command list is refused at its end.
    let mut s = Screener::new(pats(&["agent/*"]));
    let body = push_body(&["refs/heads/agent/x"], CAPS);
    assert_eq!(s.feed(&body[..20]), Screen::NeedMore);
    assert!(refused(s.finish()).message.contains("ended early"));
}

#[test]
fn malformed_lengths_and_lines_are_refused() {
    let p = pats(&["**", "refs/**"]);
    let first = pkt(format!("{Z} {A} refs/heads/a\0 report-status").as_bytes());
    for (what, tail) in [
        ("non-hex", b"00zz".to_vec()),
        ("sign", b"+004".to_vec()),
        ("too short", b"0003".to_vec()),
        ("delim", b"0001".to_vec()),
        ("response end", b"0002".to_vec()),
        ("empty line", b"0004".to_vec()),
        ("too long", b"fff1".to_vec()),
        ("garbage line", pkt(b"hello\n")),
        (
            "short oid",
            pkt(format!("{} {A} refs/heads/b", &Z[1..]).as_bytes()),
        ),
        (
            "non-hex oid",
            pkt(format!("{} {A} refs/heads/b", Z.replace('0', "g")).as_bytes()),
        ),
        ("no ref", pkt(format!("{Z} {A} ").as_bytes())),
        ("no spaces", pkt(format!("{Z}x{A}xrefs/heads/b").as_bytes())),
        (
            "late caps",
            pkt(format!("{Z} {A} refs/heads/b\0 side-band").as_bytes()),
        ),
        ("bad shallow", pkt(b"shallow 1234\n")),
        (
            "non-utf8 ref",
            pkt(format!("{Z} {A} refs/heads/\u{fffd}").as_bytes())
                .into_iter()
                .map(|b| if b == 0xef { 0xff } else { b })
                .collect(),
        ),
    ] {
        let body = [first.clone(), tail, b"0000".to_vec()].concat();
        for cut in [1, 3, body.len()] {
            let r = refused(screen_in_chunks(&p, &body, cut));
            assert!(r.refs.is_empty(), "{what}: {r:?}");
            assert!(r.message.starts_with("tryboxi: "), "{what}");
            // The client asked for report-status: the refusal says why in `unpack`.
            let lines = read_report(&r.report(), &r.capabilities).unwrap();
            assert_eq!(lines, [format!("unpack {}", r.message)], "{what}");
        }
    }
    // A ref name that git would refuse is refused here too, by name.
    let body = push_body(&["refs/heads/agent/../main"], " report-status");
    let r = refused(screen_in_chunks(&p, &body, 2));
    assert!(
        r.refs[0]
            .reason
            .as_deref()
            .unwrap()
            .contains("not a valid ref name")
    );
}

#[test]
fn an_oversized_preamble_or_too_many_commands_is_refused() {
    // 17 lines of ~65,000 bytes: past 1 MiB before any flush.
    let long = format!("{Z} {A} refs/heads/agent/{}", "x".repeat(64_900));
    let mut body = Vec::new();
    for _ in 0..17 {
        body.extend(pkt(long.as_bytes()));
    }
    let r = refused(screen_in_chunks(&pats(&["agent/*"]), &body, 65_536));
    assert!(r.message.contains("larger than"), "{}", r.message);
    // 10,001 short commands (under 1 MiB in all).
    let mut body = pkt(format!("{Z} {A} refs/heads/a\0 report-status").as_bytes());
    for _ in 0..MAX_COMMANDS {
        body.extend(pkt(format!("{Z} {A} refs/heads/a").as_bytes()));
    }
    body.extend(b"0000");
    assert!(body.len() < MAX_PREAMBLE);
    let r = refused(screen_in_chunks(&pats(&["*"]), &body, 4096));
    assert!(r.message.contains("more than 10000 refs"), "{}", r.message);
    // Exactly the limit is fine.
    let cut = body.len() - 4 - pkt(format!("{Z} {A} refs/heads/a").as_bytes()).len();
    let exact = [&body[..cut], b"0000"].concat();
    assert_eq!(
        allowed_refs(screen_in_chunks(&pats(&["*"]), &exact, 4096)).len(),
        MAX_COMMANDS
    );
}

#[test]
fn push_certificates_are_refused_with_a_message_git_prints() {
    let mut body = pkt(b"push-cert\0 report-status side-band-64k push-cert=123\n");
    body.extend(pkt(b"certificate version 0.1\n"));
    body.extend(pkt(b"pusher x\n"));
    let r = refused(screen_in_chunks(&pats(&["agent/*"]), &body, 1));
    assert!(r.message.contains("push certificates"), "{}", r.message);
    assert!(r.capabilities.has("side-band-64k"));
    let out = r.report();
    let (pkts, _) = read_pkts(&out).unwrap();
    assert!(pkts[0].starts_with(b"\x02tryboxi: signed pushes"));
    let lines = read_report(&out, &r.capabilities).unwrap();
    assert!(
        lines[0].starts_with("unpack tryboxi: signed pushes"),
        "{lines:?}"
    );
}

#[test]
fn shallow_lines_are_skipped_and_sha256_is_read() {
    let mut body = pkt(format!("shallow {A}\n").as_bytes());
    body.extend(push_body(&["refs/heads/agent/x"], CAPS));
    assert_eq!(
        allowed_refs(screen_in_chunks(&pats(&["agent/*"]), &body, 9)),
        ["refs/heads/agent/x"]
    );
    let z = "0".repeat(64);
    let a = "a".repeat(64);
    let mut body = pkt(format!("shallow {a}").as_bytes());
    body.extend(pkt(format!(
        "{z} {a} refs/heads/agent/x\0 report-status object-format=sha256"
    )
    .as_bytes()));
    body.extend(pkt(format!("{a} {z} refs/heads/main\n").as_bytes()));
    body.extend(b"0000");
    let r = refused(screen_in_chunks(&pats(&["agent/*"]), &body, 11));
    assert_eq!(r.refs.len(), 2);
    assert!(r.refs[1].reason.is_some());
    // A sha1-length line in a sha256 push is malformed.
    let mut body = pkt(format!("{z} {a} refs/heads/agent/x\0 object-format=sha256").as_bytes());
    body.extend(pkt(format!("{Z} {A} refs/heads/agent/y").as_bytes()));
    body.extend(b"0000");
    assert!(
        refused(screen_in_chunks(&pats(&["agent/*"]), &body, 100))
            .refs
            .is_empty()
    );
}

#[test]
fn bytes_after_the_decision_are_ignored() {
    let body = push_body(&["refs/heads/agent/x"], CAPS);
    let mut s = Screener::new(pats(&["agent/*"]));
    let d = s.feed(&body);
    assert!(matches!(d, Screen::Allow { .. }));
    assert_eq!(s.feed(b"zzzz garbage"), d);
    assert_eq!(s.finish(), d);
}

// ---- the fuzz target's corpus and a bounded random run ----

fn corpus() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("fuzz/corpus/receive_pack")
}

fn seeds() -> Vec<(&'static str, Vec<u8>)> {
    let pick = |p: u8, b: Vec<u8>| [vec![p], b].concat();
    let mut cert = pkt(b"push-cert\0 report-status side-band-64k\n");
    cert.extend(pkt(b"certificate version 0.1\n"));
    vec![
        ("allowed", pick(0, push_body(&["refs/heads/agent/x"], CAPS))),
        (
            "refused-main",
            pick(
                4,
                push_body(&["refs/heads/agent/x", "refs/heads/main"], CAPS),
            ),
        ),
        (
            "deny-pattern",
            pick(1, push_body(&["refs/heads/agent/release/1"], CAPS)),
        ),
        (
            "tag",
            pick(
                2,
                push_body(&["refs/tags/v1", "refs/heads/main"], " report-status"),
            ),
        ),
        (
            "no-patterns",
            pick(3, push_body(&["refs/heads/agent/x"], " side-band")),
        ),
        ("probe", pick(0, b"0000".to_vec())),
        ("empty", vec![0]),
        ("push-cert", pick(0, cert)),
        (
            "shallow",
            pick(
                8,
                [
                    pkt(format!("shallow {A}").as_bytes()),
                    push_body(&["refs/heads/agent/x"], CAPS),
                ]
                .concat(),
            ),
        ),
        ("bad-length", pick(0, b"00zz0000".to_vec())),
        ("too-long", pick(0, b"ffff".to_vec())),
        (
            "truncated",
            pick(0, push_body(&["refs/heads/agent/x"], CAPS)[..50].to_vec()),
        ),
    ]
}

/// Writes the seed corpus: `cargo test --lib write_receive_pack_seed_corpus -- --ignored`.
#[test]
#[ignore]
fn write_receive_pack_seed_corpus() {
    std::fs::create_dir_all(corpus()).unwrap();
    for (name, bytes) in seeds() {
        std::fs::write(corpus().join(format!("seed-{name}")), bytes).unwrap();
    }
}

#[test]
fn saved_receive_pack_seeds_are_current_and_replay_cleanly() {
    for (name, bytes) in seeds() {
        let p = corpus().join(format!("seed-{name}"));
        let saved = std::fs::read(&p)
            .unwrap_or_else(|e| panic!("{}: {e}; run write_receive_pack_seed_corpus", p.display()));
        assert_eq!(saved, bytes, "{} is stale", p.display());
    }
    let mut n = 0;
    for e in std::fs::read_dir(corpus()).unwrap() {
        receive_pack(&std::fs::read(e.unwrap().path()).unwrap());
        n += 1;
    }
    assert!(n >= seeds().len());
}

/// A bounded random run of the fuzz check in every `cargo test`: seeds mutated by a fixed-seed
/// xorshift (byte flips, cut, duplicated ranges, length digits).
#[test]
fn random_receive_pack_inputs_hold_the_fuzz_checks() {
    let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
    let mut next = move || {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        x
    };
    let seeds = seeds();
    for _ in 0..3000 {
        let mut b = seeds[(next() % seeds.len() as u64) as usize].1.clone();
        for _ in 0..(next() % 4) {
            if b.is_empty() {
                break;
            }
            let i = (next() % b.len() as u64) as usize;
            match next() % 5 {
                0 => b[i] = next() as u8,
                1 => b[i] = b"0123456789abcdef"[(next() % 16) as usize],
                2 => b.truncate(i),
                3 => {
                    let j = i + (next() % 64) as usize;
                    let part = b[i..j.min(b.len())].to_vec();
                    b.splice(i..i, part);
                }
                _ => b.insert(i, 0),
            }
        }
        receive_pack(&b);
    }
}
