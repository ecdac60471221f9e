//! Host <-> guest RPC: length-prefixed bincode frames, message types, stream multiplexing
//! with per-stream flow control. Shared by the daemon and the guest agent; transport-agnostic
//! (virtio-serial by default, vsock where the host offers it): everything runs over any tokio
//! `AsyncRead + AsyncWrite`.
//!
//! Owns the wire contract (see `docs/RPC.md`) and the host-side [`AgentClient`]. It never
//! touches VMs, disks or processes: the guest side of the work lives in `crate::guest`.
//!
//! Layout: [`msg`] (types), [`frame`] (codec), [`outbox`] (fair writer), [`client`] (host API:
//! `client/{connect,streams,exec}.rs` inside).

pub mod client;
pub mod frame;
#[cfg(any(test, fuzzing))]
pub mod fuzzing;
#[cfg(test)]
pub mod hostile;
pub mod msg;
pub mod outbox;

#[allow(unused_imports)]
pub use client::{
    AgentClient, Deadlines, DirWatch, ExecControl, ExecEvent, ExecRequest, ExecStream, FileChunks,
};
pub use frame::FrameError;
#[allow(unused_imports)]
pub use msg::{
    DirEntry, FileKind, FileStat, PtySize, RemoteError, WalkCursor, WalkDelta, WalkEntry,
};

/// Bytes of `Data` a sender may have in flight per stream before the receiver grants credit.
/// Also the window of unacknowledged exec output the guest may have in flight per exec.
pub const WINDOW: usize = 256 * 1024;

/// The least window a `Data` frame costs, however short: a peer flooding empty or one-byte
/// frames runs out of window after `WINDOW / MIN_DATA_COST` frames instead of growing the
/// receiver's queue for free.
pub const MIN_DATA_COST: usize = 64;

/// Window (and credit) a `Data` frame of `len` bytes costs: `max(len, MIN_DATA_COST)`. Both sides
/// count in these units: the sender acquires them before sending, the receiver charges them and
/// grants the same amount back once it consumed the frame.
pub fn data_cost(len: usize) -> usize {
    len.max(MIN_DATA_COST)
}

/// Errors of the RPC layer, seen by the daemon.
#[derive(Debug, thiserror::Error)]
pub enum RpcError {
    #[error(
        "the guest agent connection is gone (VM stopped, crashed or restarted); reconnect or recreate the sandbox"
    )]
    Disconnected,
    #[error("the guest agent did not answer within {0:?}; the VM may still be booting or be hung")]
    Timeout(std::time::Duration),
    /// The host closed the connection because the agent broke the protocol (e.g. sent more than
    /// its window) or missed a deadline; every later call fails with this too.
    #[error("the connection to the guest agent was closed: {0}")]
    Closed(String),
    /// The agent did not answer a request in time (see [`Deadlines`]); the connection is closed.
    #[error(
        "the guest agent did not answer {what} within {after:?}; it is hung or hostile, so its connection was closed"
    )]
    Deadline {
        what: String,
        after: std::time::Duration,
    },
    /// The agent did not answer a request in time but still answers a ping: it is alive and
    /// busy (or that one request is stuck, e.g. a read of a file that never ends). Only this
    /// request failed; the connection and the sandbox live on.
    #[error(
        "the guest agent did not answer {what} within {after:?} but still answers pings; the request was abandoned (the sandbox stays up: it is busy, or {what} is stuck inside the VM)"
    )]
    Slow {
        what: String,
        after: std::time::Duration,
    },
    /// An answer was bigger than the caller's cap; the request failed, the connection lives on.
    #[error("the guest agent's answer to {what} is larger than the {max}-byte cap")]
    TooLarge { what: String, max: u64 },
    #[error(
        "protocol version mismatch: host speaks {ours}, guest agent {agent_version} speaks {theirs}; rebuild the initramfs with this tryboxi binary"
    )]
    VersionMismatch {
        ours: u32,
        theirs: u32,
        agent_version: String,
    },
    #[error("the guest agent refused the request: {0}")]
    Remote(RemoteError),
    #[error("the guest agent sent an unexpected frame ({0}); it is broken or from another version")]
    Protocol(String),
    /// The guest broke a rule of the protocol that bounds what the host keeps (its window, the
    /// answers per stream); the host closes the connection.
    #[error("the guest agent broke the protocol: {0}")]
    Violation(String),
    #[error("invalid request: {0}")]
    Invalid(String),
    #[error(transparent)]
    Frame(#[from] FrameError),
    #[error("cannot reach the agent channel: {0}")]
    Io(#[from] std::io::Error),
    /// The caller's writer (`read_file_to`) failed; the request is abandoned.
    #[error("cannot store what the guest agent sent: {0}")]
    Store(std::io::Error),
}

impl From<outbox::Closed> for RpcError {
    fn from(_: outbox::Closed) -> Self {
        RpcError::Disconnected
    }
}
