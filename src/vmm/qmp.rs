//! A small asynchronous QMP (QEMU Machine Protocol) client over a unix socket.
//!
//! Owns: the QMP handshake (greeting, `qmp_capabilities`), sending commands with a numeric
//! `id` and matching each reply to its caller, and delivering asynchronous events
//! (`SHUTDOWN`, `STOP`, `RESUME`, `MIGRATION`...) on a channel.
//! Never: decides policy (when to stop or kill a VM is `qemu.rs`'s job), or keeps a connection
//! open longer than its owner wants: QEMU serves one QMP client at a time per socket, so holders
//! should drop the client when done.
//!
//! The client is general: [`QmpClient::execute`] takes any command and arguments; the typed
//! helpers below are the commands tryboxi needs now plus the migration family used by snapshots.

use std::collections::HashMap;
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use serde::Deserialize;
use serde::de::DeserializeOwned;
use serde_json::{Map, Value, json};
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::UnixStream;
use tokio::net::unix::OwnedWriteHalf;
use tokio::sync::{Mutex, mpsc, oneshot};

/// How many undelivered events are kept before new ones are dropped (with a warning).
const EVENT_BACKLOG: usize = 64;
/// How long a command may wait for its reply. QEMU answers every command the daemon sends
/// promptly (long work such as `migrate` runs in the background and is polled), so a reply that
/// does not come means QEMU's main loop is stuck: the caller gets an error instead of waiting
/// forever with the sandbox's lock held.
pub const COMMAND_TIMEOUT: Duration = Duration::from_secs(60);
/// Longest accepted QMP line (replies such as `query-migrate` are a few KiB at most).
const MAX_LINE: usize = 1 << 20;

#[derive(Debug, thiserror::Error)]
pub enum QmpError {
    #[error("cannot connect to the QMP socket {path}: {source}")]
    Connect {
        path: String,
        #[source]
        source: std::io::Error,
    },
    #[error("QMP I/O error: {0}")]
    Io(#[from] std::io::Error),
    #[error("QMP protocol error: {0} (is this really a QEMU monitor socket?)")]
    Protocol(String),
    /// QEMU answered the command with an `error` object.
    #[error("QMP command `{command}` failed: {class}: {desc}")]
    Command {
        command: String,
        class: String,
        desc: String,
    },
    #[error("the QMP connection closed (QEMU exited or another client took the monitor)")]
    Disconnected,
    #[error("timed out after {0:?} waiting for QMP {1}")]
    Timeout(Duration, String),
}

/// An asynchronous QMP event, e.g. `SHUTDOWN` with `{"guest": true, "reason": "guest-reset"}`.
#[derive(Debug, Clone, PartialEq)]
pub struct QmpEvent {
    pub name: String,
    pub data: Value,
    /// Seconds and microseconds since the epoch, as QEMU reported them.
    pub timestamp: (i64, i64),
}

/// The QEMU version from the QMP greeting.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
pub struct QmpVersion {
    pub major: u32,
    pub minor: u32,
    pub micro: u32,
}

/// Reply of `query-status`.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
pub struct VmStatus {
    pub running: bool,
    /// `running`, `paused`, `prelaunch`, `inmigrate`, `postmigrate`, `shutdown`...
    pub status: String,
}

type Reply = Result<Value, (String, String)>;
type Pending = Arc<std::sync::Mutex<PendingState>>;

#[derive(Default)]
struct PendingState {
    waiters: HashMap<u64, oneshot::Sender<Reply>>,
    /// Set once the reader saw EOF or an error: later commands fail at once.
    closed: bool,
}

/// A connected, negotiated QMP session. Dropping it closes the connection.
pub struct QmpClient {
    writer: Mutex<OwnedWriteHalf>,
    pending: Pending,
    next_id: AtomicU64,
    // Events and the version are read by the tests only (tryboxi waits on replies, not events).
    #[cfg_attr(not(test), allow(dead_code))]
    events: std::sync::Mutex<Option<mpsc::Receiver<QmpEvent>>>,
    #[cfg_attr(not(test), allow(dead_code))]
    version: QmpVersion,
    reader: tokio::task::JoinHandle<()>,
    /// See [`COMMAND_TIMEOUT`].
    command_timeout: Duration,
}

impl Drop for QmpClient {
    fn drop(&mut self) {
        self.reader.abort();
    }
}

impl QmpClient {
    /// Connect, read the greeting and negotiate capabilities, all within `timeout`.
    pub async fn connect(path: &Path, timeout: Duration) -> Result<QmpClient, QmpError> {
        tokio::time::timeout(timeout, Self::connect_inner(path))
            .await
            .map_err(|_| QmpError::Timeout(timeout, "greeting".into()))?
    }

    async fn connect_inner(path: &Path) -> Result<QmpClient, QmpError> {
        let stream = UnixStream::connect(path)
            .await
            .map_err(|source| QmpError::Connect {
                path: path.display().to_string(),
                source,
            })?;
        let (read, writer) = stream.into_split();
        let mut read = BufReader::new(read);
        let greeting = read_message(&mut read)
            .await?
            .ok_or(QmpError::Disconnected)?;
        let version = parse_greeting(&greeting)?;

        let pending: Pending = Arc::default();
        let (tx, rx) = mpsc::channel(EVENT_BACKLOG);
        let reader = tokio::spawn(reader_loop(read, pending.clone(), tx));
        let client = QmpClient {
            writer: Mutex::new(writer),
            pending,
            next_id: AtomicU64::new(1),
            events: std::sync::Mutex::new(Some(rx)),
            version,
            reader,
            command_timeout: COMMAND_TIMEOUT,
        };
        client.execute("qmp_capabilities", None).await?;
        Ok(client)
    }

    /// QEMU's version as announced in the greeting.
    #[cfg(test)]
    pub fn version(&self) -> QmpVersion {
        self.version
    }

    /// The event stream; `Some` only on the first call. Events are buffered from the moment
    /// the connection is made; when the buffer is full, new events are dropped.
    #[cfg(test)]
    pub fn take_events(&self) -> Option<mpsc::Receiver<QmpEvent>> {
        self.events.lock().ok()?.take()
    }

    /// Wait at most `d` for each command's reply (default [`COMMAND_TIMEOUT`]).
    #[cfg(test)]
    pub fn set_command_timeout(&mut self, d: Duration) {
        self.command_timeout = d;
    }

    /// Run any QMP command and return its `return` value; a reply that does not come within
    /// the command timeout is a [`QmpError::Timeout`].
    pub async fn execute(
        &self,
        command: &str,
        arguments: Option<Value>,
    ) -> Result<Value, QmpError> {
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        match tokio::time::timeout(
            self.command_timeout,
            self.execute_id(id, command, arguments),
        )
        .await
        {
            Ok(r) => r,
            Err(_) => {
                if let Ok(mut p) = self.pending.lock() {
                    p.waiters.remove(&id);
                }
                tracing::warn!(
                    command,
                    timeout_s = self.command_timeout.as_secs(),
                    "QEMU did not answer a QMP command"
                );
                Err(QmpError::Timeout(
                    self.command_timeout,
                    format!("the reply to `{command}` (QEMU is not answering its monitor)"),
                ))
            }
        }
    }

    async fn execute_id(
        &self,
        id: u64,
        command: &str,
        arguments: Option<Value>,
    ) -> Result<Value, QmpError> {
        let (tx, rx) = oneshot::channel();
        {
            let mut p = self
                .pending
                .lock()
                .map_err(|_| QmpError::Protocol("pending-reply table poisoned".into()))?;
            if p.closed {
                return Err(QmpError::Disconnected);
            }
            p.waiters.insert(id, tx);
        }
        let mut msg = Map::new();
        msg.insert("execute".into(), Value::String(command.into()));
        if let Some(args) = arguments {
            msg.insert("arguments".into(), args);
        }
        msg.insert("id".into(), json!(id));
        let mut line = serde_json::to_vec(&Value::Object(msg))
            .map_err(|e| QmpError::Protocol(format!("cannot encode `{command}`: {e}")))?;
        line.push(b'\n');
        let written = {
            let mut w = self.writer.lock().await;
            w.write_all(&line).await
        };
        if let Err(e) = written {
            if let Ok(mut p) = self.pending.lock() {
                p.waiters.remove(&id);
            }
            return Err(match e.kind() {
                std::io::ErrorKind::BrokenPipe | std::io::ErrorKind::ConnectionReset => {
                    QmpError::Disconnected
                }
                _ => QmpError::Io(e),
            });
        }
        match rx.await {
            Ok(Ok(v)) => Ok(v),
            Ok(Err((class, desc))) => Err(QmpError::Command {
                command: command.into(),
                class,
                desc,
            }),
            Err(_) => Err(QmpError::Disconnected),
        }
    }

    /// Run a command and decode its `return` value.
    pub async fn execute_as<T: DeserializeOwned>(
        &self,
        command: &str,
        arguments: Option<Value>,
    ) -> Result<T, QmpError> {
        let v = self.execute(command, arguments).await?;
        serde_json::from_value(v)
            .map_err(|e| QmpError::Protocol(format!("unexpected reply to `{command}`: {e}")))
    }

    pub async fn query_status(&self) -> Result<VmStatus, QmpError> {
        self.execute_as("query-status", None).await
    }

    /// Pause the vCPUs.
    pub async fn stop(&self) -> Result<(), QmpError> {
        self.execute("stop", None).await.map(drop)
    }

    /// Resume the vCPUs.
    pub async fn cont(&self) -> Result<(), QmpError> {
        self.execute("cont", None).await.map(drop)
    }

    /// Make QEMU exit. The connection closing before the reply arrives also counts as success.
    pub async fn quit(&self) -> Result<(), QmpError> {
        match self.execute("quit", None).await {
            Ok(_) | Err(QmpError::Disconnected) => Ok(()),
            Err(e) => Err(e),
        }
    }

    /// `migrate-set-capabilities`, e.g. `[("x-ignore-shared", true)]`.
    pub async fn migrate_set_capabilities(&self, caps: &[(&str, bool)]) -> Result<(), QmpError> {
        let list: Vec<Value> = caps
            .iter()
            .map(|(c, on)| json!({"capability": c, "state": on}))
            .collect();
        self.execute(
            "migrate-set-capabilities",
            Some(json!({ "capabilities": list })),
        )
        .await
        .map(drop)
    }

    /// Start an outgoing migration, e.g. `file:/path/state.bin`.
    pub async fn migrate(&self, uri: &str) -> Result<(), QmpError> {
        self.execute("migrate", Some(json!({ "uri": uri })))
            .await
            .map(drop)
    }

    /// Start an incoming migration on a QEMU launched with `-incoming defer`.
    pub async fn migrate_incoming(&self, uri: &str) -> Result<(), QmpError> {
        self.execute("migrate-incoming", Some(json!({ "uri": uri })))
            .await
            .map(drop)
    }

    /// `query-migrate` as raw JSON (its shape varies with the migration state).
    pub async fn query_migrate(&self) -> Result<Value, QmpError> {
        self.execute("query-migrate", None).await
    }
}

fn parse_greeting(v: &Value) -> Result<QmpVersion, QmpError> {
    let qemu = v
        .get("QMP")
        .and_then(|q| q.get("version"))
        .and_then(|v| v.get("qemu"))
        .ok_or_else(|| QmpError::Protocol(format!("expected a QMP greeting, got {v}")))?;
    serde_json::from_value(qemu.clone())
        .map_err(|e| QmpError::Protocol(format!("bad version in the QMP greeting: {e}")))
}

/// Read one newline-terminated JSON message; `None` at end of stream.
async fn read_message<R: tokio::io::AsyncBufRead + Unpin>(
    r: &mut R,
) -> Result<Option<Value>, QmpError> {
    let mut line = Vec::new();
    loop {
        line.clear();
        let n = (&mut *r)
            .take(MAX_LINE as u64 + 1)
            .read_until(b'\n', &mut line)
            .await?;
        if n == 0 {
            return Ok(None);
        }
        if line.len() > MAX_LINE {
            return Err(QmpError::Protocol(format!(
                "message longer than {MAX_LINE} bytes"
            )));
        }
        if line.iter().all(u8::is_ascii_whitespace) {
            continue;
        }
        return serde_json::from_slice(&line)
            .map(Some)
            .map_err(|e| QmpError::Protocol(format!("invalid JSON from QEMU: {e}")));
    }
}

async fn reader_loop<R: tokio::io::AsyncBufRead + Unpin>(
    mut r: R,
    pending: Pending,
    events: mpsc::Sender<QmpEvent>,
) {
    loop {
        match read_message(&mut r).await {
            Ok(Some(msg)) => dispatch(msg, &pending, &events),
            Ok(None) => break,
            Err(e) => {
                tracing::warn!(error = %e, "QMP connection dropped");
                break;
            }
        }
    }
    if let Ok(mut p) = pending.lock() {
        p.closed = true;
        // Dropping the senders wakes every waiter with `Disconnected`.
        p.waiters.clear();
    }
}

fn dispatch(msg: Value, pending: &Pending, events: &mpsc::Sender<QmpEvent>) {
    if let Some(name) = msg.get("event").and_then(Value::as_str) {
        let ts = msg.get("timestamp");
        let field = |k: &str| ts.and_then(|t| t.get(k)).and_then(Value::as_i64);
        let ev = QmpEvent {
            name: name.to_owned(),
            data: msg.get("data").cloned().unwrap_or(Value::Null),
            timestamp: (
                field("seconds").unwrap_or(0),
                field("microseconds").unwrap_or(0),
            ),
        };
        tracing::debug!(event = %ev.name, data = %ev.data, "QMP event");
        if let Err(mpsc::error::TrySendError::Full(ev)) = events.try_send(ev) {
            tracing::warn!(event = %ev.name, "QMP event backlog full; event dropped");
        }
        return;
    }
    let Some(id) = msg.get("id").and_then(Value::as_u64) else {
        tracing::warn!(message = %msg, "QMP message without id or event; ignored");
        return;
    };
    let reply = if let Some(v) = msg.get("return") {
        Ok(v.clone())
    } else if let Some(e) = msg.get("error") {
        let s = |k: &str| e.get(k).and_then(Value::as_str).unwrap_or("?").to_owned();
        Err((s("class"), s("desc")))
    } else {
        tracing::warn!(message = %msg, "QMP reply with neither return nor error; ignored");
        return;
    };
    let waiter = pending.lock().ok().and_then(|mut p| p.waiters.remove(&id));
    match waiter {
        // The caller may have given up (dropped its future): nothing to do.
        Some(tx) => drop(tx.send(reply)),
        None => tracing::warn!(id, "QMP reply for an unknown id; ignored"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::net::UnixListener;

    /// A scripted QMP peer: sends a greeting, then answers each command with `respond`.
    /// Returns every command it received when the client disconnects.
    fn fake_qmp<F>(
        dir: &Path,
        respond: F,
    ) -> (std::path::PathBuf, tokio::task::JoinHandle<Vec<Value>>)
    where
        F: Fn(&Value) -> Vec<Value> + Send + 'static,
    {
        let path = dir.join("qmp.sock");
        let listener = UnixListener::bind(&path).expect("bind fake QMP socket");
        let h = tokio::spawn(async move {
            let (s, _) = listener.accept().await.expect("accept");
            let (r, mut w) = s.into_split();
            let mut r = BufReader::new(r);
            let greeting = json!({"QMP": {"version": {"qemu": {"major": 10, "minor": 0, "micro": 2}, "package": ""}, "capabilities": []}});
            w.write_all(format!("{greeting}\r\n").as_bytes())
                .await
                .expect("write");
            let mut seen = Vec::new();
            while let Ok(Some(cmd)) = read_message(&mut r).await {
                for out in respond(&cmd) {
                    if out == json!("CLOSE") {
                        seen.push(cmd);
                        return seen;
                    }
                    w.write_all(format!("{out}\r\n").as_bytes())
                        .await
                        .expect("write");
                }
                seen.push(cmd);
            }
            seen
        });
        (path, h)
    }

    fn ok(cmd: &Value, ret: Value) -> Value {
        json!({"return": ret, "id": cmd["id"]})
    }

    const T: Duration = Duration::from_secs(5);

    #[tokio::test]
    async fn handshake_negotiates_capabilities_and_reads_version() {
        let dir = tempfile::tempdir().expect("tempdir");
        let (path, h) = fake_qmp(dir.path(), |c| vec![ok(c, json!({}))]);
        let c = QmpClient::connect(&path, T).await.expect("connect");
        assert_eq!(
            c.version(),
            QmpVersion {
                major: 10,
                minor: 0,
                micro: 2
            }
        );
        drop(c);
        let seen = h.await.expect("peer");
        assert_eq!(seen.len(), 1);
        assert_eq!(seen[0]["execute"], "qmp_capabilities");
    }

    #[tokio::test]
    async fn replies_are_matched_by_id_even_out_of_order() {
        let dir = tempfile::tempdir().expect("tempdir");
        // Holds back the first of two `x-*` commands and answers both, in reverse order,
        // once the second arrives; each reply names the command it answers.
        let held = std::sync::Mutex::new(None::<Value>);
        let (path, _h) = fake_qmp(dir.path(), move |c| {
            let name = c["execute"].as_str().unwrap_or_default().to_owned();
            if !name.starts_with("x-") {
                return vec![ok(c, json!({}))];
            }
            let mut held = held.lock().expect("lock");
            match held.take() {
                None => {
                    *held = Some(c.clone());
                    vec![]
                }
                Some(first) => vec![
                    ok(c, json!({ "cmd": name })),
                    ok(&first, json!({ "cmd": first["execute"] })),
                ],
            }
        });
        let c = QmpClient::connect(&path, T).await.expect("connect");
        let (a, b) = tokio::join!(c.execute("x-first", None), c.execute("x-second", None));
        assert_eq!(a.expect("first")["cmd"], "x-first");
        assert_eq!(b.expect("second")["cmd"], "x-second");
    }

    #[tokio::test]
    async fn error_reply_becomes_command_error_with_class_and_desc() {
        let dir = tempfile::tempdir().expect("tempdir");
        let (path, _h) = fake_qmp(dir.path(), |c| {
            if c["execute"] == "cont" {
                vec![
                    json!({"error": {"class": "GenericError", "desc": "migration in progress"}, "id": c["id"]}),
                ]
            } else {
                vec![ok(c, json!({}))]
            }
        });
        let c = QmpClient::connect(&path, T).await.expect("connect");
        match c.cont().await {
            Err(QmpError::Command {
                command,
                class,
                desc,
            }) => {
                assert_eq!(command, "cont");
                assert_eq!(class, "GenericError");
                assert_eq!(desc, "migration in progress");
            }
            other => panic!("expected a command error, got {other:?}"),
        }
        // The session survives an error reply.
        c.stop().await.expect("stop after error");
    }

    #[tokio::test]
    async fn a_command_qemu_never_answers_times_out_and_the_session_goes_on() {
        let dir = tempfile::tempdir().expect("tempdir");
        let (path, _h) = fake_qmp(dir.path(), |c| {
            if c["execute"] == "stop" {
                vec![]
            } else {
                vec![ok(c, json!({}))]
            }
        });
        let mut c = QmpClient::connect(&path, T).await.expect("connect");
        c.set_command_timeout(Duration::from_millis(200));
        let r = tokio::time::timeout(T, c.stop()).await.expect("no hang");
        match r {
            Err(QmpError::Timeout(d, what)) => {
                assert_eq!(d, Duration::from_millis(200));
                assert!(what.contains("`stop`"), "{what}");
            }
            other => panic!("expected a timeout, got {other:?}"),
        }
        assert!(c.pending.lock().expect("lock").waiters.is_empty());
        c.cont().await.expect("a later command is answered");
    }

    #[tokio::test]
    async fn events_are_delivered_on_the_channel() {
        let dir = tempfile::tempdir().expect("tempdir");
        let (path, _h) = fake_qmp(dir.path(), |c| {
            if c["execute"] == "stop" {
                vec![
                    json!({"event": "STOP", "timestamp": {"seconds": 7, "microseconds": 9}}),
                    ok(c, json!({})),
                ]
            } else {
                vec![ok(c, json!({}))]
            }
        });
        let c = QmpClient::connect(&path, T).await.expect("connect");
        let mut ev = c.take_events().expect("first take");
        assert!(c.take_events().is_none());
        c.stop().await.expect("stop");
        let e = tokio::time::timeout(T, ev.recv())
            .await
            .expect("event in time")
            .expect("event");
        assert_eq!(e.name, "STOP");
        assert_eq!(e.timestamp, (7, 9));
    }

    #[tokio::test]
    async fn arguments_are_sent_and_quit_tolerates_hangup() {
        let dir = tempfile::tempdir().expect("tempdir");
        let (path, h) = fake_qmp(dir.path(), |c| {
            if c["execute"] == "quit" {
                vec![json!("CLOSE")]
            } else {
                vec![ok(c, json!({}))]
            }
        });
        let c = QmpClient::connect(&path, T).await.expect("connect");
        c.migrate_set_capabilities(&[("x-ignore-shared", true)])
            .await
            .expect("caps");
        c.quit()
            .await
            .expect("quit succeeds even though the peer hung up");
        // Once closed, commands fail fast with Disconnected.
        let r = tokio::time::timeout(T, c.query_status())
            .await
            .expect("no hang");
        assert!(matches!(r, Err(QmpError::Disconnected)), "{r:?}");
        let seen = h.await.expect("peer");
        assert_eq!(
            seen[1]["arguments"],
            json!({"capabilities": [{"capability": "x-ignore-shared", "state": true}]})
        );
    }

    #[tokio::test]
    async fn non_qmp_peer_is_a_protocol_error() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("s.sock");
        let l = UnixListener::bind(&path).expect("bind");
        tokio::spawn(async move {
            let (mut s, _) = l.accept().await.expect("accept");
            s.write_all(b"{\"hello\": 1}\n").await.expect("write");
            tokio::time::sleep(T).await;
        });
        let r = QmpClient::connect(&path, T).await;
        assert!(matches!(r, Err(QmpError::Protocol(_))), "{:?}", r.err());
    }
}
