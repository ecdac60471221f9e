//! Exec use case: run a command in a sandbox's VM and stream its events.

use tokio::sync::mpsc;

use super::{Service, ServiceError};
use crate::api;

impl Service {
    /// Start a command; events (output, then the exit status or an error) arrive on the receiver.
    pub async fn start_exec(
        &self,
        id: &str,
        req: api::ExecRequest,
    ) -> Result<mpsc::Receiver<api::ExecEvent>, ServiceError> {
        let rec = self.record(id)?;
        validate_exec(&req)?;
        Err(ServiceError::Conflict(format!(
            "sandbox `{}` is {}, not ready",
            id, rec.api.state
        )))
    }
}

pub(super) fn validate_exec(req: &api::ExecRequest) -> Result<(), ServiceError> {
    match (&req.cmd, &req.argv) {
        (Some(_), Some(_)) => Err(ServiceError::BadRequest(
            "give either `cmd` or `argv`, not both".into(),
        )),
        (None, None) => Err(ServiceError::BadRequest(
            "give `cmd` (a shell string) or `argv`".into(),
        )),
        (None, Some(a)) if a.is_empty() => Err(ServiceError::BadRequest("`argv` is empty".into())),
        (Some(c), None) if c.trim().is_empty() => {
            Err(ServiceError::BadRequest("`cmd` is empty".into()))
        }
        _ => match req.timeout_s {
            Some(t) if !(t > 0.0 && t.is_finite()) => Err(ServiceError::BadRequest(format!(
                "timeout_s must be a positive number, got {t}"
            ))),
            _ => Ok(()),
        },
    }
}
