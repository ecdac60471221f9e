//! Git repository grants in the service layer (`tryboxi git allow|ls|deny`,
//! `/v1/sandboxes/{id}/git`): which repositories a sandbox's git may reach with which token
//! secret and which branches it may push, kept in the `git_grants` table and published in
//! the sandbox's [`crate::secrets::Snapshot::git`] for the egress interceptor.
//!
//! A grant is checked when made: the repository normalised (`HOST/OWNER/REPO`), the push
//! patterns well-formed, the token secret stored and given to the sandbox. Grants live as long
//! as the sandbox; a fork child inherits its parent's.

use serde::{Deserialize, Serialize};

use super::{Service, ServiceError};
use crate::api;
use crate::secrets::GitGrant;
use crate::secrets::git::{refs, repo};
use crate::store::GIT_GRANTS;

/// At most this many repositories per sandbox.
pub const MAX_GRANTS: usize = 64;
/// At most this many push patterns per grant.
pub const MAX_PATTERNS: usize = 32;

/// What the store keeps per sandbox.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct GrantsRecord {
    pub grants: Vec<GrantRecord>,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct GrantRecord {
    pub repo: String,
    pub push: Vec<String>,
    pub token_secret: String,
}

fn bad(m: impl Into<String>) -> ServiceError {
    ServiceError::BadRequest(m.into())
}

impl Service {
    fn grants_record(&self, id: &str) -> Result<GrantsRecord, ServiceError> {
        Ok(self
            .store
            .get::<GrantsRecord>(GIT_GRANTS, id)?
            .unwrap_or_default())
    }

    fn grant_list(&self, id: &str, rec: GrantsRecord) -> api::GitGrantList {
        api::GitGrantList {
            sandbox_id: id.to_owned(),
            grants: rec
                .grants
                .into_iter()
                .map(|g| api::GitGrantInfo {
                    repo: g.repo,
                    push: g.push,
                    token_secret: g.token_secret,
                })
                .collect(),
        }
    }

    /// `GET /v1/sandboxes/{id}/git`.
    pub fn list_git(&self, id: &str) -> Result<api::GitGrantList, ServiceError> {
        self.record(id)?;
        Ok(self.grant_list(id, self.grants_record(id)?))
    }

    /// `POST /v1/sandboxes/{id}/git`: add or replace the grant of one repository; takes effect
    /// at the sandbox's next request (no restart).
    pub fn allow_git(
        &self,
        id: &str,
        req: api::GitAllowRequest,
    ) -> Result<api::GitGrantList, ServiceError> {
        self.record(id)?;
        let repo = repo::normalize_grant(&req.repo).map_err(bad)?;
        if req.push.len() > MAX_PATTERNS {
            return Err(bad(format!(
                "a grant takes at most {MAX_PATTERNS} push patterns, got {}",
                req.push.len()
            )));
        }
        let mut push: Vec<String> = Vec::new();
        for p in req.push {
            refs::validate_pattern(&p).map_err(|e| bad(e.to_string()))?;
            if !push.contains(&p) {
                push.push(p);
            }
        }
        let name = req.token_secret;
        crate::secrets::store::check_name(&name).map_err(|e| bad(e.to_string()))?;
        self.check_secret_names(std::slice::from_ref(&name))?;
        if !self.secret_env(id).iter().any(|(n, _)| *n == name) {
            return Err(bad(format!(
                "the sandbox does not hold the secret `{name}`: give it first with \
                 `tryboxi create --secret {name}` (or POST /v1/sandboxes/{id}/secrets)"
            )));
        }
        let mut rec = self.grants_record(id)?;
        rec.grants.retain(|g| g.repo != repo);
        if rec.grants.len() >= MAX_GRANTS {
            return Err(ServiceError::Conflict(format!(
                "the sandbox has {MAX_GRANTS} repository grants already"
            )));
        }
        rec.grants.push(GrantRecord {
            repo: repo.clone(),
            push: push.clone(),
            token_secret: name.clone(),
        });
        self.store.put(GIT_GRANTS, id, &rec)?;
        tracing::info!(sandbox = %id, repo = %repo, patterns = push.len(), secret = %name, "git repository granted");
        self.telemetry.events.publish(
            "sandbox.git_allowed",
            id,
            None,
            serde_json::json!({"repo": repo, "push": push, "token_secret": name}),
        );
        self.publish_secrets(id);
        Ok(self.grant_list(id, rec))
    }

    /// `DELETE /v1/sandboxes/{id}/git?repo=HOST/OWNER/REPO`: drop a grant (404 if none).
    pub fn deny_git(&self, id: &str, repo: &str) -> Result<api::GitGrantList, ServiceError> {
        self.record(id)?;
        let repo = repo::normalize_grant(repo).map_err(bad)?;
        let mut rec = self.grants_record(id)?;
        let before = rec.grants.len();
        rec.grants.retain(|g| g.repo != repo);
        if rec.grants.len() == before {
            return Err(ServiceError::NotFound(format!(
                "sandbox {id} has no grant for {repo}"
            )));
        }
        self.store.put(GIT_GRANTS, id, &rec)?;
        tracing::info!(sandbox = %id, repo = %repo, "git repository grant removed");
        self.telemetry.events.publish(
            "sandbox.git_denied",
            id,
            None,
            serde_json::json!({"repo": repo}),
        );
        self.publish_secrets(id);
        Ok(self.grant_list(id, rec))
    }

    /// The grants published in sandbox `id`'s snapshot.
    pub(super) fn git_grants(&self, id: &str) -> Vec<GitGrant> {
        match self.grants_record(id) {
            Ok(rec) => rec
                .grants
                .into_iter()
                .map(|g| GitGrant {
                    repo: g.repo,
                    push: g.push,
                    token_secret: g.token_secret,
                })
                .collect(),
            Err(e) => {
                tracing::warn!(sandbox = %id, error = %e, "cannot read the sandbox's git grants");
                Vec::new()
            }
        }
    }

    /// A fork child starts with its parent's grants (published with its secrets).
    pub(super) fn fork_git(&self, parent: &str, child: &str) -> Result<(), ServiceError> {
        let rec = self.grants_record(parent)?;
        if !rec.grants.is_empty() {
            self.store.put(GIT_GRANTS, child, &rec)?;
        }
        Ok(())
    }

    /// A removed sandbox: drop its grants.
    pub(super) fn forget_git(&self, id: &str) {
        let _ = self.store.delete(GIT_GRANTS, id);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::secrets::Value;

    fn set(svc: &Service, name: &str) {
        let spec = crate::secrets::store::SecretSpec {
            hosts: vec!["github.com".into()],
            headers: vec![],
            in_body: false,
        };
        svc.secret_store
            .set(name, Value::new(b"ghs_tok_0123456789".to_vec()), spec)
            .unwrap();
    }

    #[test]
    fn grants_are_checked_published_inherited_and_dropped() {
        let d = tempfile::tempdir().unwrap();
        let svc = super::super::test_service(d.path(), crate::config::Config::default());
        let id = super::super::test_sandbox(&svc, d.path());
        set(&svc, "GH");
        set(&svc, "OTHER");
        svc.init_secrets(&id, &["GH".into()]).unwrap();
        let allow = |repo: &str, push: &[&str], secret: &str| {
            svc.allow_git(
                &id,
                api::GitAllowRequest {
                    repo: repo.into(),
                    push: push.iter().map(|p| p.to_string()).collect(),
                    token_secret: secret.into(),
                },
            )
        };
        // Token secret not stored, or stored but not given to the sandbox: a clear 400.
        let e = allow("github.com/o/r", &[], "NOPE").unwrap_err();
        assert!(matches!(e, ServiceError::BadRequest(_)), "{e}");
        let e = allow("github.com/o/r", &[], "OTHER").unwrap_err();
        assert!(
            matches!(&e, ServiceError::BadRequest(m) if m.contains("does not hold")),
            "{e}"
        );
        assert!(matches!(
            allow("github.com/o", &[], "GH").unwrap_err(),
            ServiceError::BadRequest(_)
        ));
        assert!(matches!(
            allow("github.com/o/r", &["agent/../main"], "GH").unwrap_err(),
            ServiceError::BadRequest(_)
        ));
        let l = allow(
            "https://GitHub.com/O/R.git",
            &["agent/*", "!agent/main"],
            "GH",
        )
        .unwrap();
        assert_eq!(l.grants.len(), 1);
        assert_eq!(l.grants[0].repo, "github.com/o/r");
        // Allowing again replaces the grant.
        let l = allow("github.com/o/r", &["agent/*"], "GH").unwrap();
        assert_eq!(l.grants.len(), 1);
        assert_eq!(l.grants[0].push, ["agent/*"]);
        allow("github.com/o/ro", &[], "GH").unwrap();
        let snap = svc.secrets.for_sandbox(&id).current();
        assert_eq!(snap.git.len(), 2);
        assert_eq!(snap.git[0].repo, "github.com/o/r");
        assert!(snap.intercepted_hosts().contains(&"github.com".to_string()));
        // Republishing the secrets (value change, daemon start) keeps the grants.
        set(&svc, "GH");
        svc.publish_all_secrets();
        assert_eq!(svc.secrets.for_sandbox(&id).current().git.len(), 2);
        // A fork child inherits them.
        let child = crate::ids::new_id(crate::ids::SANDBOX);
        svc.fork_secrets(&id, &child).unwrap();
        assert_eq!(svc.secrets.for_sandbox(&child).current().git.len(), 2);
        // Deny removes one; an unknown one is a 404.
        let l = svc.deny_git(&id, "github.com/o/ro.git").unwrap();
        assert_eq!(l.grants.len(), 1);
        assert!(matches!(
            svc.deny_git(&id, "github.com/o/ro").unwrap_err(),
            ServiceError::NotFound(_)
        ));
        assert_eq!(svc.list_git(&id).unwrap().grants.len(), 1);
        assert_eq!(svc.secrets.for_sandbox(&id).current().git.len(), 1);
        // Dropped with the sandbox.
        svc.forget_secrets(&child);
        assert!(svc.grants_record(&child).unwrap().grants.is_empty());
        assert!(svc.secrets.for_sandbox(&child).current().git.is_empty());
    }
}
