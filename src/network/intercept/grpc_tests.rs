//! gRPC through the interceptor, driven from a native peer: the client is the `h2` crate
//! speaking the gRPC wire format by hand (HTTP/2, `content-type: application/grpc`,
//! `te: trailers`, 5-byte length-prefixed protobuf messages, `grpc-status`/`grpc-message`
//! trailers), so no gRPC library stands between the test and the bytes. The upstream is a
//! rustls + hyper HTTP/2 server on 127.0.0.1 with a certificate from the test's extra CA,
//! reached directly or through a real in-process HTTP `CONNECT` proxy (`[network]
//! upstream_proxy`).

use bytes::Bytes;
use http_body_util::{BodyExt as _, StreamBody};
use hyper::Response;
use hyper::body::Frame;

use super::body::{BoxError, ProxyBody, boxed};
use super::tests::{HOST, PH, Seen, VAL, guest_tls, harness_at, server_tls, test_ca};

/// One protobuf field 1 (string) holding `s`.
fn pb(s: &[u8]) -> Vec<u8> {
    let mut v = vec![0x0a];
    let mut n = s.len();
    while n >= 0x80 {
        v.push((n as u8 & 0x7f) | 0x80);
        n >>= 7;
    }
    v.push(n as u8);
    v.extend_from_slice(s);
    v
}

/// The string of field 1; panics unless the message is exactly one such field (its length
/// prefix must match: a scrub that changed the length breaks this).
fn unpb(m: &[u8]) -> String {
    assert_eq!(m[0], 0x0a, "{m:?}");
    let (mut n, mut shift, mut i) = (0usize, 0, 1);
    loop {
        let b = m[i];
        n |= ((b & 0x7f) as usize) << shift;
        shift += 7;
        i += 1;
        if b < 0x80 {
            break;
        }
    }
    assert_eq!(n, m.len() - i, "protobuf length prefix broken: {m:?}");
    String::from_utf8(m[i..].to_vec()).unwrap()
}

fn frame(flag: u8, m: &[u8]) -> Vec<u8> {
    let mut v = vec![flag];
    v.extend_from_slice(&(m.len() as u32).to_be_bytes());
    v.extend_from_slice(m);
    v
}

/// Split complete gRPC frames off the front of `buf`: `(flag, message)`.
fn take_frames(buf: &mut Vec<u8>) -> Vec<(u8, Vec<u8>)> {
    let mut out = Vec::new();
    while buf.len() >= 5 {
        let len = u32::from_be_bytes([buf[1], buf[2], buf[3], buf[4]]) as usize;
        if buf.len() < 5 + len {
            break;
        }
        out.push((buf[0], buf[5..5 + len].to_vec()));
        buf.drain(..5 + len);
    }
    out
}

fn trailers(auth: &str) -> hyper::HeaderMap {
    let mut t = hyper::HeaderMap::new();
    t.insert("grpc-status", "0".parse().unwrap());
    t.insert("grpc-message", format!("done {auth}").parse().unwrap());
    t.insert("x-echo-auth", auth.parse().unwrap());
    t
}

/// The gRPC service: `/t.Echo/Chat` answers each message as it arrives (bidi streaming),
/// `/t.Echo/Collect` answers once at the end (client streaming), `/t.Echo/Gz` answers one
/// gzip-compressed message. Every answer echoes the Authorization it was sent.
async fn serve(req: hyper::Request<hyper::body::Incoming>, seen: Seen) -> Response<ProxyBody> {
    let (parts, mut body) = req.into_parts();
    let auth = parts
        .headers
        .get("authorization")
        .map(|v| String::from_utf8_lossy(v.as_bytes()).into_owned())
        .unwrap_or_default();
    seen.lock().unwrap().push(format!(
        "path={} auth={auth} ct={:?} te={:?} gae={:?}",
        parts.uri.path(),
        parts.headers.get("content-type"),
        parts.headers.get("te"),
        parts.headers.get("grpc-accept-encoding"),
    ));
    let (tx, rx) = tokio::sync::mpsc::channel::<Result<Frame<Bytes>, BoxError>>(16);
    let path = parts.uri.path().to_owned();
    let gz = path == "/t.Echo/Gz";
    let seen2 = seen.clone();
    let auth2 = auth.clone();
    let work = async move {
        let mut buf = Vec::new();
        let mut msgs = Vec::new();
        while let Some(Ok(f)) = body.frame().await {
            let Ok(d) = f.into_data() else { continue };
            buf.extend_from_slice(&d);
            for (_, m) in take_frames(&mut buf) {
                let text = unpb(&m);
                if path == "/t.Echo/Chat" {
                    let reply = pb(format!("echo:{text} auth:{auth2}").as_bytes());
                    let _ = tx.send(Ok(Frame::data(frame(0, &reply).into()))).await;
                }
                msgs.push(text);
            }
        }
        seen2
            .lock()
            .unwrap()
            .push(format!("msgs={}", msgs.join("|")));
        let text = format!("n={} auth={auth2} msgs={}", msgs.len(), msgs.join("|"));
        match path.as_str() {
            "/t.Echo/Collect" => {
                let _ = tx
                    .send(Ok(Frame::data(frame(0, &pb(text.as_bytes())).into())))
                    .await;
            }
            "/t.Echo/Gz" => {
                use std::io::Write as _;
                let mut e = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
                e.write_all(&pb(text.as_bytes())).unwrap();
                let _ = tx
                    .send(Ok(Frame::data(frame(1, &e.finish().unwrap()).into())))
                    .await;
            }
            _ => {}
        }
        let _ = tx.send(Ok(Frame::trailers(trailers(&auth2)))).await;
    };
    tokio::spawn(work);
    let mut r = Response::new(boxed(StreamBody::new(
        tokio_stream::wrappers::ReceiverStream::new(rx),
    )));
    r.headers_mut()
        .insert("content-type", "application/grpc".parse().unwrap());
    if gz {
        r.headers_mut()
            .insert("grpc-encoding", "gzip".parse().unwrap());
    }
    r
}

async fn grpc_upstream() -> super::tests::Harness {
    let ca = test_ca();
    let acceptor = server_tls(&ca, HOST, &[b"h2"]);
    let (addr, seen) =
        super::tests::serve_tls(acceptor, |req, seen| async move { serve(req, seen).await }).await;
    harness_at(ca.pem, addr, seen)
}

/// A call's response side: reads whole gRPC frames with a bounded wait.
struct Call {
    body: h2::RecvStream,
    buf: Vec<u8>,
}

impl Call {
    async fn next(&mut self) -> Option<(u8, Vec<u8>)> {
        let wait = std::time::Duration::from_secs(10);
        loop {
            if let Some(f) = take_frames(&mut self.buf).into_iter().next() {
                return Some(f);
            }
            let d = tokio::time::timeout(wait, self.body.data())
                .await
                .expect("a message within 10 s (nothing may be held back)")?
                .unwrap();
            let _ = self.body.flow_control().release_capacity(d.len());
            self.buf.extend_from_slice(&d);
        }
    }
}

async fn start(
    h: &super::tests::Harness,
    method: &str,
) -> (
    h2::client::SendRequest<Bytes>,
    h2::client::ResponseFuture,
    h2::SendStream<Bytes>,
) {
    let (tls, _task) = guest_tls(h, &[b"h2"]).await.unwrap();
    let (client, conn) = h2::client::handshake(tls).await.unwrap();
    tokio::spawn(conn);
    start_on(client, method).await
}

/// [`start`] on an HTTP/2 connection the test already holds (e.g. one through the upstream
/// proxy).
async fn start_on(
    client: h2::client::SendRequest<Bytes>,
    method: &str,
) -> (
    h2::client::SendRequest<Bytes>,
    h2::client::ResponseFuture,
    h2::SendStream<Bytes>,
) {
    let mut client = client.ready().await.unwrap();
    let req = hyper::Request::builder()
        .method("POST")
        .uri(format!("https://{HOST}/t.Echo/{method}"))
        .header("content-type", "application/grpc")
        .header("te", "trailers")
        .header("authorization", format!("Bearer {PH}"))
        .body(())
        .unwrap();
    let (resp, send) = client.send_request(req, false).unwrap();
    (client, resp, send)
}

async fn call_of(resp: h2::client::ResponseFuture) -> Call {
    let r = resp.await.unwrap();
    assert_eq!(r.status(), 200);
    assert_eq!(r.headers()["content-type"], "application/grpc");
    Call {
        body: r.into_body(),
        buf: Vec::new(),
    }
}

/// The value as the guest sees it inside a message: masked with the placeholder's first bytes
/// (same length, so protobuf stays valid).
fn masked() -> &'static str {
    &PH[..VAL.len()]
}

#[tokio::test]
async fn grpc_bidi_streaming_swaps_metadata_masks_messages_and_keeps_trailers() {
    let h = grpc_upstream().await;
    let (_c, resp, mut send) = start(&h, "Chat").await;
    // Each message is answered before the next is sent: neither direction may hold bytes back.
    send.send_data(frame(0, &pb(b"one")).into(), false).unwrap();
    let mut call = call_of(resp).await;
    let (flag, m) = call.next().await.unwrap();
    assert_eq!(flag, 0);
    assert_eq!(unpb(&m), format!("echo:one auth:Bearer {}", masked()));
    // The second message split across two DATA frames.
    let f = frame(0, &pb(b"two"));
    send.send_data(Bytes::copy_from_slice(&f[..3]), false)
        .unwrap();
    send.send_data(Bytes::copy_from_slice(&f[3..]), false)
        .unwrap();
    let (_, m) = call.next().await.unwrap();
    assert_eq!(unpb(&m), format!("echo:two auth:Bearer {}", masked()));
    send.send_data(Bytes::new(), true).unwrap();
    assert!(call.next().await.is_none());
    let t = tokio::time::timeout(std::time::Duration::from_secs(10), call.body.trailers())
        .await
        .unwrap()
        .unwrap()
        .expect("trailers are forwarded");
    assert_eq!(t["grpc-status"], "0");
    assert_eq!(t["grpc-message"], format!("done Bearer {PH}").as_str());
    assert_eq!(t["x-echo-auth"], format!("Bearer {PH}").as_str());
    let seen = h.seen.lock().unwrap().clone();
    assert!(
        seen[0].contains(&format!("auth=Bearer {VAL}")),
        "the upstream gets the value: {seen:?}"
    );
    assert!(seen[0].contains("te=Some(\"trailers\")"), "{seen:?}");
    assert!(seen[0].contains("gae=Some(\"identity\")"), "{seen:?}");
    assert!(seen.iter().all(|s| !s.contains(PH)), "{seen:?}");
}

#[tokio::test]
async fn grpc_client_streaming_and_compressed_responses() {
    let h = grpc_upstream().await;
    for (method, flag_in) in [("Collect", 0u8), ("Gz", 1)] {
        let (_c, resp, mut send) = start(&h, method).await;
        // Three messages, the placeholder inside one: gRPC bodies are not swapped (the secret
        // allows in-body swaps, but a changed length would break the message).
        let mut body = frame(0, &pb(b"a"));
        body.extend(frame(0, &pb(PH.as_bytes())));
        body.extend(frame(0, &pb(b"c")));
        for piece in body.chunks(7) {
            send.send_data(Bytes::copy_from_slice(piece), false)
                .unwrap();
        }
        send.send_data(Bytes::new(), true).unwrap();
        let mut call = call_of(resp).await;
        let (flag, m) = call.next().await.unwrap();
        // A compressed message reaches the guest decoded (flag 0).
        assert_eq!(flag, 0, "{method} (upstream sent flag {flag_in})");
        assert_eq!(
            unpb(&m),
            format!("n=3 auth=Bearer {} msgs=a|{PH}|c", masked())
        );
        assert!(call.next().await.is_none());
        let t = call.body.trailers().await.unwrap().unwrap();
        assert_eq!(t["grpc-status"], "0");
        assert!(!format!("{t:?}").contains(VAL));
        let seen = h.seen.lock().unwrap().clone();
        assert!(seen.contains(&format!("msgs=a|{PH}|c")), "{seen:?}");
    }
}

#[tokio::test]
async fn behind_the_upstream_proxy_grpc_streams_through_a_tunnel_by_name() {
    let h = grpc_upstream().await;
    let (proxy, tls, _task) = super::tests::guest_tls_behind_proxy(&h, &[b"h2"]).await;
    assert_eq!(tls.get_ref().1.alpn_protocol(), Some(&b"h2"[..]));
    let (client, conn) = h2::client::handshake(tls).await.unwrap();
    tokio::spawn(conn);

    // Bidi streaming: each message answered before the next is sent.
    let (client, resp, mut send) = start_on(client, "Chat").await;
    send.send_data(frame(0, &pb(b"one")).into(), false).unwrap();
    let mut call = call_of(resp).await;
    let (_, m) = call.next().await.unwrap();
    assert_eq!(unpb(&m), format!("echo:one auth:Bearer {}", masked()));
    let f = frame(0, &pb(b"two"));
    send.send_data(Bytes::copy_from_slice(&f[..3]), false)
        .unwrap();
    send.send_data(Bytes::copy_from_slice(&f[3..]), true)
        .unwrap();
    let (_, m) = call.next().await.unwrap();
    assert_eq!(unpb(&m), format!("echo:two auth:Bearer {}", masked()));
    assert!(call.next().await.is_none());
    let wait = std::time::Duration::from_secs(10);
    let t = tokio::time::timeout(wait, call.body.trailers())
        .await
        .unwrap()
        .unwrap()
        .expect("trailers are forwarded");
    assert_eq!(t["grpc-status"], "0");
    assert_eq!(t["grpc-message"], format!("done Bearer {PH}").as_str());
    assert_eq!(t["x-echo-auth"], format!("Bearer {PH}").as_str());

    // Client streaming on the same guest connection, the placeholder inside a message.
    let (client, resp, mut send) = start_on(client, "Collect").await;
    let mut body = frame(0, &pb(b"a"));
    body.extend(frame(0, &pb(PH.as_bytes())));
    body.extend(frame(0, &pb(b"c")));
    for piece in body.chunks(7) {
        send.send_data(Bytes::copy_from_slice(piece), false)
            .unwrap();
    }
    send.send_data(Bytes::new(), true).unwrap();
    let mut call = call_of(resp).await;
    let (_, m) = call.next().await.unwrap();
    assert_eq!(
        unpb(&m),
        format!("n=3 auth=Bearer {} msgs=a|{PH}|c", masked())
    );
    assert!(call.next().await.is_none());
    let t = tokio::time::timeout(wait, call.body.trailers())
        .await
        .unwrap()
        .unwrap()
        .expect("trailers are forwarded");
    assert_eq!(t["grpc-status"], "0");
    assert_eq!(t["x-echo-auth"], format!("Bearer {PH}").as_str());

    // The upstream got the value in the metadata of both calls, never the placeholder there.
    let seen = h.seen.lock().unwrap().clone();
    let calls: Vec<_> = seen.iter().filter(|s| s.starts_with("path=")).collect();
    assert_eq!(calls.len(), 2, "{seen:?}");
    assert!(calls[0].starts_with("path=/t.Echo/Chat"), "{seen:?}");
    assert!(calls[1].starts_with("path=/t.Echo/Collect"), "{seen:?}");
    for c in &calls {
        assert!(c.contains(&format!("auth=Bearer {VAL} ")), "{seen:?}");
        assert!(c.contains("te=Some(\"trailers\")"), "{seen:?}");
        assert!(!c.contains(PH), "{seen:?}");
    }
    assert!(h.blocked.lock().unwrap().is_empty());
    // One tunnel, asked for by name (never by the unreachable address): both calls were
    // multiplexed on the HTTP/2 connection the stack's tunnel carries.
    assert_eq!(proxy.seen.connects(), vec![format!("{HOST}:443")]);

    // The proxy drops the tunnel: the guest's connection stays, and a later call goes on a
    // new tunnel, again by name (a call racing the close may fail; the deadline bounds it).
    proxy.cut();
    let deadline = std::time::Instant::now() + wait;
    let mut call = loop {
        let (_c, resp, mut send) = start_on(client.clone(), "Collect").await;
        let _ = send.send_data(frame(0, &pb(b"again")).into(), true);
        if let Ok(Ok(r)) = tokio::time::timeout(wait, resp).await
            && r.status() == 200
        {
            break Call {
                body: r.into_body(),
                buf: Vec::new(),
            };
        }
        assert!(
            std::time::Instant::now() < deadline,
            "no call succeeded after the tunnel was cut"
        );
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    };
    let (_, m) = call.next().await.expect("an answer on the new tunnel");
    assert_eq!(unpb(&m), format!("n=1 auth=Bearer {} msgs=again", masked()));
    assert_eq!(
        proxy.seen.connects(),
        vec![format!("{HOST}:443"), format!("{HOST}:443")]
    );
}
