//! `/v1/secrets...` and `/v1/sandboxes/{id}/secrets`: the secret store and the secrets a
//! sandbox holds. A value comes in only in the body of a set and goes out in no response.

use hyper::{Response, StatusCode};

use crate::api;
use crate::daemon::response::{self, ApiError, Body};
use crate::service::Service;

pub async fn set(
    svc: &Service,
    name: &str,
    req: api::SetSecretRequest,
) -> Result<Response<Body>, ApiError> {
    Ok(response::json(
        StatusCode::OK,
        &svc.set_secret(name, req).await?,
    ))
}

pub fn list(svc: &Service) -> Result<Response<Body>, ApiError> {
    Ok(response::json(StatusCode::OK, &svc.list_secrets()?))
}

pub fn remove(svc: &Service, name: &str) -> Result<Response<Body>, ApiError> {
    Ok(response::json(StatusCode::OK, &svc.remove_secret(name)?))
}

pub fn add_to_sandbox(
    svc: &Service,
    id: &str,
    req: api::AddSandboxSecret,
) -> Result<Response<Body>, ApiError> {
    Ok(response::json(
        StatusCode::OK,
        &svc.add_sandbox_secret(id, req)?,
    ))
}
