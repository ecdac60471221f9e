//! `tryboxi events [--sandbox ID] [--since N] [--json]`: follow the daemon's events live
//! (server-sent events from `GET /v1/events`). Reconnects after a daemon restart, resuming
//! after the last event seen.

use std::io::Write as _;
use std::time::{Duration, Instant};

use http_body_util::BodyExt as _;

use crate::error::TopError;
use crate::telemetry::events::Event;

/// How long to keep trying to reconnect after the stream breaks.
const RECONNECT_FOR: Duration = Duration::from_secs(30);

#[derive(Debug, clap::Args)]
pub struct Args {
    /// Only this sandbox's events.
    #[arg(long, value_name = "ID")]
    sandbox: Option<String>,
    /// Start after this event id (0 = from the oldest kept event). Default: only new events.
    #[arg(long, value_name = "N")]
    since: Option<u64>,
    /// One JSON object per line instead of text.
    #[arg(long)]
    json: bool,
    /// Stop after this many events (for scripts).
    #[arg(long, value_name = "N")]
    count: Option<u64>,
}

pub async fn run(a: Args) -> Result<(), TopError> {
    let client = super::client()?;
    // `None`: only new events. After a break, resume after the last event seen.
    let mut cursor = a.since;
    let mut printed = 0u64;
    let mut broken_since: Option<Instant> = None;
    loop {
        let mut path = match cursor {
            Some(n) => format!("/v1/events?since={n}"),
            None => "/v1/events?since=now".to_owned(),
        };
        if let Some(s) = &a.sandbox {
            path.push_str(&format!("&sandbox={s}"));
        }
        let mut body = match client.get_stream(&path).await {
            Ok(b) => b,
            Err(e @ crate::client::ClientError::Unreachable { .. }) => {
                match broken_since {
                    Some(t) if t.elapsed() < RECONNECT_FOR => {}
                    _ => return Err(e.into()),
                }
                tokio::time::sleep(Duration::from_millis(500)).await;
                continue;
            }
            Err(e) => return Err(e.into()),
        };
        let mut parser = SseParser::default();
        while let Some(Ok(frame)) = body.frame().await {
            let Ok(data) = frame.into_data() else {
                continue;
            };
            for msg in parser.push(&data) {
                let Some(data) = msg.data else { continue };
                let ev: Event = serde_json::from_str(&data).map_err(|e| {
                    TopError::Other(anyhow::anyhow!("bad event from the daemon: {e}"))
                })?;
                cursor = Some(ev.id);
                print(&ev, a.json)?;
                printed += 1;
                if a.count.is_some_and(|c| printed >= c) {
                    return Ok(());
                }
            }
        }
        // The stream ended (daemon restarting?): reconnect for a while, resuming.
        broken_since = Some(Instant::now());
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

fn print(ev: &Event, json: bool) -> Result<(), TopError> {
    let mut out = std::io::stdout().lock();
    let line = if json {
        serde_json::to_string(ev).expect("events serialize")
    } else {
        let details = match &ev.data {
            serde_json::Value::Object(m) => m
                .iter()
                .filter(|(_, v)| !v.is_null())
                .map(|(k, v)| match v {
                    serde_json::Value::String(s) => format!("{k}={s}"),
                    v => format!("{k}={v}"),
                })
                .collect::<Vec<_>>()
                .join(" "),
            serde_json::Value::Null => String::new(),
            v => v.to_string(),
        };
        format!(
            "{:>6} {} {:<16} {} {}{}",
            ev.id,
            ev.time,
            ev.kind,
            ev.sandbox_id,
            ev.exec_id
                .as_deref()
                .map(|e| format!("{e} "))
                .unwrap_or_default(),
            details
        )
    };
    writeln!(out, "{line}")
        .and_then(|_| out.flush())
        .map_err(|e| TopError::Other(e.into()))
}

/// One server-sent event message.
#[derive(Debug, Default, PartialEq)]
pub struct SseMessage {
    pub id: Option<String>,
    pub event: Option<String>,
    pub data: Option<String>,
}

/// Splits a byte stream into SSE messages (blank-line separated `field: value` lines;
/// comments and `retry:` ignored).
#[derive(Debug, Default)]
pub struct SseParser {
    buf: Vec<u8>,
    cur: SseMessage,
}

impl SseParser {
    pub fn push(&mut self, bytes: &[u8]) -> Vec<SseMessage> {
        self.buf.extend_from_slice(bytes);
        let mut out = Vec::new();
        while let Some(nl) = self.buf.iter().position(|&b| b == b'\n') {
            let line: Vec<u8> = self.buf.drain(..=nl).collect();
            let line = String::from_utf8_lossy(&line);
            let line = line.trim_end_matches(['\n', '\r']);
            if line.is_empty() {
                let m = std::mem::take(&mut self.cur);
                if m.data.is_some() || m.event.is_some() {
                    out.push(m);
                }
                continue;
            }
            if line.starts_with(':') {
                continue;
            }
            let (field, value) = line.split_once(':').unwrap_or((line, ""));
            let value = value.strip_prefix(' ').unwrap_or(value).to_owned();
            match field {
                "id" => self.cur.id = Some(value),
                "event" => self.cur.event = Some(value),
                "data" => {
                    self.cur.data = Some(match self.cur.data.take() {
                        Some(d) => d + "\n" + &value,
                        None => value,
                    })
                }
                _ => {}
            }
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sse_parser_reassembles_messages_split_across_chunks() {
        let mut p = SseParser::default();
        assert!(
            p.push(b"retry: 1000\n\n: keepalive\n\nid: 3\nevent: sandbox.re")
                .is_empty()
        );
        let m = p.push(b"ady\ndata: {\"a\":1}\n\nid: 4\ndata: x\ndata: y\n\n");
        assert_eq!(
            m,
            vec![
                SseMessage {
                    id: Some("3".into()),
                    event: Some("sandbox.ready".into()),
                    data: Some("{\"a\":1}".into())
                },
                SseMessage {
                    id: Some("4".into()),
                    event: None,
                    data: Some("x\ny".into())
                }
            ]
        );
    }
}
