//! Directory watches ([`AgentClient::watch_dir`]): a long-lived stream of [`WatchBatch`]es.
//!
//! Owns the host's checks of what a watching guest sends: every batch is decoded within its
//! frame (the codec bounds it; no length the guest declares is allocated beyond it), holds at
//! most [`WATCH_MAX_BATCH`] events with names of at most [`WATCH_MAX_NAME`] bytes, and costs
//! the stream's window until the caller took it (credit goes back only then, so a guest that
//! floods waits for a slow consumer instead of growing a queue here). A batch that breaks a rule
//! ends the watch (the stream is cancelled; the connection lives on). Between batches there is
//! no deadline: a quiet directory is not a hung agent, and a dead connection ends the stream.

use super::super::RpcError;
use super::super::frame::decode_answer;
use super::super::msg::{Body, Request, WATCH_MAX_BATCH, WATCH_MAX_NAME, WatchBatch};
use super::streams::OpenStream;
use super::{AgentClient, unexpected};

/// A directory watch in the guest; dropping it cancels the watch there.
pub struct DirWatch {
    s: OpenStream,
    done: bool,
}

/// Checks and decodes one `Data` frame of a watch.
fn batch(d: &[u8]) -> Result<WatchBatch, RpcError> {
    let b: WatchBatch =
        decode_answer(d).map_err(|e| RpcError::Protocol(format!("bad watch batch: {e}")))?;
    if b.events.len() > WATCH_MAX_BATCH {
        return Err(RpcError::Protocol(format!(
            "a watch batch of {} events (at most {WATCH_MAX_BATCH})",
            b.events.len()
        )));
    }
    if let Some(e) = b.events.iter().find(|e| e.name.len() > WATCH_MAX_NAME) {
        return Err(RpcError::Protocol(format!(
            "a watch event name of {} bytes (at most {WATCH_MAX_NAME})",
            e.name.len()
        )));
    }
    Ok(b)
}

impl std::fmt::Debug for DirWatch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DirWatch")
            .field("stream", &self.s.id)
            .finish()
    }
}

impl DirWatch {
    /// The next batch of events, however long it takes; `Ok(None)` once the guest ended the
    /// watch without an error. After an error the watch is over (drop it).
    pub async fn next(&mut self) -> Result<Option<WatchBatch>, RpcError> {
        if self.done {
            return Ok(None);
        }
        match self.s.recv().await? {
            Body::Data(d) => {
                let b = batch(&d)?;
                self.s.grant(d.len())?;
                Ok(Some(b))
            }
            Body::DataEnd => {
                self.done = true;
                Ok(None)
            }
            Body::Error(e) => Err(RpcError::Remote(e)),
            other => Err(unexpected(&other)),
        }
    }
}

impl AgentClient {
    /// Watches directory `path` in the guest (with `recursive`, its tree): returns once the
    /// watch is in place (within the reply deadline), so every change after that is reported.
    pub async fn watch_dir(&self, path: &str, recursive: bool) -> Result<DirWatch, RpcError> {
        let mut s = self.open(true)?;
        s.send(Body::Request(Request::WatchDir {
            path: path.into(),
            recursive,
        }))?;
        // The guest reads the tree to watch it, then answers with an empty batch.
        match s.recv_within("watch_dir").await? {
            Body::Data(d) => {
                let first = batch(&d)?;
                s.grant(d.len())?;
                if !first.events.is_empty() {
                    return Err(RpcError::Protocol(
                        "the first batch of a watch must be empty".into(),
                    ));
                }
                Ok(DirWatch { s, done: false })
            }
            Body::Error(e) => Err(RpcError::Remote(e)),
            other => Err(unexpected(&other)),
        }
    }
}
