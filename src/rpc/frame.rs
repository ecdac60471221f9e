//! The frame codec: a 4-byte little-endian payload length, then a bincode 2 payload.
//!
//! Owns the byte format only. Never allocates more than [`MAX_FRAME`] for one frame, never
//! panics on hostile input (fuzzed by `fuzz/fuzz_targets/frame_decode.rs` and proptest).

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

#[derive(Debug, thiserror::Error)]
pub enum FrameError {
    #[error("frame of {0} bytes exceeds the {MAX_FRAME}-byte limit; the peer is broken or hostile")]
    TooLarge(usize),
    #[error("frame payload does not decode ({0}); the peer speaks another protocol or is corrupt")]
    Decode(String),
    #[error("frame payload has {0} trailing bytes; the peer speaks another protocol")]
    Trailing(usize),
    #[error("frame does not encode: {0}")]
    Encode(String),
    #[error("connection closed in the middle of a frame")]
    Truncated,
    #[error("i/o error on the agent channel: {0}")]
    Io(#[from] std::io::Error),
}

/// Encodes one frame, length prefix included.
pub fn encode(frame: &Frame) -> Result<Vec<u8>, FrameError> {
    let mut out = vec![0u8; 4];
    bincode::serde::encode_into_std_write(frame, &mut out, CONFIG)
        .map_err(|e| FrameError::Encode(e.to_string()))?;
    let len = out.len() - 4;
    if len > MAX_FRAME {
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

/// Decodes the first frame of `buf`: `Ok(None)` if more bytes are needed, else the frame and
/// the number of bytes it used.
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rpc::msg::{Body, ExecSpec, Request, WireExecEvent};
    use proptest::prelude::*;

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

    fn arb_body() -> impl Strategy<Value = Body> {
        prop_oneof![
            (any::<u32>(), ".{0,20}")
                .prop_map(|(protocol, version)| Body::Hello { protocol, version }),
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
