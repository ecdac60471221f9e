//! Secrets in the service layer: the store's API (`/v1/secrets`), which secrets each sandbox
//! holds and its placeholder for each (the `secret_bindings` table), the `NAME=<placeholder>`
//! env of every exec, the [`crate::secrets::Snapshot`] published for the egress interceptor,
//! and the inbound refusal of anything holding a stored value.
//!
//! Bindings live as long as the sandbox: pause/resume and restoring its own checkpoint keep
//! them (its processes hold the placeholders); a fork child and every new sandbox (also one
//! cloned from a golden snapshot or taken from the warm pool) mint fresh placeholders.

use serde::{Deserialize, Serialize};

use std::path::{Path, PathBuf};
use std::sync::Arc;

use super::{SandboxRecord, Service, ServiceError};
use crate::api;
use crate::secrets::scan::Scanner;
use crate::secrets::store::{SecretMeta, SecretSpec, SecretStoreError};
use crate::secrets::{Binding, Snapshot, Value, placeholder};
use crate::store::{SANDBOXES, SECRET_BINDINGS};

/// At most this many secrets per sandbox.
pub const MAX_SANDBOX_SECRETS: usize = 64;

/// What the store keeps per sandbox (names and placeholders; values live in `secrets.json`).
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct BindingsRecord {
    pub bindings: Vec<BoundSecret>,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct BoundSecret {
    pub name: String,
    pub placeholder: String,
}

impl From<SecretStoreError> for ServiceError {
    fn from(e: SecretStoreError) -> Self {
        match e {
            SecretStoreError::BadName(_) | SecretStoreError::Invalid { .. } => {
                ServiceError::BadRequest(e.to_string())
            }
            SecretStoreError::NotFound(_) => ServiceError::NotFound(e.to_string()),
            SecretStoreError::Full => ServiceError::Conflict(e.to_string()),
            SecretStoreError::Write { .. }
                if crate::diskspace::mentions_no_space(&e.to_string()) =>
            {
                ServiceError::NoSpace(e.to_string())
            }
            _ => ServiceError::Internal(e.to_string()),
        }
    }
}

fn info(m: SecretMeta) -> api::SecretInfo {
    api::SecretInfo {
        name: m.name,
        hosts: m.hosts,
        headers: m.headers,
        in_body: m.in_body,
        created_at: m.created_at,
        last_used_at: m.last_used_at,
        already_synced_to: Vec::new(),
    }
}

/// Whether any file under `dir` (a sandbox's sync base: manifest, blobs, packs) holds what
/// `scanner` looks for. Read in 1 MiB chunks; symlinks are not followed.
fn dir_holds(dir: &Path, scanner: &Scanner) -> bool {
    use std::io::Read as _;
    let Ok(rd) = std::fs::read_dir(dir) else {
        return false;
    };
    for e in rd.flatten() {
        let Ok(ft) = e.file_type() else { continue };
        let p = e.path();
        if ft.is_dir() {
            if dir_holds(&p, scanner) {
                return true;
            }
        } else if ft.is_file() {
            let Ok(mut f) = std::fs::File::open(&p) else {
                continue;
            };
            let mut st = scanner.stream();
            let mut buf = vec![0u8; 1 << 20];
            loop {
                match f.read(&mut buf) {
                    Ok(0) | Err(_) => break,
                    Ok(n) => {
                        if st.feed(&buf[..n]).is_some() {
                            return true;
                        }
                    }
                }
            }
        }
    }
    false
}

fn minted() -> Result<String, ServiceError> {
    placeholder::mint().map_err(|e| ServiceError::Internal(e.to_string()))
}

impl Service {
    /// `PUT /v1/secrets/{name}`: add or replace a secret; sandboxes holding it see the new
    /// value at their next request (their placeholder stays). The answer names the sandboxes
    /// whose sync base already holds the value (synced before it was stored).
    pub async fn set_secret(
        &self,
        name: &str,
        req: api::SetSecretRequest,
    ) -> Result<api::SecretInfo, ServiceError> {
        let value = Value::new(req.value.0.as_bytes().to_vec());
        let mut out = self.store_secret(name, value.clone(), req)?;
        let scanner = Arc::new(Scanner::new(&[(name.to_owned(), value)]));
        if scanner.is_empty() {
            return Ok(out);
        }
        let bases: Vec<(String, PathBuf)> = self
            .store
            .list::<SandboxRecord>(SANDBOXES)?
            .into_iter()
            .map(|r| (r.api.id, r.dir.join("workspace")))
            .collect();
        let held = tokio::task::spawn_blocking(move || {
            bases
                .into_iter()
                .filter(|(_, dir)| dir_holds(dir, &scanner))
                .map(|(id, _)| id)
                .collect::<Vec<_>>()
        })
        .await
        .map_err(|e| ServiceError::Internal(format!("secret scan task failed: {e}")))?;
        for id in &held {
            tracing::warn!(secret = %name, sandbox = %id, "a sandbox's synced files already hold the secret's value");
        }
        out.already_synced_to = held;
        Ok(out)
    }

    pub(super) fn store_secret(
        &self,
        name: &str,
        value: Value,
        req: api::SetSecretRequest,
    ) -> Result<api::SecretInfo, ServiceError> {
        let meta = self.secret_store.set(
            name,
            value,
            SecretSpec {
                hosts: req.hosts,
                headers: req.headers,
                in_body: req.in_body,
            },
        )?;
        tracing::info!(secret = %name, hosts = meta.hosts.len(), "secret stored");
        self.telemetry
            .events
            .publish("secret.set", "", None, serde_json::json!({"name": name}));
        self.publish_holding(name);
        Ok(info(meta))
    }

    /// `GET /v1/secrets`: names, hosts, headers, dates; never a value.
    pub fn list_secrets(&self) -> Result<api::SecretList, ServiceError> {
        Ok(api::SecretList {
            secrets: self.secret_store.list()?.into_iter().map(info).collect(),
        })
    }

    /// `DELETE /v1/secrets/{name}`: forget it, and take it from every sandbox holding it
    /// (their placeholder stops working and leaves their next execs' env).
    pub fn remove_secret(&self, name: &str) -> Result<api::SecretInfo, ServiceError> {
        let meta = self.secret_store.remove(name)?;
        for (id, mut rec) in self.store.list_keyed::<BindingsRecord>(SECRET_BINDINGS)? {
            let before = rec.bindings.len();
            rec.bindings.retain(|b| b.name != name);
            if rec.bindings.len() != before {
                self.store.put(SECRET_BINDINGS, &id, &rec)?;
                self.publish_secrets(&id);
            }
        }
        tracing::info!(secret = %name, "secret removed");
        self.telemetry.events.publish(
            "secret.removed",
            "",
            None,
            serde_json::json!({"name": name}),
        );
        Ok(info(meta))
    }

    /// Every name is a stored secret (400 otherwise), at most [`MAX_SANDBOX_SECRETS`].
    pub(super) fn check_secret_names(&self, names: &[String]) -> Result<(), ServiceError> {
        if names.len() > MAX_SANDBOX_SECRETS {
            return Err(ServiceError::BadRequest(format!(
                "a sandbox holds at most {MAX_SANDBOX_SECRETS} secrets, got {}",
                names.len()
            )));
        }
        for n in names {
            crate::secrets::store::check_name(n)
                .map_err(|e| ServiceError::BadRequest(e.to_string()))?;
            if let Err(SecretStoreError::NotFound(_)) = self.secret_store.get(n) {
                return Err(ServiceError::BadRequest(format!(
                    "no stored secret `{n}`: add it first with `tryboxi secret set {n} --host HOST`"
                )));
            }
        }
        Ok(())
    }

    /// A new sandbox's secrets: fresh placeholders, recorded and published.
    pub(super) fn init_secrets(&self, id: &str, names: &[String]) -> Result<(), ServiceError> {
        let mut rec = BindingsRecord::default();
        for n in names {
            if rec.bindings.iter().any(|b| &b.name == n) {
                continue;
            }
            rec.bindings.push(BoundSecret {
                name: n.clone(),
                placeholder: minted()?,
            });
        }
        if !rec.bindings.is_empty() {
            self.store.put(SECRET_BINDINGS, id, &rec)?;
        }
        self.publish_secrets(id);
        Ok(())
    }

    /// A fork child holds its parent's secrets under fresh placeholders (the parent's do not
    /// work in the child).
    pub(super) fn fork_secrets(&self, parent: &str, child: &str) -> Result<(), ServiceError> {
        self.fork_git(parent, child)?;
        let names: Vec<String> = self
            .bindings(parent)?
            .bindings
            .into_iter()
            .map(|b| b.name)
            .collect();
        self.init_secrets(child, &names)
    }

    /// `POST /v1/sandboxes/{id}/secrets`: one more stored secret for a sandbox (paused or
    /// running: the next exec sees it, no restart). Giving one it holds keeps its placeholder.
    pub fn add_sandbox_secret(
        &self,
        id: &str,
        req: api::AddSandboxSecret,
    ) -> Result<api::SandboxSecrets, ServiceError> {
        self.record(id)?;
        let name = req.name;
        self.check_secret_names(std::slice::from_ref(&name))?;
        let mut rec = self.bindings(id)?;
        if !rec.bindings.iter().any(|b| b.name == name) {
            if rec.bindings.len() >= MAX_SANDBOX_SECRETS {
                return Err(ServiceError::Conflict(format!(
                    "the sandbox holds {MAX_SANDBOX_SECRETS} secrets already"
                )));
            }
            rec.bindings.push(BoundSecret {
                name: name.clone(),
                placeholder: minted()?,
            });
            self.store.put(SECRET_BINDINGS, id, &rec)?;
            tracing::info!(sandbox = %id, secret = %name, "secret given to the sandbox");
            self.telemetry.events.publish(
                "sandbox.secret_added",
                id,
                None,
                serde_json::json!({"name": name}),
            );
        }
        self.publish_secrets(id);
        Ok(api::SandboxSecrets {
            sandbox_id: id.to_owned(),
            secrets: rec
                .bindings
                .into_iter()
                .map(|b| api::SandboxSecret {
                    name: b.name,
                    placeholder: b.placeholder,
                })
                .collect(),
        })
    }

    fn bindings(&self, id: &str) -> Result<BindingsRecord, ServiceError> {
        Ok(self
            .store
            .get::<BindingsRecord>(SECRET_BINDINGS, id)?
            .unwrap_or_default())
    }

    /// A removed sandbox: drop its bindings and its published snapshot.
    pub(super) fn forget_secrets(&self, id: &str) {
        let _ = self.store.delete(SECRET_BINDINGS, id);
        self.forget_git(id);
        self.secrets.forget(id);
        self.guest_trust.forget(id);
    }

    /// Publish sandbox `id`'s current [`Snapshot`] (its bindings with today's values; a
    /// binding whose secret is gone is left out; its git grants).
    pub(super) fn publish_secrets(&self, id: &str) {
        let rec = match self.bindings(id) {
            Ok(r) => r,
            Err(e) => {
                tracing::warn!(sandbox = %id, error = %e, "cannot read the sandbox's secrets");
                BindingsRecord::default()
            }
        };
        let bindings = rec
            .bindings
            .into_iter()
            .filter_map(|b| {
                let (meta, value) = self.secret_store.get(&b.name).ok()?;
                Some(Binding {
                    name: b.name,
                    hosts: meta.hosts,
                    headers: meta.headers,
                    in_body: meta.in_body,
                    placeholder: b.placeholder,
                    value,
                })
            })
            .collect();
        self.secrets.for_sandbox(id).publish(Snapshot {
            bindings,
            git: self.git_grants(id),
        });
    }

    /// Republish every sandbox holding secret `name` (its value or hosts changed).
    fn publish_holding(&self, name: &str) {
        match self.store.list_keyed::<BindingsRecord>(SECRET_BINDINGS) {
            Ok(all) => {
                for (id, rec) in all {
                    if rec.bindings.iter().any(|b| b.name == name) {
                        self.publish_secrets(&id);
                    }
                }
            }
            Err(e) => tracing::warn!(error = %e, "cannot read the sandboxes' secrets"),
        }
    }

    /// Daemon start: publish every sandbox's snapshot.
    pub(super) fn publish_all_secrets(&self) {
        match self.store.list_keyed::<BindingsRecord>(SECRET_BINDINGS) {
            Ok(all) => {
                for (id, _) in all {
                    self.publish_secrets(&id);
                }
            }
            Err(e) => tracing::warn!(error = %e, "cannot read the sandboxes' secrets"),
        }
    }

    /// The env of sandbox `id`'s execs: `NAME=<placeholder>` per secret it holds.
    pub(super) fn secret_env(&self, id: &str) -> Vec<(String, String)> {
        self.secrets
            .for_sandbox(id)
            .current()
            .bindings
            .iter()
            .map(|b| (b.name.clone(), b.placeholder.clone()))
            .collect()
    }

    /// Refuse (403) when `bytes` holds a stored secret's value or an encoding of it; `what`
    /// says where (the error names the secret, never the value).
    pub(super) fn refuse_values(
        &self,
        id: &str,
        what: &str,
        bytes: &[u8],
    ) -> Result<(), ServiceError> {
        let scanner = self.secret_store.scanner();
        match scanner.find(bytes) {
            None => Ok(()),
            Some(name) => Err(self.refusal(id, what, name)),
        }
    }

    fn refusal(&self, id: &str, what: &str, name: &str) -> ServiceError {
        tracing::warn!(sandbox = %id, secret = %name, what, "refused: holds a stored secret's value");
        self.telemetry.events.publish(
            "secret.inbound_refused",
            id,
            None,
            serde_json::json!({"name": name, "where": what}),
        );
        ServiceError::Forbidden(format!(
            "refused: the {what} holds the value of the stored secret `{name}` (or an encoding \
             of it); values never enter a sandbox: give it the secret by name (`--secret {name}`) \
             and use its placeholder, `${name}`"
        ))
    }

    /// Refuse later standard input (`POST /v1/execs/{id}/stdin`) that holds a stored value,
    /// also one split between this input and what came before (`carry`, updated).
    pub(super) fn refuse_stdin_value(
        &self,
        id: &str,
        carry: &mut zeroize::Zeroizing<Vec<u8>>,
        data: &[u8],
    ) -> Result<(), ServiceError> {
        match self.secret_store.scanner().feed_carry(carry, data) {
            None => Ok(()),
            Some(name) => Err(self.refusal(id, "standard input", &name)),
        }
    }

    /// Refuse an exec whose command, env values or stdin hold a stored value.
    pub(super) fn refuse_exec_values(
        &self,
        id: &str,
        w: &crate::rpc::ExecRequest,
    ) -> Result<(), ServiceError> {
        let scanner = self.secret_store.scanner();
        if scanner.is_empty() {
            return Ok(());
        }
        let hit = |what: &'static str, b: &[u8]| scanner.find(b).map(|n| (what, n.to_owned()));
        let found = w
            .shell
            .as_deref()
            .and_then(|s| hit("command", s.as_bytes()))
            .or_else(|| w.argv.iter().find_map(|a| hit("command", a.as_bytes())))
            .or_else(|| w.cwd.as_deref().and_then(|c| hit("command", c.as_bytes())))
            .or_else(|| {
                w.env
                    .iter()
                    .find_map(|(_, v)| hit("environment", v.as_bytes()))
            })
            .or_else(|| w.stdin.as_deref().and_then(|s| hit("standard input", s)));
        match found {
            None => Ok(()),
            Some((what, name)) => Err(self.refusal(id, what, &name)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const V: &str = "sk-live-abcdefghijklmnop";

    fn set(svc: &Service, name: &str) {
        svc.store_secret(
            name,
            Value::new(format!("{V}-{name}").into_bytes()),
            api::SetSecretRequest {
                value: api::SecretText(zeroize::Zeroizing::new(format!("{V}-{name}"))),
                hosts: vec!["api.example.com".into()],
                headers: vec![],
                in_body: false,
            },
        )
        .unwrap();
    }

    #[test]
    fn sandboxes_get_fresh_placeholders_and_a_fork_never_its_parents() {
        let d = tempfile::tempdir().unwrap();
        let svc = super::super::test_service(d.path(), crate::config::Config::default());
        set(&svc, "A");
        set(&svc, "B");
        assert!(svc.check_secret_names(&["NOPE".into()]).is_err());
        svc.init_secrets("sbx_1", &["A".into(), "B".into()])
            .unwrap();
        let env = svc.secret_env("sbx_1");
        assert_eq!(env.len(), 2);
        for (n, p) in &env {
            assert!(placeholder::is_placeholder(p), "{n}={p}");
        }
        // The published snapshot carries the value for the interceptor.
        let snap = svc.secrets.for_sandbox("sbx_1").current();
        assert!(snap.bindings[0].value.ct_eq(format!("{V}-A").as_bytes()));
        svc.fork_secrets("sbx_1", "sbx_2").unwrap();
        let child = svc.secret_env("sbx_2");
        assert_eq!(
            child.iter().map(|(n, _)| n).collect::<Vec<_>>(),
            env.iter().map(|(n, _)| n).collect::<Vec<_>>()
        );
        for ((_, a), (_, b)) in env.iter().zip(&child) {
            assert_ne!(a, b, "a fork must not reuse its parent's placeholder");
        }
        // Republishing (e.g. at daemon start or after a value change) keeps the placeholders.
        set(&svc, "A");
        svc.publish_all_secrets();
        assert_eq!(svc.secret_env("sbx_1"), env);
        // Removing a secret takes it from every sandbox.
        svc.remove_secret("B").unwrap();
        assert_eq!(svc.secret_env("sbx_1").len(), 1);
        assert_eq!(svc.secret_env("sbx_2").len(), 1);
        svc.forget_secrets("sbx_2");
        assert!(svc.secret_env("sbx_2").is_empty());
    }

    #[test]
    fn a_value_already_in_a_sync_base_is_found_across_read_chunks() {
        let d = tempfile::tempdir().unwrap();
        let packs = d.path().join("workspace/packs");
        std::fs::create_dir_all(&packs).unwrap();
        let value = b"sk-live-in-a-pack-0123";
        let scanner = Scanner::new(&[("K".into(), Value::new(value.to_vec()))]);
        // The value straddles the 1 MiB read boundary.
        let mut pack = vec![b'x'; (1 << 20) - 5];
        pack.extend_from_slice(value);
        pack.extend_from_slice(b"tail");
        std::fs::write(packs.join("p1"), &pack).unwrap();
        assert!(dir_holds(&d.path().join("workspace"), &scanner));
        std::fs::write(packs.join("p1"), &pack[..pack.len() - 10]).unwrap();
        assert!(!dir_holds(&d.path().join("workspace"), &scanner));
    }

    #[test]
    fn an_exec_holding_a_value_is_refused_naming_the_secret_only() {
        let d = tempfile::tempdir().unwrap();
        let svc = super::super::test_service(d.path(), crate::config::Config::default());
        set(&svc, "API_KEY");
        let value = format!("{V}-API_KEY");
        let b64 = crate::api::b64::encode(value.as_bytes());
        let reqs = [
            crate::rpc::ExecRequest {
                argv: vec!["curl".into(), format!("-H=Bearer {value}")],
                ..Default::default()
            },
            crate::rpc::ExecRequest {
                shell: Some(format!("echo {b64} | base64 -d")),
                ..Default::default()
            },
            crate::rpc::ExecRequest {
                argv: vec!["env".into()],
                env: vec![("X".into(), hex::encode(&value))],
                ..Default::default()
            },
            crate::rpc::ExecRequest {
                argv: vec!["cat".into()],
                stdin: Some(format!("token={value}\n").into_bytes()),
                ..Default::default()
            },
        ];
        for r in &reqs {
            let e = svc.refuse_exec_values("sbx_1", r).unwrap_err();
            let msg = e.to_string();
            assert!(matches!(e, ServiceError::Forbidden(_)));
            assert!(msg.contains("`API_KEY`"), "{msg}");
            assert!(!msg.contains(V), "{msg}");
        }
        let fine = crate::rpc::ExecRequest {
            argv: vec!["echo".into(), "$API_KEY".into()],
            ..Default::default()
        };
        svc.refuse_exec_values("sbx_1", &fine).unwrap();
    }

    /// The one write path of the files API and of E2B uploads (after multipart and gzip
    /// decoding): refused before any VM is asked, naming the secret.
    #[tokio::test]
    async fn a_file_write_holding_any_stored_value_is_refused_before_the_vm() {
        let d = tempfile::tempdir().unwrap();
        let svc = super::super::test_service(d.path(), crate::config::Config::default());
        set(&svc, "API_KEY");
        let value = format!("{V}-API_KEY");
        // A sandbox that does not exist and was never given the secret: the scan comes first.
        for data in [
            format!("k={value}\n").into_bytes(),
            hex::encode(&value).into_bytes(),
            crate::api::b64::encode(value.as_bytes()).into_bytes(),
        ] {
            let e = svc
                .vm_write("sbx_none", "/workspace/up.txt", &data, Some((1000, 1000)))
                .await
                .unwrap_err();
            let msg = e.to_string();
            assert!(matches!(e, ServiceError::Forbidden(_)), "{msg}");
            assert!(
                msg.contains("`API_KEY`") && msg.contains("file written"),
                "{msg}"
            );
            assert!(!msg.contains(V), "{msg}");
        }
        // Without a value the write goes on to the VM (here: no such sandbox).
        let e = svc
            .vm_write("sbx_none", "/workspace/up.txt", b"fine", None)
            .await
            .unwrap_err();
        assert!(!matches!(e, ServiceError::Forbidden(_)), "{e}");
    }
}
