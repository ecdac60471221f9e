//! `GET /v1/health` and `GET /v1/openapi.yaml`.

use hyper::{Response, StatusCode};

use crate::daemon::response::{self, ApiError, Body};
use crate::service::Service;

/// The HTTP contract, checked in at `api/openapi.yaml` and tested against the server.
pub const OPENAPI_YAML: &str = include_str!("../../../api/openapi.yaml");

pub fn health(svc: &Service) -> Result<Response<Body>, ApiError> {
    Ok(response::json(StatusCode::OK, &svc.health()?))
}

pub fn openapi() -> Response<Body> {
    response::text("application/yaml", OPENAPI_YAML)
}
