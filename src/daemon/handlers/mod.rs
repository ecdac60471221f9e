//! One handler file per resource. Each turns an [`Action`] into a response by calling the
//! service; none holds business logic.

mod events;
mod exec;
mod execs;
mod gc;
mod git;
mod health;
mod lifecycle;
mod metrics;
mod network;
mod ports;
mod sandboxes;
mod secrets;
mod snapshots;
mod templates;
mod traces;
mod workspace;

use std::sync::Arc;

use hyper::Response;

use super::response::{ApiError, Body};
use super::router::Action;
use crate::service::Service;

#[cfg(test)]
pub use health::OPENAPI_YAML;

/// `caller_uid`: the unix-socket peer's uid (`None` over TCP), for the checks that depend on
/// who asks (a workspace may not be the caller's home folder).
pub async fn handle(
    svc: &Arc<Service>,
    action: Action,
    caller_uid: Option<u32>,
) -> Result<Response<Body>, ApiError> {
    match action {
        Action::Health => health::health(svc),
        Action::OpenApi => Ok(health::openapi()),
        Action::CreateSandbox(req) => sandboxes::create(svc, req, caller_uid).await,
        Action::ListSandboxes => sandboxes::list(svc),
        Action::GetSandbox(id) => sandboxes::get(svc, &id),
        Action::DeleteSandbox(id) => sandboxes::delete(svc, &id).await,
        Action::Exec(id, req, format) => exec::exec(svc, &id, req, format).await,
        Action::CreateSnapshot(id, req) => snapshots::create(svc, &id, req).await,
        Action::ListSnapshots(id) => snapshots::list(svc, &id),
        Action::DeleteSnapshot(id, snap) => snapshots::delete(svc, &id, &snap).await,
        Action::Restore(id, req) => snapshots::restore(svc, &id, req).await,
        Action::Fork(id, req) => lifecycle::fork(svc, &id, req).await,
        Action::Pause(id, req) => lifecycle::pause(svc, &id, req).await,
        Action::Resume(id, req) => lifecycle::resume(svc, &id, req).await,
        Action::Events { since, sandbox } => events::events(svc, since, sandbox),
        Action::Metrics => metrics::metrics(svc),
        Action::Trace(id) => traces::trace(svc, &id),
        Action::ExecOutput(id, q) => execs::output(svc, &id, q).await,
        Action::ListExecs(id) => execs::list(svc, &id),
        Action::GetExec(id) => execs::get(svc, &id),
        Action::AttachExec(id, req, format) => execs::attach(svc, &id, req, format).await,
        Action::ExecStdin(id, req) => execs::stdin(svc, &id, req).await,
        Action::SignalExec(id, req) => execs::signal(svc, &id, req).await,
        Action::ResizeExec(id, req) => execs::resize(svc, &id, req).await,
        Action::Sync(id, req) => workspace::sync(svc, &id, req).await,
        Action::Diff { id, stat, paths } => workspace::diff(svc, &id, stat, paths).await,
        Action::Apply(id, req) => workspace::apply(svc, &id, req).await,
        Action::Pull(id, req) => workspace::pull(svc, &id, req).await,
        Action::Undo(art, req) => workspace::undo(svc, &art, req).await,
        Action::ReadFile { id, path } => workspace::read_file(svc, &id, &path).await,
        Action::WriteFile { id, path, body } => workspace::write_file(svc, &id, &path, body).await,
        Action::SetSecret(name, req) => secrets::set(svc, &name, req).await,
        Action::ListSecrets => secrets::list(svc),
        Action::RemoveSecret(name) => secrets::remove(svc, &name),
        Action::AddSandboxSecret(id, req) => secrets::add_to_sandbox(svc, &id, req),
        Action::ListGit(id) => git::list(svc, &id),
        Action::AllowGit(id, req) => git::allow(svc, &id, req),
        Action::DenyGit { id, repo } => git::deny(svc, &id, &repo),
        Action::ListPorts(id) => ports::list(svc, &id),
        Action::ExposePort(id, req) => ports::expose(svc, &id, req).await,
        Action::UnexposePort(id, port) => ports::unexpose(svc, &id, port).await,
        Action::ListTemplates => templates::list(svc),
        Action::Gc(req) => gc::gc(svc, req).await,
        Action::GetNetwork(id) => network::get(svc, &id),
        Action::ChangeNetwork(id, req) => network::change(svc, &id, req).await,
        Action::NetworkSetup(id, req) => network::setup(svc, &id, req).await,
        Action::RequestAccess(id, req) => network::request(svc, &id, req).await,
        Action::ListAccessRequests(id) => network::requests(svc, &id),
        Action::DecideAccess {
            id,
            request,
            approve,
            face,
        } => network::decide(svc, &id, &request, approve, face.as_deref()).await,
    }
}
