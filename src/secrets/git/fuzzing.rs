//! What the `receive_pack` fuzz target checks on one input, shared with the unit tests that
//! replay the saved corpus (`fuzz/corpus/receive_pack/`) and run a bounded number of random
//! inputs. Compiled both here and, by path, into the fuzz crate (with [`super::pktline`] and
//! [`super::refs`] beside it): it may only use those two modules.
//!
//! The first input byte picks the grant's patterns (bits 0-1) and how the body is cut into
//! chunks (the rest of the byte); the rest is a `git-receive-pack` request body. Checked, beyond
//! "no panic": the decision does not depend on how the body is cut; an allowed push's refs all
//! pass the patterns and a refused one names at least one refused ref (or none was read); the
//! report of a refusal is well-formed pkt-lines (side-band demultiplexed when asked) that say
//! `unpack ...` and `ng <ref>` for exactly the push's refs.

use super::pktline::{Capabilities, MAX_COMMANDS, MAX_PKT, Screen, Screener};
use super::refs;

const PATTERNS: [&[&str]; 4] = [
    &["agent/*"],
    &["agent/**", "!agent/release/*"],
    &["refs/tags/v*", "main"],
    &[],
];

/// Feeds `body` in pieces of `cut` bytes (the last may be shorter), then finishes.
pub fn screen_in_chunks(patterns: &[String], body: &[u8], cut: usize) -> Screen {
    let mut s = Screener::new(patterns.to_vec());
    for c in body.chunks(cut.max(1)) {
        if s.feed(c) != Screen::NeedMore {
            break;
        }
    }
    s.finish()
}

/// The fuzz target's check (see the module docs).
pub fn receive_pack(data: &[u8]) {
    let Some((&pick, body)) = data.split_first() else {
        return;
    };
    let patterns: Vec<String> = PATTERNS[usize::from(pick & 3)]
        .iter()
        .map(|s| s.to_string())
        .collect();
    let whole = screen_in_chunks(&patterns, body, body.len());
    for cut in [1, usize::from(pick >> 2) + 1, 7] {
        assert_eq!(
            screen_in_chunks(&patterns, body, cut),
            whole,
            "fed in {cut}-byte chunks the screener decided differently"
        );
    }
    match &whole {
        Screen::NeedMore => panic!("finish() left the screener undecided"),
        Screen::Allow { commands } => {
            assert!(commands.len() <= MAX_COMMANDS);
            for c in commands {
                assert_eq!(refs::check_ref(&patterns, &c.name), Ok(()), "{c:?}");
            }
        }
        Screen::Refuse(r) => {
            assert!(r.refs.len() <= MAX_COMMANDS);
            assert!(r.refs.is_empty() || r.refs.iter().any(|s| s.reason.is_some()));
            for s in &r.refs {
                assert_eq!(
                    s.reason.is_none(),
                    refs::check_ref(&patterns, &s.name).is_ok()
                );
            }
            let lines = read_report(&r.report(), &r.capabilities)
                .unwrap_or_else(|e| panic!("the report does not parse: {e}"));
            if r.capabilities.has("report-status") || r.capabilities.has("report-status-v2") {
                assert!(lines.first().is_some_and(|l| l.starts_with("unpack ")));
                let ng: Vec<&str> = lines[1..]
                    .iter()
                    .map(|l| l.strip_prefix("ng ").expect("only ng lines follow"))
                    .collect();
                assert_eq!(ng.len(), r.refs.len());
            }
        }
    }
}

/// Splits pkt-lines until a flush; returns the lines' payloads and the bytes after the flush.
pub fn read_pkts(mut b: &[u8]) -> Result<(Vec<Vec<u8>>, &[u8]), String> {
    let mut out = Vec::new();
    loop {
        let h = b.get(..4).ok_or("truncated pkt-line header")?;
        let h = std::str::from_utf8(h).map_err(|_| "bad header")?;
        let n = usize::from_str_radix(h, 16).map_err(|_| "bad header")?;
        if n == 0 {
            return Ok((out, &b[4..]));
        }
        if !(5..=MAX_PKT).contains(&n) || n > b.len() {
            return Err(format!("bad pkt-line length {n}"));
        }
        out.push(b[4..n].to_vec());
        b = &b[n..];
    }
}

/// The report-status lines (newlines removed) of a receive-pack result body, demultiplexing
/// side-band if `caps` asked for it; band-2 messages are skipped, band 3 is an error.
pub fn read_report(body: &[u8], caps: &Capabilities) -> Result<Vec<String>, String> {
    let status: Vec<u8> = if caps.has("side-band-64k") || caps.has("side-band") {
        let (pkts, rest) = read_pkts(body)?;
        if !rest.is_empty() {
            return Err("bytes after the final flush".into());
        }
        let mut s = Vec::new();
        for p in pkts {
            match p.split_first() {
                Some((1, d)) => s.extend_from_slice(d),
                Some((2, _)) => {}
                _ => return Err("an unexpected side-band packet".into()),
            }
        }
        s
    } else {
        body.to_vec()
    };
    if status.is_empty() {
        return Ok(vec![]);
    }
    let (lines, rest) = read_pkts(&status)?;
    if !rest.is_empty() {
        return Err("bytes after the report's flush".into());
    }
    lines
        .into_iter()
        .map(|l| {
            let s = String::from_utf8(l).map_err(|_| "a report line is not UTF-8")?;
            s.strip_suffix('\n')
                .map(str::to_owned)
                .ok_or_else(|| "a report line without newline".to_string())
        })
        .collect()
}
