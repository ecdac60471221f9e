//! The `exec` tool: run a command through the daemon's exec stream, report progress while it
//! runs, stop it when the client cancels, and shape the output for the model.

use std::time::{Duration, Instant};

use rmcp::RoleServer;
use rmcp::model::{CallToolResult, ContentBlock, ProgressNotificationParam};
use rmcp::service::RequestContext;

use super::ToolError;
use super::outputs::{Captured, Outputs, excerpt};
use crate::api;
use crate::client::Client;

/// Bytes of each stream shown in the tool result; the rest is paged with `read_output`.
pub const SHOWN: usize = 16 << 10;
/// Progress notifications at most this often.
const PROGRESS_EVERY: Duration = Duration::from_secs(1);
/// Longest timeout the model may ask for.
pub const MAX_TIMEOUT_S: f64 = 3600.0;

/// How the command ended.
#[derive(Debug, serde::Serialize)]
pub struct Outcome {
    pub sandbox_id: String,
    pub exit_code: Option<i32>,
    pub signal: Option<i32>,
    pub timed_out: bool,
    pub duration_ms: u64,
    pub stdout: String,
    pub stderr: String,
    /// Set when some output is not shown: page it with `read_output`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub output_id: Option<String>,
    pub stdout_bytes: u64,
    pub stderr_bytes: u64,
}

/// Run `req` in sandbox `id` and turn the stream into a tool result.
pub async fn run(
    client: &Client,
    id: &str,
    req: &api::ExecRequest,
    ctx: &RequestContext<RoleServer>,
    outputs: &std::sync::Mutex<Outputs>,
) -> Result<CallToolResult, ToolError> {
    let route = "POST /v1/sandboxes/{id}/exec";
    let mut events = client
        .exec(id, req)
        .await
        .map_err(|e| ToolError::from_client(e, "exec", route, Some(id)))?;
    let started = Instant::now();
    let token = ctx.meta.get_progress_token();
    let mut ticker =
        tokio::time::interval_at(tokio::time::Instant::now() + PROGRESS_EVERY, PROGRESS_EVERY);
    let mut stdout = Captured::default();
    let mut stderr = Captured::default();
    let mut last_line = String::new();
    let end = loop {
        tokio::select! {
            _ = ctx.ct.cancelled() => {
                // Dropping the stream closes the HTTP request; the daemon then kills the
                // command's process group.
                drop(events);
                tracing::info!(sandbox = id, "exec cancelled by the client");
                return Err(ToolError::Other("Cancelled: the command was killed.".into()));
            }
            _ = ticker.tick(), if token.is_some() => {
                if let Some(t) = &token {
                    let secs = started.elapsed().as_secs_f64();
                    let mut p = ProgressNotificationParam::new(t.clone(), secs)
                        .with_message(progress_message(secs, &stdout, &stderr, &last_line));
                    if let Some(total) = req.timeout_s {
                        p = p.with_total(total);
                    }
                    if let Err(e) = ctx.peer.notify_progress(p).await {
                        tracing::debug!(error = %e, "progress notification not sent");
                    }
                }
            }
            ev = events.next() => {
                let ev = ev.map_err(|e| ToolError::from_client(e, "exec", route, Some(id)))?;
                match ev {
                    None => {
                        return Err(ToolError::Daemon(
                            "the exec stream ended without an exit status".into(),
                        ))
                    }
                    Some(api::ExecEvent::Started { .. }) => {}
                    Some(api::ExecEvent::Stdout { data, data_b64 }) => {
                        let b = api::ExecEvent::output_bytes(&data, &data_b64)
                            .map_err(ToolError::Daemon)?;
                        note_last_line(&mut last_line, &b);
                        stdout.push(&b);
                    }
                    Some(api::ExecEvent::Stderr { data, data_b64 }) => {
                        let b = api::ExecEvent::output_bytes(&data, &data_b64)
                            .map_err(ToolError::Daemon)?;
                        note_last_line(&mut last_line, &b);
                        stderr.push(&b);
                    }
                    Some(api::ExecEvent::Exit { exit_code, signal, timed_out, duration_ms }) => {
                        break (exit_code, signal, timed_out, duration_ms);
                    }
                    Some(api::ExecEvent::Error { code, message }) => {
                        return Err(ToolError::ExecFailed { code, message });
                    }
                }
            }
        }
    };
    let (exit_code, signal, timed_out, duration_ms) = end;
    let (out_text, out_cut) = excerpt(&stdout.bytes, SHOWN);
    let (err_text, err_cut) = excerpt(&stderr.bytes, SHOWN);
    let cut = out_cut.is_some() || err_cut.is_some() || stdout.dropped > 0 || stderr.dropped > 0;
    let outcome = Outcome {
        sandbox_id: id.to_owned(),
        exit_code,
        signal,
        timed_out,
        duration_ms,
        stdout_bytes: stdout.total(),
        stderr_bytes: stderr.total(),
        stdout: out_text,
        stderr: err_text,
        output_id: if cut {
            Some(
                outputs
                    .lock()
                    .map_err(|_| ToolError::Other("output store poisoned".into()))?
                    .insert(stdout, stderr),
            )
        } else {
            None
        },
    };
    let text = render(&outcome, req.timeout_s);
    let mut result = if timed_out {
        CallToolResult::error(vec![ContentBlock::text(text)])
    } else {
        CallToolResult::success(vec![ContentBlock::text(text)])
    };
    result.structured_content = serde_json::to_value(&outcome).ok();
    Ok(result)
}

/// The text the model reads.
pub fn render(o: &Outcome, timeout_s: Option<f64>) -> String {
    let mut s = String::new();
    if o.timed_out {
        s.push_str(&format!(
            "TIMED OUT after {} s: the command was killed (with its whole process group). \
             Output so far is below. Retry with a larger timeout_s, or make the command \
             finish sooner.\n",
            timeout_s
                .map(|t| t.to_string())
                .unwrap_or_else(|| "?".into())
        ));
    }
    match (o.exit_code, o.signal) {
        (Some(c), _) => s.push_str(&format!("exit code: {c}")),
        (None, Some(sig)) => s.push_str(&format!("killed by signal {sig}")),
        (None, None) => s.push_str("exit status unknown"),
    }
    s.push_str(&format!(
        " ({} ms, sandbox {})\n",
        o.duration_ms, o.sandbox_id
    ));
    for (name, text, bytes) in [
        ("stdout", &o.stdout, o.stdout_bytes),
        ("stderr", &o.stderr, o.stderr_bytes),
    ] {
        if bytes == 0 {
            continue;
        }
        s.push_str(&format!("--- {name} ({bytes} bytes) ---\n{text}"));
        if !text.ends_with('\n') {
            s.push('\n');
        }
    }
    if let Some(id) = &o.output_id {
        s.push_str(&format!(
            "[output was cut; read all of it with read_output(output_id=\"{id}\", \
             stream=\"stdout\"|\"stderr\", offset=0)]\n"
        ));
    }
    s
}

fn note_last_line(last: &mut String, chunk: &[u8]) {
    let text = String::from_utf8_lossy(chunk);
    if let Some(line) = text.lines().rev().map(str::trim).find(|l| !l.is_empty()) {
        *last = line.chars().take(120).collect();
    }
}

fn progress_message(secs: f64, out: &Captured, err: &Captured, last: &str) -> String {
    let mut m = format!(
        "running {secs:.0} s, {} bytes of output",
        out.total() + err.total()
    );
    if !last.is_empty() {
        m.push_str(": ");
        m.push_str(last);
    }
    m
}

/// Validate and clamp the model's exec arguments into a request. `default_timeout_s`: the
/// user's default (`None` for a background command: it runs until stopped).
pub fn request(
    cmd: String,
    timeout_s: Option<f64>,
    cwd: Option<String>,
    default_timeout_s: Option<f64>,
) -> Result<api::ExecRequest, ToolError> {
    let invalid = |m: &str| ToolError::InvalidArgs {
        tool: "exec".into(),
        message: m.into(),
    };
    if cmd.trim().is_empty() {
        return Err(invalid("`cmd` is empty"));
    }
    let timeout = timeout_s.or(default_timeout_s);
    if let Some(t) = timeout
        && (!t.is_finite() || t <= 0.0)
    {
        return Err(invalid("`timeout_s` must be a positive number of seconds"));
    }
    Ok(api::ExecRequest {
        cmd: Some(cmd),
        cwd,
        timeout_s: timeout.map(|t| t.min(MAX_TIMEOUT_S)),
        ..Default::default()
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn outcome() -> Outcome {
        Outcome {
            sandbox_id: "sbx_x".into(),
            exit_code: Some(3),
            signal: None,
            timed_out: false,
            duration_ms: 12,
            stdout: "hello\n".into(),
            stderr: String::new(),
            output_id: None,
            stdout_bytes: 6,
            stderr_bytes: 0,
        }
    }

    #[test]
    fn render_shows_exit_code_and_only_nonempty_streams() {
        let t = render(&outcome(), None);
        assert!(t.starts_with("exit code: 3"), "{t}");
        assert!(t.contains("--- stdout (6 bytes) ---\nhello\n"), "{t}");
        assert!(!t.contains("stderr"), "{t}");
    }

    #[test]
    fn render_of_a_timeout_says_it_was_killed_and_how_to_retry() {
        let mut o = outcome();
        o.timed_out = true;
        o.exit_code = None;
        o.signal = Some(9);
        let t = render(&o, Some(5.0));
        assert!(t.starts_with("TIMED OUT after 5 s"), "{t}");
        assert!(t.contains("timeout_s"), "{t}");
    }

    #[test]
    fn cut_output_names_the_way_to_page_it() {
        let mut o = outcome();
        o.output_id = Some("out_4".into());
        assert!(render(&o, None).contains("read_output(output_id=\"out_4\""));
    }

    #[test]
    fn timeouts_are_validated_and_capped() {
        assert!(request("true".into(), Some(-1.0), None, Some(600.0)).is_err());
        assert!(request("  ".into(), None, None, Some(600.0)).is_err());
        let r = request("true".into(), Some(1e9), None, Some(600.0)).unwrap();
        assert_eq!(r.timeout_s, Some(MAX_TIMEOUT_S));
        let r = request("true".into(), None, None, Some(600.0)).unwrap();
        assert_eq!(r.timeout_s, Some(600.0));
        // A background command has no default timeout; one the model gives still holds.
        let r = request("true".into(), None, None, None).unwrap();
        assert_eq!(r.timeout_s, None);
        assert!(request("true".into(), Some(0.0), None, None).is_err());
    }
}
