//! The egress policy of one sandbox: rules, presets, the always-blocked ranges, DNS pins, and
//! the [`PolicyGate`] that answers the stack's questions (see `network::gate`).
//!
//! Owns: what a sandbox may reach and why. Order of evaluation (docs/NETWORK-POLICY.md):
//! 1. always-blocked ranges ([`blocked`]: loopback, RFC 1918, CGNAT, link-local/metadata, ULA,
//!    fe80::/10, multicast, the host's own addresses, and IPv4-mapped / embedded forms) — no
//!    rule opens them;
//! 2. fixed refusals (UDP other than DNS to the sandbox resolver, QUIC, direct resolvers on
//!    53/853);
//! 3. deny rules, 4. allow rules (user rules and presets), 5. default deny.
//!
//! Never: touches packets (that is the stack), or resolves a name the policy denies.
//!
//! Files: `host.rs` (host normalisation against matching tricks), `rules.rs` (the serde
//! [`Policy`], rules and presets), `blocked.rs`, `pins.rs` (name -> IP answers given to this
//! sandbox), `gate.rs` ([`PolicyGate`]), `ask.rs` (what an agent may ask to allow),
//! `synthetic.rs` (answers for names only the upstream proxy can reach; their addresses pass
//! step 1 only for the sandbox they were given to).

pub mod ask;
pub mod blocked;
pub mod gate;
pub mod host;
pub mod pins;
pub mod rules;
pub mod synthetic;

pub use gate::{GateSettings, NetEvent, NetEventSink, PolicyGate};
pub use host::HostError;
pub use rules::{Policy, Rule, Target, Verdict};

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum PolicyError {
    #[error(transparent)]
    Host(#[from] HostError),
    #[error("invalid rule `{input}`: {message}")]
    Rule { input: String, message: String },
    #[error("unknown network preset `{0}` (known: registries, github, none)")]
    UnknownPreset(String),
    #[error("cannot ask for `{host}`: {reason}")]
    NotAskable { host: String, reason: String },
}
