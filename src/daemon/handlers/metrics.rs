//! `GET /metrics`: the Prometheus text exposition (format 0.0.4).

use std::sync::Arc;

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::{Response, header};

use crate::daemon::response::{ApiError, Body};
use crate::service::Service;
use crate::telemetry::metrics::CONTENT_TYPE;

pub fn metrics(svc: &Arc<Service>) -> Result<Response<Body>, ApiError> {
    let text = svc.metrics_text()?;
    Ok(Response::builder()
        .header(header::CONTENT_TYPE, CONTENT_TYPE)
        .header(header::CACHE_CONTROL, "no-store")
        .body(Full::new(Bytes::from(text)).boxed())
        .expect("valid response"))
}
