//! envd's `process` and `filesystem` messages in proto3-JSON, the mapping the Connect JSON
//! codec uses (see `../shared/e2b/envd-protos.txt` for the field numbers and JSON names).
//!
//! Owns: the request shapes we accept (camelCase, snake_case also accepted; integers as numbers
//! or strings; enums by name or number; unknown fields ignored) and the response shapes we send
//! (camelCase, `int64` as a string, enums by name, default values omitted, `bytes` as base64).
//! Never: what a request does. Depends on nothing else in the crate, so the fuzz crate compiles
//! it by path (`fuzz/fuzz_targets/e2b_wire.rs`); `EntryInfo` is built in `entry.rs`.

use std::collections::BTreeMap;

use serde::de::{self, Deserializer};
use serde::{Deserialize, Serialize};
use serde_json::{Map, Value, json};

/// Longest string field we accept (paths, commands, tags).
pub const MAX_FIELD: usize = 64 * 1024;

/// A `uint32` as proto3-JSON allows it: a number or a decimal string.
fn u32_lenient<'de, D: Deserializer<'de>>(d: D) -> Result<Option<u32>, D::Error> {
    #[derive(Deserialize)]
    #[serde(untagged)]
    enum N {
        Num(u32),
        Str(String),
    }
    match Option::<N>::deserialize(d)? {
        None => Ok(None),
        Some(N::Num(n)) => Ok(Some(n)),
        Some(N::Str(s)) => s.parse().map(Some).map_err(de::Error::custom),
    }
}

#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize, Serialize)]
#[serde(default, rename_all = "camelCase")]
pub struct ProcessConfig {
    pub cmd: String,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub args: Vec<String>,
    #[serde(skip_serializing_if = "BTreeMap::is_empty")]
    pub envs: BTreeMap<String, String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub cwd: Option<String>,
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
#[serde(default)]
pub struct PtySize {
    #[serde(deserialize_with = "u32_lenient")]
    pub cols: Option<u32>,
    #[serde(deserialize_with = "u32_lenient")]
    pub rows: Option<u32>,
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
#[serde(default)]
pub struct Pty {
    pub size: Option<PtySize>,
}

#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize)]
#[serde(default)]
pub struct StartRequest {
    pub process: Option<ProcessConfig>,
    pub pty: Option<Pty>,
    pub tag: Option<String>,
    pub stdin: Option<bool>,
}

/// Which process: by pid or by tag.
#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize)]
#[serde(default)]
pub struct ProcessSelector {
    #[serde(deserialize_with = "u32_lenient")]
    pub pid: Option<u32>,
    pub tag: Option<String>,
}

#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize)]
#[serde(default)]
pub struct SelectRequest {
    pub process: Option<ProcessSelector>,
}

#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize)]
#[serde(default)]
pub struct ProcessInput {
    pub stdin: Option<String>,
    pub pty: Option<String>,
}

#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize)]
#[serde(default)]
pub struct SendInputRequest {
    pub process: Option<ProcessSelector>,
    pub input: Option<ProcessInput>,
}

#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize)]
#[serde(default)]
pub struct StreamInputData {
    pub input: Option<ProcessInput>,
}

/// One message of the client stream of `StreamInput` (a oneof: `start`, `data`, `keepalive`).
#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize)]
#[serde(default)]
pub struct StreamInputRequest {
    pub start: Option<SelectRequest>,
    pub data: Option<StreamInputData>,
    pub keepalive: Option<Value>,
}

#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize)]
#[serde(default)]
pub struct SendSignalRequest {
    pub process: Option<ProcessSelector>,
    pub signal: Option<Value>,
}

#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize)]
#[serde(default)]
pub struct UpdateRequest {
    pub process: Option<ProcessSelector>,
    pub pty: Option<Pty>,
}

/// envd's `Signal` enum, by name or number: the signal number, `None` for anything else.
pub fn signal_number(v: &Value) -> Option<i32> {
    match v {
        Value::String(s) => match s.as_str() {
            "SIGNAL_SIGKILL" => Some(9),
            "SIGNAL_SIGTERM" => Some(15),
            s => s.parse().ok().filter(|n| [9, 15].contains(n)),
        },
        Value::Number(n) => n.as_i64().and_then(|n| match n {
            9 | 15 => Some(n as i32),
            _ => None,
        }),
        _ => None,
    }
}

#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize)]
#[serde(default)]
pub struct PathRequest {
    pub path: String,
    #[serde(deserialize_with = "u32_lenient")]
    pub depth: Option<u32>,
}

#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize)]
#[serde(default)]
pub struct MoveRequest {
    pub source: String,
    pub destination: String,
}

/// `process.ProcessEvent` as JSON (oneof `event`).
pub enum ProcessEvent<'a> {
    Start {
        pid: u32,
    },
    Stdout(&'a [u8]),
    Stderr(&'a [u8]),
    Pty(&'a [u8]),
    End {
        exit_code: i32,
        exited: bool,
        status: String,
        error: Option<String>,
    },
    Keepalive,
}

impl ProcessEvent<'_> {
    /// `{"event": {...}}` (the `StartResponse`/`ConnectResponse` wrapper).
    pub fn to_json(&self) -> Value {
        use base64::Engine as _;
        let b64 = |b: &[u8]| base64::engine::general_purpose::STANDARD.encode(b);
        let ev = match self {
            ProcessEvent::Start { pid } => json!({ "start": { "pid": pid } }),
            ProcessEvent::Stdout(b) => json!({ "data": { "stdout": b64(b) } }),
            ProcessEvent::Stderr(b) => json!({ "data": { "stderr": b64(b) } }),
            ProcessEvent::Pty(b) => json!({ "data": { "pty": b64(b) } }),
            ProcessEvent::End {
                exit_code,
                exited,
                status,
                error,
            } => {
                let mut m = Map::new();
                if *exit_code != 0 {
                    m.insert("exitCode".into(), json!(exit_code));
                }
                if *exited {
                    m.insert("exited".into(), json!(true));
                }
                if !status.is_empty() {
                    m.insert("status".into(), json!(status));
                }
                if let Some(e) = error.as_ref().filter(|e| !e.is_empty()) {
                    m.insert("error".into(), json!(e));
                }
                json!({ "end": m })
            }
            ProcessEvent::Keepalive => json!({ "keepalive": {} }),
        };
        json!({ "event": ev })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn start_request_accepts_camel_and_lenient_numbers_and_ignores_unknown_fields() {
        let r: StartRequest = serde_json::from_str(
            r#"{"process":{"cmd":"/bin/bash","args":["-l","-c","echo hi"],"envs":{"A":"1"},"cwd":"/home/user"},
                "pty":{"size":{"cols":"80","rows":24}},"tag":"t","stdin":false,"newField":1}"#,
        )
        .unwrap();
        let p = r.process.unwrap();
        assert_eq!(p.args, vec!["-l", "-c", "echo hi"]);
        assert_eq!(p.envs["A"], "1");
        let size = r.pty.unwrap().size.unwrap();
        assert_eq!((size.cols, size.rows), (Some(80), Some(24)));
        assert_eq!(r.stdin, Some(false));
        let s: SelectRequest = serde_json::from_str(r#"{"process":{"pid":"42"}}"#).unwrap();
        assert_eq!(s.process.unwrap().pid, Some(42));
        assert!(serde_json::from_str::<SelectRequest>(r#"{"process":{"pid":"x"}}"#).is_err());
    }

    #[test]
    fn signals_by_name_or_number_only_the_two_envd_knows() {
        assert_eq!(signal_number(&json!("SIGNAL_SIGKILL")), Some(9));
        assert_eq!(signal_number(&json!("SIGNAL_SIGTERM")), Some(15));
        assert_eq!(signal_number(&json!(15)), Some(15));
        assert_eq!(signal_number(&json!("SIGNAL_UNSPECIFIED")), None);
        assert_eq!(signal_number(&json!(2)), None);
    }

    #[test]
    fn end_events_omit_defaults() {
        let ok = ProcessEvent::End {
            exit_code: 0,
            exited: true,
            status: "exit status 0".into(),
            error: None,
        }
        .to_json();
        assert_eq!(
            ok,
            json!({"event":{"end":{"exited":true,"status":"exit status 0"}}})
        );
        let bad = ProcessEvent::End {
            exit_code: 3,
            exited: true,
            status: "exit status 3".into(),
            error: None,
        }
        .to_json();
        assert_eq!(bad["event"]["end"]["exitCode"], 3);
        assert_eq!(
            ProcessEvent::Stdout(b"hi").to_json(),
            json!({"event":{"data":{"stdout":"aGk="}}})
        );
    }
}
