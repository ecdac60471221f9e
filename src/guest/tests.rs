//! Host-only tests of the real agent code (real processes, real files) against the real
//! host client, over in-memory pipes. No VM, no init/mount code.

use super::exec::{ExecConfig, SPOOL_CAP};
use super::reaper::ReapMode;
use super::server::{Agent, ServeEnd, ServeError, ShutdownMode, serve};
use crate::rpc::frame::{MAX_FRAME, encode, read_frame};
use crate::rpc::msg::{Body, Frame, PROTOCOL_VERSION};
use crate::rpc::{AgentClient, ExecEvent, ExecRequest, ExecStream, FileKind, PtySize, RpcError};
use sha2::{Digest, Sha256};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::io::AsyncWriteExt;
use tokio::task::JoinHandle;

const T: Duration = Duration::from_secs(60);

pub(super) fn agent() -> Arc<Agent> {
    let cfg = ExecConfig {
        default_cwd: "/".into(),
        base_env: None,
        spawn_in_cwd: false,
    };
    Agent::new(cfg, ReapMode::OwnOnly, ShutdownMode::Return).unwrap()
}

/// A client and an agent joined by a cuttable link (aborting the returned task is the VM dying).
pub(super) async fn link(
    agent: &Arc<Agent>,
) -> (
    AgentClient,
    JoinHandle<()>,
    JoinHandle<Result<ServeEnd, ServeError>>,
) {
    let (host, mut host_far) = tokio::io::duplex(256 * 1024);
    let (mut guest_far, guest) = tokio::io::duplex(256 * 1024);
    let wire = tokio::spawn(async move {
        let _ = tokio::io::copy_bidirectional(&mut host_far, &mut guest_far).await;
    });
    let server = tokio::spawn(serve(agent.clone(), guest));
    let client = tokio::time::timeout(T, AgentClient::connect(host))
        .await
        .unwrap()
        .unwrap();
    (client, wire, server)
}

fn sh(s: &str) -> ExecRequest {
    ExecRequest {
        shell: Some(s.into()),
        ..Default::default()
    }
}

#[derive(Debug, Default)]
pub(super) struct Outcome {
    pub(super) out: Vec<u8>,
    pub(super) err: Vec<u8>,
    pub(super) code: Option<i32>,
    pub(super) signal: Option<i32>,
    pub(super) timed_out: bool,
}

async fn drain(s: &mut ExecStream, o: &mut Outcome) -> Result<(), RpcError> {
    while let Some(ev) = tokio::time::timeout(T, s.next())
        .await
        .expect("exec stream stalled")
    {
        match ev? {
            ExecEvent::Started { .. } => {}
            ExecEvent::Stdout(b) => o.out.extend(b),
            ExecEvent::Stderr(b) => o.err.extend(b),
            ExecEvent::Exit {
                code,
                signal,
                timed_out,
            } => {
                (o.code, o.signal, o.timed_out) = (code, signal, timed_out);
            }
        }
    }
    Ok(())
}

pub(super) async fn run(c: &AgentClient, req: ExecRequest) -> Outcome {
    let mut s = c.exec(req).await.unwrap();
    let mut o = Outcome::default();
    drain(&mut s, &mut o).await.unwrap();
    o
}

#[tokio::test]
async fn exec_echo_round_trips() {
    let a = agent();
    let (c, _w, _s) = link(&a).await;
    let o = run(
        &c,
        ExecRequest {
            argv: vec!["echo".into(), "hello world".into()],
            ..Default::default()
        },
    )
    .await;
    assert_eq!(o.out, b"hello world\n");
    assert_eq!(o.code, Some(0));
    assert!(c.ping().await.unwrap() < T);
}

#[tokio::test]
async fn exit_codes_and_signals_are_reported() {
    let a = agent();
    let (c, _w, _s) = link(&a).await;
    let o = run(&c, sh("exit 42")).await;
    assert_eq!((o.code, o.signal, o.timed_out), (Some(42), None, false));
    let o = run(&c, sh("kill -TERM $$")).await;
    assert_eq!((o.code, o.signal), (None, Some(libc::SIGTERM)));
}

#[tokio::test]
async fn spawn_failure_is_a_remote_error() {
    let a = agent();
    let (c, _w, _s) = link(&a).await;
    let e = c
        .exec(ExecRequest {
            argv: vec!["/no/such/binary".into()],
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert!(
        matches!(e, RpcError::Remote(ref r) if r.kind == crate::rpc::msg::ErrorKind::NotFound),
        "{e}"
    );
}

#[tokio::test]
async fn stdout_and_stderr_are_separate() {
    let a = agent();
    let (c, _w, _s) = link(&a).await;
    let o = run(&c, sh("echo out; echo err >&2; echo out2")).await;
    assert_eq!(o.out, b"out\nout2\n");
    assert_eq!(o.err, b"err\n");
}

#[tokio::test]
async fn env_cwd_and_stdin_reach_the_command() {
    let a = agent();
    let (c, _w, _s) = link(&a).await;
    let dir = tempfile::tempdir().unwrap();
    let cwd = dir
        .path()
        .canonicalize()
        .unwrap()
        .to_string_lossy()
        .into_owned();
    let mut req = sh("printf '%s|' \"$FOO\"; pwd; cat");
    req.env = vec![("FOO".into(), "bar baz".into())];
    req.cwd = Some(cwd.clone());
    req.stdin = Some(b"from stdin".to_vec());
    let o = run(&c, req).await;
    assert_eq!(
        String::from_utf8(o.out).unwrap(),
        format!("bar baz|{cwd}\nfrom stdin")
    );
}

#[tokio::test]
async fn stdin_can_be_streamed_and_closed() {
    let a = agent();
    let (c, _w, _s) = link(&a).await;
    let mut req = sh("wc -c");
    req.keep_stdin_open = true;
    let mut s = c.exec(req).await.unwrap();
    let chunk = vec![b'x'; 100_000];
    for _ in 0..10 {
        s.write_stdin(&chunk).await.unwrap();
    }
    s.close_stdin().await.unwrap();
    let mut o = Outcome::default();
    drain(&mut s, &mut o).await.unwrap();
    assert_eq!(String::from_utf8(o.out).unwrap().trim(), "1000000");
}

fn gone(pid: i32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Err(_) => true,
        // A zombie waiting for its new parent to reap it is dead too.
        Ok(s) => s
            .rsplit(')')
            .next()
            .is_some_and(|r| r.trim_start().starts_with('Z')),
    }
}

#[tokio::test]
async fn timeout_kills_the_whole_process_group() {
    let a = agent();
    let (c, _w, _s) = link(&a).await;
    let mut req = sh("sleep 100 & echo $!; sleep 100");
    req.timeout = Some(Duration::from_millis(500));
    let t0 = Instant::now();
    let o = run(&c, req).await;
    assert!(o.timed_out);
    assert_eq!(o.signal, Some(libc::SIGKILL));
    assert!(t0.elapsed() < Duration::from_secs(20));
    let bg: i32 = String::from_utf8(o.out).unwrap().trim().parse().unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    while !gone(bg) {
        assert!(
            Instant::now() < deadline,
            "background sleep {bg} survived the timeout"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test]
async fn kill_request_signals_the_process_group() {
    let a = agent();
    let (c, _w, _s) = link(&a).await;
    let mut s = c.exec(sh("echo ready; sleep 100")).await.unwrap();
    loop {
        match tokio::time::timeout(T, s.next())
            .await
            .unwrap()
            .unwrap()
            .unwrap()
        {
            ExecEvent::Stdout(b) if b == b"ready\n" => break,
            _ => {}
        }
    }
    s.kill(libc::SIGTERM).await.unwrap();
    let mut o = Outcome::default();
    drain(&mut s, &mut o).await.unwrap();
    assert_eq!(o.signal, Some(libc::SIGTERM));
}

fn seq_output(n: u32) -> Vec<u8> {
    let mut v = Vec::new();
    for i in 1..=n {
        v.extend_from_slice(format!("{i}\n").as_bytes());
    }
    v
}

#[tokio::test]
async fn ten_megabytes_of_output_arrive_intact() {
    let a = agent();
    let (c, _w, _s) = link(&a).await;
    let t0 = Instant::now();
    let o = run(&c, sh("seq 1 1500000")).await;
    let took = t0.elapsed();
    let expected = seq_output(1_500_000);
    assert!(expected.len() > 10_000_000);
    assert_eq!(o.out.len(), expected.len());
    assert_eq!(Sha256::digest(&o.out), Sha256::digest(&expected));
    eprintln!("10.9 MB of exec output in {took:?}");
}

#[tokio::test]
async fn binary_output_and_files_are_intact() {
    let a = agent();
    let (c, _w, _s) = link(&a).await;
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("bin").to_string_lossy().into_owned();
    let data: Vec<u8> = (0..300_000u32).map(|i| (i * 7 + i / 256) as u8).collect();
    c.write_file(&path, &data, 0o640).await.unwrap();
    let o = run(
        &c,
        ExecRequest {
            argv: vec!["cat".into(), path.clone()],
            ..Default::default()
        },
    )
    .await;
    assert_eq!(o.out, data);
    assert_eq!(c.read_file(&path, u64::MAX).await.unwrap(), data);
    let st = c.stat(&path).await.unwrap();
    assert_eq!(
        (st.kind, st.size, st.mode),
        (FileKind::File, data.len() as u64, 0o640)
    );
}

/// A file swapped for a symlink to `/dev/zero` (or a FIFO, or the device itself) between the
/// host's walk and its read gives an error at once, not endless bytes or a hang.
#[tokio::test]
async fn read_file_follows_no_symlink_and_reads_only_regular_files() {
    let a = agent();
    let (c, _w, _s) = link(&a).await;
    let dir = tempfile::tempdir().unwrap();
    let p = |n: &str| dir.path().join(n).to_string_lossy().into_owned();
    std::fs::write(p("real"), b"x").unwrap();
    std::os::unix::fs::symlink("/dev/zero", p("zero")).unwrap();
    std::os::unix::fs::symlink(p("real"), p("to-real")).unwrap();
    nix::unistd::mkfifo(p("fifo").as_str(), nix::sys::stat::Mode::S_IRWXU).unwrap();
    for bad in [p("zero"), p("to-real"), p("fifo"), "/dev/zero".into()] {
        let r = tokio::time::timeout(Duration::from_secs(5), c.read_file(&bad, 1 << 20)).await;
        let r = r.unwrap_or_else(|_| panic!("reading {bad} does not end"));
        assert!(matches!(r, Err(RpcError::Remote(_))), "{bad}: {r:?}");
    }
    assert_eq!(c.read_file(&p("real"), 1 << 20).await.unwrap(), b"x");
}

#[tokio::test]
async fn file_operations_work_and_reject_relative_paths() {
    let a = agent();
    let (c, _w, _s) = link(&a).await;
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().to_string_lossy().into_owned();
    c.mkdir(&format!("{root}/a/b/c"), 0o755).await.unwrap();
    c.write_file(&format!("{root}/a/b/f.txt"), b"hi", 0o600)
        .await
        .unwrap();
    c.write_file(&format!("{root}/a/b/f.txt"), b"replaced", 0o600)
        .await
        .unwrap();
    assert_eq!(
        c.read_file(&format!("{root}/a/b/f.txt"), u64::MAX)
            .await
            .unwrap(),
        b"replaced"
    );
    let names: Vec<(String, FileKind)> = c
        .list(&format!("{root}/a/b"))
        .await
        .unwrap()
        .into_iter()
        .map(|e| (e.name, e.stat.kind))
        .collect();
    assert_eq!(
        names,
        vec![
            ("c".into(), FileKind::Dir),
            ("f.txt".into(), FileKind::File)
        ]
    );
    assert!(c.remove(&format!("{root}/a"), false).await.is_err());
    c.remove(&format!("{root}/a"), true).await.unwrap();
    let e = c.stat(&format!("{root}/a")).await.unwrap_err();
    assert!(matches!(e, RpcError::Remote(ref r) if r.kind == crate::rpc::msg::ErrorKind::NotFound));
    for bad in ["relative/x", "", "./x"] {
        assert!(matches!(
            c.read_file(bad, u64::MAX).await,
            Err(RpcError::Remote(_))
        ));
        assert!(matches!(
            c.write_file(bad, b"x", 0o644).await,
            Err(RpcError::Remote(_))
        ));
        assert!(matches!(c.stat(bad).await, Err(RpcError::Remote(_))));
    }
    assert!(matches!(
        c.read_file(&format!("{root}/missing"), u64::MAX).await,
        Err(RpcError::Remote(_))
    ));
}

#[tokio::test]
async fn twenty_concurrent_execs() {
    let a = agent();
    let (c, _w, _s) = link(&a).await;
    let mut tasks = Vec::new();
    for i in 0..20 {
        let c = c.clone();
        tasks.push(tokio::spawn(async move {
            let o = run(
                &c,
                sh(&format!(
                    "sleep 0.2; echo start{i}; seq 1 {}; echo end{i} >&2",
                    1000 * i
                )),
            )
            .await;
            (i, o)
        }));
    }
    for t in tasks {
        let (i, o) = t.await.unwrap();
        let mut expected = format!("start{i}\n").into_bytes();
        expected.extend(seq_output(1000 * i));
        assert_eq!(o.out, expected, "exec {i}");
        assert_eq!(o.err, format!("end{i}\n").into_bytes());
        assert_eq!(o.code, Some(0));
    }
    // Every exec was acknowledged to the end, so the agent holds none of them any more.
    let deadline = Instant::now() + T;
    while a.execs.len() > 0 {
        assert!(
            Instant::now() < deadline,
            "{} execs still held",
            a.execs.len()
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

async fn read_until(s: &mut ExecStream, acc: &mut Vec<u8>, needle: &str) {
    while !String::from_utf8_lossy(acc).contains(needle) {
        match tokio::time::timeout(T, s.next())
            .await
            .expect("pty output stalled")
        {
            Some(Ok(ExecEvent::Stdout(b))) => acc.extend(b),
            Some(Ok(_)) => {}
            other => panic!(
                "stream ended before {needle:?}: {other:?}, got {:?}",
                String::from_utf8_lossy(acc)
            ),
        }
    }
}

#[tokio::test]
async fn pty_mode_sees_a_tty_and_resize_works() {
    let a = agent();
    let (c, _w, _s) = link(&a).await;
    let mut req =
        sh("test -t 0 && test -t 1 && echo IS_A_TTY; stty size; read x; stty size; echo DONE");
    req.pty = Some(PtySize { rows: 24, cols: 80 });
    let mut s = c.exec(req).await.unwrap();
    let mut acc = Vec::new();
    read_until(&mut s, &mut acc, "24 80").await;
    assert!(String::from_utf8_lossy(&acc).contains("IS_A_TTY"));
    s.resize(40, 100).await.unwrap();
    s.write_stdin(b"\n").await.unwrap();
    read_until(&mut s, &mut acc, "DONE").await;
    assert!(
        String::from_utf8_lossy(&acc).contains("40 100"),
        "{:?}",
        String::from_utf8_lossy(&acc)
    );
    let mut o = Outcome::default();
    drain(&mut s, &mut o).await.unwrap();
    assert_eq!(o.code, Some(0));
}

#[tokio::test]
async fn big_file_transfer_does_not_starve_an_exec() {
    let a = agent();
    let (c, _w, _s) = link(&a).await;
    let dir = tempfile::tempdir().unwrap();
    let big = dir.path().join("big");
    std::fs::write(&big, vec![0xabu8; 64 << 20]).unwrap();
    let big = big.to_string_lossy().into_owned();
    let c2 = c.clone();
    let t0 = Instant::now();
    let transfer = tokio::spawn(async move {
        let d = c2.read_file(&big, u64::MAX).await.unwrap();
        (d.len(), t0.elapsed())
    });
    // Wait until the transfer is really flowing, then run a command next to it.
    tokio::time::sleep(Duration::from_millis(50)).await;
    let t1 = Instant::now();
    let o = run(&c, sh("echo alive")).await;
    let exec_took = t1.elapsed();
    let exec_done = t0.elapsed();
    assert_eq!(o.out, b"alive\n");
    let (len, transfer_took) = transfer.await.unwrap();
    assert_eq!(len, 64 << 20);
    eprintln!("exec next to a 64 MiB read: {exec_took:?}; transfer {transfer_took:?}");
    assert!(
        exec_done < transfer_took,
        "the exec finished only after the transfer"
    );
}

#[tokio::test]
async fn connection_drop_ends_pending_calls_with_disconnected() {
    let a = agent();
    let (c, wire, _s) = link(&a).await;
    let mut s = c.exec(sh("sleep 100")).await.unwrap();
    assert!(matches!(
        s.next().await,
        Some(Ok(ExecEvent::Started { .. }))
    ));
    let (exec_id, from) = (s.exec_id(), s.next_seq());
    let pending = tokio::spawn(async move { s.next().await });
    wire.abort();
    let r = tokio::time::timeout(Duration::from_secs(10), pending)
        .await
        .unwrap()
        .unwrap();
    assert!(matches!(r, Some(Err(RpcError::Disconnected))), "{r:?}");
    assert!(matches!(c.ping().await, Err(RpcError::Disconnected)));
    assert!(matches!(
        c.exec(sh("true")).await,
        Err(RpcError::Disconnected)
    ));
    assert!(matches!(
        c.read_file("/etc/hostname", u64::MAX).await,
        Err(RpcError::Disconnected)
    ));
    // The command survives the drop: reattach and stop it.
    let (c2, _w2, _s2) = link(&a).await;
    let mut s = c2.resume(exec_id, from).await.unwrap();
    s.kill(libc::SIGKILL).await.unwrap();
    let mut o = Outcome::default();
    drain(&mut s, &mut o).await.unwrap();
    assert_eq!(o.signal, Some(libc::SIGKILL));
}

#[tokio::test]
async fn spool_replays_output_after_reconnect_without_loss() {
    let a = agent();
    let (c, wire, _s) = link(&a).await;
    let mut s = c.exec(sh("seq 1 1500000")).await.unwrap();
    let mut o = Outcome::default();
    while o.out.len() < 100_000 {
        if let Some(Ok(ExecEvent::Stdout(b))) = tokio::time::timeout(T, s.next()).await.unwrap() {
            o.out.extend(b);
        }
    }
    wire.abort();
    let tail = drain(&mut s, &mut o).await;
    assert!(matches!(tail, Err(RpcError::Disconnected)));
    let (exec_id, from) = (s.exec_id(), s.next_seq());
    drop((s, c));
    // With nobody acknowledging, the spool fills up to its cap and the pipes stop being read.
    let exec = a.execs.get(exec_id).unwrap();
    let deadline = Instant::now() + T;
    while exec.spooled_bytes() < SPOOL_CAP {
        assert!(
            Instant::now() < deadline,
            "spool never filled: {}",
            exec.spooled_bytes()
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert!(exec.spooled_bytes() <= SPOOL_CAP + 2 * (crate::rpc::frame::CHUNK + 64));
    drop(exec);
    let (c2, _w2, _s2) = link(&a).await;
    // Asking for what was already acknowledged is refused.
    assert!(c2.resume(exec_id, 1).await.is_err());
    let mut s2 = c2.resume(exec_id, from).await.unwrap();
    drain(&mut s2, &mut o).await.unwrap();
    let expected = seq_output(1_500_000);
    assert_eq!(o.out.len(), expected.len());
    assert_eq!(Sha256::digest(&o.out), Sha256::digest(&expected));
    assert_eq!(o.code, Some(0));
}

async fn raw_hello(io: &mut tokio::io::DuplexStream, protocol: u32) -> Frame {
    let hello = Frame {
        stream: 0,
        body: Body::Hello {
            protocol,
            version: "test".into(),
            nonce: 7,
        },
    };
    io.write_all(&encode(&hello).unwrap()).await.unwrap();
    read_frame(io).await.unwrap().unwrap()
}

#[tokio::test]
async fn oversize_and_garbage_frames_are_rejected_by_the_agent() {
    let a = agent();
    let (mut h, g) = tokio::io::duplex(1 << 16);
    let server = tokio::spawn(serve(a.clone(), g));
    assert!(matches!(
        raw_hello(&mut h, PROTOCOL_VERSION).await.body,
        Body::HelloAck { .. }
    ));
    h.write_all(&((MAX_FRAME as u32) + 1).to_le_bytes())
        .await
        .unwrap();
    let r = tokio::time::timeout(T, server).await.unwrap().unwrap();
    assert!(
        matches!(
            r,
            Err(ServeError::Frame(crate::rpc::FrameError::TooLarge(_)))
        ),
        "{r:?}"
    );

    let (mut h, g) = tokio::io::duplex(1 << 16);
    let server = tokio::spawn(serve(a.clone(), g));
    raw_hello(&mut h, PROTOCOL_VERSION).await;
    h.write_all(&[5, 0, 0, 0, 0xff, 0xff, 0xff, 0xff, 0xff])
        .await
        .unwrap();
    let r = tokio::time::timeout(T, server).await.unwrap().unwrap();
    assert!(matches!(r, Err(ServeError::Frame(_))), "{r:?}");
}

#[tokio::test]
async fn version_mismatch_is_a_clear_error_on_both_sides() {
    let a = agent();
    let (mut h, g) = tokio::io::duplex(1 << 16);
    let server = tokio::spawn(serve(a, g));
    let ack = raw_hello(&mut h, PROTOCOL_VERSION + 1).await;
    assert!(matches!(
        ack.body,
        Body::HelloAck {
            protocol: PROTOCOL_VERSION,
            ..
        }
    ));
    let r = tokio::time::timeout(T, server).await.unwrap().unwrap();
    assert!(matches!(r, Err(ServeError::Version(_))));

    // A fake guest that answers with another protocol version.
    let (h, mut g) = tokio::io::duplex(1 << 16);
    tokio::spawn(async move {
        let Ok(Some(Frame {
            body: Body::Hello { nonce, .. },
            ..
        })) = read_frame(&mut g).await
        else {
            panic!("no Hello from the client");
        };
        let ack = Frame {
            stream: 0,
            body: Body::HelloAck {
                protocol: 999,
                version: "old".into(),
                nonce,
            },
        };
        let _ = g.write_all(&encode(&ack).unwrap()).await;
        let _ = read_frame(&mut g).await;
    });
    let e = AgentClient::connect(h).await.unwrap_err();
    assert!(
        matches!(e, RpcError::VersionMismatch { theirs: 999, .. }),
        "{e}"
    );
}

#[tokio::test]
async fn shutdown_is_answered() {
    let a = agent();
    let (c, _w, server) = link(&a).await;
    c.shutdown().await.unwrap();
    let r = tokio::time::timeout(T, server).await.unwrap().unwrap();
    assert!(matches!(r, Ok(ServeEnd::Shutdown)));
}

#[tokio::test]
async fn connect_unix_retries_until_the_agent_answers() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("agent.sock");
    let a = agent();
    let p = path.clone();
    tokio::spawn(async move {
        // The socket appears only after the client has started trying.
        tokio::time::sleep(Duration::from_millis(300)).await;
        let l = tokio::net::UnixListener::bind(&p).unwrap();
        let (s, _) = l.accept().await.unwrap();
        let _ = serve(a, s).await;
    });
    let c = AgentClient::connect_unix(&path, T).await.unwrap();
    c.ping().await.unwrap();
    let missing = dir.path().join("nobody.sock");
    let e = AgentClient::connect_unix(&missing, Duration::from_millis(200))
        .await
        .unwrap_err();
    assert!(matches!(e, RpcError::Timeout(_)));
}

#[tokio::test]
async fn a_second_hello_on_the_same_stream_starts_over() {
    let a = agent();
    let (mut h, g) = tokio::io::duplex(1 << 16);
    let server = tokio::spawn(serve(a, g));
    raw_hello(&mut h, PROTOCOL_VERSION).await;
    let hello = Frame {
        stream: 0,
        body: Body::Hello {
            protocol: PROTOCOL_VERSION,
            version: "again".into(),
            nonce: 8,
        },
    };
    h.write_all(&encode(&hello).unwrap()).await.unwrap();
    let r = tokio::time::timeout(T, server).await.unwrap().unwrap();
    assert!(
        matches!(r, Ok(ServeEnd::Rehello(ref f)) if *f == hello),
        "{r:?}"
    );
}

#[tokio::test]
async fn an_abandoned_handshake_closes_its_connection() {
    // A guest that never answers: the client gives up and must really hang up.
    let (h, mut g) = tokio::io::duplex(1 << 16);
    let attempt = tokio::time::timeout(Duration::from_millis(200), AgentClient::connect(h)).await;
    assert!(attempt.is_err());
    let hello = read_frame(&mut g).await.unwrap().unwrap();
    assert!(matches!(hello.body, Body::Hello { .. }));
    let eof = tokio::time::timeout(T, read_frame(&mut g))
        .await
        .unwrap()
        .unwrap();
    assert!(eof.is_none(), "the connection stayed open");
}

#[tokio::test]
async fn untar_replaces_deletes_and_walk_reports_the_tree() {
    let a = agent();
    let (c, _w, _s) = link(&a).await;
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().join("ws");
    std::fs::create_dir_all(root.join("old/deep")).unwrap();
    std::fs::write(root.join("old/deep/x"), b"x").unwrap();
    std::fs::write(root.join("gone"), b"bye").unwrap();
    std::fs::create_dir_all(root.join(".git/objects")).unwrap();
    let mut b = tar::Builder::new(Vec::new());
    let mut h = tar::Header::new_gnu();
    h.set_size(5);
    h.set_mode(0o755);
    h.set_mtime(1_700_000_000);
    h.set_entry_type(tar::EntryType::Regular);
    b.append_data(&mut h, "src/run.sh", &b"hello"[..]).unwrap();
    let mut l = tar::Header::new_gnu();
    l.set_entry_type(tar::EntryType::Symlink);
    l.set_size(0);
    b.append_link(&mut l, "link", "src/run.sh").unwrap();
    let tar = b.into_inner().unwrap();
    let rootp = root.to_str().unwrap();
    c.untar(
        rootp,
        vec!["old".into(), "gone".into(), "never-there".into()],
        &tar,
    )
    .await
    .unwrap();
    assert_eq!(std::fs::read(root.join("src/run.sh")).unwrap(), b"hello");
    assert!(!root.join("old").exists() && !root.join("gone").exists());
    // `..` in the delete list is refused.
    let e = c.untar(rootp, vec!["../x".into()], &[]).await.unwrap_err();
    assert!(e.to_string().contains("not a plain relative path"), "{e}");
    // A VM-made symlink where the host has a directory is replaced, never written through.
    let outside = dir.path().join("outside");
    std::fs::create_dir_all(&outside).unwrap();
    std::os::unix::fs::symlink(&outside, root.join("sub")).unwrap();
    let mut b = tar::Builder::new(Vec::new());
    let mut h = tar::Header::new_gnu();
    h.set_size(2);
    h.set_mode(0o644);
    h.set_entry_type(tar::EntryType::Regular);
    b.append_data(&mut h, "sub/f", &b"hi"[..]).unwrap();
    c.untar(rootp, vec![], &b.into_inner().unwrap())
        .await
        .unwrap();
    assert!(
        std::fs::symlink_metadata(root.join("sub"))
            .unwrap()
            .is_dir()
    );
    assert_eq!(std::fs::read(root.join("sub/f")).unwrap(), b"hi");
    assert!(!outside.join("f").exists());
    std::fs::remove_dir_all(root.join("sub")).unwrap();
    let w = c.walk(rootp, &[".git".into()]).await.unwrap();
    let names: Vec<&str> = w.iter().map(|e| e.path.as_str()).collect();
    assert_eq!(names, ["link", "src", "src/run.sh"]);
    let f = &w[2];
    assert_eq!(
        (f.kind, f.size, f.mode, f.mtime, f.mtime_nsec),
        (FileKind::File, 5, 0o755, 1_700_000_000, 0)
    );
    assert_eq!(w[0].link.as_deref(), Some("src/run.sh"));
}

#[test]
fn programs_are_resolved_like_execvp_or_left_to_it() {
    use std::os::unix::fs::PermissionsExt;
    let d = tempfile::tempdir().unwrap();
    let (a, b) = (d.path().join("a"), d.path().join("b"));
    std::fs::create_dir_all(&a).unwrap();
    std::fs::create_dir_all(&b).unwrap();
    let write = |p: &std::path::Path, mode: u32| {
        std::fs::write(p, "#!/bin/sh\n").unwrap();
        std::fs::set_permissions(p, std::fs::Permissions::from_mode(mode)).unwrap();
    };
    write(&a.join("tool"), 0o644); // not executable: skipped
    write(&b.join("tool"), 0o755);
    std::fs::create_dir_all(a.join("dir")).unwrap(); // a directory: skipped
    write(&b.join("dir"), 0o755);
    let path = format!("{}:{}", a.display(), b.display());
    let r = super::exec::resolve_program;
    assert_eq!(r("tool", Some(&path)), Some(b.join("tool")));
    assert_eq!(r("dir", Some(&path)), Some(b.join("dir")));
    // Names with a slash, unknown names, relative PATH entries and no PATH: left to execvp.
    assert_eq!(r("./tool", Some(&path)), None);
    assert_eq!(r("nope", Some(&path)), None);
    assert_eq!(r("tool", Some("rel/dir::")), None);
    assert_eq!(r("tool", None), None);
    assert_eq!(r("", Some(&path)), None);
}
