//! Port exposure: a guest port reachable on a host loopback port (`tryboxi port`).

use serde::{Deserialize, Serialize};

/// `POST /v1/sandboxes/{id}/ports`: forward a host loopback port to the guest's `port`.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ExposePortRequest {
    pub port: u16,
    /// The host port (on 127.0.0.1, at least 1024); absent: one the OS picks.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub host_port: Option<u16>,
}

/// A guest port reachable at `url` on the host's loopback.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct ExposedPort {
    /// The guest's port.
    pub port: u16,
    /// The listening port on 127.0.0.1.
    pub host_port: u16,
    /// `http://127.0.0.1:<host_port>`.
    pub url: String,
    /// Why the host port is not listening now (it was taken when the daemon bound it again
    /// after a restart).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
}

/// `GET /v1/sandboxes/{id}/ports`.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct PortList {
    pub ports: Vec<ExposedPort>,
}
