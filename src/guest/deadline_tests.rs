//! Deadlines against the real agent (in-process, over in-memory pipes): long but legitimate work
//! reports progress and succeeds under a deadline shorter than the work; a request stuck inside
//! an abandoned read is cancelled, releasing its file. (A request stuck in the guest failing
//! alone is `rpc::client::hostile_tests::a_slow_agent_that_answers_pings_fails_only_the_request`.)

use super::exec::ExecConfig;
use super::reaper::ReapMode;
use super::server::{Agent, ShutdownMode, serve};
use crate::rpc::{AgentClient, Deadlines, RpcError};
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

const T: Duration = Duration::from_secs(60);

async fn client() -> AgentClient {
    let cfg = ExecConfig {
        default_cwd: "/".into(),
        base_env: None,
        spawn_in_cwd: false,
    };
    let agent: Arc<Agent> = Agent::new(cfg, ReapMode::OwnOnly, ShutdownMode::Return).unwrap();
    let (host, guest) = tokio::io::duplex(256 * 1024);
    tokio::spawn(serve(agent, guest));
    tokio::time::timeout(T, AgentClient::connect(host))
        .await
        .unwrap()
        .unwrap()
}

/// How many of this process's descriptors are open on `p`.
fn fds_on(p: &Path) -> usize {
    std::fs::read_dir("/proc/self/fd")
        .unwrap()
        .flatten()
        .filter(|e| std::fs::read_link(e.path()).is_ok_and(|t| t == p))
        .count()
}

/// Polls until `f` holds, at most `T`.
async fn eventually(what: &str, f: impl Fn() -> bool) {
    let t = Instant::now();
    while !f() {
        assert!(t.elapsed() < T, "{what}: not within {T:?}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test]
async fn a_read_abandoned_at_its_cap_releases_the_guests_file() {
    let d = tempfile::tempdir().unwrap();
    let p = d.path().join("big");
    std::fs::write(&p, vec![7u8; 4 << 20]).unwrap();
    let c = client().await;
    let r = c.read_file(p.to_str().unwrap(), 64 << 10).await;
    assert!(matches!(&r, Err(RpcError::TooLarge { .. })), "{r:?}");
    // Before `Cancel` the agent's reader waited for credit with the file open until the
    // connection ended.
    eventually("the agent still holds the abandoned file", || {
        fds_on(&p) == 0
    })
    .await;
    c.ping().await.unwrap();
}

#[tokio::test]
async fn a_big_delete_before_an_unpack_reports_progress_and_succeeds() {
    let d = tempfile::tempdir().unwrap();
    let big = d.path().join("ws/big");
    for i in 0..20 {
        let sub = big.join(format!("d{i}"));
        std::fs::create_dir_all(&sub).unwrap();
        for j in 0..100 {
            std::fs::write(sub.join(format!("f{j}")), b"").unwrap();
        }
    }
    let mut ar = tar::Builder::new(Vec::new());
    let mut h = tar::Header::new_gnu();
    h.set_size(2);
    h.set_mode(0o644);
    h.set_cksum();
    ar.append_data(&mut h, "new", &b"hi"[..]).unwrap();
    let tar = ar.into_inner().unwrap();
    let c = client().await;
    let deadline = Duration::from_millis(150);
    // 2,021 entries at >= 250 us each: the delete lasts >= 505 ms, over three deadlines.
    super::progress::pace::slow_under(&big, Duration::from_micros(250));
    c.set_deadlines(Deadlines {
        reply: deadline,
        per_mib: Duration::ZERO,
        ..Deadlines::default()
    });
    let ws = d.path().join("ws");
    let t = Instant::now();
    let r = tokio::time::timeout(T, c.untar(ws.to_str().unwrap(), vec!["big".into()], &tar))
        .await
        .unwrap();
    let took = t.elapsed();
    assert!(r.is_ok(), "after {took:?}: {r:?}");
    assert!(!big.exists());
    assert_eq!(std::fs::read(ws.join("new")).unwrap(), b"hi");
    // The delete must have outlasted the deadline, or this proves nothing (the pace makes sure).
    assert!(took > 2 * deadline, "the delete took only {took:?}");
}
