//! `/v1/sandboxes/{id}/snapshots[/{snapshot}]` and `/v1/sandboxes/{id}/restore`.

use std::sync::Arc;

use hyper::{Response, StatusCode};

use crate::api;
use crate::daemon::response::{self, ApiError, Body};
use crate::service::Service;

pub async fn create(
    svc: &Arc<Service>,
    id: &str,
    req: api::SnapshotRequest,
) -> Result<Response<Body>, ApiError> {
    Ok(response::json(
        StatusCode::CREATED,
        &svc.create_snapshot(id, req).await?,
    ))
}

pub fn list(svc: &Service, id: &str) -> Result<Response<Body>, ApiError> {
    Ok(response::json(StatusCode::OK, &svc.list_snapshots(id)?))
}

pub async fn delete(svc: &Arc<Service>, id: &str, snap: &str) -> Result<Response<Body>, ApiError> {
    Ok(response::json(
        StatusCode::OK,
        &svc.delete_snapshot(id, snap).await?,
    ))
}

pub async fn restore(
    svc: &Arc<Service>,
    id: &str,
    req: api::RestoreRequest,
) -> Result<Response<Body>, ApiError> {
    Ok(response::json(
        StatusCode::OK,
        &svc.restore_snapshot(id, req).await?,
    ))
}
