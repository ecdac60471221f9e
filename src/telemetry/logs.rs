//! Exec output logs: each exec's stdout, stderr and both interleaved (`output`) are written to
//! `<sandbox dir>/execs/<exe_id>/{stdout,stderr,output}.log`, each capped at a configured size
//! (bytes past the cap are counted, not kept), with an in-memory ring of the newest bytes so
//! live readers are served without touching the disk. `meta.json` records the final sizes and
//! what the cap dropped once the exec ends.
//!
//! Offsets are byte offsets into one stream's log. Never: grows past the cap, or blocks a
//! writer on a reader (readers copy out under a short lock).

use std::collections::{HashMap, VecDeque};
use std::fs::File;
use std::io::{BufWriter, Read as _, Seek as _, SeekFrom, Write as _};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use serde::{Deserialize, Serialize};
use tokio::sync::watch;

/// Bytes of each stream kept in memory for live readers. Must exceed the write buffer, so every
/// byte before the ring is already in the file.
pub const RING_BYTES: usize = 64 * 1024;
const WRITE_BUFFER: usize = 16 * 1024;
/// Largest chunk one read returns.
pub const MAX_READ: usize = 1024 * 1024;

/// The API's output stream names (`api::OutputStream`).
pub use crate::api::OutputStream as Stream;

impl Stream {
    const ALL: [Stream; 3] = [Stream::Output, Stream::Stdout, Stream::Stderr];
    fn index(self) -> usize {
        self as usize
    }
    pub fn file_name(self) -> &'static str {
        match self {
            Stream::Output => "output.log",
            Stream::Stdout => "stdout.log",
            Stream::Stderr => "stderr.log",
        }
    }
    pub fn parse(s: &str) -> Option<Stream> {
        match s {
            "output" | "both" => Some(Stream::Output),
            "stdout" => Some(Stream::Stdout),
            "stderr" => Some(Stream::Stderr),
            _ => None,
        }
    }
}

/// Written next to the logs when the exec ends.
#[derive(Debug, Default, Clone, Serialize, Deserialize)]
pub struct Meta {
    /// Bytes kept, per stream (output, stdout, stderr).
    pub kept: [u64; 3],
    /// Bytes the cap dropped, per stream.
    pub dropped: [u64; 3],
}

/// A piece of a log.
#[derive(Debug, Clone, PartialEq)]
pub struct Chunk {
    pub offset: u64,
    pub data: Vec<u8>,
    /// Offset to ask for next.
    pub next_offset: u64,
    /// The exec is still running (more may come).
    pub running: bool,
    /// The cap dropped some of this stream's output.
    pub truncated: bool,
    /// Nothing more will ever come after `next_offset`.
    pub eof: bool,
}

struct StreamLog {
    file: Option<BufWriter<File>>,
    len: u64,
    dropped: u64,
    ring: VecDeque<u8>,
}

impl StreamLog {
    fn ring_start(&self) -> u64 {
        self.len - self.ring.len() as u64
    }
}

struct State {
    streams: [StreamLog; 3],
    running: bool,
}

/// The log of one running exec.
pub struct ExecLog {
    dir: PathBuf,
    cap: u64,
    state: Mutex<State>,
    /// Bumped on every write and at the end, for readers waiting for more.
    changed: watch::Sender<u64>,
}

impl ExecLog {
    /// Create the log files in `dir` (created if needed). A file that cannot be created is
    /// logged and that stream is kept in the ring only.
    pub fn create(dir: &Path, cap: u64) -> ExecLog {
        if let Err(e) = std::fs::create_dir_all(dir) {
            tracing::warn!(dir = %dir.display(), error = %e, "cannot create the exec log directory");
        }
        let open = |s: Stream| match File::create(dir.join(s.file_name())) {
            Ok(f) => Some(BufWriter::with_capacity(WRITE_BUFFER, f)),
            Err(e) => {
                tracing::warn!(dir = %dir.display(), error = %e, "cannot create an exec log file");
                None
            }
        };
        let streams = Stream::ALL.map(|s| StreamLog {
            file: open(s),
            len: 0,
            dropped: 0,
            ring: VecDeque::new(),
        });
        ExecLog {
            dir: dir.to_path_buf(),
            cap,
            state: Mutex::new(State {
                streams,
                running: true,
            }),
            changed: watch::Sender::new(0),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Append output of one stream (it also goes to the interleaved `output`).
    pub fn write(&self, stderr: bool, bytes: &[u8]) {
        {
            let mut st = self.lock();
            let which = if stderr {
                Stream::Stderr
            } else {
                Stream::Stdout
            };
            for s in [which, Stream::Output] {
                append(&mut st.streams[s.index()], bytes, self.cap);
            }
        }
        self.changed.send_modify(|v| *v += 1);
    }

    /// Flush the files, write `meta.json`, and tell readers the exec ended.
    pub fn finish(&self) {
        let meta = {
            let mut st = self.lock();
            st.running = false;
            for s in st.streams.iter_mut() {
                if let Some(f) = s.file.as_mut()
                    && let Err(e) = f.flush()
                {
                    tracing::warn!(dir = %self.dir.display(), error = %e, "cannot flush an exec log");
                }
            }
            Meta {
                kept: [0, 1, 2].map(|i| st.streams[i].len),
                dropped: [0, 1, 2].map(|i| st.streams[i].dropped),
            }
        };
        let json = serde_json::to_vec(&meta).expect("meta serializes");
        if let Err(e) = std::fs::write(self.dir.join("meta.json"), json) {
            tracing::warn!(dir = %self.dir.display(), error = %e, "cannot write the exec log meta");
        }
        self.changed.send_modify(|v| *v += 1);
    }

    /// Read up to `max` bytes of `stream` from `offset`.
    pub fn read(&self, stream: Stream, offset: u64, max: usize) -> Chunk {
        let st = self.lock();
        let s = &st.streams[stream.index()];
        let offset = offset.min(s.len);
        let ring_start = s.ring_start();
        let data = if offset >= ring_start {
            let skip = (offset - ring_start) as usize;
            s.ring.iter().skip(skip).take(max).copied().collect()
        } else {
            // Older than the ring: it is in the file (see RING_BYTES).
            let want = ((ring_start - offset) as usize).min(max);
            read_file(&self.dir.join(stream.file_name()), offset, want)
        };
        let next_offset = offset + data.len() as u64;
        Chunk {
            offset,
            next_offset,
            running: st.running,
            truncated: s.dropped > 0,
            eof: !st.running && next_offset >= s.len,
            data,
        }
    }

    /// A receiver that changes when output arrives or the exec ends.
    pub fn watch(&self) -> watch::Receiver<u64> {
        self.changed.subscribe()
    }
}

fn append(s: &mut StreamLog, bytes: &[u8], cap: u64) {
    let room = cap.saturating_sub(s.len) as usize;
    let (keep, drop) = bytes.split_at(bytes.len().min(room));
    s.dropped += drop.len() as u64;
    if keep.is_empty() {
        return;
    }
    if let Some(f) = s.file.as_mut()
        && let Err(e) = f.write_all(keep)
    {
        tracing::warn!(error = %e, "cannot write an exec log; keeping it in memory only");
        s.file = None;
    }
    s.len += keep.len() as u64;
    s.ring.extend(keep);
    let over = s.ring.len().saturating_sub(RING_BYTES);
    s.ring.drain(..over);
}

fn read_file(path: &Path, offset: u64, want: usize) -> Vec<u8> {
    let mut buf = Vec::new();
    if let Ok(mut f) = File::open(path)
        && f.seek(SeekFrom::Start(offset)).is_ok()
    {
        let _ = f.take(want as u64).read_to_end(&mut buf);
    }
    buf
}

/// Read a finished exec's log from its directory. `None` when the directory is gone.
pub fn read_finished(dir: &Path, stream: Stream, offset: u64, max: usize) -> Option<Chunk> {
    let path = dir.join(stream.file_name());
    let len = std::fs::metadata(&path).ok()?.len();
    let meta: Meta = std::fs::read(dir.join("meta.json"))
        .ok()
        .and_then(|b| serde_json::from_slice(&b).ok())
        .unwrap_or_default();
    let offset = offset.min(len);
    let data = read_file(&path, offset, max.min((len - offset) as usize));
    let next_offset = offset + data.len() as u64;
    Some(Chunk {
        offset,
        next_offset,
        running: false,
        truncated: meta.dropped[stream.index()] > 0,
        eof: next_offset >= len,
        data,
    })
}

/// The logs of running execs, by exec id.
#[derive(Default)]
pub struct ExecLogs {
    live: Mutex<HashMap<String, Arc<ExecLog>>>,
}

impl ExecLogs {
    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, Arc<ExecLog>>> {
        self.live.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub fn start(&self, exec_id: &str, dir: &Path, cap: u64) -> Arc<ExecLog> {
        let log = Arc::new(ExecLog::create(dir, cap));
        self.lock().insert(exec_id.to_owned(), log.clone());
        log
    }

    pub fn end(&self, exec_id: &str) {
        if let Some(log) = self.lock().remove(exec_id) {
            log.finish();
        }
    }

    pub fn live(&self, exec_id: &str) -> Option<Arc<ExecLog>> {
        self.lock().get(exec_id).cloned()
    }
}

/// Remove ANSI escape sequences (colors, cursor moves) from output.
pub fn strip_ansi(bytes: &[u8]) -> Vec<u8> {
    strip_ansi_escapes::strip(bytes)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn log_cap_keeps_the_first_bytes_and_counts_the_rest() {
        let dir = tempfile::tempdir().unwrap();
        let log = ExecLog::create(dir.path(), 10);
        log.write(false, b"0123456");
        log.write(true, b"ab");
        log.write(false, b"789XYZ");
        let out = log.read(Stream::Output, 0, MAX_READ);
        assert_eq!(out.data, b"0123456ab7");
        assert!(out.truncated && out.running && !out.eof);
        let so = log.read(Stream::Stdout, 0, MAX_READ);
        assert_eq!(so.data, b"0123456789");
        assert!(so.truncated);
        let se = log.read(Stream::Stderr, 0, MAX_READ);
        assert_eq!(se.data, b"ab");
        assert!(!se.truncated);
        log.finish();
        // On disk: the same bytes, never more than the cap; meta.json says what was dropped.
        assert_eq!(
            std::fs::read(dir.path().join("output.log")).unwrap(),
            b"0123456ab7"
        );
        assert_eq!(
            std::fs::read(dir.path().join("stdout.log")).unwrap(),
            b"0123456789"
        );
        let done = read_finished(dir.path(), Stream::Output, 3, MAX_READ).unwrap();
        assert_eq!(done.data, b"3456ab7");
        assert!(done.truncated && done.eof && !done.running);
        let meta: Meta =
            serde_json::from_slice(&std::fs::read(dir.path().join("meta.json")).unwrap()).unwrap();
        assert_eq!(meta.kept, [10, 10, 2]);
        assert_eq!(meta.dropped, [5, 3, 0]);
    }

    #[test]
    fn live_readers_get_old_bytes_from_the_file_and_new_ones_from_the_ring() {
        let dir = tempfile::tempdir().unwrap();
        let log = ExecLog::create(dir.path(), u64::MAX);
        let total = RING_BYTES * 3 + 123;
        let data: Vec<u8> = (0..total).map(|i| (i % 251) as u8).collect();
        for piece in data.chunks(1000) {
            log.write(false, piece);
        }
        let mut got = Vec::new();
        let mut off = 0;
        loop {
            let c = log.read(Stream::Stdout, off, 7000);
            if c.data.is_empty() {
                break;
            }
            off = c.next_offset;
            got.extend(c.data);
        }
        assert_eq!(got.len(), data.len());
        assert!(got == data, "bytes differ");
        let c = log.read(Stream::Stdout, off + 50, 10);
        assert_eq!((c.offset, c.data.len(), c.eof), (total as u64, 0, false));
    }

    #[tokio::test]
    async fn readers_are_woken_by_output_and_by_the_end() {
        let dir = tempfile::tempdir().unwrap();
        let logs = ExecLogs::default();
        let log = logs.start("exe_1", dir.path(), 1 << 20);
        let mut w = log.watch();
        let writer = log.clone();
        tokio::spawn(async move { writer.write(false, b"hi") });
        tokio::time::timeout(std::time::Duration::from_secs(5), w.changed())
            .await
            .unwrap()
            .unwrap();
        assert_eq!(log.read(Stream::Stdout, 0, 10).data, b"hi");
        logs.end("exe_1");
        assert!(logs.live("exe_1").is_none());
        assert!(
            read_finished(dir.path(), Stream::Stdout, 0, 10)
                .unwrap()
                .eof
        );
    }

    #[test]
    fn ansi_colors_are_stripped_on_request() {
        assert_eq!(strip_ansi(b"\x1b[31mred\x1b[0m plain"), b"red plain");
    }
}
