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
    upgrade_on(tls).await
}

async fn upgrade_on(
    tls: tokio_rustls::client::TlsStream<tokio::io::DuplexStream>,
) -> (TokioIo<hyper::upgrade::Upgraded>, hyper::HeaderMap) {
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

#[tokio::test]
async fn behind_the_upstream_proxy_the_upgrade_opens_its_own_tunnel_by_name() {
    let h = ws_upstream().await;
    let (proxy, tls, _task) = super::tests::guest_tls_behind_proxy(&h, &[b"http/1.1"]).await;
    let (mut io, headers) = upgrade_on(tls).await;
    assert_eq!(headers["x-echo-auth"], format!("Bearer {PH}").as_str());
    io.write_all(&frame(1, true, b"hello", true)).await.unwrap();
    let wait = std::time::Duration::from_secs(10);
    let (_, p) = tokio::time::timeout(wait, read_frame(&mut io))
        .await
        .unwrap()
        .expect("an echo frame");
    assert!(String::from_utf8(p).unwrap().starts_with("echo:hello"));
    // The upgrade went on a connection of its own: a second CONNECT, by name.
    assert_eq!(
        proxy.seen.connects(),
        vec![format!("{HOST}:443"), format!("{HOST}:443")]
    );
    assert_eq!(
        h.seen.lock().unwrap()[0],
        format!("auth=Bearer {VAL} upgrade=websocket ext=")
    );
}

/// A client frame of any length (16- and 64-bit forms), masked with a fixed key.
fn client_frame(op: u8, fin: bool, p: &[u8]) -> Vec<u8> {
    let mut v = vec![op | if fin { 0x80 } else { 0 }];
    match p.len() {
        n if n < 126 => v.push(0x80 | n as u8),
        n if n < 65536 => {
            v.push(0x80 | 126);
            v.extend_from_slice(&(n as u16).to_be_bytes());
        }
        n => {
            v.push(0x80 | 127);
            v.extend_from_slice(&(n as u64).to_be_bytes());
        }
    }
    let key = [0x0f, 0xf0, 0x55, 0xaa];
    v.extend_from_slice(&key);
    v.extend(p.iter().enumerate().map(|(i, b)| b ^ key[i % 4]));
    v
}

/// A real WebSocket server (tokio-tungstenite, which checks the handshake, that client frames
/// are masked, lengths, fragments and UTF-8) on `io`: records the handshake's Authorization
/// and every message and ping it receives; echoes short text messages.
async fn serve_ws<S>(io: S, seen: Seen)
where
    S: AsyncRead + tokio::io::AsyncWrite + Unpin,
{
    use futures_util::{SinkExt as _, StreamExt as _};
    use tokio_tungstenite::tungstenite::Message;
    use tokio_tungstenite::tungstenite::handshake::server::{Request as WsReq, Response as WsResp};
    let s2 = seen.clone();
    // The error type is tungstenite's (its `Callback` trait), not ours to shrink.
    #[allow(clippy::result_large_err)]
    let cb = move |req: &WsReq, resp: WsResp| {
        let auth = req
            .headers()
            .get("authorization")
            .map(|v| String::from_utf8_lossy(v.as_bytes()).into_owned())
            .unwrap_or_default();
        s2.lock().unwrap().push(format!("handshake auth={auth}"));
        Ok(resp)
    };
    let Ok(mut ws) = tokio_tungstenite::accept_hdr_async(io, cb).await else {
        seen.lock().unwrap().push("handshake refused".into());
        return;
    };
    while let Some(m) = ws.next().await {
        let m = match m {
            Ok(m) => m,
            Err(e) => {
                seen.lock().unwrap().push(format!("error={e}"));
                return;
            }
        };
        let line = match &m {
            Message::Text(t) => format!("text={}", t.as_str()),
            Message::Binary(b) => format!("binary len={} {}", b.len(), String::from_utf8_lossy(b)),
            Message::Ping(p) => format!("ping={}", String::from_utf8_lossy(p)),
            Message::Close(_) => return,
            _ => continue,
        };
        seen.lock().unwrap().push(line);
        if let Message::Text(t) = m
            && t.len() < 100
            && ws
                .send(Message::text(format!("echo:{}", t.as_str())))
                .await
                .is_err()
        {
            return;
        }
    }
}

/// The tungstenite server behind TLS for `HOST` (HTTP/1.1 only).
async fn tungstenite_upstream() -> super::tests::Harness {
    let ca = test_ca();
    let acceptor = server_tls(&ca, HOST, &[b"http/1.1"]);
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap();
    let seen: Seen = Seen::default();
    let s2 = seen.clone();
    tokio::spawn(async move {
        while let Ok((tcp, _)) = l.accept().await {
            let (acceptor, seen) = (acceptor.clone(), s2.clone());
            tokio::spawn(async move {
                if let Ok(tls) = acceptor.accept(tcp).await {
                    serve_ws(tls, seen).await;
                }
            });
        }
    });
    harness_at(ca.pem, addr, seen)
}

/// Wait (10 s at most) until the upstream has recorded `n` lines (connections that never
/// shook hands, such as the interceptor's first upstream connection, left out).
async fn seen_n(seen: &Seen, n: usize) -> Vec<String> {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    loop {
        let mut s = seen.lock().unwrap().clone();
        s.retain(|l| l != "handshake refused");
        if s.len() >= n || std::time::Instant::now() > deadline {
            return s;
        }
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
}

#[tokio::test]
async fn guest_frames_carry_the_value_upstream_when_the_secret_allows_bodies() {
    let h = tungstenite_upstream().await;
    let (mut io, _) = upgrade(&h).await;
    let wait = std::time::Duration::from_secs(10);
    // One frame; a message in fragments with the placeholder split across them (and a ping
    // between); 16- and 64-bit lengths; written a few bytes at a time.
    let frag = format!("frag {PH} end");
    let mid = format!("{}{PH}{}", "m".repeat(150), "n".repeat(150));
    let big = [
        b"x".repeat(40_000),
        PH.as_bytes().to_vec(),
        b"y".repeat(40_000),
    ]
    .concat();
    let small = [
        client_frame(1, true, format!("one {PH}").as_bytes()),
        client_frame(1, false, &frag.as_bytes()[..9]),
        client_frame(9, true, b"p"),
        client_frame(0, false, &frag.as_bytes()[9..20]),
        client_frame(0, true, &frag.as_bytes()[20..]),
    ]
    .concat();
    for c in small.chunks(3) {
        io.write_all(c).await.unwrap();
        io.flush().await.unwrap();
    }
    io.write_all(&client_frame(1, true, mid.as_bytes()))
        .await
        .unwrap();
    io.write_all(&client_frame(2, true, &big)).await.unwrap();
    io.flush().await.unwrap();
    let seen = seen_n(&h.seen, 6).await;
    assert_eq!(seen[0], format!("handshake auth=Bearer {VAL}"));
    assert_eq!(seen[1], format!("text=one {VAL}"), "{seen:?}");
    assert_eq!(seen[2], "ping=p", "{seen:?}");
    assert_eq!(seen[3], format!("text=frag {VAL} end"), "{seen:?}");
    assert_eq!(
        seen[4],
        format!("text={}", mid.replace(PH, VAL)),
        "{seen:?}"
    );
    let big_len = big.len() - PH.len() + VAL.len();
    assert!(
        seen[5].starts_with(&format!("binary len={big_len} ")) && seen[5].contains(VAL),
        "{:?}",
        &seen[5][..40]
    );
    assert!(seen.iter().all(|s| !s.contains(PH)), "{seen:?}");
    // The echo comes back scrubbed (same length, masked).
    let (_, p) = tokio::time::timeout(wait, read_frame(&mut io))
        .await
        .unwrap()
        .expect("an echo");
    let got = String::from_utf8(p).unwrap();
    assert_eq!(got, format!("echo:one {}", &PH[..VAL.len()]));
    assert!(h.blocked.lock().unwrap().is_empty());

    // A secret that does not allow bodies: the frames go unchanged.
    let mut snap = (*h.icpt.secrets().current()).clone();
    snap.bindings[0].in_body = false;
    h.icpt.secrets().publish(snap);
    let before = seen_n(&h.seen, 0).await.len();
    let (mut io, _) = upgrade(&h).await;
    io.write_all(&client_frame(1, true, format!("two {PH}").as_bytes()))
        .await
        .unwrap();
    io.flush().await.unwrap();
    let seen = seen_n(&h.seen, before + 2).await;
    assert_eq!(seen[before], format!("handshake auth=Bearer {VAL}"));
    assert_eq!(seen[before + 1], format!("text=two {PH}"), "{seen:?}");
}

#[tokio::test]
async fn websocket_over_plaintext_is_relayed_never_swapped_and_foreign_placeholders_refused() {
    let h = super::tests::harness_with(true, true).await;
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap();
    let seen = Seen::default();
    let s2 = seen.clone();
    tokio::spawn(async move {
        while let Ok((tcp, _)) = l.accept().await {
            tokio::spawn(serve_ws(tcp, s2.clone()));
        }
    });
    let plain = |auth: String| {
        let icpt = h.icpt.clone();
        async move {
            let (ours, theirs) = tokio::io::duplex(64 * 1024);
            let tcp = tokio::net::TcpStream::connect(addr).await.unwrap();
            tokio::spawn({
                let dial = crate::network::upstream_proxy::Dial::direct(
                    tcp.peer_addr().unwrap(),
                    Some(HOST),
                );
                icpt.serve_plain(theirs, tcp, dial, HOST.to_string())
            });
            let (mut s, conn) = hyper::client::conn::http1::handshake(TokioIo::new(ours))
                .await
                .unwrap();
            tokio::spawn(conn.with_upgrades());
            let req = Request::builder()
                .uri("/ws")
                .header("host", HOST)
                .header("connection", "Upgrade")
                .header("upgrade", "websocket")
                .header("sec-websocket-version", "13")
                .header("sec-websocket-key", "dGhlIHNhbXBsZSBub25jZQ==")
                .header("authorization", auth)
                .body(full(""))
                .unwrap();
            s.send_request(req).await.unwrap()
        }
    };
    // Its own secret's placeholder: the upgrade works, nothing is swapped (no value ever goes
    // in plaintext), frames pass unchanged.
    let mut resp = plain(format!("Bearer {PH}")).await;
    assert_eq!(resp.status(), StatusCode::SWITCHING_PROTOCOLS);
    let mut io = TokioIo::new(hyper::upgrade::on(&mut resp).await.unwrap());
    io.write_all(&client_frame(1, true, format!("hi {PH}").as_bytes()))
        .await
        .unwrap();
    io.flush().await.unwrap();
    let (_, p) = tokio::time::timeout(std::time::Duration::from_secs(10), read_frame(&mut io))
        .await
        .unwrap()
        .expect("an echo");
    assert_eq!(String::from_utf8(p).unwrap(), format!("echo:hi {PH}"));
    let got = seen_n(&seen, 2).await;
    assert_eq!(
        got,
        [
            format!("handshake auth=Bearer {PH}"),
            format!("text=hi {PH}")
        ]
    );
    // Another secret's placeholder in the handshake: refused, with the event; the upstream
    // never sees it.
    let resp = plain(format!("Bearer {}", super::tests::PH2)).await;
    assert_eq!(resp.status(), StatusCode::FORBIDDEN);
    assert_eq!(
        h.blocked.lock().unwrap().as_slice(),
        [("OTHER".to_string(), HOST.to_string())]
    );
    assert_eq!(seen.lock().unwrap().len(), 2);
}

#[tokio::test]
async fn http2_extended_connect_is_not_offered_and_is_refused() {
    let h = super::tests::harness_with(false, true).await;
    let (tls, _task) = guest_tls(&h, &[b"h2"]).await.unwrap();
    let (mut s, conn) = h2::client::handshake(tls).await.unwrap();
    tokio::spawn(conn);
    // An ordinary request first: the server's SETTINGS have arrived when it is answered.
    let req = Request::builder()
        .uri(format!("https://{HOST}/"))
        .body(())
        .unwrap();
    let (resp, _) = s.send_request(req, true).unwrap();
    assert_eq!(resp.await.unwrap().status(), 200);
    assert!(
        !s.is_extended_connect_protocol_enabled(),
        "SETTINGS_ENABLE_CONNECT_PROTOCOL must not be offered to the guest"
    );
    let before = h.seen.lock().unwrap().len();
    // Sent anyway: the stream is refused (reset), nothing reaches the upstream.
    let mut req = Request::builder()
        .method("CONNECT")
        .uri(format!("https://{HOST}/ws"))
        .header("authorization", format!("Bearer {PH}"))
        .header("sec-websocket-version", "13")
        .body(())
        .unwrap();
    req.extensions_mut()
        .insert(h2::ext::Protocol::from_static("websocket"));
    let mut s = s.ready().await.unwrap();
    let (resp, _) = s.send_request(req, false).unwrap();
    match tokio::time::timeout(std::time::Duration::from_secs(10), resp)
        .await
        .expect("an answer")
    {
        Err(e) => assert_eq!(e.reason(), Some(h2::Reason::PROTOCOL_ERROR), "{e}"),
        Ok(r) => assert_eq!(r.status(), StatusCode::METHOD_NOT_ALLOWED),
    }
    // A plain CONNECT: 405.
    let req = Request::builder()
        .method("CONNECT")
        .uri(format!("{HOST}:443"))
        .body(())
        .unwrap();
    let (resp, _) = s.send_request(req, true).unwrap();
    assert_eq!(resp.await.unwrap().status(), StatusCode::METHOD_NOT_ALLOWED);
    let seen = h.seen.lock().unwrap();
    assert_eq!(seen.len(), before, "{seen:?}");
    assert!(seen.iter().all(|l| !l.contains(VAL)));
}

#[tokio::test]
async fn frames_mark_swapped_secrets_used_and_audit_other_secrets_placeholders() {
    use super::tests::PH2;
    let h = tungstenite_upstream().await;
    let used: std::sync::Arc<std::sync::Mutex<Vec<String>>> = Default::default();
    let u = used.clone();
    h.icpt.set_used_sink(std::sync::Arc::new(move |name: &str| {
        u.lock().unwrap().push(name.to_owned())
    }));
    let (mut io, _) = upgrade(&h).await;
    // The handshake's Authorization was swapped: used once.
    assert_eq!(used.lock().unwrap().as_slice(), ["KEY"]);
    // Another secret's placeholder (twice, split across fragments): unchanged upstream,
    // audited once for the message; again in the next message: audited again.
    let m = format!("tool output {PH2} and {PH2}");
    let frames = [
        client_frame(1, false, &m.as_bytes()[..20]),
        client_frame(0, true, &m.as_bytes()[20..]),
        client_frame(1, true, format!("again {PH2}").as_bytes()),
        // The swapped secret's placeholder: marks it used.
        client_frame(1, true, format!("key {PH}").as_bytes()),
        client_frame(1, true, b"nothing here"),
    ]
    .concat();
    for c in frames.chunks(7) {
        io.write_all(c).await.unwrap();
        io.flush().await.unwrap();
    }
    let seen = seen_n(&h.seen, 5).await;
    assert_eq!(seen[1], format!("text={m}"), "{seen:?}");
    assert_eq!(seen[2], format!("text=again {PH2}"), "{seen:?}");
    assert_eq!(seen[3], format!("text=key {VAL}"), "{seen:?}");
    assert_eq!(seen[4], "text=nothing here", "{seen:?}");
    assert_eq!(
        h.audited.lock().unwrap().as_slice(),
        [
            ("OTHER".to_string(), HOST.to_string()),
            ("OTHER".to_string(), HOST.to_string())
        ]
    );
    assert!(h.blocked.lock().unwrap().is_empty());
    assert_eq!(used.lock().unwrap().as_slice(), ["KEY", "KEY"]);
}
