//! The frame codec: a 4-byte little-endian payload length, then a bincode 2 payload.
//!
//! Owns the byte format only: frames, and the bincode values some answers carry inside their
//! `Data` (walk manifests, [`encode_answer`] / [`decode_answer`]). Never allocates more than
//! [`MAX_FRAME`] for one frame or [`MAX_ANSWER`] for one answer, never panics on hostile input
//! (fuzzed by `fuzz/fuzz_targets/{frame_decode,msg_decode}.rs` and proptest).

use super::msg::Frame;
use tokio::io::{AsyncRead, AsyncReadExt};

/// Largest payload accepted or produced (1 MiB).
pub const MAX_FRAME: usize = 1 << 20;
/// Bulk data is cut into chunks of at most this size so one stream cannot hog the link.
pub const CHUNK: usize = 32 * 1024;

const CONFIG: bincode::config::Configuration<
    bincode::config::LittleEndian,
    bincode::config::Varint,
    bincode::config::Limit<MAX_FRAME>,
> = bincode::config::standard().with_limit::<MAX_FRAME>();

/// Largest bincode value carried inside a stream's `Data` (a `Walk`/`WalkSince` answer): 64 MiB,
/// about 700,000 files of a workspace tree. The host collects at most this many bytes and
/// decodes them with the same byte limit, so a declared length inside (a path claiming 2^50
/// bytes) fails before anything is allocated.
pub const MAX_ANSWER: usize = 64 << 20;

const ANSWER_CONFIG: bincode::config::Configuration<
    bincode::config::LittleEndian,
    bincode::config::Varint,
    bincode::config::Limit<MAX_ANSWER>,
> = bincode::config::standard().with_limit::<MAX_ANSWER>();

#[derive(Debug, thiserror::Error)]
pub enum FrameError {
    #[error("frame of {0} bytes exceeds the {MAX_FRAME}-byte limit; the peer is broken or hostile")]
    TooLarge(usize),
    #[error("frame payload does not decode ({0}); the peer speaks another protocol or is corrupt")]
    Decode(String),
    #[error("frame payload has {0} trailing bytes; the peer speaks another protocol")]
    Trailing(usize),
    #[error(
        "answer of {0} bytes exceeds the {MAX_ANSWER}-byte limit; the peer is broken or hostile"
    )]
    AnswerTooLarge(usize),
    #[error("frame does not encode: {0}")]
    Encode(String),
    #[error("connection closed in the middle of a frame")]
    Truncated,
    #[error("i/o error on the agent channel: {0}")]
    Io(#[from] std::io::Error),
}

/// Encoded sizes from which a value is checked by decoding it before it is sent: bincode's
/// limit counts what decoding would allocate (a `String` or `Vec` claims its in-memory size,
/// up to ~24x its encoded size for empty strings), so a value can encode within a limit and still
/// not decode within it. Below these sizes no value of the protocol can claim the limit.
const CHECK_FRAME_FROM: usize = MAX_FRAME / 32;
const CHECK_ANSWER_FROM: usize = MAX_ANSWER / 32;

/// Encodes one frame, length prefix included. A frame the peer could not decode within
/// [`MAX_FRAME`] (by bytes or by what it would allocate) fails with [`FrameError::TooLarge`].
pub fn encode(frame: &Frame) -> Result<Vec<u8>, FrameError> {
    let mut out = vec![0u8; 4];
    bincode::serde::encode_into_std_write(frame, &mut out, CONFIG)
        .map_err(|e| FrameError::Encode(e.to_string()))?;
    let len = out.len() - 4;
    if len > MAX_FRAME {
        return Err(FrameError::TooLarge(len));
    }
    // Decoded exactly as the peer will: a big `List` can claim more than MAX_FRAME.
    if len > CHECK_FRAME_FROM && decode_payload(&out[4..]).is_err() {
        return Err(FrameError::TooLarge(len));
    }
    out[..4].copy_from_slice(&(len as u32).to_le_bytes());
    Ok(out)
}

/// Decodes a payload (without its length prefix).
pub fn decode_payload(payload: &[u8]) -> Result<Frame, FrameError> {
    if payload.len() > MAX_FRAME {
        return Err(FrameError::TooLarge(payload.len()));
    }
    let (frame, used) = bincode::serde::decode_from_slice::<Frame, _>(payload, CONFIG)
        .map_err(|e| FrameError::Decode(e.to_string()))?;
    if used != payload.len() {
        return Err(FrameError::Trailing(payload.len() - used));
    }
    Ok(frame)
}

/// Encodes a value carried inside a stream's `Data` (the guest's walk answers). Fails with
/// [`FrameError::AnswerTooLarge`] when the host would refuse it: above [`MAX_ANSWER`] bytes, or
/// claiming more than that when decoded (checked by decoding it as the host does).
pub fn encode_answer<T: serde::Serialize + serde::de::DeserializeOwned>(
    value: &T,
) -> Result<Vec<u8>, FrameError> {
    // (bincode checks its limit only when decoding; the bytes are the same with or without.)
    let out = bincode::serde::encode_to_vec(value, ANSWER_CONFIG)
        .map_err(|e| FrameError::Encode(e.to_string()))?;
    if out.len() > MAX_ANSWER {
        return Err(FrameError::AnswerTooLarge(out.len()));
    }
    if out.len() > CHECK_ANSWER_FROM && decode_answer::<T>(&out).is_err() {
        return Err(FrameError::AnswerTooLarge(out.len()));
    }
    Ok(out)
}

/// Decodes exactly one value from `bytes` (nothing may follow it), allocating at most
/// [`MAX_ANSWER`] bytes whatever lengths the bytes declare.
pub fn decode_answer<T: serde::de::DeserializeOwned>(bytes: &[u8]) -> Result<T, FrameError> {
    if bytes.len() > MAX_ANSWER {
        return Err(FrameError::AnswerTooLarge(bytes.len()));
    }
    let (v, used) = bincode::serde::decode_from_slice::<T, _>(bytes, ANSWER_CONFIG)
        .map_err(|e| FrameError::Decode(e.to_string()))?;
    if used != bytes.len() {
        return Err(FrameError::Trailing(bytes.len() - used));
    }
    Ok(v)
}

/// Decodes the first frame of `buf`: `Ok(None)` if more bytes are needed, else the frame and
/// the number of bytes it used.
#[cfg(any(test, fuzzing))]
pub fn decode_frame(buf: &[u8]) -> Result<Option<(Frame, usize)>, FrameError> {
    let Some(prefix) = buf.get(..4) else {
        return Ok(None);
    };
    let len = u32::from_le_bytes([prefix[0], prefix[1], prefix[2], prefix[3]]) as usize;
    if len > MAX_FRAME {
        return Err(FrameError::TooLarge(len));
    }
    let Some(payload) = buf.get(4..4 + len) else {
        return Ok(None);
    };
    Ok(Some((decode_payload(payload)?, 4 + len)))
}

/// Reads one frame; `Ok(None)` on a clean end of stream between frames.
pub async fn read_frame<R: AsyncRead + Unpin>(r: &mut R) -> Result<Option<Frame>, FrameError> {
    let mut prefix = [0u8; 4];
    let mut got = 0;
    while got < 4 {
        let n = r.read(&mut prefix[got..]).await?;
        if n == 0 {
            return if got == 0 {
                Ok(None)
            } else {
                Err(FrameError::Truncated)
            };
        }
        got += n;
    }
    let len = u32::from_le_bytes(prefix) as usize;
    if len > MAX_FRAME {
        return Err(FrameError::TooLarge(len));
    }
    let mut payload = vec![0u8; len];
    r.read_exact(&mut payload)
        .await
        .map_err(|e| match e.kind() {
            std::io::ErrorKind::UnexpectedEof => FrameError::Truncated,
            _ => FrameError::Io(e),
        })?;
    decode_payload(&payload).map(Some)
}

/// What [`seek_frame`] found.
#[derive(Debug)]
pub struct Found {
    pub frame: Frame,
    /// Bytes read after the frame: the start of the rest of the stream.
    pub rest: Vec<u8>,
    /// Bytes skipped before the frame.
    pub skipped: u64,
}

/// Reads `r` until a frame that `want` accepts appears anywhere in the byte stream, and returns
/// it with the bytes that followed it.
///
/// Unlike [`read_frame`] it does not trust the stream to start at a frame boundary: every byte
/// offset is tried, so half a frame left over from an earlier connection (or any other junk)
/// is skipped instead of putting the reader out of step. Only frames whose payload is at most
/// `max_len` bytes can be found; `want` must be specific enough (e.g. check a random nonce) that
/// junk cannot pass it. `Ok(None)` if the stream ends first. Memory stays bounded by about
/// 64 KiB + `max_len` however much junk arrives.
pub async fn seek_frame<R, F>(
    r: &mut R,
    max_len: usize,
    mut want: F,
) -> Result<Option<Found>, FrameError>
where
    R: AsyncRead + Unpin,
    F: FnMut(&Frame) -> bool,
{
    const KEEP: usize = 64 * 1024;
    let max_len = max_len.min(MAX_FRAME);
    let mut buf: Vec<u8> = Vec::new();
    // Offsets below `from` have been tried with all the bytes a frame there could need.
    let mut from = 0usize;
    // Bytes dropped from the front of `buf`.
    let mut dropped = 0u64;
    let mut chunk = vec![0u8; 8192];
    loop {
        let n = r.read(&mut chunk).await?;
        if n == 0 {
            return Ok(None);
        }
        buf.extend_from_slice(&chunk[..n]);
        let mut off = from;
        while off + 4 <= buf.len() {
            let len = u32::from_le_bytes([buf[off], buf[off + 1], buf[off + 2], buf[off + 3]]);
            let end = off + 4 + len as usize;
            if len as usize <= max_len
                && end <= buf.len()
                && let Ok(frame) = decode_payload(&buf[off + 4..end])
                && want(&frame)
            {
                return Ok(Some(Found {
                    frame,
                    rest: buf[end..].to_vec(),
                    skipped: dropped + off as u64,
                }));
            }
            off += 1;
        }
        // A wanted frame could still start at any of the last `4 + max_len` offsets.
        from = buf.len().saturating_sub(4 + max_len);
        if from > KEEP {
            buf.drain(..from);
            dropped += from as u64;
            from = 0;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rpc::msg::{Body, ExecSpec, Request, WireExecEvent};
    use proptest::prelude::*;
    use tokio::io::AsyncWriteExt;

    fn sample() -> Frame {
        Frame {
            stream: 7,
            body: Body::Request(Request::Exec(ExecSpec {
                argv: vec!["echo".into(), "hi".into()],
                ..Default::default()
            })),
        }
    }

    #[test]
    fn frame_round_trips() {
        let bytes = encode(&sample()).unwrap();
        let (f, used) = decode_frame(&bytes).unwrap().unwrap();
        assert_eq!(f, sample());
        assert_eq!(used, bytes.len());
    }

    /// A `List` reply of 40,000 short names encodes to ~600 KB (< `MAX_FRAME`) but claims
    /// ~2.6 MB when decoded: the peer refused it (and the host cut the agent off for a "bad
    /// frame"). Whatever encodes must decode on the other side.
    #[test]
    fn a_frame_that_encodes_also_decodes() {
        use crate::rpc::msg::{DirEntry, FileKind, FileStat, Reply};
        let entry = |i: usize| DirEntry {
            name: format!("{i}"),
            stat: FileStat {
                kind: FileKind::File,
                size: 0,
                mode: 0o644,
                mtime: 0,
                uid: 1000,
                gid: 1000,
                link: None,
            },
        };
        for n in [1_000, 40_000, 200_000] {
            let f = Frame {
                stream: 1,
                body: Body::Reply(Reply::List((0..n).map(entry).collect())),
            };
            match encode(&f) {
                Ok(bytes) => {
                    let back = decode_frame(&bytes);
                    assert!(
                        matches!(&back, Ok(Some((g, _))) if *g == f),
                        "{n} entries: encoded to {} bytes but does not decode: {:?}",
                        bytes.len(),
                        back.err()
                    );
                }
                Err(e) => assert!(n > 1_000, "{n} entries: {e}"),
            }
        }
    }

    /// Same for walk answers: 2,000,000 entries with empty paths and small numbers encode to
    /// ~16 MB but claim ~70 MB (each varint claims its full width), past `MAX_ANSWER`, when
    /// decoded; the host answered "bad walk answer".
    #[test]
    fn an_answer_that_encodes_also_decodes() {
        use crate::rpc::msg::{FileKind, WalkCursor, WalkDelta, WalkEntry};
        let e = WalkEntry {
            path: String::new(),
            kind: FileKind::File,
            size: 0,
            mode: 0,
            mtime: 0,
            mtime_nsec: 0,
            link: None,
            base: false,
        };
        let d = WalkDelta {
            cursor: WalkCursor {
                epoch: 1,
                generation: 2,
            },
            full: true,
            entries: vec![e; 2_000_000],
            removed: Vec::new(),
        };
        match encode_answer(&d) {
            Ok(bytes) => {
                let back = decode_answer::<WalkDelta>(&bytes);
                assert!(
                    back.is_ok(),
                    "encoded to {} bytes but does not decode: {:?}",
                    bytes.len(),
                    back.err()
                );
            }
            Err(e) => assert!(matches!(e, FrameError::AnswerTooLarge(_)), "{e}"),
        }
        // A smaller one still goes through.
        let small = WalkDelta {
            entries: d.entries[..100_000].to_vec(),
            ..d
        };
        let bytes = encode_answer(&small).unwrap();
        assert_eq!(decode_answer::<WalkDelta>(&bytes).unwrap(), small);
    }

    #[test]
    fn oversize_frame_is_rejected() {
        let mut bytes = ((MAX_FRAME + 1) as u32).to_le_bytes().to_vec();
        bytes.extend_from_slice(&[0; 16]);
        assert!(matches!(decode_frame(&bytes), Err(FrameError::TooLarge(_))));
        let big = Frame {
            stream: 1,
            body: Body::Data(vec![0; MAX_FRAME + 1]),
        };
        assert!(encode(&big).is_err());
    }

    #[test]
    fn garbage_payload_is_rejected() {
        let mut bytes = 6u32.to_le_bytes().to_vec();
        bytes.extend_from_slice(&[0xff; 6]);
        assert!(decode_frame(&bytes).is_err());
    }

    #[test]
    fn huge_claimed_vec_length_does_not_allocate() {
        // stream 1, Body::Data (variant 3), then a varint length of u64::MAX.
        let payload = [1u8, 3, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff];
        assert!(decode_payload(&payload).is_err());
    }

    #[tokio::test]
    async fn truncated_frame_is_a_clean_error() {
        let bytes = encode(&sample()).unwrap();
        let mut r = &bytes[..bytes.len() - 1];
        assert!(matches!(
            read_frame(&mut r).await,
            Err(FrameError::Truncated)
        ));
        let mut r = &bytes[..2];
        assert!(matches!(
            read_frame(&mut r).await,
            Err(FrameError::Truncated)
        ));
        let mut r: &[u8] = &[];
        assert!(read_frame(&mut r).await.unwrap().is_none());
    }

    fn hello_ack(nonce: u64) -> Frame {
        Frame {
            stream: 0,
            body: Body::HelloAck {
                protocol: 4,
                version: "v".into(),
                nonce,
            },
        }
    }

    fn is_ack(nonce: u64) -> impl FnMut(&Frame) -> bool {
        move |f| matches!(f.body, Body::HelloAck { nonce: n, .. } if n == nonce)
    }

    #[tokio::test]
    async fn seek_frame_skips_half_frames_and_other_frames() {
        // The tail of a frame cut in the middle, whole frames of an earlier connection, a stale
        // HelloAck, then the one wanted and the start of what follows it.
        let mut wire = encode(&sample()).unwrap()[9..].to_vec();
        wire.extend(encode(&sample()).unwrap());
        wire.extend(encode(&hello_ack(1)).unwrap());
        wire.extend(encode(&hello_ack(2)).unwrap());
        let next = encode(&sample()).unwrap();
        wire.extend(&next);
        let mut r = &wire[..];
        let found = seek_frame(&mut r, 4096, is_ack(2)).await.unwrap().unwrap();
        assert_eq!(found.frame, hello_ack(2));
        assert_eq!(
            found.skipped as usize,
            wire.len() - next.len() - encode(&hello_ack(2)).unwrap().len()
        );
        let rest = found.rest;
        // Whatever was read past the frame is handed back: the stream goes on from there.
        let mut all = rest;
        all.extend_from_slice(r);
        assert_eq!(all, next);
    }

    #[tokio::test]
    async fn seek_frame_is_not_stalled_by_a_junk_length() {
        // A junk prefix claiming a 1 MiB frame that never comes: plain `read_frame` would wait
        // for it forever; the wanted frame right behind it is found at once.
        let (mut w, mut r) = tokio::io::duplex(1 << 16);
        let mut wire = (MAX_FRAME as u32).to_le_bytes().to_vec();
        wire.extend(encode(&hello_ack(9)).unwrap());
        w.write_all(&wire).await.unwrap();
        let found = tokio::time::timeout(
            std::time::Duration::from_secs(10),
            seek_frame(&mut r, 4096, is_ack(9)),
        )
        .await
        .expect("stalled behind a junk length")
        .unwrap();
        assert_eq!(found.unwrap().frame, hello_ack(9));
        drop(w);
        let mut r: &[u8] = &[1, 2, 3];
        assert!(seek_frame(&mut r, 4096, is_ack(9)).await.unwrap().is_none());
    }

    #[tokio::test]
    async fn seek_frame_keeps_memory_bounded_on_endless_junk() {
        let (mut w, mut r) = tokio::io::duplex(1 << 16);
        let seek = tokio::spawn(async move { seek_frame(&mut r, 4096, is_ack(3)).await });
        // 8 MiB of junk, then the wanted frame.
        let junk = vec![0x5a; 1 << 16];
        for _ in 0..128 {
            w.write_all(&junk).await.unwrap();
        }
        w.write_all(&encode(&hello_ack(3)).unwrap()).await.unwrap();
        let found = tokio::time::timeout(std::time::Duration::from_secs(60), seek)
            .await
            .unwrap()
            .unwrap()
            .unwrap();
        let found = found.unwrap();
        assert_eq!(found.frame, hello_ack(3));
        assert_eq!(found.skipped, 128 << 16);
    }

    fn arb_body() -> impl Strategy<Value = Body> {
        prop_oneof![
            (any::<u32>(), ".{0,20}", any::<u64>()).prop_map(|(protocol, version, nonce)| {
                Body::Hello {
                    protocol,
                    version,
                    nonce,
                }
            }),
            proptest::collection::vec(any::<u8>(), 0..4096).prop_map(Body::Data),
            any::<u32>().prop_map(Body::Credit),
            any::<i32>().prop_map(Body::Kill),
            (any::<u16>(), any::<u16>()).prop_map(|(rows, cols)| Body::Resize { rows, cols }),
            (any::<u64>(), proptest::collection::vec(any::<u8>(), 0..512)).prop_map(|(seq, b)| {
                Body::Exec {
                    seq,
                    event: WireExecEvent::Stderr(b),
                }
            }),
            (
                any::<u64>(),
                any::<Option<i32>>(),
                any::<Option<i32>>(),
                any::<bool>()
            )
                .prop_map(|(seq, code, signal, timed_out)| Body::Exec {
                    seq,
                    event: WireExecEvent::Exit {
                        code,
                        signal,
                        timed_out
                    }
                }),
            (
                proptest::collection::vec(".{0,10}", 0..5),
                proptest::option::of(".{0,30}"),
                any::<Option<u64>>()
            )
                .prop_map(|(argv, shell, timeout_ms)| Body::Request(Request::Exec(
                    ExecSpec {
                        argv,
                        shell,
                        timeout_ms,
                        env: vec![("K".into(), "V".into())],
                        ..Default::default()
                    }
                ))),
            (".{0,40}", any::<bool>())
                .prop_map(|(path, recursive)| Body::Request(Request::Remove { path, recursive })),
        ]
    }

    proptest! {
        #[test]
        fn any_message_round_trips(stream in any::<u32>(), body in arb_body()) {
            let f = Frame { stream, body };
            let bytes = encode(&f).unwrap();
            let (back, used) = decode_frame(&bytes).unwrap().unwrap();
            prop_assert_eq!(back, f);
            prop_assert_eq!(used, bytes.len());
        }

        #[test]
        fn seek_frame_finds_a_frame_behind_any_junk(junk in proptest::collection::vec(any::<u8>(), 0..2048),
                                                    nonce in any::<u64>()) {
            let mut wire = junk;
            wire.extend(encode(&hello_ack(nonce)).unwrap());
            let rt = tokio::runtime::Builder::new_current_thread().build().unwrap();
            let mut r = &wire[..];
            let found = rt.block_on(seek_frame(&mut r, 4096, is_ack(nonce))).unwrap();
            prop_assert_eq!(found.map(|f| f.frame), Some(hello_ack(nonce)));
        }

        #[test]
        fn decoder_never_panics_on_garbage(bytes in proptest::collection::vec(any::<u8>(), 0..2048)) {
            let _ = decode_frame(&bytes);
            let _ = decode_payload(&bytes);
        }

        #[test]
        fn decoder_never_panics_on_mutated_frames(stream in any::<u32>(), body in arb_body(),
                                                  idx in any::<usize>(), val in any::<u8>(),
                                                  cut in any::<usize>()) {
            let mut bytes = encode(&Frame { stream, body }).unwrap();
            let i = idx % bytes.len();
            bytes[i] = val;
            let cut = cut % (bytes.len() + 1);
            let _ = decode_frame(&bytes[..cut]);
        }
    }
}
