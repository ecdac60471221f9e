//! Connecting: the retry loop over QEMU's chardev socket ([`AgentClient::connect_unix`]) and
//! the handshake over any byte stream ([`AgentClient::connect`]): a `Hello` with a fresh nonce,
//! skipping whatever an earlier connection left on the channel up to the `HelloAck` that echoes
//! it, then the connection's reader and writer tasks.

use super::streams::{CloseOnDrop, Handle, Shared};
use super::{AgentClient, unexpected};
use crate::rpc::RpcError;
use crate::rpc::frame::{FrameError, read_frame, seek_frame};
use crate::rpc::msg::{Body, CONTROL_STREAM, Frame, PROTOCOL_VERSION};
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite};

/// How long one connection attempt waits for the handshake before trying a new connection.
const HANDSHAKE_ATTEMPT: Duration = Duration::from_secs(5);

/// Largest `HelloAck` payload looked for (it holds two numbers and a short version string).
const MAX_HELLO_ACK: usize = 4096;

/// A fresh random nonce for one connection attempt. Unpredictability is not needed, only that
/// two attempts (of this daemon or an earlier one) practically never share a value, so a weak
/// fallback is fine if the OS has no entropy to give.
fn hello_nonce() -> u64 {
    getrandom::u64().unwrap_or_else(|_| {
        use std::hash::{BuildHasher, Hasher};
        let mut h = std::collections::hash_map::RandomState::new().build_hasher();
        h.write_u128(
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .unwrap_or_default()
                .as_nanos(),
        );
        h.write_u32(std::process::id());
        h.finish()
    })
}

impl AgentClient {
    /// Connects to the host end of the agent channel (QEMU's chardev unix socket), retrying
    /// until the guest agent answers the handshake or `timeout` passes.
    pub async fn connect_unix(path: &Path, timeout: Duration) -> Result<Self, RpcError> {
        let deadline = Instant::now() + timeout;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(RpcError::Timeout(timeout));
            }
            match tokio::net::UnixStream::connect(path).await {
                // A Hello can be lost (the agent was mid-reconnect, or read garbage first);
                // a fresh connection costs nothing, so do not wait on one for long.
                Ok(s) => match tokio::time::timeout(left.min(HANDSHAKE_ATTEMPT), Self::connect(s))
                    .await
                {
                    Ok(Ok(c)) => return Ok(c),
                    Ok(Err(
                        RpcError::Disconnected
                        | RpcError::Io(_)
                        | RpcError::Frame(_)
                        | RpcError::Protocol(_),
                    ))
                    | Err(_) => {}
                    Ok(Err(e)) => return Err(e),
                },
                Err(e) => {
                    tracing::trace!(path = %path.display(), error = %e, "agent socket not ready")
                }
            }
            tokio::time::sleep(Duration::from_millis(50).min(left)).await;
        }
    }

    /// Runs the handshake over `io` and starts the connection's reader and writer tasks.
    pub async fn connect<S>(io: S) -> Result<Self, RpcError>
    where
        S: AsyncRead + AsyncWrite + Send + Unpin + 'static,
    {
        let (mut rd, wr) = tokio::io::split(io);
        let shared = Arc::new(Shared::new());
        let w = shared.clone();
        let writer = tokio::spawn(async move {
            if let Err(e) = w.outbox.run_writer(wr).await {
                tracing::debug!(error = %e, "agent channel write failed");
            }
            w.kill();
        });
        let abort_writer = writer.abort_handle();
        // If the handshake fails or this future is dropped (a timeout), close the connection:
        // the writer task holds half of `io`, and a QEMU chardev accepts one client at a time.
        let mut guard = CloseOnDrop(Some((shared.clone(), abort_writer.clone())));
        let nonce = hello_nonce();
        let hello = Frame {
            stream: CONTROL_STREAM,
            body: Body::Hello {
                protocol: PROTOCOL_VERSION,
                version: env!("CARGO_PKG_VERSION").to_string(),
                nonce,
            },
        };
        // On a virtio port the byte stream outlives host connections: before the answer to this
        // Hello there can be frames the agent wrote for an earlier connection, a HelloAck for an
        // earlier (abandoned) attempt, even the tail of a half-written frame. Skip all of it, at
        // any byte offset, up to the HelloAck that echoes this connection's nonce; everything
        // after it belongs to this connection.
        let handshake = async {
            shared.outbox.send_control(hello)?;
            let found = seek_frame(
                &mut rd,
                MAX_HELLO_ACK,
                |f| matches!(f.body, Body::HelloAck { nonce: n, .. } if n == nonce),
            )
            .await?;
            let Some(found) = found else {
                return Err(RpcError::Disconnected);
            };
            if found.skipped > 0 {
                tracing::info!(
                    bytes = found.skipped,
                    "skipped what an earlier connection left on the agent channel"
                );
            }
            let rest = found.rest;
            let (protocol, version) = match found.frame.body {
                Body::HelloAck {
                    protocol, version, ..
                } => (protocol, version),
                other => return Err(unexpected(&other)),
            };
            if protocol != PROTOCOL_VERSION {
                return Err(RpcError::VersionMismatch {
                    ours: PROTOCOL_VERSION,
                    theirs: protocol,
                    agent_version: version,
                });
            }
            Ok((version, rest))
        };
        let (agent_version, rest) = handshake.await?;
        guard.0 = None;
        let mut rd = std::io::Cursor::new(rest).chain(rd);
        let r = shared.clone();
        let reader = tokio::spawn(async move {
            let res = loop {
                tokio::select! {
                    f = read_frame(&mut rd) => match f {
                        Ok(Some(frame)) => {
                            if let Err(e) = r.dispatch(frame) {
                                break Err(e);
                            }
                        }
                        Ok(None) => break Ok(()),
                        // The link ended (VM gone, socket reset): nothing the guest said.
                        Err(e @ (FrameError::Io(_) | FrameError::Truncated)) => {
                            tracing::debug!(error = %e, "agent channel ended");
                            break Ok(());
                        }
                        Err(e) => break Err(RpcError::from(e)),
                    },
                    _ = r.outbox.closed() => break Ok(()),
                }
            };
            match res {
                // The guest broke the protocol (a bad frame, a broken window): say why to every
                // caller and to the service.
                Err(e) => r.cut_off(e.to_string()),
                Ok(()) => r.kill(),
            }
        });
        tracing::debug!(agent_version = %agent_version, "guest agent connected");
        Ok(Self {
            handle: Arc::new(Handle {
                shared,
                agent_version,
                tasks: vec![abort_writer, reader.abort_handle()],
            }),
        })
    }
}
