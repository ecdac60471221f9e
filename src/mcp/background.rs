//! Background commands: `exec` with `background: true` starts a detached exec and returns its
//! id (with whatever it printed in its first moment), `exec_output` reads its kept output,
//! `stop_exec` signals it. All through the daemon's exec routes (`/v1/execs/{id}...`); an exec
//! id is only used once its sandbox is known to be one this server may use.

use std::time::Duration;

use rmcp::model::{CallToolResult, ContentBlock};

use super::outputs::{Captured, excerpt};
use super::server::{SandboxServer, json_result};
use super::tools::{ExecOutputArgs, StopExecArgs};
use super::{ToolError, exec};
use crate::api;
use crate::client::Client;

/// How long `exec` with `background` watches the new command before it returns (a server
/// that fails at once, e.g. on a port in use, is reported right away).
const FIRST_LOOK: Duration = Duration::from_millis(1500);
/// Longest wait for the daemon's `started` event (the sync before the command comes first).
const START_WAIT: Duration = Duration::from_secs(600);
/// Longest `wait_s` of `exec_output`.
const MAX_WAIT_S: f64 = 30.0;
/// Bytes returned by one `exec_output` call.
const PAGE: u64 = 64 << 10;
/// How long `stop_exec` waits for the command to end after the signal.
const STOP_WAIT: Duration = Duration::from_secs(5);

/// Start `req` (detached) in sandbox `id`; return its exec id once it runs.
pub async fn start(
    client: &Client,
    id: &str,
    req: &api::ExecRequest,
) -> Result<CallToolResult, ToolError> {
    let route = "POST /v1/sandboxes/{id}/exec";
    let failed = |e| ToolError::from_client(e, "exec", route, Some(id));
    let mut events = client.exec(id, req).await.map_err(failed)?;
    let first = tokio::time::timeout(START_WAIT, events.next())
        .await
        .map_err(|_| ToolError::Daemon("the command did not start in time".into()))?
        .map_err(failed)?;
    let (exec_id, pid) = match first {
        Some(api::ExecEvent::Started { exec_id, pid, .. }) => (exec_id, pid),
        Some(api::ExecEvent::Error { code, message }) => {
            return Err(ToolError::ExecFailed { code, message });
        }
        other => {
            return Err(ToolError::Daemon(format!(
                "the exec stream began with {other:?} instead of `started`"
            )));
        }
    };
    // A first look: its early output, and its end if it ended at once.
    let mut out = Captured::default();
    let mut ended: Option<(Option<i32>, Option<i32>)> = None;
    let look = async {
        while let Ok(Some(ev)) = events.next().await {
            match ev {
                api::ExecEvent::Stdout { data, data_b64 }
                | api::ExecEvent::Stderr { data, data_b64 } => {
                    if let Ok(b) = api::ExecEvent::output_bytes(&data, &data_b64) {
                        out.push(&b);
                    }
                }
                api::ExecEvent::Exit {
                    exit_code, signal, ..
                } => {
                    ended = Some((exit_code, signal));
                    return;
                }
                api::ExecEvent::Error { .. } => {
                    ended = Some((None, None));
                    return;
                }
                api::ExecEvent::Started { .. } => {}
            }
        }
    };
    let _ = tokio::time::timeout(FIRST_LOOK, look).await;
    // Dropping the stream leaves the detached command running.
    drop(events);
    let (early, cut) = excerpt(&out.bytes, exec::SHOWN);
    let running = ended.is_none();
    let (exit_code, signal) = ended.unwrap_or((None, None));
    let mut text = if running {
        format!(
            "Started in the background: exec_id {exec_id} (sandbox {id}). It keeps running; \
             read its output with exec_output(exec_id=\"{exec_id}\"), stop it with \
             stop_exec(exec_id=\"{exec_id}\").\n"
        )
    } else {
        format!(
            "The background command already ended ({}): exec_id {exec_id} (sandbox {id}). \
             Its output is below; all of it with exec_output(exec_id=\"{exec_id}\").\n",
            end_text(exit_code, signal)
        )
    };
    if !early.is_empty() {
        text.push_str(&format!("--- first output ---\n{early}"));
        if !early.ends_with('\n') {
            text.push('\n');
        }
        if cut.is_some() || out.dropped > 0 {
            text.push_str("[cut; read all of it with exec_output]\n");
        }
    }
    let mut r = CallToolResult::success(vec![ContentBlock::text(text)]);
    r.structured_content = Some(serde_json::json!({
        "exec_id": exec_id,
        "sandbox_id": id,
        "pid": pid,
        "running": running,
        "exit_code": exit_code,
        "signal": signal,
        "output": early,
    }));
    Ok(r)
}

fn end_text(exit_code: Option<i32>, signal: Option<i32>) -> String {
    match (exit_code, signal) {
        (Some(c), _) => format!("exit code {c}"),
        (None, Some(s)) => format!("killed by signal {s}"),
        (None, None) => "it was lost".into(),
    }
}

impl SandboxServer {
    /// The exec, once its sandbox is one this server may use.
    async fn scoped_exec(
        &self,
        tool: &'static str,
        exec_id: &str,
    ) -> Result<api::ExecInfo, ToolError> {
        if !crate::ids::is_valid(crate::ids::EXEC, exec_id) {
            return Err(ToolError::InvalidArgs {
                tool: tool.into(),
                message: format!("`{exec_id}` is not an exec id (`exe_` and 16 hex digits)"),
            });
        }
        let info = self
            .inner
            .client
            .exec_info(exec_id)
            .await
            .map_err(|e| ToolError::from_client(e, tool, "GET /v1/execs/{id}", None))?;
        self.check_scope(&info.sandbox_id).await?;
        Ok(info)
    }

    /// `exec_output`.
    pub(super) async fn exec_output(&self, a: ExecOutputArgs) -> Result<CallToolResult, ToolError> {
        let info = self.scoped_exec("exec_output", &a.exec_id).await?;
        let wait = a.wait_s.unwrap_or(0.0);
        if !wait.is_finite() || wait < 0.0 {
            return Err(ToolError::InvalidArgs {
                tool: "exec_output".into(),
                message: "`wait_s` must be 0 or a positive number of seconds".into(),
            });
        }
        let wait_ms = (wait.min(MAX_WAIT_S) * 1000.0) as u64;
        let client = &self.inner.client;
        let o = client
            .exec_output(&a.exec_id, a.stream.as_str(), a.offset, wait_ms, PAGE)
            .await
            .map_err(|e| {
                ToolError::from_client(e, "exec_output", "GET /v1/execs/{id}/output", None)
            })?;
        // The end status as of after this read (the first look may be older).
        let info = if o.running {
            info
        } else {
            client
                .exec_info(&a.exec_id)
                .await
                .map_err(|e| ToolError::from_client(e, "exec_output", "GET /v1/execs/{id}", None))?
        };
        let body = match (&o.data, &o.data_b64) {
            (Some(t), _) => t.clone(),
            (None, Some(b)) => format!("[binary output, {} bytes of base64]", b.len()),
            (None, None) => String::new(),
        };
        let status = if info.running {
            "running".to_owned()
        } else {
            format!("ended, {}", end_text(info.exit_code, info.signal))
        };
        let mut text = format!(
            "{} ({status}), bytes {}..{} of {}{}\n",
            a.exec_id,
            o.offset,
            o.next_offset,
            a.stream.as_str(),
            if o.eof { ", the end" } else { "" }
        );
        text.push_str(&body);
        if o.truncated {
            text.push_str("\n[the daemon's log cap dropped some of this output]\n");
        }
        let mut r = CallToolResult::success(vec![ContentBlock::text(text)]);
        r.structured_content = Some(serde_json::json!({
            "exec_id": a.exec_id,
            "sandbox_id": info.sandbox_id,
            "text": body,
            "offset": o.offset,
            "next_offset": o.next_offset,
            "eof": o.eof,
            "running": info.running,
            "exit_code": info.exit_code,
            "signal": info.signal,
            "truncated": o.truncated,
        }));
        Ok(r)
    }

    /// `stop_exec`.
    pub(super) async fn stop_exec(&self, a: StopExecArgs) -> Result<CallToolResult, ToolError> {
        let info = self.scoped_exec("stop_exec", &a.exec_id).await?;
        let signal = a.signal.unwrap_or_else(|| "TERM".into());
        let spec = api::SignalSpec::Name(signal.clone());
        let number = spec.number().map_err(|m| ToolError::InvalidArgs {
            tool: "stop_exec".into(),
            message: m,
        })?;
        if !info.running {
            return Ok(json_result(&serde_json::json!({
                "exec_id": a.exec_id,
                "running": false,
                "exit_code": info.exit_code,
                "signal": info.signal,
                "message": "It had already ended.",
            })));
        }
        let client = &self.inner.client;
        let route = "POST /v1/execs/{id}/signal";
        client
            .signal_exec(&a.exec_id, api::SignalSpec::Number(number))
            .await
            .map_err(|e| ToolError::from_client(e, "stop_exec", route, None))?;
        let deadline = tokio::time::Instant::now() + STOP_WAIT;
        let info = loop {
            let i = client
                .exec_info(&a.exec_id)
                .await
                .map_err(|e| ToolError::from_client(e, "stop_exec", "GET /v1/execs/{id}", None))?;
            if !i.running || tokio::time::Instant::now() >= deadline {
                break i;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        };
        let message = if info.running {
            format!(
                "Sent {signal}; it is still running after {} s. Send `KILL` to force it.",
                STOP_WAIT.as_secs()
            )
        } else {
            format!(
                "Sent {signal}; it ended ({}).",
                end_text(info.exit_code, info.signal)
            )
        };
        Ok(json_result(&serde_json::json!({
            "exec_id": a.exec_id,
            "running": info.running,
            "exit_code": info.exit_code,
            "signal": info.signal,
            "message": message,
        })))
    }
}
