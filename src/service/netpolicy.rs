//! Network use cases: each sandbox's egress policy (kept in the store's `network` table), the
//! live [`PolicyGate`] of each sandbox (changes apply at once), the setup phase, and the
//! agent's access requests that only the user decides.
//!
//! Never: touches packets (that is `network::stack`), or lets the MCP face decide a request.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use serde::{Deserialize, Serialize};
use serde_json::json;

use super::{Service, ServiceError};
use crate::api;
use crate::config::NetworkConfig;
use crate::network::dns::{UdpUpstream, resolv_conf_nameserver};
use crate::network::gate::FlowEvent;
use crate::network::policy::{
    self, GateSettings, NetEvent, NetEventSink, Policy, PolicyError, PolicyGate, Rule, Verdict,
};
use crate::store::NETWORK;
use crate::telemetry::Telemetry;

/// Pending requests kept per sandbox; more are refused (an agent cannot flood the user).
const MAX_PENDING: usize = 16;
/// Decided requests kept per sandbox (the oldest go first).
const MAX_KEPT: usize = 64;

/// Event kinds of this module.
pub mod kind {
    pub const ALLOWED: &str = "network.allowed";
    pub const DENIED: &str = "network.denied";
    pub const UPSTREAM_FAILED: &str = "network.upstream_failed";
    pub const DNS_DENIED: &str = "network.dns_denied";
    pub const SUPPRESSED: &str = "network.events_suppressed";
    pub const POLICY_CHANGED: &str = "network.policy_changed";
    pub const REQUESTED: &str = "network.access_requested";
    pub const DECIDED: &str = "network.access_decided";
    pub const SETUP: &str = "network.setup";
    /// A secret's placeholder sent toward a host that is not one of its hosts, refused.
    pub const SECRET_BLOCKED: &str = "secret.blocked";
    /// A placeholder in a request body to another host: allowed, recorded.
    pub const SECRET_IN_BODY: &str = "secret.in_body";
    /// The git proxy refused a request or a push (a branch outside the grant's patterns, the
    /// token aimed at another repository, a ref write through the forge's API).
    pub const GIT_REFUSED: &str = "git.refused";
}

/// What the store keeps per sandbox.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct NetworkRecord {
    pub policy: Policy,
    #[serde(default)]
    pub requests: Vec<api::AccessRequest>,
}

/// The daemon's network side: shared gate settings and the live gates.
pub struct Networks {
    pub settings: Arc<GateSettings>,
    sink: NetEventSink,
    gates: Mutex<HashMap<String, Arc<PolicyGate>>>,
    /// Sandboxes running a setup command, with the widening in force.
    setups: Mutex<HashMap<String, Policy>>,
    /// Serialises read-modify-write of network records.
    edit: tokio::sync::Mutex<()>,
    default_policy: Vec<String>,
}

impl Networks {
    pub fn new(cfg: &NetworkConfig, telemetry: Arc<Telemetry>) -> Networks {
        let server = cfg
            .upstream_dns
            .or_else(|| resolv_conf_nameserver(std::path::Path::new("/etc/resolv.conf")));
        let mut settings = GateSettings::new(Arc::new(UdpUpstream::new(server)));
        for (name, ips) in &cfg.test_hosts {
            match policy::host::normalize_name(name) {
                Ok(n) => {
                    settings.static_hosts.insert(n, ips.clone());
                }
                Err(e) => tracing::warn!(error = %e, "ignoring a [network] test_hosts entry"),
            }
        }
        settings.upstream_map = cfg.test_upstream_map.clone().into_iter().collect();
        settings.intercept_tls = intercept_tls(cfg);
        // The daemon refuses to start on a setting it cannot honour (`daemon::serve`), so an
        // error here is only possible for a library caller; it then connects directly.
        settings.upstream_proxy = match crate::network::upstream_proxy::from_env(
            cfg.upstream_proxy.as_deref(),
            cfg.upstream_no_proxy.as_deref(),
        ) {
            Ok(p) => p.map(Arc::new),
            Err(e) => {
                tracing::warn!(error = %e, "upstream proxy setting ignored: egress connects directly");
                None
            }
        };
        if !settings.static_hosts.is_empty() || !settings.upstream_map.is_empty() {
            tracing::warn!(
                hosts = settings.static_hosts.len(),
                mapped = settings.upstream_map.len(),
                "[network] test overrides are in force"
            );
        }
        Networks {
            settings: Arc::new(settings),
            sink: event_sink(telemetry),
            gates: Mutex::new(HashMap::new()),
            setups: Mutex::new(HashMap::new()),
            edit: tokio::sync::Mutex::new(()),
            default_policy: cfg.default_policy.clone(),
        }
    }

    fn gate(&self, id: &str) -> Option<Arc<PolicyGate>> {
        self.gates
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get(id)
            .cloned()
    }

    fn widening(&self, id: &str) -> Option<Policy> {
        self.setups
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get(id)
            .cloned()
    }

    /// Push the policy in force (the record's, widened during a setup) to the live gate.
    fn apply(&self, id: &str, base: &Policy) {
        if let Some(g) = self.gate(id) {
            g.set_policy(match self.widening(id) {
                Some(w) => base.union(&w),
                None => base.clone(),
            });
        }
    }
}

/// The upstream trust of intercepted flows: the host's CA bundle plus `[network]
/// intercept_extra_ca`. `None` (interception off, logged) when neither can be read.
fn intercept_tls(cfg: &NetworkConfig) -> Option<Arc<rustls::ClientConfig>> {
    use crate::network::intercept::tls;
    let system = tls::system_bundle();
    let mut files: Vec<&std::path::Path> = system.iter().map(|p| p.as_path()).collect();
    if let Some(extra) = &cfg.intercept_extra_ca {
        files.push(extra);
    }
    match tls::upstream_client_config(&files) {
        Ok(c) => Some(c),
        Err(e) => {
            tracing::warn!(error = %e, "no upstream trust store: secrets will not be intercepted");
            None
        }
    }
}

/// Flow and DNS outcomes -> events (`network.*`) on the event bus.
fn event_sink(tel: Arc<Telemetry>) -> NetEventSink {
    Arc::new(move |sandbox: &str, ev: NetEvent| {
        let flow_json = |f: &crate::network::gate::Flow| {
            json!({"proto": format!("{:?}", f.proto).to_lowercase(), "ip": f.dst.ip().to_string(),
                   "port": f.dst.port()})
        };
        let (k, data) = match ev {
            NetEvent::Flow(FlowEvent::Allowed { flow, host, rule }) => {
                let mut d = flow_json(&flow);
                d["host"] = host.into();
                d["rule"] = rule.into();
                (kind::ALLOWED, d)
            }
            NetEvent::Flow(FlowEvent::Denied { flow, host, reason }) => {
                let mut d = flow_json(&flow);
                d["host"] = host.into();
                d["reason"] = reason.into();
                d["hint"] = "the agent may ask with the request_network_access tool; \
                             the user decides with `tryboxi net approve`"
                    .into();
                (kind::DENIED, d)
            }
            NetEvent::Flow(FlowEvent::UpstreamFailed { flow, error }) => {
                let mut d = flow_json(&flow);
                d["error"] = error.into();
                (kind::UPSTREAM_FAILED, d)
            }
            NetEvent::Flow(FlowEvent::Closed { .. }) => return,
            NetEvent::DnsDenied {
                name,
                qtype,
                reason,
            } => (
                kind::DNS_DENIED,
                json!({"host": name, "qtype": qtype, "reason": reason}),
            ),
            NetEvent::SecretBlocked {
                secret,
                host,
                position,
            } => (
                kind::SECRET_BLOCKED,
                json!({"secret": secret, "host": host, "position": position}),
            ),
            NetEvent::SecretInBody { secret, host } => (
                kind::SECRET_IN_BODY,
                json!({"secret": secret, "host": host}),
            ),
            NetEvent::GitRefused {
                host,
                status,
                reason,
            } => (
                kind::GIT_REFUSED,
                json!({"host": host, "status": status, "reason": reason}),
            ),
            NetEvent::Suppressed { count } => (kind::SUPPRESSED, json!({"count": count})),
        };
        tel.events.publish(k, sandbox, None, data);
    })
}

fn bad(e: PolicyError) -> ServiceError {
    ServiceError::BadRequest(e.to_string())
}

/// `["registries", "a.com:443"]` -> a policy.
pub fn parse_policy(items: &[String]) -> Result<Policy, PolicyError> {
    Policy::parse_list(&items.join(","))
}

impl Service {
    fn network_record(&self, id: &str) -> Result<NetworkRecord, ServiceError> {
        self.record(id)?;
        match self.store.get::<NetworkRecord>(NETWORK, id)? {
            Some(r) => Ok(r),
            // A sandbox recorded by a daemon that kept no network record: the default policy.
            None => Ok(NetworkRecord {
                policy: parse_policy(&self.networks.default_policy).map_err(bad)?,
                requests: Vec::new(),
            }),
        }
    }

    /// Check a create request's network part (before anything is booted).
    pub fn validate_network(
        &self,
        spec: Option<&api::NetworkSpec>,
    ) -> Result<Policy, ServiceError> {
        let items = match spec {
            Some(s) => s.policy.clone(),
            None => self.networks.default_policy.clone(),
        };
        parse_policy(&items).map_err(bad)
    }

    /// Record a new sandbox's policy (create calls it once the id exists).
    pub fn init_network(&self, id: &str, policy: Policy) -> Result<(), ServiceError> {
        self.store.put(
            NETWORK,
            id,
            &NetworkRecord {
                policy,
                requests: Vec::new(),
            },
        )?;
        Ok(())
    }

    /// A fork child starts with its parent's policy (pending requests stay with the parent).
    pub fn copy_network(&self, from: &str, to: &str) -> Result<(), ServiceError> {
        let policy = self.network_record(from)?.policy;
        // The child's guest bundle holds the parent's interception CA: keep it valid.
        let (a, b) = (self.paths.sandbox_dir(from), self.paths.sandbox_dir(to));
        if let Err(e) = crate::network::intercept::SandboxCa::copy_files(&a, &b) {
            tracing::warn!(from, to, error = %e, "cannot copy the interception CA to the fork");
        }
        self.init_network(to, policy)
    }

    /// The live gate of a sandbox, made from its stored policy on first use. The stack hands
    /// it every flow of the sandbox's VM.
    pub fn network_gate(&self, id: &str) -> Result<Arc<PolicyGate>, ServiceError> {
        if let Some(g) = self.networks.gate(id) {
            return Ok(g);
        }
        let rec = self.network_record(id)?;
        let mut gates = self
            .networks
            .gates
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        let g = gates
            .entry(id.to_owned())
            .or_insert_with(|| {
                let g = PolicyGate::new(
                    id,
                    rec.policy.clone(),
                    self.networks.settings.clone(),
                    self.networks.sink.clone(),
                );
                self.attach_secrets(id, &g);
                g
            })
            .clone();
        Ok(g)
    }

    /// Hook the sandbox's live secrets and its interception CA (in its directory, minted on
    /// first use) into its gate: secrets published later take effect on the next flow.
    fn attach_secrets(&self, id: &str, gate: &PolicyGate) {
        use crate::network::intercept::SandboxCa;
        let dir = self.paths.sandbox_dir(id);
        if !dir.is_dir() {
            return;
        }
        let secrets = self.secrets.for_sandbox(id);
        match SandboxCa::load_or_create(&dir, &secrets.current().intercepted_hosts()) {
            Ok(ca) => {
                if gate.set_interception(secrets, ca)
                    && let (Some(icpt), Some(weak)) = (gate.interceptor(), self.life.weak())
                {
                    // `secret ls` shows when each secret was last swapped into a request.
                    icpt.set_used_sink(Arc::new(move |name: &str| {
                        if let Some(svc) = weak.upgrade() {
                            svc.secret_store.mark_used(name);
                        }
                    }));
                }
            }
            Err(e) => {
                tracing::warn!(sandbox = id, error = %e, "no interception CA: secrets are not intercepted")
            }
        }
    }

    /// A removed sandbox: drop its gate and record.
    pub fn forget_network(&self, id: &str) {
        self.networks
            .gates
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(id);
        let _ = self.store.delete(NETWORK, id);
    }

    fn view(&self, id: &str, rec: &NetworkRecord) -> api::NetworkPolicy {
        api::NetworkPolicy {
            sandbox_id: id.to_owned(),
            presets: rec
                .policy
                .presets
                .iter()
                .map(|p| p.name().to_owned())
                .collect(),
            rules: rec.policy.rules.iter().map(|r| r.to_string()).collect(),
            setup_widening: self
                .networks
                .widening(id)
                .map(|w| {
                    w.presets
                        .iter()
                        .map(|p| p.name().to_owned())
                        .chain(w.rules.iter().map(|r| r.to_string()))
                        .collect()
                })
                .unwrap_or_default(),
            pending_requests: rec
                .requests
                .iter()
                .filter(|r| r.state == api::AccessRequestState::Pending)
                .count(),
        }
    }

    /// `GET /v1/sandboxes/{id}/network`.
    pub fn get_network(&self, id: &str) -> Result<api::NetworkPolicy, ServiceError> {
        let rec = self.network_record(id)?;
        Ok(self.view(id, &rec))
    }

    /// `POST /v1/sandboxes/{id}/network/rules` (the user).
    pub async fn change_network(
        &self,
        id: &str,
        change: api::NetworkRuleChange,
    ) -> Result<api::NetworkPolicy, ServiceError> {
        let verdict = match change.verdict.as_str() {
            "allow" => Verdict::Allow,
            "deny" => Verdict::Deny,
            v => {
                return Err(ServiceError::BadRequest(format!(
                    "verdict must be allow or deny, got `{v}`"
                )));
            }
        };
        let rule = Rule::parse(verdict, &change.target).map_err(bad)?;
        let _g = self.networks.edit.lock().await;
        let mut rec = self.network_record(id)?;
        rec.policy.add_rule(rule.clone());
        self.store.put(NETWORK, id, &rec)?;
        self.networks.apply(id, &rec.policy);
        self.telemetry.events.publish(
            kind::POLICY_CHANGED,
            id,
            None,
            json!({"rule": rule.to_string(), "by": "user"}),
        );
        Ok(self.view(id, &rec))
    }

    /// `POST /v1/sandboxes/{id}/network/requests` (the agent asks).
    pub async fn request_access(
        &self,
        id: &str,
        req: api::AccessRequestCreate,
    ) -> Result<api::AccessRequest, ServiceError> {
        let rule = policy::ask::vet(&req.host).map_err(bad)?;
        if let policy::Target::Name(n) | policy::Target::Suffix(n) = &rule.target
            && let Some(why) = policy::ask::resolves_into_blocked(&self.networks.settings, n).await
        {
            return Err(ServiceError::BadRequest(format!(
                "cannot ask for `{}`: it resolves into an always-blocked range ({why})",
                req.host
            )));
        }
        let reason = req.reason.map(|r| r.chars().take(500).collect::<String>());
        let _g = self.networks.edit.lock().await;
        let mut rec = self.network_record(id)?;
        let pending = |r: &api::AccessRequest| r.state == api::AccessRequestState::Pending;
        if let Some(same) = rec
            .requests
            .iter()
            .find(|r| pending(r) && r.rule == rule.to_string())
        {
            return Ok(same.clone());
        }
        if rec.requests.iter().filter(|r| pending(r)).count() >= MAX_PENDING {
            return Err(ServiceError::Conflict(format!(
                "{MAX_PENDING} requests already wait for the user; ask again once they are decided"
            )));
        }
        let ar = api::AccessRequest {
            id: crate::ids::new_id(crate::ids::REQUEST),
            sandbox_id: id.to_owned(),
            rule: rule.to_string(),
            host: req.host.trim().to_owned(),
            reason,
            state: api::AccessRequestState::Pending,
            created_at: super::now_rfc3339(),
            decided_at: None,
        };
        rec.requests.push(ar.clone());
        trim_decided(&mut rec.requests);
        self.store.put(NETWORK, id, &rec)?;
        self.telemetry.events.publish(
            kind::REQUESTED,
            id,
            None,
            json!({"request_id": ar.id, "rule": ar.rule, "reason": ar.reason,
                   "approve_with": format!("tryboxi net approve {id} {}", ar.id)}),
        );
        Ok(ar)
    }

    /// `GET /v1/sandboxes/{id}/network/requests`.
    pub fn list_access_requests(&self, id: &str) -> Result<api::AccessRequestList, ServiceError> {
        Ok(api::AccessRequestList {
            requests: self.network_record(id)?.requests,
        })
    }

    /// `POST .../requests/{req}/approve|reject` (the user; never the MCP face).
    pub async fn decide_access(
        &self,
        id: &str,
        req_id: &str,
        approve: bool,
        face: Option<&str>,
    ) -> Result<api::AccessRequest, ServiceError> {
        if face == Some("mcp") {
            return Err(ServiceError::Forbidden(
                "access requests are decided by the user (`tryboxi net approve`), not by the \
                 agent's tools"
                    .into(),
            ));
        }
        let _g = self.networks.edit.lock().await;
        let mut rec = self.network_record(id)?;
        let idx = rec
            .requests
            .iter()
            .position(|r| r.id == req_id)
            .ok_or_else(|| ServiceError::NotFound(format!("no request `{req_id}` on {id}")))?;
        if rec.requests[idx].state != api::AccessRequestState::Pending {
            return Err(ServiceError::Conflict(format!(
                "request {req_id} was already {:?}",
                rec.requests[idx].state
            )));
        }
        if approve {
            // Vetted again: what a name resolves to may have changed since it was asked.
            let rule = policy::ask::vet(&rec.requests[idx].host).map_err(bad)?;
            if let policy::Target::Name(n) | policy::Target::Suffix(n) = &rule.target
                && let Some(why) =
                    policy::ask::resolves_into_blocked(&self.networks.settings, n).await
            {
                return Err(ServiceError::BadRequest(format!(
                    "not approved: `{n}` now resolves into an always-blocked range ({why})"
                )));
            }
            rec.policy.add_rule(rule);
        }
        let r = &mut rec.requests[idx];
        r.state = if approve {
            api::AccessRequestState::Approved
        } else {
            api::AccessRequestState::Rejected
        };
        r.decided_at = Some(super::now_rfc3339());
        let out = r.clone();
        self.store.put(NETWORK, id, &rec)?;
        self.networks.apply(id, &rec.policy);
        self.telemetry.events.publish(
            kind::DECIDED,
            id,
            None,
            json!({"request_id": out.id, "rule": out.rule, "state": out.state}),
        );
        Ok(out)
    }

    /// `POST /v1/sandboxes/{id}/network/setup`: run `cmd` with the policy widened by
    /// `req.policy`, then narrow it back. The narrowing runs in its own task, so it happens
    /// even when the HTTP client goes away.
    pub async fn network_setup(
        self: &Arc<Self>,
        id: &str,
        req: api::NetworkSetupRequest,
    ) -> Result<api::NetworkSetupReport, ServiceError> {
        let widening = parse_policy(&req.policy).map_err(bad)?;
        let rec = self.network_record(id)?;
        self.network_gate(id)?;
        {
            let mut s = self
                .networks
                .setups
                .lock()
                .unwrap_or_else(|e| e.into_inner());
            if s.contains_key(id) {
                return Err(ServiceError::Conflict(format!(
                    "{id} is already running a setup command"
                )));
            }
            s.insert(id.to_owned(), widening.clone());
        }
        self.networks.apply(id, &rec.policy);
        self.telemetry.events.publish(
            kind::SETUP,
            id,
            None,
            json!({"phase": "started", "cmd": req.cmd, "widening": widening.summary()}),
        );
        let svc = self.clone();
        let sid = id.to_owned();
        let task = tokio::spawn(async move {
            let report = run_setup(&svc, &sid, &req).await;
            svc.networks
                .setups
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .remove(&sid);
            if let Ok(rec) = svc.network_record(&sid) {
                svc.networks.apply(&sid, &rec.policy);
            }
            svc.telemetry.events.publish(
                kind::SETUP,
                &sid,
                None,
                json!({"phase": "finished", "exit_code": report.exit_code,
                       "error": report.error, "duration_ms": report.duration_ms}),
            );
            report
        });
        task.await
            .map_err(|e| ServiceError::Internal(format!("the setup task failed: {e}")))
    }
}

async fn run_setup(
    svc: &Arc<Service>,
    id: &str,
    req: &api::NetworkSetupRequest,
) -> api::NetworkSetupReport {
    const TAIL: usize = 8192;
    let mut report = api::NetworkSetupReport {
        exit_code: None,
        signal: None,
        timed_out: false,
        duration_ms: 0,
        stdout_tail: String::new(),
        stderr_tail: String::new(),
        error: None,
    };
    let exec = api::ExecRequest {
        cmd: Some(req.cmd.clone()),
        timeout_s: req.timeout_s,
        ..Default::default()
    };
    let mut rx = match svc.start_exec(id, exec).await {
        Ok(rx) => rx,
        Err(e) => {
            report.error = Some(e.to_string());
            return report;
        }
    };
    let (mut out, mut err) = (Vec::new(), Vec::new());
    let keep = |buf: &mut Vec<u8>, b: &[u8]| {
        buf.extend_from_slice(b);
        if buf.len() > TAIL {
            buf.drain(..buf.len() - TAIL);
        }
    };
    while let Some(ev) = rx.recv().await {
        match ev {
            api::ExecEvent::Stdout { data, data_b64 } => keep(
                &mut out,
                &api::ExecEvent::output_bytes(&data, &data_b64).unwrap_or_default(),
            ),
            api::ExecEvent::Stderr { data, data_b64 } => keep(
                &mut err,
                &api::ExecEvent::output_bytes(&data, &data_b64).unwrap_or_default(),
            ),
            api::ExecEvent::Exit {
                exit_code,
                signal,
                timed_out,
                duration_ms,
            } => {
                report.exit_code = exit_code;
                report.signal = signal;
                report.timed_out = timed_out;
                report.duration_ms = duration_ms;
            }
            api::ExecEvent::Error { code, message } => {
                report.error = Some(format!("{code}: {message}"))
            }
            api::ExecEvent::Started { .. } => {}
        }
    }
    report.stdout_tail = String::from_utf8_lossy(&out).into_owned();
    report.stderr_tail = String::from_utf8_lossy(&err).into_owned();
    report
}

/// Keep every pending request and the newest decided ones.
fn trim_decided(reqs: &mut Vec<api::AccessRequest>) {
    let decided = reqs
        .iter()
        .filter(|r| r.state != api::AccessRequestState::Pending)
        .count();
    let mut drop = decided.saturating_sub(MAX_KEPT);
    reqs.retain(|r| {
        if drop > 0 && r.state != api::AccessRequestState::Pending {
            drop -= 1;
            false
        } else {
            true
        }
    });
}

#[cfg(test)]
#[path = "netpolicy_tests.rs"]
mod tests;
