//! `POST /v1/sandboxes/{id}/exec`: streams NDJSON `ExecEvent` lines, the exit status last.

use std::sync::Arc;

use bytes::Bytes;
use hyper::Response;
use tokio::sync::mpsc;

use crate::api;
use crate::daemon::response::{self, ApiError, Body};
use crate::service::Service;

pub async fn exec(
    svc: &Arc<Service>,
    id: &str,
    req: api::ExecRequest,
) -> Result<Response<Body>, ApiError> {
    // Errors before the command starts (unknown sandbox, bad request) are plain JSON errors;
    // once it runs, everything (including a VM dying) arrives as NDJSON events.
    let mut events = svc.start_exec(id, req).await?;
    let (tx, rx) = mpsc::channel::<Bytes>(64);
    tokio::spawn(async move {
        while let Some(ev) = events.recv().await {
            let mut line = serde_json::to_vec(&ev).expect("exec events serialize");
            line.push(b'\n');
            if tx.send(Bytes::from(line)).await.is_err() {
                // The client went away; dropping `events` tells the service to stop streaming.
                break;
            }
        }
    });
    Ok(response::ndjson(rx))
}
