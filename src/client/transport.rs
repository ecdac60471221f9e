//! How the client reaches the daemon: its unix socket (the default), or TCP named by
//! `TRYBOXI_URL` with the bearer token from `TRYBOXI_TOKEN`.
//!
//! Owns: reading those variables, refusing to send the token in plain text to anything but a
//! loopback address, and TLS with the daemon's certificate pinned by its SHA-256 fingerprint
//! (`TRYBOXI_FINGERPRINT`, printed by `tryboxi token` on the daemon's machine). When the
//! token or fingerprint is not in the environment, this machine's data root provides them.
//! Never: HTTP requests themselves (`client`).

use std::net::IpAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::crypto::WebPkiSupportedAlgorithms;
use rustls::pki_types::{CertificateDer, ServerName, UnixTime};
use rustls::{CertificateError, DigitallySignedStruct, SignatureScheme};
use sha2::{Digest, Sha256};
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::net::{TcpStream, UnixStream};

use super::ClientError;
use crate::config::Paths;

/// A connected byte stream to the daemon.
pub trait Io: AsyncRead + AsyncWrite + Unpin + Send {}
impl<T: AsyncRead + AsyncWrite + Unpin + Send> Io for T {}

/// Where the daemon is.
#[derive(Debug, Clone)]
pub enum Endpoint {
    Unix(PathBuf),
    Tcp {
        /// As written in the URL (`host:port`), also the `Host` header.
        authority: String,
        host: String,
        port: u16,
        token: String,
        tls: Option<Arc<rustls::ClientConfig>>,
    },
}

impl Endpoint {
    /// `TRYBOXI_URL` when set (`http://127.0.0.1:7070` or `https://host:7443`), else the data
    /// root's unix socket.
    pub fn from_env(paths: &Paths) -> Result<Endpoint, String> {
        let url = match std::env::var("TRYBOXI_URL") {
            Ok(u) if !u.trim().is_empty() => u.trim().to_owned(),
            _ => return Ok(Endpoint::Unix(paths.socket())),
        };
        let var = |name: &str| std::env::var(name).ok().filter(|v| !v.trim().is_empty());
        Endpoint::from_url(
            &url,
            var("TRYBOXI_TOKEN"),
            var("TRYBOXI_FINGERPRINT"),
            paths,
        )
    }

    fn from_url(
        url: &str,
        token: Option<String>,
        fingerprint: Option<String>,
        paths: &Paths,
    ) -> Result<Endpoint, String> {
        let uri: hyper::Uri = url
            .parse()
            .map_err(|e| format!("TRYBOXI_URL `{url}`: {e}"))?;
        let tls = match uri.scheme_str() {
            Some("https") => true,
            Some("http") => false,
            _ => return Err(format!("TRYBOXI_URL `{url}`: use http:// or https://")),
        };
        if !matches!(uri.path(), "" | "/") || uri.query().is_some() {
            return Err(format!(
                "TRYBOXI_URL `{url}`: give only scheme, host and port"
            ));
        }
        let authority = uri
            .authority()
            .ok_or_else(|| format!("TRYBOXI_URL `{url}` has no host"))?;
        let port = authority
            .port_u16()
            .ok_or_else(|| format!("TRYBOXI_URL `{url}` has no port"))?;
        let host = authority
            .host()
            .trim_start_matches('[')
            .trim_end_matches(']')
            .to_owned();
        if !tls && !is_loopback(&host) {
            return Err(format!(
                "TRYBOXI_URL `{url}`: refusing to send the API token in plain text to `{host}`; \
                 use https:// (the daemon's `tcp_tls = true`)"
            ));
        }
        let token = match token {
            Some(t) => t.trim().to_owned(),
            None => std::fs::read_to_string(paths.token_file())
                .ok()
                .map(|t| t.trim().to_owned())
                .filter(|t| !t.is_empty())
                .ok_or(
                    "TRYBOXI_URL needs TRYBOXI_TOKEN (`tryboxi token` on the daemon's machine)",
                )?,
        };
        let tls = if tls {
            let pin = match fingerprint {
                Some(f) => f,
                None => local_fingerprint(&paths.tls_cert_file()).ok_or(
                    "an https:// TRYBOXI_URL needs TRYBOXI_FINGERPRINT (`tryboxi token` on the \
                     daemon's machine prints it)",
                )?,
            };
            Some(pinned_config(&pin)?)
        } else {
            None
        };
        Ok(Endpoint::Tcp {
            authority: authority.as_str().to_owned(),
            host,
            port,
            token,
            tls,
        })
    }

    /// What to name in an "unreachable" error.
    pub fn describe(&self) -> PathBuf {
        match self {
            Endpoint::Unix(p) => p.clone(),
            Endpoint::Tcp { authority, tls, .. } => {
                let scheme = if tls.is_some() { "https" } else { "http" };
                PathBuf::from(format!("{scheme}://{authority}"))
            }
        }
    }

    /// The `Host` header and, over TCP, the bearer token.
    pub fn headers(&self) -> (&str, Option<&str>) {
        match self {
            Endpoint::Unix(_) => ("localhost", None),
            Endpoint::Tcp {
                authority, token, ..
            } => (authority, Some(token)),
        }
    }

    pub async fn connect(&self) -> Result<Box<dyn Io>, ClientError> {
        let unreachable = |source| ClientError::Unreachable {
            socket: self.describe(),
            source,
        };
        match self {
            Endpoint::Unix(p) => Ok(Box::new(UnixStream::connect(p).await.map_err(unreachable)?)),
            Endpoint::Tcp {
                host, port, tls, ..
            } => {
                let tcp = TcpStream::connect((host.as_str(), *port))
                    .await
                    .map_err(unreachable)?;
                let _ = tcp.set_nodelay(true);
                let Some(config) = tls else {
                    return Ok(Box::new(tcp));
                };
                let name = ServerName::try_from(host.clone())
                    .map_err(|e| ClientError::Protocol(format!("server name `{host}`: {e}")))?;
                let stream = tokio_rustls::TlsConnector::from(config.clone())
                    .connect(name, tcp)
                    .await
                    .map_err(|e| {
                        ClientError::Protocol(format!(
                            "TLS handshake with {} failed: {}",
                            self.describe().display(),
                            handshake_error(&e)
                        ))
                    })?;
                Ok(Box::new(stream))
            }
        }
    }
}

/// The reason a handshake failed, in words (our own verifier's reason when it refused).
fn handshake_error(e: &std::io::Error) -> String {
    match e.get_ref().and_then(|i| i.downcast_ref::<rustls::Error>()) {
        Some(rustls::Error::InvalidCertificate(CertificateError::Other(o))) => o.0.to_string(),
        _ => e.to_string(),
    }
}

fn is_loopback(host: &str) -> bool {
    host.eq_ignore_ascii_case("localhost")
        || host.parse::<IpAddr>().is_ok_and(|ip| ip.is_loopback())
}

fn local_fingerprint(cert: &Path) -> Option<String> {
    use rustls::pki_types::pem::PemObject;
    let der = CertificateDer::from_pem_file(cert).ok()?;
    Some(crate::daemon::tls::fingerprint(&der))
}

/// The 32 bytes of a fingerprint written as `sha256:` + hex, with or without the prefix and
/// with or without `:` between bytes, in either case.
pub fn parse_fingerprint(s: &str) -> Result<[u8; 32], String> {
    let t = s.trim();
    let t = t
        .get(..7)
        .filter(|p| p.eq_ignore_ascii_case("sha256:"))
        .map_or(t, |_| &t[7..]);
    let hex_digits: String = t.chars().filter(|c| *c != ':').collect();
    let mut out = [0u8; 32];
    hex::decode_to_slice(&hex_digits, &mut out).map_err(|_| {
        format!("TRYBOXI_FINGERPRINT `{s}` is not a SHA-256 fingerprint (sha256:<64 hex digits>)")
    })?;
    Ok(out)
}

/// A rustls client config (ring) that trusts exactly the certificate with this fingerprint.
pub fn pinned_config(fingerprint: &str) -> Result<Arc<rustls::ClientConfig>, String> {
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let verifier = Arc::new(PinnedCert {
        sha256: parse_fingerprint(fingerprint)?,
        algs: provider.signature_verification_algorithms,
    });
    let mut config = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|e| format!("TLS setup: {e}"))?
        .dangerous()
        .with_custom_certificate_verifier(verifier)
        .with_no_client_auth();
    config.alpn_protocols = vec![b"http/1.1".to_vec()];
    Ok(Arc::new(config))
}

/// Trusts one certificate, named by its SHA-256; handshake signatures are still checked
/// against that certificate's key (so only the holder of the daemon's key passes).
#[derive(Debug)]
struct PinnedCert {
    sha256: [u8; 32],
    algs: WebPkiSupportedAlgorithms,
}

#[derive(Debug, thiserror::Error)]
#[error("the daemon's certificate is {got}, not the pinned TRYBOXI_FINGERPRINT")]
struct FingerprintMismatch {
    got: String,
}

impl ServerCertVerifier for PinnedCert {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        _intermediates: &[CertificateDer<'_>],
        _server_name: &ServerName<'_>,
        _ocsp_response: &[u8],
        _now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        if Sha256::digest(end_entity.as_ref()).as_slice() == self.sha256 {
            return Ok(ServerCertVerified::assertion());
        }
        Err(rustls::Error::InvalidCertificate(CertificateError::Other(
            rustls::OtherError(Arc::new(FingerprintMismatch {
                got: crate::daemon::tls::fingerprint(end_entity),
            })),
        )))
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls12_signature(message, cert, dss, &self.algs)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls13_signature(message, cert, dss, &self.algs)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.algs.supported_schemes()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn paths() -> (tempfile::TempDir, Paths) {
        let d = tempfile::tempdir().unwrap();
        let p = Paths {
            root: d.path().to_path_buf(),
        };
        (d, p)
    }

    #[test]
    fn fingerprints_parse_in_every_usual_spelling() {
        let hex = "ab".repeat(32);
        let colons = vec!["AB"; 32].join(":");
        for s in [
            hex.clone(),
            format!("sha256:{hex}"),
            format!("SHA256:{colons}"),
        ] {
            assert_eq!(parse_fingerprint(&s).unwrap(), [0xab; 32], "{s}");
        }
        assert!(parse_fingerprint("sha256:abcd").is_err());
    }

    #[test]
    fn plain_http_off_loopback_is_refused_before_the_token_is_sent() {
        let (_d, p) = paths();
        let t = || Some("tok".to_owned());
        let e = Endpoint::from_url("http://10.0.0.5:7070", t(), None, &p).unwrap_err();
        assert!(e.contains("plain text"), "{e}");
        for ok in [
            "http://127.0.0.1:7070",
            "http://localhost:7070",
            "http://[::1]:7070",
        ] {
            let ep = Endpoint::from_url(ok, t(), None, &p).unwrap();
            assert_eq!(ep.headers().1, Some("tok"));
        }
        let e = Endpoint::from_url("https://10.0.0.5:7443", t(), None, &p).unwrap_err();
        assert!(e.contains("TRYBOXI_FINGERPRINT"), "{e}");
        let fp = format!("sha256:{}", "00".repeat(32));
        let ep = Endpoint::from_url("https://10.0.0.5:7443", t(), Some(fp), &p).unwrap();
        assert_eq!(ep.headers().0, "10.0.0.5:7443");
        assert_eq!(ep.describe(), PathBuf::from("https://10.0.0.5:7443"));
        let e = Endpoint::from_url("http://127.0.0.1:7070", None, None, &p).unwrap_err();
        assert!(e.contains("TRYBOXI_TOKEN"), "{e}");
        assert!(Endpoint::from_url("ftp://127.0.0.1:1", t(), None, &p).is_err());
        assert!(Endpoint::from_url("http://127.0.0.1", t(), None, &p).is_err());
    }
}
