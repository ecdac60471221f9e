//! The guest's clock and trust bundle: what a VM needs so that TLS works for the real programs
//! inside it, behind a TLS-inspecting proxy the host trusts and through the secrets
//! interceptor.
//!
//! Owns: setting the guest's wall clock whenever a VM comes up (boot, resume, restore, clone:
//! a VM started from a snapshot otherwise runs on the snapshot's time), and the guest trust
//! bundle of every sandbox that has something to add: the guest's own distribution bundle
//! (kept once as [`GUEST_BUNDLE_DISTRO`] before the first overwrite), then the host's locally
//! added CAs (`[network] trust_host_cas`, read at start from `host_ca_dirs`, see
//! `network::host_cas`), then, for a sandbox with secrets, its interception CA. It is written
//! to the guest's trust store and named by the usual CA environment variables ([`CA_ENV`]) in
//! every exec. The bundle is written again before an exec whenever the VM or the added
//! certificates changed since the last write, which covers create, pool claim, restore, fork
//! and a secret added for a new host; a new VM whose bundle still carries the stamp of that
//! write ([`GUEST_BUNDLE_STAMP`]: a restore, a fork) is checked with two small reads instead,
//! and a restore of a snapshot taken after such a write or check, with the same additions
//! now, skips even that (the snapshot keeps the digest: [`GuestTrust::carry_over`]).
//!
//! Why the distribution bundle and not the host's whole system bundle (as the secrets path
//! once used): the guest verifies only two kinds of server. Intercepted hosts present a leaf
//! from the sandbox CA, so no host root matters there; every other host is verified by the
//! guest itself against the real (or proxy-re-signed) chain, for which its own distribution's
//! roots plus the host's local CAs are what the host itself trusts, without importing the host
//! distribution's root choices into another distribution. One composition for every sandbox
//! also means that turning `trust_host_cas` off really keeps the host's local CAs out of every
//! guest, secrets or not.
//! Never: holds a CA key (only public certificates enter the VM), or touches a sandbox with
//! nothing to add (no env, no write).

use std::collections::HashMap;
use std::sync::{Arc, Mutex, Weak};
use std::time::{SystemTime, UNIX_EPOCH};

use super::Service;
use super::vms::LiveVm;
use crate::network::host_cas::HostCas;
use crate::rpc::{AgentClient, RpcError};

/// The guest's trust store: the file Debian's `ca-certificates` (and OpenSSL's default) reads.
pub const GUEST_BUNDLE: &str = "/etc/ssl/certs/ca-certificates.crt";
/// The guest's original bundle, kept once before the first overwrite.
pub const GUEST_BUNDLE_DISTRO: &str = "/etc/ssl/certs/ca-certificates.crt.distro";
/// Variables every exec of a sandbox with added CAs gets, each naming [`GUEST_BUNDLE`].
pub const CA_ENV: [&str; 6] = [
    "SSL_CERT_FILE",
    "REQUESTS_CA_BUNDLE",
    "NODE_EXTRA_CA_CERTS",
    "CURL_CA_BUNDLE",
    "GIT_SSL_CAINFO",
    "CARGO_HTTP_CAINFO",
];
/// What the last bundle tryboxi wrote holds: `<sha256 of the additions> <bundle bytes>`. A VM
/// started from a snapshot or a fork base (a new QEMU) whose bundle is still that one is not
/// written again: reading 200 KiB and writing it back was most of the first exec after a
/// restore under TCG (BENCHMARKS.md, "Before and after"). A guest that fakes it only denies
/// itself the additions.
pub const GUEST_BUNDLE_STAMP: &str = "/etc/ssl/certs/ca-certificates.crt.tryboxi";
/// Starts the comment line before each certificate tryboxi adds; a bundle is cut at the first
/// such line when kept as the distribution's, so additions are never kept twice.
const MARK: &str = "# tryboxi-added:";
/// Most bytes of a CA bundle read from the guest (Debian's is ~200 KiB).
const MAX_BUNDLE: u64 = 8 << 20;

/// The host's CAs every guest trusts, and per sandbox: the VM and the digest of the additions
/// its bundle was last written (or found) with.
#[derive(Default)]
pub struct GuestTrust {
    /// The host's local CAs as one PEM block ("" when off or none).
    host_block: String,
    written: Mutex<HashMap<String, (Weak<LiveVm>, String)>>,
}

/// What identifies a set of additions: its SHA-256 (hex).
fn digest(added: &str) -> String {
    crate::workspace::sha256(added.as_bytes())
}

impl GuestTrust {
    /// Reads the host's local CAs when `[network] trust_host_cas` is on (logged).
    pub fn new(cfg: &crate::config::NetworkConfig) -> GuestTrust {
        let host = host_cas(cfg);
        if let Some(h) = &host {
            for s in &h.skipped {
                tracing::warn!(file = %s.file.display(), reason = %s.reason, "host CA file not used");
            }
            if !h.cas.is_empty() {
                tracing::info!(cas = ?h.describe(), "every guest trusts the host's local CAs");
            }
        }
        GuestTrust {
            host_block: host.map(|h| h.pem_block(MARK)).unwrap_or_default(),
            written: Default::default(),
        }
    }

    fn is_current(&self, id: &str, vm: &Arc<LiveVm>, added: &str) -> bool {
        self.written_for(id, vm).is_some_and(|d| d == digest(added))
    }

    fn record(&self, id: &str, vm: &Arc<LiveVm>, added: &str) {
        self.carry_over(id, vm, digest(added));
    }

    /// The digest of the additions `vm`'s bundle holds, when this daemon wrote or found them
    /// in that very VM (a snapshot keeps it: see [`Self::carry_over`]).
    pub fn written_for(&self, id: &str, vm: &Arc<LiveVm>) -> Option<String> {
        self.lock()
            .get(id)
            .filter(|(w, _)| std::ptr::eq(w.as_ptr(), Arc::as_ptr(vm)))
            .map(|(_, d)| d.clone())
    }

    /// `vm` was started from a snapshot taken while the bundle held the additions of
    /// `digest` ([`Self::written_for`] read before the checkpoint): its bundle is that one, so
    /// its first exec needs no look at it (a running VM's is not looked at again either).
    pub fn carry_over(&self, id: &str, vm: &Arc<LiveVm>, digest: String) {
        self.lock()
            .insert(id.to_owned(), (Arc::downgrade(vm), digest));
    }

    /// A removed sandbox.
    pub fn forget(&self, id: &str) {
        self.lock().remove(id);
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, (Weak<LiveVm>, String)>> {
        self.written.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// The host's local CAs per `cfg`, or `None` when `trust_host_cas` is off.
pub fn host_cas(cfg: &crate::config::NetworkConfig) -> Option<HostCas> {
    cfg.trust_host_cas
        .then(|| crate::network::host_cas::read_dirs(&cfg.host_ca_dirs))
}

/// Set the guest's wall clock to the host's (best effort: a failure is logged, the VM stays up).
/// Returns once the request is queued, not answered: every request the caller sends after it
/// runs on the new time (see [`AgentClient::set_clock_queued`]), and the answer is awaited in
/// the background.
pub(super) fn sync_clock(agent: &AgentClient, vm: &str) {
    let now = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0);
    let vm = vm.to_owned();
    match agent.set_clock_queued(now) {
        Ok(answer) => {
            tokio::spawn(async move {
                if let Err(e) = answer.await {
                    tracing::warn!(vm = %vm, error = %e, "cannot set the guest clock");
                }
            });
        }
        Err(e) => tracing::warn!(vm = %vm, error = %e, "cannot set the guest clock"),
    }
}

/// What is added for one sandbox: the host's CAs, then the sandbox CA (if any).
fn additions(host_block: &str, sandbox_ca: Option<&str>) -> String {
    let mut out = host_block.to_owned();
    if let Some(pem) = sandbox_ca {
        out.push_str(MARK);
        out.push_str(" sandbox interception CA\n");
        out.push_str(pem);
        if !out.ends_with('\n') {
            out.push('\n');
        }
    }
    out
}

/// The distribution's part of a guest bundle: everything before the first [`MARK`] line.
fn distro_part(b: &[u8]) -> &[u8] {
    let mut at = 0;
    for line in b.split_inclusive(|&c| c == b'\n') {
        if line.starts_with(MARK.as_bytes()) {
            return &b[..at];
        }
        at += line.len();
    }
    b
}

/// The bundle: `base` (PEM certificates), a newline if it lacks one, then the additions.
fn bundle(base: &[u8], added: &str) -> Vec<u8> {
    let mut out = Vec::with_capacity(base.len() + added.len() + 1);
    out.extend_from_slice(base);
    if !out.is_empty() && !out.ends_with(b"\n") {
        out.push(b'\n');
    }
    out.extend_from_slice(added.as_bytes());
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
    /// Before an exec: make sure the guest's trust bundle holds the host's local CAs and, with
    /// secrets, the sandbox's current interception CA; return the CA env for the exec. A
    /// sandbox with nothing to add gets nothing.
    pub(super) async fn guest_trust_env(
        &self,
        id: &str,
        vm: &Arc<LiveVm>,
        has_secrets: bool,
    ) -> Vec<(String, String)> {
        let sandbox_ca = if has_secrets {
            self.sandbox_ca_pem(id)
        } else {
            None
        };
        let added = additions(&self.guest_trust.host_block, sandbox_ca.as_deref());
        if added.is_empty() {
            return Vec::new();
        }
        if !self.guest_trust.is_current(id, vm, &added) {
            match write_guest_bundle(&vm.agent, &added).await {
                Ok(()) => self.guest_trust.record(id, vm, &added),
                Err(e) => {
                    tracing::warn!(sandbox = %id, error = %e, "cannot write the guest CA bundle")
                }
            }
        }
        ca_env()
    }

    /// The sandbox's interception CA (re-issued first if a new host needs it), if it has one.
    fn sandbox_ca_pem(&self, id: &str) -> Option<String> {
        let icpt = self.network_gate(id).ok().and_then(|g| g.interceptor())?;
        let ca = icpt.ca();
        if let Err(e) = ca.ensure(&icpt.secrets().current().intercepted_hosts()) {
            tracing::warn!(sandbox = %id, error = %e, "cannot re-issue the interception CA");
        }
        ca.cert_pem()
    }
}

/// The stamp of a bundle of `len` bytes ending with `added`.
fn stamp(added: &str, len: usize) -> String {
    format!("{} {len}\n", crate::workspace::sha256(added.as_bytes()))
}

/// Whether the guest's bundle is still the one tryboxi wrote with `added` (its stamp matches
/// and its size is the stamped one).
async fn bundle_is_current(agent: &AgentClient, added: &str) -> bool {
    // Both requests at once: one round trip on the first exec of every new VM.
    let (st, meta) = tokio::join!(
        agent.read_file(GUEST_BUNDLE_STAMP, 256),
        agent.stat(GUEST_BUNDLE)
    );
    let (Ok(st), Ok(meta)) = (st, meta) else {
        return false;
    };
    let Ok(len) = usize::try_from(meta.size) else {
        return false;
    };
    st == stamp(added, len).as_bytes()
}

async fn write_guest_bundle(agent: &AgentClient, added: &str) -> Result<(), String> {
    if bundle_is_current(agent, added).await {
        return Ok(());
    }
    // The guest's original bundle is kept once, before the first overwrite (cut at any
    // addition of ours, should the guest have lost the copy); an image without one gets an
    // empty copy, so that our own bundle is never taken for the distribution's.
    let base = if agent.stat(GUEST_BUNDLE_DISTRO).await.is_err() {
        let b = match agent.read_file(GUEST_BUNDLE, MAX_BUNDLE).await {
            Ok(b) => distro_part(&b).to_vec(),
            // The agent answered: no bundle in this image (one that exists but cannot be read
            // is left alone).
            Err(RpcError::Remote(_)) if agent.stat(GUEST_BUNDLE).await.is_err() => Vec::new(),
            Err(e) => return Err(format!("reading {GUEST_BUNDLE}: {e}")),
        };
        agent
            .write_file(GUEST_BUNDLE_DISTRO, &b, 0o644)
            .await
            .map_err(|e| format!("keeping {GUEST_BUNDLE_DISTRO}: {e}"))?;
        b
    } else {
        let b = agent
            .read_file(GUEST_BUNDLE_DISTRO, MAX_BUNDLE)
            .await
            .map_err(|e| format!("reading {GUEST_BUNDLE_DISTRO}: {e}"))?;
        distro_part(&b).to_vec()
    };
    let b = bundle(&base, added);
    // The stamp goes first: a bundle write cut short then leaves a size that does not match.
    agent
        .write_file(GUEST_BUNDLE_STAMP, stamp(added, b.len()).as_bytes(), 0o644)
        .await
        .map_err(|e| format!("writing {GUEST_BUNDLE_STAMP}: {e}"))?;
    agent
        .write_file(GUEST_BUNDLE, &b, 0o644)
        .await
        .map_err(|e| format!("writing {GUEST_BUNDLE}: {e}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    async fn live_vm(id: &str) -> (Arc<LiveVm>, tokio::net::UnixStream) {
        let (agent, guest) = crate::rpc::hostile::fake_guest().await;
        let dir = std::path::PathBuf::from("/nonexistent").join(id);
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
    async fn a_vm_from_a_snapshot_carries_the_bundle_state_the_snapshot_had() {
        let trust = GuestTrust::default();
        let (old, _g1) = live_vm("sbx_1").await;
        let (new, _g2) = live_vm("sbx_1").await;
        let added = additions("# tryboxi-added: host CA X (f)\nH\n", None);
        // Nothing written yet: nothing to carry (the snapshot records none).
        assert_eq!(trust.written_for("sbx_1", &old), None);
        trust.record("sbx_1", &old, &added);
        assert!(trust.is_current("sbx_1", &old, &added));
        // Another VM of the sandbox (a restore) is not current by itself...
        assert!(!trust.is_current("sbx_1", &new, &added));
        // ...but is once it carries the digest the snapshot read from the old one.
        let d = trust.written_for("sbx_1", &old).expect("recorded");
        trust.carry_over("sbx_1", &new, d);
        assert!(trust.is_current("sbx_1", &new, &added));
        assert!(!trust.is_current("sbx_1", &old, &added));
        // Different additions since (a new secret host, other host CAs after a restart): the
        // carried state does not count and the bundle is looked at.
        let more = additions("# tryboxi-added: host CA X (f)\nH\n", Some("SBX\n"));
        assert!(!trust.is_current("sbx_1", &new, &more));
        trust.forget("sbx_1");
        assert!(!trust.is_current("sbx_1", &new, &added));
    }

    #[test]
    fn the_stamp_names_the_additions_and_the_bundle_size() {
        let s = stamp("CA\n", 1234);
        assert_eq!(s, format!("{} 1234\n", crate::workspace::sha256(b"CA\n")));
        assert_ne!(s, stamp("CA2\n", 1234));
        assert_ne!(s, stamp("CA\n", 1235));
    }

    #[test]
    fn bundle_keeps_the_base_and_appends_the_additions_on_their_own_line() {
        let added = additions("", Some("CA\n"));
        let b = bundle(
            b"-----BEGIN CERTIFICATE-----\nA\n-----END CERTIFICATE-----",
            &added,
        );
        let s = String::from_utf8(b).unwrap();
        assert!(s.starts_with("-----BEGIN CERTIFICATE-----\nA\n-----END CERTIFICATE-----\n#"));
        assert!(s.ends_with("interception CA\nCA\n"), "{s}");
        assert_eq!(
            bundle(b"", &additions("", Some("CA"))).as_slice(),
            b"# tryboxi-added: sandbox interception CA\nCA\n"
        );
    }

    #[test]
    fn additions_are_the_host_cas_then_the_sandbox_ca_or_nothing() {
        assert_eq!(
            additions("", None),
            "",
            "nothing to add: the guest is left alone"
        );
        let host = "# tryboxi-added: host CA Corp (/x.crt)\nHOST\n";
        assert_eq!(additions(host, None), host);
        assert_eq!(
            additions(host, Some("SBX\n")),
            format!("{host}# tryboxi-added: sandbox interception CA\nSBX\n")
        );
    }

    #[test]
    fn the_distro_part_stops_at_the_first_addition() {
        let distro = b"-----BEGIN CERTIFICATE-----\nD\n-----END CERTIFICATE-----\n";
        let ours = bundle(
            distro,
            &additions("# tryboxi-added: host CA X (f)\nH\n", Some("S")),
        );
        assert_eq!(distro_part(&ours), distro);
        assert_eq!(distro_part(distro), distro);
        assert_eq!(distro_part(b""), b"");
        // Only at the start of a line.
        let odd = b"x # tryboxi-added: not ours\n";
        assert_eq!(distro_part(odd), odd);
    }

    #[test]
    fn the_host_cas_are_read_only_when_on() {
        let d = tempfile::tempdir().unwrap();
        let key = rcgen::KeyPair::generate().unwrap();
        let mut p = rcgen::CertificateParams::default();
        p.distinguished_name
            .push(rcgen::DnType::CommonName, "Trust Test CA");
        p.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
        std::fs::write(d.path().join("t.crt"), p.self_signed(&key).unwrap().pem()).unwrap();
        let mut cfg = crate::config::NetworkConfig {
            host_ca_dirs: vec![d.path().to_path_buf()],
            ..Default::default()
        };
        let t = GuestTrust::new(&cfg);
        assert!(
            t.host_block
                .starts_with("# tryboxi-added: host CA Trust Test CA (")
        );
        assert_eq!(t.host_block.matches("BEGIN CERTIFICATE").count(), 1);
        cfg.trust_host_cas = false;
        assert!(host_cas(&cfg).is_none());
        assert_eq!(GuestTrust::new(&cfg).host_block, "");
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
        t.record("sbx_a", &a, "CA1");
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
