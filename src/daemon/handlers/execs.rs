//! `GET /v1/execs/{id}/output`: a piece of an exec's output log from a byte offset.

use std::sync::Arc;

use hyper::{Response, StatusCode};

use crate::daemon::response::{self, ApiError, Body};
use crate::service::{OutputQuery, Service};

pub async fn output(
    svc: &Arc<Service>,
    id: &str,
    q: OutputQuery,
) -> Result<Response<Body>, ApiError> {
    Ok(response::json(
        StatusCode::OK,
        &svc.exec_output(id, q).await?,
    ))
}
