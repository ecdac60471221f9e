//! `/v1/sandboxes/{id}/git`: a sandbox's git repository grants (which repositories its git
//! reaches with which token secret, which branches it may push). No token value goes in or out.

use hyper::{Response, StatusCode};

use crate::api;
use crate::daemon::response::{self, ApiError, Body};
use crate::service::Service;

pub fn list(svc: &Service, id: &str) -> Result<Response<Body>, ApiError> {
    Ok(response::json(StatusCode::OK, &svc.list_git(id)?))
}

pub fn allow(
    svc: &Service,
    id: &str,
    req: api::GitAllowRequest,
) -> Result<Response<Body>, ApiError> {
    Ok(response::json(StatusCode::OK, &svc.allow_git(id, req)?))
}

pub fn deny(svc: &Service, id: &str, repo: &str) -> Result<Response<Body>, ApiError> {
    Ok(response::json(StatusCode::OK, &svc.deny_git(id, repo)?))
}
