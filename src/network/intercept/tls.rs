//! The two TLS ends of an intercepted flow: the server config presented to the guest (a leaf
//! from the sandbox CA, ALPN `h2` and `http/1.1`) and the client config used upstream, verified
//! against the host's trust store (its system bundle, which includes locally added CAs) plus an
//! optional extra CA file. Verification is never skipped.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use rustls::pki_types::CertificateDer;
use rustls::pki_types::pem::PemObject as _;

use super::ca::Leaf;

/// Where the host's CA bundle usually is (Debian/Ubuntu/Alpine first, then Fedora/RHEL, SUSE).
pub const SYSTEM_BUNDLES: [&str; 4] = [
    "/etc/ssl/certs/ca-certificates.crt",
    "/etc/pki/tls/certs/ca-bundle.crt",
    "/etc/ssl/ca-bundle.pem",
    "/etc/ssl/cert.pem",
];

/// ALPN offered on both ends.
pub const ALPN: [&[u8]; 2] = [b"h2", b"http/1.1"];

#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    #[error("cannot read CA bundle {path}: {source}")]
    Read {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("no usable CA certificate in {0}")]
    NoRoots(String),
    #[error("TLS configuration: {0}")]
    Config(#[from] rustls::Error),
}

/// The host's system CA bundle, if one of the usual files exists.
pub fn system_bundle() -> Option<PathBuf> {
    SYSTEM_BUNDLES
        .iter()
        .map(PathBuf::from)
        .find(|p| p.is_file())
}

fn provider() -> Arc<rustls::crypto::CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

/// The upstream client config: roots from every file in `bundles` (PEM; files that do not
/// exist are an error, so a configured extra CA that is missing is noticed).
pub fn upstream_client_config(bundles: &[&Path]) -> Result<Arc<rustls::ClientConfig>, TlsError> {
    let mut roots = rustls::RootCertStore::empty();
    for path in bundles {
        let bytes = std::fs::read(path).map_err(|source| TlsError::Read {
            path: path.to_path_buf(),
            source,
        })?;
        let certs: Vec<CertificateDer<'static>> = CertificateDer::pem_slice_iter(&bytes)
            .filter_map(Result::ok)
            .collect();
        let (added, _) = roots.add_parsable_certificates(certs);
        if added == 0 {
            return Err(TlsError::NoRoots(path.display().to_string()));
        }
    }
    if roots.is_empty() {
        return Err(TlsError::NoRoots("(no bundle given)".into()));
    }
    let mut cfg = rustls::ClientConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()?
        .with_root_certificates(roots)
        .with_no_client_auth();
    cfg.alpn_protocols = ALPN.iter().map(|p| p.to_vec()).collect();
    Ok(Arc::new(cfg))
}

/// The server config the guest sees for one host.
pub fn guest_server_config(leaf: &Leaf) -> Result<Arc<rustls::ServerConfig>, TlsError> {
    let mut cfg = rustls::ServerConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()?
        .with_no_client_auth()
        .with_single_cert(leaf.chain.clone(), leaf.key())?;
    cfg.alpn_protocols = ALPN.iter().map(|p| p.to_vec()).collect();
    Ok(Arc::new(cfg))
}
