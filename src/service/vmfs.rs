//! File operations inside a sandbox's VM for the faces that browse it (the E2B face's
//! `filesystem` service and `/files`): stat, list, mkdir, move, remove, chown, whole-file read
//! and write, and the guest's users and groups (`/etc/passwd`, `/etc/group`) by name.
//!
//! Owns: mapping the agent's file errors onto service errors by kind (not found, exists,
//! denied, bad path), the size bounds of what is read from the guest, and the inbound secret
//! scan of what is written. Never touches the host's files: every path here is a guest path.
//! Each call is one or a few agent requests on the VM as it is now; no lock is held across
//! them (a VM replaced meanwhile fails the call).

use std::sync::Arc;

use super::workspace::agent_err;
use super::{Service, ServiceError};
use crate::api;
use crate::rpc::RpcError;
use crate::rpc::msg::FileKind;
use crate::rpc::msg::{DirEntry, ErrorKind, FileStat};
use crate::service::vms::LiveVm;

/// Largest `/etc/passwd` or `/etc/group` read from a guest.
const MAX_ACCOUNTS_FILE: u64 = 1024 * 1024;
/// Most accounts (users or groups) parsed from one of those files.
const MAX_ACCOUNTS: usize = 10_000;

/// A directory watch in a sandbox's VM ([`Service::vm_watch_dir`]). It holds the VM, so the
/// sandbox counts as in use (no idle pause) while watched, as during an exec; the VM going away
/// (stopped, paused, restored, crashed) ends it with `Unavailable`.
pub struct VmWatch {
    _vm: Arc<LiveVm>,
    watch: crate::rpc::DirWatch,
    path: String,
}

impl VmWatch {
    /// The next batch of changes, however long it takes; `Ok(None)` when the guest ended the
    /// watch. After an error the watch is over.
    pub async fn next(&mut self) -> Result<Option<crate::rpc::msg::WatchBatch>, ServiceError> {
        self.watch.next().await.map_err(|e| match e {
            RpcError::Remote(r) if r.kind == ErrorKind::NotFound => {
                ServiceError::NotFound(r.message)
            }
            RpcError::Remote(r) => {
                ServiceError::Unprocessable(format!("watch of {}: {}", self.path, r.message))
            }
            RpcError::Disconnected | RpcError::Closed(_) => ServiceError::Unavailable(format!(
                "the watch of {} ended: the sandbox's VM stopped, was paused or was restored \
                 ({e}); watch it again",
                self.path
            )),
            e => ServiceError::Unavailable(format!("the watch of {} ended: {e}", self.path)),
        })
    }
}

/// A guest user as `/etc/passwd` names it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GuestUser {
    pub name: String,
    pub uid: u32,
    pub gid: u32,
    pub home: String,
}

/// The guest's users and groups, read from its account files.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct GuestAccounts {
    pub users: Vec<GuestUser>,
    /// (name, gid)
    pub groups: Vec<(String, u32)>,
}

impl GuestAccounts {
    /// Parse `passwd` and `group` text (lines past [`MAX_ACCOUNTS`] and malformed lines are
    /// skipped).
    pub fn parse(passwd: &str, group: &str) -> GuestAccounts {
        let users = passwd
            .lines()
            .filter_map(|l| {
                let f: Vec<&str> = l.split(':').collect();
                if f.len() < 7 || f[0].is_empty() {
                    return None;
                }
                Some(GuestUser {
                    name: f[0].to_owned(),
                    uid: f[2].parse().ok()?,
                    gid: f[3].parse().ok()?,
                    home: f[5].to_owned(),
                })
            })
            .take(MAX_ACCOUNTS)
            .collect();
        let groups = group
            .lines()
            .filter_map(|l| {
                let f: Vec<&str> = l.split(':').collect();
                if f.len() < 3 || f[0].is_empty() {
                    return None;
                }
                Some((f[0].to_owned(), f[2].parse().ok()?))
            })
            .take(MAX_ACCOUNTS)
            .collect();
        GuestAccounts { users, groups }
    }

    pub fn user(&self, name: &str) -> Option<&GuestUser> {
        self.users.iter().find(|u| u.name == name)
    }

    /// The user name of `uid`, or the number when the guest has no such user.
    pub fn user_name(&self, uid: u32) -> String {
        self.users
            .iter()
            .find(|u| u.uid == uid)
            .map(|u| u.name.clone())
            .unwrap_or_else(|| uid.to_string())
    }

    /// The group name of `gid`, or the number.
    pub fn group_name(&self, gid: u32) -> String {
        self.groups
            .iter()
            .find(|g| g.1 == gid)
            .map(|g| g.0.clone())
            .unwrap_or_else(|| gid.to_string())
    }
}

/// An agent error of a file request, by kind.
pub fn fs_err(path: &str) -> impl Fn(RpcError) -> ServiceError + '_ {
    move |e| match e {
        RpcError::Remote(r) => match r.kind {
            ErrorKind::NotFound => {
                ServiceError::NotFound(format!("{path}: no such file or directory"))
            }
            ErrorKind::AlreadyExists => ServiceError::Conflict(format!("{path} already exists")),
            ErrorKind::PermissionDenied => {
                ServiceError::Forbidden(format!("{path}: permission denied"))
            }
            ErrorKind::InvalidRequest => ServiceError::BadRequest(r.message),
            _ => ServiceError::Unprocessable(format!("{path}: {}", r.message)),
        },
        e => ServiceError::Unavailable(format!("cannot reach the sandbox's agent: {e}")),
    }
}

fn check_path(path: &str) -> Result<(), ServiceError> {
    if !path.starts_with('/') || path.contains('\0') || path.len() > 4096 {
        return Err(ServiceError::BadRequest(format!(
            "`{path}` is not an absolute guest path (at most 4096 bytes, no NUL)"
        )));
    }
    Ok(())
}

impl Service {
    async fn fs_vm(&self, id: &str) -> Result<Arc<LiveVm>, ServiceError> {
        // Resume on use, then only the VM is held (see ARCHITECTURE "Lock order").
        let (_, _rec, vm) = self.ready_vm(id).await?;
        Ok(vm)
    }

    /// `lstat` of a guest path.
    pub async fn vm_stat(&self, id: &str, path: &str) -> Result<FileStat, ServiceError> {
        check_path(path)?;
        let vm = self.fs_vm(id).await?;
        vm.agent.stat(path).await.map_err(fs_err(path))
    }

    /// The entries of a guest directory, sorted by name.
    pub async fn vm_list(&self, id: &str, path: &str) -> Result<Vec<DirEntry>, ServiceError> {
        check_path(path)?;
        let vm = self.fs_vm(id).await?;
        vm.agent.list(path).await.map_err(fs_err(path))
    }

    /// `mkdir -p`, then give what was created to `owner` (uid, gid). `Conflict` when the path
    /// already exists (as a directory or not).
    pub async fn vm_mkdir(
        &self,
        id: &str,
        path: &str,
        owner: Option<(u32, u32)>,
    ) -> Result<(), ServiceError> {
        check_path(path)?;
        let vm = self.fs_vm(id).await?;
        if vm.agent.stat(path).await.is_ok() {
            return Err(ServiceError::Conflict(format!("{path} already exists")));
        }
        // The topmost missing ancestor: everything from it down is new and gets the owner.
        let mut first_new = path.to_owned();
        let mut p = std::path::Path::new(path);
        while let Some(parent) = p.parent() {
            let ps = parent.to_string_lossy();
            if ps == "/" || vm.agent.stat(&ps).await.is_ok() {
                break;
            }
            first_new = ps.into_owned();
            p = parent;
        }
        vm.agent.mkdir(path, 0o755).await.map_err(fs_err(path))?;
        if let Some((uid, gid)) = owner {
            let mut cur = std::path::PathBuf::from(path);
            loop {
                let s = cur.to_string_lossy().into_owned();
                vm.agent.chown(&s, uid, gid).await.map_err(fs_err(&s))?;
                if s == first_new || !cur.pop() {
                    break;
                }
            }
        }
        Ok(())
    }

    /// `rename(2)` inside the guest.
    pub async fn vm_rename(&self, id: &str, from: &str, to: &str) -> Result<(), ServiceError> {
        check_path(from)?;
        check_path(to)?;
        let vm = self.fs_vm(id).await?;
        vm.agent.rename(from, to).await.map_err(fs_err(from))
    }

    /// Watch directory `path` (with `recursive`, its tree) with inotify in the guest: returns
    /// once the watch is in place (`BadRequest` when `path` is not a directory).
    pub async fn vm_watch_dir(
        &self,
        id: &str,
        path: &str,
        recursive: bool,
    ) -> Result<VmWatch, ServiceError> {
        check_path(path)?;
        let vm = self.fs_vm(id).await?;
        let watch = vm
            .agent
            .watch_dir(path, recursive)
            .await
            .map_err(fs_err(path))?;
        Ok(VmWatch {
            _vm: vm,
            watch,
            path: path.to_owned(),
        })
    }

    /// Remove a file, a symlink or a whole directory tree.
    pub async fn vm_remove(&self, id: &str, path: &str) -> Result<(), ServiceError> {
        check_path(path)?;
        let vm = self.fs_vm(id).await?;
        vm.agent.remove(path, true).await.map_err(fs_err(path))
    }

    /// A whole regular file, at most `sync.max_file_mib`.
    pub async fn vm_read(&self, id: &str, path: &str) -> Result<Vec<u8>, ServiceError> {
        check_path(path)?;
        let vm = self.fs_vm(id).await?;
        let st = vm.agent.stat(path).await.map_err(fs_err(path))?;
        if st.kind == crate::rpc::msg::FileKind::Dir {
            return Err(ServiceError::BadRequest(format!("{path} is a directory")));
        }
        let max = self.max_file_bytes();
        if st.size > max {
            return Err(ServiceError::BadRequest(format!(
                "{path} is {} bytes, over the limit of {max} (sync.max_file_mib)",
                st.size
            )));
        }
        vm.agent.read_file(path, max).await.map_err(fs_err(path))
    }

    /// Write a whole file (parents created), owned by `owner` when given. Refused (403) when it
    /// holds a stored secret's value.
    pub async fn vm_write(
        &self,
        id: &str,
        path: &str,
        data: &[u8],
        owner: Option<(u32, u32)>,
    ) -> Result<(), ServiceError> {
        check_path(path)?;
        if data.len() as u64 > self.max_file_bytes() {
            return Err(ServiceError::BadRequest(format!(
                "{} bytes for {path} is over the limit of {} (sync.max_file_mib)",
                data.len(),
                self.max_file_bytes()
            )));
        }
        self.refuse_values(id, "file written through the API", data)?;
        let vm = self.fs_vm(id).await?;
        if let Some(parent) = std::path::Path::new(path).parent().and_then(|p| p.to_str())
            && vm.agent.stat(parent).await.is_err()
        {
            drop(vm);
            self.vm_mkdir(id, parent, owner)
                .await
                .or_else(|e| match e {
                    ServiceError::Conflict(_) => Ok(()),
                    e => Err(e),
                })?;
            return Box::pin(self.vm_write(id, path, data, owner)).await;
        }
        vm.agent
            .write_file(path, data, 0o644)
            .await
            .map_err(fs_err(path))?;
        if let Some((uid, gid)) = owner {
            vm.agent.chown(path, uid, gid).await.map_err(fs_err(path))?;
        }
        Ok(())
    }

    /// The guest's users and groups (its `/etc/passwd` and `/etc/group`, bounded).
    pub async fn vm_accounts(&self, id: &str) -> Result<GuestAccounts, ServiceError> {
        let vm = self.fs_vm(id).await?;
        let read = |p: &'static str| {
            let vm = vm.clone();
            async move {
                vm.agent
                    .read_file(p, MAX_ACCOUNTS_FILE)
                    .await
                    .map(|b| String::from_utf8_lossy(&b).into_owned())
                    .unwrap_or_default()
            }
        };
        Ok(GuestAccounts::parse(
            &read("/etc/passwd").await,
            &read("/etc/group").await,
        ))
    }
}

impl Service {
    /// `GET /v1/sandboxes/{id}/files?path=/abs`.
    pub async fn read_vm_file(
        &self,
        id: &str,
        path: &str,
    ) -> Result<api::FileContent, ServiceError> {
        check_guest_path(path)?;
        // A single agent call on this VM: no lock held (a VM replaced meanwhile fails it).
        let (_, _rec, vm) = self.ready_vm(id).await?;
        let st = vm.agent.stat(path).await.map_err(not_found_or(path))?;
        if st.kind != FileKind::File {
            return Err(ServiceError::BadRequest(format!(
                "{path} is not a regular file"
            )));
        }
        if st.size > self.max_file_bytes() {
            return Err(ServiceError::BadRequest(format!(
                "{path} is {} bytes, over the limit (sync.max_file_mib)",
                st.size
            )));
        }
        let data = vm
            .agent
            .read_file(path, self.max_file_bytes())
            .await
            .map_err(not_found_or(path))?;
        let (content, content_b64) = match String::from_utf8(data) {
            Ok(s) => (Some(s), None),
            Err(e) => (None, Some(api::b64::encode(e.as_bytes()))),
        };
        Ok(api::FileContent {
            path: path.to_owned(),
            content,
            content_b64,
            mode: Some(st.mode),
        })
    }

    /// `PUT /v1/sandboxes/{id}/files?path=/abs`: write a file inside the VM (never the host).
    pub async fn write_vm_file(
        &self,
        id: &str,
        path: &str,
        body: api::FileContent,
    ) -> Result<api::FileContent, ServiceError> {
        check_guest_path(path)?;
        if !body.path.is_empty() && body.path != path {
            return Err(ServiceError::BadRequest(format!(
                "the body names `{}` but the URL names `{path}`",
                body.path
            )));
        }
        let data = match (&body.content, &body.content_b64) {
            (Some(_), Some(_)) => {
                return Err(ServiceError::BadRequest(
                    "give `content` or `content_b64`, not both".into(),
                ));
            }
            (Some(s), None) => s.as_bytes().to_vec(),
            (None, Some(b)) => api::b64::decode(b).map_err(ServiceError::BadRequest)?,
            (None, None) => Vec::new(),
        };
        self.refuse_values(id, "file written through the API", &data)?;
        let mode = body.mode.unwrap_or(0o644);
        if mode > 0o7777 {
            return Err(ServiceError::BadRequest(format!(
                "mode {mode:o} is not a permission mode"
            )));
        }
        // A single agent call on this VM: no lock held (a VM replaced meanwhile fails it).
        let (_, _rec, vm) = self.ready_vm(id).await?;
        if let Some(parent) = std::path::Path::new(path).parent().and_then(|p| p.to_str()) {
            vm.agent.mkdir(parent, 0o755).await.map_err(agent_err)?;
        }
        vm.agent
            .write_file(path, &data, mode)
            .await
            .map_err(agent_err)?;
        Ok(api::FileContent {
            path: path.to_owned(),
            content: None,
            content_b64: None,
            mode: Some(mode),
        })
    }
}

fn check_guest_path(path: &str) -> Result<(), ServiceError> {
    if !path.starts_with('/') || path.contains('\0') {
        return Err(ServiceError::BadRequest(format!(
            "`path` must be an absolute path inside the VM, got `{path}`"
        )));
    }
    Ok(())
}

fn not_found_or(path: &str) -> impl Fn(RpcError) -> ServiceError + '_ {
    move |e| match e {
        RpcError::Remote(r) if r.kind == crate::rpc::msg::ErrorKind::NotFound => {
            ServiceError::NotFound(format!("no file {path} in the sandbox"))
        }
        e => agent_err(e),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn accounts_parse_users_and_groups_and_skip_broken_lines() {
        let a = GuestAccounts::parse(
            "root:x:0:0:root:/root:/bin/bash\nbroken\nuser:x:1000:1000::/home/user:/bin/bash\nx:x:NaN:1::/:/bin/sh\n",
            "root:x:0:\nuser:x:1000:\nsudo:x:27:user\n",
        );
        assert_eq!(a.users.len(), 2);
        let u = a.user("user").expect("user");
        assert_eq!((u.uid, u.gid, u.home.as_str()), (1000, 1000, "/home/user"));
        assert_eq!(a.user_name(1000), "user");
        assert_eq!(a.user_name(4242), "4242");
        assert_eq!(a.group_name(27), "sudo");
        assert_eq!(a.group_name(5), "5");
        assert!(a.user("nobody").is_none());
    }

    #[test]
    fn guest_paths_must_be_absolute_and_bounded() {
        assert!(check_path("/a/b").is_ok());
        assert!(check_path("a").is_err());
        assert!(check_path("/a\0").is_err());
        assert!(check_path(&format!("/{}", "a".repeat(5000))).is_err());
    }

    #[test]
    fn agent_errors_keep_their_kind() {
        use crate::rpc::msg::RemoteError;
        let e = fs_err("/x")(RpcError::Remote(RemoteError::new(
            ErrorKind::NotFound,
            "no",
        )));
        assert!(matches!(e, ServiceError::NotFound(_)));
        let e = fs_err("/x")(RpcError::Remote(RemoteError::new(
            ErrorKind::AlreadyExists,
            "",
        )));
        assert!(matches!(e, ServiceError::Conflict(_)));
        let e = fs_err("/x")(RpcError::Disconnected);
        assert!(matches!(e, ServiceError::Unavailable(_)));
    }
}
