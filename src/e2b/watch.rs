//! envd's directory watches: `WatchDir` (a server stream) and the polled watchers of the sync
//! Python SDK (`CreateWatcher`, `GetWatcherEvents`, `RemoveWatcher`).
//!
//! Owns: the bookkeeping of watches per sandbox and envd's JSON of an event. The watching
//! itself is inotify in the guest (`Service::vm_watch_dir`, the agent's `WatchDir` request):
//! events arrive as they happen, a rename is a `RENAME` of the old name and a `CREATE` of the
//! new one. Watchers are bounded per sandbox ([`MAX_PER_SANDBOX`], both kinds) and in queued
//! events ([`MAX_QUEUED`], the oldest dropped), and a polled watcher is dropped when nobody asked
//! for its events for [`IDLE`] (its guest watch is cancelled). A watch whose VM went away
//! (stopped, paused, restored) or whose directory was removed ends with a Connect error: the
//! stream's end, or the next `GetWatcherEvents`.

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde_json::{Value, json};
use tokio::sync::Notify;

use super::connect::{Code, ConnectError};
use crate::rpc::msg::{WatchEvent, WatchKind};
use crate::service::vmfs::VmWatch;

/// A polled watcher nobody read for this long is dropped.
const IDLE: Duration = Duration::from_secs(600);
/// How often a polled watcher checks whether it went idle (a host timer; the guest is not
/// asked anything).
const IDLE_CHECK: Duration = Duration::from_secs(30);
/// Watchers (both kinds) per sandbox.
const MAX_PER_SANDBOX: usize = 16;
/// Events a polled watcher keeps until they are read (older ones are dropped).
pub const MAX_QUEUED: usize = 10_000;

/// envd's name of an event kind.
pub fn type_name(k: WatchKind) -> &'static str {
    match k {
        WatchKind::Create => "EVENT_TYPE_CREATE",
        WatchKind::Write => "EVENT_TYPE_WRITE",
        WatchKind::Remove => "EVENT_TYPE_REMOVE",
        WatchKind::Rename => "EVENT_TYPE_RENAME",
        WatchKind::Chmod => "EVENT_TYPE_CHMOD",
    }
}

/// An event as envd's `FilesystemEvent` JSON.
pub fn event_json(e: &WatchEvent) -> Value {
    json!({ "name": e.name, "type": type_name(e.kind) })
}

struct Watcher {
    sandbox: String,
    /// A `WatchDir` stream: counted, but not readable through `GetWatcherEvents`.
    stream: bool,
    events: VecDeque<Value>,
    /// Set when the watch ended (VM gone, directory removed): returned once, then the
    /// watcher is dropped.
    failed: Option<ConnectError>,
    last_read: Instant,
    /// Ends the watcher's task (and with it the guest's watch).
    stop: Arc<Notify>,
}

impl Watcher {
    fn new(sandbox: &str, stream: bool) -> Watcher {
        Watcher {
            sandbox: sandbox.to_owned(),
            stream,
            events: VecDeque::new(),
            failed: None,
            last_read: Instant::now(),
            stop: Arc::new(Notify::new()),
        }
    }

    /// Queues `evs`, dropping the oldest past [`MAX_QUEUED`].
    fn queue(&mut self, evs: impl IntoIterator<Item = Value>) {
        self.events.extend(evs);
        let over = self.events.len().saturating_sub(MAX_QUEUED);
        if over > 0 {
            self.events.drain(..over);
        }
    }
}

/// The watches of every sandbox.
#[derive(Default, Clone)]
pub struct Watchers {
    inner: Arc<Mutex<HashMap<String, Watcher>>>,
}

/// A `WatchDir` stream's place among its sandbox's watches; given back when dropped.
pub struct StreamSlot {
    watchers: Watchers,
    id: String,
}

impl Drop for StreamSlot {
    fn drop(&mut self) {
        self.watchers.lock().remove(&self.id);
    }
}

impl Watchers {
    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, Watcher>> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Watchers of `sandbox` right now (both kinds count against [`MAX_PER_SANDBOX`]).
    #[cfg(test)]
    pub fn count(&self, sandbox: &str) -> usize {
        self.lock()
            .values()
            .filter(|w| w.sandbox == sandbox)
            .count()
    }

    /// Whether `sandbox` may have one more watch (checked before the guest is asked, and again
    /// when the watch is registered).
    pub fn check_room(&self, sandbox: &str) -> Result<(), ConnectError> {
        Self::room(&self.lock(), sandbox)
    }

    fn room(map: &HashMap<String, Watcher>, sandbox: &str) -> Result<(), ConnectError> {
        if map.values().filter(|w| w.sandbox == sandbox).count() >= MAX_PER_SANDBOX {
            return Err(ConnectError::new(
                Code::ResourceExhausted,
                format!("at most {MAX_PER_SANDBOX} directory watches per sandbox"),
            ));
        }
        Ok(())
    }

    /// Registers `watcher` under a new id if its sandbox has room.
    fn insert(&self, watcher: Watcher) -> Result<String, ConnectError> {
        let mut map = self.lock();
        Self::room(&map, &watcher.sandbox)?;
        let id = crate::service::e2b::new_token()[..24].to_owned();
        map.insert(id.clone(), watcher);
        Ok(id)
    }

    /// Counts a `WatchDir` stream of `sandbox` until the slot is dropped.
    pub fn stream_slot(&self, sandbox: &str) -> Result<StreamSlot, ConnectError> {
        let id = self.insert(Watcher::new(sandbox, true))?;
        Ok(StreamSlot {
            watchers: self.clone(),
            id,
        })
    }

    /// A polled watcher fed by `watch` (already in place in the guest): its id.
    pub fn create(&self, sandbox: &str, watch: VmWatch) -> Result<String, ConnectError> {
        let w = Watcher::new(sandbox, false);
        let stop = w.stop.clone();
        let id = self.insert(w)?;
        let (me, wid) = (self.clone(), id.clone());
        tokio::spawn(async move {
            let mut check = tokio::time::interval(IDLE_CHECK);
            check.reset();
            let mut watch = Some(watch);
            loop {
                let next = async {
                    match watch.as_mut() {
                        Some(w) => w.next().await,
                        None => std::future::pending().await,
                    }
                };
                let r = tokio::select! {
                    () = stop.notified() => return,
                    _ = check.tick() => {
                        if me.drop_if_idle(&wid) {
                            return;
                        }
                        continue;
                    }
                    r = next => r,
                };
                let mut map = me.lock();
                let Some(w) = map.get_mut(&wid) else { return };
                let failed = match r {
                    Ok(Some(batch)) => {
                        if batch.lost > 0 {
                            tracing::debug!(watcher = %wid, lost = batch.lost, "the guest dropped watch events");
                        }
                        w.queue(batch.events.iter().map(event_json));
                        continue;
                    }
                    Ok(None) => ConnectError::new(Code::Unavailable, "the watch ended"),
                    Err(e) => e.into(),
                };
                // The error waits for a reader (or the idle drop); the VM is let go now.
                w.failed = Some(failed);
                watch = None;
            }
        });
        Ok(id)
    }

    /// Drops watcher `id` if nobody read it for [`IDLE`]; true when it is gone.
    fn drop_if_idle(&self, id: &str) -> bool {
        let mut map = self.lock();
        match map.get(id) {
            Some(w) if w.last_read.elapsed() <= IDLE => false,
            Some(_) => {
                tracing::debug!(watcher = %id, "dropping an idle directory watcher");
                map.remove(id);
                true
            }
            None => true,
        }
    }

    /// The events queued since the last call (a failed watch answers its error once, then is
    /// gone).
    pub fn take(&self, sandbox: &str, id: &str) -> Result<Vec<Value>, ConnectError> {
        let mut map = self.lock();
        let w = map
            .get_mut(id)
            .filter(|w| w.sandbox == sandbox && !w.stream)
            .ok_or_else(|| ConnectError::new(Code::NotFound, format!("watcher {id} not found")))?;
        w.last_read = Instant::now();
        if let Some(e) = w.failed.take() {
            map.remove(id);
            return Err(e);
        }
        Ok(w.events.drain(..).collect())
    }

    /// Removes a polled watcher; its guest watch is cancelled.
    pub fn remove(&self, sandbox: &str, id: &str) -> Result<(), ConnectError> {
        let mut map = self.lock();
        match map.get(id) {
            Some(w) if w.sandbox == sandbox && !w.stream => {
                w.stop.notify_one();
                map.remove(id);
                Ok(())
            }
            _ => Err(ConnectError::new(
                Code::NotFound,
                format!("watcher {id} not found"),
            )),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn events_are_envd_json() {
        let ev = |name: &str, kind| {
            event_json(&WatchEvent {
                name: name.into(),
                kind,
            })
        };
        assert_eq!(
            ev("a/b", WatchKind::Rename),
            json!({"name": "a/b", "type": "EVENT_TYPE_RENAME"})
        );
        assert_eq!(ev("x", WatchKind::Create)["type"], "EVENT_TYPE_CREATE");
        assert_eq!(ev("x", WatchKind::Write)["type"], "EVENT_TYPE_WRITE");
        assert_eq!(ev("x", WatchKind::Remove)["type"], "EVENT_TYPE_REMOVE");
        assert_eq!(ev("x", WatchKind::Chmod)["type"], "EVENT_TYPE_CHMOD");
    }

    #[test]
    fn the_queue_keeps_the_newest_events() {
        let mut w = Watcher::new("s", false);
        w.queue((0..MAX_QUEUED + 5).map(|i| json!(i)));
        assert_eq!(w.events.len(), MAX_QUEUED);
        assert_eq!(w.events.front(), Some(&json!(5)));
        assert_eq!(w.events.back(), Some(&json!(MAX_QUEUED + 4)));
    }

    #[test]
    fn watchers_belong_to_their_sandbox_and_are_bounded() {
        let w = Watchers::default();
        let mut one = Watcher::new("s1", false);
        one.events.push_back(json!({"name":"a"}));
        w.lock().insert("w1".into(), one);
        assert_eq!(w.take("s2", "w1").unwrap_err().code, Code::NotFound);
        assert_eq!(w.take("s1", "w1").unwrap().len(), 1);
        assert!(w.take("s1", "w1").unwrap().is_empty());
        assert!(w.remove("s2", "w1").is_err());
        w.remove("s1", "w1").unwrap();
        assert!(w.take("s1", "w1").is_err());
        // Streams count, but are not polled watchers.
        let slot = w.stream_slot("s1").unwrap();
        assert_eq!(w.count("s1"), 1);
        assert_eq!(w.take("s1", &slot.id).unwrap_err().code, Code::NotFound);
        assert!(w.remove("s1", &slot.id).is_err());
        drop(slot);
        assert_eq!(w.count("s1"), 0);
        let slots: Vec<_> = (0..MAX_PER_SANDBOX)
            .map(|_| w.stream_slot("s1").unwrap())
            .collect();
        assert_eq!(
            w.check_room("s1").unwrap_err().code,
            Code::ResourceExhausted
        );
        assert_eq!(
            w.stream_slot("s1").err().unwrap().code,
            Code::ResourceExhausted
        );
        assert!(w.check_room("s2").is_ok());
        drop(slots);
        assert!(w.check_room("s1").is_ok());
    }

    #[tokio::test]
    async fn a_failed_watch_is_reported_once() {
        let w = Watchers::default();
        let mut f = Watcher::new("s1", false);
        f.failed = Some(ConnectError::new(Code::Unavailable, "VM gone"));
        w.lock().insert("w1".into(), f);
        assert_eq!(w.take("s1", "w1").unwrap_err().code, Code::Unavailable);
        assert_eq!(w.take("s1", "w1").unwrap_err().code, Code::NotFound);
    }
}
