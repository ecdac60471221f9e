//! A sandbox whose agent misbehaves (a hostile test double of the guest side, no VM): the call
//! fails with a clear error instead of hanging, and the sandbox is marked failed with the reason.

use std::sync::Arc;
use std::time::{Duration, Instant};

use super::*;
use crate::config::{Config, Paths};
use crate::rpc::hostile::{fake_guest, ignore_all};
use crate::rpc::{Deadlines, hostile};
use crate::store::Store;
use crate::vmm::Accel;

fn service() -> (Arc<Service>, String, tempfile::TempDir) {
    let dir = tempfile::tempdir().unwrap();
    // No VMM: the watcher has no QEMU to ask about or kill.
    let config = Config {
        qemu_binary: dir.path().join("no-qemu").display().to_string(),
        ..Config::default()
    };
    let svc = crate::service::test_service(dir.path(), config);
    let id = ids::new_id(ids::SANDBOX);
    let rec = SandboxRecord {
        api: api::Sandbox {
            id: id.clone(),
            state: SandboxState::Ready,
            workspace: Some(api::WorkspaceSpec {
                host_path: dir.path().display().to_string(),
                exclude: Vec::new(),
            }),
            template: "auto".into(),
            vcpus: 1,
            memory_mib: 256,
            accel: None,
            created_at: super::super::now_rfc3339(),
            error: None,
            ports: Vec::new(),
        },
        dir: dir.path().join("sandboxes").join(&id),
    };
    svc.store.put(SANDBOXES, &id, &rec).unwrap();
    (svc, id, dir)
}

fn live(id: &str, dir: &Path, agent: AgentClient) -> Arc<LiveVm> {
    Arc::new(LiveVm {
        info: VmInfo {
            id: id.to_owned(),
            dir: dir.to_path_buf(),
            pid: 0,
            accel: Accel::Tcg,
            agent_socket: dir.join("agent.sock"),
            qmp_socket: dir.join("qmp.sock"),
            console_log: dir.join("console.log"),
        },
        agent,
    })
}

/// Polls the record until it is failed (or 10 s pass); its error.
async fn failed_with(svc: &Service, id: &str) -> String {
    let until = Instant::now() + Duration::from_secs(10);
    loop {
        let rec = svc.record(id).unwrap();
        if rec.api.state == SandboxState::Failed {
            return rec.api.error.unwrap_or_default();
        }
        assert!(Instant::now() < until, "still {}", rec.api.state);
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test]
async fn a_silent_agent_fails_the_call_and_the_sandbox() {
    let (svc, id, dir) = service();
    let (agent, mut g) = fake_guest().await;
    tokio::spawn(async move { ignore_all(&mut g).await });
    agent.set_deadlines(Deadlines {
        reply: Duration::from_millis(300),
        per_mib: Duration::ZERO,
        ..Deadlines::default()
    });
    let vm = live(&id, dir.path(), agent);
    svc.vms.insert(&id, vm.clone());
    svc.watch(id.clone(), vm);
    let r = tokio::time::timeout(
        Duration::from_secs(20),
        svc.read_vm_file(&id, "/etc/hostname"),
    )
    .await
    .expect("the call waited forever for a silent agent");
    let e = r.unwrap_err().to_string();
    assert!(e.contains("did not answer"), "{e}");
    let why = failed_with(&svc, &id).await;
    assert!(
        why.contains("cut off") && why.contains("did not answer"),
        "{why}"
    );
    assert!(svc.vms.get(&id).is_none());
}

#[tokio::test]
async fn an_agent_past_its_window_fails_the_sandbox() {
    let (svc, id, dir) = service();
    let (agent, mut g) = fake_guest().await;
    tokio::spawn(async move {
        // Answers anything with more data than its window allows, without waiting for credit.
        let (stream, _) = hostile::next_request(&mut g).await.unwrap();
        for _ in 0..16 {
            hostile::send(
                &mut g,
                stream,
                crate::rpc::msg::Body::Data(vec![0; 32 << 10]),
            )
            .await;
        }
        ignore_all(&mut g).await;
    });
    let vm = live(&id, dir.path(), agent.clone());
    svc.vms.insert(&id, vm.clone());
    svc.watch(id.clone(), vm);
    // The caller does not consume the answer, so the host holds all the guest sends.
    let c = agent.clone();
    let stuck = tokio::spawn(async move {
        let (_keep, mut never_read) = tokio::io::duplex(1);
        let _ = c.read_file_to("/f", u64::MAX, &mut never_read).await;
    });
    let why = failed_with(&svc, &id).await;
    assert!(
        why.contains("cut off") && why.contains("without credit"),
        "{why}"
    );
    stuck.abort();
}

#[tokio::test]
async fn a_silent_agent_no_longer_holds_the_workspace_lock() {
    let (svc, id, dir) = service();
    let (agent, mut g) = fake_guest().await;
    tokio::spawn(async move { ignore_all(&mut g).await });
    agent.set_deadlines(Deadlines {
        reply: Duration::from_millis(300),
        per_mib: Duration::ZERO,
        ..Deadlines::default()
    });
    let vm = live(&id, dir.path(), agent);
    svc.vms.insert(&id, vm.clone());
    svc.watch(id.clone(), vm);
    // A diff walks the VM's tree under the sandbox's workspace lock.
    let r = tokio::time::timeout(Duration::from_secs(20), svc.diff(&id, true, Vec::new()))
        .await
        .expect("the diff waited forever for a silent agent");
    let e = r.unwrap_err().to_string();
    assert!(e.contains("did not answer walk_since"), "{e}");
    let lock = svc
        .ws_locks
        .lock()
        .unwrap()
        .get(&id)
        .cloned()
        .expect("the diff took the lock");
    assert!(lock.try_lock().is_ok(), "the workspace lock is still held");
    let why = failed_with(&svc, &id).await;
    assert!(why.contains("did not answer walk_since"), "{why}");
}

/// `agent_timeout_s` is the deadline of the agent connections the service makes: here a
/// restored VM's (the early connection the driver hands over), whose agent then goes silent.
#[tokio::test]
async fn agent_timeout_s_is_the_deadline_of_a_restored_vms_agent() {
    let config = Config::parse("agent_timeout_s = 1").expect("agent_timeout_s is a config key");
    let dir = tempfile::tempdir().unwrap();
    let svc = Service::new(
        Paths {
            root: dir.path().to_path_buf(),
        },
        config,
        Store::in_memory(),
        dir.path().join("artifacts"),
        None,
    );
    let Ok(driver) = crate::vmm::QemuDriver::new("qemu-system-x86_64") else {
        println!("skipped: no qemu-system-x86_64 (agent_or_kill takes a driver)");
        return;
    };
    let (host, guest) = std::os::unix::net::UnixStream::pair().unwrap();
    guest.set_nonblocking(true).unwrap();
    let guest = tokio::net::UnixStream::from_std(guest).unwrap();
    tokio::spawn(async move {
        let mut g = hostile::answer_hello(guest).await;
        ignore_all(&mut g).await;
    });
    let started = crate::vmm::qemu::Resumed {
        info: VmInfo {
            id: "sbx_t".into(),
            dir: dir.path().to_path_buf(),
            pid: 0,
            accel: Accel::Tcg,
            agent_socket: dir.path().join("agent.sock"),
            qmp_socket: dir.path().join("qmp.sock"),
            console_log: dir.path().join("console.log"),
        },
        agent: Some(host),
        replaced_layer: None,
    };
    let (_, agent) =
        super::super::snapshots::agent_or_kill(&driver, started, "restored", svc.agent_deadlines())
            .await
            .expect("the handshake");
    let t0 = Instant::now();
    let r = tokio::time::timeout(Duration::from_secs(30), agent.stat("/etc/hostname"))
        .await
        .expect("the stat waited past 30 s for a silent agent");
    let e = r.unwrap_err().to_string();
    assert!(e.contains("did not answer stat within 1s"), "{e}");
    assert!(t0.elapsed() < Duration::from_secs(10), "{:?}", t0.elapsed());
}

#[tokio::test]
async fn a_slow_agent_fails_the_call_but_not_the_sandbox() {
    use crate::rpc::msg::{Body, Reply, Request};
    let (svc, id, dir) = service();
    let mut events = svc.telemetry.events.subscribe(Some(0), None).unwrap();
    let (agent, mut g) = fake_guest().await;
    // Alive (answers pings) but never answers the read: a file that blocks, a busy agent.
    tokio::spawn(async move {
        while let Some((stream, req)) = hostile::next_request(&mut g).await {
            if req == Request::Ping {
                hostile::send(&mut g, stream, Body::Reply(Reply::Pong)).await;
            }
        }
    });
    agent.set_deadlines(Deadlines {
        reply: Duration::from_millis(300),
        per_mib: Duration::ZERO,
        ..Deadlines::default()
    });
    let vm = live(&id, dir.path(), agent.clone());
    svc.vms.insert(&id, vm.clone());
    svc.watch(id.clone(), vm);
    let r = tokio::time::timeout(Duration::from_secs(20), svc.read_vm_file(&id, "/proc/kmsg"))
        .await
        .expect("the call waited forever");
    let e = r.unwrap_err().to_string();
    assert!(e.contains("still answers pings"), "{e}");
    // The sandbox stays up, its agent connected; the event says what happened.
    let ev = tokio::time::timeout(Duration::from_secs(10), async {
        loop {
            let ev = events.next().await.unwrap().unwrap();
            if ev.kind == "sandbox.agent_slow" {
                return ev;
            }
        }
    })
    .await
    .expect("no sandbox.agent_slow event");
    assert_eq!(ev.sandbox_id, id);
    let rec = svc.record(&id).unwrap();
    assert_eq!(rec.api.state, SandboxState::Ready, "{:?}", rec.api.error);
    assert!(svc.vms.get(&id).is_some());
    agent.ping().await.unwrap();
}
