//! WebSocket upgrades on intercepted hosts (HTTP/1.1 `Upgrade: websocket`; the HTTP/2 form,
//! RFC 8441's extended CONNECT, is not offered: `SETTINGS_ENABLE_CONNECT_PROTOCOL` is never
//! sent to the guest, so clients use HTTP/1.1, and a `:protocol` request sent anyway is reset).
//!
//! The handshake is an ordinary request: checked, its placeholders swapped like any other,
//! sent upstream on a connection of its own (ALPN `http/1.1`), with `Sec-WebSocket-Extensions`
//! removed so no compression is negotiated (a compressed frame cannot be scrubbed; an upstream
//! that answers with an extension anyway is refused, 502). After `101 Switching Protocols` the
//! bytes are relayed both ways:
//! - guest -> upstream, when a secret serving the host allows bodies (`--in-body`), per data
//!   message ([`WsSwap`]): each client frame is unmasked, the placeholders in the message's
//!   payload are swapped for the values as it streams (a placeholder split across fragments,
//!   continuation frames or reads is still found: only a tail shorter than the longest
//!   placeholder is held), and the output is re-framed (new lengths, 7/16/64-bit forms) and
//!   masked again with a fresh key, as a client must. Nothing else is held, so no message
//!   needs a size cap. Control frames pass unchanged. Every message (swapped or not, plaintext
//!   `ws://` too) is also watched (`ws_watch.rs`): another secret's placeholder is audited
//!   (`secret.in_body`, position `websocket frame`), a swapped one marks its secret used. A frame a client may not send
//!   (unmasked, reserved bits or opcodes, a fragmented or long control frame, a continuation
//!   without a start) closes the connection. With nothing to swap or watch the bytes pass
//!   unchanged.
//! - upstream -> guest, when the handshake carried a value (or a body-swap secret serves the
//!   host), per message ([`WsScrub`]): a whole
//!   message (its fragments held until the last, 16 MiB max) has the value replaced in its
//!   payloads by a mask of the same length (frame lengths cannot change without re-framing),
//!   each fragment keeping its length, and is forwarded at once; control frames pass at once
//!   (masked too). A value split across two *messages* cannot be masked (the first part is
//!   already gone): the connection is closed before the second message and `secret.blocked` is
//!   emitted (position `websocket frames`). A masked or oversized server frame also closes it.
//!
//! On plaintext flows (`ws://`) the handshake is checked like any plaintext request (a
//! placeholder of a secret that does not serve the host, in an authorization position, is
//! refused with `secret.blocked`) and nothing is ever swapped: the frames pass unswapped
//! (watched for other secrets' placeholders, as above).

use std::sync::Arc;

use hyper::header::{self, HeaderMap, HeaderValue};
use hyper::{Method, Version};
use hyper_util::rt::TokioIo;
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};

use super::Interceptor;
use super::scrub::{Replacer, StreamReplace};
use super::swap::Blocked;
use super::ws_watch::FrameWatch;

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
    #[error("an unmasked WebSocket frame from the client")]
    Unmasked,
    #[error("a WebSocket frame a client may not send: {0}")]
    Protocol(&'static str),
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

/// A data frame of the guest's being read: payload bytes still to come, its mask key and
/// where in the key the next byte falls, and whether it ends its message.
struct ClientFrame {
    left: u64,
    key: [u8; 4],
    at: usize,
    fin: bool,
}

/// The data message being swapped: its opcode, whether its first frame has gone upstream, the
/// streaming swap of its payload and the swapped bytes not framed yet.
struct Message {
    op: u8,
    started: bool,
    /// `None`: nothing is swapped (the frames are only watched).
    rep: Option<StreamReplace>,
    out: Vec<u8>,
}

/// The guest -> upstream frame swapper (see the module doc).
pub struct WsSwap {
    swaps: Option<Arc<Replacer>>,
    /// Placeholders audited or marked used ([`FrameWatch`]).
    watch: Option<FrameWatch>,
    /// Bytes of a frame header (or of a whole control frame) not complete yet.
    buf: Vec<u8>,
    frame: Option<ClientFrame>,
    msg: Option<Message>,
}

/// Append one client frame: `op` with FIN as given, `payload` masked with a fresh key.
fn client_frame(out: &mut Vec<u8>, op: u8, fin: bool, payload: &[u8]) {
    out.push(op | if fin { 0x80 } else { 0 });
    match payload.len() {
        n if n < 126 => out.push(0x80 | n as u8),
        n if n <= usize::from(u16::MAX) => {
            out.push(0x80 | 126);
            out.extend_from_slice(&(n as u16).to_be_bytes());
        }
        n => {
            out.push(0x80 | 127);
            out.extend_from_slice(&(n as u64).to_be_bytes());
        }
    }
    let mut key = [0u8; 4];
    if getrandom::fill(&mut key).is_err() {
        // Never expected; a fixed key is still a valid frame.
        key = [0x5a, 0xa5, 0x3c, 0xc3];
    }
    out.extend_from_slice(&key);
    out.extend(payload.iter().enumerate().map(|(i, b)| b ^ key[i % 4]));
}

impl WsSwap {
    #[cfg(test)]
    pub fn new(swaps: Arc<Replacer>) -> WsSwap {
        WsSwap::with(Some(swaps), None)
    }

    /// A swapper of `swaps` (if any) whose messages `watch` sees first (if any).
    pub fn with(swaps: Option<Arc<Replacer>>, watch: Option<FrameWatch>) -> WsSwap {
        WsSwap {
            swaps,
            watch,
            buf: Vec::new(),
            frame: None,
            msg: None,
        }
    }

    /// Frame the swapped bytes of the current message not sent yet (`fin`: and end it).
    fn emit(&mut self, out: &mut Vec<u8>, fin: bool) {
        let Some(m) = &mut self.msg else { return };
        if fin {
            if let Some(rep) = &mut m.rep {
                let rest = rep.finish();
                m.out.extend(rest);
            }
            if let Some(w) = &mut self.watch {
                w.end_message();
            }
        } else if m.out.is_empty() {
            return;
        }
        let op = if m.started { 0 } else { m.op };
        client_frame(out, op, fin, &m.out);
        m.out.clear();
        m.started = true;
        if fin {
            self.msg = None;
        }
    }

    /// The frames `chunk` completes or continues, swapped and re-framed. Only a partial frame
    /// header, a partial control frame (at most 131 bytes) and the swap's carry are held.
    pub fn push(&mut self, chunk: &[u8]) -> Result<Vec<u8>, WsError> {
        self.buf.extend_from_slice(chunk);
        let mut out = Vec::new();
        let mut pos = 0;
        while pos < self.buf.len() || self.frame.as_ref().is_some_and(|f| f.left == 0) {
            if let Some(f) = &mut self.frame {
                let n = usize::try_from(f.left)
                    .unwrap_or(usize::MAX)
                    .min(self.buf.len() - pos);
                let mut plain = self.buf[pos..pos + n].to_vec();
                for b in plain.iter_mut() {
                    *b ^= f.key[f.at % 4];
                    f.at += 1;
                }
                f.left -= n as u64;
                pos += n;
                let (done, fin) = (f.left == 0, f.fin);
                if let Some(m) = &mut self.msg {
                    if let Some(w) = &mut self.watch {
                        w.feed(&plain);
                    }
                    match &mut m.rep {
                        Some(rep) => {
                            let swapped = rep.push(&plain);
                            m.out.extend(swapped);
                        }
                        None => m.out.extend_from_slice(&plain),
                    }
                }
                if !done {
                    break;
                }
                self.frame = None;
                if fin {
                    self.emit(&mut out, true);
                }
                continue;
            }
            let Some(h) = client_header(&self.buf[pos..])? else {
                break;
            };
            if h.op >= 8 {
                // A control frame passes unchanged, whole (after what is swapped so far).
                let total = h.hlen + h.len as usize;
                if self.buf.len() - pos < total {
                    break;
                }
                self.emit(&mut out, false);
                out.extend_from_slice(&self.buf[pos..pos + total]);
                pos += total;
                continue;
            }
            match (h.op, self.msg.is_some()) {
                (0, true) => {}
                (1 | 2, false) => {
                    self.msg = Some(Message {
                        op: h.op,
                        started: false,
                        rep: self.swaps.clone().map(StreamReplace::new),
                        out: Vec::new(),
                    })
                }
                (0, false) => return Err(WsError::Protocol("a continuation without a message")),
                (1 | 2, true) => {
                    return Err(WsError::Protocol("a new message inside a fragmented one"));
                }
                _ => return Err(WsError::Protocol("a reserved opcode")),
            }
            self.frame = Some(ClientFrame {
                left: h.len,
                key: h.key,
                at: 0,
                fin: h.fin,
            });
            pos += h.hlen;
        }
        self.buf.drain(..pos);
        self.emit(&mut out, false);
        Ok(out)
    }
}

/// A client frame's header.
struct ClientHeader {
    fin: bool,
    op: u8,
    /// Header length, mask key included.
    hlen: usize,
    len: u64,
    key: [u8; 4],
}

/// Parse a client frame's header (`None`: not all of it yet).
fn client_header(b: &[u8]) -> Result<Option<ClientHeader>, WsError> {
    if b.len() < 2 {
        return Ok(None);
    }
    if b[0] & 0x70 != 0 {
        return Err(WsError::Protocol("reserved bits set without an extension"));
    }
    if b[1] & 0x80 == 0 {
        return Err(WsError::Unmasked);
    }
    let (ext, len) = match b[1] & 0x7f {
        126 if b.len() >= 4 => (2, u64::from(u16::from_be_bytes([b[2], b[3]]))),
        127 if b.len() >= 10 => {
            let mut n = [0u8; 8];
            n.copy_from_slice(&b[2..10]);
            (8, u64::from_be_bytes(n))
        }
        126 | 127 => return Ok(None),
        n => (0, u64::from(n)),
    };
    if len >> 63 != 0 {
        return Err(WsError::Protocol("a 64-bit length with its top bit set"));
    }
    let hlen = 2 + ext + 4;
    if b.len() < hlen {
        return Ok(None);
    }
    let (fin, op) = (b[0] & 0x80 != 0, b[0] & 0x0f);
    if op >= 8 && (!fin || len > 125) {
        return Err(WsError::Protocol("a fragmented or long control frame"));
    }
    let mut key = [0u8; 4];
    key.copy_from_slice(&b[hlen - 4..hlen]);
    Ok(Some(ClientHeader {
        fin,
        op,
        hlen,
        len,
        key,
    }))
}

/// A rewrite of one direction's frames.
trait Reframe: Send {
    fn push(&mut self, chunk: &[u8]) -> Result<Vec<u8>, WsError>;
}

impl Reframe for WsScrub {
    fn push(&mut self, chunk: &[u8]) -> Result<Vec<u8>, WsError> {
        WsScrub::push(self, chunk)
    }
}

impl Reframe for WsSwap {
    fn push(&mut self, chunk: &[u8]) -> Result<Vec<u8>, WsError> {
        WsSwap::push(self, chunk)
    }
}

/// One direction of a relay: read, rewrite (if `f`), write; `Ok` when either end closes.
async fn pump<R, W>(mut r: R, mut w: W, mut f: Option<Box<dyn Reframe>>) -> Result<(), WsError>
where
    R: tokio::io::AsyncRead + Unpin,
    W: tokio::io::AsyncWrite + Unpin,
{
    let mut buf = vec![0u8; 16 * 1024];
    loop {
        let n = match r.read(&mut buf).await {
            Ok(0) | Err(_) => {
                let _ = w.shutdown().await;
                return Ok(());
            }
            Ok(n) => n,
        };
        let wrote = match &mut f {
            Some(f) => w.write_all(&f.push(&buf[..n])?).await,
            None => w.write_all(&buf[..n]).await,
        };
        if wrote.is_err() {
            return Ok(());
        }
    }
}

/// Relay an upgraded connection until either side closes. `scrub`: the same-length masks and
/// the names of the secrets whose values the handshake carried; `swap`: the placeholder ->
/// value pairs of the secrets allowed in bodies for this host; `watch`: what the guest's
/// messages are audited for and which swaps mark a secret used (`ws_watch.rs`).
pub async fn relay(
    icpt: Arc<Interceptor>,
    host: String,
    (guest, upstream): (hyper::upgrade::OnUpgrade, hyper::upgrade::OnUpgrade),
    scrub: Option<(Arc<Replacer>, String)>,
    swap: Option<Arc<Replacer>>,
    watch: Option<FrameWatch>,
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
    if scrub.is_none() && swap.is_none() && watch.is_none() {
        let (mut g, mut u) = (g, u);
        let _ = tokio::io::copy_bidirectional(&mut g, &mut u).await;
        return;
    }
    let names = scrub.as_ref().map(|(_, n)| n.clone()).unwrap_or_default();
    let down = scrub.map(|(m, _)| Box::new(WsScrub::new(m)) as Box<dyn Reframe>);
    let up = (swap.is_some() || watch.is_some())
        .then(|| Box::new(WsSwap::with(swap, watch)) as Box<dyn Reframe>);
    let (gr, gw) = tokio::io::split(g);
    let (ur, uw) = tokio::io::split(u);
    let to_upstream = pump(gr, uw, up);
    let to_guest = pump(ur, gw, down);
    tokio::pin!(to_upstream, to_guest);
    // `true`: the error was toward the guest.
    let r: Result<(), (WsError, bool)> = tokio::select! {
        r = &mut to_guest => r.map_err(|e| (e, true)),
        r = &mut to_upstream => match r {
            Ok(()) => to_guest.await.map_err(|e| (e, true)),
            Err(e) => Err((e, false)),
        },
    };
    // On an error both halves are dropped here: the guest's and the upstream's connections
    // close.
    match r {
        Ok(()) => {}
        Err((e, true)) => {
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
        Err((e, false)) => {
            tracing::info!(host, error = %e, "websocket closed: a frame from the guest could not be swapped");
        }
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

    /// A client frame of any length, masked with a fixed key.
    fn masked(op: u8, fin: bool, p: &[u8]) -> Vec<u8> {
        let mut v = frame(op, fin, p);
        let hlen = v.len() - p.len();
        v[1] |= 0x80;
        let key = [0x37, 0xfa, 0x21, 0x3d];
        let payload: Vec<u8> = p.iter().enumerate().map(|(i, b)| b ^ key[i % 4]).collect();
        v.truncate(hlen);
        v.extend_from_slice(&key);
        v.extend(payload);
        v
    }

    /// Parse client frames: `(fin, op, length form, payload unmasked)`; each must be masked.
    fn parse(mut b: &[u8]) -> Vec<(bool, u8, u8, Vec<u8>)> {
        let mut v = Vec::new();
        while !b.is_empty() {
            assert_ne!(b[1] & 0x80, 0, "every frame toward the upstream is masked");
            let form = b[1] & 0x7f;
            let (ext, len) = match form {
                126 => (2, usize::from(u16::from_be_bytes([b[2], b[3]]))),
                127 => (8, u64::from_be_bytes(b[2..10].try_into().unwrap()) as usize),
                n => (0, usize::from(n)),
            };
            let key = &b[2 + ext..6 + ext];
            let p = b[6 + ext..6 + ext + len]
                .iter()
                .enumerate()
                .map(|(i, c)| c ^ key[i % 4])
                .collect();
            v.push((b[0] & 0x80 != 0, b[0] & 0x0f, form, p));
            b = &b[6 + ext + len..];
        }
        v
    }

    /// Messages (opcode, payload) and control frames, reassembled.
    fn messages(frames: &[(bool, u8, u8, Vec<u8>)]) -> Vec<(u8, Vec<u8>)> {
        let mut out = Vec::new();
        let mut cur: Option<(u8, Vec<u8>)> = None;
        for (fin, op, _, p) in frames {
            if *op >= 8 {
                out.push((*op, p.clone()));
                continue;
            }
            let c = cur.get_or_insert_with(|| (*op, Vec::new()));
            if *op != 0 {
                assert_eq!(c.1.len(), 0, "a new message inside one");
            }
            c.1.extend_from_slice(p);
            if *fin {
                out.push(cur.take().unwrap());
            }
        }
        assert!(cur.is_none(), "an unfinished message");
        out
    }

    #[test]
    fn guest_frames_are_swapped_reframed_and_masked_split_anywhere() {
        const PH: &[u8] = b"tbx_placeholder_abcdefghijklmnop";
        const VAL: &[u8] = b"sk-the-real-value-that-is-longer-than-its-placeholder";
        let r = Replacer::new(vec![(PH.to_vec(), VAL.to_vec())]).unwrap();
        let swapped = |b: &[u8]| -> Vec<u8> { r.replace_all(b) };
        // Small frames: every split offset.
        let a = [b"a ".as_slice(), PH, b" b"].concat();
        let frag = [b"x ".as_slice(), PH, b" y"].concat();
        let stream = [
            masked(1, true, &a),
            masked(9, true, b"ping tbx_placeholder"),
            masked(1, false, &frag[..12]),
            masked(10, true, PH),
            masked(0, false, &frag[12..20]),
            masked(0, false, b""),
            masked(0, true, &frag[20..]),
            masked(2, true, b""),
            masked(8, true, &[3, 232]),
        ]
        .concat();
        let want = vec![
            (1, swapped(&a)),
            (9, b"ping tbx_placeholder".to_vec()),
            // Control frames pass unchanged (a placeholder in a pong is not a body).
            (10, PH.to_vec()),
            (1, swapped(&frag)),
            (2, vec![]),
            (8, vec![3, 232]),
        ];
        for cut in 0..=stream.len() {
            let mut s = WsSwap::new(r.clone());
            let mut out = s.push(&stream[..cut]).unwrap();
            out.extend(s.push(&stream[cut..]).unwrap());
            assert_eq!(messages(&parse(&out)), want, "cut {cut}");
        }
        // Byte by byte, the ping's bytes unchanged.
        let mut s = WsSwap::new(r.clone());
        let mut out = Vec::new();
        for b in &stream {
            out.extend(s.push(std::slice::from_ref(b)).unwrap());
        }
        assert_eq!(messages(&parse(&out)), want);
        assert!(
            out.windows(2 + 4 + 20)
                .any(|w| w == masked(9, true, b"ping tbx_placeholder").as_slice())
        );
        // 16- and 64-bit lengths: the new lengths are right in the form they need.
        let mid = [vec![b'm'; 140], PH.to_vec(), vec![b'n'; 140]].concat();
        let big = [vec![b'x'; 40_000], PH.to_vec(), vec![b'y'; 40_000]].concat();
        let near = [vec![b'z'; 65_535 - PH.len()], PH.to_vec()].concat();
        let stream = [
            masked(1, true, &mid),
            masked(2, true, &big),
            masked(2, true, &near),
        ]
        .concat();
        for cut in [0, 3, 7, 150, 40_010, 80_100, stream.len() - 1] {
            let mut s = WsSwap::new(r.clone());
            let mut out = s.push(&stream[..cut]).unwrap();
            out.extend(s.push(&stream[cut..]).unwrap());
            let frames = parse(&out);
            assert_eq!(
                messages(&frames),
                [(1, swapped(&mid)), (2, swapped(&big)), (2, swapped(&near))],
                "cut {cut}"
            );
            if cut == 0 {
                let forms: Vec<u8> = frames.iter().map(|f| f.2).collect();
                // `near` grows past 65535 bytes: from the 16-bit form to the 64-bit one.
                assert_eq!(forms, [126, 127, 127]);
            }
        }
        // What a client may not send closes the connection.
        for (bad, e) in [
            (frame(1, true, b"unmasked"), WsError::Unmasked),
            (
                masked(0, true, b"cont"),
                WsError::Protocol("a continuation without a message"),
            ),
            (
                masked(0x41, true, b"rsv"),
                WsError::Protocol("reserved bits set without an extension"),
            ),
            (
                masked(9, false, b"ping"),
                WsError::Protocol("a fragmented or long control frame"),
            ),
            (
                masked(3, true, b"op3"),
                WsError::Protocol("a reserved opcode"),
            ),
            (
                [masked(1, false, b"a"), masked(2, true, b"b")].concat(),
                WsError::Protocol("a new message inside a fragmented one"),
            ),
        ] {
            assert_eq!(WsSwap::new(r.clone()).push(&bad), Err(e));
        }
        let mut f = vec![0x82, 0xff];
        f.extend_from_slice(&u64::MAX.to_be_bytes());
        f.extend_from_slice(&[0; 4]);
        assert!(WsSwap::new(r).push(&f).is_err());
    }
}
