//! envd's `filesystem.Filesystem` service (Connect unary, JSON): Stat, ListDir, MakeDir,
//! Move, Remove, on the sandbox's VM through the service (`service::vmfs`).
//!
//! Owns: E2B's path rules (relative paths start in the user's home), `EntryInfo` building
//! (owner and group names from the guest's account files), ListDir's depth walk (bounded), and
//! the mapping of errors onto Connect codes, and the watch methods (WatchDir as a stream;
//! CreateWatcher, GetWatcherEvents, RemoveWatcher) on the guest's inotify watches, kept by
//! `watch.rs`.

use std::collections::VecDeque;

use hyper::body::Incoming;
use hyper::{Request, Response, StatusCode};
use serde_json::{Value, json};

use super::connect::{Code, ConnectError, decode};
use super::entry::Entry;
use super::proto::{MoveRequest, PathRequest};
use super::{Face, guest_path, read_body};
use crate::daemon::response::Body;
use crate::rpc::msg::{FileKind, FileStat};
use crate::service::e2b::E2bSandbox;
use crate::service::vmfs::GuestAccounts;

/// Deepest ListDir walk.
const MAX_DEPTH: u32 = 16;
/// Most entries one ListDir returns.
const MAX_ENTRIES: usize = 20_000;

pub async fn handle(
    req: Request<Incoming>,
    face: &Face,
    rec: &E2bSandbox,
    method: &str,
) -> Response<Body> {
    if method == "WatchDir" {
        return match watch_dir(req, face, rec).await {
            Ok(r) => r,
            Err(e) => super::connect_stream_error(&e),
        };
    }
    match unary(req, face, rec, method).await {
        Ok(v) => super::json(StatusCode::OK, &v),
        Err(e) => super::connect_unary_error(&e),
    }
}

/// The user's accounts view and home directory.
async fn who(
    face: &Face,
    rec: &E2bSandbox,
    user: &str,
) -> Result<(GuestAccounts, String), ConnectError> {
    let acc = face.svc.vm_accounts(&rec.sandbox_id).await?;
    let home = match acc.user(user) {
        Some(u) => u.home.clone(),
        None => {
            return Err(ConnectError::new(
                Code::InvalidArgument,
                format!("the sandbox has no user `{user}`"),
            ));
        }
    };
    Ok((acc, home))
}

fn entry(acc: &GuestAccounts, path: &str, st: &FileStat) -> Value {
    let name = path.rsplit('/').next().unwrap_or(path);
    Entry {
        name,
        path,
        stat: st,
        owner: acc.user_name(st.uid),
        group: acc.group_name(st.gid),
    }
    .to_json()
}

#[derive(Debug, Default, serde::Deserialize)]
#[serde(default, rename_all = "camelCase")]
struct WatchRequest {
    path: String,
    #[serde(alias = "recursive")]
    recursive: Option<bool>,
}

#[derive(Debug, Default, serde::Deserialize)]
#[serde(default, rename_all = "camelCase")]
struct WatcherRequest {
    #[serde(alias = "watcher_id")]
    watcher_id: String,
}

/// A watch of `p` in the guest, in place when this returns (`InvalidArgument` when `p` is not a
/// directory).
async fn start_watch(
    face: &Face,
    id: &str,
    p: &str,
    recursive: bool,
) -> Result<crate::service::vmfs::VmWatch, ConnectError> {
    face.watchers.check_room(id)?;
    Ok(face.svc.vm_watch_dir(id, p, recursive).await?)
}

/// `WatchDir`: `{"start":{}}` once the guest's watch is in place, then
/// `{"filesystem":{"name","type"}}` for each change as the guest reports it (`watch.rs`),
/// keepalives when asked; the watch ends with the stream (or with an error envelope when the
/// VM or the directory went away).
async fn watch_dir(
    req: Request<Incoming>,
    face: &Face,
    rec: &E2bSandbox,
) -> Result<Response<Body>, ConnectError> {
    let user = super::request_user(req.headers())?;
    let keepalive = req
        .headers()
        .get("keepalive-ping-interval")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.trim().parse::<u64>().ok())
        .filter(|s| *s > 0)
        .map(|s| std::time::Duration::from_secs(s.min(300)));
    let body = read_body(req.into_body(), super::connect::MAX_MESSAGE + 5)
        .await
        .map_err(|e| ConnectError::new(Code::ResourceExhausted, e.message))?;
    let mut d = super::connect::Decoder::default();
    d.push(&body);
    let msg = match d.next()? {
        Some(super::connect::Frame::Message(m)) => m,
        _ => {
            return Err(ConnectError::new(
                Code::InvalidArgument,
                "a streaming request must hold one whole message envelope",
            ));
        }
    };
    let r: WatchRequest = decode(&msg)?;
    let id = rec.sandbox_id.clone();
    let (_, home) = who(face, rec, &user).await?;
    let p = guest_path(&r.path, &home)?;
    let recursive = r.recursive.unwrap_or(false);
    let mut watch = start_watch(face, &id, &p, recursive).await?;
    let slot = face.watchers.stream_slot(&id)?;
    let (tx, rx) = tokio::sync::mpsc::channel::<bytes::Bytes>(16);
    tokio::spawn(async move {
        use super::connect::{end, message};
        let _slot = slot;
        let _ = tx.send(message(&json!({ "start": {} }))).await;
        let mut ping =
            tokio::time::interval(keepalive.unwrap_or(std::time::Duration::from_secs(3600)));
        ping.reset();
        let end_err = loop {
            tokio::select! {
                // The client went away: dropping `watch` cancels the guest's watch.
                _ = tx.closed() => return,
                _ = ping.tick(), if keepalive.is_some() => {
                    if tx.send(message(&json!({ "keepalive": {} }))).await.is_err() {
                        return;
                    }
                }
                r = watch.next() => match r {
                    // A slow client holds the guest back: the next batch is not read (nor
                    // its credit given back) until these are sent.
                    Ok(Some(batch)) => {
                        for ev in &batch.events {
                            let m = message(&json!({ "filesystem": super::watch::event_json(ev) }));
                            if tx.send(m).await.is_err() {
                                return;
                            }
                        }
                    }
                    Ok(None) => break Some(ConnectError::new(Code::Unavailable, "the watch ended")),
                    Err(e) => break Some(ConnectError::from(e)),
                },
            }
        };
        let _ = tx.send(end(end_err.as_ref())).await;
    });
    Ok(super::connect_stream(rx))
}

async fn unary(
    req: Request<Incoming>,
    face: &Face,
    rec: &E2bSandbox,
    method: &str,
) -> Result<Value, ConnectError> {
    let user = super::request_user(req.headers())?;
    let body = read_body(req.into_body(), super::MAX_JSON_BODY)
        .await
        .map_err(|e| ConnectError::new(Code::ResourceExhausted, e.message))?;
    let id = rec.sandbox_id.as_str();
    let svc = &face.svc;
    match method {
        "Stat" => {
            let r: PathRequest = decode(&body)?;
            let (acc, home) = who(face, rec, &user).await?;
            let p = guest_path(&r.path, &home)?;
            let st = svc.vm_stat(id, &p).await?;
            Ok(json!({ "entry": entry(&acc, &p, &st) }))
        }
        "ListDir" => {
            let r: PathRequest = decode(&body)?;
            let (acc, home) = who(face, rec, &user).await?;
            let p = guest_path(&r.path, &home)?;
            let depth = r.depth.unwrap_or(1).clamp(1, MAX_DEPTH);
            let st = svc.vm_stat(id, &p).await?;
            if st.kind != FileKind::Dir {
                return Err(ConnectError::new(
                    Code::InvalidArgument,
                    format!("{p} is not a directory"),
                ));
            }
            let mut out = Vec::new();
            let mut todo = VecDeque::from([(p, 1u32)]);
            while let Some((dir, level)) = todo.pop_front() {
                for e in svc.vm_list(id, &dir).await? {
                    let path = format!("{}/{}", dir.trim_end_matches('/'), e.name);
                    if e.stat.kind == FileKind::Dir && level < depth {
                        todo.push_back((path.clone(), level + 1));
                    }
                    out.push(entry(&acc, &path, &e.stat));
                    if out.len() > MAX_ENTRIES {
                        return Err(ConnectError::new(
                            Code::ResourceExhausted,
                            format!("more than {MAX_ENTRIES} entries: list a smaller depth"),
                        ));
                    }
                }
            }
            Ok(json!({ "entries": out }))
        }
        "MakeDir" => {
            let r: PathRequest = decode(&body)?;
            let (acc, home) = who(face, rec, &user).await?;
            let p = guest_path(&r.path, &home)?;
            let owner = acc.user(&user).map(|u| (u.uid, u.gid));
            svc.vm_mkdir(id, &p, owner).await?;
            let st = svc.vm_stat(id, &p).await?;
            Ok(json!({ "entry": entry(&acc, &p, &st) }))
        }
        "Move" => {
            let r: MoveRequest = decode(&body)?;
            let (acc, home) = who(face, rec, &user).await?;
            let (from, to) = (
                guest_path(&r.source, &home)?,
                guest_path(&r.destination, &home)?,
            );
            svc.vm_rename(id, &from, &to).await?;
            let st = svc.vm_stat(id, &to).await?;
            Ok(json!({ "entry": entry(&acc, &to, &st) }))
        }
        "Remove" => {
            let r: PathRequest = decode(&body)?;
            let (_, home) = who(face, rec, &user).await?;
            let p = guest_path(&r.path, &home)?;
            if p == "/" {
                return Err(ConnectError::new(
                    Code::InvalidArgument,
                    "refusing to remove /",
                ));
            }
            svc.vm_remove(id, &p).await?;
            Ok(json!({}))
        }
        "CreateWatcher" => {
            let r: WatchRequest = decode(&body)?;
            let (_, home) = who(face, rec, &user).await?;
            let p = guest_path(&r.path, &home)?;
            let watch = start_watch(face, id, &p, r.recursive.unwrap_or(false)).await?;
            let wid = face.watchers.create(id, watch)?;
            Ok(json!({ "watcherId": wid }))
        }
        "GetWatcherEvents" => {
            let r: WatcherRequest = decode(&body)?;
            Ok(json!({ "events": face.watchers.take(id, &r.watcher_id)? }))
        }
        "RemoveWatcher" => {
            let r: WatcherRequest = decode(&body)?;
            face.watchers.remove(id, &r.watcher_id)?;
            Ok(json!({}))
        }
        other => Err(ConnectError::new(
            Code::Unimplemented,
            format!("no method filesystem.Filesystem/{other}"),
        )),
    }
}
