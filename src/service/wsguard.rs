//! Which host folders may never be a sandbox's workspace, whoever asks (HTTP API, so the CLI
//! and MCP too): a workspace is synced into a VM that may have network, and apply writes into
//! it.
//!
//! Refused: the file system root `/`; the calling user's home folder itself (and the daemon
//! user's), since it holds shell history, browser profiles, keys and dotfiles a later apply
//! could replace (a project folder inside it is fine); the daemon's data root, anything inside
//! it and any folder containing it (syncing it would copy every sandbox's data, disks and the
//! API token, and build an archive of the whole tree). Paths are compared after symlinks are
//! resolved. Pure apart from reading the password database.

use std::path::{Path, PathBuf};

/// Home folders that may not be a workspace for a request from `caller_uid` (the unix-socket
/// peer or loopback TCP client's uid; `None`: a remote TLS client with the token): that user's, the daemon user's and the
/// daemon's `$HOME`, symlinks resolved.
pub fn forbidden_homes(caller_uid: Option<u32>) -> Vec<PathBuf> {
    let own = nix::unistd::geteuid();
    let uids = [caller_uid.map(nix::unistd::Uid::from_raw), Some(own)];
    let mut homes: Vec<PathBuf> = uids
        .into_iter()
        .flatten()
        .filter_map(|u| nix::unistd::User::from_uid(u).ok().flatten())
        .map(|u| u.dir)
        .collect();
    if let Some(h) = std::env::var_os("HOME").filter(|h| !h.is_empty()) {
        homes.push(PathBuf::from(h));
    }
    let mut out: Vec<PathBuf> = homes
        .into_iter()
        .filter(|h| h.is_absolute())
        .map(|h| h.canonicalize().unwrap_or(h))
        .collect();
    out.sort();
    out.dedup();
    out
}

/// Why `ws` (absolute, symlinks resolved) may not be a workspace, if it may not.
pub fn refusal(ws: &Path, data_root: &Path, homes: &[PathBuf]) -> Option<String> {
    let root = data_root
        .canonicalize()
        .unwrap_or_else(|_| data_root.to_path_buf());
    let shown = ws.display();
    if ws.parent().is_none() {
        return Some(format!(
            "workspace `{shown}` is the file system root; use a project folder"
        ));
    }
    if homes.iter().any(|h| h == ws) {
        return Some(format!(
            "workspace `{shown}` is a home folder (shell history, keys, dotfiles); use a \
             project folder inside it"
        ));
    }
    if root.starts_with(ws) {
        return Some(format!(
            "workspace `{shown}` holds tryboxi's data root {}; use a project folder outside it",
            root.display()
        ));
    }
    if ws.starts_with(&root) {
        return Some(format!(
            "workspace `{shown}` is inside tryboxi's data root {}; use a project folder \
             outside it",
            root.display()
        ));
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn root_homes_and_the_data_root_are_refused_project_folders_are_not() {
        let d = tempfile::tempdir().unwrap();
        let base = d.path().canonicalize().unwrap();
        let home = base.join("home/alice");
        let data = home.join(".local/share/tryboxi");
        let project = home.join("src/app");
        for p in [&data, &project] {
            std::fs::create_dir_all(p.join("sandboxes")).unwrap();
        }
        let homes = vec![home.clone()];
        for (ws, what) in [
            (PathBuf::from("/"), "file system root"),
            (home.clone(), "home folder"),
            (data.clone(), "holds tryboxi's data root"),
            (home.join(".local"), "holds tryboxi's data root"),
            (base.join("home"), "holds tryboxi's data root"),
            (data.join("sandboxes"), "inside tryboxi's data root"),
        ] {
            let why = refusal(&ws, &data, &homes).unwrap_or_default();
            assert!(why.contains(what), "{}: {why:?}", ws.display());
        }
        assert_eq!(refusal(&project, &data, &homes), None);
        assert_eq!(refusal(&home.join("src"), &data, &homes), None);
        // A symlinked data root is compared resolved.
        let link = base.join("data-link");
        std::os::unix::fs::symlink(&data, &link).unwrap();
        assert!(refusal(&data, &link, &homes).is_some());
        assert!(refusal(&home.join(".local/share"), &link, &homes).is_some());
    }

    #[test]
    fn the_callers_and_the_daemons_homes_are_found() {
        let homes = forbidden_homes(Some(0));
        let root_home = nix::unistd::User::from_uid(nix::unistd::Uid::from_raw(0))
            .unwrap()
            .unwrap()
            .dir;
        let root_home = root_home.canonicalize().unwrap_or(root_home);
        assert!(homes.contains(&root_home), "{homes:?}");
    }
}
