//! Test TLS upstreams: a fresh test CA (its certificate written as PEM where the test says)
//! and a rustls server configuration for some names, signed by it.

use std::path::Path;
use std::sync::Arc;

use rcgen::{BasicConstraints, CertificateParams, DnType, IsCa, Issuer, KeyPair};

/// A new CA (common name `ca_cn`, if any) written to `ca_pem_path`, and a server config (ALPN
/// `http/1.1`) whose certificate for `hosts` that CA signed.
pub fn ca_signed_server(
    ca_pem_path: &Path,
    ca_cn: Option<&str>,
    hosts: &[&str],
) -> Arc<rustls::ServerConfig> {
    let ca_key = KeyPair::generate().unwrap();
    let mut p = CertificateParams::default();
    if let Some(cn) = ca_cn {
        p.distinguished_name.push(DnType::CommonName, cn);
    }
    p.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    let ca_cert = p.self_signed(&ca_key).unwrap();
    std::fs::write(ca_pem_path, ca_cert.pem()).unwrap();
    let issuer = Issuer::new(p, ca_key);
    let key = KeyPair::generate().unwrap();
    let cert = CertificateParams::new(hosts.iter().map(|h| h.to_string()).collect::<Vec<_>>())
        .unwrap()
        .signed_by(&key, &issuer)
        .unwrap();
    let mut cfg = rustls::ServerConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()
    .unwrap()
    .with_no_client_auth()
    .with_single_cert(
        vec![cert.der().clone()],
        rustls::pki_types::PrivateKeyDer::Pkcs8(key.serialize_der().into()),
    )
    .unwrap();
    cfg.alpn_protocols = vec![b"http/1.1".to_vec()];
    Arc::new(cfg)
}
