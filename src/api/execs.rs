//! API types of running execs: the live-exec list, attach, later stdin, signals, pty resize.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

/// A pseudo-terminal's size (`ExecRequest.pty`, `POST /v1/execs/{id}/resize`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PtySize {
    pub rows: u16,
    pub cols: u16,
}

/// Largest pty side accepted.
pub const MAX_PTY_SIDE: u16 = 1000;

impl PtySize {
    /// Both sides in `1..=MAX_PTY_SIDE`.
    pub fn check(&self) -> Result<(), String> {
        let ok = |n: u16| (1..=MAX_PTY_SIDE).contains(&n);
        if ok(self.rows) && ok(self.cols) {
            Ok(())
        } else {
            Err(format!(
                "pty rows and cols must be 1..={MAX_PTY_SIDE}, got {}x{}",
                self.rows, self.cols
            ))
        }
    }
}

/// One exec (`GET /v1/sandboxes/{id}/execs`, `GET /v1/execs/{id}`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ExecInfo {
    pub id: String,
    pub sandbox_id: String,
    /// The command's pid in the guest.
    pub pid: Option<u32>,
    pub command: Vec<String>,
    pub cwd: Option<String>,
    /// The request's own environment (not the sandbox's secret placeholders).
    #[serde(default)]
    pub env: BTreeMap<String, String>,
    pub tag: Option<String>,
    #[serde(default)]
    pub pty: bool,
    #[serde(default)]
    pub detached: bool,
    #[serde(default)]
    pub user: Option<String>,
    /// RFC 3339 UTC.
    pub started_at: String,
    pub running: bool,
    /// Once ended: the exit code, signal, timeout flag and error, as in the `exit` event.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub exit_code: Option<i32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub signal: Option<i32>,
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub timed_out: bool,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
}

/// Which output of an exec (`GET /v1/execs/{id}/output?stream=`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum OutputStream {
    /// Both streams interleaved in arrival order.
    Output,
    Stdout,
    Stderr,
}

/// `GET /v1/execs/{id}/output`: a piece of an exec's output log.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ExecOutput {
    pub exec_id: String,
    pub stream: OutputStream,
    pub offset: u64,
    pub next_offset: u64,
    /// The bytes as UTF-8 text; absent when they are not valid UTF-8 (then `data_b64`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub data: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub data_b64: Option<String>,
    pub running: bool,
    /// The log cap (`exec_log_max_bytes`) dropped some output of this stream.
    pub truncated: bool,
    /// No more output will come after `next_offset`.
    pub eof: bool,
}

/// `GET /v1/sandboxes/{id}/execs`: the running execs.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ExecList {
    pub execs: Vec<ExecInfo>,
}

/// `POST /v1/execs/{id}/attach`.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AttachRequest {
    /// Replay the output so far (from the capped log) before the live events.
    #[serde(default)]
    pub replay: bool,
}

/// `POST /v1/execs/{id}/stdin`: `data` (UTF-8) or `data_b64`, then optionally close.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ExecStdinRequest {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub data: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub data_b64: Option<String>,
    #[serde(default)]
    pub close: bool,
}

/// Largest `POST /v1/execs/{id}/stdin` payload (decoded).
pub const MAX_STDIN_INPUT: usize = 1 << 20;

/// `POST /v1/execs/{id}/signal`: a number or a name (`"SIGTERM"`, `"TERM"`).
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ExecSignalRequest {
    pub signal: SignalSpec,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum SignalSpec {
    Number(i32),
    Name(String),
}

const SIGNALS: &[(&str, i32)] = &[
    ("HUP", 1),
    ("INT", 2),
    ("QUIT", 3),
    ("KILL", 9),
    ("USR1", 10),
    ("USR2", 12),
    ("PIPE", 13),
    ("ALRM", 14),
    ("TERM", 15),
    ("CONT", 18),
    ("STOP", 19),
    ("TSTP", 20),
    ("WINCH", 28),
];

impl SignalSpec {
    /// The signal number (1..=64), or why not.
    pub fn number(&self) -> Result<i32, String> {
        let n = match self {
            SignalSpec::Number(n) => *n,
            SignalSpec::Name(s) => {
                let up = s.trim().to_ascii_uppercase();
                let bare = up.strip_prefix("SIG").unwrap_or(&up);
                match SIGNALS.iter().find(|(name, _)| *name == bare) {
                    Some((_, n)) => *n,
                    None => bare.parse().map_err(|_| format!("unknown signal `{s}`"))?,
                }
            }
        };
        if (1..=64).contains(&n) {
            Ok(n)
        } else {
            Err(format!("signal must be 1..=64, got {n}"))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn signals_parse_by_number_and_name() {
        let n = |j: &str| {
            serde_json::from_str::<ExecSignalRequest>(j)
                .unwrap()
                .signal
                .number()
        };
        assert_eq!(n(r#"{"signal":15}"#), Ok(15));
        assert_eq!(n(r#"{"signal":"SIGTERM"}"#), Ok(15));
        assert_eq!(n(r#"{"signal":"kill"}"#), Ok(9));
        assert_eq!(n(r#"{"signal":"9"}"#), Ok(9));
        assert!(n(r#"{"signal":"SIGNOPE"}"#).is_err());
        assert!(n(r#"{"signal":0}"#).is_err());
        assert!(n(r#"{"signal":65}"#).is_err());
    }

    #[test]
    fn pty_sizes_are_bounded() {
        assert!(PtySize { rows: 24, cols: 80 }.check().is_ok());
        assert!(PtySize { rows: 0, cols: 80 }.check().is_err());
        assert!(
            PtySize {
                rows: 24,
                cols: 1001
            }
            .check()
            .is_err()
        );
    }
}
