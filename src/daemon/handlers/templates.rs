//! `GET /v1/templates`.

use hyper::{Response, StatusCode};

use crate::daemon::response::{self, ApiError, Body};
use crate::service::Service;

pub fn list(svc: &Service) -> Result<Response<Body>, ApiError> {
    Ok(response::json(StatusCode::OK, &svc.list_templates()?))
}
