//! The agent holds the host to its window too: a host that sends more `Data` than its credit
//! allows (here to an exec that does not read its stdin) ends the connection instead of filling
//! the guest's memory. The real host client never does that (`guest::tests` feed stdin and write
//! files through the real client with the check on).

use super::exec::ExecConfig;
use super::reaper::ReapMode;
use super::server::{Agent, ServeError, ShutdownMode, serve};
use crate::rpc::WINDOW;
use crate::rpc::frame::{CHUNK, encode, read_frame};
use crate::rpc::msg::{Body, ExecSpec, Frame, PROTOCOL_VERSION, Request, WireExecEvent};
use std::time::Duration;
use tokio::io::AsyncWriteExt;

const T: Duration = Duration::from_secs(30);

/// Runs a `sleep` that never reads its stdin on stream 1 of a raw connection, sends it
/// `stdin` (a list of `Data` bodies, without waiting for credit), and returns how the agent
/// ended the connection.
async fn flood_stdin(
    stdin: impl Iterator<Item = Vec<u8>>,
) -> Result<super::server::ServeEnd, ServeError> {
    let cfg = ExecConfig {
        default_cwd: "/".into(),
        base_env: None,
        spawn_in_cwd: false,
    };
    let a = Agent::new(cfg, ReapMode::OwnOnly, ShutdownMode::Return).unwrap();
    let (mut h, g) = tokio::io::duplex(4 << 20);
    let server = tokio::spawn(serve(a, g));
    let send = |stream, body| encode(&Frame { stream, body }).unwrap();
    let hello = Body::Hello {
        protocol: PROTOCOL_VERSION,
        version: "hostile host".into(),
        nonce: 1,
    };
    h.write_all(&send(0, hello)).await.unwrap();
    let exec = Request::Exec(ExecSpec {
        argv: vec!["sleep".into(), "30".into()],
        ..Default::default()
    });
    h.write_all(&send(1, Body::Request(exec))).await.unwrap();
    let mut pid = None;
    while pid.is_none() {
        let f = tokio::time::timeout(T, read_frame(&mut h))
            .await
            .unwrap()
            .unwrap()
            .unwrap();
        if let Body::Exec {
            event: WireExecEvent::Started { pid: p, .. },
            ..
        } = f.body
        {
            pid = Some(p);
        }
    }
    for d in stdin {
        if h.write_all(&send(1, Body::Data(d))).await.is_err() {
            break;
        }
    }
    let r = tokio::time::timeout(T, server)
        .await
        .expect("the agent queued whatever the host sent")
        .unwrap();
    // SAFETY: kill(2) on the sleep this test started (a plain pid, never 0 or negative).
    unsafe { libc::kill(pid.unwrap() as i32, libc::SIGKILL) };
    r
}

/// Empty `Data` frames cost no bytes: without a per-frame cost a host could queue them in the
/// agent for free behind a command that does not read its stdin.
#[tokio::test]
async fn a_host_flooding_empty_data_is_cut_off_by_the_agent() {
    // Half a window of real bytes (the pipe takes 64 KiB, the rest waits), then empty frames
    // (bounded, so a regression shows as a connection that stays up).
    let stdin = std::iter::repeat_n(vec![b'x'; CHUNK], WINDOW / 2 / CHUNK)
        .chain(std::iter::repeat_n(Vec::new(), 200_000));
    let r = flood_stdin(stdin).await;
    assert!(
        matches!(&r, Err(ServeError::Protocol(m)) if m.contains("window")),
        "{r:?}"
    );
}

#[tokio::test]
async fn a_host_past_its_window_is_cut_off_by_the_agent() {
    let cfg = ExecConfig {
        default_cwd: "/".into(),
        base_env: None,
        spawn_in_cwd: false,
    };
    let a = Agent::new(cfg, ReapMode::OwnOnly, ShutdownMode::Return).unwrap();
    let (mut h, g) = tokio::io::duplex(4 << 20);
    let server = tokio::spawn(serve(a, g));
    let send = |stream, body| encode(&Frame { stream, body }).unwrap();
    let hello = Body::Hello {
        protocol: PROTOCOL_VERSION,
        version: "hostile host".into(),
        nonce: 1,
    };
    h.write_all(&send(0, hello)).await.unwrap();
    let exec = Request::Exec(ExecSpec {
        argv: vec!["sleep".into(), "30".into()],
        ..Default::default()
    });
    h.write_all(&send(1, Body::Request(exec))).await.unwrap();
    // The HelloAck, then the exec's Started (its pid, to kill it at the end).
    let mut pid = None;
    while pid.is_none() {
        let f = tokio::time::timeout(T, read_frame(&mut h))
            .await
            .unwrap()
            .unwrap()
            .unwrap();
        if let Body::Exec {
            event: WireExecEvent::Started { pid: p, .. },
            ..
        } = f.body
        {
            pid = Some(p);
        }
    }
    // Four windows of stdin for a command that never reads it, without waiting for credit.
    for _ in 0..4 * WINDOW / CHUNK {
        if h.write_all(&send(1, Body::Data(vec![b'x'; CHUNK])))
            .await
            .is_err()
        {
            break;
        }
    }
    let r = tokio::time::timeout(T, server)
        .await
        .expect("the agent queued whatever the host sent")
        .unwrap();
    // SAFETY: kill(2) on the sleep this test started (a plain pid, never 0 or negative).
    unsafe { libc::kill(pid.unwrap() as i32, libc::SIGKILL) };
    assert!(
        matches!(&r, Err(ServeError::Protocol(m)) if m.contains("window")),
        "{r:?}"
    );
}
