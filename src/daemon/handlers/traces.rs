//! `GET /v1/traces/{id}`: a sandbox's or an exec's spans, by start time.

use std::sync::Arc;

use hyper::{Response, StatusCode};

use crate::daemon::response::{self, ApiError, Body};
use crate::service::Service;

pub fn trace(svc: &Arc<Service>, id: &str) -> Result<Response<Body>, ApiError> {
    Ok(response::json(StatusCode::OK, &svc.trace(id)?))
}
