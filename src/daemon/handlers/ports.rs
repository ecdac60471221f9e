//! `/v1/sandboxes/{id}/ports`: guest ports forwarded from host loopback ports.

use std::sync::Arc;

use hyper::{Response, StatusCode};

use crate::api;
use crate::daemon::response::{self, ApiError, Body};
use crate::service::Service;

pub fn list(svc: &Service, id: &str) -> Result<Response<Body>, ApiError> {
    Ok(response::json(StatusCode::OK, &svc.list_ports(id)?))
}

pub async fn expose(
    svc: &Arc<Service>,
    id: &str,
    req: api::ExposePortRequest,
) -> Result<Response<Body>, ApiError> {
    Ok(response::json(
        StatusCode::CREATED,
        &svc.expose_port(id, req).await?,
    ))
}

pub async fn unexpose(svc: &Service, id: &str, port: u16) -> Result<Response<Body>, ApiError> {
    Ok(response::json(
        StatusCode::OK,
        &svc.unexpose_port(id, port).await?,
    ))
}
