//! `/v1/sandboxes/{id}/network...`: the egress policy, the setup phase and access requests.

use std::sync::Arc;

use hyper::{Response, StatusCode};

use crate::api;
use crate::daemon::response::{self, ApiError, Body};
use crate::service::Service;

pub fn get(svc: &Service, id: &str) -> Result<Response<Body>, ApiError> {
    Ok(response::json(StatusCode::OK, &svc.get_network(id)?))
}

pub async fn change(
    svc: &Service,
    id: &str,
    req: api::NetworkRuleChange,
) -> Result<Response<Body>, ApiError> {
    Ok(response::json(
        StatusCode::OK,
        &svc.change_network(id, req).await?,
    ))
}

pub async fn setup(
    svc: &Arc<Service>,
    id: &str,
    req: api::NetworkSetupRequest,
) -> Result<Response<Body>, ApiError> {
    Ok(response::json(
        StatusCode::OK,
        &svc.network_setup(id, req).await?,
    ))
}

pub async fn request(
    svc: &Service,
    id: &str,
    req: api::AccessRequestCreate,
) -> Result<Response<Body>, ApiError> {
    Ok(response::json(
        StatusCode::CREATED,
        &svc.request_access(id, req).await?,
    ))
}

pub fn requests(svc: &Service, id: &str) -> Result<Response<Body>, ApiError> {
    Ok(response::json(
        StatusCode::OK,
        &svc.list_access_requests(id)?,
    ))
}

pub async fn decide(
    svc: &Service,
    id: &str,
    request: &str,
    approve: bool,
    face: Option<&str>,
) -> Result<Response<Body>, ApiError> {
    Ok(response::json(
        StatusCode::OK,
        &svc.decide_access(id, request, approve, face).await?,
    ))
}
