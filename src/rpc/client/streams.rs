//! One connection's streams: the state shared by the client handles and the reader task
//! ([`Shared`]: stream ids, routing of incoming frames, per-stream credit for host->guest
//! `Data`, the receive window the guest must keep to, the deadlines, why the connection was
//! closed), the guards that end the connection ([`Handle`], [`CloseOnDrop`]) and one request's
//! stream ([`OpenStream`]).
//!
//! Nothing the guest sends can make a stream's queue grow without bound: `Data` counts against
//! the stream's [`WINDOW`] until the host grants it back as `Credit`, exec events until the host
//! acknowledges them, and any other frame at most [`MAX_OTHER_FRAMES`] times per stream. A guest
//! that goes past that is cut off: the connection is closed and [`Shared::reason`] says why.
//!
//! A request that misses its deadline is not taken for a dead agent at once: the host first
//! pings the agent ([`Shared::missed`]). An agent that answers is alive but slow: only that
//! request fails ([`RpcError::Slow`], the guest is told to `Cancel` it, the service records the
//! event); an agent that does not is cut off. `Progress` frames from the agent restart a
//! request's deadline (long deletes, walks and unpacks report it) and are never queued.

use super::super::frame::CHUNK;
use super::super::msg::{Body, CONTROL_STREAM, Frame, Reply, Request};
use super::super::outbox::Outbox;
use super::super::{RpcError, WINDOW, data_cost};
use std::collections::HashMap;
use std::sync::atomic::{AtomicU32, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::sync::{Semaphore, mpsc, watch};

/// The longest the host waits for the liveness ping after a missed deadline (less when the
/// deadline itself is shorter).
pub(super) const PROBE: Duration = Duration::from_secs(10);

/// Frames other than `Data` and exec events one stream may receive (a request is answered by one
/// terminal frame; a resumed exec by `Resumed` and possibly an `Error`). More is a hostile guest.
pub(super) const MAX_OTHER_FRAMES: u32 = 4;

/// How long the host waits for the agent. A request the agent does not answer in time fails with
/// [`RpcError::Deadline`] and closes the connection (the agent is hung or hostile; the service
/// then marks the sandbox failed). Exec output and exec stdin have no deadline: a command may
/// legitimately be silent, or not read its stdin, for as long as it runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Deadlines {
    /// The longest wait for any answer: a reply, an exec's `Started`, the next chunk of a read,
    /// credit to send the next chunk of a write. Default 120 s (a first walk of a big tree under
    /// TCG takes tens of seconds).
    pub reply: Duration,
    /// Added to `reply` per MiB of archive the agent unpacks from a disk (`UntarDisk`), which it
    /// does without a word until done. Default 1 s.
    pub per_mib: Duration,
    /// The longest `Progress` frames may keep one wait going in all: past it the request fails
    /// even though the agent keeps saying it works (a hostile agent could otherwise hold the
    /// request, and the sandbox's lock, forever). Default 1 h.
    pub progress_max: Duration,
}

impl Default for Deadlines {
    fn default() -> Self {
        Deadlines {
            reply: Duration::from_secs(120),
            per_mib: Duration::from_secs(1),
            progress_max: Duration::from_secs(3600),
        }
    }
}

pub(super) type StreamTx = mpsc::UnboundedSender<Body>;

/// The reader's end of one stream.
pub(super) struct Slot {
    tx: StreamTx,
    /// Bytes of `Data` and exec events routed to the stream and not yet granted back (credit)
    /// or acknowledged by the host.
    held: Arc<AtomicUsize>,
    /// Other frames routed to the stream.
    others: u32,
    /// Counts the `Progress` frames of the stream (never queued).
    progress: Arc<watch::Sender<u64>>,
}

/// What [`Shared::open`] hands to the new stream's owner.
pub(super) struct Opened {
    pub(super) id: u32,
    pub(super) rx: mpsc::UnboundedReceiver<Body>,
    pub(super) credit: Arc<Semaphore>,
    pub(super) held: Arc<AtomicUsize>,
    pub(super) progress: watch::Receiver<u64>,
}

/// State shared by the client handles and the reader task.
pub(super) struct Shared {
    pub(super) outbox: Outbox,
    /// `None` once the connection is dead; dropping the senders ends every receiver.
    pub(super) streams: Mutex<Option<HashMap<u32, Slot>>>,
    /// Credit for host->guest `Data`, per stream.
    pub(super) credits: Mutex<HashMap<u32, Arc<Semaphore>>>,
    pub(super) next_stream: AtomicU32,
    /// Why the connection was closed, when the host closed it (a broken rule, a deadline).
    pub(super) reason: Mutex<Option<String>>,
    pub(super) deadlines: Mutex<Deadlines>,
    /// The last request the agent was slow to answer while still answering pings (see
    /// [`Shared::missed`]); watched by the service.
    pub(super) slow: watch::Sender<Option<String>>,
}

impl Shared {
    pub(super) fn new() -> Shared {
        Shared {
            outbox: Outbox::new(),
            streams: Mutex::new(Some(HashMap::new())),
            credits: Mutex::new(HashMap::new()),
            next_stream: AtomicU32::new(1),
            reason: Mutex::new(None),
            deadlines: Mutex::new(Deadlines::default()),
            slow: watch::channel(None).0,
        }
    }

    fn lock_streams(&self) -> std::sync::MutexGuard<'_, Option<HashMap<u32, Slot>>> {
        self.streams.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub(super) fn deadlines(&self) -> Deadlines {
        *self.deadlines.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub(super) fn reason(&self) -> Option<String> {
        self.reason
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    /// Closes the connection because the guest broke a rule or missed a deadline; the first
    /// reason is kept.
    pub(super) fn cut_off(&self, why: String) {
        {
            let mut r = self.reason.lock().unwrap_or_else(|p| p.into_inner());
            if r.is_none() && !self.outbox.is_closed() {
                tracing::warn!(reason = %why, "closing the guest agent connection");
                *r = Some(why);
            }
        }
        self.kill();
    }

    /// The error for a call whose connection is gone.
    pub(super) fn gone(&self) -> RpcError {
        match self.reason() {
            Some(r) => RpcError::Closed(r),
            None => RpcError::Disconnected,
        }
    }

    fn lock_credits(&self) -> std::sync::MutexGuard<'_, HashMap<u32, Arc<Semaphore>>> {
        self.credits.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub(super) fn open(&self) -> Result<Opened, RpcError> {
        let mut g = self.lock_streams();
        let Some(map) = g.as_mut() else {
            drop(g);
            return Err(self.gone());
        };
        let id = loop {
            let id = self.next_stream.fetch_add(1, Ordering::Relaxed);
            if id != CONTROL_STREAM && !map.contains_key(&id) {
                break id;
            }
        };
        // Unbounded, but what the guest can put in it is bounded (see the module doc).
        let (tx, rx) = mpsc::unbounded_channel();
        let held = Arc::new(AtomicUsize::new(0));
        let (progress, progress_rx) = watch::channel(0u64);
        map.insert(
            id,
            Slot {
                tx,
                held: held.clone(),
                others: 0,
                progress: Arc::new(progress),
            },
        );
        let credit = Arc::new(Semaphore::new(WINDOW));
        self.lock_credits().insert(id, credit.clone());
        Ok(Opened {
            id,
            rx,
            credit,
            held,
            progress: progress_rx,
        })
    }

    pub(super) fn close_stream(&self, id: u32) {
        if let Some(map) = self.lock_streams().as_mut() {
            map.remove(&id);
        }
        self.lock_credits().remove(&id);
    }

    /// Ends everything: called once when the link dies.
    pub(super) fn kill(&self) {
        self.outbox.close();
        self.lock_streams().take();
        for (_, sem) in self.lock_credits().drain() {
            sem.close();
        }
    }

    /// Routes one frame from the guest to its stream. An error means the guest broke the
    /// protocol; the caller closes the connection.
    pub(super) fn dispatch(&self, frame: Frame) -> Result<(), RpcError> {
        let stream = frame.stream;
        if let Body::Credit(n) = frame.body {
            if let Some(sem) = self.lock_credits().get(&stream) {
                if sem.available_permits() + n as usize > WINDOW {
                    return Err(RpcError::Violation(format!(
                        "credit overflow on stream {stream}"
                    )));
                }
                sem.add_permits(n as usize);
            }
            return Ok(());
        }
        let mut g = self.lock_streams();
        // Frames for a stream that is over (its caller dropped it) are discarded.
        let Some(slot) = g.as_mut().and_then(|m| m.get_mut(&stream)) else {
            return Ok(());
        };
        match &frame.body {
            // The guest may send `Data` while it holds credit: at most a window un-granted,
            // counted in `data_cost` (an empty frame costs as much as a short one).
            Body::Data(d) => {
                let cost = data_cost(d.len());
                let held = slot.held.fetch_add(cost, Ordering::AcqRel) + cost;
                if held > WINDOW {
                    return Err(RpcError::Violation(format!(
                        "the guest sent {held} bytes of data on stream {stream} without credit \
                         (window {WINDOW})"
                    )));
                }
            }
            // Exec events: the guest may start one while less than a window is unacknowledged
            // (the agent's own rule, `guest::exec::pump`).
            Body::Exec { event, .. } => {
                let before = slot.held.fetch_add(event.cost(), Ordering::AcqRel);
                if before >= WINDOW {
                    return Err(RpcError::Violation(format!(
                        "the guest sent exec output on stream {stream} with {before} bytes \
                         unacknowledged (window {WINDOW})"
                    )));
                }
            }
            // Restarts the request's deadline; nothing is queued, so a flood costs nothing.
            Body::Progress => {
                slot.progress.send_modify(|n| *n = n.wrapping_add(1));
                return Ok(());
            }
            _ => {
                slot.others += 1;
                if slot.others > MAX_OTHER_FRAMES {
                    return Err(RpcError::Violation(format!(
                        "the guest sent more than {MAX_OTHER_FRAMES} answers on stream {stream}"
                    )));
                }
            }
        }
        // The receiver may be gone (caller dropped); late frames are discarded.
        let _ = slot.tx.send(frame.body);
        Ok(())
    }

    /// Sends `data` as `Data` chunks within the stream's credit. With `deadline`, a guest that
    /// grants no credit (and reports no progress) for that long missed it ([`Self::missed`]).
    pub(super) async fn send_data(
        &self,
        stream: u32,
        sem: &Semaphore,
        data: &[u8],
        mut deadline: Option<Waiting<'_>>,
    ) -> Result<(), RpcError> {
        for chunk in data.chunks(CHUNK) {
            let acquire = sem.acquire_many(data_cost(chunk.len()) as u32);
            let permit = match deadline.as_mut() {
                None => acquire.await,
                Some(w) => match w.wait(acquire).await {
                    Ok(p) => p,
                    Err(after) => {
                        return Err(self.missed(&format!("credit for {}", w.what), after).await);
                    }
                },
            };
            permit.map_err(|_| self.gone())?.forget();
            self.outbox
                .send(Frame {
                    stream,
                    body: Body::Data(chunk.to_vec()),
                })
                .map_err(|_| self.gone())?;
        }
        Ok(())
    }
}

/// A wait for the agent under a deadline that its `Progress` frames restart.
pub(super) struct Waiting<'a> {
    pub(super) what: &'a str,
    pub(super) after: Duration,
    pub(super) progress: watch::Receiver<u64>,
    /// How far `Progress` may push the deadline in all ([`Deadlines::progress_max`]).
    pub(super) max: Duration,
}

impl Waiting<'_> {
    /// `fut`'s output, or `Err(after)` when `after` passed with no progress reported, or when
    /// progress kept it going for longer than `max` (never less than `after`) in all.
    pub(super) async fn wait<F: std::future::Future>(
        &mut self,
        fut: F,
    ) -> Result<F::Output, Duration> {
        let hard = tokio::time::Instant::now() + self.max.max(self.after);
        let sleep = tokio::time::sleep(self.after);
        tokio::pin!(sleep, fut);
        let mut progress_open = true;
        loop {
            tokio::select! {
                out = &mut fut => return Ok(out),
                () = &mut sleep => return Err(self.after),
                r = self.progress.changed(), if progress_open => match r {
                    Ok(()) => sleep
                        .as_mut()
                        .reset((tokio::time::Instant::now() + self.after).min(hard)),
                    // The stream is over (connection gone): `fut` ends too.
                    Err(_) => progress_open = false,
                },
            }
        }
    }
}

impl Shared {
    /// The agent missed a deadline for `what`. Ping it (within [`PROBE`], less when `after` is
    /// shorter): if it answers it is alive but slow, and only this request fails
    /// ([`RpcError::Slow`], recorded for the service in [`Self::slow`]); if it does not, it is
    /// hung or hostile: close the connection ([`RpcError::Deadline`]).
    pub(super) async fn missed(&self, what: &str, after: Duration) -> RpcError {
        if self.answers_ping(after.min(PROBE)).await {
            let e = RpcError::Slow {
                what: what.to_owned(),
                after,
            };
            tracing::warn!(
                request = what,
                ?after,
                "the guest agent is slow; request abandoned"
            );
            self.slow.send_replace(Some(e.to_string()));
            return e;
        }
        let e = RpcError::Deadline {
            what: what.to_owned(),
            after,
        };
        self.cut_off(e.to_string());
        e
    }

    /// Whether the agent answers a `Ping` within `within`.
    async fn answers_ping(&self, within: Duration) -> bool {
        let Ok(o) = self.open() else {
            return false;
        };
        let mut rx = o.rx;
        let sent = self
            .outbox
            .send(Frame {
                stream: o.id,
                body: Body::Request(Request::Ping),
            })
            .is_ok();
        let pong = sent
            && matches!(
                tokio::time::timeout(within, rx.recv()).await,
                Ok(Some(Body::Reply(Reply::Pong)))
            );
        self.close_stream(o.id);
        pong
    }
}

/// Closes the connection when the last [`AgentClient`] or [`ExecStream`] is dropped.
pub(super) struct Handle {
    pub(super) shared: Arc<Shared>,
    pub(super) agent_version: String,
    pub(super) tasks: Vec<tokio::task::AbortHandle>,
}

impl Drop for Handle {
    fn drop(&mut self) {
        self.shared.kill();
        for t in &self.tasks {
            t.abort();
        }
    }
}

/// Kills a connection whose handshake did not finish (failed, or its future was dropped).
pub(super) struct CloseOnDrop(pub(super) Option<(Arc<Shared>, tokio::task::AbortHandle)>);

impl Drop for CloseOnDrop {
    fn drop(&mut self) {
        if let Some((shared, writer)) = self.0.take() {
            shared.kill();
            writer.abort();
        }
    }
}

/// A stream opened by one request; unregisters itself when dropped.
pub(super) struct OpenStream {
    pub(super) handle: Arc<Handle>,
    pub(super) id: u32,
    pub(super) rx: mpsc::UnboundedReceiver<Body>,
    pub(super) credit: Arc<Semaphore>,
    /// The stream's un-granted guest->host bytes ([`Slot::held`]).
    pub(super) held: Arc<AtomicUsize>,
    /// Changes on every `Progress` frame of the stream.
    pub(super) progress: watch::Receiver<u64>,
    /// Tell the agent to `Cancel` the request when the stream is dropped before its answer
    /// ended (a cap hit, a missed deadline, a dropped caller). Not for execs: they outlive
    /// their streams.
    pub(super) cancel: bool,
    /// The answer ended (`Reply`, `Error` or `DataEnd` received).
    pub(super) finished: bool,
}

impl Drop for OpenStream {
    fn drop(&mut self) {
        if self.cancel && !self.finished {
            let _ = self.send_control(Body::Cancel);
        }
        self.handle.shared.close_stream(self.id);
    }
}

impl OpenStream {
    /// The next frame, however long it takes (exec output).
    pub(super) async fn recv(&mut self) -> Result<Body, RpcError> {
        match self.rx.recv().await {
            Some(b) => {
                if matches!(b, Body::Reply(_) | Body::Error(_) | Body::DataEnd) {
                    self.finished = true;
                }
                Ok(b)
            }
            None => Err(self.handle.shared.gone()),
        }
    }

    /// The next frame within the reply deadline (see [`Self::recv_for`]).
    pub(super) async fn recv_within(&mut self, what: &str) -> Result<Body, RpcError> {
        let after = self.handle.shared.deadlines().reply;
        self.recv_for(what, after).await
    }

    /// The next frame within `after`, restarted by each `Progress`; past it [`Shared::missed`]
    /// decides between a slow agent (this request fails) and a dead one (the connection closes).
    pub(super) async fn recv_for(&mut self, what: &str, after: Duration) -> Result<Body, RpcError> {
        let mut w = self.waiting(what, after);
        let r = w.wait(self.recv()).await;
        match r {
            Ok(r) => r,
            Err(after) => Err(self.handle.shared.missed(what, after).await),
        }
    }

    /// A deadline of `after` for this stream, restarted by its `Progress` frames.
    pub(super) fn waiting<'a>(&self, what: &'a str, after: Duration) -> Waiting<'a> {
        let mut progress = self.progress.clone();
        progress.mark_unchanged();
        Waiting {
            what,
            after,
            progress,
            max: self.handle.shared.deadlines().progress_max,
        }
    }

    /// The host consumed a `Data` frame of `len` bytes: its cost leaves the window and goes back
    /// as credit.
    pub(super) fn grant(&self, len: usize) -> Result<(), RpcError> {
        let cost = data_cost(len);
        self.release(cost);
        self.send_control(Body::Credit(cost as u32))
    }

    /// The host consumed exec event `seq` (costing `cost`): acknowledge it.
    pub(super) fn ack(&self, seq: u64, cost: usize) -> Result<(), RpcError> {
        self.release(cost);
        self.send_control(Body::ExecAck { seq })
    }

    fn release(&self, n: usize) {
        let _ = self
            .held
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |h| {
                Some(h.saturating_sub(n))
            });
    }

    pub(super) fn send(&self, body: Body) -> Result<(), RpcError> {
        let shared = &self.handle.shared;
        shared
            .outbox
            .send(Frame {
                stream: self.id,
                body,
            })
            .map_err(|_| shared.gone())
    }

    pub(super) fn send_control(&self, body: Body) -> Result<(), RpcError> {
        let shared = &self.handle.shared;
        shared
            .outbox
            .send_control(Frame {
                stream: self.id,
                body,
            })
            .map_err(|_| shared.gone())
    }
}
