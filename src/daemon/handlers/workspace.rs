//! Workspace routes: sync, diff, apply, pull, undo, and single files inside a VM.

use std::sync::Arc;

use hyper::{Response, StatusCode};

use crate::api;
use crate::daemon::response::{self, ApiError, Body};
use crate::service::Service;

pub async fn sync(
    svc: &Arc<Service>,
    id: &str,
    req: api::SyncRequest,
) -> Result<Response<Body>, ApiError> {
    Ok(response::json(
        StatusCode::OK,
        &svc.sync_workspace(id, req).await?,
    ))
}

pub async fn diff(
    svc: &Arc<Service>,
    id: &str,
    stat: bool,
    paths: Vec<String>,
) -> Result<Response<Body>, ApiError> {
    Ok(response::json(
        StatusCode::OK,
        &svc.diff(id, stat, paths).await?,
    ))
}

pub async fn apply(
    svc: &Arc<Service>,
    id: &str,
    req: api::ApplyRequest,
) -> Result<Response<Body>, ApiError> {
    Ok(response::json(StatusCode::OK, &svc.apply(id, req).await?))
}

pub async fn pull(
    svc: &Arc<Service>,
    id: &str,
    req: api::ApplyRequest,
) -> Result<Response<Body>, ApiError> {
    Ok(response::json(StatusCode::OK, &svc.pull(id, req).await?))
}

pub async fn undo(
    svc: &Arc<Service>,
    art: &str,
    req: api::UndoRequest,
) -> Result<Response<Body>, ApiError> {
    Ok(response::json(StatusCode::OK, &svc.undo(art, req).await?))
}

pub async fn read_file(
    svc: &Arc<Service>,
    id: &str,
    path: &str,
) -> Result<Response<Body>, ApiError> {
    Ok(response::json(
        StatusCode::OK,
        &svc.read_vm_file(id, path).await?,
    ))
}

pub async fn write_file(
    svc: &Arc<Service>,
    id: &str,
    path: &str,
    body: api::FileContent,
) -> Result<Response<Body>, ApiError> {
    Ok(response::json(
        StatusCode::OK,
        &svc.write_vm_file(id, path, body).await?,
    ))
}
