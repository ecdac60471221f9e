//! envd's `filesystem.Filesystem` service (Connect unary, JSON): Stat, ListDir, MakeDir,
//! Move, Remove, on the sandbox's VM through the service (`service::vmfs`).
//!
//! Owns: E2B's path rules (relative paths start in the user's home), `EntryInfo` building
//! (owner and group names from the guest's account files), ListDir's depth walk (bounded), and
//! the mapping of errors onto Connect codes. The watch methods (WatchDir, CreateWatcher,
//! GetWatcherEvents, RemoveWatcher) answer `unimplemented` with a clear message.

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
    match unary(req, face, rec, method).await {
        Ok(v) => super::json(StatusCode::OK, &v),
        Err(e) => super::json(
            StatusCode::from_u16(e.code.http_status()).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR),
            &e.json(),
        ),
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
        "WatchDir" | "CreateWatcher" | "GetWatcherEvents" | "RemoveWatcher" => {
            Err(ConnectError::new(
                Code::Unimplemented,
                "watching directories is not supported by tryboxi's E2B face yet",
            ))
        }
        other => Err(ConnectError::new(
            Code::Unimplemented,
            format!("no method filesystem.Filesystem/{other}"),
        )),
    }
}
