//! `/v1/execs/{id}` and `/v1/sandboxes/{id}/execs`: an exec's output log from a byte offset,
//! the running execs, attach, later stdin, signals and pty resizes.

use std::sync::Arc;

use hyper::{Response, StatusCode};

use crate::api;
use crate::daemon::response::{self, ApiError, Body};
use crate::daemon::router::StreamFormat;
use crate::service::{OutputQuery, Service};

pub async fn output(
    svc: &Arc<Service>,
    id: &str,
    q: OutputQuery,
) -> Result<Response<Body>, ApiError> {
    Ok(response::json(
        StatusCode::OK,
        &svc.exec_output(id, q).await?,
    ))
}

pub fn list(svc: &Arc<Service>, sandbox_id: &str) -> Result<Response<Body>, ApiError> {
    let execs = svc.list_execs(sandbox_id)?;
    Ok(response::json(StatusCode::OK, &api::ExecList { execs }))
}

pub fn get(svc: &Arc<Service>, id: &str) -> Result<Response<Body>, ApiError> {
    Ok(response::json(StatusCode::OK, &svc.get_exec(id)?))
}

pub async fn attach(
    svc: &Arc<Service>,
    id: &str,
    req: api::AttachRequest,
    format: StreamFormat,
) -> Result<Response<Body>, ApiError> {
    let events = svc.attach_exec(id, req.replay).await?;
    Ok(super::exec::stream_events(events, format))
}

/// Answers the exec as listed.
pub async fn stdin(
    svc: &Arc<Service>,
    id: &str,
    req: api::ExecStdinRequest,
) -> Result<Response<Body>, ApiError> {
    let data = match (&req.data_b64, &req.data) {
        (Some(_), Some(_)) => {
            return Err(ApiError::bad_request("give `data` or `data_b64`, not both"));
        }
        (Some(b), None) => {
            api::b64::decode(b).map_err(|e| ApiError::bad_request(format!("data_b64: {e}")))?
        }
        (None, Some(s)) => s.as_bytes().to_vec(),
        (None, None) => Vec::new(),
    };
    svc.exec_input(id, &data, req.close).await?;
    get(svc, id)
}

pub async fn signal(
    svc: &Arc<Service>,
    id: &str,
    req: api::ExecSignalRequest,
) -> Result<Response<Body>, ApiError> {
    let n = req.signal.number().map_err(ApiError::bad_request)?;
    svc.signal_exec(id, n).await?;
    get(svc, id)
}

pub async fn resize(
    svc: &Arc<Service>,
    id: &str,
    req: api::PtySize,
) -> Result<Response<Body>, ApiError> {
    svc.resize_exec(id, req.rows, req.cols).await?;
    get(svc, id)
}
