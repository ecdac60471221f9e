//! The workspace: the host repo goes into the VM one way (delta sync), and changes come back
//! only on request (diff, apply, pull), with a backup and undo.
//!
//! Owns: the rules of what is synced ([`rules`]: `.gitignore`, `sync.exclude`, secrets), the
//! sync base of a sandbox ([`manifest`]: the manifest last synced plus content-addressed blobs
//! of what was sent), git config sanitizing ([`gitconfig`]), the git metadata apply refuses
//! ([`gitmeta`]), the delta ([`sync`]), the diff of the VM against the base ([`diff`],
//! with [`spill`] holding the VM's changed files on disk while it runs),
//! bringing changes back ([`apply`], with [`links`] resolving symlinks against the repo as the
//! apply leaves it), backups ([`backup`], writing through [`hostfs`]) and the ext4 image of a
//! first big sync ([`basedisk`]).
//! Never: talks HTTP or to the VM itself (the service moves bytes), commits, switches branches,
//! resets, cleans or touches a git index, writes under `.git/`, or deletes except through
//! `crate::safefs`.

pub mod apply;
pub mod backup;
pub mod basedisk;
pub mod diff;
pub mod gitconfig;
pub mod gitmeta;
pub mod hostfs;
pub mod links;
pub mod manifest;
pub mod rules;
pub mod spill;
pub mod sync;

#[cfg(test)]
mod secrets_tests;

use std::path::PathBuf;

/// Where the workspace lives inside every VM.
pub const GUEST_ROOT: &str = "/workspace";

#[derive(Debug, thiserror::Error)]
pub enum WorkspaceError {
    #[error("cannot {what} {path}: {source}")]
    Io {
        what: &'static str,
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("invalid pattern `{pattern}` in the sync rules: {message}")]
    Pattern { pattern: String, message: String },
    #[error("the sync base in {0} is corrupt ({1}); remove and recreate the sandbox")]
    CorruptBase(PathBuf, String),
    #[error("backup `{0}` does not exist")]
    NoArtifact(String),
    #[error("backup `{0}` was already undone")]
    AlreadyUndone(String),
    #[error("{0}")]
    Refused(String),
    /// Over a size limit of the config (`sync.max_diff_mib`, `sync.max_sync_mib`,
    /// `sync.max_file_mib`); nothing was changed.
    #[error("{0}")]
    TooBig(String),
    /// Undo would overwrite host changes made after the apply.
    #[error("{0}")]
    HostEdited(String),
    #[error("cannot record the backup: {0}")]
    Store(String),
}

impl WorkspaceError {
    pub fn io(what: &'static str, path: impl Into<PathBuf>) -> impl FnOnce(std::io::Error) -> Self {
        let path = path.into();
        move |source| WorkspaceError::Io { what, path, source }
    }
}

/// `a/b/c` -> `["a", "a/b", "a/b/c"]`: the path and every ancestor, shortest first.
pub(crate) fn ancestors(rel: &str) -> impl Iterator<Item = &str> {
    rel.match_indices('/')
        .map(move |(i, _)| &rel[..i])
        .chain(std::iter::once(rel))
}

/// The SHA-256 of `data`, hex.
pub fn sha256(data: &[u8]) -> String {
    use sha2::Digest;
    hex::encode(sha2::Sha256::digest(data))
}
