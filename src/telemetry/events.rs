//! The event log: every state change (sandbox created/ready/failed/removed, exec
//! started/finished, and later sync/apply/snapshot...) is appended to the store's `events` table
//! and broadcast in process, so followers see it at once and can resume after a disconnect.
//!
//! The table is kept to [`Retention`] (`[telemetry]` `event_max_count` and
//! `event_max_age_days` in config.toml): every append deletes the oldest events past the count in
//! its own transaction (so a guest flooding denied connections cannot grow the store past the
//! cap), and events past the age are deleted in batches at start and every
//! [`AGE_CHECK_EVERY`] appends. A follower whose cursor was pruned resumes at the oldest kept.
//!
//! Never: polls. A subscriber reads the stored backlog after its cursor, then the live
//! broadcast; if it falls behind the broadcast it catches up from the store again.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use serde::{Deserialize, Serialize};
use tokio::sync::broadcast;

use crate::store::{Store, StoreError};

/// One recorded state change. Its `id` is the store's sequence number (1, 2, ...), used as the
/// SSE `id:` and for `Last-Event-ID` / `?since=N` resumption.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Event {
    #[serde(default)]
    pub id: u64,
    /// RFC 3339 UTC.
    pub time: String,
    /// `sandbox.created`, `sandbox.ready`, `sandbox.failed`, `sandbox.removed`,
    /// `exec.started`, `exec.finished`, ... (dotted, stable).
    #[serde(rename = "type")]
    pub kind: String,
    pub sandbox_id: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub exec_id: Option<String>,
    /// Kind-specific details (exit code, reason, duration...).
    #[serde(default, skip_serializing_if = "serde_json::Value::is_null")]
    pub data: serde_json::Value,
}

/// Event kinds of the sandbox and exec lifecycle. Other modules publish their own dotted names
/// (`network.*`, `secret.*`, `sandbox.paused`, `port.exposed`, ...).
pub mod kind {
    pub const SANDBOX_CREATED: &str = "sandbox.created";
    pub const SANDBOX_READY: &str = "sandbox.ready";
    pub const SANDBOX_FAILED: &str = "sandbox.failed";
    pub const SANDBOX_REMOVED: &str = "sandbox.removed";
    pub const EXEC_STARTED: &str = "exec.started";
    pub const EXEC_FINISHED: &str = "exec.finished";
}

/// How many events a live subscriber may fall behind before it re-reads the store.
const LIVE_CAPACITY: usize = 256;
/// Backlog read size.
const BATCH: usize = 256;
/// Appends between two age checks (each deletes at most [`PRUNE_BATCH`] expired events).
pub const AGE_CHECK_EVERY: u64 = 256;
/// Most events one pruning transaction deletes.
pub const PRUNE_BATCH: usize = 1000;

/// How many events, and how old, the store keeps.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Retention {
    /// Newest events kept; older ones are deleted as new ones come. At least 1.
    pub max_count: u64,
    /// Events older than this are deleted; `None`: kept whatever their age.
    pub max_age: Option<Duration>,
}

impl Default for Retention {
    fn default() -> Self {
        Retention {
            max_count: 100_000,
            max_age: Some(Duration::from_secs(30 * 86_400)),
        }
    }
}

/// Only the time of a stored event, to judge its age without decoding the rest.
#[derive(Deserialize)]
struct Stamp {
    time: String,
}

pub struct EventBus {
    store: Arc<Store>,
    retention: Retention,
    tx: broadcast::Sender<Arc<Event>>,
    /// Held across append + send, so the broadcast order is the sequence order.
    order: Mutex<()>,
}

impl EventBus {
    #[cfg(test)]
    pub fn new(store: Arc<Store>) -> EventBus {
        EventBus::with_retention(store, Retention::default())
    }

    /// A bus that keeps the store to `retention`; what is already past it is pruned now.
    pub fn with_retention(store: Arc<Store>, retention: Retention) -> EventBus {
        let retention = Retention {
            max_count: retention.max_count.max(1),
            ..retention
        };
        let (tx, _) = broadcast::channel(LIVE_CAPACITY);
        let bus = EventBus {
            store,
            retention,
            tx,
            order: Mutex::new(()),
        };
        bus.prune(usize::MAX, crate::telemetry::traces::unix_secs_now());
        bus
    }

    /// Delete events past the retention, at most `max_batches` transactions of [`PRUNE_BATCH`];
    /// `now` in seconds since the epoch. Returns how many were deleted (errors are logged).
    pub fn prune(&self, max_batches: usize, now: u64) -> u64 {
        let cutoff = self
            .retention
            .max_age
            .map(|a| now.saturating_sub(a.as_secs()));
        let expired = |b: &[u8]| {
            let Some(cutoff) = cutoff else { return false };
            serde_json::from_slice::<Stamp>(b)
                .ok()
                .and_then(|s| crate::service::parse_rfc3339(&s.time))
                .is_some_and(|t| t < cutoff)
        };
        let mut total = 0;
        for _ in 0..max_batches {
            match self
                .store
                .prune_events(self.retention.max_count, PRUNE_BATCH, expired)
            {
                Ok(n) => {
                    total += n as u64;
                    if n < PRUNE_BATCH {
                        break;
                    }
                }
                Err(e) => {
                    tracing::warn!(error = %e, "cannot prune the event log");
                    break;
                }
            }
        }
        if total > 0 {
            tracing::info!(deleted = total, "pruned old events");
        }
        total
    }

    /// Record and broadcast an event; returns its id. A store failure is logged and the event
    /// is still broadcast (with id 0): observability must never fail the operation it observes.
    pub fn publish(
        &self,
        kind: &str,
        sandbox_id: &str,
        exec_id: Option<&str>,
        data: serde_json::Value,
    ) -> u64 {
        let mut ev = Event {
            id: 0,
            time: crate::service::now_rfc3339(),
            kind: kind.to_owned(),
            sandbox_id: sandbox_id.to_owned(),
            exec_id: exec_id.map(str::to_owned),
            data,
        };
        let _guard = self.order.lock().unwrap_or_else(|p| p.into_inner());
        match self.store.append_event(&ev, Some(self.retention.max_count)) {
            Ok(seq) => ev.id = seq,
            Err(e) => tracing::warn!(error = %e, kind, "cannot record an event"),
        }
        if ev.id > 0 && ev.id.is_multiple_of(AGE_CHECK_EVERY) && self.retention.max_age.is_some() {
            self.prune(1, crate::telemetry::traces::unix_secs_now());
        }
        metrics::counter!(super::metrics::EVENTS, "type" => kind.to_owned()).increment(1);
        tracing::debug!(id = ev.id, kind, sandbox = sandbox_id, exec = ?exec_id, "event");
        let id = ev.id;
        // No receivers is fine: nobody follows right now.
        let _ = self.tx.send(Arc::new(ev));
        id
    }

    /// Follow events with an id greater than `since` (`None`: only events from now on),
    /// optionally only one sandbox's.
    pub fn subscribe(
        &self,
        since: Option<u64>,
        sandbox: Option<String>,
    ) -> Result<Subscription, StoreError> {
        // Subscribe before reading the cursor or the backlog, so nothing falls between.
        let rx = self.tx.subscribe();
        let cursor = match since {
            Some(n) => n,
            None => self.store.last_event_id()?,
        };
        Ok(Subscription {
            rx,
            store: self.store.clone(),
            cursor,
            sandbox,
            backlog: std::collections::VecDeque::new(),
            catching_up: true,
        })
    }
}

fn read_after(store: &Store, since: u64, limit: usize) -> Result<Vec<Event>, StoreError> {
    Ok(store
        .events_after::<Event>(since, limit)?
        .into_iter()
        .map(|(seq, mut e)| {
            e.id = seq;
            e
        })
        .collect())
}

/// A follower's cursor: the stored backlog first, then live events, in id order, each once.
pub struct Subscription {
    rx: broadcast::Receiver<Arc<Event>>,
    store: Arc<Store>,
    cursor: u64,
    sandbox: Option<String>,
    backlog: std::collections::VecDeque<Event>,
    catching_up: bool,
}

impl Subscription {
    fn wanted(&self, e: &Event) -> bool {
        self.sandbox.as_deref().is_none_or(|s| s == e.sandbox_id)
    }

    /// The next event; `None` only when the bus is gone (daemon shutting down).
    pub async fn next(&mut self) -> Result<Option<Event>, StoreError> {
        loop {
            while let Some(e) = self.backlog.pop_front() {
                self.cursor = e.id;
                if self.wanted(&e) {
                    return Ok(Some(e));
                }
            }
            if self.catching_up {
                let batch = read_after(&self.store, self.cursor, BATCH)?;
                if batch.is_empty() {
                    self.catching_up = false;
                } else {
                    self.backlog.extend(batch);
                }
                continue;
            }
            match self.rx.recv().await {
                Ok(e) if e.id == 0 => {
                    // Not stored (store error): deliver it, it cannot be resumed anyway.
                    if self.wanted(&e) {
                        return Ok(Some((*e).clone()));
                    }
                }
                Ok(e) if e.id <= self.cursor => {} // already delivered from the backlog
                Ok(e) if e.id > self.cursor + 1 => {
                    // A gap (an event stored but broadcast before we subscribed): re-read.
                    self.catching_up = true;
                }
                Ok(e) => {
                    self.cursor = e.id;
                    if self.wanted(&e) {
                        return Ok(Some((*e).clone()));
                    }
                }
                Err(broadcast::error::RecvError::Lagged(n)) => {
                    tracing::debug!(
                        missed = n,
                        "event follower lagged; catching up from the store"
                    );
                    self.catching_up = true;
                }
                Err(broadcast::error::RecvError::Closed) => return Ok(None),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    fn bus() -> EventBus {
        EventBus::new(Arc::new(Store::in_memory()))
    }

    /// An event without an exec and without data; its id.
    fn publish(b: &EventBus, kind: &str, sandbox: &str) -> u64 {
        b.publish(kind, sandbox, None, serde_json::Value::Null)
    }

    async fn next(s: &mut Subscription) -> Event {
        tokio::time::timeout(Duration::from_secs(5), s.next())
            .await
            .expect("an event within 5 s")
            .unwrap()
            .expect("bus alive")
    }

    #[tokio::test]
    async fn follower_gets_backlog_then_live_events_in_order() {
        let b = bus();
        publish(&b, kind::SANDBOX_CREATED, "sbx_a");
        publish(&b, kind::SANDBOX_READY, "sbx_a");
        let mut s = b.subscribe(Some(0), None).unwrap();
        assert_eq!(next(&mut s).await.id, 1);
        assert_eq!(next(&mut s).await.kind, kind::SANDBOX_READY);
        let publisher = tokio::spawn({
            let b = Arc::new(b);
            async move {
                b.publish(
                    kind::EXEC_STARTED,
                    "sbx_a",
                    Some("exe_1"),
                    serde_json::json!({}),
                );
                b
            }
        });
        let e = next(&mut s).await;
        assert_eq!((e.id, e.exec_id.as_deref()), (3, Some("exe_1")));
        drop(publisher.await.unwrap());
    }

    #[tokio::test]
    async fn resume_skips_seen_events_and_filter_keeps_one_sandbox() {
        let b = bus();
        for (i, s) in ["sbx_a", "sbx_b", "sbx_a", "sbx_b"].iter().enumerate() {
            assert_eq!(publish(&b, kind::SANDBOX_CREATED, s), i as u64 + 1);
        }
        let mut s = b.subscribe(Some(1), Some("sbx_a".into())).unwrap();
        assert_eq!(next(&mut s).await.id, 3);
        publish(&b, kind::SANDBOX_REMOVED, "sbx_b");
        publish(&b, kind::SANDBOX_REMOVED, "sbx_a");
        let e = next(&mut s).await;
        assert_eq!((e.id, e.kind.as_str()), (6, kind::SANDBOX_REMOVED));
    }

    #[tokio::test]
    async fn following_from_now_skips_the_backlog() {
        let b = bus();
        publish(&b, kind::SANDBOX_CREATED, "sbx_a");
        let mut s = b.subscribe(None, None).unwrap();
        publish(&b, kind::SANDBOX_READY, "sbx_a");
        assert_eq!(next(&mut s).await.id, 2);
    }

    #[tokio::test]
    async fn a_flood_of_events_keeps_the_store_at_its_cap() {
        let store = Arc::new(Store::in_memory());
        let cap = 500;
        let b = EventBus::with_retention(
            store.clone(),
            Retention {
                max_count: cap,
                max_age: None,
            },
        );
        let mut s = b.subscribe(Some(0), None).unwrap();
        // A guest flooding denied connections: many more events than the cap.
        let n = cap * 7 + 3;
        for _ in 0..n {
            b.publish(
                "network.denied",
                "sbx_a",
                None,
                serde_json::json!({"ip": "203.0.113.9", "port": 80}),
            );
            assert!(store.event_count().unwrap() <= cap);
        }
        assert_eq!(store.event_count().unwrap(), cap);
        // A follower from 0 resumes at the oldest kept one; the newest are all there.
        assert_eq!(next(&mut s).await.id, n - cap + 1);
        let late = b.subscribe(Some(0), None).unwrap();
        let mut late = late;
        assert_eq!(next(&mut late).await.id, n - cap + 1);
    }

    #[tokio::test]
    async fn events_past_the_age_are_pruned_in_batches() {
        let store = Arc::new(Store::in_memory());
        let old = |i: u64| Event {
            id: 0,
            time: format!("2020-01-01T00:{:02}:{:02}Z", i / 60 % 60, i % 60),
            kind: kind::SANDBOX_CREATED.into(),
            sandbox_id: "sbx_old".into(),
            exec_id: None,
            data: serde_json::Value::Null,
        };
        let n_old = PRUNE_BATCH as u64 * 2 + 17;
        for i in 0..n_old {
            store.append_event(&old(i), None).unwrap();
        }
        let retention = Retention {
            max_count: 1_000_000,
            max_age: Some(Duration::from_secs(86_400)),
        };
        // At start: everything older than a day goes, in several transactions, but the newest
        // event (it carries the numbering on).
        let b = EventBus::with_retention(store.clone(), retention);
        assert_eq!(store.event_count().unwrap(), 1);
        // While running: an old backlog (here written behind the bus's back) is pruned as
        // events come, one batch per check.
        for i in 0..n_old {
            store.append_event(&old(i), None).unwrap();
        }
        let first_new = publish(&b, kind::SANDBOX_READY, "sbx_new");
        assert_eq!(first_new, n_old * 2 + 1, "numbers are never reused");
        for _ in 1..AGE_CHECK_EVERY {
            publish(&b, kind::SANDBOX_READY, "sbx_new");
        }
        let batch = PRUNE_BATCH as u64;
        assert_eq!(
            store.event_count().unwrap(),
            1 + n_old - batch + AGE_CHECK_EVERY
        );
        let now = crate::telemetry::traces::unix_secs_now();
        assert_eq!(b.prune(usize::MAX, now), 1 + n_old - batch);
        assert_eq!(store.event_count().unwrap(), AGE_CHECK_EVERY);
    }

    #[tokio::test]
    async fn a_lagging_follower_catches_up_from_the_store() {
        let b = bus();
        let mut s = b.subscribe(Some(0), None).unwrap();
        let n = LIVE_CAPACITY as u64 * 2 + 10;
        for _ in 0..n {
            publish(&b, kind::EXEC_STARTED, "sbx_a");
        }
        for want in 1..=n {
            assert_eq!(next(&mut s).await.id, want);
        }
    }
}
