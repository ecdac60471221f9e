//! The host against a replaced agent: a hostile test double of the guest side of the RPC
//! (`rpc::hostile`) over a socket pair. Each test is an attack the host must survive with a
//! clear error: a walk answer declaring a 2^50-byte path, data past the window, an endless
//! answer, an agent that never answers.

use crate::rpc::frame::{CHUNK, MAX_ANSWER, read_frame};
use crate::rpc::hostile::{fake_guest, ignore_all, next_request, send};
use crate::rpc::msg::{Body, WireExecEvent};
use crate::rpc::{AgentClient, Deadlines, ExecRequest, RpcError, WINDOW};
use std::time::Duration;
use tokio::net::UnixStream;

/// Longest a test waits for the host to react: past it, the host hung (the old code did).
const T: Duration = Duration::from_secs(20);

/// A `WalkSince` answer: `WalkDelta { cursor: {0, 0}, full: true, entries: [one entry] }` whose
/// first path declares 2^50 bytes (bincode varint: 253 then a u64), followed by two bytes.
fn walk_bomb() -> Vec<u8> {
    let mut b = vec![0u8, 0, 1, 1, 253];
    b.extend_from_slice(&(1u64 << 50).to_le_bytes());
    b.extend_from_slice(b"ab");
    b
}

/// Answers the first request with `bytes` as `Data` + `DataEnd`, then reads until the host
/// hangs up.
async fn answer_with(mut g: UnixStream, bytes: Vec<u8>) {
    let (id, _) = next_request(&mut g).await.unwrap();
    send(&mut g, id, Body::Data(bytes)).await;
    send(&mut g, id, Body::DataEnd).await;
    ignore_all(&mut g).await;
}

/// The attack itself; run in a child process by the test below (the old code aborted the whole
/// process on it: `memory allocation of 1125899906842624 bytes failed`).
#[tokio::test]
async fn walk_bomb_child() {
    if std::env::var_os("TRYBOXI_HOSTILE_CHILD").is_none() {
        println!(
            "walk_bomb_child runs only as the child of walk_answer_declaring_a_huge_path_is_refused"
        );
        return;
    }
    let (c, g) = fake_guest().await;
    tokio::spawn(answer_with(g, walk_bomb()));
    let r = tokio::time::timeout(T, c.walk_since("/workspace", &[], None, false))
        .await
        .expect("walk hung");
    let e = r.expect_err("a 2^50-byte path decoded");
    assert!(
        matches!(&e, RpcError::Protocol(m) if m.contains("bad walk answer")),
        "{e}"
    );
    println!("CHILD_OK: {e}");
}

#[test]
fn walk_answer_declaring_a_huge_path_is_refused() {
    use std::os::unix::process::CommandExt;
    let mut cmd = std::process::Command::new(std::env::current_exe().unwrap());
    cmd.args([
        "--exact",
        "rpc::client::hostile_tests::walk_bomb_child",
        "--nocapture",
        "--test-threads=1",
    ])
    .env("TRYBOXI_HOSTILE_CHILD", "1");
    // SAFETY: pre_exec runs in the forked child before exec; setrlimit is async-signal-safe.
    // The 8 GiB address-space cap keeps a regression from touching the machine's memory.
    unsafe {
        cmd.pre_exec(|| {
            let lim = libc::rlimit {
                rlim_cur: 8 << 30,
                rlim_max: 8 << 30,
            };
            if libc::setrlimit(libc::RLIMIT_AS, &lim) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    let out = cmd.output().unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success() && stdout.contains("CHILD_OK"),
        "the walk bomb took the process down ({}):\n{stdout}\n{stderr}",
        out.status
    );
}

#[tokio::test]
async fn walk_answer_over_the_answer_cap_is_refused() {
    let (c, mut g) = fake_guest().await;
    tokio::spawn(async move {
        // An answer that never ends, sent within credit; stops (and stalls) a little past the
        // cap so a regression cannot fill memory.
        let (id, _) = next_request(&mut g).await.unwrap();
        let mut credit = WINDOW;
        let mut sent = 0usize;
        while sent < MAX_ANSWER + 4 * CHUNK {
            while credit < CHUNK {
                match read_frame(&mut g).await {
                    Ok(Some(f)) if f.stream == id => {
                        if let Body::Credit(n) = f.body {
                            credit += n as usize;
                        }
                    }
                    Ok(Some(_)) => {}
                    _ => return,
                }
            }
            send(&mut g, id, Body::Data(vec![7; CHUNK])).await;
            credit -= CHUNK;
            sent += CHUNK;
        }
        ignore_all(&mut g).await;
    });
    let r = tokio::time::timeout(T * 3, c.walk("/workspace", &[]))
        .await
        .expect("an endless walk answer hung the host");
    assert!(
        matches!(&r, Err(RpcError::TooLarge { max, .. }) if *max == MAX_ANSWER as u64),
        "{r:?}"
    );
}

/// A guest that answers a read with data forever, within its credit, stopping only at 64 MiB
/// (then stalling) so the old code's unbounded collection shows as a hang, not a full memory.
async fn endless_read(mut g: UnixStream) {
    let Some((id, _)) = next_request(&mut g).await else {
        return;
    };
    let mut credit = WINDOW;
    for _ in 0..(64 << 20) / CHUNK {
        while credit < CHUNK {
            match read_frame(&mut g).await {
                Ok(Some(f)) => {
                    if let (true, Body::Credit(n)) = (f.stream == id, f.body) {
                        credit += n as usize;
                    }
                }
                _ => return,
            }
        }
        send(&mut g, id, Body::Data(vec![1; CHUNK])).await;
        credit -= CHUNK;
    }
    ignore_all(&mut g).await;
}

#[tokio::test]
async fn endless_read_stops_at_the_callers_cap() {
    let (c, g) = fake_guest().await;
    tokio::spawn(endless_read(g));
    let r = tokio::time::timeout(T, c.read_file("/dev/zero", 1 << 20))
        .await
        .expect("an endless read hung the host");
    assert!(
        matches!(&r, Err(RpcError::TooLarge { max, .. }) if *max == 1 << 20),
        "{r:?}"
    );
    // A request that outgrew its cap fails alone: the connection lives on.
    assert!(!c.is_closed());
}

/// A writer that never accepts a byte: the host's consumer of the stream is stuck on it, so
/// whatever the guest sends is held by the host until it grants credit.
struct Stuck;

impl tokio::io::AsyncWrite for Stuck {
    fn poll_write(
        self: std::pin::Pin<&mut Self>,
        _: &mut std::task::Context<'_>,
        _: &[u8],
    ) -> std::task::Poll<std::io::Result<usize>> {
        std::task::Poll::Pending
    }
    fn poll_flush(
        self: std::pin::Pin<&mut Self>,
        _: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        std::task::Poll::Pending
    }
    fn poll_shutdown(
        self: std::pin::Pin<&mut Self>,
        _: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        std::task::Poll::Pending
    }
}

/// Waits until the host closes the connection; the reason it gives.
async fn cut_off(c: &AgentClient) -> String {
    tokio::time::timeout(T, c.closed())
        .await
        .expect("the host kept a guest that broke its window");
    c.close_reason().expect("a reason")
}

#[tokio::test]
async fn data_past_the_window_cuts_the_guest_off() {
    let (c, mut g) = fake_guest().await;
    tokio::spawn(async move {
        let (id, _) = next_request(&mut g).await.unwrap();
        // Twice the window, never waiting for credit.
        for _ in 0..2 * WINDOW / CHUNK {
            send(&mut g, id, Body::Data(vec![0; CHUNK])).await;
        }
        ignore_all(&mut g).await;
    });
    let c2 = c.clone();
    let read = tokio::spawn(async move { c2.read_file_to("/f", u64::MAX, &mut Stuck).await });
    let why = cut_off(&c).await;
    assert!(why.contains("without credit"), "{why}");
    let r = tokio::time::timeout(T, c.ping()).await.unwrap();
    assert!(
        matches!(&r, Err(RpcError::Closed(m)) if m.contains("without credit")),
        "{r:?}"
    );
    read.abort();
}

#[tokio::test]
async fn exec_output_past_the_window_cuts_the_guest_off() {
    let (c, mut g) = fake_guest().await;
    tokio::spawn(async move {
        let (id, _) = next_request(&mut g).await.unwrap();
        let started = WireExecEvent::Started { exec_id: 1, pid: 2 };
        send(
            &mut g,
            id,
            Body::Exec {
                seq: 1,
                event: started,
            },
        )
        .await;
        // 4 MiB of output, never waiting for an ack.
        for seq in 2..130 {
            let event = WireExecEvent::Stdout(vec![b'x'; CHUNK]);
            send(&mut g, id, Body::Exec { seq, event }).await;
        }
        ignore_all(&mut g).await;
    });
    // Nobody reads the exec's events: the host holds what the guest sends.
    let req = ExecRequest {
        argv: vec!["yes".into()],
        ..Default::default()
    };
    // (The cut can come before `exec` returns: then it fails with the same reason.)
    let _stream = c.exec(req).await;
    let why = cut_off(&c).await;
    assert!(why.contains("unacknowledged"), "{why}");
}

#[tokio::test]
async fn answers_flooding_a_stream_cut_the_guest_off() {
    let (c, mut g) = fake_guest().await;
    tokio::spawn(async move {
        let (id, _) = next_request(&mut g).await.unwrap();
        let started = WireExecEvent::Started { exec_id: 1, pid: 2 };
        send(
            &mut g,
            id,
            Body::Exec {
                seq: 1,
                event: started,
            },
        )
        .await;
        for _ in 0..1000 {
            send(&mut g, id, Body::DataEnd).await;
        }
        ignore_all(&mut g).await;
    });
    let _stream = c
        .exec(ExecRequest {
            argv: vec!["true".into()],
            ..Default::default()
        })
        .await;
    let why = cut_off(&c).await;
    assert!(why.contains("answers on stream"), "{why}");
}

#[tokio::test]
async fn a_bad_frame_cuts_the_guest_off_with_the_reason() {
    use tokio::io::AsyncWriteExt;
    let (c, mut g) = fake_guest().await;
    // A length prefix past the 1 MiB frame limit.
    g.write_all(&(64u32 << 20).to_le_bytes()).await.unwrap();
    let why = cut_off(&c).await;
    assert!(why.contains("exceeds the 1048576-byte limit"), "{why}");
    let r = c.stat("/").await;
    assert!(
        matches!(&r, Err(RpcError::Closed(m)) if m.contains("limit")),
        "{r:?}"
    );
    // A link that merely ends is no broken rule: no reason.
    let (c, g) = fake_guest().await;
    drop(g);
    tokio::time::timeout(T, c.closed()).await.unwrap();
    assert_eq!(c.close_reason(), None);
    assert!(matches!(c.ping().await, Err(RpcError::Disconnected)));
}

/// A guest that reads everything and answers nothing.
async fn silent() -> AgentClient {
    let (c, mut g) = fake_guest().await;
    tokio::spawn(async move { ignore_all(&mut g).await });
    c.set_deadlines(Deadlines {
        reply: Duration::from_millis(300),
        per_mib: Duration::from_millis(10),
        ..Deadlines::default()
    });
    c
}

/// Runs `call` against a silent agent: it must fail with `Deadline` well before `T` and leave
/// the connection closed with that reason.
async fn times_out<F, Fut, O>(name: &str, call: F)
where
    F: FnOnce(AgentClient) -> Fut,
    Fut: std::future::Future<Output = Result<O, RpcError>>,
    O: std::fmt::Debug,
{
    let c = silent().await;
    let t = std::time::Instant::now();
    let r = tokio::time::timeout(T, call(c.clone()))
        .await
        .unwrap_or_else(|_| panic!("{name} waited forever for a silent agent"));
    assert!(
        matches!(&r, Err(RpcError::Deadline { .. })),
        "{name}: {r:?}"
    );
    assert!(
        t.elapsed() < Duration::from_secs(10),
        "{name}: {:?}",
        t.elapsed()
    );
    let why = c.close_reason().expect("closed with a reason");
    assert!(why.contains("did not answer"), "{name}: {why}");
    assert!(c.is_closed(), "{name}");
    assert!(matches!(c.ping().await, Err(RpcError::Closed(_))), "{name}");
}

#[tokio::test]
async fn a_silent_agent_fails_every_request_by_its_deadline() {
    times_out("ping", |c| async move { c.ping().await }).await;
    times_out("stat", |c| async move { c.stat("/x").await }).await;
    times_out("walk_since", |c| async move {
        c.walk_since("/workspace", &[], None, false).await
    })
    .await;
    times_out(
        "read_file",
        |c| async move { c.read_file("/x", 1 << 20).await },
    )
    .await;
    // Bigger than the window: the second chunk needs credit that never comes.
    times_out("write_file", |c| async move {
        c.write_file("/x", &vec![0; 2 * WINDOW], 0o644).await
    })
    .await;
    times_out("untar_disk", |c| async move {
        c.untar_disk("/workspace", vec![], "xfer", 100 << 20).await
    })
    .await;
    times_out("exec", |c| async move {
        c.exec(ExecRequest {
            argv: vec!["true".into()],
            ..Default::default()
        })
        .await
    })
    .await;
    times_out("resume", |c| async move { c.resume(1, 2).await }).await;
}

#[tokio::test]
async fn exec_output_has_no_deadline() {
    // A command may be silent for longer than the reply deadline: its stream waits.
    let (c, mut g) = fake_guest().await;
    let (tx, rx) = tokio::sync::oneshot::channel::<()>();
    tokio::spawn(async move {
        let (id, _) = next_request(&mut g).await.unwrap();
        let started = WireExecEvent::Started { exec_id: 1, pid: 2 };
        send(
            &mut g,
            id,
            Body::Exec {
                seq: 1,
                event: started,
            },
        )
        .await;
        let _ = rx.await;
        let exit = WireExecEvent::Exit {
            code: Some(0),
            signal: None,
            timed_out: false,
        };
        send(
            &mut g,
            id,
            Body::Exec {
                seq: 2,
                event: exit,
            },
        )
        .await;
        ignore_all(&mut g).await;
    });
    c.set_deadlines(Deadlines {
        reply: Duration::from_millis(200),
        per_mib: Duration::ZERO,
        ..Deadlines::default()
    });
    let mut s = c
        .exec(ExecRequest {
            argv: vec!["sleep".into(), "1".into()],
            ..Default::default()
        })
        .await
        .unwrap();
    assert!(matches!(
        s.next().await,
        Some(Ok(crate::rpc::ExecEvent::Started { .. }))
    ));
    tokio::time::sleep(Duration::from_millis(800)).await;
    tx.send(()).unwrap();
    let ev = tokio::time::timeout(T, s.next()).await.unwrap();
    assert!(
        matches!(
            ev,
            Some(Ok(crate::rpc::ExecEvent::Exit { code: Some(0), .. }))
        ),
        "{ev:?}"
    );
    assert!(!c.is_closed());
}

/// A guest that answers pings (and records every frame the host sends) but never answers any
/// other request.
async fn ping_only(mut g: UnixStream, seen: tokio::sync::mpsc::UnboundedSender<(u32, Body)>) {
    use crate::rpc::msg::{Reply, Request};
    while let Ok(Some(f)) = read_frame(&mut g).await {
        if f.body == Body::Request(Request::Ping) {
            send(&mut g, f.stream, Body::Reply(Reply::Pong)).await;
        }
        let _ = seen.send((f.stream, f.body));
    }
}

#[tokio::test]
async fn a_slow_agent_that_answers_pings_fails_only_the_request() {
    let (c, g) = fake_guest().await;
    let (tx, mut seen) = tokio::sync::mpsc::unbounded_channel();
    tokio::spawn(ping_only(g, tx));
    c.set_deadlines(Deadlines {
        reply: Duration::from_millis(300),
        per_mib: Duration::ZERO,
        ..Deadlines::default()
    });
    let mut slow = c.slow_requests();
    let r = tokio::time::timeout(T, c.stat("/proc/kmsg"))
        .await
        .expect("stat hung");
    assert!(
        matches!(&r, Err(RpcError::Slow { what, .. }) if what == "stat"),
        "{r:?}"
    );
    // The connection lives on: no reason, calls still work.
    assert!(!c.is_closed());
    assert_eq!(c.close_reason(), None);
    tokio::time::timeout(T, c.ping()).await.unwrap().unwrap();
    // The service hears of it.
    tokio::time::timeout(T, slow.changed())
        .await
        .unwrap()
        .unwrap();
    let msg = slow.borrow().clone().expect("a slow report");
    assert!(msg.contains("still answers pings"), "{msg}");
    // The guest is told to abandon the request (stream 1 is the stat).
    let cancelled = tokio::time::timeout(T, async {
        while let Some((stream, body)) = seen.recv().await {
            if stream == 1 && body == Body::Cancel {
                return;
            }
        }
    })
    .await;
    assert!(cancelled.is_ok(), "no Cancel for the abandoned stat");
    // Same for a read whose chunks stop coming, and a write whose credit stops coming.
    let r = tokio::time::timeout(T, c.read_file("/proc/kmsg", 1 << 20))
        .await
        .unwrap();
    assert!(matches!(&r, Err(RpcError::Slow { .. })), "{r:?}");
    let r = tokio::time::timeout(T, c.write_file("/x", &vec![0; 2 * WINDOW], 0o644))
        .await
        .unwrap();
    assert!(matches!(&r, Err(RpcError::Slow { .. })), "{r:?}");
    assert!(!c.is_closed());
}

#[tokio::test]
async fn progress_restarts_the_deadline_of_a_long_request() {
    use crate::rpc::msg::Reply;
    let (c, mut g) = fake_guest().await;
    tokio::spawn(async move {
        let (id, _) = next_request(&mut g).await.unwrap();
        // Works for 1.5 s (5 deadlines), saying so every 100 ms, then answers.
        for _ in 0..15 {
            tokio::time::sleep(Duration::from_millis(100)).await;
            send(&mut g, id, Body::Progress).await;
        }
        send(&mut g, id, Body::Reply(Reply::Done)).await;
        ignore_all(&mut g).await;
    });
    c.set_deadlines(Deadlines {
        reply: Duration::from_millis(300),
        per_mib: Duration::ZERO,
        ..Deadlines::default()
    });
    let t = std::time::Instant::now();
    let r = tokio::time::timeout(T, c.remove("/workspace/big", true))
        .await
        .unwrap();
    assert!(r.is_ok(), "{r:?}");
    assert!(t.elapsed() >= Duration::from_millis(1500));
    assert!(!c.is_closed());
}

#[tokio::test]
async fn endless_progress_fails_the_request_at_the_overall_cap() {
    use crate::rpc::msg::{Reply, Request};
    let (c, mut g) = fake_guest().await;
    tokio::spawn(async move {
        let (id, _) = next_request(&mut g).await.unwrap();
        // Says it works every 50 ms, forever, and answers pings: alive but never done. One
        // socket, two handles: a reader task (read_frame is not cancel-safe) and this writer.
        let std = g.into_std().unwrap();
        let mut r = UnixStream::from_std(std.try_clone().unwrap()).unwrap();
        let mut w = UnixStream::from_std(std).unwrap();
        let (pings, mut ping_rx) = tokio::sync::mpsc::unbounded_channel();
        tokio::spawn(async move {
            while let Ok(Some(f)) = read_frame(&mut r).await {
                if f.body == Body::Request(Request::Ping) {
                    let _ = pings.send(f.stream);
                }
            }
        });
        let mut tick = tokio::time::interval(Duration::from_millis(50));
        loop {
            tokio::select! {
                _ = tick.tick() => send(&mut w, id, Body::Progress).await,
                p = ping_rx.recv() => match p {
                    Some(stream) => send(&mut w, stream, Body::Reply(Reply::Pong)).await,
                    None => return,
                },
            }
        }
    });
    c.set_deadlines(Deadlines {
        reply: Duration::from_millis(300),
        per_mib: Duration::ZERO,
        progress_max: Duration::from_millis(1000),
    });
    let t = std::time::Instant::now();
    let r = tokio::time::timeout(T, c.remove("/workspace/big", true))
        .await
        .expect("endless progress kept the request past its cap");
    assert!(matches!(&r, Err(RpcError::Slow { .. })), "{r:?}");
    assert!(
        t.elapsed() >= Duration::from_millis(1000),
        "{:?}",
        t.elapsed()
    );
    assert!(
        !c.is_closed(),
        "an agent that answers pings stays connected"
    );
}

#[tokio::test]
async fn progress_without_an_answer_still_meets_a_deadline_once_it_stops() {
    let (c, mut g) = fake_guest().await;
    tokio::spawn(async move {
        let (id, _) = next_request(&mut g).await.unwrap();
        for _ in 0..5 {
            tokio::time::sleep(Duration::from_millis(100)).await;
            send(&mut g, id, Body::Progress).await;
        }
        ignore_all(&mut g).await;
    });
    c.set_deadlines(Deadlines {
        reply: Duration::from_millis(300),
        per_mib: Duration::ZERO,
        ..Deadlines::default()
    });
    let r = tokio::time::timeout(T, c.remove("/workspace/big", true))
        .await
        .expect("progress that stopped kept the request forever");
    // It answers no ping either: cut off.
    assert!(matches!(&r, Err(RpcError::Deadline { .. })), "{r:?}");
}

#[tokio::test]
async fn empty_data_frames_cost_window() {
    let (c, mut g) = fake_guest().await;
    tokio::spawn(async move {
        let (id, _) = next_request(&mut g).await.unwrap();
        // One byte the host's consumer gets stuck on, then empty frames: they cost no bytes,
        // so without a per-frame cost each one is queued on the host for free. Bounded so a
        // regression shows as a hang.
        send(&mut g, id, Body::Data(vec![1])).await;
        for _ in 0..100_000 {
            send(&mut g, id, Body::Data(Vec::new())).await;
        }
        ignore_all(&mut g).await;
    });
    let c2 = c.clone();
    let read = tokio::spawn(async move { c2.read_file_to("/f", u64::MAX, &mut Stuck).await });
    let why = cut_off(&c).await;
    assert!(why.contains("without credit"), "{why}");
    read.abort();
}
