//! Fetching the VM's changed files for a diff, apply or pull: each file goes chunk by chunk
//! from the agent into the operation's spill ([`crate::workspace::spill`]), hashed as it
//! arrives: a small file in memory, received on the async task itself (no thread, no file),
//! a bigger one (or any once the daemon's in-memory budget is spent) through a blocking
//! thread into a spill file, never whole in memory. A few files at once; the first error (a
//! file past `sync.max_file_mib`, the operation past `sync.max_diff_mib`, the agent refusing)
//! ends the fetch and drops the other reads.
//!
//! The limits hold whatever the agent sends: an agent that follows a symlink swapped in after
//! the walk (`/dev/zero`), or a file that grows, is cut off at the limit.

use std::collections::HashMap;
use std::sync::Arc;

use futures_util::StreamExt;

use super::ServiceError;
use super::workspace::{agent_err, guest_path};
use crate::rpc::AgentClient;
use crate::workspace::spill::{Spill, Spilled};

/// VM files fetched at once.
const FETCH_CONCURRENCY: usize = 8;

/// Fetch `wanted` (workspace-relative paths with the size the walk gave) into `spill`, each
/// at most `max_file` bytes. Path -> spilled content.
pub(super) async fn into_spill(
    agent: &AgentClient,
    spill: &Arc<Spill>,
    wanted: Vec<(String, u64)>,
    max_file: u64,
) -> Result<HashMap<String, Spilled>, ServiceError> {
    let mut fetches = futures_util::stream::iter(wanted)
        .map(|(rel, _size)| one(agent, spill, rel, max_file))
        .buffer_unordered(FETCH_CONCURRENCY);
    let mut out = HashMap::new();
    while let Some(r) = fetches.next().await {
        // The first error drops the other reads in flight (their streams end on the host side).
        let (rel, sp) = r?;
        out.insert(rel, sp);
    }
    Ok(out)
}

/// Chunks queued between the agent and a file's writer thread (32 KiB each).
const QUEUED_CHUNKS: usize = 16;

/// One file: chunks from the agent go to memory while the file is small; past that, they are
/// queued to a blocking thread that writes and hashes them, so receiving goes on while the
/// previous chunks are written.
async fn one(
    agent: &AgentClient,
    spill: &Arc<Spill>,
    rel: String,
    max_file: u64,
) -> Result<(String, Spilled), ServiceError> {
    let mut w = spill.writer(&rel, max_file);
    let mut chunks = agent
        .read_file_chunks(&guest_path(&rel))
        .await
        .map_err(agent_err)?;
    // In memory: only memory work here, on the async task.
    let first_on_disk = loop {
        match chunks.next().await.map_err(agent_err)? {
            None => return Ok((rel, w.finish()?)),
            Some(c) if w.write_in_memory(&c)? => {}
            Some(c) => break c,
        }
    };
    let (tx, mut rx) = tokio::sync::mpsc::channel::<Vec<u8>>(QUEUED_CHUNKS);
    let writer = tokio::task::spawn_blocking(move || {
        w.write(&first_on_disk)?;
        while let Some(c) = rx.blocking_recv() {
            w.write(&c)?;
        }
        w.finish()
    });
    let read = async {
        while let Some(c) = chunks.next().await.map_err(agent_err)? {
            if tx.send(c).await.is_err() {
                // The writer stopped (a limit, a full disk): its error says why.
                break;
            }
        }
        Ok::<(), ServiceError>(())
    };
    let read = read.await;
    drop(tx);
    let written = writer
        .await
        .map_err(|e| ServiceError::Internal(format!("workspace task failed: {e}")))?;
    read?;
    Ok((rel, written?))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rpc::frame::{encode, read_frame};
    use crate::rpc::msg::{Body, Frame, PROTOCOL_VERSION, Request};
    use std::time::Duration;
    use tokio::io::AsyncWriteExt;

    const T: Duration = Duration::from_secs(30);

    /// A hostile guest: answers every `ReadFile` with endless bytes (a stock agent reading a
    /// file swapped for a symlink to `/dev/zero` does the same), within the credit it gets.
    /// Returns the client and a counter of the bytes it sent.
    async fn endless_guest() -> (AgentClient, Arc<std::sync::atomic::AtomicU64>) {
        let (host, guest) = tokio::io::duplex(1 << 20);
        let sent = Arc::new(std::sync::atomic::AtomicU64::new(0));
        let sent2 = sent.clone();
        tokio::spawn(async move {
            let (mut rd, mut wr) = tokio::io::split(guest);
            let Ok(Some(Frame {
                body: Body::Hello { nonce, .. },
                ..
            })) = read_frame(&mut rd).await
            else {
                return;
            };
            let ack = Frame {
                stream: 0,
                body: Body::HelloAck {
                    protocol: PROTOCOL_VERSION,
                    version: "hostile".into(),
                    nonce,
                },
            };
            if wr.write_all(&encode(&ack).unwrap()).await.is_err() {
                return;
            }
            // Credit per stream, shared by the frame reader and the writers.
            let credit: Arc<std::sync::Mutex<HashMap<u32, Arc<tokio::sync::Semaphore>>>> =
                Default::default();
            let (tx, mut rx) = tokio::sync::mpsc::channel::<Frame>(16);
            tokio::spawn(async move {
                while let Some(f) = rx.recv().await {
                    if wr.write_all(&encode(&f).unwrap()).await.is_err() {
                        return;
                    }
                }
            });
            while let Ok(Some(f)) = read_frame(&mut rd).await {
                match f.body {
                    Body::Request(Request::ReadFile { .. }) => {
                        let sem = Arc::new(tokio::sync::Semaphore::new(crate::rpc::WINDOW));
                        credit.lock().unwrap().insert(f.stream, sem.clone());
                        let (tx, sent) = (tx.clone(), sent2.clone());
                        tokio::spawn(async move {
                            let chunk = vec![0u8; 32 * 1024];
                            loop {
                                let Ok(p) = sem.acquire_many(chunk.len() as u32).await else {
                                    return;
                                };
                                p.forget();
                                let d = Frame {
                                    stream: f.stream,
                                    body: Body::Data(chunk.clone()),
                                };
                                if tx.send(d).await.is_err() {
                                    return;
                                }
                                sent.fetch_add(
                                    chunk.len() as u64,
                                    std::sync::atomic::Ordering::Relaxed,
                                );
                            }
                        });
                    }
                    Body::Credit(n) => {
                        if let Some(s) = credit.lock().unwrap().get(&f.stream) {
                            s.add_permits(n as usize);
                        }
                    }
                    _ => {}
                }
            }
        });
        let client = tokio::time::timeout(T, AgentClient::connect(host))
            .await
            .unwrap()
            .unwrap();
        (client, sent)
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_guest_sending_endless_bytes_is_cut_off_at_the_limits() {
        let (agent, sent) = endless_guest().await;
        let d = tempfile::tempdir().unwrap();
        // Per file: the walk said 10 bytes; the guest sends /dev/zero.
        let spill = Arc::new(Spill::new(d.path(), 64 << 20).unwrap());
        let e = tokio::time::timeout(
            T,
            into_spill(&agent, &spill, vec![("f".into(), 10)], 1 << 20),
        )
        .await
        .expect("the fetch ends")
        .unwrap_err()
        .to_string();
        assert!(e.contains("sync.max_file_mib") && e.contains(" f "), "{e}");
        assert!(spill.used() <= 1 << 20, "{} bytes kept", spill.used());
        // The whole operation: 8 files at once, each under its own limit, over the budget.
        let spill = Arc::new(Spill::new(d.path(), 2 << 20).unwrap());
        let files = (0..20).map(|i| (format!("f{i}"), 10)).collect();
        let e = tokio::time::timeout(T, into_spill(&agent, &spill, files, 1 << 20))
            .await
            .expect("the fetch ends")
            .unwrap_err()
            .to_string();
        assert!(e.contains("sync.max_diff_mib"), "{e}");
        assert!(spill.used() <= 2 << 20, "{} bytes kept", spill.used());
        let on_disk: u64 = spill.dir().map_or(0, |dir| {
            std::fs::read_dir(dir)
                .unwrap()
                .map(|e| e.unwrap().metadata().unwrap().len())
                .sum()
        });
        assert!(on_disk <= 2 << 20, "{on_disk} bytes on disk");
        // What the guest got to send is bounded by the limits plus one window per stream.
        let n = sent.load(std::sync::atomic::Ordering::Relaxed);
        assert!(
            n < (3 << 20) + 9 * crate::rpc::WINDOW as u64,
            "{n} bytes sent"
        );
    }
}
