//! The one top-level error of the binary and its mapping to process exit codes.

use std::process::ExitCode;

/// Everything a face of the binary can fail with, reduced to what the user must know.
#[derive(Debug, thiserror::Error)]
pub enum TopError {
    /// Wrong usage or invalid input (exit 2).
    #[error("{0}")]
    Usage(String),
    /// The daemon answered with an API error (exit 1).
    #[error("{code}: {message}")]
    Api { code: String, message: String },
    /// The daemon refuses this user (`uid_not_allowed`): its message as it is (exit 3).
    #[error("{0}")]
    Refused(String),
    /// The daemon could not be reached (exit 3).
    #[error("{0}")]
    Unreachable(String),
    /// A command run in a sandbox exited with this code; no message (the code is passed on).
    #[error("exit status {0}")]
    ExitStatus(u8),
    /// Anything else (exit 1).
    #[error(transparent)]
    Other(#[from] anyhow::Error),
}

impl TopError {
    pub fn exit_code(&self) -> ExitCode {
        match self {
            TopError::Usage(_) => ExitCode::from(2),
            TopError::Api { .. } | TopError::Other(_) => ExitCode::from(1),
            TopError::Unreachable(_) | TopError::Refused(_) => ExitCode::from(3),
            TopError::ExitStatus(c) => ExitCode::from(*c),
        }
    }
}
