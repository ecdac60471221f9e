//! `/v1/sandboxes` and `/v1/sandboxes/{id}`.

use std::sync::Arc;

use hyper::{Response, StatusCode};

use crate::api;
use crate::daemon::response::{self, ApiError, Body};
use crate::service::Service;

pub async fn create(
    svc: &Arc<Service>,
    req: api::CreateSandboxRequest,
    caller_uid: Option<u32>,
) -> Result<Response<Body>, ApiError> {
    let sbx = svc.create_sandbox(req, caller_uid).await?;
    Ok(response::json(StatusCode::CREATED, &sbx))
}

pub fn list(svc: &Service) -> Result<Response<Body>, ApiError> {
    Ok(response::json(StatusCode::OK, &svc.list_sandboxes()?))
}

pub fn get(svc: &Service, id: &str) -> Result<Response<Body>, ApiError> {
    Ok(response::json(StatusCode::OK, &svc.get_sandbox(id)?))
}

pub async fn delete(svc: &Arc<Service>, id: &str) -> Result<Response<Body>, ApiError> {
    let sbx = svc.remove_sandbox(id).await?;
    Ok(response::json(StatusCode::OK, &sbx))
}
