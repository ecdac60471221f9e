//! The per-sandbox interception CA: one ECDSA P-256 key and a self-signed CA certificate whose
//! name constraints permit only the hosts that hold secrets, plus the leaf certificates it
//! issues for them.
//!
//! Persisted in the sandbox's directory (`intercept-ca.key` 0600, `intercept-ca.pem`,
//! `intercept-ca.hosts`) so the guest's trust bundle stays valid across pause, restore and
//! fork. When the host set grows, the certificate is re-issued (same key, same subject) with
//! the union of the hosts; the guest bundle must then be refreshed with [`SandboxCa::cert_pem`].
//! Leaf certificates: random serial, authority key identifier present, notBefore backdated one
//! day (guest clocks lag after a restore), valid [`LEAF_DAYS`] days, cached per host.

use std::collections::{BTreeSet, HashMap};
use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use rcgen::{
    BasicConstraints, CertificateParams, DistinguishedName, DnType, ExtendedKeyUsagePurpose,
    GeneralSubtree, IsCa, Issuer, KeyPair, KeyUsagePurpose, NameConstraints, SanType, SerialNumber,
};
use rustls::pki_types::{CertificateDer, PrivateKeyDer, PrivatePkcs8KeyDer};
use time::{Duration, OffsetDateTime};

pub const KEY_FILE: &str = "intercept-ca.key";
pub const CERT_FILE: &str = "intercept-ca.pem";
pub const HOSTS_FILE: &str = "intercept-ca.hosts";
/// Validity of a leaf certificate (re-issued from the cache's point of view after half of it).
pub const LEAF_DAYS: i64 = 7;
/// Validity of the CA certificate.
const CA_DAYS: i64 = 3650;
/// Hosts a CA may be constrained to (the set comes from the user's secrets; bounded anyway).
const MAX_HOSTS: usize = 256;

#[derive(Debug, thiserror::Error)]
pub enum CaError {
    #[error("cannot {what} {path}: {source}")]
    Io {
        what: &'static str,
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("certificate generation failed: {0}")]
    Cert(#[from] rcgen::Error),
    #[error("the stored interception CA in {0} is unreadable")]
    Corrupt(PathBuf),
    #[error("{0} is not a DNS name a certificate can be issued for")]
    BadHost(String),
    #[error("the interception CA does not cover {0}")]
    NotCovered(String),
    #[error("more than {MAX_HOSTS} intercepted hosts")]
    TooManyHosts,
}

/// A leaf certificate chain and key, ready for a rustls server config.
#[derive(Clone)]
pub struct Leaf {
    pub chain: Vec<CertificateDer<'static>>,
    key_der: Arc<Vec<u8>>,
    issued: OffsetDateTime,
}

impl Leaf {
    pub fn key(&self) -> PrivateKeyDer<'static> {
        PrivateKeyDer::Pkcs8(PrivatePkcs8KeyDer::from(self.key_der.as_ref().clone()))
    }
}

impl std::fmt::Debug for Leaf {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Leaf(issued {})", self.issued)
    }
}

struct State {
    hosts: BTreeSet<String>,
    cert_pem: String,
    cert_der: CertificateDer<'static>,
    issuer: Issuer<'static, KeyPair>,
    leaves: HashMap<String, Leaf>,
}

/// One sandbox's interception CA. Cheap to share (`Arc`); all methods take `&self`.
pub struct SandboxCa {
    dir: PathBuf,
    /// `None` until there is a host to cover (nothing is minted or written before).
    state: Mutex<Option<State>>,
}

impl std::fmt::Debug for SandboxCa {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "SandboxCa({})", self.dir.display())
    }
}

fn ca_params(hosts: &BTreeSet<String>, not_before: OffsetDateTime) -> CertificateParams {
    let mut p = CertificateParams::default();
    let mut dn = DistinguishedName::new();
    dn.push(DnType::CommonName, "tryboxi sandbox interception CA");
    dn.push(DnType::OrganizationName, "tryboxi");
    p.distinguished_name = dn;
    p.is_ca = IsCa::Ca(BasicConstraints::Constrained(0));
    p.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
    // No hosts yet: permit only the reserved `invalid` TLD (an empty list would drop the
    // extension and leave the CA unconstrained).
    let permitted: Vec<String> = if hosts.is_empty() {
        vec!["invalid".into()]
    } else {
        hosts.iter().cloned().collect()
    };
    p.name_constraints = Some(NameConstraints {
        permitted_subtrees: permitted.into_iter().map(GeneralSubtree::DnsName).collect(),
        excluded_subtrees: vec![],
    });
    p.not_before = not_before;
    p.not_after = not_before + Duration::days(CA_DAYS);
    p
}

fn random_serial() -> SerialNumber {
    let mut b = [0u8; 16];
    let _ = getrandom::fill(&mut b);
    // Positive, non-zero.
    b[0] = (b[0] & 0x7f) | 0x01;
    SerialNumber::from_slice(&b)
}

fn check_host(h: &str) -> Result<String, CaError> {
    let h = h.to_ascii_lowercase();
    let ok = !h.is_empty()
        && h.len() <= 253
        && h.parse::<std::net::IpAddr>().is_err()
        && h.bytes()
            .all(|c| c.is_ascii_alphanumeric() || c == b'-' || c == b'.' || c == b'_');
    if ok { Ok(h) } else { Err(CaError::BadHost(h)) }
}

impl SandboxCa {
    /// Load the CA stored in `dir`, or mint one; re-issue its certificate if `hosts` holds a
    /// host it does not cover yet. With no stored CA and no hosts nothing is minted yet: the
    /// first [`SandboxCa::ensure`] with a host does it.
    pub fn load_or_create(dir: &Path, hosts: &[String]) -> Result<Arc<SandboxCa>, CaError> {
        let state = if hosts.is_empty() && !dir.join(KEY_FILE).exists() {
            None
        } else {
            Some(Self::build(dir, hosts)?)
        };
        Ok(Arc::new(SandboxCa {
            dir: dir.to_owned(),
            state: Mutex::new(state),
        }))
    }

    /// Make the certificate cover `hosts` too (re-issued and stored if it grows).
    pub fn ensure(&self, hosts: &[String]) -> Result<(), CaError> {
        let mut st = self.lock();
        let missing = match st.as_ref() {
            Some(s) => hosts
                .iter()
                .any(|h| !s.hosts.contains(&h.to_ascii_lowercase())),
            None => !hosts.is_empty(),
        };
        if missing {
            *st = Some(Self::build(&self.dir, hosts)?);
        }
        Ok(())
    }

    /// Copy a stored CA from one sandbox directory to another (a fork keeps trusting it).
    pub fn copy_files(from: &Path, to: &Path) -> Result<(), CaError> {
        if !from.join(KEY_FILE).exists() {
            return Ok(());
        }
        for (name, mode) in [(KEY_FILE, 0o600), (CERT_FILE, 0o644), (HOSTS_FILE, 0o644)] {
            let src = from.join(name);
            let bytes = std::fs::read(&src).map_err(|source| CaError::Io {
                what: "read",
                path: src,
                source,
            })?;
            write_file(&to.join(name), &bytes, mode)?;
        }
        Ok(())
    }

    fn build(dir: &Path, hosts: &[String]) -> Result<State, CaError> {
        let io = |what, path: &Path| {
            let path = path.to_owned();
            move |source| CaError::Io { what, path, source }
        };
        let key_path = dir.join(KEY_FILE);
        let cert_path = dir.join(CERT_FILE);
        let hosts_path = dir.join(HOSTS_FILE);
        let wanted: BTreeSet<String> = hosts
            .iter()
            .map(|h| check_host(h))
            .collect::<Result<_, _>>()?;
        let stored = match std::fs::read_to_string(&key_path) {
            Ok(key_pem) => {
                let key =
                    KeyPair::from_pem(&key_pem).map_err(|_| CaError::Corrupt(key_path.clone()))?;
                let cert_pem =
                    std::fs::read_to_string(&cert_path).map_err(io("read", &cert_path))?;
                let hosts_txt =
                    std::fs::read_to_string(&hosts_path).map_err(io("read", &hosts_path))?;
                let mut lines = hosts_txt.lines();
                let nb = lines
                    .next()
                    .and_then(|l| l.parse::<i64>().ok())
                    .and_then(|t| OffsetDateTime::from_unix_timestamp(t).ok())
                    .ok_or_else(|| CaError::Corrupt(hosts_path.clone()))?;
                let stored_hosts: BTreeSet<String> = lines
                    .filter(|l| !l.is_empty())
                    .map(check_host)
                    .collect::<Result<_, _>>()?;
                Some((key, cert_pem, stored_hosts, nb))
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => None,
            Err(e) => return Err(io("read", &key_path)(e)),
        };
        let (key, mut cert_pem, mut all, mut not_before, mut fresh) = match stored {
            Some((k, c, h, nb)) => (k, c, h, nb, false),
            None => {
                let k = KeyPair::generate()?;
                let nb = OffsetDateTime::now_utc() - Duration::days(1);
                (k, String::new(), BTreeSet::new(), nb, true)
            }
        };
        if !wanted.is_subset(&all) {
            all.extend(wanted);
            fresh = true;
            not_before = OffsetDateTime::now_utc() - Duration::days(1);
        }
        if all.len() > MAX_HOSTS {
            return Err(CaError::TooManyHosts);
        }
        let mut params = ca_params(&all, not_before);
        if fresh {
            params.serial_number = Some(random_serial());
            let cert = params.self_signed(&key)?;
            cert_pem = cert.pem();
            write_file(&key_path, key.serialize_pem().as_bytes(), 0o600)?;
            write_file(&cert_path, cert_pem.as_bytes(), 0o644)?;
            let mut h = format!("{}\n", not_before.unix_timestamp());
            for x in &all {
                h.push_str(x);
                h.push('\n');
            }
            write_file(&hosts_path, h.as_bytes(), 0o644)?;
            tracing::info!(dir = %dir.display(), hosts = all.len(), "interception CA issued");
        }
        use rustls::pki_types::pem::PemObject as _;
        let cert_der = CertificateDer::from_pem_slice(cert_pem.as_bytes())
            .map_err(|_| CaError::Corrupt(cert_path.clone()))?;
        params.serial_number = None;
        Ok(State {
            hosts: all,
            cert_pem,
            cert_der,
            issuer: Issuer::new(params, key),
            leaves: HashMap::new(),
        })
    }

    /// The CA certificate (PEM) for the guest's trust bundle (`None`: none minted yet).
    pub fn cert_pem(&self) -> Option<String> {
        self.lock().as_ref().map(|s| s.cert_pem.clone())
    }

    #[cfg(test)]
    pub fn cert_der(&self) -> Option<CertificateDer<'static>> {
        self.lock().as_ref().map(|s| s.cert_der.clone())
    }

    /// Hosts the certificate's name constraints permit.
    pub fn hosts(&self) -> Vec<String> {
        self.lock()
            .as_ref()
            .map(|s| s.hosts.iter().cloned().collect())
            .unwrap_or_default()
    }

    /// Whether the certificate covers `host` (a leaf for it would validate in the guest).
    pub fn covers(&self, host: &str) -> bool {
        let h = host.to_ascii_lowercase();
        self.hosts()
            .iter()
            .any(|c| h == *c || h.ends_with(&format!(".{c}")))
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Option<State>> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// A leaf certificate for `host` (cached; re-issued after half its validity).
    pub fn leaf(&self, host: &str) -> Result<Leaf, CaError> {
        let host = check_host(host)?;
        let now = OffsetDateTime::now_utc();
        let mut guard = self.lock();
        let Some(st) = guard.as_mut() else {
            return Err(CaError::NotCovered(host));
        };
        if let Some(l) = st.leaves.get(&host)
            && now - l.issued < Duration::days(LEAF_DAYS / 2)
        {
            return Ok(l.clone());
        }
        let key = KeyPair::generate()?;
        let mut p = CertificateParams::default();
        let mut dn = DistinguishedName::new();
        dn.push(DnType::CommonName, host.clone());
        p.distinguished_name = dn;
        p.subject_alt_names = vec![SanType::DnsName(
            host.clone()
                .try_into()
                .map_err(|_| CaError::BadHost(host.clone()))?,
        )];
        p.serial_number = Some(random_serial());
        p.not_before = now - Duration::days(1);
        p.not_after = now + Duration::days(LEAF_DAYS);
        p.key_usages = vec![KeyUsagePurpose::DigitalSignature];
        p.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth];
        p.use_authority_key_identifier_extension = true;
        let cert = p.signed_by(&key, &st.issuer)?;
        let leaf = Leaf {
            chain: vec![cert.der().clone(), st.cert_der.clone()],
            key_der: Arc::new(key.serialize_der()),
            issued: now,
        };
        if st.leaves.len() >= MAX_HOSTS {
            st.leaves.clear();
        }
        st.leaves.insert(host, leaf.clone());
        Ok(leaf)
    }
}

fn write_file(path: &Path, bytes: &[u8], mode: u32) -> Result<(), CaError> {
    use std::os::unix::fs::OpenOptionsExt as _;
    let err = |source| CaError::Io {
        what: "write",
        path: path.to_owned(),
        source,
    };
    let tmp = path.with_extension("tmp");
    let _ = std::fs::remove_file(&tmp);
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(mode)
        .open(&tmp)
        .map_err(err)?;
    f.write_all(bytes).map_err(err)?;
    f.sync_all().map_err(err)?;
    std::fs::rename(&tmp, path).map_err(err)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt as _;

    #[test]
    fn the_ca_persists_and_grows_with_its_hosts() {
        let d = tempfile::tempdir().unwrap();
        let a = SandboxCa::load_or_create(d.path(), &["api.example.com".into()]).unwrap();
        let mode = std::fs::metadata(d.path().join(KEY_FILE))
            .unwrap()
            .permissions()
            .mode();
        assert_eq!(mode & 0o777, 0o600);
        // Same hosts: the stored CA comes back unchanged (valid across restore and fork).
        let b = SandboxCa::load_or_create(d.path(), &["API.example.com".into()]).unwrap();
        assert_eq!(a.cert_pem(), b.cert_pem());
        assert!(b.covers("api.example.com") && b.covers("x.api.example.com"));
        assert!(!b.covers("example.com") && !b.covers("evilapi.example.com"));
        // A new host: re-issued, covering both.
        let c = SandboxCa::load_or_create(d.path(), &["other.test".into()]).unwrap();
        assert_ne!(a.cert_pem(), c.cert_pem());
        assert_eq!(c.hosts(), ["api.example.com", "other.test"]);
        // Leaves are cached, backdated and short-lived.
        let l1 = c.leaf("other.test").unwrap();
        let l2 = c.leaf("OTHER.test").unwrap();
        assert_eq!(l1.chain[0], l2.chain[0]);
        assert_eq!(l1.chain.len(), 2);
        assert!(SandboxCa::load_or_create(d.path(), &["1.2.3.4".into()]).is_err());
        // No host yet: nothing minted, nothing written; the first host mints it.
        let e = tempfile::tempdir().unwrap();
        let none = SandboxCa::load_or_create(e.path(), &[]).unwrap();
        assert!(none.cert_pem().is_none() && none.leaf("a.test").is_err());
        assert!(!e.path().join(KEY_FILE).exists());
        none.ensure(&["a.test".into()]).unwrap();
        assert!(none.covers("a.test") && none.leaf("a.test").is_ok());
        // A fork's copy is the same CA.
        let f = tempfile::tempdir().unwrap();
        SandboxCa::copy_files(e.path(), f.path()).unwrap();
        let copy = SandboxCa::load_or_create(f.path(), &["a.test".into()]).unwrap();
        assert_eq!(copy.cert_pem(), none.cert_pem());
    }

    #[test]
    fn a_leaf_verifies_against_the_ca_and_only_for_its_hosts() {
        let d = tempfile::tempdir().unwrap();
        let ca = SandboxCa::load_or_create(d.path(), &["api.example.com".into()]).unwrap();
        let mut roots = rustls::RootCertStore::empty();
        roots.add(ca.cert_der().unwrap()).unwrap();
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let verifier =
            rustls::client::WebPkiServerVerifier::builder_with_provider(Arc::new(roots), provider)
                .build()
                .unwrap();
        use rustls::client::danger::ServerCertVerifier as _;
        let now = rustls::pki_types::UnixTime::now();
        let ok = ca.leaf("api.example.com").unwrap();
        let name = rustls::pki_types::ServerName::try_from("api.example.com").unwrap();
        verifier
            .verify_server_cert(&ok.chain[0], &ok.chain[1..], &name, &[], now)
            .unwrap();
        // Two hours behind (a restored guest): still valid.
        let behind = rustls::pki_types::UnixTime::since_unix_epoch(std::time::Duration::from_secs(
            now.as_secs() - 7200,
        ));
        verifier
            .verify_server_cert(&ok.chain[0], &ok.chain[1..], &name, &[], behind)
            .unwrap();
        // A leaf for a host outside the name constraints is refused by the verifier.
        let bad = ca.leaf("evil.test").unwrap();
        let bad_name = rustls::pki_types::ServerName::try_from("evil.test").unwrap();
        assert!(
            verifier
                .verify_server_cert(&bad.chain[0], &bad.chain[1..], &bad_name, &[], now)
                .is_err()
        );
    }
}
