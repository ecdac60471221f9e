//! Exposed ports: a guest port forwarded from a loopback port on the host (`tryboxi port`,
//! `POST /v1/sandboxes/{id}/ports`), and [`Service::connect_guest_port`], the in-process
//! connection the E2B face proxies through. Every connection goes into the VM through its
//! userspace network stack ([`crate::network::stack::ingress`]): from the gateway address to
//! the guest's port. Ingress only; the egress policy is untouched.
//!
//! Owns: the host listeners (127.0.0.1 only, host ports below 1024 refused, at most
//! [`MAX_PORTS`] per sandbox, at most [`MAX_CONNS_PER_PORT`] relayed connections per port:
//! more are closed at once). The exposed ports are in the sandbox record (`api::Sandbox.ports`),
//! so a listener is bound again after a daemon restart ([`Service::rebind_ports`]; a host port
//! taken by then is reported in the listing and as a `port.unavailable` event). Listeners stay
//! while a sandbox is paused (a connection resumes it) and go with the sandbox.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use tokio::io::DuplexStream;
use tokio::net::{TcpListener, TcpStream};
use tokio::task::JoinSet;

use super::{Service, ServiceError};
use crate::api::{self, SandboxState};
use crate::network::stack::ingress::IngressError;
use crate::store::SANDBOXES;

/// Exposed ports per sandbox.
pub const MAX_PORTS: usize = 16;
/// Connections relayed at once through one exposed port; more are closed on accept.
pub const MAX_CONNS_PER_PORT: usize = 64;
/// How long the guest may take to accept a connection.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);
/// How long a connection waits for a (re)started VM's NIC to attach to its stack.
const ATTACH_WAIT: Duration = Duration::from_secs(5);

/// A running host listener; dropping it stops the listener and every connection it relays.
struct Listener(tokio::task::JoinHandle<()>);

impl Drop for Listener {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// The host listeners, by sandbox id and guest port.
#[derive(Default)]
pub struct PortListeners(Mutex<HashMap<String, HashMap<u16, Listener>>>);

impl PortListeners {
    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, HashMap<u16, Listener>>> {
        self.0.lock().unwrap_or_else(|p| p.into_inner())
    }
}

fn url_of(host_port: u16) -> String {
    format!("http://127.0.0.1:{host_port}")
}

impl From<IngressError> for ServiceError {
    fn from(e: IngressError) -> Self {
        match e {
            IngressError::Refused(_) | IngressError::Timeout { .. } => {
                ServiceError::PortNotOpen(e.to_string())
            }
            IngressError::TooMany(_) => ServiceError::Busy(e.to_string()),
            IngressError::NotAttached => ServiceError::Conflict(e.to_string()),
            IngressError::BadPort => ServiceError::BadRequest(e.to_string()),
        }
    }
}

impl Service {
    /// A connection to the guest's `port` through the sandbox's network stack, once the guest
    /// accepted it. A paused sandbox is resumed first. Refused (`ServiceError::PortNotOpen`,
    /// whose message contains "port is not open") when nothing listens there.
    pub async fn connect_guest_port(
        &self,
        sandbox_id: &str,
        port: u16,
    ) -> Result<DuplexStream, ServiceError> {
        if port == 0 {
            return Err(IngressError::BadPort.into());
        }
        let rec = self.record(sandbox_id)?;
        match rec.api.state {
            SandboxState::Ready => self.life.touch(sandbox_id),
            // Resume on use, as an exec does (the guard is let go at once).
            SandboxState::Paused => drop(self.hold_ready(sandbox_id).await?),
            s => {
                return Err(ServiceError::Conflict(format!(
                    "sandbox `{sandbox_id}` is {s}"
                )));
            }
        }
        let stack = self.nets.get(sandbox_id).ok_or_else(|| {
            ServiceError::Conflict(format!("sandbox `{sandbox_id}` has no network stack"))
        })?;
        // A VM that just booted, resumed or was restored attaches its NIC within moments.
        let deadline = tokio::time::Instant::now() + ATTACH_WAIT;
        loop {
            match stack.ingress().connect(port, CONNECT_TIMEOUT).await {
                Err(IngressError::NotAttached) if tokio::time::Instant::now() < deadline => {
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
                r => return r.map_err(Into::into),
            }
        }
    }

    /// `GET /v1/sandboxes/{id}/ports`.
    pub fn list_ports(&self, id: &str) -> Result<api::PortList, ServiceError> {
        Ok(api::PortList {
            ports: self.record(id)?.api.ports,
        })
    }

    /// `POST /v1/sandboxes/{id}/ports`: listen on 127.0.0.1 and relay every connection to
    /// the guest's port.
    pub async fn expose_port(
        self: &Arc<Self>,
        id: &str,
        req: api::ExposePortRequest,
    ) -> Result<api::ExposedPort, ServiceError> {
        check_expose(&req)?;
        let (_life, mut rec) = self.hold(id).await?;
        if !matches!(rec.api.state, SandboxState::Ready | SandboxState::Paused) {
            return Err(ServiceError::Conflict(format!(
                "sandbox `{id}` is {}",
                rec.api.state
            )));
        }
        if let Some(p) = rec.api.ports.iter().find(|p| p.port == req.port) {
            return Err(ServiceError::Conflict(format!(
                "port {} is exposed already, at {}",
                p.port, p.url
            )));
        }
        if rec.api.ports.len() >= MAX_PORTS {
            return Err(ServiceError::Conflict(format!(
                "sandbox `{id}` has {MAX_PORTS} exposed ports already (the most it may have)"
            )));
        }
        let listener = bind(req.host_port.unwrap_or(0))?;
        let host_port = listener
            .local_addr()
            .map_err(|e| ServiceError::Internal(format!("a bound listener has no address: {e}")))?
            .port();
        let exposed = api::ExposedPort {
            port: req.port,
            host_port,
            url: url_of(host_port),
            error: None,
        };
        rec.api.ports.push(exposed.clone());
        self.store.put(SANDBOXES, id, &rec)?;
        self.start_listener(id, req.port, listener);
        tracing::info!(sandbox = %id, port = req.port, host_port, "port exposed");
        self.telemetry.events.publish(
            "port.exposed",
            id,
            None,
            serde_json::json!({ "port": req.port, "host_port": host_port, "url": exposed.url }),
        );
        Ok(exposed)
    }

    /// `DELETE /v1/sandboxes/{id}/ports/{port}`: stop listening; open connections close.
    pub async fn unexpose_port(
        &self,
        id: &str,
        port: u16,
    ) -> Result<api::ExposedPort, ServiceError> {
        let (_life, mut rec) = self.hold(id).await?;
        let Some(i) = rec.api.ports.iter().position(|p| p.port == port) else {
            return Err(ServiceError::NotFound(format!(
                "port {port} of sandbox `{id}` is not exposed"
            )));
        };
        let gone = rec.api.ports.remove(i);
        self.store.put(SANDBOXES, id, &rec)?;
        if let Some(m) = self.ports.lock().get_mut(id) {
            m.remove(&port);
        }
        tracing::info!(sandbox = %id, port, host_port = gone.host_port, "port no longer exposed");
        Ok(gone)
    }

    /// The sandbox is gone: its listeners and their connections too.
    pub(super) fn close_ports(&self, id: &str) {
        self.ports.lock().remove(id);
    }

    /// After a daemon restart: listen again on every recorded host port of the sandboxes that
    /// are ready or paused. A port taken meanwhile is marked in the record (`error`), logged
    /// and published as `port.unavailable`; the others work as before.
    pub(super) async fn rebind_ports(self: &Arc<Self>) {
        let recs: Vec<super::SandboxRecord> = match self.store.list(SANDBOXES) {
            Ok(r) => r,
            Err(e) => {
                tracing::error!(error = %e, "cannot read sandboxes to bind their ports again");
                return;
            }
        };
        for r in recs.into_iter().filter(|r| !r.api.ports.is_empty()) {
            let id = r.api.id.clone();
            let Ok((_life, mut rec)) = self.hold(&id).await else {
                continue;
            };
            if !matches!(rec.api.state, SandboxState::Ready | SandboxState::Paused) {
                continue;
            }
            for p in rec.api.ports.iter_mut() {
                match bind(p.host_port) {
                    Ok(l) => {
                        p.error = None;
                        self.start_listener(&id, p.port, l);
                    }
                    Err(e) => {
                        let why = e.to_string();
                        tracing::warn!(sandbox = %id, port = p.port, host_port = p.host_port, error = %why, "cannot listen on an exposed port again");
                        self.telemetry.events.publish(
                            "port.unavailable",
                            &id,
                            None,
                            serde_json::json!({ "port": p.port, "host_port": p.host_port, "error": why }),
                        );
                        p.error = Some(why);
                    }
                }
            }
            if let Err(e) = self.store.put(SANDBOXES, &id, &rec) {
                tracing::warn!(sandbox = %id, error = %e, "cannot record the exposed ports");
            }
        }
    }

    fn start_listener(self: &Arc<Self>, id: &str, port: u16, listener: TcpListener) {
        let task = tokio::spawn(serve(Arc::downgrade(self), id.to_owned(), port, listener));
        self.ports
            .lock()
            .entry(id.to_owned())
            .or_default()
            .insert(port, Listener(task));
    }
}

/// Refusals that need no sandbox: guest port 0, a privileged host port.
fn check_expose(req: &api::ExposePortRequest) -> Result<(), ServiceError> {
    if req.port == 0 {
        return Err(ServiceError::BadRequest(
            "port must be between 1 and 65535".into(),
        ));
    }
    match req.host_port {
        Some(h) if h < 1024 => Err(ServiceError::BadRequest(format!(
            "host_port {h} is refused: host ports below 1024 are privileged (give 1024-65535, or none for a free one)"
        ))),
        _ => Ok(()),
    }
}

/// A listener on 127.0.0.1:`host_port` (0: a free port); 409 when the port is taken.
fn bind(host_port: u16) -> Result<TcpListener, ServiceError> {
    let std = std::net::TcpListener::bind(("127.0.0.1", host_port)).map_err(|e| {
        if e.kind() == std::io::ErrorKind::AddrInUse {
            ServiceError::Conflict(format!("host port {host_port} is in use on 127.0.0.1"))
        } else {
            ServiceError::Internal(format!("cannot listen on 127.0.0.1:{host_port}: {e}"))
        }
    })?;
    std.set_nonblocking(true).map_err(|e| {
        ServiceError::Internal(format!("cannot listen on 127.0.0.1:{host_port}: {e}"))
    })?;
    TcpListener::from_std(std)
        .map_err(|e| ServiceError::Internal(format!("cannot listen on 127.0.0.1:{host_port}: {e}")))
}

/// Accept on the host port and relay each connection (at most [`MAX_CONNS_PER_PORT`] at once;
/// aborting this task drops them all).
async fn serve(svc: Weak<Service>, id: String, port: u16, listener: TcpListener) {
    let mut conns = JoinSet::new();
    loop {
        tokio::select! {
            r = listener.accept() => {
                let tcp = match r {
                    Ok((tcp, _)) => tcp,
                    Err(e) => {
                        tracing::warn!(sandbox = %id, port, error = %e, "accept failed on an exposed port");
                        tokio::time::sleep(Duration::from_millis(100)).await;
                        continue;
                    }
                };
                if conns.len() >= MAX_CONNS_PER_PORT {
                    tracing::debug!(sandbox = %id, port, "too many connections on an exposed port; closing one");
                    continue;
                }
                let Some(svc) = svc.upgrade() else { return };
                conns.spawn(relay(svc, id.clone(), port, tcp));
            }
            Some(_) = conns.join_next(), if !conns.is_empty() => {}
        }
    }
}

async fn relay(svc: Arc<Service>, id: String, port: u16, mut tcp: TcpStream) {
    let conn = svc.connect_guest_port(&id, port).await;
    drop(svc);
    match conn {
        Ok(mut guest) => {
            let _ = tcp.set_nodelay(true);
            let _ = tokio::io::copy_bidirectional(&mut tcp, &mut guest).await;
        }
        // The client sees the connection closed at once.
        Err(e) => {
            tracing::debug!(sandbox = %id, port, error = %e, "exposed port: no connection to the guest")
        }
    }
}

#[cfg(test)]
#[path = "ports_tests.rs"]
mod store_tests;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn privileged_host_ports_and_port_zero_are_refused() {
        let req = |port, host_port| api::ExposePortRequest { port, host_port };
        assert!(check_expose(&req(3000, None)).is_ok());
        assert!(check_expose(&req(3000, Some(1024))).is_ok());
        let e = check_expose(&req(3000, Some(80))).unwrap_err();
        assert!(matches!(e, ServiceError::BadRequest(_)), "{e:?}");
        assert!(e.to_string().contains("below 1024"), "{e}");
        assert!(check_expose(&req(0, None)).is_err());
    }

    #[tokio::test]
    async fn listeners_bind_loopback_only_and_a_taken_port_is_a_conflict() {
        let l = bind(0).unwrap();
        let addr = l.local_addr().unwrap();
        assert!(addr.ip().is_loopback(), "{addr}");
        let e = bind(addr.port()).unwrap_err();
        assert!(matches!(e, ServiceError::Conflict(_)), "{e:?}");
        assert!(e.to_string().contains("in use"), "{e}");
    }

    #[test]
    fn ingress_refusals_keep_the_phrase_the_e2b_sdk_looks_for() {
        let e = ServiceError::from(IngressError::Refused(3000));
        assert!(matches!(e, ServiceError::PortNotOpen(_)), "{e:?}");
        assert!(e.to_string().contains("port is not open"), "{e}");
        let api = crate::daemon::response::ApiError::from(e);
        assert_eq!(api.status, hyper::StatusCode::BAD_GATEWAY);
        let e = ServiceError::from(IngressError::Timeout {
            port: 3000,
            secs: 10,
        });
        assert!(matches!(e, ServiceError::PortNotOpen(_)), "{e:?}");
        assert!(e.to_string().contains("port is not open"), "{e}");
    }
}
