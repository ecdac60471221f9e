//! The agent's RPC server: one [`Agent`] per guest, [`serve`] once per host connection.
//!
//! Owns the guest end of a connection: the handshake, routing of frames to execs and file
//! transfers, credit for host->guest data. State that must survive a reconnect (the execs and
//! their spools) lives in [`Agent`], not in the connection. It never powers off by itself unless
//! built with [`ShutdownMode::PowerOff`] (PID 1 only).

use super::exec::{Exec, ExecConfig, ExecTable};
use super::files::{self, Inflow, WriteMsg};
use super::reaper::{ReapMode, Reaper};
use crate::rpc::WINDOW;
use crate::rpc::frame::{FrameError, read_frame};
use crate::rpc::msg::{
    Body, CONTROL_STREAM, ErrorKind, Frame, PROTOCOL_VERSION, RemoteError, Reply, Request,
};
use crate::rpc::outbox::Outbox;
use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::sync::{Semaphore, mpsc};

pub const AGENT_VERSION: &str = env!("CARGO_PKG_VERSION");

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ShutdownMode {
    /// Sync and power the machine off (PID 1 in a VM).
    PowerOff,
    /// Reply, then make [`serve`] return [`ServeEnd::Shutdown`] (tests, non-PID-1 runs).
    Return,
}

#[derive(Debug, thiserror::Error)]
pub enum ServeError {
    #[error(transparent)]
    Frame(#[from] FrameError),
    #[error("the host broke the protocol: {0}")]
    Protocol(String),
    #[error("the host speaks protocol {0}, this agent {PROTOCOL_VERSION}")]
    Version(u32),
}

/// Why [`serve`] returned without error.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ServeEnd {
    /// A new host said `Hello` on the same byte stream: call [`serve_from`] with this frame.
    Rehello(Frame),
    /// The host went away; reconnecting is up to the caller.
    Eof,
    /// The host asked for a shutdown (only with [`ShutdownMode::Return`]).
    Shutdown,
}

/// Everything that outlives one connection.
pub struct Agent {
    pub execs: Arc<ExecTable>,
    shutdown: ShutdownMode,
    /// The workspace walk kept current by inotify (`WalkSince`).
    walks: Arc<std::sync::Mutex<Option<super::watch::WalkCache>>>,
}

impl Agent {
    /// Must be called inside a tokio runtime (it starts the reaper).
    pub fn new(
        cfg: ExecConfig,
        reap: ReapMode,
        shutdown: ShutdownMode,
    ) -> std::io::Result<Arc<Self>> {
        let reaper = Reaper::start(reap)?;
        Ok(Arc::new(Self {
            execs: ExecTable::new(cfg, reaper),
            shutdown,
            walks: Arc::default(),
        }))
    }
}

enum Route {
    /// An exec and its stdin's [`Inflow`].
    Exec(Arc<Exec>, Arc<Inflow>),
    /// A write_file or untar and its content's [`Inflow`].
    Write(mpsc::UnboundedSender<WriteMsg>, Arc<Inflow>),
    Read(Arc<Semaphore>),
    /// A directory watch: its credit, and what stops it (`Cancel`, the connection's end).
    Watch(Arc<Semaphore>, Arc<tokio::sync::Notify>),
    /// A one-shot request in progress; data for it is a protocol error.
    Busy,
}

type Routes = Arc<std::sync::Mutex<HashMap<u32, Route>>>;

fn lock(r: &Routes) -> std::sync::MutexGuard<'_, HashMap<u32, Route>> {
    r.lock().unwrap_or_else(|p| p.into_inner())
}

/// Serves one host connection until it ends.
pub async fn serve<S>(agent: Arc<Agent>, io: S) -> Result<ServeEnd, ServeError>
where
    S: AsyncRead + AsyncWrite + Send + 'static,
{
    serve_from(agent, io, None).await
}

/// Like [`serve`], with the connection's `Hello` already read (after [`ServeEnd::Rehello`]).
pub async fn serve_from<S>(
    agent: Arc<Agent>,
    io: S,
    hello: Option<Frame>,
) -> Result<ServeEnd, ServeError>
where
    S: AsyncRead + AsyncWrite + Send + 'static,
{
    let (mut rd, wr) = tokio::io::split(io);
    let outbox = Arc::new(Outbox::new());
    let w = outbox.clone();
    let mut writer = AbortOnDrop(tokio::spawn(async move { w.run_writer(wr).await }));
    let routes: Routes = Arc::default();
    let res = serve_inner(&agent, &mut rd, &outbox, &routes, hello).await;
    if !matches!(res, Ok(ServeEnd::Rehello(_))) {
        let _ = tokio::time::timeout(WRITER_STOP, outbox.wait_idle()).await;
    }
    outbox.close();
    for (_, r) in lock(&routes).drain() {
        match r {
            Route::Read(sem) => sem.close(),
            Route::Watch(sem, stop) => {
                sem.close();
                stop.notify_one();
            }
            _ => {}
        }
    }
    writer.stop().await;
    res
}

/// How long a finished connection's writer may take to complete the frame it is writing.
const WRITER_STOP: Duration = Duration::from_secs(2);

/// Aborts the task when dropped, so a cancelled `serve` drops the transport too.
struct AbortOnDrop<T>(tokio::task::JoinHandle<T>);

impl<T> AbortOnDrop<T> {
    /// Waits for the writer of a closed outbox to stop. It stops between two frames: on a virtio
    /// port the byte stream goes on into the next host connection, and a frame cut in the middle
    /// would leave that host's reader out of step. Only a writer stuck on a host that no longer
    /// reads is aborted (mid-frame, possibly; the host's handshake skips such a remnant).
    async fn stop(&mut self) {
        if tokio::time::timeout(WRITER_STOP, &mut self.0)
            .await
            .is_err()
        {
            tracing::warn!("the connection's writer is stuck; aborting it");
            self.0.abort();
            // Wait until it is really gone: an aborted task can still be inside a write, which
            // must not interleave with the next connection's writer.
            let _ = (&mut self.0).await;
        }
    }
}

impl<T> Drop for AbortOnDrop<T> {
    fn drop(&mut self) {
        self.0.abort();
    }
}

async fn serve_inner<R: AsyncRead + Unpin>(
    agent: &Arc<Agent>,
    rd: &mut R,
    outbox: &Arc<Outbox>,
    routes: &Routes,
    hello: Option<Frame>,
) -> Result<ServeEnd, ServeError> {
    let first = match hello {
        Some(f) => Some(f),
        None => read_frame(rd).await?,
    };
    match first {
        None => return Ok(ServeEnd::Eof),
        Some(Frame {
            body:
                Body::Hello {
                    protocol,
                    version,
                    nonce,
                },
            ..
        }) => {
            tracing::info!(host_version = %version, protocol, "host connected");
            let ack = Body::HelloAck {
                protocol: PROTOCOL_VERSION,
                version: AGENT_VERSION.into(),
                nonce,
            };
            let _ = outbox.send_control(Frame {
                stream: CONTROL_STREAM,
                body: ack,
            });
            if protocol != PROTOCOL_VERSION {
                return Err(ServeError::Version(protocol));
            }
        }
        Some(f) => {
            return Err(ServeError::Protocol(format!(
                "expected Hello, got {:?}",
                f.body
            )));
        }
    }
    loop {
        let frame = tokio::select! {
            f = read_frame(rd) => f?,
            _ = outbox.closed() => return Ok(ServeEnd::Eof),
        };
        let Some(Frame { stream, body }) = frame else {
            return Ok(ServeEnd::Eof);
        };
        if stream == CONTROL_STREAM {
            if let Body::Hello { .. } = body {
                // On a virtio port a quick host reconnect can arrive without an EOF first.
                return Ok(ServeEnd::Rehello(Frame { stream, body }));
            }
            return Err(ServeError::Protocol(format!("frame on stream 0: {body:?}")));
        }
        match body {
            Body::Request(req) => {
                if lock(routes).contains_key(&stream) {
                    return Err(ServeError::Protocol(format!(
                        "stream {stream} opened twice"
                    )));
                }
                if let Some(end) = request(agent, outbox, routes, stream, req).await {
                    return Ok(end);
                }
            }
            Body::Data(d) => {
                let mut g = lock(routes);
                // The host may send only within its credit: past the window it is broken.
                let owed = match g.get(&stream) {
                    Some(Route::Exec(_, inflow) | Route::Write(_, inflow)) => {
                        match inflow.receive(d.len(), outbox, stream) {
                            Some(o) => o,
                            None => {
                                return Err(ServeError::Protocol(format!(
                                    "the host sent data on stream {stream} past its {WINDOW}-byte window"
                                )));
                            }
                        }
                    }
                    Some(_) => {
                        return Err(ServeError::Protocol(format!("data on stream {stream}")));
                    }
                    None => continue, // the request already failed; its late data is dropped
                };
                let gone = match g.get(&stream) {
                    Some(Route::Exec(e, _)) => {
                        e.stdin_data(d, owed);
                        false
                    }
                    // A consumer that is gone failed its request; the rest is dropped.
                    Some(Route::Write(tx, _)) => tx.send(WriteMsg::Data(d, owed)).is_err(),
                    _ => false,
                };
                if gone {
                    g.remove(&stream);
                }
            }
            Body::DataEnd => match lock(routes).get(&stream) {
                Some(Route::Exec(e, _)) => e.stdin_end(),
                Some(Route::Write(tx, _)) => {
                    let _ = tx.send(WriteMsg::End);
                }
                _ => {}
            },
            Body::Credit(n) => {
                if let Some(Route::Read(sem) | Route::Watch(sem, _)) = lock(routes).get(&stream) {
                    if sem.available_permits() + n as usize > WINDOW {
                        return Err(ServeError::Protocol(format!("credit overflow on {stream}")));
                    }
                    sem.add_permits(n as usize);
                }
            }
            // The host abandoned the request: stop reading (a read, a walk's sending) or
            // end the content (a write or untar fails as if the host went away). Execs outlive
            // their streams; one-shot requests run to their end (the answer is discarded).
            Body::Cancel => {
                let mut g = lock(routes);
                match g.get(&stream) {
                    Some(Route::Read(sem)) => {
                        sem.close();
                        g.remove(&stream);
                    }
                    Some(Route::Write(..)) => {
                        g.remove(&stream);
                    }
                    Some(Route::Watch(sem, stop)) => {
                        sem.close();
                        stop.notify_one();
                        g.remove(&stream);
                    }
                    _ => {}
                }
            }
            Body::Kill(sig) => {
                if let Some(Route::Exec(e, _)) = lock(routes).get(&stream) {
                    e.kill(sig);
                }
            }
            Body::Resize { rows, cols } => {
                if let Some(Route::Exec(e, _)) = lock(routes).get(&stream) {
                    e.resize(rows, cols);
                }
            }
            Body::ExecAck { seq } => {
                let mut g = lock(routes);
                if let Some(Route::Exec(e, _)) = g.get(&stream) {
                    e.ack(seq);
                    if e.finished() {
                        g.remove(&stream);
                    }
                }
            }
            other => return Err(ServeError::Protocol(format!("unexpected frame {other:?}"))),
        }
    }
}

fn reply(outbox: &Outbox, stream: u32, r: Result<Reply, RemoteError>) {
    let body = match r {
        Ok(r) => Body::Reply(r),
        Err(e) => Body::Error(e),
    };
    let _ = outbox.send(Frame { stream, body });
}

/// Starts one request. Returns `Some` when the connection must end (shutdown).
async fn request(
    agent: &Arc<Agent>,
    outbox: &Arc<Outbox>,
    routes: &Routes,
    stream: u32,
    req: Request,
) -> Option<ServeEnd> {
    match req {
        Request::Ping => reply(outbox, stream, Ok(Reply::Pong)),
        Request::SetIdentity { hostname, seed } => reply(
            outbox,
            stream,
            super::init::set_identity(&hostname, &seed).map(|()| Reply::Done),
        ),
        Request::SetClock { unix_ms } => reply(
            outbox,
            stream,
            super::init::set_clock(unix_ms).map(|()| Reply::Done),
        ),
        Request::Shutdown => {
            tracing::info!("shutdown requested");
            reply(outbox, stream, Ok(Reply::Done));
            if agent.shutdown == ShutdownMode::PowerOff {
                let _ = tokio::time::timeout(Duration::from_secs(2), outbox.wait_idle()).await;
                super::init::power_off();
            }
            return Some(ServeEnd::Shutdown);
        }
        Request::Exec(spec) => match agent.execs.start(spec) {
            Ok(exec) => {
                if let Err(e) = exec.attach(outbox.clone(), stream, 1) {
                    reply(outbox, stream, Err(e));
                } else {
                    lock(routes).insert(stream, Route::Exec(exec, Arc::default()));
                }
            }
            Err(e) => reply(outbox, stream, Err(e)),
        },
        Request::Resume { exec_id, from_seq } => match agent.execs.get(exec_id) {
            None => reply(
                outbox,
                stream,
                Err(RemoteError::new(
                    ErrorKind::NotFound,
                    format!("no exec {exec_id} (finished and acknowledged, or never started)"),
                )),
            ),
            Some(exec) => match exec.check_resume(from_seq) {
                Err(e) => reply(outbox, stream, Err(e)),
                Ok(()) => {
                    // `Resumed` must precede the replayed events on this stream.
                    reply(outbox, stream, Ok(Reply::Resumed));
                    match exec.attach(outbox.clone(), stream, from_seq) {
                        Ok(()) => {
                            lock(routes).insert(stream, Route::Exec(exec, Arc::default()));
                        }
                        Err(e) => reply(outbox, stream, Err(e)),
                    }
                }
            },
        },
        Request::ReadFile { path } => {
            let sem = Arc::new(Semaphore::new(WINDOW));
            lock(routes).insert(stream, Route::Read(sem.clone()));
            let (ob, rt) = (outbox.clone(), routes.clone());
            tokio::spawn(async move {
                files::read(path, ob, stream, sem).await;
                lock(&rt).remove(&stream);
            });
        }
        Request::WriteFile { path, mode } => {
            let (tx, rx) = mpsc::unbounded_channel();
            lock(routes).insert(stream, Route::Write(tx, Arc::default()));
            let (ob, rt) = (outbox.clone(), routes.clone());
            tokio::spawn(async move {
                files::write(path, mode, rx, ob, stream).await;
                lock(&rt).remove(&stream);
            });
        }
        Request::Untar { dir, delete } => {
            let (tx, rx) = mpsc::unbounded_channel();
            lock(routes).insert(stream, Route::Write(tx, Arc::default()));
            let (ob, rt) = (outbox.clone(), routes.clone());
            tokio::spawn(async move {
                super::tree::untar(dir, delete, rx, ob, stream).await;
                lock(&rt).remove(&stream);
            });
        }
        Request::Walk { path, skip } => {
            let sem = Arc::new(Semaphore::new(WINDOW));
            lock(routes).insert(stream, Route::Read(sem.clone()));
            let (ob, rt) = (outbox.clone(), routes.clone());
            tokio::spawn(async move {
                super::tree::walk(path, skip, ob, stream, sem).await;
                lock(&rt).remove(&stream);
            });
        }
        Request::WalkSince {
            path,
            skip,
            since,
            stat_all,
        } => {
            let sem = Arc::new(Semaphore::new(WINDOW));
            lock(routes).insert(stream, Route::Read(sem.clone()));
            let (ob, rt) = (outbox.clone(), routes.clone());
            let cache = agent.walks.clone();
            tokio::spawn(async move {
                let args = super::tree::WalkSinceArgs {
                    path,
                    skip,
                    since,
                    stat_all,
                };
                super::tree::walk_since(cache, args, ob, stream, sem).await;
                lock(&rt).remove(&stream);
            });
        }
        Request::WatchDir { path, recursive } => {
            let sem = Arc::new(Semaphore::new(WINDOW));
            let stop = Arc::new(tokio::sync::Notify::new());
            lock(routes).insert(stream, Route::Watch(sem.clone(), stop.clone()));
            let (ob, rt) = (outbox.clone(), routes.clone());
            tokio::spawn(async move {
                super::dirwatch::run(path, recursive, ob, stream, sem, stop).await;
                lock(&rt).remove(&stream);
            });
        }
        Request::UntarDisk {
            dir,
            delete,
            serial,
            len,
        } => {
            lock(routes).insert(stream, Route::Busy);
            let (ob, rt) = (outbox.clone(), routes.clone());
            tokio::spawn(async move {
                let work = super::progress::Work::default();
                let _ticker = super::progress::Ticker::start(ob.clone(), stream, work.clone());
                let r = tokio::task::spawn_blocking(move || {
                    super::tree::untar_disk(&dir, &delete, &serial, len, &work)
                })
                .await
                .unwrap_or_else(|e| Err(RemoteError::new(ErrorKind::Other, e.to_string())))
                .map(|()| Reply::Done);
                lock(&rt).remove(&stream);
                reply(&ob, stream, r);
            });
        }
        Request::MountBase { dir, serial } => {
            lock(routes).insert(stream, Route::Busy);
            let (ob, rt) = (outbox.clone(), routes.clone());
            let cache = agent.walks.clone();
            tokio::spawn(async move {
                let r = tokio::task::spawn_blocking(move || {
                    let r = super::wsbase::mount_base(&dir, &serial);
                    // The walk's watches name the directory the overlay now hides.
                    *cache.lock().unwrap_or_else(|p| p.into_inner()) = None;
                    r
                })
                .await
                .unwrap_or_else(|e| Err(RemoteError::new(ErrorKind::Other, e.to_string())))
                .map(|()| Reply::Done);
                lock(&rt).remove(&stream);
                reply(&ob, stream, r);
            });
        }
        req @ (Request::Stat { .. }
        | Request::List { .. }
        | Request::Mkdir { .. }
        | Request::Rename { .. }
        | Request::Chown { .. }
        | Request::Remove { .. }) => {
            lock(routes).insert(stream, Route::Busy);
            let (ob, rt) = (outbox.clone(), routes.clone());
            tokio::spawn(async move {
                // A recursive remove can take long: it reports progress.
                let work = super::progress::Work::default();
                let _ticker = super::progress::Ticker::start(ob.clone(), stream, work.clone());
                let r = tokio::task::spawn_blocking(move || files::simple(req, &work))
                    .await
                    .unwrap_or_else(|e| Err(RemoteError::new(ErrorKind::Other, e.to_string())));
                lock(&rt).remove(&stream);
                reply(&ob, stream, r);
            });
        }
    }
    None
}
