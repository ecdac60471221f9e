//! `POST /v1/sandboxes/{id}/exec` (and `POST /v1/execs/{id}/attach`, through
//! [`stream_events`]): streams `ExecEvent`s (NDJSON lines, or server-sent events
//! with `Accept: text/event-stream`), the exit status last.

use std::sync::Arc;

use bytes::Bytes;
use hyper::Response;
use tokio::sync::mpsc;

use crate::api;
use crate::daemon::response::{self, ApiError, Body};
use crate::daemon::router::StreamFormat;
use crate::service::Service;

pub async fn exec(
    svc: &Arc<Service>,
    id: &str,
    req: api::ExecRequest,
    format: StreamFormat,
) -> Result<Response<Body>, ApiError> {
    // Errors before the command starts (unknown sandbox, bad request) are plain JSON errors;
    // once it runs, everything (including a VM dying) arrives as stream events.
    let events = svc.start_exec(id, req).await?;
    Ok(stream_events(events, format))
}

/// Stream exec events as NDJSON or SSE. When the client goes away `events` is dropped, which
/// kills an attached command (`service/exec.rs`) and only stops a follower.
pub(super) fn stream_events(
    mut events: mpsc::Receiver<api::ExecEvent>,
    format: StreamFormat,
) -> Response<Body> {
    let (tx, rx) = mpsc::channel::<Bytes>(64);
    tokio::spawn(async move {
        loop {
            // Watch for the caller going away even while the command prints nothing: dropping
            // `events` tells the service to kill the command's process group.
            let ev = tokio::select! {
                ev = events.recv() => ev,
                _ = tx.closed() => break,
            };
            let Some(ev) = ev else { break };
            if tx.send(encode(&ev, format)).await.is_err() {
                break;
            }
        }
    });
    response::stream(rx, format)
}

fn encode(ev: &api::ExecEvent, format: StreamFormat) -> Bytes {
    let json = serde_json::to_vec(ev).expect("exec events serialize");
    match format {
        StreamFormat::Ndjson => Bytes::from([json.as_slice(), b"\n"].concat()),
        StreamFormat::Sse => {
            let kind = match ev {
                api::ExecEvent::Started { .. } => "started",
                api::ExecEvent::Stdout { .. } => "stdout",
                api::ExecEvent::Stderr { .. } => "stderr",
                api::ExecEvent::Exit { .. } => "exit",
                api::ExecEvent::Error { .. } => "error",
            };
            Bytes::from([format!("event: {kind}\ndata: ").as_bytes(), &json, b"\n\n"].concat())
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sse_frames_name_the_event_and_carry_one_json_line() {
        let ev = api::ExecEvent::output(false, b"a\nb");
        let b = encode(&ev, StreamFormat::Sse);
        assert_eq!(
            &b[..],
            b"event: stdout\ndata: {\"type\":\"stdout\",\"data\":\"a\\nb\"}\n\n"
        );
        let b = encode(&ev, StreamFormat::Ndjson);
        assert_eq!(&b[..], b"{\"type\":\"stdout\",\"data\":\"a\\nb\"}\n");
    }
}
