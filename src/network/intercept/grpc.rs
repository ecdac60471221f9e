//! gRPC bodies (`content-type: application/grpc...`) on intercepted flows: the response scrub
//! works per length-prefixed message, not on the byte stream.
//!
//! Why: a gRPC message is a protobuf whose fields carry their own lengths, so the value cannot be
//! replaced by the (differently sized) placeholder inside one; it is replaced by a mask of the
//! same length (the placeholder's rendering cut or repeated, [`Replacer::same_length`]). And a
//! stream scrubber holds back the last bytes of each chunk in case they start a value, which
//! would stall a streaming call whose peer waits for the message; here each whole message
//! (bounded by [`MAX_MESSAGE`]) is scrubbed and forwarded at once.
//!
//! Compressed messages (flag 1, `grpc-encoding: gzip` or `deflate`) are decoded and forwarded
//! uncompressed (flag 0 is valid whatever `grpc-encoding` says); other encodings fail closed.
//! A value split across two messages is not found (each message is decoded on its own).
//! Trailers (`grpc-status`, `grpc-message`, metadata) are scrubbed like headers.
//! Request bodies of gRPC calls are never swapped (same reason); the secret travels in metadata.

use std::io::Read as _;
use std::sync::Arc;

use hyper::HeaderMap;
use hyper::header::{self, HeaderValue};

use super::body::{BoxError, Transform};
use super::scrub::Replacer;

/// Largest gRPC message (decoded) the scrubber buffers; larger ones end the call.
pub const MAX_MESSAGE: usize = 16 * 1024 * 1024;

#[derive(Debug, thiserror::Error)]
pub enum GrpcError {
    #[error("gRPC message longer than {0} bytes")]
    TooLarge(usize),
    #[error("gRPC message compressed with {0:?}, which cannot be decoded for scrubbing")]
    Encoding(String),
    #[error("gRPC message does not decode as {0}")]
    Decode(&'static str),
    #[error("gRPC body ends inside a message")]
    Truncated,
}

/// Whether `h` (request or response headers) declare a gRPC body.
pub fn is_grpc(h: &HeaderMap) -> bool {
    h.get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| {
            let v = v.trim().to_ascii_lowercase();
            v == "application/grpc" || v.starts_with("application/grpc+")
        })
}

/// Ask the upstream for uncompressed messages (it may still compress; those are decoded).
pub fn ask_identity(h: &mut HeaderMap) {
    h.insert("grpc-accept-encoding", HeaderValue::from_static("identity"));
}

/// The per-message scrubber of one gRPC response body.
pub struct GrpcScrub {
    /// Same-length replacement inside messages.
    masks: Arc<Replacer>,
    /// Length-changing replacement in trailers.
    headers: Arc<Replacer>,
    /// `grpc-encoding` of the response, lowercase.
    encoding: Option<String>,
    buf: Vec<u8>,
}

impl GrpcScrub {
    pub fn new(scrubber: Arc<Replacer>, encoding: Option<&str>) -> Option<GrpcScrub> {
        Some(GrpcScrub {
            masks: scrubber.same_length()?,
            headers: scrubber,
            encoding: encoding.map(|e| e.trim().to_ascii_lowercase()),
            buf: Vec::new(),
        })
    }

    fn decode(&self, msg: &[u8]) -> Result<Vec<u8>, GrpcError> {
        let enc = self.encoding.as_deref().unwrap_or("identity");
        let mut out = Vec::new();
        let limit = MAX_MESSAGE as u64 + 1;
        let r = match enc {
            "gzip" => flate2::read::GzDecoder::new(msg)
                .take(limit)
                .read_to_end(&mut out),
            "deflate" => flate2::read::ZlibDecoder::new(msg)
                .take(limit)
                .read_to_end(&mut out),
            other => return Err(GrpcError::Encoding(other.to_owned())),
        };
        r.map_err(|_| GrpcError::Decode(if enc == "gzip" { "gzip" } else { "deflate" }))?;
        if out.len() > MAX_MESSAGE {
            return Err(GrpcError::TooLarge(MAX_MESSAGE));
        }
        Ok(out)
    }
}

impl Transform for GrpcScrub {
    fn push(&mut self, chunk: &[u8]) -> Result<Vec<u8>, BoxError> {
        self.buf.extend_from_slice(chunk);
        let mut out = Vec::new();
        let mut pos = 0;
        while self.buf.len() - pos >= 5 {
            let flag = self.buf[pos];
            let mut n = [0u8; 4];
            n.copy_from_slice(&self.buf[pos + 1..pos + 5]);
            let len = u32::from_be_bytes(n) as usize;
            if len > MAX_MESSAGE {
                return Err(GrpcError::TooLarge(MAX_MESSAGE).into());
            }
            if self.buf.len() - pos - 5 < len {
                break;
            }
            let raw = &self.buf[pos + 5..pos + 5 + len];
            let (flag, msg) = if flag & 1 == 1 {
                (flag & !1, self.decode(raw)?)
            } else {
                (flag, raw.to_vec())
            };
            let msg = self.masks.replace_all(&msg);
            let len = u32::try_from(msg.len()).map_err(|_| GrpcError::TooLarge(MAX_MESSAGE))?;
            out.push(flag);
            out.extend_from_slice(&len.to_be_bytes());
            out.extend_from_slice(&msg);
            pos += 5 + raw.len();
        }
        self.buf.drain(..pos);
        Ok(out)
    }

    fn finish(&mut self) -> Result<Vec<u8>, BoxError> {
        if self.buf.is_empty() {
            Ok(Vec::new())
        } else {
            Err(GrpcError::Truncated.into())
        }
    }

    fn trailers(&mut self, t: &mut HeaderMap) {
        super::proxy::scrub_headers(t, &self.headers);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::network::intercept::scrub::rendered_forms;

    fn frame(flag: u8, m: &[u8]) -> Vec<u8> {
        let mut v = vec![flag];
        v.extend_from_slice(&(m.len() as u32).to_be_bytes());
        v.extend_from_slice(m);
        v
    }

    #[test]
    fn messages_split_anywhere_keep_their_lengths_and_lose_the_value() {
        let r = Replacer::new(rendered_forms(b"sk-VALUE-123", b"tbx_placeholder_x", &[])).unwrap();
        let mut body = frame(0, b"\x0a\x0csk-VALUE-123");
        body.extend(frame(0, b"second"));
        for cut in 0..=body.len() {
            let mut g = GrpcScrub::new(r.clone(), None).unwrap();
            let mut out = g.push(&body[..cut]).unwrap();
            out.extend(g.push(&body[cut..]).unwrap());
            out.extend(g.finish().unwrap());
            assert_eq!(out.len(), body.len(), "cut {cut}");
            let want = [frame(0, b"\x0a\x0ctbx_placehol"), frame(0, b"second")].concat();
            assert_eq!(out, want, "cut {cut}");
        }
        // A whole message is forwarded as soon as it is complete (nothing held back).
        let mut g = GrpcScrub::new(r.clone(), None).unwrap();
        assert_eq!(g.push(&frame(0, b"s")).unwrap(), frame(0, b"s"));
        // Truncated bodies and oversized lengths fail.
        assert!(g.push(&[0, 0, 0]).unwrap().is_empty());
        assert!(g.finish().is_err());
        let mut g = GrpcScrub::new(r.clone(), None).unwrap();
        assert!(g.push(&[0, 0xff, 0xff, 0xff, 0xff]).is_err());
        // Compressed: decoded; unknown encodings fail closed.
        use std::io::Write as _;
        let mut e = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
        e.write_all(b"x sk-VALUE-123 y").unwrap();
        let gz = e.finish().unwrap();
        let mut g = GrpcScrub::new(r.clone(), Some("gzip")).unwrap();
        assert_eq!(
            g.push(&frame(1, &gz)).unwrap(),
            frame(0, b"x tbx_placehol y")
        );
        let mut g = GrpcScrub::new(r.clone(), Some("snappy")).unwrap();
        assert!(g.push(&frame(1, b"zz")).is_err());
    }
}
