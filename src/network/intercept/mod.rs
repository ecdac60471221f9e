//! The TLS-terminating egress interceptor: for flows to hosts that hold a secret of the
//! sandbox, the daemon ends the guest's TLS with a leaf from the sandbox's own CA, swaps
//! placeholders for values in authorization positions, forwards each request upstream over
//! verified TLS, and scrubs the values out of the responses. Placeholders sent to hosts that
//! are not their secret's are refused with a `secret.blocked` event.
//!
//! Owns: the per-sandbox CA (`ca.rs`), the TLS configs of both ends (`tls.rs`), the per-flow
//! HTTP proxy (`proxy.rs`), the request swap and block check (`swap.rs`), the streaming
//! scrubber and decoders (`scrub.rs`), gRPC's per-message scrub (`grpc.rs`), WebSocket
//! upgrades and their frame scrub (`ws.rs`) and watch (`ws_watch.rs`: audit, last used), the body adapter (`body.rs`), the request-body audit (`audit.rs`), the git proxy's hook
//! (`git.rs`: token injection, push screening, forge API checks).
//! Never: lets a value reach the guest, a log line, an event or an error text; skips upstream
//! certificate verification; intercepts a host without a secret (those stay pass-through).
//!
//! The policy gate decides first (policy, DNS pin, SNI); only then, if the SNI is one of
//! [`Snapshot::intercepted_hosts`](crate::secrets::Snapshot::intercepted_hosts), the stack
//! hands the flow's guest bytes and its already-connected upstream socket (a `CONNECT` tunnel
//! when the daemon has an upstream proxy) to [`Interceptor::serve`], with the [`Dial`] that
//! opens its later upstream connections (new requests, WebSocket upgrades, the git proxy's).

pub mod audit;
pub mod body;
pub mod ca;
pub mod git;
pub mod grpc;
pub mod proxy;
pub mod scrub;
pub mod swap;
pub mod tls;
pub mod ws;
pub mod ws_watch;

#[cfg(test)]
mod git_real_tests;
#[cfg(test)]
mod git_tests;
#[cfg(test)]
mod grpc_tests;
#[cfg(test)]
mod tests;
#[cfg(test)]
mod ws_tests;

use std::sync::Arc;

use tokio::io::{AsyncRead, AsyncWrite};
use tokio::net::TcpStream;

pub use ca::SandboxCa;
pub use swap::Blocked;

use crate::network::upstream_proxy::Dial;
use crate::secrets::SandboxSecrets;

#[derive(Debug, thiserror::Error)]
pub enum InterceptError {
    #[error("upstream connection: {0}")]
    UpstreamDial(#[source] crate::network::upstream_proxy::DialError),
    #[error("upstream TLS: {0}")]
    UpstreamTls(#[source] std::io::Error),
    #[error("upstream HTTP: {0}")]
    UpstreamHttp(#[source] hyper::Error),
    #[error("guest TLS: {0}")]
    GuestTls(#[source] std::io::Error),
    #[error("guest HTTP: {0}")]
    Guest(#[source] BoxError),
    #[error("{0} is not a TLS server name")]
    BadSni(String),
    #[error("bad request: {0}")]
    BadRequest(&'static str),
    #[error(transparent)]
    Ca(#[from] ca::CaError),
    #[error(transparent)]
    Tls(#[from] tls::TlsError),
}

pub use body::BoxError;

/// Where `secret.blocked` goes: `(what was blocked, the host it was sent to)`.
pub type BlockSink = Arc<dyn Fn(&Blocked, &str) + Send + Sync>;

/// Where the git proxy's refusals go: `(host, status, reason)` (`git.refused`; the reason
/// names repositories and refs, never a value).
pub type GitSink = Arc<dyn Fn(&str, u16, &str) + Send + Sync>;

/// Where a swap is reported: the name of the secret whose value a request carried (for
/// `secret ls`'s "last used"; never the value).
pub type UsedSink = Arc<dyn Fn(&str) + Send + Sync>;

/// One sandbox's interceptor: its live secrets, its CA, the upstream trust.
pub struct Interceptor {
    pub(crate) ca: Arc<SandboxCa>,
    pub(crate) secrets: SandboxSecrets,
    pub(crate) upstream_tls: Arc<rustls::ClientConfig>,
    sink: BlockSink,
    git_sink: std::sync::OnceLock<GitSink>,
    used_sink: std::sync::OnceLock<UsedSink>,
}

impl std::fmt::Debug for Interceptor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Interceptor({:?})", self.ca)
    }
}

impl Interceptor {
    pub fn new(
        secrets: SandboxSecrets,
        ca: Arc<SandboxCa>,
        upstream_tls: Arc<rustls::ClientConfig>,
        sink: BlockSink,
    ) -> Arc<Interceptor> {
        Arc::new(Interceptor {
            ca,
            secrets,
            upstream_tls,
            sink,
            git_sink: std::sync::OnceLock::new(),
            used_sink: std::sync::OnceLock::new(),
        })
    }

    /// Where the git proxy's refusals are reported (set once; later calls are ignored).
    pub fn set_git_sink(&self, sink: GitSink) {
        let _ = self.git_sink.set(sink);
    }

    /// Where swaps are reported (set once; later calls are ignored).
    pub fn set_used_sink(&self, sink: UsedSink) {
        let _ = self.used_sink.set(sink);
    }

    /// A request carried secret `name`'s value upstream.
    pub fn used(&self, name: &str) {
        if let Some(s) = self.used_sink.get() {
            s(name)
        }
    }

    /// Record a request or push the git proxy refused (`git.refused`).
    pub fn git_refused(&self, host: &str, status: u16, reason: &str) {
        tracing::info!(host, status, reason, "git proxy refused a request");
        if let Some(s) = self.git_sink.get() {
            s(host, status, reason)
        }
    }

    pub fn secrets(&self) -> &SandboxSecrets {
        &self.secrets
    }

    pub fn ca(&self) -> &Arc<SandboxCa> {
        &self.ca
    }

    /// Whether plaintext HTTP flows are served by [`Interceptor::serve_plain`] (the sandbox
    /// holds a secret whose placeholder must be checked in every request).
    pub fn checks_plaintext(&self) -> bool {
        !self.secrets.current().bindings.is_empty()
    }

    /// Serve one plaintext HTTP/1 flow whose first request the gate allowed for `host`.
    pub async fn serve_plain<G>(
        self: Arc<Self>,
        guest: G,
        upstream: TcpStream,
        dial: Dial,
        host: String,
    ) -> Result<(), InterceptError>
    where
        G: AsyncRead + AsyncWrite + Unpin + Send + 'static,
    {
        proxy::serve_plain(self, guest, upstream, dial, host).await
    }

    /// Whether TLS flows to `host` (normalised, lowercase) are intercepted now. A host new to
    /// the CA re-issues the CA certificate (the guest bundle must then be refreshed).
    pub fn intercepts(&self, host: &str) -> bool {
        let hosts = self.secrets.current().intercepted_hosts();
        if !hosts.iter().any(|h| h.eq_ignore_ascii_case(host)) {
            return false;
        }
        if !self.ca.covers(host)
            && let Err(e) = self.ca.ensure(&hosts)
        {
            tracing::warn!(host, error = %e, "cannot extend the interception CA; flow not intercepted");
            return false;
        }
        true
    }

    /// Record a refused placeholder (`secret.blocked`) or an audited one (`secret.in_body`).
    pub fn blocked(&self, b: &Blocked, host: &str) {
        tracing::info!(secret = %b.secret, host, position = %b.position, refused = b.refused, "secret placeholder seen toward another host");
        (self.sink)(b, host)
    }

    /// Serve one intercepted flow: `guest` carries the guest's TLS bytes (from its ClientHello
    /// on), `upstream` is connected to the pinned address (or tunnelled to `sni` through the
    /// upstream proxy), `dial` opens later connections the same way, `sni` passed the gate.
    pub async fn serve<G>(
        self: Arc<Self>,
        guest: G,
        upstream: TcpStream,
        dial: Dial,
        sni: String,
    ) -> Result<(), InterceptError>
    where
        G: AsyncRead + AsyncWrite + Unpin + Send + 'static,
    {
        proxy::serve(self, guest, upstream, dial, sni).await
    }
}
