//! TLS for the TCP listener (`tcp_tls = true`): the token must never travel in plain text off
//! the machine.
//!
//! Owns: the daemon's self-signed certificate (made once with rcgen and kept in the data root,
//! `tls-cert.pem` and `tls-key.pem`, mode 0600), its SHA-256 fingerprint (what clients pin and
//! `tryboxi token` prints), and the rustls acceptor (ring provider, TLS 1.2 and 1.3, ALPN
//! `http/1.1`).
//! Never: access checks (`middleware`) or the client side (`client::transport`).

use std::io::Write as _;
use std::os::unix::fs::OpenOptionsExt;
use std::path::Path;
use std::sync::Arc;

use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use sha2::{Digest, Sha256};

use super::DaemonError;
use crate::config::Paths;

/// The certificate and key the TCP listener serves.
pub struct Identity {
    pub cert: CertificateDer<'static>,
    key: PrivateKeyDer<'static>,
}

impl Identity {
    pub fn fingerprint(&self) -> String {
        fingerprint(&self.cert)
    }
}

/// `sha256:` and the lowercase hex SHA-256 of a certificate's DER bytes.
pub fn fingerprint(cert_der: &[u8]) -> String {
    format!("sha256:{}", hex::encode(Sha256::digest(cert_der)))
}

/// Load the data root's certificate, or make one (and keep it) when there is none.
pub fn ensure_identity(paths: &Paths) -> Result<Identity, DaemonError> {
    let (cert_path, key_path) = (paths.tls_cert_file(), paths.tls_key_file());
    if cert_path.exists() || key_path.exists() {
        return load(&cert_path, &key_path);
    }
    let names = vec!["localhost".to_owned(), "127.0.0.1".into(), "::1".into()];
    let made = rcgen::generate_simple_self_signed(names)
        .map_err(|e| DaemonError::Setup(format!("cannot make a TLS certificate: {e}")))?;
    // Neither file is ever replaced: a half-written pair is a clear error at the next start
    // (the fingerprint clients pinned must not change behind their back).
    write_private(&key_path, made.signing_key.serialize_pem().as_bytes())?;
    write_private(&cert_path, made.cert.pem().as_bytes())?;
    tracing::info!(cert = %cert_path.display(), fingerprint = %fingerprint(made.cert.der()), "made the TCP listener's TLS certificate");
    load(&cert_path, &key_path)
}

fn load(cert_path: &Path, key_path: &Path) -> Result<Identity, DaemonError> {
    let bad = |path: &Path, e: &dyn std::fmt::Display| {
        DaemonError::Setup(format!(
            "cannot read the TLS {}: {e} (delete {} and {} to make a new certificate; clients \
             then need its new fingerprint)",
            path.display(),
            cert_path.display(),
            key_path.display()
        ))
    };
    let cert = CertificateDer::from_pem_file(cert_path).map_err(|e| bad(cert_path, &e))?;
    let key = PrivateKeyDer::from_pem_file(key_path).map_err(|e| bad(key_path, &e))?;
    Ok(Identity { cert, key })
}

/// Create `path` with mode 0600 and these bytes (never over an existing file).
fn write_private(path: &Path, bytes: &[u8]) -> Result<(), DaemonError> {
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(path)
        .map_err(super::io_err("cannot create", path))?;
    f.write_all(bytes)
        .and_then(|()| f.sync_all())
        .map_err(super::io_err("cannot write", path))
}

/// The rustls acceptor for `identity` (ring provider).
pub fn acceptor(identity: Identity) -> Result<tokio_rustls::TlsAcceptor, DaemonError> {
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let mut config = rustls::ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .and_then(|b| {
            b.with_no_client_auth()
                .with_single_cert(vec![identity.cert], identity.key)
        })
        .map_err(|e| DaemonError::Setup(format!("TLS setup: {e}")))?;
    config.alpn_protocols = vec![b"http/1.1".to_vec()];
    Ok(tokio_rustls::TlsAcceptor::from(Arc::new(config)))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    #[test]
    fn certificate_is_made_once_private_and_kept() {
        let dir = tempfile::tempdir().unwrap();
        let paths = Paths {
            root: dir.path().to_path_buf(),
        };
        let first = ensure_identity(&paths).unwrap();
        for f in [paths.tls_cert_file(), paths.tls_key_file()] {
            let mode = std::fs::metadata(&f).unwrap().permissions().mode() & 0o777;
            assert_eq!(mode, 0o600, "{}", f.display());
        }
        let again = ensure_identity(&paths).unwrap();
        assert_eq!(first.fingerprint(), again.fingerprint());
        assert!(first.fingerprint().starts_with("sha256:"));
        assert_eq!(first.fingerprint().len(), 7 + 64);
        acceptor(again).unwrap();
    }

    #[test]
    fn a_half_made_identity_is_a_clear_error() {
        let dir = tempfile::tempdir().unwrap();
        let paths = Paths {
            root: dir.path().to_path_buf(),
        };
        std::fs::write(paths.tls_cert_file(), "not pem").unwrap();
        let e = ensure_identity(&paths).err().unwrap().to_string();
        assert!(e.contains("cannot read the TLS"), "{e}");
    }
}
