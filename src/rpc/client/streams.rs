//! One connection's streams: the state shared by the client handles and the reader task
//! ([`Shared`]: stream ids, routing of incoming frames, per-stream credit for host->guest
//! `Data`), the guards that end the connection ([`Handle`], [`CloseOnDrop`]) and one request's
//! stream ([`OpenStream`]).

use super::super::frame::CHUNK;
use super::super::msg::{Body, CONTROL_STREAM, Frame};
use super::super::outbox::Outbox;
use super::super::{RpcError, WINDOW};
use std::collections::HashMap;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex};
use tokio::sync::{Semaphore, mpsc};

pub(super) type StreamTx = mpsc::UnboundedSender<Body>;

/// State shared by the client handles and the reader task.
pub(super) struct Shared {
    pub(super) outbox: Outbox,
    /// `None` once the connection is dead; dropping the senders ends every receiver.
    pub(super) streams: Mutex<Option<HashMap<u32, StreamTx>>>,
    /// Credit for host->guest `Data`, per stream.
    pub(super) credits: Mutex<HashMap<u32, Arc<Semaphore>>>,
    pub(super) next_stream: AtomicU32,
}

impl Shared {
    fn lock_streams(&self) -> std::sync::MutexGuard<'_, Option<HashMap<u32, StreamTx>>> {
        self.streams.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn lock_credits(&self) -> std::sync::MutexGuard<'_, HashMap<u32, Arc<Semaphore>>> {
        self.credits.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub(super) fn open(
        &self,
    ) -> Result<(u32, mpsc::UnboundedReceiver<Body>, Arc<Semaphore>), RpcError> {
        let mut g = self.lock_streams();
        let map = g.as_mut().ok_or(RpcError::Disconnected)?;
        let id = loop {
            let id = self.next_stream.fetch_add(1, Ordering::Relaxed);
            if id != CONTROL_STREAM && !map.contains_key(&id) {
                break id;
            }
        };
        let (tx, rx) = mpsc::unbounded_channel();
        map.insert(id, tx);
        let sem = Arc::new(Semaphore::new(WINDOW));
        self.lock_credits().insert(id, sem.clone());
        Ok((id, rx, sem))
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

    pub(super) fn dispatch(&self, frame: Frame) -> Result<(), RpcError> {
        if let Body::Credit(n) = frame.body {
            if let Some(sem) = self.lock_credits().get(&frame.stream) {
                if sem.available_permits() + n as usize > WINDOW {
                    return Err(RpcError::Protocol(format!(
                        "credit overflow on stream {}",
                        frame.stream
                    )));
                }
                sem.add_permits(n as usize);
            }
            return Ok(());
        }
        if let Some(map) = self.lock_streams().as_ref()
            && let Some(tx) = map.get(&frame.stream)
        {
            // The receiver may be gone (caller dropped); late frames are discarded.
            let _ = tx.send(frame.body);
        }
        Ok(())
    }

    pub(super) async fn send_data(
        &self,
        stream: u32,
        sem: &Semaphore,
        data: &[u8],
    ) -> Result<(), RpcError> {
        for chunk in data.chunks(CHUNK) {
            sem.acquire_many(chunk.len() as u32)
                .await
                .map_err(|_| RpcError::Disconnected)?
                .forget();
            self.outbox.send(Frame {
                stream,
                body: Body::Data(chunk.to_vec()),
            })?;
        }
        Ok(())
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
}

impl Drop for OpenStream {
    fn drop(&mut self) {
        self.handle.shared.close_stream(self.id);
    }
}

impl OpenStream {
    pub(super) async fn recv(&mut self) -> Result<Body, RpcError> {
        self.rx.recv().await.ok_or(RpcError::Disconnected)
    }

    pub(super) fn send(&self, body: Body) -> Result<(), RpcError> {
        Ok(self.handle.shared.outbox.send(Frame {
            stream: self.id,
            body,
        })?)
    }

    pub(super) fn send_control(&self, body: Body) -> Result<(), RpcError> {
        Ok(self.handle.shared.outbox.send_control(Frame {
            stream: self.id,
            body,
        })?)
    }
}
