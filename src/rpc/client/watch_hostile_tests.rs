//! A hostile agent against the host's directory watches (`watch.rs`): floods past the window,
//! batches with too many events or too long names, lengths declared to be huge. The host must
//! end the watch (or the connection, for a broken window) with a clear error, keep nothing
//! beyond its bounds, and tell the guest it stopped watching.

use crate::rpc::frame::{encode_answer, read_frame};
use crate::rpc::hostile::{fake_guest, send};
use crate::rpc::msg::{
    Body, Reply, Request, WATCH_MAX_BATCH, WATCH_MAX_NAME, WatchBatch, WatchEvent, WatchKind,
};
use crate::rpc::{RpcError, WINDOW};
use std::time::Duration;
use tokio::net::UnixStream;
use tokio::sync::mpsc;

const T: Duration = Duration::from_secs(20);

fn batch(n: usize, name_len: usize) -> Vec<u8> {
    let events = (0..n)
        .map(|_| WatchEvent {
            name: "n".repeat(name_len),
            kind: WatchKind::Write,
        })
        .collect();
    // (encode_answer checks nothing the host checks per batch: these are the attacks.)
    encode_answer(&WatchBatch { events, lost: 0 }).unwrap()
}

/// A guest that answers pings, answers a `WatchDir` with `first` and then each of `then` (never
/// waiting for credit), and reports the frames the host sends on the watch's stream.
async fn guest(
    mut g: UnixStream,
    first: Vec<u8>,
    then: Vec<Vec<u8>>,
    seen: mpsc::UnboundedSender<Body>,
) {
    let mut watch = None;
    while let Ok(Some(f)) = read_frame(&mut g).await {
        match f.body {
            Body::Request(Request::Ping) => send(&mut g, f.stream, Body::Reply(Reply::Pong)).await,
            Body::Request(Request::WatchDir { .. }) => {
                watch = Some(f.stream);
                send(&mut g, f.stream, Body::Data(first.clone())).await;
                for b in &then {
                    send(&mut g, f.stream, Body::Data(b.clone())).await;
                }
            }
            other if Some(f.stream) == watch => {
                let _ = seen.send(other);
            }
            _ => {}
        }
    }
}

async fn setup(
    first: Vec<u8>,
    then: Vec<Vec<u8>>,
) -> (crate::rpc::AgentClient, mpsc::UnboundedReceiver<Body>) {
    let (c, g) = fake_guest().await;
    let (tx, rx) = mpsc::unbounded_channel();
    tokio::spawn(guest(g, first, then, tx));
    (c, rx)
}

/// Waits for the host's `Cancel` of the watch.
async fn cancelled(rx: &mut mpsc::UnboundedReceiver<Body>) {
    let wait = async {
        while let Some(b) = rx.recv().await {
            if b == Body::Cancel {
                return;
            }
        }
        panic!("the guest's end closed without a Cancel");
    };
    tokio::time::timeout(T, wait)
        .await
        .expect("the host never cancelled the watch");
}

#[tokio::test]
async fn a_batch_of_too_many_events_ends_the_watch() {
    let (c, mut rx) = setup(
        batch(0, 0),
        vec![batch(3, 1), batch(WATCH_MAX_BATCH + 1, 1)],
    )
    .await;
    let mut w = c.watch_dir("/w", false).await.unwrap();
    let b = tokio::time::timeout(T, w.next())
        .await
        .unwrap()
        .unwrap()
        .unwrap();
    assert_eq!(b.events.len(), 3);
    let e = tokio::time::timeout(T, w.next())
        .await
        .unwrap()
        .unwrap_err();
    assert!(
        matches!(&e, RpcError::Protocol(m) if m.contains("1025 events")),
        "{e}"
    );
    drop(w);
    cancelled(&mut rx).await;
    // Only the watch ended: the connection lives on.
    tokio::time::timeout(T, c.ping()).await.unwrap().unwrap();
}

#[tokio::test]
async fn an_oversized_name_ends_the_watch() {
    let (c, mut rx) = setup(batch(0, 0), vec![batch(1, WATCH_MAX_NAME + 1)]).await;
    let mut w = c.watch_dir("/w", true).await.unwrap();
    let e = tokio::time::timeout(T, w.next())
        .await
        .unwrap()
        .unwrap_err();
    assert!(
        matches!(&e, RpcError::Protocol(m) if m.contains("4097 bytes")),
        "{e}"
    );
    drop(w);
    cancelled(&mut rx).await;
    tokio::time::timeout(T, c.ping()).await.unwrap().unwrap();
}

#[tokio::test]
async fn a_name_declaring_a_huge_length_is_refused_without_allocating_it() {
    // `WatchBatch { events: [one], .. }` whose name declares 2^50 bytes.
    let mut bomb = vec![1u8, 253];
    bomb.extend_from_slice(&(1u64 << 50).to_le_bytes());
    bomb.extend_from_slice(b"ab");
    let (c, _rx) = setup(batch(0, 0), vec![bomb]).await;
    let mut w = c.watch_dir("/w", false).await.unwrap();
    let e = tokio::time::timeout(T, w.next())
        .await
        .unwrap()
        .unwrap_err();
    assert!(
        matches!(&e, RpcError::Protocol(m) if m.contains("bad watch batch")),
        "{e}"
    );
}

#[tokio::test]
async fn the_first_batch_must_be_the_empty_start() {
    let (c, mut rx) = setup(batch(2, 1), vec![]).await;
    let e = tokio::time::timeout(T, c.watch_dir("/w", false))
        .await
        .unwrap()
        .unwrap_err();
    assert!(
        matches!(&e, RpcError::Protocol(m) if m.contains("first batch")),
        "{e}"
    );
    cancelled(&mut rx).await;
}

#[tokio::test]
async fn a_flood_past_the_window_cuts_the_guest_off() {
    // Batches of 1000 events of 100-byte names (~100 KiB each), three windows' worth, sent
    // without waiting for credit while the host reads nothing.
    let flood: Vec<Vec<u8>> = (0..3 * WINDOW / (100 * 1000) + 1)
        .map(|_| batch(1000, 100))
        .collect();
    let (c, _rx) = setup(batch(0, 0), flood).await;
    let _w = c.watch_dir("/w", false).await.unwrap();
    tokio::time::timeout(T, c.closed())
        .await
        .expect("the host kept a guest that broke its window");
    let why = c.close_reason().expect("a reason");
    assert!(why.contains("without credit"), "{why}");
}

#[tokio::test]
async fn a_quiet_watch_has_no_deadline_and_cancels_when_dropped() {
    let (c, mut rx) = setup(batch(0, 0), vec![]).await;
    c.set_deadlines(crate::rpc::Deadlines {
        reply: Duration::from_millis(300),
        ..c.deadlines()
    });
    let mut w = c.watch_dir("/w", false).await.unwrap();
    // Well past the reply deadline, the watch is still waiting and the connection is up.
    assert!(
        tokio::time::timeout(Duration::from_secs(1), w.next())
            .await
            .is_err()
    );
    assert!(!c.is_closed());
    drop(w);
    cancelled(&mut rx).await;
}
