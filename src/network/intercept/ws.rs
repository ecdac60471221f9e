//! WebSocket upgrades on intercepted hosts (HTTP/1.1 `Upgrade: websocket`; the HTTP/2 form
//! needs CONNECT, which stays refused).
//!
//! The handshake is an ordinary request: checked, its placeholders swapped like any other,
//! sent upstream on a connection of its own (ALPN `http/1.1`), with `Sec-WebSocket-Extensions`
//! removed so no compression is negotiated (a compressed frame cannot be scrubbed; an upstream
//! that answers with an extension anyway is refused, 502). After `101 Switching Protocols` the
//! bytes are relayed both ways:
//! - guest -> upstream as they are (client frames are masked; a placeholder in them is not
//!   swapped);
//! - upstream -> guest, when the handshake carried a value, per message ([`WsScrub`]): a whole
//!   message (its fragments held until the last, 16 MiB max) has the value replaced in its
//!   payloads by a mask of the same length (frame lengths cannot change without re-framing),
//!   each fragment keeping its length, and is forwarded at once; control frames pass at once
//!   (masked too). A value split across two *messages* cannot be masked (the first part is
//!   already gone): the connection is closed before the second message and `secret.blocked` is
//!   emitted (position `websocket frames`). A masked or oversized server frame also closes it.

use std::sync::Arc;

use hyper::header::{self, HeaderMap, HeaderValue};
use hyper::{Method, Version};
use hyper_util::rt::TokioIo;
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};

use super::Interceptor;
use super::scrub::Replacer;
use super::swap::Blocked;

/// Largest server frame the scrubber buffers.
pub const MAX_FRAME: usize = 16 * 1024 * 1024;

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum WsError {
    #[error("a WebSocket frame longer than {0} bytes")]
    TooLarge(usize),
    #[error("a masked WebSocket frame from the server")]
    Masked,
    #[error("a secret value split across WebSocket frames")]
    Split,
}

fn has_token(h: &HeaderMap, name: header::HeaderName, token: &str) -> bool {
    h.get_all(name)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .any(|t| t.trim().eq_ignore_ascii_case(token))
}

/// Whether a request asks for a WebSocket upgrade (HTTP/1.1 GET, `Connection: upgrade`,
/// `Upgrade: websocket`).
pub fn is_upgrade(p: &hyper::http::request::Parts) -> bool {
    p.method == Method::GET
        && p.version == Version::HTTP_11
        && has_token(&p.headers, header::CONNECTION, "upgrade")
        && has_token(&p.headers, header::UPGRADE, "websocket")
}

/// Put back the upgrade headers `strip_hop_by_hop` removed; offer no extension.
pub fn restore_upgrade_headers(h: &mut HeaderMap) {
    h.insert(header::CONNECTION, HeaderValue::from_static("upgrade"));
    h.insert(header::UPGRADE, HeaderValue::from_static("websocket"));
    h.remove(header::SEC_WEBSOCKET_EXTENSIONS);
}

/// The upstream -> guest frame scrubber.
pub struct WsScrub {
    masks: Arc<Replacer>,
    buf: Vec<u8>,
    /// The frames (header, payload) of a fragmented message not finished yet.
    held: Vec<(Vec<u8>, Vec<u8>)>,
    held_len: usize,
    /// The last bytes of the previous message (to see a value split across two).
    tail: Vec<u8>,
}

impl WsScrub {
    pub fn new(masks: Arc<Replacer>) -> WsScrub {
        WsScrub {
            masks,
            buf: Vec::new(),
            held: Vec::new(),
            held_len: 0,
            tail: Vec::new(),
        }
    }

    /// The held fragments, the value masked across them (each keeps its length).
    fn flush(&mut self, out: &mut Vec<u8>) -> Result<(), WsError> {
        if self.held.is_empty() {
            return Ok(());
        }
        let mut joined = std::mem::take(&mut self.tail);
        let start = joined.len();
        for (_, p) in &self.held {
            joined.extend_from_slice(p);
        }
        if self.masks.straddles(&joined, start) {
            return Err(WsError::Split);
        }
        let keep = (joined.len() - start).min(self.masks.max_len().saturating_sub(1));
        self.tail = joined[joined.len() - keep..].to_vec();
        let masked = self.masks.replace_all(&joined[start..]);
        let mut at = 0;
        for (h, p) in self.held.drain(..) {
            out.extend_from_slice(&h);
            out.extend_from_slice(&masked[at..at + p.len()]);
            at += p.len();
        }
        self.held_len = 0;
        Ok(())
    }

    /// The frames completed by `chunk`, scrubbed. Partial frames, and the fragments of a
    /// message until its last one, are held (16 MiB max); control frames pass at once.
    pub fn push(&mut self, chunk: &[u8]) -> Result<Vec<u8>, WsError> {
        self.buf.extend_from_slice(chunk);
        let mut out = Vec::new();
        let mut pos = 0;
        loop {
            let b = &self.buf[pos..];
            if b.len() < 2 {
                break;
            }
            if b[1] & 0x80 != 0 {
                return Err(WsError::Masked);
            }
            let (hlen, len) = match b[1] & 0x7f {
                126 if b.len() >= 4 => (4, u64::from(u16::from_be_bytes([b[2], b[3]]))),
                127 if b.len() >= 10 => {
                    let mut n = [0u8; 8];
                    n.copy_from_slice(&b[2..10]);
                    (10, u64::from_be_bytes(n))
                }
                126 | 127 => break,
                n => (2, u64::from(n)),
            };
            let len = usize::try_from(len)
                .ok()
                .filter(|&l| l <= MAX_FRAME - self.held_len)
                .ok_or(WsError::TooLarge(MAX_FRAME))?;
            if b.len() < hlen + len {
                break;
            }
            let (fin, op) = (b[0] & 0x80 != 0, b[0] & 0x0f);
            let head = b[..hlen].to_vec();
            let payload = b[hlen..hlen + len].to_vec();
            pos += hlen + len;
            if op <= 2 {
                self.held_len += len;
                self.held.push((head, payload));
                if fin {
                    self.flush(&mut out)?;
                }
            } else {
                if op == 8 {
                    // Close: what is held goes first (nothing follows a close).
                    self.flush(&mut out)?;
                }
                out.extend_from_slice(&head);
                out.extend_from_slice(&self.masks.replace_all(&payload));
            }
        }
        self.buf.drain(..pos);
        Ok(out)
    }
}

/// Relay an upgraded connection until either side closes. `scrub`: the same-length masks and
/// the names of the secrets whose values the handshake carried.
pub async fn relay(
    icpt: Arc<Interceptor>,
    host: String,
    guest: hyper::upgrade::OnUpgrade,
    upstream: hyper::upgrade::OnUpgrade,
    scrub: Option<(Arc<Replacer>, String)>,
) {
    let (g, u) = match tokio::join!(guest, upstream) {
        (Ok(g), Ok(u)) => (TokioIo::new(g), TokioIo::new(u)),
        (g, u) => {
            tracing::debug!(
                host,
                guest_ok = g.is_ok(),
                upstream_ok = u.is_ok(),
                "websocket upgrade did not complete"
            );
            return;
        }
    };
    let Some((masks, names)) = scrub else {
        let (mut g, mut u) = (g, u);
        let _ = tokio::io::copy_bidirectional(&mut g, &mut u).await;
        return;
    };
    let (mut gr, mut gw) = tokio::io::split(g);
    let (mut ur, mut uw) = tokio::io::split(u);
    let to_upstream = async {
        let _ = tokio::io::copy(&mut gr, &mut uw).await;
        let _ = uw.shutdown().await;
    };
    let to_guest = async {
        let mut s = WsScrub::new(masks);
        let mut buf = vec![0u8; 16 * 1024];
        loop {
            let n = match ur.read(&mut buf).await {
                Ok(0) | Err(_) => {
                    let _ = gw.shutdown().await;
                    return Ok::<(), WsError>(());
                }
                Ok(n) => n,
            };
            let out = s.push(&buf[..n])?;
            if gw.write_all(&out).await.is_err() {
                return Ok(());
            }
        }
    };
    tokio::pin!(to_upstream, to_guest);
    let r: Result<(), WsError> = tokio::select! {
        r = &mut to_guest => r,
        () = &mut to_upstream => to_guest.await,
    };
    if let Err(e) = r {
        // Both halves are dropped here: the guest's and the upstream's connections close.
        tracing::info!(host, error = %e, "websocket closed: a frame toward the guest could not be scrubbed");
        icpt.blocked(
            &Blocked {
                secret: names,
                position: "websocket frames".into(),
                refused: true,
            },
            &host,
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::network::intercept::scrub::rendered_forms;

    fn frame(op: u8, fin: bool, p: &[u8]) -> Vec<u8> {
        let mut v = vec![op | if fin { 0x80 } else { 0 }];
        match p.len() {
            n if n < 126 => v.push(n as u8),
            n if n < 65536 => {
                v.push(126);
                v.extend_from_slice(&(n as u16).to_be_bytes());
            }
            n => {
                v.push(127);
                v.extend_from_slice(&(n as u64).to_be_bytes());
            }
        }
        v.extend_from_slice(p);
        v
    }

    #[test]
    fn frames_split_anywhere_keep_their_lengths_and_lose_the_value() {
        let r = Replacer::new(rendered_forms(b"sk-VALUE-123", b"tbx_placeholder_x", &[]))
            .unwrap()
            .same_length()
            .unwrap();
        let big = [b"x".repeat(200), b"sk-VALUE-123".to_vec()].concat();
        let stream = [
            frame(1, true, b"a sk-VALUE-123 b"),
            frame(9, true, b"ping sk-VALUE-123"),
            frame(2, true, &big),
        ]
        .concat();
        let want = [
            frame(1, true, b"a tbx_placehol b"),
            frame(9, true, b"ping tbx_placehol"),
            frame(
                2,
                true,
                &[b"x".repeat(200), b"tbx_placehol".to_vec()].concat(),
            ),
        ]
        .concat();
        for cut in 0..=stream.len() {
            let mut s = WsScrub::new(r.clone());
            let mut out = s.push(&stream[..cut]).unwrap();
            out.extend(s.push(&stream[cut..]).unwrap());
            assert_eq!(out, want, "cut {cut}");
        }
        // A value split across a fragment and its continuation: held, masked across both, a
        // ping between them passes first.
        let mut s = WsScrub::new(r.clone());
        assert_eq!(s.push(&frame(1, false, b"a sk-VAL")), Ok(vec![]));
        assert_eq!(s.push(&frame(9, true, b"p")), Ok(frame(9, true, b"p")));
        assert_eq!(
            s.push(&frame(0, true, b"UE-123 b")),
            Ok([frame(1, false, b"a tbx_pl"), frame(0, true, b"acehol b")].concat())
        );
        // Across two messages: refused before the second.
        let mut s = WsScrub::new(r.clone());
        assert!(s.push(&frame(1, true, b"a sk-VAL")).is_ok());
        assert_eq!(s.push(&frame(1, true, b"UE-123 b")), Err(WsError::Split));
        // Masked or oversized server frames: refused.
        let mut s = WsScrub::new(r.clone());
        assert_eq!(s.push(&[0x81, 0x85, 1, 2, 3, 4]), Err(WsError::Masked));
        let mut s = WsScrub::new(r);
        let mut f = vec![0x82, 127];
        f.extend_from_slice(&u64::MAX.to_be_bytes());
        assert_eq!(s.push(&f), Err(WsError::TooLarge(MAX_FRAME)));
    }
}
