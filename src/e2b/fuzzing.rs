//! What the `e2b_wire` fuzz target checks on one input, shared with the unit tests that replay
//! the saved corpus (`fuzz/corpus/e2b_wire/`). Compiled here and, by path, into the fuzz crate
//! together with `connect.rs` and `proto.rs` (so it uses only those two).
//!
//! The input's first byte picks a chunk size; the rest is a streaming request body (Connect
//! envelopes) fed to the decoder in chunks of that size, and also the body of a unary request.
//! Checks: the decoder never panics, never yields a message over `MAX_MESSAGE`, yields the same
//! messages however the body is split, and a body made of the messages it yielded decodes to
//! them again; every envd request type decodes (or refuses) any message without panicking, and
//! a signal is only ever SIGTERM or SIGKILL.

use super::connect::{Decoder, Frame, MAX_MESSAGE, envelope};
use super::proto::{
    MoveRequest, PathRequest, SelectRequest, SendInputRequest, SendSignalRequest, StartRequest,
    StreamInputRequest, UpdateRequest, signal_number,
};

/// Messages of `body` fed in `chunk`-byte pieces, and whether the decoder refused it.
fn frames(body: &[u8], chunk: usize) -> (Vec<Vec<u8>>, bool) {
    let mut d = Decoder::default();
    let mut out = Vec::new();
    for c in body.chunks(chunk.max(1)) {
        d.push(c);
        loop {
            match d.next() {
                Ok(Some(Frame::Message(m))) => {
                    assert!(m.len() <= MAX_MESSAGE, "a message over the limit");
                    out.push(m.to_vec());
                }
                Ok(Some(Frame::End)) => {}
                Ok(None) => break,
                Err(_) => return (out, true),
            }
        }
    }
    (out, false)
}

fn decode_all(msg: &[u8]) {
    let _ = serde_json::from_slice::<StartRequest>(msg);
    let _ = serde_json::from_slice::<SelectRequest>(msg);
    let _ = serde_json::from_slice::<SendInputRequest>(msg);
    let _ = serde_json::from_slice::<StreamInputRequest>(msg);
    let _ = serde_json::from_slice::<UpdateRequest>(msg);
    let _ = serde_json::from_slice::<PathRequest>(msg);
    let _ = serde_json::from_slice::<MoveRequest>(msg);
    if let Ok(r) = serde_json::from_slice::<SendSignalRequest>(msg)
        && let Some(sig) = r.signal.as_ref().and_then(signal_number)
    {
        assert!(sig == 9 || sig == 15, "signal {sig} from {r:?}");
    }
}

pub fn wire(data: &[u8]) {
    let Some((&pick, body)) = data.split_first() else {
        return;
    };
    let chunk = usize::from(pick % 64) + 1;
    let (whole, whole_err) = frames(body, body.len().max(1));
    let (split, split_err) = frames(body, chunk);
    assert_eq!(
        whole, split,
        "the messages depend on how the body was split"
    );
    assert_eq!(
        whole_err, split_err,
        "a refusal depends on how the body was split"
    );
    let again: Vec<u8> = whole.iter().flat_map(|m| envelope(0, m).to_vec()).collect();
    assert_eq!(frames(&again, chunk), (whole.clone(), false));
    for m in &whole {
        decode_all(m);
    }
    decode_all(body);
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::PathBuf;

    fn corpus() -> PathBuf {
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("fuzz/corpus/e2b_wire")
    }

    /// Inputs the SDKs really send, and broken ones.
    fn seeds() -> Vec<(&'static str, Vec<u8>)> {
        let env = |j: &str| envelope(0, j.as_bytes()).to_vec();
        let mut stream = vec![7u8];
        stream.extend(env(r#"{"start":{"process":{"pid":42}}}"#));
        stream.extend(env(r#"{"data":{"input":{"stdin":"aGk="}}}"#));
        stream.extend(env(r#"{"keepalive":{}}"#));
        let mut start = vec![0u8];
        start.extend(env(
            r#"{"process":{"cmd":"/bin/bash","args":["-l","-c","echo hi"],"envs":{"A":"1"},"cwd":"/home/user"},"pty":{"size":{"cols":80,"rows":24}},"stdin":false}"#,
        ));
        let mut compressed = vec![3u8, 1, 0, 0, 0, 2];
        compressed.extend(b"{}");
        vec![
            ("start", start),
            ("stream-input", stream),
            (
                "signal",
                [
                    &[1u8][..],
                    br#"{"process":{"pid":"7"},"signal":"SIGNAL_SIGKILL"}"#,
                ]
                .concat(),
            ),
            (
                "signal-num",
                [&[1u8][..], br#"{"process":{"tag":"t"},"signal":2}"#].concat(),
            ),
            (
                "listdir",
                [&[2u8][..], br#"{"path":"/home/user","depth":"3"}"#].concat(),
            ),
            (
                "move",
                [&[9u8][..], br#"{"source":"a","destination":"../b"}"#].concat(),
            ),
            ("compressed", compressed),
            ("huge-len", vec![5u8, 0, 0xff, 0xff, 0xff, 0xff]),
            ("truncated", vec![5u8, 0, 0, 0, 0, 9, b'{']),
            ("end", [&[0u8][..], &envelope(2, b"{}")].concat()),
        ]
    }

    #[test]
    #[ignore = "writes the seed corpus into the source tree"]
    fn write_e2b_wire_seed_corpus() {
        std::fs::create_dir_all(corpus()).unwrap();
        for (name, data) in seeds() {
            std::fs::write(corpus().join(format!("seed-{name}")), data).unwrap();
        }
    }

    #[test]
    fn saved_e2b_wire_corpus_is_current_and_replays_cleanly() {
        for (name, data) in seeds() {
            let p = corpus().join(format!("seed-{name}"));
            let saved = std::fs::read(&p)
                .unwrap_or_else(|e| panic!("{}: {e}; run write_e2b_wire_seed_corpus", p.display()));
            assert_eq!(
                saved, data,
                "{name} is stale; run write_e2b_wire_seed_corpus"
            );
        }
        for e in std::fs::read_dir(corpus()).unwrap() {
            wire(&std::fs::read(e.unwrap().path()).unwrap());
        }
    }

    #[test]
    fn random_inputs_hold_the_checks() {
        let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
        for _ in 0..3000 {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            let len = (x % 200) as usize;
            let mut v = Vec::with_capacity(len);
            let mut y = x;
            for _ in 0..len {
                y = y
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                // Mostly small lengths, so whole envelopes occur.
                v.push(match y >> 61 {
                    0 => 0,
                    1 => b'{',
                    _ => (y >> 33) as u8,
                });
            }
            wire(&v);
        }
    }
}
