//! WebSocket through the interceptor, from a native peer: a hyper HTTP/1.1 client upgrades over
//! TLS that trusts the sandbox CA; the upstream is a rustls + hyper server on 127.0.0.1 that
//! answers the handshake with 101 and then speaks RFC 6455 frames by hand (no WebSocket library
//! between the test and the bytes).

use hyper::{Request, Response, StatusCode};
use hyper_util::rt::{TokioExecutor, TokioIo};
use tokio::io::{AsyncRead, AsyncReadExt as _, AsyncWriteExt as _};

use super::body::{ProxyBody, full};
use super::tests::{HOST, PH, Seen, VAL, guest_tls, harness_at, server_tls, test_ca};

/// A frame; `mask`: a client frame (masked with a fixed key).
fn frame(op: u8, fin: bool, p: &[u8], mask: bool) -> Vec<u8> {
    assert!(p.len() < 126);
    let mut v = vec![op | if fin { 0x80 } else { 0 }];
    if mask {
        let key = [0x11, 0x22, 0x33, 0x44];
        v.push(0x80 | p.len() as u8);
        v.extend_from_slice(&key);
        v.extend(p.iter().enumerate().map(|(i, b)| b ^ key[i % 4]));
    } else {
        v.push(p.len() as u8);
        v.extend_from_slice(p);
    }
    v
}

/// Read one frame (payload < 126 bytes): `(first byte, payload unmasked)`; `None` at EOF.
async fn read_frame<R: AsyncRead + Unpin>(r: &mut R) -> Option<(u8, Vec<u8>)> {
    let mut h = [0u8; 2];
    r.read_exact(&mut h).await.ok()?;
    let len = (h[1] & 0x7f) as usize;
    assert!(len < 126);
    let mut key = [0u8; 4];
    if h[1] & 0x80 != 0 {
        r.read_exact(&mut key).await.ok()?;
    }
    let mut p = vec![0u8; len];
    r.read_exact(&mut p).await.ok()?;
    p.iter_mut().enumerate().for_each(|(i, b)| *b ^= key[i % 4]);
    Some((h[0], p))
}

/// The upstream: records the handshake's Authorization and extensions, then answers every
/// client text frame `m` with `echo:m auth:<Authorization>`; `split` is answered with the
/// Authorization split across a fragment and its continuation, `split2` across two messages.
async fn ws_upstream() -> super::tests::Harness {
    let ca = test_ca();
    let acceptor = server_tls(&ca, HOST, &[b"http/1.1"]);
    let (addr, seen) =
        super::tests::serve_tls(acceptor, |req, seen| async move { handshake(req, seen) }).await;
    harness_at(ca.pem, addr, seen)
}

fn handshake(mut req: Request<hyper::body::Incoming>, seen: Seen) -> Response<ProxyBody> {
    let h = |n: &str| {
        req.headers()
            .get(n)
            .map(|v| String::from_utf8_lossy(v.as_bytes()).into_owned())
            .unwrap_or_default()
    };
    let auth = h("authorization");
    seen.lock().unwrap().push(format!(
        "auth={auth} upgrade={} ext={}",
        h("upgrade"),
        h("sec-websocket-extensions")
    ));
    let echo = h("authorization");
    let on = hyper::upgrade::on(&mut req);
    let seen2 = seen.clone();
    tokio::spawn(async move {
        let Ok(up) = on.await else { return };
        let mut io = TokioIo::new(up);
        while let Some((_, p)) = read_frame(&mut io).await {
            let text = String::from_utf8_lossy(&p).into_owned();
            seen2.lock().unwrap().push(format!("frame={text}"));
            let (a, b) = auth.split_at(auth.len() - 6);
            let out = if text == "split" {
                [
                    frame(1, false, a.as_bytes(), false),
                    frame(0, true, b.as_bytes(), false),
                ]
                .concat()
            } else if text == "split2" {
                [
                    frame(1, true, a.as_bytes(), false),
                    frame(1, true, b.as_bytes(), false),
                ]
                .concat()
            } else {
                frame(
                    1,
                    true,
                    format!("echo:{text} auth:{auth}").as_bytes(),
                    false,
                )
            };
            if io.write_all(&out).await.is_err() {
                return;
            }
        }
    });
    let mut r = Response::new(full(""));
    *r.status_mut() = StatusCode::SWITCHING_PROTOCOLS;
    r.headers_mut()
        .insert("upgrade", "websocket".parse().unwrap());
    r.headers_mut()
        .insert("connection", "upgrade".parse().unwrap());
    r.headers_mut()
        .insert("sec-websocket-accept", "test-accept".parse().unwrap());
    r.headers_mut().insert("x-echo-auth", echo.parse().unwrap());
    r
}

/// Upgrade a guest connection; the upgraded stream and the 101's headers.
async fn upgrade(
    h: &super::tests::Harness,
) -> (TokioIo<hyper::upgrade::Upgraded>, hyper::HeaderMap) {
    let (tls, _task) = guest_tls(h, &[b"http/1.1"]).await.unwrap();
    let (mut s, conn) = hyper::client::conn::http1::handshake(TokioIo::new(tls))
        .await
        .unwrap();
    tokio::spawn(conn.with_upgrades());
    let _ = TokioExecutor::new();
    let req = Request::builder()
        .uri("/ws")
        .header("host", HOST)
        .header("connection", "Upgrade")
        .header("upgrade", "websocket")
        .header("sec-websocket-version", "13")
        .header("sec-websocket-key", "dGhlIHNhbXBsZSBub25jZQ==")
        .header("sec-websocket-extensions", "permessage-deflate")
        .header("authorization", format!("Bearer {PH}"))
        .body(full(""))
        .unwrap();
    let mut resp = s.send_request(req).await.unwrap();
    assert_eq!(resp.status(), StatusCode::SWITCHING_PROTOCOLS);
    let headers = resp.headers().clone();
    let up = hyper::upgrade::on(&mut resp).await.unwrap();
    (TokioIo::new(up), headers)
}

#[tokio::test]
async fn websocket_handshake_is_swapped_frames_flow_both_ways_and_are_scrubbed() {
    let h = ws_upstream().await;
    let (mut io, headers) = upgrade(&h).await;
    assert_eq!(headers["x-echo-auth"], format!("Bearer {PH}").as_str());
    assert_eq!(headers["upgrade"], "websocket");
    let wait = std::time::Duration::from_secs(10);
    for m in ["hello", "again"] {
        io.write_all(&frame(1, true, m.as_bytes(), true))
            .await
            .unwrap();
        let (b0, p) = tokio::time::timeout(wait, read_frame(&mut io))
            .await
            .unwrap()
            .expect("an echo frame");
        assert_eq!(b0, 0x81);
        // Same length as the upstream's frame: the value masked with the placeholder's start.
        let got = String::from_utf8(p).unwrap();
        assert_eq!(got, format!("echo:{m} auth:Bearer {}", &PH[..VAL.len()]));
    }
    let seen = h.seen.lock().unwrap().clone();
    assert_eq!(
        seen[0],
        format!("auth=Bearer {VAL} upgrade=websocket ext="),
        "the value goes upstream, no extension is offered: {seen:?}"
    );
    assert_eq!(&seen[1..], ["frame=hello", "frame=again"]);
    assert!(h.blocked.lock().unwrap().is_empty());
    // The value split across a fragment and its continuation: masked across both.
    io.write_all(&frame(1, true, b"split", true)).await.unwrap();
    let mut got = Vec::new();
    for fin in [0x01, 0x80] {
        let (b0, p) = tokio::time::timeout(wait, read_frame(&mut io))
            .await
            .unwrap()
            .expect("a fragment");
        assert_eq!(b0 & 0x80, fin & 0x80);
        got.extend(p);
    }
    assert_eq!(
        String::from_utf8(got).unwrap(),
        format!("Bearer {}", &PH[..VAL.len()])
    );
    // Split across two messages: the connection is closed before the second, with an event
    // naming the secret; nothing of the value's tail reaches the guest.
    io.write_all(&frame(1, true, b"split2", true))
        .await
        .unwrap();
    let mut rest = Vec::new();
    tokio::time::timeout(wait, io.read_to_end(&mut rest))
        .await
        .expect("the connection closes")
        .ok();
    let tail = &VAL[VAL.len() - 6..];
    assert!(!String::from_utf8_lossy(&rest).contains(tail), "{rest:?}");
    assert_eq!(
        h.blocked.lock().unwrap().as_slice(),
        [("KEY".to_string(), HOST.to_string())]
    );
}
