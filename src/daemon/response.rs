//! HTTP responses: JSON bodies, streamed NDJSON bodies, and the JSON error envelope.

use std::convert::Infallible;

use bytes::Bytes;
use http_body_util::{BodyExt, Full, StreamBody, combinators::BoxBody};
use hyper::body::Frame;
use hyper::{Response, StatusCode, header};
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;

use super::router::StreamFormat;
use crate::api;
use crate::service::ServiceError;

pub type Body = BoxBody<Bytes, Infallible>;

/// An API error: status + stable code + human message.
#[derive(Debug)]
pub struct ApiError {
    pub status: StatusCode,
    pub code: &'static str,
    pub message: String,
}

impl ApiError {
    pub fn new(status: StatusCode, code: &'static str, message: impl Into<String>) -> Self {
        ApiError {
            status,
            code,
            message: message.into(),
        }
    }
    pub fn bad_request(m: impl Into<String>) -> Self {
        Self::new(StatusCode::BAD_REQUEST, "bad_request", m)
    }
    pub fn not_found(m: impl Into<String>) -> Self {
        Self::new(StatusCode::NOT_FOUND, "not_found", m)
    }
    pub fn unauthorized(m: impl Into<String>) -> Self {
        Self::new(StatusCode::UNAUTHORIZED, "unauthorized", m)
    }
    pub fn forbidden(m: impl Into<String>) -> Self {
        Self::new(StatusCode::FORBIDDEN, "forbidden", m)
    }
    pub fn method_not_allowed(m: &hyper::Method) -> Self {
        Self::new(
            StatusCode::METHOD_NOT_ALLOWED,
            "method_not_allowed",
            format!("method {m} is not allowed here"),
        )
    }

    pub fn into_response(self) -> Response<Body> {
        let body = api::ErrorBody {
            error: api::ErrorDetail {
                code: self.code.to_owned(),
                message: self.message,
            },
        };
        json(self.status, &body)
    }
}

impl From<ServiceError> for ApiError {
    fn from(e: ServiceError) -> Self {
        let (status, code) = match &e {
            ServiceError::NotFound(_) => (StatusCode::NOT_FOUND, "not_found"),
            ServiceError::BadRequest(_) => (StatusCode::BAD_REQUEST, "bad_request"),
            ServiceError::Unprocessable(_) => (StatusCode::UNPROCESSABLE_ENTITY, "unprocessable"),
            ServiceError::Conflict(_) => (StatusCode::CONFLICT, "conflict"),
            ServiceError::NoWorkspace(_) => (StatusCode::CONFLICT, "no_workspace"),
            ServiceError::PortNotOpen(_) => (StatusCode::BAD_GATEWAY, "port_not_open"),
            ServiceError::Forbidden(_) => (StatusCode::FORBIDDEN, "forbidden"),
            ServiceError::Unavailable(_) => (StatusCode::SERVICE_UNAVAILABLE, "unavailable"),
            ServiceError::Busy(_) => (StatusCode::TOO_MANY_REQUESTS, "host_full"),
            ServiceError::NoSpace(_) => (StatusCode::INSUFFICIENT_STORAGE, "no_space"),
            ServiceError::Internal(_) => (StatusCode::INTERNAL_SERVER_ERROR, "internal"),
        };
        ApiError::new(status, code, e.to_string())
    }
}

pub fn json<T: serde::Serialize>(status: StatusCode, value: &T) -> Response<Body> {
    let mut bytes = serde_json::to_vec(value).expect("API types serialize to JSON");
    bytes.push(b'\n');
    Response::builder()
        .status(status)
        .header(header::CONTENT_TYPE, "application/json")
        .body(Full::new(Bytes::from(bytes)).boxed())
        .expect("valid response")
}

pub fn text(content_type: &'static str, body: &'static str) -> Response<Body> {
    Response::builder()
        .header(header::CONTENT_TYPE, content_type)
        .body(Full::new(Bytes::from_static(body.as_bytes())).boxed())
        .expect("valid response")
}

/// A streamed body (NDJSON lines or server-sent events), sent as the receiver yields them.
pub fn stream(rx: mpsc::Receiver<Bytes>, format: StreamFormat) -> Response<Body> {
    use futures_util::StreamExt as _;
    let stream = ReceiverStream::new(rx).map(|b| Ok::<_, Infallible>(Frame::data(b)));
    let content_type = match format {
        StreamFormat::Ndjson => "application/x-ndjson",
        StreamFormat::Sse => "text/event-stream",
    };
    Response::builder()
        .header(header::CONTENT_TYPE, content_type)
        .header(header::CACHE_CONTROL, "no-store")
        .body(BodyExt::boxed(StreamBody::new(stream)))
        .expect("valid response")
}
