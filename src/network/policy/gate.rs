//! [`PolicyGate`]: the policy side of one sandbox's network (implements [`Gate`]).
//!
//! connect (SYN time): blocked ranges -> deny; UDP -> deny (DNS goes to the sandbox resolver
//! through [`Gate::dns`], QUIC and everything else is refused); ports 53/853 elsewhere ->
//! deny (direct resolvers, DoT); IP/CIDR deny then allow rules; on 80/443 an IP pinned by the
//! sandbox resolver for a name the policy allows on that port -> allow with inspection; else
//! deny. inspect (first bytes): the SNI (443) or Host (80) must be allowed now AND pinned to
//! this destination IP. dns: see `network::dns`; with an upstream proxy, an allowed name the
//! host cannot resolve gets a synthetic address (`synthetic.rs`). Policy changes apply to the
//! next decision.

use std::collections::HashMap;
use std::net::{IpAddr, SocketAddr};
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, Instant};

use futures_util::future::BoxFuture;

use super::blocked::{self, HostAddrs};
use super::host::{self, canonical_ip};
use super::pins::Pins;
use super::rules::{Decision, Policy};
use super::synthetic::Synthetic;
use crate::network::dns::{self, QType, Rcode, Upstream};
use crate::network::gate::{
    ConnectVerdict, Flow, FlowEvent, Gate, Handoff, Inspect, InspectVerdict, Proto,
};
use crate::network::intercept::{BlockSink, Blocked, Interceptor, SandboxCa, swap};
use crate::network::sniff::{self, Sniffed};
use crate::network::upstream_proxy::UpstreamProxy;
use crate::secrets::SandboxSecrets;

/// What a gate reports besides flows (DNS decisions), for events and metrics.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum NetEvent {
    Flow(FlowEvent),
    /// A DNS question not answered upstream (policy) or whose answer was dropped (rebinding).
    DnsDenied {
        name: String,
        qtype: String,
        reason: String,
    },
    /// A secret's placeholder was sent (or looked up) toward a host that is not one of the
    /// secret's hosts, and refused. Names the secret, never its value.
    SecretBlocked {
        secret: String,
        host: String,
        /// `header <name>`, `query`, `dns name`.
        position: String,
    },
    /// A secret's placeholder went, allowed, in a request body to a host that is not one of its
    /// hosts (agents echo tool output to their model): audited, not refused.
    SecretInBody {
        secret: String,
        host: String,
    },
    /// The git proxy refused a request or a push (`reason` names repositories and refs).
    GitRefused {
        host: String,
        status: u16,
        reason: String,
    },
    /// Events dropped by the rate limit since the last one that went out.
    Suppressed {
        count: u64,
    },
}

/// Where a gate's events go: `(sandbox id, event)`.
pub type NetEventSink = Arc<dyn Fn(&str, NetEvent) + Send + Sync>;

/// Daemon-wide settings every gate shares.
pub struct GateSettings {
    /// The resolver allowed names are looked up with.
    pub upstream: Arc<dyn Upstream>,
    /// TEST/OVERRIDE: names answered from here instead of the upstream resolver.
    pub static_hosts: HashMap<String, Vec<IpAddr>>,
    /// TEST/OVERRIDE: an allowed flow to the key really connects to the value.
    pub upstream_map: HashMap<SocketAddr, SocketAddr>,
    pub host_addrs: HostAddrs,
    /// Upstream lookups in flight per sandbox; more get SERVFAIL (bounded memory and load).
    pub max_dns_inflight: usize,
    /// Events per second per sandbox before they are counted instead of recorded.
    pub events_per_sec: u32,
    /// Upstream TLS of intercepted flows (system trust store + configured extra CA); `None`:
    /// no interception.
    pub intercept_tls: Option<Arc<rustls::ClientConfig>>,
    /// The explicit proxy upstream connections go through (`[network] upstream_proxy` or the
    /// daemon's `HTTPS_PROXY`...); `None`: direct.
    pub upstream_proxy: Option<Arc<UpstreamProxy>>,
}

impl GateSettings {
    pub fn new(upstream: Arc<dyn Upstream>) -> GateSettings {
        GateSettings {
            upstream,
            static_hosts: HashMap::new(),
            upstream_map: HashMap::new(),
            host_addrs: HostAddrs::default(),
            max_dns_inflight: 64,
            events_per_sec: 50,
            intercept_tls: None,
            upstream_proxy: None,
        }
    }
}

pub struct PolicyGate {
    inner: Arc<Inner>,
}

struct Inner {
    sandbox: String,
    policy: RwLock<Arc<Policy>>,
    pins: Mutex<Pins>,
    settings: Arc<GateSettings>,
    sink: NetEventSink,
    dns_slots: Arc<tokio::sync::Semaphore>,
    limiter: Mutex<RateLimit>,
    /// The sandbox's secrets interceptor, once it has one.
    interception: RwLock<Option<Arc<Interceptor>>>,
    /// Addresses answered for names only the upstream proxy reaches.
    synthetic: Mutex<Synthetic>,
}

impl PolicyGate {
    pub fn new(
        sandbox: &str,
        policy: Policy,
        settings: Arc<GateSettings>,
        sink: NetEventSink,
    ) -> Arc<PolicyGate> {
        let slots = settings.max_dns_inflight.max(1);
        let rate = settings.events_per_sec.max(1);
        Arc::new(PolicyGate {
            inner: Arc::new(Inner {
                sandbox: sandbox.to_owned(),
                policy: RwLock::new(Arc::new(policy)),
                pins: Mutex::new(Pins::default()),
                settings,
                sink,
                dns_slots: Arc::new(tokio::sync::Semaphore::new(slots)),
                limiter: Mutex::new(RateLimit::new(rate)),
                interception: RwLock::new(None),
                synthetic: Mutex::new(Synthetic::default()),
            }),
        })
    }

    /// Replace the policy; the next decision uses it.
    pub fn set_policy(&self, p: Policy) {
        *self.inner.policy.write().unwrap_or_else(|e| e.into_inner()) = Arc::new(p);
    }

    #[cfg(test)]
    pub fn policy(&self) -> Arc<Policy> {
        self.inner.policy()
    }

    /// Intercept TLS flows to the hosts of `secrets` (read per flow, so a secret added later
    /// takes effect on the next connection) with leaves from `ca`, and refuse placeholders sent
    /// elsewhere. `false` (and nothing changes) when the daemon has no upstream trust store.
    pub fn set_interception(&self, secrets: SandboxSecrets, ca: Arc<SandboxCa>) -> bool {
        let Some(tls) = self.inner.settings.intercept_tls.clone() else {
            tracing::warn!(sandbox = %self.inner.sandbox, "no upstream CA bundle: secrets are not intercepted");
            return false;
        };
        let weak = Arc::downgrade(&self.inner);
        let sink: BlockSink = Arc::new(move |b: &Blocked, host: &str| {
            if let Some(inner) = weak.upgrade() {
                inner.emit_blocked(b, host);
            }
        });
        let icpt = Interceptor::new(secrets, ca, tls, sink);
        let weak = Arc::downgrade(&self.inner);
        icpt.set_git_sink(Arc::new(move |host: &str, status: u16, reason: &str| {
            if let Some(inner) = weak.upgrade() {
                inner.emit(NetEvent::GitRefused {
                    host: host.to_owned(),
                    status,
                    reason: reason.to_owned(),
                });
            }
        }));
        *self
            .inner
            .interception
            .write()
            .unwrap_or_else(|e| e.into_inner()) = Some(icpt);
        true
    }

    pub fn interceptor(&self) -> Option<Arc<Interceptor>> {
        self.inner.interceptor()
    }
}

impl Inner {
    fn policy(&self) -> Arc<Policy> {
        self.policy
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    fn pinned(&self, ip: IpAddr) -> Vec<String> {
        let pins = self.pins.lock().unwrap_or_else(|e| e.into_inner());
        pins.names(ip, Instant::now())
            .into_iter()
            .map(str::to_owned)
            .collect()
    }

    fn interceptor(&self) -> Option<Arc<Interceptor>> {
        self.interception
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    fn emit_blocked(&self, b: &Blocked, host: &str) {
        if !b.refused {
            self.emit(NetEvent::SecretInBody {
                secret: b.secret.clone(),
                host: host.to_owned(),
            });
            return;
        }
        metrics::counter!(crate::telemetry::metrics::NET_FLOWS, "verdict" => "secret_blocked", "proto" => "tcp")
            .increment(1);
        self.emit(NetEvent::SecretBlocked {
            secret: b.secret.clone(),
            host: host.to_owned(),
            position: b.position.clone(),
        });
    }

    /// A placeholder in an authorization position of a plaintext request to `host`.
    fn plaintext_blocked(&self, bytes: &[u8], host: &str) -> Option<InspectVerdict> {
        let icpt = self.interceptor()?;
        let snap = icpt.secrets().current();
        let b = swap::find_blocked_in_http1(bytes, &snap, host)?;
        self.emit_blocked(&b, host);
        Some(InspectVerdict::Deny {
            reason: format!(
                "the placeholder of secret {} ({}) is refused: {host} is not one of its hosts",
                b.secret, b.position
            ),
            host: Some(host.to_owned()),
        })
    }

    /// A plaintext flow's hand-off when the sandbox holds secrets: every later request on the
    /// connection is checked too, not only the first one seen here.
    fn intercept_plain(&self, host: &str) -> Option<Handoff> {
        let icpt = self.interceptor()?;
        if !icpt.checks_plaintext() {
            return None;
        }
        let host = host.to_owned();
        Some(Handoff(Arc::new(move |guest, upstream, dial| {
            let (icpt, host) = (icpt.clone(), host.clone());
            Box::pin(async move {
                if let Err(e) = icpt.serve_plain(guest, upstream, dial, host.clone()).await {
                    tracing::debug!(%host, error = %e, "checked plaintext flow ended");
                }
            })
        })))
    }

    /// The flow's hand-off to the interceptor when `host` holds a secret.
    fn intercept(&self, host: &str) -> Option<Handoff> {
        let icpt = self.interceptor()?;
        if !icpt.intercepts(host) {
            return None;
        }
        let sni = host.to_owned();
        Some(Handoff(Arc::new(move |guest, upstream, dial| {
            let (icpt, sni) = (icpt.clone(), sni.clone());
            Box::pin(async move {
                if let Err(e) = icpt.serve(guest, upstream, dial, sni.clone()).await {
                    tracing::debug!(host = %sni, error = %e, "intercepted flow ended");
                }
            })
        })))
    }

    fn is_synthetic(&self, ip: IpAddr) -> bool {
        self.settings.upstream_proxy.is_some()
            && self
                .synthetic
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .is_assigned(ip)
    }

    /// The answer to `q` for the allowed `name` the host resolver gave no address for, when
    /// the upstream proxy carries it: a synthetic address (A) pinned to it, or an empty answer
    /// (other types). `None` without a proxy, for a no-proxy name, or when the table is full.
    fn synthetic_answer(&self, q: &dns::GuestQuery, name: &str) -> Option<Vec<u8>> {
        let proxy = self.settings.upstream_proxy.as_ref()?;
        if !proxy.proxies_name(name) {
            return None;
        }
        if q.qtype != QType::A {
            dns_outcome("nodata");
            return Some(dns::reply(q, Rcode::NoError, &[]));
        }
        let ip = self
            .synthetic
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .assign(name)?;
        let ips = [IpAddr::V4(ip)];
        self.pins.lock().unwrap_or_else(|e| e.into_inner()).add(
            name,
            &ips,
            Duration::from_secs(60),
            Instant::now(),
        );
        tracing::debug!(sandbox = %self.sandbox, %name, %ip, proxy = %proxy.display(), "host resolver has no address; synthetic answer for the upstream proxy");
        dns_outcome("synthetic");
        let a = dns::Answer::from_ips(name, QType::A, &ips, 60);
        Some(dns::reply(q, Rcode::NoError, &a.records))
    }

    fn blocked(&self, ip: IpAddr) -> Option<String> {
        blocked::why_blocked(ip, &self.settings.host_addrs.get())
    }

    fn emit(&self, ev: NetEvent) {
        let suppressed = {
            let mut l = self.limiter.lock().unwrap_or_else(|e| e.into_inner());
            match l.take(Instant::now()) {
                Some(s) => s,
                None => return,
            }
        };
        if suppressed > 0 {
            (self.sink)(&self.sandbox, NetEvent::Suppressed { count: suppressed });
        }
        (self.sink)(&self.sandbox, ev);
    }

    fn connect(&self, flow: &Flow) -> ConnectVerdict {
        let deny = |reason: String| ConnectVerdict::Deny { reason };
        let ip = canonical_ip(flow.dst.ip());
        let port = flow.dst.port();
        // This sandbox's own synthetic answers (names only the proxy reaches) are in a blocked
        // range; they are decided by name only (pins), never by IP rules.
        let synthetic = self.is_synthetic(ip);
        if !synthetic && let Some(why) = self.blocked(ip) {
            return deny(format!("always blocked: {why}"));
        }
        if flow.proto == Proto::Udp {
            return deny(match port {
                443 => "QUIC (UDP 443) is blocked; HTTPS over TCP works".into(),
                53 => "direct DNS resolvers are refused; use the sandbox resolver".into(),
                _ => "UDP is limited to DNS through the sandbox resolver".into(),
            });
        }
        if port == 53 || port == 853 {
            return deny(format!(
                "direct DNS resolvers (TCP {port}) are refused; use the sandbox resolver"
            ));
        }
        let upstream = self.upstream_for(flow.dst);
        let policy = self.policy();
        let by_ip = if synthetic {
            None
        } else {
            policy.decide_ip(ip, port)
        };
        match by_ip {
            Some(Decision::Deny(r)) => return deny(r),
            Some(Decision::Allow(rule)) => {
                return ConnectVerdict::Allow {
                    upstream,
                    inspect: Inspect::Nothing,
                    rule,
                };
            }
            None => {}
        }
        if port == 80 || port == 443 {
            let names = self.pinned(ip);
            for n in &names {
                if let Decision::Allow(rule) = policy.decide_name(n, port) {
                    return ConnectVerdict::Allow {
                        upstream,
                        inspect: if port == 443 {
                            Inspect::TlsSni
                        } else {
                            Inspect::HttpHost
                        },
                        rule: format!("{rule} (via the DNS answer for {n})"),
                    };
                }
            }
            if names.is_empty() {
                return deny(format!(
                    "{ip} was not answered by the sandbox resolver for an allowed name \
                     (hard-coded IP?)"
                ));
            }
            return deny(format!(
                "{ip} was answered only for names not allowed on port {port}: {}",
                names.join(", ")
            ));
        }
        deny(format!(
            "no rule allows {ip}:{port} (name rules cover ports 80 and 443; other ports need an \
             IP or CIDR rule)"
        ))
    }

    fn upstream_for(&self, dst: SocketAddr) -> SocketAddr {
        let dst = SocketAddr::new(canonical_ip(dst.ip()), dst.port());
        self.settings.upstream_map.get(&dst).copied().unwrap_or(dst)
    }

    fn inspect(&self, flow: &Flow, bytes: &[u8]) -> InspectVerdict {
        let ip = canonical_ip(flow.dst.ip());
        let port = flow.dst.port();
        let sniffed = match port {
            443 => sniff::tls_sni(bytes),
            80 => sniff::http_host(bytes, port),
            p => {
                return InspectVerdict::Deny {
                    reason: format!("no inspection is defined for port {p}"),
                    host: None,
                };
            }
        };
        let name = match sniffed {
            Sniffed::NeedMore => return InspectVerdict::NeedMore,
            Sniffed::Refused(reason) => return InspectVerdict::Deny { reason, host: None },
            Sniffed::Host(n) => n,
        };
        // Re-checked now: the rule may have changed and the pin may have expired since connect.
        match self.policy().decide_name(&name, port) {
            Decision::Deny(r) => InspectVerdict::Deny {
                reason: format!("{name}: {r}"),
                host: Some(name),
            },
            Decision::Allow(rule) => {
                let pinned = self.pins.lock().unwrap_or_else(|e| e.into_inner()).has(
                    &name,
                    ip,
                    Instant::now(),
                );
                if pinned {
                    if port == 80 {
                        if let Some(v) = self.plaintext_blocked(bytes, &name) {
                            return v;
                        }
                        if let Some(handler) = self.intercept_plain(&name) {
                            return InspectVerdict::Intercept {
                                rule: format!("{rule} (every request checked for placeholders)"),
                                host: Some(name),
                                handler,
                            };
                        }
                    }
                    if port == 443
                        && let Some(handler) = self.intercept(&name)
                    {
                        return InspectVerdict::Intercept {
                            rule: format!("{rule} (secrets intercepted)"),
                            host: Some(name),
                            handler,
                        };
                    }
                    InspectVerdict::Allow {
                        rule,
                        host: Some(name),
                    }
                } else {
                    InspectVerdict::Deny {
                        reason: format!(
                            "{name} is allowed but the sandbox resolver never answered {ip} for \
                             it (SNI/Host sent to another address)"
                        ),
                        host: Some(name),
                    }
                }
            }
        }
    }

    async fn dns(self: Arc<Self>, query: Vec<u8>) -> Option<Vec<u8>> {
        let q = match dns::parse_query(&query) {
            Ok(q) => q,
            Err(reply) => return reply,
        };
        // A placeholder in a name (exfiltration by lookup): refused before anything else.
        if let Some(icpt) = self.interceptor()
            && let Some(b) = swap::find_in_dns_name(&icpt.secrets().current(), &q.name)
        {
            dns_outcome("denied");
            self.emit_blocked(&b, &q.name.to_ascii_lowercase());
            return Some(dns::reply(&q, Rcode::NxDomain, &[]));
        }
        let name = match host::normalize_name(&q.name) {
            Ok(n) => n,
            Err(e) => {
                self.emit(NetEvent::DnsDenied {
                    name: q.name.clone(),
                    qtype: q.qtype.to_string(),
                    reason: e.to_string(),
                });
                dns_outcome("denied");
                return Some(dns::reply(&q, Rcode::NxDomain, &[]));
            }
        };
        if let Decision::Deny(reason) = self.policy().decide_lookup(&name) {
            dns_outcome("denied");
            self.emit(NetEvent::DnsDenied {
                name,
                qtype: q.qtype.to_string(),
                reason: format!("not resolved: {reason}"),
            });
            return Some(dns::reply(&q, Rcode::NxDomain, &[]));
        }
        if !matches!(q.qtype, QType::A | QType::Aaaa) {
            // Only addresses are looked up; other types (TXT, HTTPS/SVCB, MX...) get an empty
            // answer so clients fall back to A/AAAA at once.
            dns_outcome("nodata");
            return Some(dns::reply(&q, Rcode::NoError, &[]));
        }
        let answer = match self.settings.static_hosts.get(&name) {
            Some(ips) => dns::Answer::from_ips(&name, q.qtype, ips, 60),
            None => {
                let Ok(_slot) = self.dns_slots.clone().try_acquire_owned() else {
                    dns_outcome("servfail");
                    return Some(dns::reply(&q, Rcode::ServFail, &[]));
                };
                let lookup = self.settings.upstream.query(&name, q.qtype);
                let failed = |this: &Self| {
                    this.synthetic_answer(&q, &name).or_else(|| {
                        dns_outcome("servfail");
                        Some(dns::reply(&q, Rcode::ServFail, &[]))
                    })
                };
                match tokio::time::timeout(Duration::from_secs(5), lookup).await {
                    Ok(Ok(a)) if a.ips().is_empty() => match self.synthetic_answer(&q, &name) {
                        Some(reply) => return Some(reply),
                        None => a,
                    },
                    Ok(Ok(a)) => a,
                    Ok(Err(e)) => {
                        tracing::debug!(sandbox = %self.sandbox, %name, error = %e, "upstream DNS failed");
                        return failed(&self);
                    }
                    Err(_) => return failed(&self),
                }
            }
        };
        let (kept, dropped) = answer.filter(|ip| self.blocked(ip));
        if !dropped.is_empty() {
            self.emit(NetEvent::DnsDenied {
                name: name.clone(),
                qtype: q.qtype.to_string(),
                reason: format!(
                    "answers pointing into blocked ranges dropped (rebinding): {}",
                    dropped.join("; ")
                ),
            });
            if kept.ips().is_empty() {
                dns_outcome("rebinding");
                return Some(dns::reply(&q, Rcode::NxDomain, &[]));
            }
        }
        let ips = kept.ips();
        if !ips.is_empty() {
            let ttl = Duration::from_secs(u64::from(kept.min_ttl()));
            self.pins.lock().unwrap_or_else(|e| e.into_inner()).add(
                &name,
                &ips,
                ttl,
                Instant::now(),
            );
        }
        dns_outcome("answered");
        Some(dns::reply(&q, kept.rcode, &kept.records))
    }

    fn record(&self, event: FlowEvent) {
        use crate::telemetry::metrics as m;
        let (verdict, proto) = match &event {
            FlowEvent::Allowed { flow, .. } => ("allowed", flow.proto),
            FlowEvent::Denied { flow, .. } => ("denied", flow.proto),
            FlowEvent::UpstreamFailed { flow, .. } => ("upstream_failed", flow.proto),
            FlowEvent::Closed {
                flow,
                bytes_up,
                bytes_down,
            } => {
                metrics::counter!(m::NET_BYTES, "direction" => "up").increment(*bytes_up);
                metrics::counter!(m::NET_BYTES, "direction" => "down").increment(*bytes_down);
                let _ = flow;
                return;
            }
        };
        let proto = match proto {
            Proto::Tcp => "tcp",
            Proto::Udp => "udp",
        };
        metrics::counter!(m::NET_FLOWS, "verdict" => verdict, "proto" => proto).increment(1);
        // Fill the host from the DNS pins when the stack did not know it.
        let event = match event {
            FlowEvent::Allowed { flow, host, rule } => FlowEvent::Allowed {
                host: host.or_else(|| self.pinned(flow.dst.ip()).into_iter().next()),
                flow,
                rule,
            },
            FlowEvent::Denied { flow, host, reason } => FlowEvent::Denied {
                host: host.or_else(|| self.pinned(flow.dst.ip()).into_iter().next()),
                flow,
                reason,
            },
            e => e,
        };
        self.emit(NetEvent::Flow(event));
    }
}

impl Gate for PolicyGate {
    fn connect(&self, flow: &Flow) -> ConnectVerdict {
        self.inner.connect(flow)
    }

    fn inspect(&self, flow: &Flow, first_bytes: &[u8]) -> InspectVerdict {
        self.inner.inspect(flow, first_bytes)
    }

    fn dns(&self, query: Vec<u8>) -> BoxFuture<'static, Option<Vec<u8>>> {
        Box::pin(self.inner.clone().dns(query))
    }

    fn record(&self, event: FlowEvent) {
        self.inner.record(event)
    }

    fn upstream_proxy(&self) -> Option<Arc<UpstreamProxy>> {
        self.inner.settings.upstream_proxy.clone()
    }
}

fn dns_outcome(outcome: &'static str) {
    metrics::counter!(crate::telemetry::metrics::NET_DNS, "outcome" => outcome).increment(1);
}

/// A token bucket: `rate` events per second, bursts up to `2 * rate`.
struct RateLimit {
    rate: f64,
    tokens: f64,
    last: Instant,
    suppressed: u64,
}

impl RateLimit {
    fn new(rate: u32) -> RateLimit {
        RateLimit {
            rate: f64::from(rate),
            tokens: f64::from(rate) * 2.0,
            last: Instant::now(),
            suppressed: 0,
        }
    }

    /// `Some(n)`: this event goes out, after `n` suppressed ones; `None`: suppress it.
    fn take(&mut self, now: Instant) -> Option<u64> {
        let dt = now.saturating_duration_since(self.last).as_secs_f64();
        self.last = now;
        self.tokens = (self.tokens + dt * self.rate).min(self.rate * 2.0);
        if self.tokens >= 1.0 {
            self.tokens -= 1.0;
            Some(std::mem::take(&mut self.suppressed))
        } else {
            self.suppressed += 1;
            metrics::counter!(crate::telemetry::metrics::NET_EVENTS_SUPPRESSED).increment(1);
            None
        }
    }
}

#[cfg(test)]
#[path = "gate_tests.rs"]
mod tests;
