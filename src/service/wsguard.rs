//! Which host folders may never be a sandbox's workspace, whoever asks (HTTP API, so the CLI
//! and MCP too): a workspace is synced into a VM that may have network, and apply writes into
//! it.
//!
//! Refused: the file system root `/`; any folder that is or contains a home folder of any
//! user of the host (`/etc/passwd`, plus the calling user's,
//! the daemon user's and `$HOME`), since it holds shell history, browser profiles, keys and
//! dotfiles a later apply could replace, and syncing `/home` copies every home (a project
//! folder inside a home is fine); any folder inside a home's dot-directory (`~/.ssh`,
//! `~/.config`, `~/.local/bin`, `~/.gnupg`, any `~/.*`), where an apply could plant
//! `authorized_keys` or an executable on `PATH`; the daemon's data root, anything inside it
//! and any folder containing it (syncing it would copy every sandbox's data, disks and the
//! API token, and build an archive of the whole tree). Paths are compared after symlinks are
//! resolved. [`forbidden_homes`] reads the password file (and may run `getent`, which may ask
//! LDAP; see `accounts`) and resolves symlinks: call it off the async runtime.

use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};

/// Home folders no workspace may be or contain, nor reach into through a dot-directory: every
/// user's from the password file, plus (for a request from `caller_uid`: the unix-socket
/// peer or loopback TCP client's uid; `None`: a remote TLS client with the token) that user's, the daemon user's and the
/// daemon's `$HOME`, symlinks resolved. Homes that do not exist are left out. Blocking.
pub fn forbidden_homes(caller_uid: Option<u32>) -> Vec<PathBuf> {
    // Every user's home from the password file (read as a file: see `accounts`); the caller's
    // and the daemon's own through `accounts::by_uid`, which also asks a directory service.
    let own = nix::unistd::geteuid().as_raw();
    let file = crate::accounts::all();
    let mut homes: Vec<PathBuf> = [caller_uid, Some(own)]
        .into_iter()
        .flatten()
        .filter_map(|u| crate::accounts::find_uid(&file, u))
        .map(|a| a.home)
        .collect();
    homes.extend(file.into_iter().map(|a| a.home));
    if let Some(h) = std::env::var_os("HOME").filter(|h| !h.is_empty()) {
        homes.push(PathBuf::from(h));
    }
    let mut out: Vec<PathBuf> = homes
        .into_iter()
        .filter(|h| h.is_absolute())
        .filter_map(|h| h.canonicalize().ok())
        .collect();
    out.sort();
    out.dedup();
    out
}

/// Why `ws` (absolute, symlinks resolved) may not be a workspace, if it may not. `homes`:
/// from [`forbidden_homes`].
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
    if let Some(h) = homes.iter().find(|h| *h == ws) {
        return Some(format!(
            "workspace `{shown}` is the home folder {} (shell history, keys, dotfiles); use a \
             project folder inside it",
            h.display()
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
    if let Some(h) = homes.iter().find(|h| h.starts_with(ws)) {
        return Some(format!(
            "workspace `{shown}` holds the home folder {} (shell history, keys, dotfiles); \
             use a project folder",
            h.display()
        ));
    }
    for h in homes {
        let Ok(below) = ws.strip_prefix(h) else {
            continue;
        };
        if let Some(dot) = below
            .components()
            .next()
            .filter(|c| c.as_os_str().as_bytes().starts_with(b"."))
        {
            return Some(format!(
                "workspace `{shown}` is inside the dot-directory {} of a home folder (keys, \
                 settings, programs on PATH); use a project folder",
                h.join(dot).display()
            ));
        }
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
        assert_eq!(refusal(&home.join("src/.hidden"), &data, &homes), None);
        // A symlinked data root is compared resolved.
        let link = base.join("data-link");
        std::os::unix::fs::symlink(&data, &link).unwrap();
        assert!(refusal(&data, &link, &homes).is_some());
        assert!(refusal(&home.join(".local/share"), &link, &homes).is_some());
    }

    #[test]
    fn folders_holding_a_home_and_dot_directories_of_a_home_are_refused() {
        let d = tempfile::tempdir().unwrap();
        let base = d.path().canonicalize().unwrap();
        let data = tempfile::tempdir().unwrap();
        let data = data.path().canonicalize().unwrap();
        let (alice, bob) = (base.join("home/alice"), base.join("home/bob"));
        let homes = vec![alice.clone(), bob.clone()];
        for (ws, what) in [
            (base.join("home"), "holds the home folder"),
            (base.clone(), "holds the home folder"),
            (bob.clone(), "is the home folder"),
            (alice.join(".ssh"), "dot-directory"),
            (alice.join(".config/systemd/user"), "dot-directory"),
            (alice.join(".local/bin"), "dot-directory"),
            (bob.join(".gnupg"), "dot-directory"),
            (bob.join(".x"), "dot-directory"),
        ] {
            let why = refusal(&ws, &data, &homes).unwrap_or_default();
            assert!(why.contains(what), "{}: {why:?}", ws.display());
        }
        for ok in [
            alice.join("src/app"),
            bob.join("work"),
            base.join("srv/app"),
            alice.join("src/.github"),
        ] {
            assert_eq!(refusal(&ok, &data, &homes), None, "{}", ok.display());
        }
    }

    #[test]
    fn every_users_home_from_the_password_database_is_found() {
        let homes = forbidden_homes(None);
        let listed: Vec<PathBuf> = std::fs::read_to_string("/etc/passwd")
            .unwrap_or_default()
            .lines()
            .filter_map(|l| l.split(':').nth(5))
            .filter_map(|h| Path::new(h).canonicalize().ok())
            .collect();
        assert!(!listed.is_empty());
        for h in &listed {
            assert!(homes.contains(h), "{} missing from {homes:?}", h.display());
        }
    }

    #[test]
    fn the_callers_and_the_daemons_homes_are_found() {
        let homes = forbidden_homes(Some(0));
        let root_home = crate::accounts::by_uid(0).unwrap().home;
        let root_home = root_home.canonicalize().unwrap_or(root_home);
        assert!(homes.contains(&root_home), "{homes:?}");
    }
}
