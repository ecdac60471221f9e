//! The listeners' deadlines on a real hyper server over an in-memory pipe, on tokio's paused
//! clock (time moves only when every task waits, so the bounds are exact and the tests quick).

use std::time::Duration;

use bytes::Bytes;
use http_body_util::BodyExt as _;
use hyper::{Request, Response};
use hyper_util::rt::TokioIo;
use tokio::io::{AsyncReadExt, AsyncWriteExt, DuplexStream};
use tokio::time::Instant;

use super::*;

const D: Deadlines = Deadlines {
    header: Duration::from_secs(1),
    idle: Duration::from_secs(30),
};

/// A server on one end of a pipe: `/stream` answers one chunk a second for 5 s, the rest "ok".
fn serve() -> DuplexStream {
    let (client, server) = tokio::io::duplex(64 * 1024);
    let (io, phase) = timed(server, D);
    let svc = hyper::service::service_fn(move |req: Request<hyper::body::Incoming>| {
        let phase = phase.clone();
        async move {
            phase.request_started();
            let body: Body = if req.uri().path() == "/stream" {
                let s = futures_util::stream::unfold(0, |i| async move {
                    (i < 5).then_some(())?;
                    tokio::time::sleep(Duration::from_secs(1)).await;
                    Some((Ok(Frame::data(Bytes::from("tick\n"))), i + 1))
                });
                http_body_util::StreamBody::new(s).boxed()
            } else {
                http_body_util::Full::new(Bytes::from("ok")).boxed()
            };
            Ok::<_, std::convert::Infallible>(phase.response(Response::new(body)))
        }
    });
    tokio::spawn(async move {
        let mut b = hyper::server::conn::http1::Builder::new();
        b.header_read_timeout(None);
        let _ = b.serve_connection(TokioIo::new(io), svc).await;
    });
    client
}

const GET: &[u8] = b"GET / HTTP/1.1\r\nHost: x\r\n\r\n";

/// Read one whole "ok" answer (the test's responses are small and have a length).
async fn answer(c: &mut DuplexStream) -> String {
    let mut got = Vec::new();
    let mut buf = [0u8; 1024];
    while !got.ends_with(b"\r\n\r\nok") {
        let n = c.read(&mut buf).await.unwrap();
        assert!(
            n > 0,
            "closed before the answer: {:?}",
            String::from_utf8_lossy(&got)
        );
        got.extend_from_slice(&buf[..n]);
    }
    String::from_utf8(got).unwrap()
}

/// How long until the server closes the connection (reads until EOF or an error).
async fn closed_after(c: &mut DuplexStream) -> Duration {
    let t = Instant::now();
    let mut buf = [0u8; 1024];
    while matches!(c.read(&mut buf).await, Ok(n) if n > 0) {}
    t.elapsed()
}

#[tokio::test(start_paused = true)]
async fn an_idle_keep_alive_connection_outlives_the_header_timeout() {
    let mut c = serve();
    c.write_all(GET).await.unwrap();
    assert!(answer(&mut c).await.starts_with("HTTP/1.1 200"));
    // Idle 5x the header timeout: hyper's own timer would have closed it after 1 s.
    tokio::time::sleep(Duration::from_secs(5)).await;
    c.write_all(GET).await.unwrap();
    assert!(answer(&mut c).await.starts_with("HTTP/1.1 200"));
    // Then closed at the idle timeout, counted from the end of the last answer.
    let idle = closed_after(&mut c).await;
    assert!(
        idle >= Duration::from_secs(30) && idle < Duration::from_secs(31),
        "{idle:?}"
    );
}

#[tokio::test(start_paused = true)]
async fn a_header_begun_after_an_idle_wait_must_finish_within_the_header_timeout() {
    let mut c = serve();
    c.write_all(GET).await.unwrap();
    answer(&mut c).await;
    tokio::time::sleep(Duration::from_secs(5)).await;
    // A slowloris: the first line, then nothing.
    c.write_all(b"GET / HTTP/1.1\r\n").await.unwrap();
    let cut = closed_after(&mut c).await;
    assert!(cut <= Duration::from_millis(1100), "{cut:?}");
}

#[tokio::test(start_paused = true)]
async fn a_silent_connection_is_closed_at_the_header_timeout() {
    let mut c = serve();
    let cut = closed_after(&mut c).await;
    assert!(
        cut >= Duration::from_secs(1) && cut <= Duration::from_millis(1100),
        "{cut:?}"
    );
}

#[tokio::test(start_paused = true)]
async fn a_trickled_first_header_is_cut_from_the_opening() {
    let mut c = serve();
    let t = Instant::now();
    for line in ["GET / HTTP/1.1\r\n", "A: 1\r\n", "B: 2\r\n", "C: 3\r\n"] {
        if c.write_all(line.as_bytes()).await.is_err() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(400)).await;
    }
    closed_after(&mut c).await;
    assert!(
        t.elapsed() <= Duration::from_millis(1700),
        "{:?}",
        t.elapsed()
    );
}

#[tokio::test(start_paused = true)]
async fn a_streaming_answer_is_not_cut_and_the_idle_clock_starts_after_it() {
    let mut c = serve();
    let t = Instant::now();
    c.write_all(b"GET /stream HTTP/1.1\r\nHost: x\r\n\r\n")
        .await
        .unwrap();
    let mut got = Vec::new();
    let mut buf = [0u8; 1024];
    while !got.ends_with(b"0\r\n\r\n") {
        let n = c.read(&mut buf).await.unwrap();
        assert!(n > 0, "the stream was cut after {:?}", t.elapsed());
        got.extend_from_slice(&buf[..n]);
    }
    let text = String::from_utf8(got).unwrap();
    assert_eq!(text.matches("tick").count(), 5, "{text}");
    assert!(t.elapsed() >= Duration::from_secs(5));
    // The stream took 5x the header timeout; the connection still takes a request.
    c.write_all(GET).await.unwrap();
    assert!(answer(&mut c).await.starts_with("HTTP/1.1 200"));
}
