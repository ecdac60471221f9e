//! What the fuzz targets check on one input, shared with the unit tests that replay the saved
//! corpora (`fuzz/corpus/<target>/`, replayed by `cargo test` in CI; `cargo +nightly fuzz run
//! <target>` grows them). Compiled both here and, by path, into the fuzz crate: it may only use
//! [`super::frame`] and [`super::msg`].
//!
//! Every check panics on a violation: a decode that panics or allocates without bound (the
//! fuzzer's memory limit catches that), or a value that does not survive a round trip.

use super::frame::{decode_answer, decode_frame, decode_payload, encode, encode_answer};
use super::msg::{
    Body, DirEntry, ErrorKind, ExecSpec, FileKind, FileStat, Frame, PtySize, RemoteError, Reply,
    Request, WalkCursor, WalkDelta, WalkEntry, WireExecEvent,
};
use serde::Serialize;
use serde::de::DeserializeOwned;

/// `frame_decode`: the bytes as a stream of frames, then as one bare payload.
pub fn frame_decode(data: &[u8]) {
    let mut rest = data;
    while let Ok(Some((frame, used))) = decode_frame(rest) {
        // Whatever decodes must encode again and decode to the same frame.
        let bytes = encode(&frame).expect("a decoded frame re-encodes");
        let (again, _) = decode_frame(&bytes).expect("re-decodes").expect("complete");
        assert_eq!(again, frame);
        rest = &rest[used..];
    }
    let _ = decode_payload(data);
}

/// The message types `msg_decode` picks from with its first byte, in this order.
pub const MSG_TYPES: &[&str] = &[
    "Frame",
    "Body",
    "Request",
    "Reply",
    "WireExecEvent",
    "ExecSpec",
    "WalkDelta",
    "Vec<WalkEntry>",
    "WalkEntry",
    "WalkCursor",
    "RemoteError",
    "ErrorKind",
    "FileStat",
    "FileKind",
    "DirEntry",
    "PtySize",
];

/// Decodes `bytes` as a `T` the way guest data is decoded (the answer codec: one value, its
/// byte limit), and checks that whatever decodes round-trips.
fn check<T>(bytes: &[u8])
where
    T: Serialize + DeserializeOwned + PartialEq + std::fmt::Debug,
{
    if let Ok(v) = decode_answer::<T>(bytes) {
        let again = encode_answer(&v).expect("a decoded value re-encodes");
        assert_eq!(decode_answer::<T>(&again).expect("re-decodes"), v);
    }
}

/// `msg_decode`: the first byte picks one of [`MSG_TYPES`], the rest is decoded as that type.
/// Frames go through the frame codec too.
pub fn msg_decode(data: &[u8]) {
    let Some((&pick, rest)) = data.split_first() else {
        return;
    };
    match pick as usize % MSG_TYPES.len() {
        0 => {
            check::<Frame>(rest);
            frame_decode(rest);
        }
        1 => check::<Body>(rest),
        2 => check::<Request>(rest),
        3 => check::<Reply>(rest),
        4 => check::<WireExecEvent>(rest),
        5 => check::<ExecSpec>(rest),
        6 => check::<WalkDelta>(rest),
        7 => check::<Vec<WalkEntry>>(rest),
        8 => check::<WalkEntry>(rest),
        9 => check::<WalkCursor>(rest),
        10 => check::<RemoteError>(rest),
        11 => check::<ErrorKind>(rest),
        12 => check::<FileStat>(rest),
        13 => check::<FileKind>(rest),
        14 => check::<DirEntry>(rest),
        _ => check::<PtySize>(rest),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::PathBuf;

    fn corpus(target: &str) -> PathBuf {
        PathBuf::from(env!("CARGO_MANIFEST_DIR"))
            .join("fuzz/corpus")
            .join(target)
    }

    fn entry(path: &str) -> WalkEntry {
        WalkEntry {
            path: path.into(),
            kind: FileKind::File,
            size: 12,
            mode: 0o644,
            mtime: 1_700_000_000,
            mtime_nsec: 5,
            link: None,
            base: false,
        }
    }

    fn stat() -> FileStat {
        FileStat {
            kind: FileKind::Dir,
            size: 4096,
            mode: 0o755,
            mtime: 1,
            uid: 0,
            gid: 0,
            link: Some("t".into()),
        }
    }

    fn enc<T: Serialize + serde::de::DeserializeOwned>(pick: usize, v: &T) -> Vec<u8> {
        let mut b = vec![pick as u8];
        b.extend(encode_answer(v).unwrap());
        b
    }

    /// One valid seed per message type (most with every variant), plus the hostile shapes the
    /// host has met: lengths far past the input.
    fn seeds() -> Vec<(String, Vec<u8>)> {
        let spec = ExecSpec {
            argv: vec!["sh".into(), "-c".into(), "echo hi".into()],
            shell: Some("ls".into()),
            env: vec![("K".into(), "V".into())],
            cwd: Some("/workspace".into()),
            timeout_ms: Some(5000),
            pty: Some(PtySize { rows: 24, cols: 80 }),
            user: Some("user".into()),
        };
        let delta = WalkDelta {
            cursor: WalkCursor {
                epoch: 7,
                generation: 300,
            },
            full: false,
            entries: vec![entry("a/b.txt"), {
                let mut e = entry("l");
                e.kind = FileKind::Symlink;
                e.link = Some("../x".into());
                e
            }],
            removed: vec!["gone".into()],
        };
        let requests = vec![
            Request::Ping,
            Request::Shutdown,
            Request::Exec(spec.clone()),
            Request::Resume {
                exec_id: 3,
                from_seq: 9,
            },
            Request::ReadFile { path: "/f".into() },
            Request::WriteFile {
                path: "/f".into(),
                mode: 0o600,
            },
            Request::Stat { path: "/".into() },
            Request::List { path: "/".into() },
            Request::Mkdir {
                path: "/d".into(),
                mode: 0o755,
            },
            Request::Remove {
                path: "/d".into(),
                recursive: true,
            },
            Request::Untar {
                dir: "/workspace".into(),
                delete: vec!["old".into()],
            },
            Request::Walk {
                path: "/workspace".into(),
                skip: vec![".git".into()],
            },
            Request::WalkSince {
                path: "/workspace".into(),
                skip: vec![],
                since: Some(delta.cursor),
                stat_all: true,
            },
            Request::UntarDisk {
                dir: "/workspace".into(),
                delete: vec![],
                serial: "xfer".into(),
                len: 1 << 30,
            },
            Request::MountBase {
                dir: "/workspace".into(),
                serial: "base".into(),
            },
            Request::SetIdentity {
                hostname: "h".into(),
                seed: vec![1, 2, 3],
            },
            Request::Rename {
                from: "/a".into(),
                to: "/b".into(),
            },
            Request::WatchDir {
                path: "/w".into(),
                recursive: true,
            },
            Request::Chown {
                path: "/a".into(),
                uid: 1000,
                gid: 1000,
            },
            Request::SetClock {
                unix_ms: 1_800_000_000_000,
            },
        ];
        let replies = [
            Reply::Pong,
            Reply::Done,
            Reply::Resumed,
            Reply::Stat(stat()),
            Reply::List(vec![DirEntry {
                name: "x".into(),
                stat: stat(),
            }]),
        ];
        let events = [
            WireExecEvent::Started { exec_id: 1, pid: 2 },
            WireExecEvent::Stdout(b"out".to_vec()),
            WireExecEvent::Stderr(b"err".to_vec()),
            WireExecEvent::Exit {
                code: Some(1),
                signal: None,
                timed_out: true,
            },
        ];
        let err = RemoteError::new(ErrorKind::NotFound, "no such file");
        let mut bodies = vec![
            Body::Hello {
                protocol: 6,
                version: "0.1.0".into(),
                nonce: u64::MAX,
            },
            Body::HelloAck {
                protocol: 6,
                version: "0.1.0".into(),
                nonce: 1,
            },
            Body::Data(vec![0, 1, 2, 255]),
            Body::DataEnd,
            Body::Credit(32768),
            Body::Kill(9),
            Body::Resize { rows: 1, cols: 2 },
            Body::ExecAck { seq: 4 },
            Body::Error(err.clone()),
            Body::Progress,
            Body::Cancel,
        ];
        bodies.extend(requests.iter().cloned().map(Body::Request));
        bodies.extend(replies.iter().cloned().map(Body::Reply));
        bodies.extend(events.iter().enumerate().map(|(i, e)| Body::Exec {
            seq: i as u64 + 1,
            event: e.clone(),
        }));
        let mut out = Vec::new();
        for (i, b) in bodies.iter().enumerate() {
            let f = Frame {
                stream: i as u32,
                body: b.clone(),
            };
            out.push((format!("frame-{i:02}"), enc(0, &f)));
            out.push((format!("body-{i:02}"), enc(1, b)));
        }
        for (i, r) in requests.iter().enumerate() {
            out.push((format!("request-{i:02}"), enc(2, r)));
        }
        for (i, r) in replies.iter().enumerate() {
            out.push((format!("reply-{i:02}"), enc(3, r)));
        }
        for (i, e) in events.iter().enumerate() {
            out.push((format!("exec-event-{i:02}"), enc(4, e)));
        }
        out.push(("exec-spec".into(), enc(5, &spec)));
        out.push(("walk-delta".into(), enc(6, &delta)));
        out.push(("walk".into(), enc(7, &delta.entries)));
        out.push(("walk-entry".into(), enc(8, &delta.entries[1])));
        out.push(("walk-cursor".into(), enc(9, &delta.cursor)));
        out.push(("remote-error".into(), enc(10, &err)));
        out.push(("error-kind".into(), enc(11, &ErrorKind::Busy)));
        out.push(("file-stat".into(), enc(12, &stat())));
        out.push(("file-kind".into(), enc(13, &FileKind::Other)));
        out.push((
            "dir-entry".into(),
            enc(
                14,
                &DirEntry {
                    name: "n".into(),
                    stat: stat(),
                },
            ),
        ));
        out.push(("pty-size".into(), enc(15, &PtySize { rows: 3, cols: 4 })));
        // Hostile: a walk answer whose first path declares 2^50 bytes; a Data frame declaring
        // u64::MAX bytes; a walk declaring 2^60 entries.
        let mut bomb = vec![6u8, 0, 0, 1, 1, 253];
        bomb.extend((1u64 << 50).to_le_bytes());
        bomb.extend(b"ab");
        out.push(("hostile-walk-path-2p50".into(), bomb));
        out.push((
            "hostile-data-len-max".into(),
            [0u8, 1, 3, 253]
                .into_iter()
                .chain(u64::MAX.to_le_bytes())
                .collect(),
        ));
        out.push((
            "hostile-walk-count-2p60".into(),
            [7u8, 253]
                .into_iter()
                .chain((1u64 << 60).to_le_bytes())
                .collect(),
        ));
        out
    }

    /// Rewrites `fuzz/corpus/msg_decode/` from [`seeds`]: `cargo test --lib
    /// write_msg_seed_corpus -- --ignored`.
    #[test]
    #[ignore = "writes the seed corpus into the source tree"]
    fn write_msg_seed_corpus() {
        let dir = corpus("msg_decode");
        std::fs::create_dir_all(&dir).unwrap();
        for (name, bytes) in seeds() {
            std::fs::write(dir.join(name), bytes).unwrap();
        }
    }

    #[test]
    fn saved_seeds_are_current_and_cover_every_message_type() {
        let dir = corpus("msg_decode");
        let mut picked = vec![false; MSG_TYPES.len()];
        for (name, bytes) in seeds() {
            let saved = std::fs::read(dir.join(&name))
                .unwrap_or_else(|e| panic!("seed {name}: {e}; run write_msg_seed_corpus"));
            assert_eq!(
                saved, bytes,
                "seed {name} is stale; run write_msg_seed_corpus"
            );
            picked[bytes[0] as usize % MSG_TYPES.len()] = true;
        }
        let missing: Vec<_> = MSG_TYPES
            .iter()
            .zip(&picked)
            .filter(|(_, p)| !**p)
            .collect();
        assert!(missing.is_empty(), "no seed for {missing:?}");
    }

    /// CI's fuzzing: every saved input of every target (seeds and whatever a fuzz run added).
    #[test]
    fn saved_corpora_replay_cleanly() {
        let mut n = 0;
        for (target, run) in [
            ("msg_decode", msg_decode as fn(&[u8])),
            ("frame_decode", frame_decode as fn(&[u8])),
        ] {
            let Ok(rd) = std::fs::read_dir(corpus(target)) else {
                continue;
            };
            for e in rd {
                let p = e.unwrap().path();
                run(&std::fs::read(&p).unwrap());
                n += 1;
            }
        }
        assert!(n > 0, "no saved corpus under fuzz/corpus");
    }

    #[test]
    fn valid_seeds_decode_as_their_type() {
        // A seed that stopped decoding would only exercise the error paths.
        for (name, bytes) in seeds()
            .into_iter()
            .filter(|(n, _)| !n.starts_with("hostile"))
        {
            let rest = &bytes[1..];
            let ok = match bytes[0] {
                0 => decode_answer::<Frame>(rest).is_ok(),
                1 => decode_answer::<Body>(rest).is_ok(),
                2 => decode_answer::<Request>(rest).is_ok(),
                6 => decode_answer::<WalkDelta>(rest).is_ok(),
                7 => decode_answer::<Vec<WalkEntry>>(rest).is_ok(),
                _ => true,
            };
            assert!(ok, "{name}");
        }
        for (name, bytes) in seeds()
            .into_iter()
            .filter(|(n, _)| n.starts_with("hostile"))
        {
            msg_decode(&bytes);
            assert!(decode_answer::<WalkDelta>(&bytes[1..]).is_err(), "{name}");
        }
    }
}
