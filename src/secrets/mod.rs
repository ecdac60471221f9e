//! Secrets that never enter the VM: the contract shared by the secret store, the service
//! layer (placeholders in every exec, inbound refusal) and the egress interceptor (swap,
//! scrub, block) — see docs/SECURITY.md and `../shared/NOTES-secrets.md`.
//!
//! A value lives on the host only. A sandbox sees, for each secret it was given, an env var
//! `NAME=<placeholder>`; the interceptor swaps the placeholder for the value in authorization
//! positions of TLS flows to the secret's hosts, scrubs the value out of their responses and
//! refuses the placeholder in authorization positions to any other host.
//!
//! This file holds only the shared types; the store, the placeholder minting, the scanners and
//! the interceptor live in their own modules.

pub mod git;
pub mod placeholder;
pub mod scan;
pub mod store;

use std::collections::BTreeMap;
use std::sync::{Arc, RwLock};

use zeroize::Zeroizing;

/// A secret's real value: zeroized on drop, never `Debug`-printed, compared in constant time.
#[derive(Clone)]
pub struct Value(pub Zeroizing<Vec<u8>>);

impl Value {
    pub fn new(bytes: Vec<u8>) -> Value {
        Value(Zeroizing::new(bytes))
    }
    pub fn bytes(&self) -> &[u8] {
        &self.0
    }
    /// Constant-time equality (`subtle`).
    pub fn ct_eq(&self, other: &[u8]) -> bool {
        use subtle::ConstantTimeEq as _;
        self.0.len() == other.len() && bool::from(self.0.as_slice().ct_eq(other))
    }
}

impl std::fmt::Debug for Value {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Value(<{} bytes redacted>)", self.0.len())
    }
}

/// One secret as a sandbox holds it: what the interceptor needs to swap, scrub and block.
#[derive(Debug, Clone)]
pub struct Binding {
    /// The secret's name, also the env var's name (`[A-Z_][A-Z0-9_]*`).
    pub name: String,
    /// Hosts (lowercase DNS names, no port) whose intercepted requests get the value.
    pub hosts: Vec<String>,
    /// Extra header names (lowercase) that carry the value, beyond the standard authorization
    /// positions (`authorization`, `proxy-authorization`, `x-api-key`, `api-key`,
    /// `x-goog-api-key`) and the URL query.
    pub headers: Vec<String>,
    /// The value may also be swapped into request bodies (`--in-body`).
    pub in_body: bool,
    /// The sandbox's placeholder for this secret (`tbx_` + 32 chars of `[a-z2-7]`).
    pub placeholder: String,
    pub value: Value,
}

impl Binding {
    /// `host` (any case, no port) is one of this secret's hosts.
    pub fn serves(&self, host: &str) -> bool {
        self.hosts.iter().any(|h| h.eq_ignore_ascii_case(host))
    }
}

/// A git repository grant (`tryboxi git allow`): requests to `host/owner/repo` get the token.
#[derive(Debug, Clone)]
pub struct GitGrant {
    /// Lowercase `host/owner/repo` (no `.git`, no trailing `/`).
    pub repo: String,
    /// Branch patterns a push may update (`agent/*`); empty: no push.
    pub push: Vec<String>,
    /// The secret holding the token (one of the sandbox's bindings, by name).
    pub token_secret: String,
}

/// Everything one sandbox's egress needs at one instant (cheap to clone, swapped whole).
#[derive(Debug, Clone, Default)]
pub struct Snapshot {
    pub bindings: Vec<Binding>,
    pub git: Vec<GitGrant>,
}

impl Snapshot {
    /// Hosts whose TLS flows are intercepted (sorted, deduplicated, lowercase).
    pub fn intercepted_hosts(&self) -> Vec<String> {
        let mut v: Vec<String> = self
            .bindings
            .iter()
            .flat_map(|b| b.hosts.iter().map(|h| h.to_ascii_lowercase()))
            .chain(
                self.git
                    .iter()
                    .filter_map(|g| g.repo.split('/').next().map(str::to_owned)),
            )
            .collect();
        v.sort();
        v.dedup();
        v
    }

    /// The bindings that serve `host`.
    #[cfg(test)]
    pub fn for_host<'a>(&'a self, host: &'a str) -> impl Iterator<Item = &'a Binding> + 'a {
        self.bindings.iter().filter(move |b| b.serves(host))
    }
}

/// A sandbox's live secrets: the service publishes a new [`Snapshot`] when a secret is added,
/// changed or removed; the interceptor reads the current one per request (no restart).
#[derive(Debug, Clone, Default)]
pub struct SandboxSecrets(Arc<RwLock<Arc<Snapshot>>>);

impl SandboxSecrets {
    pub fn current(&self) -> Arc<Snapshot> {
        self.0.read().map(|g| g.clone()).unwrap_or_default()
    }
    pub fn publish(&self, s: Snapshot) {
        if let Ok(mut g) = self.0.write() {
            *g = Arc::new(s);
        }
    }
}

/// Every sandbox's [`SandboxSecrets`], by sandbox id.
#[derive(Debug, Default)]
pub struct Registry(std::sync::Mutex<BTreeMap<String, SandboxSecrets>>);

impl Registry {
    /// The handle of sandbox `id` (created empty on first use).
    pub fn for_sandbox(&self, id: &str) -> SandboxSecrets {
        let mut m = self.0.lock().unwrap_or_else(|p| p.into_inner());
        m.entry(id.to_owned()).or_default().clone()
    }
    pub fn forget(&self, id: &str) {
        let mut m = self.0.lock().unwrap_or_else(|p| p.into_inner());
        m.remove(id);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn b(name: &str, hosts: &[&str]) -> Binding {
        Binding {
            name: name.into(),
            hosts: hosts.iter().map(|h| h.to_string()).collect(),
            headers: vec![],
            in_body: false,
            placeholder: format!("tbx_{}", name.to_ascii_lowercase()),
            value: Value::new(b"sk-test-1234567890".to_vec()),
        }
    }

    #[test]
    fn a_value_is_never_printed() {
        let v = Value::new(b"sk-live-abcdef".to_vec());
        let s = format!("{v:?} {:?}", b("K", &["a.example"]));
        assert!(!s.contains("sk-live"), "{s}");
        assert!(v.ct_eq(b"sk-live-abcdef"));
        assert!(!v.ct_eq(b"sk-live-abcdeg"));
        assert!(!v.ct_eq(b"sk-live"));
    }

    #[test]
    fn hosts_match_in_any_case_and_are_listed_once() {
        let s = Snapshot {
            bindings: vec![
                b("A", &["API.example.com"]),
                b("B", &["api.example.com", "x.io"]),
            ],
            git: vec![GitGrant {
                repo: "github.com/o/r".into(),
                push: vec![],
                token_secret: "A".into(),
            }],
        };
        assert_eq!(
            s.intercepted_hosts(),
            ["api.example.com", "github.com", "x.io"]
        );
        assert_eq!(s.for_host("api.EXAMPLE.com").count(), 2);
        assert_eq!(s.for_host("other").count(), 0);
    }

    #[test]
    fn a_published_snapshot_is_seen_by_every_handle() {
        let r = Registry::default();
        let h = r.for_sandbox("sb1");
        assert!(h.current().bindings.is_empty());
        r.for_sandbox("sb1").publish(Snapshot {
            bindings: vec![b("A", &["a.example"])],
            git: vec![],
        });
        assert_eq!(h.current().bindings.len(), 1);
        r.forget("sb1");
        assert!(r.for_sandbox("sb1").current().bindings.is_empty());
    }
}
