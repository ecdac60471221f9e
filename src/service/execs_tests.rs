//! Tests of the live-exec registry: its bound, followers (replay, live, lag), and later stdin
//! (closed, ended, secrets).

use super::*;
use crate::secrets::Value;
use crate::service::{test_sandbox, test_service};

fn info(id: &str, sandbox: &str) -> api::ExecInfo {
    api::ExecInfo {
        id: id.into(),
        sandbox_id: sandbox.into(),
        pid: Some(42),
        command: vec!["sleep".into(), "9".into()],
        cwd: None,
        env: Default::default(),
        tag: None,
        pty: false,
        detached: true,
        user: None,
        started_at: crate::service::now_rfc3339(),
        running: true,
        exit_code: None,
        signal: None,
        timed_out: false,
        error: None,
    }
}

fn exit(code: i32) -> api::ExecEvent {
    api::ExecEvent::Exit {
        exit_code: Some(code),
        signal: None,
        timed_out: false,
        duration_ms: 1,
    }
}

async fn drain(mut rx: mpsc::Receiver<api::ExecEvent>) -> Vec<api::ExecEvent> {
    let mut out = Vec::new();
    let deadline = std::time::Duration::from_secs(10);
    while let Ok(Some(ev)) = tokio::time::timeout(deadline, rx.recv()).await {
        out.push(ev);
    }
    out
}

#[test]
fn a_sandbox_holds_at_most_max_live_execs() {
    let reg = LiveExecs::default();
    let mut slots = Vec::new();
    for i in 0..3 {
        let s = reg.reserve("sbx_a", 4).unwrap();
        if i < 2 {
            s.fill(LiveExec::new(
                info(&format!("exe_{i}"), "sbx_a"),
                None,
                false,
                b"",
                None,
            ));
        } else {
            slots.push(s);
        }
    }
    // 2 live + 1 starting + this one = 4.
    let last = reg.reserve("sbx_a", 4).unwrap();
    let e = reg.reserve("sbx_a", 4).err().expect("over the bound");
    assert!(matches!(e, ServiceError::Conflict(_)), "{e}");
    // Another sandbox has its own places.
    drop(reg.reserve("sbx_b", 4).unwrap());
    // A start that failed gives its place back; an ended exec too.
    drop(last);
    drop(reg.reserve("sbx_a", 4).unwrap());
    reg.remove("exe_0");
    let _a = reg.reserve("sbx_a", 4).unwrap();
    let _b = reg.reserve("sbx_a", 4).unwrap();
    assert!(reg.reserve("sbx_a", 4).is_err());
    assert_eq!(reg.of_sandbox("sbx_a").len(), 1);
}

#[tokio::test]
async fn an_attach_replays_each_byte_once_then_follows_to_the_end() {
    let d = tempfile::tempdir().unwrap();
    let log = Arc::new(ExecLog::create(d.path(), 1 << 20));
    let live = LiveExec::new(info("exe_r", "sbx_a"), None, false, b"", Some(log.clone()));
    live.publish(api::ExecEvent::output(false, b"one\n"), || {
        log.write(false, b"one\n")
    });
    live.publish(api::ExecEvent::output(true, b"warn\n"), || {
        log.write(true, b"warn\n")
    });
    let rx = follow(&live, true);
    let plain = follow(&live, false);
    live.publish(api::ExecEvent::output(false, b"two\n"), || {
        log.write(false, b"two\n")
    });
    live.finish(exit(3));
    let evs = drain(rx).await;
    assert!(
        matches!(&evs[0], api::ExecEvent::Started { pid: Some(42), .. }),
        "{evs:?}"
    );
    assert_eq!(
        evs[1..],
        [
            api::ExecEvent::output(false, b"one\n"),
            api::ExecEvent::output(true, b"warn\n"),
            api::ExecEvent::output(false, b"two\n"),
            exit(3),
        ]
    );
    let evs = drain(plain).await;
    assert_eq!(evs[1..], [api::ExecEvent::output(false, b"two\n"), exit(3)]);
    // After the end: the replay (stdout, then stderr), then the end.
    let evs = drain(follow(&live, true)).await;
    assert_eq!(
        evs[1..],
        [
            api::ExecEvent::output(false, b"one\ntwo\n"),
            api::ExecEvent::output(true, b"warn\n"),
            exit(3),
        ]
    );
}

#[tokio::test]
async fn a_lagging_follower_is_cut_off_and_the_owner_never_waits() {
    let live = LiveExec::new(info("exe_l", "sbx_a"), None, false, b"", None);
    let rx = follow(&live, false);
    // The owner publishes far more than a follower may lag without yielding: never blocks.
    for i in 0..(SUBSCRIBER_BACKLOG * 3) {
        live.publish(
            api::ExecEvent::output(false, format!("{i}\n").as_bytes()),
            || {},
        );
    }
    let evs = drain(rx).await;
    let last = evs.last().expect("events");
    assert!(
        matches!(last, api::ExecEvent::Error { code, .. } if code == "lagged"),
        "{last:?}"
    );
    assert!(evs.len() < SUBSCRIBER_BACKLOG * 3, "{}", evs.len());
}

#[tokio::test]
async fn later_stdin_needs_an_open_stdin_and_a_live_exec() {
    let d = tempfile::tempdir().unwrap();
    let svc = test_service(d.path(), crate::config::Config::default());
    let sbx = test_sandbox(&svc, d.path());
    let closed = LiveExec::new(info("exe_c", &sbx), None, false, b"", None);
    svc.execs.reserve(&sbx, 4).unwrap().fill(closed);
    let e = svc.exec_input("exe_c", b"x", false).await.unwrap_err();
    assert!(matches!(e, ServiceError::Conflict(_)), "{e}");
    assert!(e.to_string().contains("closed"), "{e}");
    // Unknown: 404; ended (a stored record, not live): 409.
    let e = svc.exec_input("exe_nope", b"x", false).await.unwrap_err();
    assert!(matches!(e, ServiceError::NotFound(_)), "{e}");
    let rec = ExecRecord {
        id: "exe_ended".into(),
        sandbox_id: sbx.clone(),
        command: vec!["true".into()],
        started_at: crate::service::now_rfc3339(),
        exit_code: Some(0),
        signal: None,
        timed_out: false,
        duration_ms: Some(1),
        error: None,
        pid: Some(7),
        cwd: None,
        env: Default::default(),
        tag: Some("t".into()),
        pty: false,
        detached: true,
        user: None,
    };
    svc.store.put(EXECS, "exe_ended", &rec).unwrap();
    let e = svc.exec_input("exe_ended", b"x", false).await.unwrap_err();
    assert!(matches!(e, ServiceError::Conflict(_)), "{e}");
    assert!(matches!(
        svc.signal_exec("exe_ended", 15).await,
        Err(ServiceError::Conflict(_))
    ));
    let got = svc.get_exec("exe_ended").unwrap();
    assert!(!got.running && got.exit_code == Some(0) && got.tag.as_deref() == Some("t"));
    // Listing: the live one only; an unknown sandbox is a 404.
    let ids: Vec<String> = svc
        .list_execs(&sbx)
        .unwrap()
        .into_iter()
        .map(|e| e.id)
        .collect();
    assert_eq!(ids, ["exe_c"]);
    assert_eq!(svc.exec_by_pid(&sbx, 42).as_deref(), Some("exe_c"));
    assert!(matches!(
        svc.list_execs("sbx_nope"),
        Err(ServiceError::NotFound(_))
    ));
    // A non-pty exec cannot be resized; a bad size is a 400.
    assert!(matches!(
        svc.resize_exec("exe_c", 10, 10).await,
        Err(ServiceError::Conflict(_))
    ));
    assert!(matches!(
        svc.resize_exec("exe_c", 0, 10).await,
        Err(ServiceError::BadRequest(_))
    ));
}

#[tokio::test]
async fn later_stdin_holding_a_secret_value_is_refused_even_split_across_inputs() {
    const V: &str = "sk-live-abcdefghijklmnop";
    let d = tempfile::tempdir().unwrap();
    let svc = test_service(d.path(), crate::config::Config::default());
    let sbx = test_sandbox(&svc, d.path());
    svc.store_secret(
        "API_KEY",
        Value::new(V.as_bytes().to_vec()),
        api::SetSecretRequest {
            value: api::SecretText(Zeroizing::new(V.into())),
            hosts: vec!["api.example.com".into()],
            headers: vec![],
            in_body: false,
        },
    )
    .unwrap();
    // The request's own stdin ended with the value's first half.
    let live = LiveExec::new(info("exe_s", &sbx), None, true, b"hello sk-live-abc", None);
    svc.execs.reserve(&sbx, 4).unwrap().fill(live);
    let e = svc
        .exec_input("exe_s", b"defghijklmnop\n", false)
        .await
        .unwrap_err();
    assert!(matches!(e, ServiceError::Forbidden(_)), "{e}");
    let msg = e.to_string();
    assert!(msg.contains("`API_KEY`") && !msg.contains(V), "{msg}");
    let e = svc
        .exec_input("exe_s", V.as_bytes(), false)
        .await
        .unwrap_err();
    assert!(matches!(e, ServiceError::Forbidden(_)), "{e}");
}
