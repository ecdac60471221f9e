//! Host reconnects over one long-lived byte stream, as on a virtio port: the guest's end of the
//! stream outlives every host connection, so whatever one connection leaves in it (frames,
//! half a frame, a late `HelloAck`) reaches the next host. In-memory pipes, real agent code.

use super::exec::ExecConfig;
use super::reaper::ReapMode;
use super::server::{Agent, ServeEnd, ShutdownMode, serve, serve_from};
use crate::rpc::frame::{decode_frame, encode, read_frame};
use crate::rpc::msg::{Body, Frame, PROTOCOL_VERSION, Reply, Request, WireExecEvent};
use crate::rpc::{AgentClient, ExecEvent, ExecRequest};
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, DuplexStream, ReadBuf};

const T: Duration = Duration::from_secs(60);

fn agent() -> Arc<Agent> {
    let cfg = ExecConfig {
        default_cwd: "/".into(),
        base_env: None,
        spawn_in_cwd: false,
    };
    Agent::new(cfg, ReapMode::OwnOnly, ShutdownMode::Return).unwrap()
}

/// The guest's end of a port: every connection gets a handle on the same byte stream.
#[derive(Clone)]
struct Port(Arc<Mutex<DuplexStream>>);

impl Port {
    fn lock(&self) -> std::sync::MutexGuard<'_, DuplexStream> {
        self.0.lock().unwrap_or_else(|p| p.into_inner())
    }
}

impl AsyncRead for Port {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        Pin::new(&mut *self.lock()).poll_read(cx, buf)
    }
}

impl AsyncWrite for Port {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        data: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut *self.lock()).poll_write(cx, data)
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut *self.lock()).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, _cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        // One connection ending must not end the port.
        Poll::Ready(Ok(()))
    }
}

fn hello(nonce: u64) -> Frame {
    Frame {
        stream: 0,
        body: Body::Hello {
            protocol: PROTOCOL_VERSION,
            version: "test".into(),
            nonce,
        },
    }
}

fn hello_ack(nonce: u64) -> Frame {
    Frame {
        stream: 0,
        body: Body::HelloAck {
            protocol: PROTOCOL_VERSION,
            version: "test".into(),
            nonce,
        },
    }
}

/// Every guest->host byte the host side has read so far (read slowly, like a busy host).
type Wire = Arc<Mutex<Vec<u8>>>;

fn slow_reader(mut r: tokio::io::ReadHalf<DuplexStream>) -> Wire {
    let wire: Wire = Arc::default();
    let w = wire.clone();
    tokio::spawn(async move {
        let mut buf = [0u8; 512];
        loop {
            match r.read(&mut buf).await {
                Ok(0) | Err(_) => return,
                Ok(n) => w.lock().unwrap().extend_from_slice(&buf[..n]),
            }
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
    });
    wire
}

/// The frames of `bytes` read strictly one after another from the start, as the host's reader
/// does; an error if the stream is out of step anywhere.
fn frames_in_step(bytes: &[u8]) -> Result<Vec<Frame>, String> {
    let mut out = Vec::new();
    let mut at = 0;
    while at < bytes.len() {
        match decode_frame(&bytes[at..]) {
            Ok(Some((f, used))) => {
                out.push(f);
                at += used;
            }
            Ok(None) => return Err(format!("stream ends inside a frame at byte {at}")),
            Err(e) => return Err(format!("out of step at byte {at}: {e}")),
        }
    }
    Ok(out)
}

/// Waits until the host has read a frame (any alignment) satisfying `want`.
async fn wait_for(wire: &Wire, what: &str, want: impl Fn(&Frame) -> bool) {
    let deadline = Instant::now() + T;
    loop {
        {
            let b = wire.lock().unwrap();
            let found =
                (0..b.len()).any(|i| matches!(decode_frame(&b[i..]), Ok(Some((f, _))) if want(&f)));
            if found {
                return;
            }
        }
        assert!(Instant::now() < deadline, "no {what} within {T:?}");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

#[tokio::test]
async fn a_rehello_lets_the_writer_finish_its_frame_first() {
    let a = agent();
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("big");
    std::fs::write(&file, vec![7u8; 1 << 20]).unwrap();
    // A small pipe: a 32 KiB frame takes many writes, so the writer is inside one most of the
    // time while the host reads slowly.
    let (host, guest) = tokio::io::duplex(1024);
    let (hr, mut hw) = tokio::io::split(host);
    let wire = slow_reader(hr);
    let port = Port(Arc::new(Mutex::new(guest)));
    let first = tokio::spawn(serve(a.clone(), port.clone()));
    hw.write_all(&encode(&hello(1)).unwrap()).await.unwrap();
    wait_for(&wire, "first HelloAck", |f| *f == hello_ack_of(f, 1)).await;
    // A read_file whose data (a whole credit window) is being written when the host comes back.
    let req = Frame {
        stream: 1,
        body: Body::Request(Request::ReadFile {
            path: file.to_str().unwrap().into(),
        }),
    };
    hw.write_all(&encode(&req).unwrap()).await.unwrap();
    wait_for(&wire, "file data", |f| matches!(f.body, Body::Data(_))).await;
    hw.write_all(&encode(&hello(2)).unwrap()).await.unwrap();
    let end = tokio::time::timeout(T, first)
        .await
        .unwrap()
        .unwrap()
        .unwrap();
    let ServeEnd::Rehello(h2) = end else {
        panic!("{end:?}")
    };
    let second = tokio::spawn(serve_from(a.clone(), port.clone(), Some(h2)));
    let ping = Frame {
        stream: 1,
        body: Body::Request(Request::Ping),
    };
    hw.write_all(&encode(&ping).unwrap()).await.unwrap();
    wait_for(&wire, "Pong", |f| f.body == Body::Reply(Reply::Pong)).await;
    // Read from the first byte with no resynchronisation, the stream is in step: the first
    // connection's last frame was finished before the second connection's HelloAck.
    let frames = frames_in_step(&wire.lock().unwrap()).unwrap();
    let acks: Vec<u64> = frames
        .iter()
        .filter_map(|f| match f.body {
            Body::HelloAck { nonce, .. } => Some(nonce),
            _ => None,
        })
        .collect();
    assert_eq!(acks, [1, 2]);
    assert_eq!(frames.last().unwrap().body, Body::Reply(Reply::Pong));
    assert!(!second.is_finished());
    second.abort();
}

/// `f` if it is the HelloAck for `nonce`, else a frame it cannot equal.
fn hello_ack_of(f: &Frame, nonce: u64) -> Frame {
    match f.body {
        Body::HelloAck { nonce: n, .. } if n == nonce => f.clone(),
        _ => hello(u64::MAX),
    }
}

#[tokio::test]
async fn a_writer_stuck_on_a_host_that_never_reads_is_given_up() {
    let a = agent();
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("big");
    std::fs::write(&file, vec![7u8; 1 << 20]).unwrap();
    let (host, guest) = tokio::io::duplex(1024);
    let (_hr, mut hw) = tokio::io::split(host);
    let server = tokio::spawn(serve(a, Port(Arc::new(Mutex::new(guest)))));
    hw.write_all(&encode(&hello(1)).unwrap()).await.unwrap();
    let req = Frame {
        stream: 1,
        body: Body::Request(Request::ReadFile {
            path: file.to_str().unwrap().into(),
        }),
    };
    hw.write_all(&encode(&req).unwrap()).await.unwrap();
    hw.write_all(&encode(&hello(2)).unwrap()).await.unwrap();
    // Nobody reads: the writer cannot finish its frame, and is aborted after its grace time.
    let t = Instant::now();
    let end = tokio::time::timeout(T, server).await.unwrap().unwrap();
    assert!(matches!(end, Ok(ServeEnd::Rehello(_))), "{end:?}");
    assert!(t.elapsed() < Duration::from_secs(10), "{:?}", t.elapsed());
}

#[tokio::test]
async fn the_client_waits_for_the_hello_ack_with_its_own_nonce() {
    // What a virtio port can hold when a host connects: the tail of a frame cut in the middle,
    // frames the agent wrote for an earlier connection (on stream 1, which this connection
    // reuses), a HelloAck for an earlier attempt. Only then the answer to this Hello.
    let (h, g) = tokio::io::duplex(1 << 16);
    let (mut gr, mut gw) = tokio::io::split(g);
    let stale_started = Frame {
        stream: 1,
        body: Body::Exec {
            seq: 1,
            event: WireExecEvent::Started {
                exec_id: 99,
                pid: 99,
            },
        },
    };
    let client = tokio::spawn(AgentClient::connect(h));
    let Some(Frame {
        body: Body::Hello { nonce, .. },
        ..
    }) = read_frame(&mut gr).await.unwrap()
    else {
        panic!("no Hello");
    };
    let mut stale = encode(&stale_started).unwrap()[5..].to_vec();
    stale.extend(encode(&hello_ack(nonce.wrapping_add(1))).unwrap());
    stale.extend(encode(&stale_started).unwrap());
    gw.write_all(&stale).await.unwrap();
    // The stale HelloAck must not complete the handshake.
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(!client.is_finished(), "handshake done on a stale HelloAck");
    gw.write_all(&encode(&hello_ack(nonce)).unwrap())
        .await
        .unwrap();
    let c = tokio::time::timeout(T, client)
        .await
        .unwrap()
        .unwrap()
        .unwrap();
    // This connection's first exec gets this connection's answer, not the stale one.
    let guest = tokio::spawn(async move {
        let req = read_frame(&mut gr).await.unwrap().unwrap();
        assert!(
            matches!(req.body, Body::Request(Request::Exec(_))),
            "{req:?}"
        );
        let started = Frame {
            stream: req.stream,
            body: Body::Exec {
                seq: 1,
                event: WireExecEvent::Started { exec_id: 5, pid: 5 },
            },
        };
        gw.write_all(&encode(&started).unwrap()).await.unwrap();
        (gr, gw)
    });
    let req = ExecRequest {
        argv: vec!["true".into()],
        keep_stdin_open: true,
        ..Default::default()
    };
    let mut s = tokio::time::timeout(T, c.exec(req)).await.unwrap().unwrap();
    assert_eq!(s.exec_id(), 5);
    assert_eq!(
        s.next().await.unwrap().unwrap(),
        ExecEvent::Started { pid: 5 }
    );
    let _io = guest.await.unwrap();
}

#[tokio::test]
async fn a_new_client_reaches_the_agent_behind_the_rest_of_a_cut_frame() {
    // The first host reads part of a big frame and goes away; a new client on the same stream
    // gets the rest of that frame (and whatever else the agent wrote for the first host) first.
    // It skips all of it, and the connection then works in step.
    let a = agent();
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("big");
    std::fs::write(&file, vec![7u8; 1 << 20]).unwrap();
    let path = file.to_str().unwrap().to_owned();
    let (host, guest) = tokio::io::duplex(1024);
    let port = Port(Arc::new(Mutex::new(guest)));
    let (mut hr, mut hw) = tokio::io::split(host);
    let first = tokio::spawn(serve(a.clone(), port.clone()));
    hw.write_all(&encode(&hello(1)).unwrap()).await.unwrap();
    let ack = read_frame(&mut hr).await.unwrap().unwrap();
    assert_eq!(ack, hello_ack_of(&ack, 1));
    let req = Frame {
        stream: 1,
        body: Body::Request(Request::ReadFile { path: path.clone() }),
    };
    hw.write_all(&encode(&req).unwrap()).await.unwrap();
    let mut some = [0u8; 100];
    hr.read_exact(&mut some).await.unwrap();
    // The new client's Hello reaches the agent on the same byte stream.
    let client = tokio::spawn(AgentClient::connect(tokio::io::join(hr, hw)));
    let end = tokio::time::timeout(T, first).await.unwrap().unwrap();
    let Ok(ServeEnd::Rehello(h)) = end else {
        panic!("{end:?}")
    };
    let second = tokio::spawn(serve_from(a.clone(), port.clone(), Some(h)));
    let c = tokio::time::timeout(T, client)
        .await
        .unwrap()
        .unwrap()
        .unwrap();
    assert_eq!(c.read_file(&path, u64::MAX).await.unwrap().len(), 1 << 20);
    let mut s = c
        .exec(ExecRequest {
            argv: vec!["echo".into(), "again".into()],
            ..Default::default()
        })
        .await
        .unwrap();
    let mut out = Vec::new();
    while let Some(ev) = s.next().await {
        if let ExecEvent::Stdout(b) = ev.unwrap() {
            out.extend(b);
        }
    }
    assert_eq!(out, b"again\n");
    drop(s);
    drop(c);
    let end = tokio::time::timeout(T, second).await.unwrap().unwrap();
    assert!(matches!(end, Ok(ServeEnd::Eof)), "{end:?}");
}
