//! The workspace walk's fallback against a hostile agent, through the diff use case: a test
//! double of the guest side of the RPC (`rpc::hostile`, no VM) answers `WalkSince` as scripted.
//!
//! Entries it sends unstated (`WalkEntry.base`: still the base disk's) take their stat from the
//! sync base's manifest (`workspace::diff::fill_base`). One the manifest has no record of, or a
//! record of another kind, or a directory's, has the host forget its walk mirror and ask again
//! with `stat_all`; an agent that still sends one fails the call with a clear
//! `ServiceError::Internal` after exactly two walks: no loop, no crash, no hang.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::net::UnixStream;

use super::vms::LiveVm;
use super::{SandboxRecord, Service, ServiceError};
use crate::api::{self, ChangeKind, SandboxState};
use crate::config::Config;
use crate::rpc::frame::encode_answer;
use crate::rpc::hostile::{fake_guest, next_request, send};
use crate::rpc::msg::{
    Body, ErrorKind, FileKind, RemoteError, Reply, Request, WalkCursor, WalkDelta, WalkEntry,
};
use crate::vmm::{Accel, VmInfo};
use crate::workspace::GUEST_ROOT;
use crate::workspace::manifest::{Base, Entry, Kind, Manifest};

/// Longest a diff may take: past it the host looped or hung on the agent.
const T: Duration = Duration::from_secs(20);

/// `WalkSince` requests the guest answers; it is silent to the ones after (a host that loops
/// waits there and shows as a timeout, not as a spin).
const MAX_WALKS: usize = 8;

/// Guest mtime (seconds) of every file in these tests.
const MTIME: i64 = 1_700_000_000;

/// What each `WalkSince` the guest got asked for: `(since, stat_all)`, in order.
type Asked = Arc<Mutex<Vec<(Option<WalkCursor>, bool)>>>;

fn cursor(generation: u64) -> WalkCursor {
    WalkCursor {
        epoch: 7,
        generation,
    }
}

/// An entry as the agent states it.
fn stated(path: &str, kind: FileKind, size: u64, mode: u32, link: Option<&str>) -> WalkEntry {
    WalkEntry {
        path: path.into(),
        kind,
        size,
        mode,
        mtime: MTIME,
        mtime_nsec: 0,
        link: link.map(Into::into),
        base: false,
    }
}

/// An entry the agent did not state: the host is to take its stat from the base.
fn unstated(path: &str, kind: FileKind) -> WalkEntry {
    WalkEntry::unstated(path.into(), kind)
}

/// The base's tree, stated as it is: nothing changed in the VM.
fn tree() -> Vec<WalkEntry> {
    vec![
        stated("a.txt", FileKind::File, 6, 0o644, None),
        stated("dir", FileKind::Dir, 4096, 0o755, None),
        stated("link", FileKind::Symlink, 5, 0o777, Some("a.txt")),
    ]
}

/// `tree()` with `e` in place of the entry of the same path.
fn tree_with(e: WalkEntry) -> Vec<WalkEntry> {
    let mut t = tree();
    t.retain(|w| w.path != e.path);
    t.push(e);
    t
}

/// A whole-tree answer.
fn full(generation: u64, entries: Vec<WalkEntry>) -> WalkDelta {
    WalkDelta {
        cursor: cursor(generation),
        full: true,
        entries,
        removed: Vec::new(),
    }
}

/// An answer with only what changed since the last cursor.
fn delta(generation: u64, entries: Vec<WalkEntry>) -> WalkDelta {
    WalkDelta {
        full: false,
        ..full(generation, entries)
    }
}

/// The sync base: `a.txt` (`hello\n`, 0644), the symlink `link` -> `a.txt`, the directory `dir`.
fn base_manifest(base: &Base) -> Manifest {
    let sha = base.put_blob(b"hello\n").unwrap();
    let ns = MTIME * 1_000_000_000;
    let mut m = Manifest::default();
    m.entries
        .insert("a.txt".into(), Entry::file(0o644, 6, ns, sha));
    m.entries.insert(
        "link".into(),
        Entry {
            kind: Kind::Symlink,
            mode: 0o777,
            size: 5,
            mtime_ns: ns,
            sha256: String::new(),
            link: Some("a.txt".into()),
            guest_size: 5,
            guest_mtime: MTIME,
            guest_nsec: 0,
        },
    );
    m.entries.insert(
        "dir".into(),
        Entry {
            kind: Kind::Dir,
            mode: 0o755,
            size: 0,
            mtime_ns: ns,
            sha256: String::new(),
            link: None,
            guest_size: 0,
            guest_mtime: MTIME,
            guest_nsec: 0,
        },
    );
    m
}

/// Plays the agent on `g`: the n-th `WalkSince` (from 0) gets `script[n]` (its last answer again
/// past its end), a `ReadFile` of `/workspace/<path>` the content `files` has for `path`, a
/// `Ping` a `Pong`. Every `WalkSince` goes into `asked`.
async fn play(
    mut g: UnixStream,
    script: Vec<WalkDelta>,
    files: HashMap<String, Vec<u8>>,
    asked: Asked,
) {
    let root = format!("{GUEST_ROOT}/");
    while let Some((stream, req)) = next_request(&mut g).await {
        match req {
            Request::WalkSince {
                since, stat_all, ..
            } => {
                let n = {
                    let mut a = asked.lock().unwrap();
                    a.push((since, stat_all));
                    a.len()
                };
                if n > MAX_WALKS {
                    continue;
                }
                let answer = &script[(n - 1).min(script.len() - 1)];
                let bytes = encode_answer(answer).unwrap();
                send(&mut g, stream, Body::Data(bytes)).await;
                send(&mut g, stream, Body::DataEnd).await;
            }
            Request::ReadFile { path } => {
                match path.strip_prefix(&root).and_then(|p| files.get(p)) {
                    Some(c) => {
                        send(&mut g, stream, Body::Data(c.clone())).await;
                        send(&mut g, stream, Body::DataEnd).await;
                    }
                    None => {
                        let e = RemoteError::new(ErrorKind::NotFound, path);
                        send(&mut g, stream, Body::Error(e)).await;
                    }
                }
            }
            Request::Ping => send(&mut g, stream, Body::Reply(Reply::Pong)).await,
            other => {
                let e = RemoteError::new(ErrorKind::InvalidRequest, format!("{other:?}"));
                send(&mut g, stream, Body::Error(e)).await;
            }
        }
    }
}

/// A ready sandbox with the sync base of [`base_manifest`], its workspace an empty temporary
/// directory, its VM's agent the hostile guest playing `script` (files: `a.txt` = `hello\n`,
/// `ghost.txt` = `boo\n`).
struct Sandbox {
    svc: Arc<Service>,
    id: String,
    asked: Asked,
    _dir: tempfile::TempDir,
}

impl Sandbox {
    async fn new(script: Vec<WalkDelta>) -> Sandbox {
        let dir = tempfile::tempdir().unwrap();
        // No VMM: nothing here may start or ask a QEMU.
        let config = Config {
            qemu_binary: dir.path().join("no-qemu").display().to_string(),
            ..Config::default()
        };
        let svc = super::test_service(dir.path(), config);
        let id = crate::ids::new_id(crate::ids::SANDBOX);
        let host = dir.path().join("host");
        std::fs::create_dir(&host).unwrap();
        let rec = SandboxRecord {
            api: api::Sandbox {
                id: id.clone(),
                state: SandboxState::Ready,
                workspace: Some(api::WorkspaceSpec {
                    host_path: host.display().to_string(),
                    exclude: Vec::new(),
                }),
                template: "auto".into(),
                vcpus: 1,
                memory_mib: 256,
                accel: None,
                created_at: super::now_rfc3339(),
                error: None,
                ports: Vec::new(),
            },
            dir: dir.path().join("sandboxes").join(&id),
        };
        svc.store.put(crate::store::SANDBOXES, &id, &rec).unwrap();
        let base = Base::new(rec.dir.join("workspace"));
        base.save(&base_manifest(&base)).unwrap();
        let (agent, g) = fake_guest().await;
        let asked = Asked::default();
        let files = HashMap::from([
            ("a.txt".to_owned(), b"hello\n".to_vec()),
            ("ghost.txt".to_owned(), b"boo\n".to_vec()),
        ]);
        tokio::spawn(play(g, script, files, asked.clone()));
        let vm = LiveVm {
            info: VmInfo {
                id: id.clone(),
                dir: rec.dir.clone(),
                pid: 0,
                accel: Accel::Tcg,
                agent_socket: rec.dir.join("agent.sock"),
                qmp_socket: rec.dir.join("qmp.sock"),
                console_log: rec.dir.join("console.log"),
            },
            agent,
        };
        svc.vms.insert(&id, Arc::new(vm));
        Sandbox {
            svc,
            id,
            asked,
            _dir: dir,
        }
    }

    /// `GET /diff?stat=true`, bounded by [`T`].
    async fn diff(&self) -> Result<api::DiffReport, ServiceError> {
        match tokio::time::timeout(T, self.svc.diff(&self.id, true, Vec::new())).await {
            Ok(r) => r,
            Err(_) => panic!("the diff hung; the guest was asked {:?}", self.asked()),
        }
    }

    fn asked(&self) -> Vec<(Option<WalkCursor>, bool)> {
        self.asked.lock().unwrap().clone()
    }
}

/// `(path, kind, old_mode, new_mode, additions)` of one file of a diff.
type Seen<'a> = (&'a str, ChangeKind, Option<u32>, Option<u32>, u64);

/// [`Seen`] of each file of a diff.
fn summary(r: &api::DiffReport) -> Vec<Seen<'_>> {
    r.files
        .iter()
        .map(|f| (f.path.as_str(), f.kind, f.old_mode, f.new_mode, f.additions))
        .collect()
}

/// The control: unstated entries the base has a record of (same kind, not a directory) take
/// their stat from it, in one walk that does not state everything.
#[tokio::test]
async fn unstated_files_the_base_knows_take_its_stat_in_one_walk() {
    let first = vec![
        unstated("a.txt", FileKind::File),
        stated("dir", FileKind::Dir, 4096, 0o755, None),
        unstated("link", FileKind::Symlink),
    ];
    let sb = Sandbox::new(vec![full(1, first)]).await;
    let r = sb.diff().await.unwrap();
    assert!(r.files.is_empty(), "{r:?}");
    assert_eq!(sb.asked(), vec![(None, false)]);
}

/// An unstated file the base has no record of: the host asks again stating everything, and the
/// diff is the one of the stated answer; the mirror it keeps is that answer's.
#[tokio::test]
async fn an_unstated_file_without_a_record_has_the_host_walk_again_stating_everything() {
    let mut stated_all = tree_with(stated("a.txt", FileKind::File, 6, 0o755, None));
    stated_all.push(stated("ghost.txt", FileKind::File, 4, 0o644, None));
    let sb = Sandbox::new(vec![
        full(1, tree_with(unstated("ghost.txt", FileKind::File))),
        full(2, stated_all),
        // The next diff: nothing changed since.
        delta(3, Vec::new()),
    ])
    .await;
    let want = vec![
        (
            "a.txt",
            ChangeKind::ModeChanged,
            Some(0o644),
            Some(0o755),
            0,
        ),
        ("ghost.txt", ChangeKind::Added, None, Some(0o644), 1),
    ];
    let r = sb.diff().await.unwrap();
    assert_eq!(summary(&r), want, "{r:?}");
    assert_eq!(sb.asked(), vec![(None, false), (None, true)]);
    // The mirror holds the stated walk: the next diff asks only for what changed since it.
    let r = sb.diff().await.unwrap();
    assert_eq!(summary(&r), want, "{r:?}");
    assert_eq!(
        sb.asked(),
        vec![(None, false), (None, true), (Some(cursor(2)), false)]
    );
}

/// An agent that sends unstated entries even when asked to state everything: a clear error
/// after exactly two walks.
#[tokio::test]
async fn an_agent_that_never_states_a_file_fails_the_diff_after_two_walks() {
    let sb = Sandbox::new(vec![full(
        1,
        tree_with(unstated("ghost.txt", FileKind::File)),
    )])
    .await;
    let e = sb.diff().await.unwrap_err();
    assert!(
        matches!(&e, ServiceError::Internal(m)
            if m.contains("`ghost.txt` unstated in a walk that states everything")),
        "{e:?}"
    );
    assert_eq!(sb.asked(), vec![(None, false), (None, true)]);
    // Nothing of the refused answers was kept: the next diff starts over, and fails the same.
    let e = sb.diff().await.unwrap_err();
    assert!(matches!(&e, ServiceError::Internal(_)), "{e:?}");
    assert_eq!(
        sb.asked(),
        vec![(None, false), (None, true), (None, false), (None, true)]
    );
}

/// An unstated entry whose record is of another kind, or a directory's, is no better than one
/// without a record: the host asks again stating everything.
#[tokio::test]
async fn an_unstated_entry_of_another_kind_or_a_directory_has_the_host_state_everything() {
    for (what, bad) in [
        ("a symlink sent as a file", unstated("link", FileKind::File)),
        (
            "a file sent as a symlink",
            unstated("a.txt", FileKind::Symlink),
        ),
        (
            "a file sent as a special file",
            unstated("a.txt", FileKind::Other),
        ),
        ("a directory", unstated("dir", FileKind::Dir)),
    ] {
        let sb = Sandbox::new(vec![full(1, tree_with(bad)), full(2, tree())]).await;
        let r = sb.diff().await.unwrap_or_else(|e| panic!("{what}: {e:?}"));
        assert!(r.files.is_empty(), "{what}: {r:?}");
        assert_eq!(sb.asked(), vec![(None, false), (None, true)], "{what}");
    }
}

/// The fallback drops the walk mirror: the stated walk starts from nothing (no `since`), not
/// from the cursor of the answer before the one that was refused.
#[tokio::test]
async fn the_fallback_forgets_the_walk_mirror() {
    let mut stated_all = tree();
    stated_all.push(stated("ghost.txt", FileKind::File, 4, 0o644, None));
    let sb = Sandbox::new(vec![
        full(1, tree()),
        delta(2, vec![unstated("ghost.txt", FileKind::File)]),
        full(3, stated_all),
    ])
    .await;
    let r = sb.diff().await.unwrap();
    assert!(r.files.is_empty(), "{r:?}");
    let r = sb.diff().await.unwrap();
    assert_eq!(
        summary(&r),
        vec![("ghost.txt", ChangeKind::Added, None, Some(0o644), 1)],
        "{r:?}"
    );
    assert_eq!(
        sb.asked(),
        vec![(None, false), (Some(cursor(1)), false), (None, true)]
    );
}
