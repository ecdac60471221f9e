//! `GET /v1/events`: server-sent events (`id:` = event id, `event:` = its type, `data:` = the
//! event as one JSON line), the stored backlog after the cursor first, then live ones as they
//! happen. A comment line every [`KEEPALIVE`] keeps proxies from closing an idle stream and
//! lets the daemon notice a client that went away.

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use hyper::Response;
use tokio::sync::mpsc;

use crate::daemon::response::{self, ApiError, Body};
use crate::daemon::router::StreamFormat;
use crate::service::Service;
use crate::telemetry::events::Event;

const KEEPALIVE: Duration = Duration::from_secs(15);

pub fn events(
    svc: &Arc<Service>,
    since: Option<u64>,
    sandbox: Option<String>,
) -> Result<Response<Body>, ApiError> {
    let mut sub = svc.follow_events(since, sandbox)?;
    let (tx, rx) = mpsc::channel::<Bytes>(64);
    tokio::spawn(async move {
        // Tell the client at once that the stream is open (and how long to wait to retry).
        if tx
            .send(Bytes::from_static(b"retry: 1000\n\n"))
            .await
            .is_err()
        {
            return;
        }
        loop {
            let frame = tokio::select! {
                ev = sub.next() => match ev {
                    Ok(Some(ev)) => encode(&ev),
                    Ok(None) => break,
                    Err(e) => {
                        tracing::warn!(error = %e, "cannot read events from the store");
                        break;
                    }
                },
                _ = tokio::time::sleep(KEEPALIVE) => Bytes::from_static(b": keepalive\n\n"),
                _ = tx.closed() => break,
            };
            if tx.send(frame).await.is_err() {
                break;
            }
        }
    });
    Ok(response::stream(rx, StreamFormat::Sse))
}

fn encode(ev: &Event) -> Bytes {
    let json = serde_json::to_string(ev).expect("events serialize");
    Bytes::from(format!(
        "id: {}\nevent: {}\ndata: {json}\n\n",
        ev.id, ev.kind
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_event_is_one_sse_frame_with_its_id_and_type() {
        let ev = Event {
            id: 7,
            time: "2026-01-01T00:00:00Z".into(),
            kind: "exec.finished".into(),
            sandbox_id: "sbx_1".into(),
            exec_id: Some("exe_1".into()),
            data: serde_json::json!({"exit_code": 0}),
        };
        let f = String::from_utf8(encode(&ev).to_vec()).unwrap();
        assert!(f.starts_with("id: 7\nevent: exec.finished\ndata: {"), "{f}");
        assert!(f.ends_with("}\n\n") && f.matches('\n').count() == 4, "{f}");
    }
}
