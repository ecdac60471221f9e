//! `/v1/sandboxes/{id}/fork`, `/v1/sandboxes/{id}/pause` and `/v1/sandboxes/{id}/resume`.

use std::sync::Arc;

use hyper::{Response, StatusCode};

use crate::api;
use crate::daemon::response::{self, ApiError, Body};
use crate::service::Service;

pub async fn fork(
    svc: &Arc<Service>,
    id: &str,
    req: api::ForkRequest,
) -> Result<Response<Body>, ApiError> {
    Ok(response::json(
        StatusCode::CREATED,
        &svc.fork_sandbox(id, req).await?,
    ))
}

pub async fn pause(
    svc: &Arc<Service>,
    id: &str,
    req: api::PauseRequest,
) -> Result<Response<Body>, ApiError> {
    Ok(response::json(
        StatusCode::OK,
        &svc.pause_sandbox_keeping(id, req.keep_memory).await?,
    ))
}

pub async fn resume(
    svc: &Arc<Service>,
    id: &str,
    req: api::ResumeRequest,
) -> Result<Response<Body>, ApiError> {
    let how = if req.reboot {
        crate::service::ResumeHow::Reboot
    } else {
        crate::service::ResumeHow::Memory
    };
    Ok(response::json(
        StatusCode::OK,
        &svc.resume_sandbox_how(id, how).await?,
    ))
}
