//! envd's directory watches: `WatchDir` (a server stream) and the polled watchers of the sync
//! Python SDK (`CreateWatcher`, `GetWatcherEvents`, `RemoveWatcher`).
//!
//! Owns: watching by polling. Every [`POLL`] the watched directory (and, when recursive, its
//! subdirectories, bounded) is listed through the agent and compared with the previous
//! listing: new entries are `CREATE`, gone ones `REMOVE`, a changed size or mtime `WRITE`, a
//! changed mode `CHMOD` (a rename shows as a `REMOVE` and a `CREATE`; changes within one poll
//! merge). Watchers are bounded per sandbox and in queued events, and dropped when their
//! sandbox is gone or nobody asked for their events for [`IDLE`].

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde_json::{Value, json};

use super::connect::{Code, ConnectError};
use crate::rpc::msg::FileKind;
use crate::service::Service;

/// How often a watched directory is listed.
pub const POLL: Duration = Duration::from_millis(500);
/// A polled watcher nobody read for this long is dropped.
const IDLE: Duration = Duration::from_secs(600);
/// Watchers (both kinds) per sandbox.
const MAX_PER_SANDBOX: usize = 16;
/// Events a polled watcher keeps until they are read (older ones are dropped).
const MAX_QUEUED: usize = 10_000;
/// Entries one listing may hold (recursive watches of big trees are refused past it).
const MAX_ENTRIES: usize = 20_000;
/// Deepest recursive listing.
const MAX_DEPTH: usize = 16;

/// What a listing remembers of an entry: kind, size, mtime, mode.
pub type Seen = BTreeMap<String, (FileKind, u64, i64, u32)>;

/// Lists `dir` (relative names, `/`-separated; recursive: every level down to [`MAX_DEPTH`]).
pub async fn snapshot(
    svc: &Service,
    id: &str,
    dir: &str,
    recursive: bool,
) -> Result<Seen, ConnectError> {
    let mut out = Seen::new();
    let mut todo: VecDeque<(String, usize)> = VecDeque::from([(String::new(), 0)]);
    while let Some((rel, depth)) = todo.pop_front() {
        let abs = if rel.is_empty() {
            dir.to_owned()
        } else {
            format!("{}/{rel}", dir.trim_end_matches('/'))
        };
        let entries = match svc.vm_list(id, &abs).await {
            Ok(e) => e,
            // A subdirectory removed between two listings is not an error.
            Err(crate::service::ServiceError::NotFound(_)) if !rel.is_empty() => continue,
            Err(e) => return Err(e.into()),
        };
        for e in entries {
            let name = if rel.is_empty() {
                e.name.clone()
            } else {
                format!("{rel}/{}", e.name)
            };
            if recursive && e.stat.kind == FileKind::Dir && depth + 1 < MAX_DEPTH {
                todo.push_back((name.clone(), depth + 1));
            }
            out.insert(name, (e.stat.kind, e.stat.size, e.stat.mtime, e.stat.mode));
            if out.len() > MAX_ENTRIES {
                return Err(ConnectError::new(
                    Code::ResourceExhausted,
                    format!("more than {MAX_ENTRIES} entries to watch: watch a smaller tree"),
                ));
            }
        }
    }
    Ok(out)
}

/// The events that turn listing `old` into `new`, as `FilesystemEvent` JSON.
pub fn changes(old: &Seen, new: &Seen) -> Vec<Value> {
    let ev = |name: &str, t: &str| json!({ "name": name, "type": t });
    let mut out = Vec::new();
    for (name, now) in new {
        match old.get(name) {
            None => out.push(ev(name, "EVENT_TYPE_CREATE")),
            Some(was) if was.0 != now.0 => {
                out.push(ev(name, "EVENT_TYPE_REMOVE"));
                out.push(ev(name, "EVENT_TYPE_CREATE"));
            }
            Some(was) => {
                if was.1 != now.1 || was.2 != now.2 {
                    out.push(ev(name, "EVENT_TYPE_WRITE"));
                }
                if was.3 != now.3 {
                    out.push(ev(name, "EVENT_TYPE_CHMOD"));
                }
            }
        }
    }
    for name in old.keys().filter(|n| !new.contains_key(*n)) {
        out.push(ev(name, "EVENT_TYPE_REMOVE"));
    }
    out
}

struct Watcher {
    sandbox: String,
    events: VecDeque<Value>,
    /// Set when the watch ended (sandbox gone, directory removed): returned once, then the
    /// watcher is dropped.
    failed: Option<ConnectError>,
    last_read: Instant,
}

/// The polled watchers of every sandbox.
#[derive(Default, Clone)]
pub struct Watchers {
    inner: Arc<Mutex<HashMap<String, Watcher>>>,
}

impl Watchers {
    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, Watcher>> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Watchers of `sandbox` right now (both kinds count against [`MAX_PER_SANDBOX`]).
    pub fn count(&self, sandbox: &str) -> usize {
        self.lock()
            .values()
            .filter(|w| w.sandbox == sandbox)
            .count()
    }

    pub fn check_room(&self, sandbox: &str, streams: usize) -> Result<(), ConnectError> {
        if self.count(sandbox) + streams >= MAX_PER_SANDBOX {
            return Err(ConnectError::new(
                Code::ResourceExhausted,
                format!("at most {MAX_PER_SANDBOX} directory watches per sandbox"),
            ));
        }
        Ok(())
    }

    /// Start a polled watcher on `dir` (whose first listing is `base`): its id.
    pub fn create(
        &self,
        svc: Arc<Service>,
        sandbox: &str,
        dir: String,
        recursive: bool,
        base: Seen,
    ) -> String {
        let id = crate::service::e2b::new_token()[..24].to_owned();
        self.lock().insert(
            id.clone(),
            Watcher {
                sandbox: sandbox.to_owned(),
                events: VecDeque::new(),
                failed: None,
                last_read: Instant::now(),
            },
        );
        let (me, wid, sbx) = (self.clone(), id.clone(), sandbox.to_owned());
        tokio::spawn(async move {
            let mut seen = base;
            loop {
                tokio::time::sleep(POLL).await;
                {
                    let map = me.lock();
                    match map.get(&wid) {
                        None => return,
                        Some(w) if w.last_read.elapsed() > IDLE => {
                            drop(map);
                            me.lock().remove(&wid);
                            return;
                        }
                        Some(_) => {}
                    }
                }
                match snapshot(&svc, &sbx, &dir, recursive).await {
                    Ok(now) => {
                        let evs = changes(&seen, &now);
                        seen = now;
                        let mut map = me.lock();
                        let Some(w) = map.get_mut(&wid) else { return };
                        w.events.extend(evs);
                        while w.events.len() > MAX_QUEUED {
                            w.events.pop_front();
                        }
                    }
                    Err(e) => {
                        if let Some(w) = me.lock().get_mut(&wid) {
                            w.failed = Some(e);
                        }
                        return;
                    }
                }
            }
        });
        id
    }

    /// The events queued since the last call (a failed watch answers its error once, then is
    /// gone).
    pub fn take(&self, sandbox: &str, id: &str) -> Result<Vec<Value>, ConnectError> {
        let mut map = self.lock();
        let w = map
            .get_mut(id)
            .filter(|w| w.sandbox == sandbox)
            .ok_or_else(|| ConnectError::new(Code::NotFound, format!("watcher {id} not found")))?;
        w.last_read = Instant::now();
        if let Some(e) = w.failed.take() {
            map.remove(id);
            return Err(e);
        }
        Ok(w.events.drain(..).collect())
    }

    pub fn remove(&self, sandbox: &str, id: &str) -> Result<(), ConnectError> {
        let mut map = self.lock();
        match map.get(id) {
            Some(w) if w.sandbox == sandbox => {
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

    fn seen(items: &[(&str, FileKind, u64, i64, u32)]) -> Seen {
        items
            .iter()
            .map(|(n, k, s, m, p)| ((*n).to_owned(), (*k, *s, *m, *p)))
            .collect()
    }

    #[test]
    fn listings_turn_into_create_write_chmod_and_remove() {
        use FileKind::*;
        let old = seen(&[
            ("a", File, 1, 10, 0o644),
            ("b", File, 1, 10, 0o644),
            ("d", Dir, 0, 1, 0o755),
            ("x", File, 1, 1, 0o644),
        ]);
        let new = seen(&[
            ("a", File, 2, 11, 0o644),
            ("b", File, 1, 10, 0o600),
            ("c", File, 0, 12, 0o644),
            ("d", File, 0, 1, 0o644),
        ]);
        let got: Vec<(String, String)> = changes(&old, &new)
            .into_iter()
            .map(|v| {
                (
                    v["name"].as_str().unwrap().to_owned(),
                    v["type"].as_str().unwrap().to_owned(),
                )
            })
            .collect();
        let want = [
            ("a", "EVENT_TYPE_WRITE"),
            ("b", "EVENT_TYPE_CHMOD"),
            ("c", "EVENT_TYPE_CREATE"),
            ("d", "EVENT_TYPE_REMOVE"),
            ("d", "EVENT_TYPE_CREATE"),
            ("x", "EVENT_TYPE_REMOVE"),
        ];
        assert_eq!(
            got,
            want.map(|(a, b)| (a.to_owned(), b.to_owned())).to_vec()
        );
        assert!(changes(&new, &new).is_empty());
    }

    #[test]
    fn watchers_belong_to_their_sandbox_and_are_bounded() {
        let w = Watchers::default();
        w.lock().insert(
            "w1".into(),
            Watcher {
                sandbox: "s1".into(),
                events: VecDeque::from([json!({"name":"a"})]),
                failed: None,
                last_read: Instant::now(),
            },
        );
        assert_eq!(w.take("s2", "w1").unwrap_err().code, Code::NotFound);
        assert_eq!(w.take("s1", "w1").unwrap().len(), 1);
        assert!(w.take("s1", "w1").unwrap().is_empty());
        assert!(w.remove("s2", "w1").is_err());
        w.remove("s1", "w1").unwrap();
        assert!(w.take("s1", "w1").is_err());
        for i in 0..MAX_PER_SANDBOX {
            w.lock().insert(
                format!("x{i}"),
                Watcher {
                    sandbox: "s1".into(),
                    events: VecDeque::new(),
                    failed: None,
                    last_read: Instant::now(),
                },
            );
        }
        assert_eq!(
            w.check_room("s1", 0).unwrap_err().code,
            Code::ResourceExhausted
        );
        assert!(w.check_room("s2", 0).is_ok());
    }
}
