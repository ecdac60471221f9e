//! Tests of `dirwatch.rs` on real temp directories (Linux inotify, in process), and of the
//! whole `WatchDir` stream between the real agent and the real host client.

use super::*;
use crate::rpc::RpcError;
use std::os::unix::fs::PermissionsExt;
use std::time::Duration;

fn ev(name: &str, kind: WatchKind) -> WatchEvent {
    WatchEvent {
        name: name.into(),
        kind,
    }
}

/// Everything queued now (inotify queues events within the syscall that caused them).
fn events(w: &mut DirWatch) -> Vec<WatchEvent> {
    assert!(w.drain().unwrap(), "the queue drains");
    let mut out = Vec::new();
    while let Some(b) = w.take_batch() {
        assert_eq!(b.lost, 0);
        out.extend(b.events);
    }
    out
}

fn start(root: &Path, recursive: bool) -> DirWatch {
    DirWatch::start(root.to_str().unwrap(), recursive).unwrap()
}

#[test]
fn masks_map_as_fsnotify_does() {
    use AddWatchFlags as F;
    let cases = [
        (F::IN_CREATE, Some(WatchKind::Create)),
        (F::IN_CREATE | F::IN_ISDIR, Some(WatchKind::Create)),
        (F::IN_MOVED_TO, Some(WatchKind::Create)),
        (F::IN_MODIFY, Some(WatchKind::Write)),
        (F::IN_CLOSE_WRITE, Some(WatchKind::Write)),
        (F::IN_DELETE, Some(WatchKind::Remove)),
        (F::IN_DELETE | F::IN_ISDIR, Some(WatchKind::Remove)),
        (F::IN_MOVED_FROM, Some(WatchKind::Rename)),
        (F::IN_ATTRIB, Some(WatchKind::Chmod)),
        (F::IN_OPEN, None),
        (F::IN_ACCESS, None),
        (F::IN_CLOSE_NOWRITE, None),
    ];
    for (m, want) in cases {
        assert_eq!(kind_of(m), want, "{m:?}");
    }
}

#[test]
fn every_kind_of_change_is_reported_once_and_in_order() {
    let d = tempfile::tempdir().unwrap();
    let mut w = start(d.path(), false);
    assert!(events(&mut w).is_empty());
    std::fs::write(d.path().join("a"), b"hello").unwrap();
    // One write: IN_CREATE, IN_MODIFY, IN_CLOSE_WRITE -> CREATE, WRITE (the close is the same
    // write).
    assert_eq!(
        events(&mut w),
        [ev("a", WatchKind::Create), ev("a", WatchKind::Write)]
    );
    std::fs::rename(d.path().join("a"), d.path().join("b")).unwrap();
    assert_eq!(
        events(&mut w),
        [ev("a", WatchKind::Rename), ev("b", WatchKind::Create)]
    );
    std::fs::set_permissions(d.path().join("b"), std::fs::Permissions::from_mode(0o600)).unwrap();
    assert_eq!(events(&mut w), [ev("b", WatchKind::Chmod)]);
    std::fs::remove_file(d.path().join("b")).unwrap();
    assert_eq!(events(&mut w), [ev("b", WatchKind::Remove)]);
    // A file opened for writing and closed unchanged: only the close says it was written.
    std::fs::write(d.path().join("c"), b"").unwrap();
    assert_eq!(
        events(&mut w),
        [ev("c", WatchKind::Create), ev("c", WatchKind::Write)]
    );
    // A burst of writes not yet sent is one event.
    {
        use std::io::Write;
        let mut f = std::fs::OpenOptions::new()
            .append(true)
            .open(d.path().join("c"))
            .unwrap();
        for _ in 0..50 {
            f.write_all(b"x").unwrap();
        }
    }
    assert_eq!(events(&mut w), [ev("c", WatchKind::Write)]);
    // Not recursive: a subdirectory's own changes are not watched.
    std::fs::create_dir(d.path().join("sub")).unwrap();
    std::fs::write(d.path().join("sub/x"), b"1").unwrap();
    assert_eq!(events(&mut w), [ev("sub", WatchKind::Create)]);
    assert_eq!(w.watched(), 1);
}

#[test]
fn the_agents_own_writes_show_as_a_create_and_write_of_the_target() {
    use super::super::files::{is_temp_name, temp_name};
    let t = temp_name("a.txt");
    assert!(is_temp_name(&t), "{t}");
    for not in [
        "a.txt",
        ".a.txt",
        ".tryboxi-1-2-ab",
        ".a.tryboxi-1-2",
        ".a.tryboxi-x-2-ab",
        ".a.tryboxi-1-2-zz",
        "a.tryboxi-1-2-ab",
    ] {
        assert!(!is_temp_name(not), "{not}");
    }
    let d = tempfile::tempdir().unwrap();
    let mut w = start(d.path(), false);
    std::fs::write(d.path().join(&t), b"content").unwrap();
    std::fs::rename(d.path().join(&t), d.path().join("a.txt")).unwrap();
    assert_eq!(
        events(&mut w),
        [
            ev("a.txt", WatchKind::Create),
            ev("a.txt", WatchKind::Write)
        ]
    );
    // Another file renamed in is a plain create.
    std::fs::write(d.path().join("x"), b"").unwrap();
    events(&mut w);
    std::fs::rename(d.path().join("x"), d.path().join("y")).unwrap();
    assert_eq!(
        events(&mut w),
        [ev("x", WatchKind::Rename), ev("y", WatchKind::Create)]
    );
}

#[test]
fn recursive_watches_follow_new_and_moved_directories() {
    let d = tempfile::tempdir().unwrap();
    std::fs::create_dir_all(d.path().join("old/deep")).unwrap();
    let mut w = start(d.path(), true);
    assert_eq!(w.watched(), 3);
    std::fs::write(d.path().join("old/deep/f"), b"1").unwrap();
    assert_eq!(
        events(&mut w),
        [
            ev("old/deep/f", WatchKind::Create),
            ev("old/deep/f", WatchKind::Write)
        ]
    );
    // A new directory filled before its event is read: what it holds is reported as created.
    std::fs::create_dir_all(d.path().join("new/inner")).unwrap();
    std::fs::write(d.path().join("new/inner/g"), b"1").unwrap();
    let got = events(&mut w);
    assert_eq!(got[0], ev("new", WatchKind::Create));
    assert!(got.contains(&ev("new/inner", WatchKind::Create)), "{got:?}");
    assert!(
        got.contains(&ev("new/inner/g", WatchKind::Create)),
        "{got:?}"
    );
    assert_eq!(w.watched(), 5);
    std::fs::write(d.path().join("new/inner/g"), b"2").unwrap();
    assert_eq!(events(&mut w), [ev("new/inner/g", WatchKind::Write)]);
    // A moved directory is watched under its new name only.
    std::fs::rename(d.path().join("old"), d.path().join("moved")).unwrap();
    assert_eq!(
        events(&mut w),
        [ev("old", WatchKind::Rename), ev("moved", WatchKind::Create)]
    );
    std::fs::write(d.path().join("moved/deep/h"), b"1").unwrap();
    assert_eq!(
        events(&mut w),
        [
            ev("moved/deep/h", WatchKind::Create),
            ev("moved/deep/h", WatchKind::Write)
        ]
    );
    assert_eq!(w.watched(), 5);
    std::fs::remove_dir_all(d.path().join("moved")).unwrap();
    let got = events(&mut w);
    assert_eq!(got.last(), Some(&ev("moved", WatchKind::Remove)), "{got:?}");
    assert_eq!(w.watched(), 3);
}

#[test]
fn depth_and_directory_count_are_bounded() {
    let d = tempfile::tempdir().unwrap();
    let deep: PathBuf = (0..WATCH_MAX_DEPTH + 3).map(|i| format!("d{i}")).collect();
    std::fs::create_dir_all(d.path().join(&deep)).unwrap();
    let w = start(d.path(), true);
    assert_eq!(w.watched(), WATCH_MAX_DEPTH + 1, "the root and 16 levels");
    for i in 0..10 {
        std::fs::create_dir(d.path().join(format!("x{i}"))).unwrap();
    }
    let e = DirWatch::start_with(d.path().to_str().unwrap(), true, 5)
        .err()
        .unwrap();
    assert_eq!(e.kind, ErrorKind::Busy);
    assert!(e.message.contains("more than 5 directories"), "{e}");
    // Past the cap at run time, new directories are reported but not watched.
    let e2 = tempfile::tempdir().unwrap();
    let mut w = DirWatch::start_with(e2.path().to_str().unwrap(), true, 2).unwrap();
    std::fs::create_dir(e2.path().join("a")).unwrap();
    std::fs::create_dir(e2.path().join("b")).unwrap();
    assert_eq!(
        events(&mut w),
        [ev("a", WatchKind::Create), ev("b", WatchKind::Create)]
    );
    assert_eq!(w.watched(), 2);
}

#[test]
fn the_pending_queue_and_names_are_bounded() {
    let d = tempfile::tempdir().unwrap();
    let mut w = start(d.path(), false);
    for i in 0..MAX_PENDING + 10 {
        w.push(format!("f{i}"), WatchKind::Create);
    }
    w.push("n".repeat(WATCH_MAX_NAME + 1), WatchKind::Create);
    assert_eq!(w.pending.len(), MAX_PENDING);
    let first = w.take_batch().unwrap();
    assert_eq!(first.lost, 11);
    assert_eq!(first.events.len(), WATCH_MAX_BATCH);
    assert_eq!(first.events[0].name, "f0");
    let mut total = first.events.len();
    while let Some(b) = w.take_batch() {
        assert!(b.events.len() <= WATCH_MAX_BATCH);
        assert_eq!(b.lost, 0);
        assert!(encode_answer(&b).unwrap().len() <= CHUNK + 64);
        total += b.events.len();
    }
    assert_eq!(total, MAX_PENDING);
    // Long names make smaller batches: about a chunk each.
    for i in 0..100 {
        w.push(format!("{i}{}", "n".repeat(2000)), WatchKind::Write);
    }
    let b = w.take_batch().unwrap();
    assert!(b.events.len() < 20, "{}", b.events.len());
}

#[test]
fn the_root_going_away_ends_the_watch() {
    let d = tempfile::tempdir().unwrap();
    let root = d.path().join("w");
    std::fs::create_dir(&root).unwrap();
    std::fs::write(root.join("f"), b"").unwrap();
    let mut w = start(&root, true);
    std::fs::remove_dir_all(&root).unwrap();
    let e = w.drain().unwrap_err();
    assert_eq!(e.kind, ErrorKind::NotFound);
    // What happened before is still there to send.
    assert_eq!(w.take_batch().unwrap().events, [ev("f", WatchKind::Remove)]);
    let f = d.path().join("file");
    std::fs::write(&f, b"").unwrap();
    let e = DirWatch::start(f.to_str().unwrap(), false).err().unwrap();
    assert_eq!(e.kind, ErrorKind::InvalidRequest);
    let e = DirWatch::start("/nonexistent/dir", false).err().unwrap();
    assert_eq!(e.kind, ErrorKind::NotFound);
    let e = DirWatch::start("relative", false).err().unwrap();
    assert_eq!(e.kind, ErrorKind::InvalidRequest);
}

const T: Duration = Duration::from_secs(20);

async fn next(w: &mut crate::rpc::DirWatch) -> Vec<WatchEvent> {
    tokio::time::timeout(T, w.next())
        .await
        .expect("an event within 20 s")
        .unwrap()
        .expect("the watch goes on")
        .events
}

#[tokio::test]
async fn the_agent_streams_events_until_cancelled_or_the_directory_goes() {
    let agent = super::super::tests::agent();
    let (client, wire, _server) = super::super::tests::link(&agent).await;
    let d = tempfile::tempdir().unwrap();
    let root = d.path().join("w");
    std::fs::create_dir(&root).unwrap();
    let rs = root.to_str().unwrap();
    let e = client.watch_dir("/nonexistent", false).await.unwrap_err();
    assert!(
        matches!(&e, RpcError::Remote(r) if r.kind == ErrorKind::NotFound),
        "{e}"
    );
    let mut w = client.watch_dir(rs, false).await.unwrap();
    assert_eq!(RUNNING.load(std::sync::atomic::Ordering::SeqCst), 1);
    // In place when `watch_dir` returns: a change right after it is seen, and promptly.
    let t = std::time::Instant::now();
    std::fs::write(root.join("a"), b"1").unwrap();
    let mut got = next(&mut w).await;
    while got.len() < 2 {
        got.extend(next(&mut w).await);
    }
    assert_eq!(got, [ev("a", WatchKind::Create), ev("a", WatchKind::Write)]);
    assert!(t.elapsed() < Duration::from_secs(2), "{:?}", t.elapsed());
    // A whole-file write through the agent shows as envd's create and write, nothing else.
    client
        .write_file(root.join("b").to_str().unwrap(), b"2", 0o644)
        .await
        .unwrap();
    let mut got = next(&mut w).await;
    while got.len() < 2 {
        got.extend(next(&mut w).await);
    }
    assert_eq!(got, [ev("b", WatchKind::Create), ev("b", WatchKind::Write)]);
    // Dropping the watch cancels it in the guest: its route goes.
    drop(w);
    let gone = async {
        while RUNNING.load(std::sync::atomic::Ordering::SeqCst) != 0 {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    };
    tokio::time::timeout(T, gone)
        .await
        .expect("the guest's watch ends");
    // A flood the host does not read stays within the window; none of it is lost once read.
    let mut w = client.watch_dir(rs, false).await.unwrap();
    for i in 0..3000 {
        std::fs::write(root.join(format!("f{i:04}")), b"").unwrap();
    }
    let mut creates = 0;
    while creates < 3000 {
        let b = tokio::time::timeout(T, w.next())
            .await
            .unwrap()
            .unwrap()
            .unwrap();
        assert_eq!(b.lost, 0);
        creates += b
            .events
            .iter()
            .filter(|e| e.kind == WatchKind::Create)
            .count();
    }
    // The directory removed: the watch ends with NotFound.
    std::fs::remove_dir_all(&root).unwrap();
    let end = loop {
        match tokio::time::timeout(T, w.next()).await.unwrap() {
            Ok(Some(_)) => continue,
            other => break other,
        }
    };
    assert!(
        matches!(&end, Err(RpcError::Remote(r)) if r.kind == ErrorKind::NotFound),
        "{end:?}"
    );
    client.ping().await.unwrap();
    // The link dies (the VM paused, restored or gone): the host's watch ends at once with
    // `Disconnected`, and the agent drops its watch with the connection.
    let root2 = d.path().join("w2");
    std::fs::create_dir(&root2).unwrap();
    let mut w = client
        .watch_dir(root2.to_str().unwrap(), true)
        .await
        .unwrap();
    wire.abort();
    let end = tokio::time::timeout(T, w.next())
        .await
        .expect("the watch hung");
    assert!(matches!(end, Err(RpcError::Disconnected)), "{end:?}");
    let gone = async {
        while RUNNING.load(std::sync::atomic::Ordering::SeqCst) != 0 {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    };
    tokio::time::timeout(T, gone)
        .await
        .expect("the agent kept the watch of a dead connection");
}
