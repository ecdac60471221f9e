//! `POST /v1/gc`.

use hyper::{Response, StatusCode};

use crate::api;
use crate::daemon::response::{self, ApiError, Body};
use crate::service::Service;

pub async fn gc(svc: &Service, req: api::GcRequest) -> Result<Response<Body>, ApiError> {
    Ok(response::json(StatusCode::OK, &svc.gc(req).await?))
}
