//! The explicit upstream proxy the daemon sends guest egress through (`[network]
//! upstream_proxy`, else `HTTPS_PROXY`/`HTTP_PROXY`/`ALL_PROXY` in the daemon's environment).
//!
//! Owns: parsing the proxy URL and the no-proxy list, deciding whether a destination bypasses
//! the proxy, and opening one upstream connection ([`Dial`]): directly, or as `CONNECT
//! name:port` through an `http://` proxy (Basic `Proxy-Authorization` when the URL has
//! credentials).
//! Never: decides policy (the stack calls it only for flows the gate allowed, with the name the
//! gate checked); puts the proxy's credentials in a log line, an event, an error or `Debug`
//! output ([`UpstreamProxy::display`] masks them).

use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;

use base64::Engine as _;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// The environment variables read when the config does not say, in this order (the first
/// non-empty one wins).
pub const PROXY_ENV: [&str; 6] = [
    "https_proxy",
    "HTTPS_PROXY",
    "http_proxy",
    "HTTP_PROXY",
    "all_proxy",
    "ALL_PROXY",
];
pub const NO_PROXY_ENV: [&str; 2] = ["no_proxy", "NO_PROXY"];

/// Largest proxy answer header read back from a `CONNECT`.
const MAX_ANSWER: usize = 8 * 1024;

#[derive(Debug, thiserror::Error)]
pub enum ProxyConfigError {
    #[error(
        "{source_name}: proxy scheme {scheme}:// is not supported (only http:// proxies, used with CONNECT); set [network] upstream_proxy = \"\" to connect directly"
    )]
    Scheme { source_name: String, scheme: String },
    #[error("{source_name}: not a proxy URL ({why})")]
    Parse { source_name: String, why: String },
    #[error("{source_name}: bad no-proxy entry {entry:?}")]
    NoProxy { source_name: String, entry: String },
}

#[derive(Debug, thiserror::Error)]
pub enum DialError {
    #[error("connect {target}: {source}")]
    Direct {
        target: SocketAddr,
        #[source]
        source: std::io::Error,
    },
    #[error("proxy {proxy} unreachable: {why}")]
    Unreachable { proxy: String, why: String },
    #[error("proxy {proxy} refused CONNECT {target}: {status} {reason}")]
    Refused {
        proxy: String,
        target: String,
        status: u16,
        reason: String,
    },
    #[error("proxy {proxy} answered CONNECT {target} badly: {why}")]
    BadAnswer {
        proxy: String,
        target: String,
        why: String,
    },
}

/// Where the proxy setting came from (shown by `tryboxi doctor`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ProxySource {
    Config,
    Env(&'static str),
}

impl std::fmt::Display for ProxySource {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ProxySource::Config => f.write_str("[network] upstream_proxy"),
            ProxySource::Env(v) => write!(f, "${v}"),
        }
    }
}

/// One no-proxy entry.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Bypass {
    All,
    /// A name and its subdomains (`example.com`, `.example.com`, `*.example.com`).
    Domain(String, Option<u16>),
    Net(ipnet::IpNet, Option<u16>),
}

/// The proxy in force. `Debug` and [`UpstreamProxy::display`] never show credentials.
#[derive(Clone)]
pub struct UpstreamProxy {
    host: String,
    port: u16,
    /// `Basic base64(user:password)`, when the URL had credentials.
    auth: Option<String>,
    no_proxy: Vec<Bypass>,
    pub source: ProxySource,
    pub no_proxy_source: Option<ProxySource>,
}

impl std::fmt::Debug for UpstreamProxy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "UpstreamProxy({} from {})", self.display(), self.source)
    }
}

impl UpstreamProxy {
    /// `http://host:port`, with `***@` in place of credentials.
    pub fn display(&self) -> String {
        let cred = if self.auth.is_some() { "***@" } else { "" };
        format!("http://{cred}{}", self.authority())
    }

    fn authority(&self) -> String {
        if self.host.contains(':') {
            format!("[{}]:{}", self.host, self.port)
        } else {
            format!("{}:{}", self.host, self.port)
        }
    }

    /// The no-proxy entries, as configured (for `doctor`).
    pub fn no_proxy_len(&self) -> usize {
        self.no_proxy.len()
    }

    /// Whether a connection to `addr` (known as `name`, if the gate checked one) goes directly:
    /// loopback destinations always do (only the daemon's own test overrides map flows there);
    /// others when the no-proxy list matches the name or the address.
    pub fn bypass(&self, name: Option<&str>, addr: SocketAddr) -> bool {
        let ip = canonical(addr.ip());
        if ip.is_loopback() {
            return true;
        }
        let port = addr.port();
        let name = name.map(|n| n.trim_end_matches('.').to_ascii_lowercase());
        self.no_proxy.iter().any(|b| match b {
            Bypass::All => true,
            Bypass::Net(net, p) => p.is_none_or(|p| p == port) && net.contains(&ip),
            Bypass::Domain(d, p) => {
                p.is_none_or(|p| p == port)
                    && name.as_deref().is_some_and(|n| {
                        n == d
                            || (n.len() > d.len() && n.ends_with(d.as_str()) && {
                                n.as_bytes()[n.len() - d.len() - 1] == b'.'
                            })
                    })
            }
        })
    }

    /// Whether connections to `name` go through the proxy whatever their port (no `*` and no
    /// portless domain entry matches it): the sandbox resolver may then answer a name the host
    /// cannot resolve with a synthetic address, since the proxy resolves it.
    pub fn proxies_name(&self, name: &str) -> bool {
        let n = name.trim_end_matches('.').to_ascii_lowercase();
        !self.no_proxy.iter().any(|b| match b {
            Bypass::All => true,
            Bypass::Net(..) => false,
            Bypass::Domain(d, port) => {
                port.is_none()
                    && (n == *d
                        || (n.len() > d.len()
                            && n.ends_with(d.as_str())
                            && n.as_bytes()[n.len() - d.len() - 1] == b'.'))
            }
        })
    }

    /// Whether the proxy accepts a TCP connection (blocking, for `doctor`; no `CONNECT` is
    /// sent). The error text never holds credentials.
    pub fn probe(&self, timeout: std::time::Duration) -> Result<(), String> {
        use std::net::ToSocketAddrs as _;
        let addrs: Vec<SocketAddr> = (self.host.as_str(), self.port)
            .to_socket_addrs()
            .map_err(|e| format!("cannot resolve {}: {e}", self.host))?
            .collect();
        let mut last = format!("{} has no address", self.host);
        for a in addrs {
            match std::net::TcpStream::connect_timeout(&a, timeout) {
                Ok(_) => return Ok(()),
                Err(e) => last = format!("connect {a}: {e}"),
            }
        }
        Err(last)
    }

    /// A TCP connection to the proxy itself (its name resolved by the host).
    pub async fn connect_proxy(&self) -> Result<TcpStream, DialError> {
        let unreachable = |why: String| DialError::Unreachable {
            proxy: self.display(),
            why,
        };
        let stream = TcpStream::connect((self.host.as_str(), self.port))
            .await
            .map_err(|e| unreachable(e.to_string()))?;
        let _ = stream.set_nodelay(true);
        Ok(stream)
    }

    /// Ask the proxy on `stream` for a tunnel to `host:port`; the stream is the tunnel when
    /// this returns (nothing past the proxy's answer header has been read).
    pub async fn tunnel(
        &self,
        mut stream: TcpStream,
        host: &str,
        port: u16,
    ) -> Result<TcpStream, DialError> {
        let target = if host.contains(':') {
            format!("[{host}]:{port}")
        } else {
            format!("{host}:{port}")
        };
        let mut req = format!("CONNECT {target} HTTP/1.1\r\nHost: {target}\r\n");
        if let Some(a) = &self.auth {
            req.push_str(&format!("Proxy-Authorization: {a}\r\n"));
        }
        req.push_str("\r\n");
        let io = |e: std::io::Error| DialError::Unreachable {
            proxy: self.display(),
            why: e.to_string(),
        };
        stream.write_all(req.as_bytes()).await.map_err(io)?;
        // Byte by byte: whatever follows the header belongs to the tunnel.
        let mut head = Vec::with_capacity(128);
        while !head.ends_with(b"\r\n\r\n") {
            if head.len() >= MAX_ANSWER {
                return Err(self.bad(&target, "answer header too long"));
            }
            let b = stream.read_u8().await.map_err(|e| {
                if e.kind() == std::io::ErrorKind::UnexpectedEof {
                    self.bad(&target, "closed before answering")
                } else {
                    io(e)
                }
            })?;
            head.push(b);
        }
        let mut headers = [httparse::EMPTY_HEADER; 32];
        let mut resp = httparse::Response::new(&mut headers);
        match resp.parse(&head) {
            Ok(httparse::Status::Complete(_)) => {}
            _ => return Err(self.bad(&target, "not an HTTP answer")),
        }
        let status = resp.code.unwrap_or(0);
        if !(200..300).contains(&status) {
            return Err(DialError::Refused {
                proxy: self.display(),
                target,
                status,
                reason: resp.reason.unwrap_or("").chars().take(80).collect(),
            });
        }
        Ok(stream)
    }

    fn bad(&self, target: &str, why: &str) -> DialError {
        DialError::BadAnswer {
            proxy: self.display(),
            target: target.to_owned(),
            why: why.to_owned(),
        }
    }
}

/// How to open (again) one flow's upstream connection: to `addr` directly, or through `proxy`
/// as `CONNECT name:port` (the IP when no name was checked).
#[derive(Debug, Clone)]
pub struct Dial {
    pub addr: SocketAddr,
    pub name: Option<String>,
    pub proxy: Option<Arc<UpstreamProxy>>,
}

impl Dial {
    /// The route for `addr` known as `name`: through `proxy` unless its no-proxy list matches.
    pub fn route(addr: SocketAddr, name: Option<&str>, proxy: Option<&Arc<UpstreamProxy>>) -> Dial {
        Dial {
            addr,
            name: name.map(str::to_owned),
            proxy: proxy.filter(|p| !p.bypass(name, addr)).cloned(),
        }
    }

    /// The `CONNECT` target's host: the checked name, else the address.
    pub fn target_host(&self) -> String {
        self.name
            .clone()
            .unwrap_or_else(|| canonical(self.addr.ip()).to_string())
    }

    /// A direct connection to `addr` (no proxy), e.g. for a test's upstream.
    pub fn direct(addr: SocketAddr, name: Option<&str>) -> Dial {
        Dial::route(addr, name, None)
    }

    /// Whether this route goes through the proxy.
    pub fn via_proxy(&self) -> bool {
        self.proxy.is_some()
    }

    pub async fn connect(&self) -> Result<TcpStream, DialError> {
        match &self.proxy {
            None => TcpStream::connect(self.addr)
                .await
                .map_err(|source| DialError::Direct {
                    target: self.addr,
                    source,
                }),
            Some(p) => {
                let s = p.connect_proxy().await?;
                p.tunnel(s, &self.target_host(), self.addr.port()).await
            }
        }
    }
}

fn canonical(ip: IpAddr) -> IpAddr {
    match ip {
        IpAddr::V6(v6) => v6.to_ipv4_mapped().map(IpAddr::V4).unwrap_or(ip),
        v4 => v4,
    }
}

/// The proxy in force: `config` (`[network] upstream_proxy`; `""` = none) else the first of
/// [`PROXY_ENV`] that `env` has; the no-proxy list from `config_no_proxy` else [`NO_PROXY_ENV`].
pub fn resolve(
    config: Option<&str>,
    config_no_proxy: Option<&[String]>,
    env: impl Fn(&str) -> Option<String>,
) -> Result<Option<UpstreamProxy>, ProxyConfigError> {
    let nonempty = |v: &&'static str| {
        let v: &'static str = v;
        env(v)
            .filter(|s| !s.trim().is_empty())
            .map(move |s| (v, s.trim().to_owned()))
    };
    let (url, source) = match config {
        Some(c) if c.trim().is_empty() => return Ok(None),
        Some(c) => (c.trim().to_owned(), ProxySource::Config),
        None => match PROXY_ENV.iter().find_map(nonempty) {
            Some((v, url)) => (url, ProxySource::Env(v)),
            None => return Ok(None),
        },
    };
    let mut proxy = parse_url(&url, &source)?;
    let (entries, no_source): (Vec<String>, Option<ProxySource>) = match config_no_proxy {
        Some(list) => (list.to_vec(), Some(ProxySource::Config)),
        None => match NO_PROXY_ENV.iter().find_map(nonempty) {
            Some((v, s)) => (
                s.split(',').map(|e| e.trim().to_owned()).collect(),
                Some(ProxySource::Env(v)),
            ),
            None => (Vec::new(), None),
        },
    };
    let name = no_source
        .as_ref()
        .map(|s| s.to_string())
        .unwrap_or_default();
    for e in entries.iter().filter(|e| !e.is_empty()) {
        proxy
            .no_proxy
            .push(parse_bypass(e).ok_or_else(|| ProxyConfigError::NoProxy {
                source_name: name.clone(),
                entry: e.clone(),
            })?);
    }
    proxy.no_proxy_source = no_source;
    Ok(Some(proxy))
}

/// [`resolve`] with the daemon's own environment.
pub fn from_env(
    config: Option<&str>,
    config_no_proxy: Option<&[String]>,
) -> Result<Option<UpstreamProxy>, ProxyConfigError> {
    resolve(config, config_no_proxy, |v| std::env::var(v).ok())
}

fn parse_url(raw: &str, source: &ProxySource) -> Result<UpstreamProxy, ProxyConfigError> {
    let source_name = source.to_string();
    // `proxy:3128` (no scheme) means http://, as curl reads it.
    let with_scheme = if raw.contains("://") {
        raw.to_owned()
    } else {
        format!("http://{raw}")
    };
    // The error texts below never quote the URL: it may hold a password.
    let parse = |why: &str| ProxyConfigError::Parse {
        source_name: source_name.clone(),
        why: why.to_owned(),
    };
    let url = url::Url::parse(&with_scheme).map_err(|e| parse(&e.to_string()))?;
    if url.scheme() != "http" {
        return Err(ProxyConfigError::Scheme {
            source_name,
            scheme: url.scheme().to_owned(),
        });
    }
    if !matches!(url.path(), "" | "/") || url.query().is_some() || url.fragment().is_some() {
        return Err(parse("a proxy URL has no path, query or fragment"));
    }
    let host = match url.host() {
        Some(url::Host::Domain(d)) => d.to_owned(),
        Some(url::Host::Ipv4(v4)) => v4.to_string(),
        Some(url::Host::Ipv6(v6)) => v6.to_string(),
        None => return Err(parse("no host")),
    };
    let decode = |s: &str| {
        percent_encoding::percent_decode_str(s)
            .decode_utf8()
            .map(|c| c.into_owned())
            .map_err(|_| parse("credentials are not UTF-8"))
    };
    let auth = if url.username().is_empty() && url.password().is_none() {
        None
    } else {
        let user = decode(url.username())?;
        let pass = decode(url.password().unwrap_or(""))?;
        let b64 = base64::engine::general_purpose::STANDARD.encode(format!("{user}:{pass}"));
        Some(format!("Basic {b64}"))
    };
    Ok(UpstreamProxy {
        host,
        port: url.port_or_known_default().unwrap_or(80),
        auth,
        no_proxy: Vec::new(),
        source: source.clone(),
        no_proxy_source: None,
    })
}

/// One no-proxy entry: `*`, a domain (`example.com`, `.example.com`, `*.example.com`), an IP
/// or a CIDR, each optionally with `:port` (IPv6 in brackets then: `[::1]:8080`).
fn parse_bypass(entry: &str) -> Option<Bypass> {
    let e = entry.trim().to_ascii_lowercase();
    if e == "*" {
        return Some(Bypass::All);
    }
    if let Ok(net) = e.parse::<ipnet::IpNet>() {
        return Some(Bypass::Net(net, None));
    }
    if let Ok(ip) = e.parse::<IpAddr>() {
        return Some(Bypass::Net(ipnet::IpNet::from(canonical(ip)), None));
    }
    let (body, port) = split_port(&e)?;
    if let Ok(net) = body.parse::<ipnet::IpNet>() {
        return Some(Bypass::Net(net, port));
    }
    if let Ok(ip) = body.parse::<IpAddr>() {
        return Some(Bypass::Net(ipnet::IpNet::from(canonical(ip)), port));
    }
    let d = body
        .trim_start_matches("*.")
        .trim_start_matches('.')
        .trim_end_matches('.');
    let ok = !d.is_empty()
        && d.bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'.' || b == b'_');
    ok.then(|| Bypass::Domain(d.to_owned(), port))
}

fn split_port(e: &str) -> Option<(&str, Option<u16>)> {
    if let Some(rest) = e.strip_prefix('[') {
        let (ip, tail) = rest.split_once(']')?;
        return match tail.strip_prefix(':') {
            Some(p) => Some((ip, Some(p.parse().ok()?))),
            None if tail.is_empty() => Some((ip, None)),
            None => None,
        };
    }
    match e.rsplit_once(':') {
        Some((h, p)) if !h.contains(':') => Some((h, Some(p.parse().ok()?))),
        _ => Some((e, None)),
    }
}

#[cfg(test)]
#[path = "upstream_proxy_tests.rs"]
mod tests;
