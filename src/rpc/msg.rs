//! Wire message types of the host <-> guest protocol.
//!
//! Owns the shape of every frame. Never does I/O and never holds state: it is pure data,
//! shared verbatim by the daemon, the guest agent and the fuzz target. Changing a type here is a
//! protocol change: bump [`PROTOCOL_VERSION`].

use serde::{Deserialize, Serialize};

/// Bumped on every incompatible change of the types in this file.
pub const PROTOCOL_VERSION: u32 = 11;

/// Stream 0 carries connection-level frames (the handshake); every request opens a new stream.
pub const CONTROL_STREAM: u32 = 0;

/// One frame on the wire: a stream id and a body.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Frame {
    pub stream: u32,
    pub body: Body,
}

/// What a frame says. Direction is noted per variant (H = host, G = guest).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum Body {
    /// H->G, stream 0: first frame of every connection. `nonce` is random per connection
    /// attempt, so the host can tell its own `HelloAck` from one written for an earlier attempt.
    Hello {
        protocol: u32,
        version: String,
        nonce: u64,
    },
    /// G->H, stream 0: the answer to `Hello`, echoing its `nonce`.
    HelloAck {
        protocol: u32,
        version: String,
        nonce: u64,
    },
    /// H->G: opens the stream with a request.
    Request(Request),
    /// Bulk bytes in the sender's direction: exec stdin and write_file content (H->G),
    /// read_file content (G->H). Costs flow-control credit.
    Data(Vec<u8>),
    /// End of `Data` on this stream (stdin close, end of file content).
    DataEnd,
    /// The receiver of `Data` grants the sender this many more bytes.
    Credit(u32),
    /// H->G: send this signal to the exec's process group.
    Kill(i32),
    /// H->G: resize the exec's pty.
    Resize { rows: u16, cols: u16 },
    /// G->H: one sequenced exec event (replayable after a reconnect).
    Exec { seq: u64, event: WireExecEvent },
    /// H->G: every exec event with a sequence number <= `seq` has been consumed; the guest drops
    /// it from its spool and may send that many more bytes.
    ExecAck { seq: u64 },
    /// G->H: the terminal successful answer of a non-exec request.
    Reply(Reply),
    /// Either way: the request on this stream failed; the stream is over.
    Error(RemoteError),
    /// G->H: the request on this stream is still being worked on and made progress since the
    /// last `Progress` (entries deleted, walked or unpacked). Sent at most every few seconds;
    /// the host restarts the request's deadline on it and queues nothing.
    Progress,
    /// H->G: the host abandoned the request on this stream (a cap was hit, a deadline passed):
    /// stop it and release what it holds. No answer; ignored for execs and finished streams.
    Cancel,
}

/// Requests, each opening its own stream.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum Request {
    Ping,
    /// Sync disks and power the VM off.
    Shutdown,
    Exec(ExecSpec),
    /// Re-attach to a running or finished exec and replay its events from `from_seq`.
    Resume {
        exec_id: u64,
        from_seq: u64,
    },
    ReadFile {
        path: String,
    },
    /// The content follows as `Data` frames and a `DataEnd`.
    WriteFile {
        path: String,
        mode: u32,
    },
    Stat {
        path: String,
    },
    List {
        path: String,
    },
    Mkdir {
        path: String,
        mode: u32,
    },
    Remove {
        path: String,
        recursive: bool,
    },
    /// Workspace sync: first remove each of `delete` (paths relative to `dir`, recursively),
    /// then unpack the tar archive that follows as `Data` + `DataEnd` into `dir` (modes and
    /// mtimes preserved). Answered with `Done`.
    Untar {
        dir: String,
        delete: Vec<String>,
    },
    /// A manifest of the tree under `path` (not following symlinks, skipping directories whose
    /// name is in `skip`): bincode of `Vec<WalkEntry>` streamed as `Data` + `DataEnd`.
    Walk {
        path: String,
        skip: Vec<String>,
    },
    /// Like `Walk`, answered from a tree walk the agent keeps current with inotify: bincode of a
    /// [`WalkDelta`] streamed as `Data` + `DataEnd`, holding everything (`full`) or only what
    /// changed after `since` (a cursor of an earlier answer).
    WalkSince {
        path: String,
        skip: Vec<String>,
        since: Option<WalkCursor>,
        /// State every entry: no `base` entries (a walk that had some is done again).
        stat_all: bool,
    },
    /// Workspace sync through the transfer disk: remove each of `delete` (as `Untar`), then
    /// unpack the tar archive the host wrote at the start of the virtio-blk disk whose serial is
    /// `serial` (`len` bytes) into `dir`. Answered with `Done`.
    UntarDisk {
        dir: String,
        delete: Vec<String>,
        serial: String,
        len: u64,
    },
    /// First sync through the workspace base disk: the host wrote an ext4 file system holding
    /// the synced tree onto the virtio-blk disk whose serial is `serial`. The agent drops the
    /// device's page cache, mounts it read-only and mounts an overlayfs on `dir` with it as the
    /// lower layer (upper and work directories on the root disk). Refused (`InvalidRequest`)
    /// when `dir` is not empty or is already a mount. Answered with `Done`.
    MountBase {
        dir: String,
        serial: String,
    },
    /// Make a clone its own machine: set the kernel's hostname to `hostname` and mix `seed`
    /// (fresh host randomness) into the kernel's random pool. Answered with `Done`.
    SetIdentity {
        hostname: String,
        seed: Vec<u8>,
    },
    /// Set the guest's wall clock (`CLOCK_REALTIME`) to `unix_ms` milliseconds after the Unix
    /// epoch: sent whenever a VM comes up (boot, resume, restore, fork), whose clock would
    /// otherwise be the snapshot's. Refused (`InvalidRequest`) outside 2020..2200. Answered
    /// with `Done`.
    SetClock {
        unix_ms: u64,
    },
    /// `rename(2)` `from` to `to` (both absolute; `to` is replaced when it is a file or an empty
    /// directory). Answered with `Done`.
    Rename {
        from: String,
        to: String,
    },
    /// `lchown(2)`: give `path` (not following a symlink) to `uid`/`gid`. Answered with `Done`.
    Chown {
        path: String,
        uid: u32,
        gid: u32,
    },
    /// Watch the directory `path` with inotify (and, with `recursive`, its subdirectories down to
    /// [`WATCH_MAX_DEPTH`], at most [`WATCH_MAX_DIRS`] of them; new ones are watched as they
    /// appear) until the host sends `Cancel` or the directory goes away. Answered with `Data`
    /// frames, each the bincode of one [`WatchBatch`] within the stream's credit; the first one,
    /// empty, says the watch is in place. Ends with `Error` (`NotFound` when the directory was
    /// removed or moved away). Since protocol 10.
    WatchDir {
        path: String,
        recursive: bool,
    },
}

/// Deepest level under a [`Request::WatchDir`] root that is watched (the root is level 0).
pub const WATCH_MAX_DEPTH: usize = 16;
/// Most directories one recursive [`Request::WatchDir`] watches (more at the start is refused;
/// new ones past it are not watched).
pub const WATCH_MAX_DIRS: usize = 8192;
/// Most events in one [`WatchBatch`] (the host refuses more).
pub const WATCH_MAX_BATCH: usize = 1024;
/// Longest [`WatchEvent::name`] in bytes (the host refuses longer).
pub const WATCH_MAX_NAME: usize = 4096;

/// What happened to an entry of a watched directory (envd's `EventType`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum WatchKind {
    Create,
    Write,
    Remove,
    Rename,
    Chmod,
}

/// One change under a watched directory.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct WatchEvent {
    /// Relative to the watched directory, `/`-separated (at most [`WATCH_MAX_NAME`] bytes).
    pub name: String,
    pub kind: WatchKind,
}

/// What one `Data` frame of a [`Request::WatchDir`] stream holds.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, Default)]
pub struct WatchBatch {
    /// At most [`WATCH_MAX_BATCH`], in the order they happened.
    pub events: Vec<WatchEvent>,
    /// Events the guest lost since the last batch (its queue was full while the host gave no
    /// credit, or the kernel's inotify queue overflowed).
    pub lost: u64,
}

/// A position in the agent's walk cache: `generation` counts its updates, `epoch` names the cache
/// (a new cache, e.g. after an agent restart, has another epoch).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct WalkCursor {
    pub epoch: u64,
    pub generation: u64,
}

/// The answer to [`Request::WalkSince`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct WalkDelta {
    /// Pass it as `since` next time.
    pub cursor: WalkCursor,
    /// `entries` is the whole tree (the caller drops what it had); else only what changed.
    pub full: bool,
    /// New or changed entries (or all of them).
    pub entries: Vec<WalkEntry>,
    /// Paths removed since the cursor (every removed path, not just the top of a tree).
    pub removed: Vec<String>,
}

/// One entry of a [`Request::Walk`] answer.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct WalkEntry {
    /// Relative to the walked directory, `/`-separated.
    pub path: String,
    pub kind: FileKind,
    pub size: u64,
    pub mode: u32,
    pub mtime: i64,
    pub mtime_nsec: u32,
    /// Target of a symlink.
    pub link: Option<String>,
    /// Not stated: a file the workspace overlay still takes from its base disk, as the first
    /// sync wrote it (only in the first walk of a `WalkSince`; `size`, `mode`, the mtime and
    /// `link` are zero). The host takes its stat from the sync base's record.
    pub base: bool,
}

impl WalkEntry {
    /// An entry the agent did not state (see [`WalkEntry::base`]).
    pub fn unstated(path: String, kind: FileKind) -> WalkEntry {
        WalkEntry {
            path,
            kind,
            size: 0,
            mode: 0,
            mtime: 0,
            mtime_nsec: 0,
            link: None,
            base: true,
        }
    }
}

/// A command to run in the guest. Stdin is a pipe fed by `Data` frames on the exec's stream
/// and closed by `DataEnd` (in pty mode `Data` goes to the terminal and `DataEnd` is ignored).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, Default)]
pub struct ExecSpec {
    /// argv[0] is looked up in PATH. Ignored when `shell` is set.
    pub argv: Vec<String>,
    /// A string run with `/bin/sh -c`.
    pub shell: Option<String>,
    pub env: Vec<(String, String)>,
    /// Default: `/workspace`.
    pub cwd: Option<String>,
    /// Kill the whole process group after this long.
    pub timeout_ms: Option<u64>,
    pub pty: Option<PtySize>,
    /// Run as this user of the guest's `/etc/passwd` (its groups from `/etc/group`, `HOME`,
    /// `USER`, `LOGNAME`); `None`: as the agent (root). Since protocol 9.
    pub user: Option<String>,
}

/// Longest [`ExecSpec::user`].
pub const MAX_USER_NAME: usize = 32;

/// A user name as [`ExecSpec::user`] takes it: `[a-z_][a-z0-9_-]*`, at most
/// [`MAX_USER_NAME`] bytes.
pub fn valid_user_name(name: &str) -> bool {
    let mut b = name.bytes();
    matches!(b.next(), Some(c) if c.is_ascii_lowercase() || c == b'_')
        && name.len() <= MAX_USER_NAME
        && b.all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == b'_' || c == b'-')
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct PtySize {
    pub rows: u16,
    pub cols: u16,
}

/// Exec events as they travel; `Started` carries the exec id the host keeps for `Resume`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum WireExecEvent {
    Started {
        exec_id: u64,
        pid: u32,
    },
    Stdout(Vec<u8>),
    Stderr(Vec<u8>),
    Exit {
        code: Option<i32>,
        signal: Option<i32>,
        timed_out: bool,
    },
}

impl WireExecEvent {
    /// Bytes this event costs against the exec window and spool (payload plus a fixed
    /// per-event overhead, so many tiny chunks are bounded too).
    pub fn cost(&self) -> usize {
        const OVERHEAD: usize = 64;
        match self {
            WireExecEvent::Stdout(b) | WireExecEvent::Stderr(b) => b.len() + OVERHEAD,
            _ => OVERHEAD,
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum Reply {
    Pong,
    Done,
    /// `Resume` accepted; events follow.
    Resumed,
    Stat(FileStat),
    List(Vec<DirEntry>),
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum FileKind {
    File,
    Dir,
    Symlink,
    Other,
}

impl FileKind {
    /// The kind of a file as `lstat` saw it (a symlink is not followed).
    pub fn of(ft: std::fs::FileType) -> FileKind {
        if ft.is_symlink() {
            FileKind::Symlink
        } else if ft.is_dir() {
            FileKind::Dir
        } else if ft.is_file() {
            FileKind::File
        } else {
            FileKind::Other
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct FileStat {
    pub kind: FileKind,
    pub size: u64,
    /// Permission bits (`st_mode & 0o7777`).
    pub mode: u32,
    /// Seconds since the epoch.
    pub mtime: i64,
    /// Owner and group ids.
    pub uid: u32,
    pub gid: u32,
    /// Target of a symlink (bounded by the guest to `PATH_MAX`).
    pub link: Option<String>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DirEntry {
    pub name: String,
    pub stat: FileStat,
}

/// Why a request failed, as the guest saw it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum ErrorKind {
    NotFound,
    AlreadyExists,
    PermissionDenied,
    InvalidRequest,
    Busy,
    Io,
    Protocol,
    Other,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RemoteError {
    pub kind: ErrorKind,
    pub message: String,
}

impl RemoteError {
    pub fn new(kind: ErrorKind, message: impl Into<String>) -> Self {
        Self {
            kind,
            message: message.into(),
        }
    }

    pub fn from_io(context: &str, e: &std::io::Error) -> Self {
        let kind = match e.kind() {
            std::io::ErrorKind::NotFound => ErrorKind::NotFound,
            std::io::ErrorKind::AlreadyExists => ErrorKind::AlreadyExists,
            std::io::ErrorKind::PermissionDenied => ErrorKind::PermissionDenied,
            std::io::ErrorKind::InvalidInput => ErrorKind::InvalidRequest,
            _ => ErrorKind::Io,
        };
        Self::new(kind, format!("{context}: {e}"))
    }
}

impl std::fmt::Display for RemoteError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{:?}: {}", self.kind, self.message)
    }
}
