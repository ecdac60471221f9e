//! The guest's clock and trust bundle: what a VM needs so that TLS interception works for the
//! real programs inside it.
//!
//! Owns: setting the guest's wall clock whenever a VM comes up (boot, resume, restore, clone:
//! a VM started from a snapshot otherwise runs on the snapshot's time), and, for a sandbox
//! with secrets, the guest trust bundle (the host's system CA bundle, which holds the host's
//! locally added CAs, plus the sandbox's interception CA) written to the guest's trust store and
//! named by the usual CA environment variables in every exec. The bundle is written again
//! before an exec whenever the VM or the CA certificate changed since the last write, which
//! covers create, pool claim, restore, fork and a secret added for a new host.
//! Never: holds a CA key (only the public certificate enters the VM), or touches a sandbox
//! without secrets (no env, no write).

use std::collections::HashMap;
use std::sync::{Arc, Mutex, Weak};
use std::time::{SystemTime, UNIX_EPOCH};

use super::Service;
use super::vms::LiveVm;
use crate::rpc::AgentClient;

/// The guest's trust store: the file Debian's `ca-certificates` (and OpenSSL's default) reads.
pub const GUEST_BUNDLE: &str = "/etc/ssl/certs/ca-certificates.crt";
/// The guest's original bundle, kept once before the first overwrite.
pub const GUEST_BUNDLE_DISTRO: &str = "/etc/ssl/certs/ca-certificates.crt.distro";
/// Variables every exec of a sandbox with secrets gets, each naming [`GUEST_BUNDLE`].
pub const CA_ENV: [&str; 6] = [
    "SSL_CERT_FILE",
    "REQUESTS_CA_BUNDLE",
    "NODE_EXTRA_CA_CERTS",
    "CURL_CA_BUNDLE",
    "GIT_SSL_CAINFO",
    "CARGO_HTTP_CAINFO",
];
/// Most bytes of a CA bundle read from the host or the guest (Debian's is ~200 KiB).
const MAX_BUNDLE: u64 = 8 << 20;

/// Per sandbox: the VM and the CA certificate its bundle was last written for.
#[derive(Default)]
pub struct GuestTrust {
    written: Mutex<HashMap<String, (Weak<LiveVm>, String)>>,
}

impl GuestTrust {
    fn is_current(&self, id: &str, vm: &Arc<LiveVm>, pem: &str) -> bool {
        self.lock()
            .get(id)
            .is_some_and(|(w, p)| std::ptr::eq(w.as_ptr(), Arc::as_ptr(vm)) && p == pem)
    }

    fn record(&self, id: &str, vm: &Arc<LiveVm>, pem: String) {
        self.lock().insert(id.to_owned(), (Arc::downgrade(vm), pem));
    }

    /// A removed sandbox.
    pub fn forget(&self, id: &str) {
        self.lock().remove(id);
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, (Weak<LiveVm>, String)>> {
        self.written.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// Set the guest's wall clock to the host's (best effort: a failure is logged, the VM stays up).
pub(super) async fn sync_clock(agent: &AgentClient, vm: &str) {
    let now = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0);
    if let Err(e) = agent.set_clock(now).await {
        tracing::warn!(vm = %vm, error = %e, "cannot set the guest clock");
    }
}

/// The bundle: `base` (PEM certificates), a newline if it lacks one, then the sandbox CA.
fn bundle(base: &[u8], ca_pem: &str) -> Vec<u8> {
    let mut out = Vec::with_capacity(base.len() + ca_pem.len() + 64);
    out.extend_from_slice(base);
    if !out.is_empty() && !out.ends_with(b"\n") {
        out.push(b'\n');
    }
    out.extend_from_slice(b"# tryboxi sandbox interception CA\n");
    out.extend_from_slice(ca_pem.as_bytes());
    if !out.ends_with(b"\n") {
        out.push(b'\n');
    }
    out
}

/// The env pointing every TLS client at [`GUEST_BUNDLE`].
fn ca_env() -> Vec<(String, String)> {
    CA_ENV
        .iter()
        .map(|k| (k.to_string(), GUEST_BUNDLE.to_owned()))
        .collect()
}

impl Service {
    /// Before an exec: make sure the guest's trust bundle holds the sandbox's current
    /// interception CA, and return the CA env for the exec. A sandbox without secrets (or
    /// without an interceptor) gets nothing.
    pub(super) async fn guest_trust_env(
        &self,
        id: &str,
        vm: &Arc<LiveVm>,
        has_secrets: bool,
    ) -> Vec<(String, String)> {
        if !has_secrets {
            return Vec::new();
        }
        let Some(icpt) = self.network_gate(id).ok().and_then(|g| g.interceptor()) else {
            return Vec::new();
        };
        let ca = icpt.ca();
        if let Err(e) = ca.ensure(&icpt.secrets().current().intercepted_hosts()) {
            tracing::warn!(sandbox = %id, error = %e, "cannot re-issue the interception CA");
        }
        let Some(pem) = ca.cert_pem() else {
            return Vec::new();
        };
        if !self.guest_trust.is_current(id, vm, &pem) {
            match self.write_guest_bundle(&vm.agent, &pem).await {
                Ok(()) => self.guest_trust.record(id, vm, pem),
                Err(e) => {
                    tracing::warn!(sandbox = %id, error = %e, "cannot write the guest CA bundle")
                }
            }
        }
        ca_env()
    }

    async fn write_guest_bundle(&self, agent: &AgentClient, ca_pem: &str) -> Result<(), String> {
        // The guest's original bundle is kept once, before the first overwrite; it is the
        // base only when the host has no bundle of its own.
        let mut distro = None;
        if agent.stat(GUEST_BUNDLE_DISTRO).await.is_err()
            && let Ok(b) = agent.read_file(GUEST_BUNDLE, MAX_BUNDLE).await
        {
            agent
                .write_file(GUEST_BUNDLE_DISTRO, &b, 0o644)
                .await
                .map_err(|e| format!("keeping {GUEST_BUNDLE_DISTRO}: {e}"))?;
            distro = Some(b);
        }
        let host = match crate::network::intercept::tls::system_bundle() {
            Some(p) => read_bounded(&p).await,
            None => None,
        };
        let base = match (host, distro) {
            (Some(h), _) => h,
            (None, Some(d)) => d,
            (None, None) => agent
                .read_file(GUEST_BUNDLE_DISTRO, MAX_BUNDLE)
                .await
                .unwrap_or_default(),
        };
        agent
            .write_file(GUEST_BUNDLE, &bundle(&base, ca_pem), 0o644)
            .await
            .map_err(|e| format!("writing {GUEST_BUNDLE}: {e}"))
    }
}

async fn read_bounded(path: &std::path::Path) -> Option<Vec<u8>> {
    let len = tokio::fs::metadata(path).await.ok()?.len();
    if len > MAX_BUNDLE {
        tracing::warn!(path = %path.display(), len, "host CA bundle too large; not used");
        return None;
    }
    tokio::fs::read(path).await.ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bundle_keeps_the_base_and_appends_the_ca_on_its_own_line() {
        let b = bundle(
            b"-----BEGIN CERTIFICATE-----\nA\n-----END CERTIFICATE-----",
            "CA\n",
        );
        let s = String::from_utf8(b).unwrap();
        assert!(s.starts_with("-----BEGIN CERTIFICATE-----\nA\n-----END CERTIFICATE-----\n#"));
        assert!(s.ends_with("interception CA\nCA\n"), "{s}");
        assert_eq!(
            bundle(b"", "CA").as_slice(),
            b"# tryboxi sandbox interception CA\nCA\n"
        );
    }

    async fn vm(id: &str) -> (Arc<LiveVm>, tokio::net::UnixStream) {
        let (agent, guest) = crate::rpc::hostile::fake_guest().await;
        let dir = std::path::PathBuf::from("/nonexistent");
        let info = crate::vmm::VmInfo {
            id: id.to_owned(),
            dir: dir.clone(),
            pid: 0,
            accel: crate::vmm::Accel::Tcg,
            agent_socket: dir.join("agent.sock"),
            qmp_socket: dir.join("qmp.sock"),
            console_log: dir.join("console.log"),
        };
        (Arc::new(LiveVm { info, agent }), guest)
    }

    #[tokio::test]
    async fn the_bundle_is_rewritten_for_another_vm_or_another_ca_only() {
        let t = GuestTrust::default();
        let (a, _ga) = vm("sbx_a").await;
        let (b, _gb) = vm("sbx_a").await;
        assert!(!t.is_current("sbx_a", &a, "CA1"), "never written");
        t.record("sbx_a", &a, "CA1".into());
        assert!(t.is_current("sbx_a", &a, "CA1"));
        assert!(!t.is_current("sbx_a", &a, "CA2"), "the CA was re-issued");
        assert!(
            !t.is_current("sbx_a", &b, "CA1"),
            "a restored or resumed VM"
        );
        assert!(!t.is_current("sbx_b", &a, "CA1"), "another sandbox");
        // The replaced VM is gone; its allocation is held by the Weak, so a new VM can never
        // take its address and pass for it.
        drop(a);
        let (c, _gc) = vm("sbx_a").await;
        assert!(!t.is_current("sbx_a", &c, "CA1"));
        t.forget("sbx_a");
        assert!(!t.is_current("sbx_a", &b, "CA1"));
    }

    #[test]
    fn every_ca_variable_names_the_guest_bundle() {
        let env = ca_env();
        assert_eq!(env.len(), 6);
        assert!(env.iter().all(|(_, v)| v == GUEST_BUNDLE));
        assert!(env.iter().any(|(k, _)| k == "NODE_EXTRA_CA_CERTS"));
    }
}
