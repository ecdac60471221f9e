//! Per-sandbox egress network: allowlist-only, in userspace, inside the daemon.
//!
//! Owns: everything between a VM's virtio-net device and the outside world.
//! Never: opens a host interface, tap device or namespace; lets a guest packet reach the host
//! without a [`gate::Gate`] decision.
//!
//! Files: `gate.rs` (the contract between the packet side and the policy side: what the
//! stack asks, what the policy answers), `deny.rs` (the gate of a sandbox without a policy),
//! `stack/` (the per-VM userspace network stack), `host_cas.rs` (the host's locally added CA
//! certificates, which every guest trusts too), `upstream_proxy.rs` (the explicit
//! proxy upstream connections go through, when one is set). The stack (`stack/`), the policy engine
//! (`policy/`), the DNS resolver (`dns/`) and the first-bytes sniffers (`sniff.rs`) build on it.
//! The design is written down in docs/NETWORK.md.

pub mod deny;
#[cfg(any(test, fuzzing))]
pub mod fuzzing;
pub mod gate;
pub mod host_cas;
pub mod intercept;
pub mod stack;
pub mod upstream_proxy;
#[cfg(test)]
pub mod upstream_proxy_testkit;

// The policy side (branch net-policy).
pub mod dns;
pub mod policy;
pub mod sniff;
