//! The fair writer: per-stream frame queues drained round-robin onto one byte stream.
//!
//! Owns ordering on the wire: frames of one stream keep their order, streams take turns one
//! frame (at most one [`CHUNK`](super::frame::CHUNK) of data) at a time, and control frames
//! (credits, acks, handshake) jump the queue. It bounds only its control queue (a waiting credit
//! or ack of a stream absorbs the next one, so a peer that sends without reading cannot grow it
//! per chunk): producers of bulk data must hold flow-control credit before queueing, so each
//! stream queues at most a window.

use super::frame::{FrameError, encode};
use super::msg::{Body, Frame};
use std::collections::{HashMap, VecDeque};
use std::sync::Mutex;
use tokio::io::{AsyncWrite, AsyncWriteExt};
use tokio::sync::{Notify, watch};

#[derive(Debug, thiserror::Error)]
#[error("the agent connection is closed")]
pub struct Closed;

#[derive(Default)]
struct Inner {
    control: VecDeque<Frame>,
    queues: HashMap<u32, VecDeque<Frame>>,
    ring: VecDeque<u32>,
    /// Frames queued or being written.
    pending: usize,
}

pub struct Outbox {
    inner: Mutex<Inner>,
    wake: Notify,
    idle: Notify,
    closed_tx: watch::Sender<bool>,
}

impl Default for Outbox {
    fn default() -> Self {
        Self::new()
    }
}

impl Outbox {
    pub fn new() -> Self {
        Self {
            inner: Mutex::new(Inner::default()),
            wake: Notify::new(),
            idle: Notify::new(),
            closed_tx: watch::channel(false).0,
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        // A panic while holding this lock leaves plain queues behind; keep going.
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub fn is_closed(&self) -> bool {
        *self.closed_tx.borrow()
    }

    /// Queues a frame behind the other frames of its stream.
    pub fn send(&self, frame: Frame) -> Result<(), Closed> {
        if self.is_closed() {
            return Err(Closed);
        }
        let mut g = self.lock();
        let stream = frame.stream;
        let q = g.queues.entry(stream).or_default();
        q.push_back(frame);
        if q.len() == 1 {
            g.ring.push_back(stream);
        }
        g.pending += 1;
        drop(g);
        self.wake.notify_one();
        Ok(())
    }

    /// Queues a frame ahead of all stream data (credits, acks, handshake, small replies whose
    /// order relative to their stream's data does not matter).
    ///
    /// A `Credit` or `ExecAck` still waiting for a stream is merged with the new one (credits
    /// add up, the higher ack wins): a peer that sends without reading cannot grow this queue
    /// by one frame per chunk or event it sends, only to one of each per stream.
    pub fn send_control(&self, frame: Frame) -> Result<(), Closed> {
        if self.is_closed() {
            return Err(Closed);
        }
        let mut g = self.lock();
        let merged = g.control.iter_mut().any(|f| {
            if f.stream != frame.stream {
                return false;
            }
            match (&mut f.body, &frame.body) {
                (Body::Credit(a), Body::Credit(b)) => match a.checked_add(*b) {
                    Some(sum) => {
                        *a = sum;
                        true
                    }
                    None => false,
                },
                (Body::ExecAck { seq: a }, Body::ExecAck { seq: b }) => {
                    *a = (*a).max(*b);
                    true
                }
                _ => false,
            }
        });
        if merged {
            return Ok(());
        }
        g.control.push_back(frame);
        g.pending += 1;
        drop(g);
        self.wake.notify_one();
        Ok(())
    }

    /// Marks the connection dead: queued frames are dropped, every waiter wakes up.
    pub fn close(&self) {
        self.closed_tx.send_replace(true);
        let mut g = self.lock();
        *g = Inner::default();
        drop(g);
        self.wake.notify_one();
        self.idle.notify_waiters();
    }

    /// Resolves once [`close`](Self::close) has been called.
    pub async fn closed(&self) {
        let mut rx = self.closed_tx.subscribe();
        // An error means the sender is gone, which only happens when `self` is dropped.
        let _ = rx.wait_for(|c| *c).await;
    }

    /// Waits until everything queued so far has been written and flushed (or the link died).
    pub async fn wait_idle(&self) {
        loop {
            let idle = self.idle.notified();
            tokio::pin!(idle);
            idle.as_mut().enable();
            if self.lock().pending == 0 || self.is_closed() {
                return;
            }
            idle.await;
        }
    }

    fn pop(&self) -> Option<Frame> {
        let mut g = self.lock();
        if let Some(f) = g.control.pop_front() {
            return Some(f);
        }
        while let Some(stream) = g.ring.pop_front() {
            let Some(q) = g.queues.get_mut(&stream) else {
                continue;
            };
            let f = q.pop_front();
            if q.is_empty() {
                g.queues.remove(&stream);
            } else {
                g.ring.push_back(stream);
            }
            if f.is_some() {
                return f;
            }
        }
        None
    }

    fn done(&self, n: usize) {
        let mut g = self.lock();
        g.pending = g.pending.saturating_sub(n);
        let idle = g.pending == 0;
        drop(g);
        if idle {
            self.idle.notify_waiters();
        }
    }

    /// Drains the outbox into `w` until the outbox is closed or a write fails (which closes it).
    pub async fn run_writer<W: AsyncWrite + Unpin>(&self, mut w: W) -> Result<(), FrameError> {
        let res = self.write_loop(&mut w).await;
        self.close();
        res
    }

    async fn write_loop<W: AsyncWrite + Unpin>(&self, w: &mut W) -> Result<(), FrameError> {
        let mut unflushed = 0usize;
        loop {
            if self.is_closed() {
                return Ok(());
            }
            match self.pop() {
                Some(frame) => {
                    let bytes = match encode(&frame) {
                        Ok(b) => b,
                        Err(e) => match unencodable(frame, &e) {
                            // A reply too big for a frame (a `List` of a huge directory): the
                            // request fails with that error instead of never being answered.
                            Some(b) => b,
                            None => {
                                tracing::error!(error = %e, "dropping unencodable frame");
                                self.done(1);
                                continue;
                            }
                        },
                    };
                    w.write_all(&bytes).await?;
                    unflushed += 1;
                }
                None => {
                    let wake = self.wake.notified();
                    tokio::pin!(wake);
                    wake.as_mut().enable();
                    if unflushed > 0 {
                        w.flush().await?;
                        self.done(unflushed);
                        unflushed = 0;
                        continue;
                    }
                    if self.is_closed() {
                        return Ok(());
                    }
                    // Re-check after registering so a send between pop() and here is not lost.
                    let empty = {
                        let g = self.lock();
                        g.control.is_empty() && g.ring.is_empty()
                    };
                    if empty {
                        wake.await;
                    }
                }
            }
        }
    }
}

/// The frame that answers in place of `frame` when `frame` does not encode: an `Error` on its
/// stream for a `Reply` (the only frames that can outgrow [`MAX_FRAME`](super::frame::MAX_FRAME));
/// `None` for anything else (dropped, logged).
fn unencodable(frame: Frame, e: &FrameError) -> Option<Vec<u8>> {
    let Body::Reply(r) = &frame.body else {
        return None;
    };
    let what = match r {
        super::msg::Reply::List(l) => format!("a list of {} entries", l.len()),
        other => format!("{:?}", std::mem::discriminant(other)),
    };
    tracing::warn!(stream = frame.stream, error = %e, "answer too big for one frame");
    let err = super::msg::RemoteError::new(
        super::msg::ErrorKind::InvalidRequest,
        format!("the answer ({what}) is too big for one frame: {e}"),
    );
    encode(&Frame {
        stream: frame.stream,
        body: Body::Error(err),
    })
    .ok()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rpc::frame::read_frame;

    #[tokio::test]
    async fn streams_take_turns_and_control_jumps_the_queue() {
        let ob = Outbox::new();
        for i in 0..3u8 {
            ob.send(Frame {
                stream: 1,
                body: Body::Data(vec![i]),
            })
            .unwrap();
        }
        ob.send(Frame {
            stream: 2,
            body: Body::Data(vec![9]),
        })
        .unwrap();
        ob.send_control(Frame {
            stream: 3,
            body: Body::Credit(5),
        })
        .unwrap();
        let order: Vec<u32> = std::iter::from_fn(|| ob.pop()).map(|f| f.stream).collect();
        assert_eq!(order, vec![3, 1, 2, 1, 1]);
    }

    #[test]
    fn waiting_credits_and_acks_are_merged_per_stream() {
        let ob = Outbox::new();
        for _ in 0..10_000 {
            for stream in [1, 2] {
                ob.send_control(Frame {
                    stream,
                    body: Body::Credit(3),
                })
                .unwrap();
            }
        }
        for seq in [5, 9, 7] {
            ob.send_control(Frame {
                stream: 1,
                body: Body::ExecAck { seq },
            })
            .unwrap();
        }
        let queued: Vec<Frame> = std::iter::from_fn(|| ob.pop()).collect();
        let bodies: Vec<(u32, Body)> = queued.into_iter().map(|f| (f.stream, f.body)).collect();
        assert_eq!(
            bodies,
            [
                (1, Body::Credit(30_000)),
                (2, Body::Credit(30_000)),
                (1, Body::ExecAck { seq: 9 })
            ]
        );
        assert_eq!(ob.lock().pending, 3);
    }

    /// A reply that cannot be a frame (a `List` of a huge directory) used to be dropped with a
    /// log line: the request was never answered (and since deadlines, the VM was cut off).
    #[tokio::test]
    async fn a_reply_too_big_for_a_frame_is_answered_with_an_error() {
        use crate::rpc::msg::{DirEntry, FileKind, FileStat, Reply};
        let ob = std::sync::Arc::new(Outbox::new());
        let (a, mut b) = tokio::io::duplex(1 << 16);
        let w = ob.clone();
        tokio::spawn(async move { w.run_writer(a).await });
        let entry = |i: usize| DirEntry {
            name: format!("a-rather-long-file-name-{i:08}"),
            stat: FileStat {
                kind: FileKind::File,
                size: 0,
                mode: 0o644,
                mtime: 0,
                uid: 1000,
                gid: 1000,
                link: None,
            },
        };
        ob.send(Frame {
            stream: 5,
            body: Body::Reply(Reply::List((0..100_000).map(entry).collect())),
        })
        .unwrap();
        let f = tokio::time::timeout(std::time::Duration::from_secs(10), read_frame(&mut b))
            .await
            .expect("the too-big reply was dropped: no answer at all")
            .unwrap()
            .unwrap();
        assert_eq!(f.stream, 5);
        assert!(
            matches!(&f.body, Body::Error(e) if e.message.contains("100000 entries")),
            "{:?}",
            f.body
        );
    }

    #[tokio::test]
    async fn writer_writes_frames_and_reports_idle() {
        let ob = std::sync::Arc::new(Outbox::new());
        let (a, mut b) = tokio::io::duplex(1 << 16);
        let w = ob.clone();
        let task = tokio::spawn(async move { w.run_writer(a).await });
        ob.send(Frame {
            stream: 1,
            body: Body::DataEnd,
        })
        .unwrap();
        tokio::time::timeout(std::time::Duration::from_secs(5), ob.wait_idle())
            .await
            .unwrap();
        let f = read_frame(&mut b).await.unwrap().unwrap();
        assert_eq!(f.body, Body::DataEnd);
        ob.close();
        task.await.unwrap().unwrap();
        assert!(
            ob.send(Frame {
                stream: 1,
                body: Body::DataEnd
            })
            .is_err()
        );
    }
}
