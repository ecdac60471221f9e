//! Sandbox use cases: create, list, get, remove.

use std::path::Path;

use super::{SandboxRecord, Service, ServiceError};
use crate::api;
use crate::store::SANDBOXES;

/// Current time as RFC 3339 UTC with seconds (`2026-12-02T10:00:00Z`).
pub fn now_rfc3339() -> String {
    let secs = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0);
    rfc3339(secs as i64)
}

/// `secs` since the epoch as RFC 3339 UTC with seconds (before 1970: the epoch).
pub fn rfc3339(secs: i64) -> String {
    let secs = secs.max(0);
    let (days, rem) = (secs / 86_400, secs % 86_400);
    let (y, m, d) = civil_from_days(days);
    format!(
        "{y:04}-{m:02}-{d:02}T{:02}:{:02}:{:02}Z",
        rem / 3600,
        (rem % 3600) / 60,
        rem % 60
    )
}

/// Days since 1970-01-01 to (year, month, day), proleptic Gregorian (H. Hinnant's algorithm).
fn civil_from_days(z: i64) -> (i64, u32, u32) {
    let z = z + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let y = yoe + era * 400;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = (doy - (153 * mp + 2) / 5 + 1) as u32;
    let m = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
    (if m <= 2 { y + 1 } else { y }, m, d)
}

impl Service {
    pub fn list_sandboxes(&self) -> Result<api::SandboxList, ServiceError> {
        let recs: Vec<SandboxRecord> = self.store.list(SANDBOXES)?;
        Ok(api::SandboxList {
            sandboxes: recs.into_iter().map(|r| r.api).collect(),
        })
    }

    pub fn get_sandbox(&self, id: &str) -> Result<api::Sandbox, ServiceError> {
        Ok(self.record(id)?.api)
    }

    pub(super) fn record(&self, id: &str) -> Result<SandboxRecord, ServiceError> {
        self.store
            .get(SANDBOXES, id)?
            .ok_or_else(|| ServiceError::NotFound(format!("no sandbox `{id}`")))
    }

    /// Validate a create request: the workspace, if any, must be an existing directory (absolute path)
    /// that may be a workspace (see [`super::wsguard`]; `caller_uid` is the unix-socket peer,
    /// `None` for a TCP client), and the resources within the configured limits. Resolving
    /// the path and reading the password database (which may ask LDAP/NSS) run off the async
    /// runtime.
    pub async fn validate_create(
        &self,
        req: &api::CreateSandboxRequest,
        caller_uid: Option<u32>,
    ) -> Result<(u32, u32, Option<std::path::PathBuf>), ServiceError> {
        let canon = match &req.workspace {
            None => None,
            Some(ws) => {
                let p = std::path::PathBuf::from(&ws.host_path);
                if !p.is_absolute() {
                    return Err(ServiceError::BadRequest(format!(
                        "workspace.host_path must be an absolute path, got `{}`",
                        ws.host_path
                    )));
                }
                let data_root = self.paths.root.clone();
                let c = tokio::task::spawn_blocking(move || {
                    check_workspace(&p, &data_root, caller_uid)
                })
                .await
                .map_err(|e| ServiceError::Internal(format!("workspace check failed: {e}")))??;
                Some(c)
            }
        };
        let vcpus = req.vcpus.unwrap_or(self.config.default_vcpus);
        let mem = req.memory_mib.unwrap_or(self.config.default_memory_mib);
        if vcpus == 0 || vcpus > self.config.max_vcpus {
            return Err(ServiceError::BadRequest(format!(
                "vcpus must be between 1 and {} (max_vcpus), got {vcpus}",
                self.config.max_vcpus
            )));
        }
        if !(128..=self.config.max_memory_mib).contains(&mem) {
            return Err(ServiceError::BadRequest(format!(
                "memory_mib must be between 128 and {} (max_memory_mib), got {mem}",
                self.config.max_memory_mib
            )));
        }
        Ok((vcpus, mem, canon))
    }
}

/// The workspace folder `p` resolved, if it is a directory that may be a workspace. Blocking.
fn check_workspace(
    p: &Path,
    data_root: &Path,
    caller_uid: Option<u32>,
) -> Result<std::path::PathBuf, ServiceError> {
    let canon = p.canonicalize().map_err(|e| {
        ServiceError::Unprocessable(format!("workspace `{}` cannot be used: {e}", p.display()))
    })?;
    if !canon.is_dir() {
        return Err(ServiceError::Unprocessable(format!(
            "workspace `{}` is not a directory",
            p.display()
        )));
    }
    let homes = super::wsguard::forbidden_homes(caller_uid);
    if let Some(why) = super::wsguard::refusal(&canon, data_root, &homes) {
        tracing::warn!(workspace = %canon.display(), caller_uid, "refused a workspace");
        return Err(ServiceError::Forbidden(why));
    }
    Ok(canon)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rfc3339_dates_are_right() {
        assert_eq!(civil_from_days(0), (1970, 1, 1));
        assert_eq!(civil_from_days(20_424), (2025, 12, 2));
        assert_eq!(civil_from_days(11_016), (2000, 2, 29));
        assert_eq!(now_rfc3339().len(), 20);
    }
}
