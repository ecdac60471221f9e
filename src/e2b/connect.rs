//! The Connect protocol (connectrpc.com), JSON codec only, as the E2B SDKs speak it to envd.
//!
//! Owns: the streaming envelope (`[flags u8][len u32 BE][json]`, flag `0x02` = end of stream,
//! `0x01` = compressed, which we refuse), incremental decoding of a request body into
//! envelopes (bounded: one message at most [`MAX_MESSAGE`]), Connect error codes and their
//! HTTP statuses, and the unary/streaming response bodies. Never: what a method does.

use bytes::{Buf, Bytes, BytesMut};
use serde::Serialize;

/// Largest single message a client may send (a `SendInput` chunk, a path list...).
pub const MAX_MESSAGE: usize = 8 * 1024 * 1024;

const FLAG_COMPRESSED: u8 = 0x01;
pub const FLAG_END: u8 = 0x02;

/// A Connect error code (the lowercase names of the spec).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Code {
    Canceled,
    InvalidArgument,
    DeadlineExceeded,
    NotFound,
    AlreadyExists,
    PermissionDenied,
    ResourceExhausted,
    FailedPrecondition,
    Unimplemented,
    Internal,
    Unavailable,
    Unauthenticated,
}

impl Code {
    pub fn name(self) -> &'static str {
        match self {
            Code::Canceled => "canceled",
            Code::InvalidArgument => "invalid_argument",
            Code::DeadlineExceeded => "deadline_exceeded",
            Code::NotFound => "not_found",
            Code::AlreadyExists => "already_exists",
            Code::PermissionDenied => "permission_denied",
            Code::ResourceExhausted => "resource_exhausted",
            Code::FailedPrecondition => "failed_precondition",
            Code::Unimplemented => "unimplemented",
            Code::Internal => "internal",
            Code::Unavailable => "unavailable",
            Code::Unauthenticated => "unauthenticated",
        }
    }

    /// The HTTP status of a unary error with this code (Connect's mapping).
    pub fn http_status(self) -> u16 {
        match self {
            Code::Canceled => 499,
            Code::Internal => 500,
            Code::InvalidArgument | Code::FailedPrecondition => 400,
            Code::DeadlineExceeded => 504,
            Code::NotFound => 404,
            Code::AlreadyExists => 409,
            Code::PermissionDenied => 403,
            Code::ResourceExhausted => 429,
            Code::Unimplemented => 501,
            Code::Unavailable => 503,
            Code::Unauthenticated => 401,
        }
    }
}

/// A Connect error: a code and a message for people.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{}: {message}", code.name())]
pub struct ConnectError {
    pub code: Code,
    pub message: String,
}

impl ConnectError {
    pub fn new(code: Code, message: impl Into<String>) -> Self {
        ConnectError {
            code,
            message: message.into(),
        }
    }

    /// `{"code":"not_found","message":"..."}`
    pub fn json(&self) -> serde_json::Value {
        serde_json::json!({ "code": self.code.name(), "message": self.message })
    }
}

/// One envelope of a streaming body.
pub fn envelope(flags: u8, json: &[u8]) -> Bytes {
    let mut b = BytesMut::with_capacity(5 + json.len());
    b.extend_from_slice(&[flags]);
    b.extend_from_slice(&(json.len() as u32).to_be_bytes());
    b.extend_from_slice(json);
    b.freeze()
}

/// A data envelope holding `msg` as JSON.
pub fn message<T: Serialize>(msg: &T) -> Bytes {
    envelope(
        0,
        &serde_json::to_vec(msg).unwrap_or_else(|_| b"{}".to_vec()),
    )
}

/// The end-of-stream envelope: `{}` or `{"error":{...}}`.
pub fn end(err: Option<&ConnectError>) -> Bytes {
    let v = match err {
        None => serde_json::json!({}),
        Some(e) => serde_json::json!({ "error": e.json() }),
    };
    envelope(FLAG_END, &serde_json::to_vec(&v).unwrap_or_default())
}

/// What the decoder found.
#[derive(Debug, PartialEq, Eq)]
pub enum Frame {
    Message(Bytes),
    /// The client's end-of-stream envelope (clients do not send one; accepted and ignored).
    End,
}

/// Splits a streaming request body into envelopes as its bytes arrive.
#[derive(Default)]
pub struct Decoder {
    buf: BytesMut,
}

impl Decoder {
    pub fn push(&mut self, data: &[u8]) {
        self.buf.extend_from_slice(data);
    }

    /// The next whole envelope, `None` when more bytes are needed. A compressed or oversized
    /// envelope is an error (and nothing of it is buffered beyond its header).
    pub fn next(&mut self) -> Result<Option<Frame>, ConnectError> {
        if self.buf.len() < 5 {
            return Ok(None);
        }
        let flags = self.buf[0];
        let len = u32::from_be_bytes([self.buf[1], self.buf[2], self.buf[3], self.buf[4]]) as usize;
        if flags & FLAG_COMPRESSED != 0 {
            return Err(ConnectError::new(
                Code::Unimplemented,
                "compressed messages are not supported (send them uncompressed)",
            ));
        }
        if len > MAX_MESSAGE {
            return Err(ConnectError::new(
                Code::ResourceExhausted,
                format!("a message of {len} bytes is over the limit of {MAX_MESSAGE}"),
            ));
        }
        if self.buf.len() < 5 + len {
            return Ok(None);
        }
        self.buf.advance(5);
        let body = self.buf.split_to(len).freeze();
        Ok(Some(if flags & FLAG_END != 0 {
            Frame::End
        } else {
            Frame::Message(body)
        }))
    }

    /// Bytes received that do not yet form a whole envelope.
    #[cfg(test)]
    pub fn pending(&self) -> usize {
        self.buf.len()
    }
}

/// Decode one proto3-JSON message, naming the method in the error.
pub fn decode<T: serde::de::DeserializeOwned>(json: &[u8]) -> Result<T, ConnectError> {
    serde_json::from_slice(json)
        .map_err(|e| ConnectError::new(Code::InvalidArgument, format!("bad request message: {e}")))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn envelopes_round_trip_split_at_every_byte() {
        let mut wire = Vec::new();
        wire.extend_from_slice(&message(&serde_json::json!({"a": 1})));
        wire.extend_from_slice(&message(&serde_json::json!({"b": "x"})));
        wire.extend_from_slice(&end(None));
        for cut in 0..wire.len() {
            let mut d = Decoder::default();
            let mut got = Vec::new();
            for part in [&wire[..cut], &wire[cut..]] {
                d.push(part);
                while let Some(f) = d.next().unwrap() {
                    got.push(f);
                }
            }
            assert_eq!(
                got,
                vec![
                    Frame::Message(Bytes::from_static(br#"{"a":1}"#)),
                    Frame::Message(Bytes::from_static(br#"{"b":"x"}"#)),
                    Frame::End
                ],
                "cut at {cut}"
            );
            assert_eq!(d.pending(), 0);
        }
    }

    #[test]
    fn compressed_and_oversized_envelopes_are_refused_before_buffering() {
        let mut d = Decoder::default();
        d.push(&[FLAG_COMPRESSED, 0, 0, 0, 1, b'x']);
        assert_eq!(d.next().unwrap_err().code, Code::Unimplemented);
        let mut d = Decoder::default();
        d.push(&[0, 0xff, 0xff, 0xff, 0xff]);
        assert_eq!(d.next().unwrap_err().code, Code::ResourceExhausted);
    }

    #[test]
    fn end_of_stream_carries_the_error_in_connect_shape() {
        let b = end(Some(&ConnectError::new(Code::NotFound, "no process 7")));
        assert_eq!(b[0], FLAG_END);
        let v: serde_json::Value = serde_json::from_slice(&b[5..]).unwrap();
        assert_eq!(v["error"]["code"], "not_found");
        assert_eq!(v["error"]["message"], "no process 7");
        assert_eq!(&end(None)[5..], b"{}");
        assert_eq!(Code::NotFound.http_status(), 404);
        assert_eq!(Code::Unauthenticated.http_status(), 401);
    }
}
