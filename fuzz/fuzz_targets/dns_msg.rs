//! Fuzzes DNS messages from the guest and from upstream: the query parser and reply builder
//! (`network::dns`), the policy gate's whole resolver path (with a fake upstream), the upstream
//! reply reader, and the stack's cut-down of answers too big for UDP. The check is
//! `network::fuzzing::dns_msg`, which `cargo test` also runs on the saved corpus
//! (`fuzz/corpus/dns_msg/`).
//! Run: `cargo xtask fuzz --target dns_msg` (or `cargo +nightly fuzz run dns_msg` in the repository root).
#![no_main]

// The whole network module is compiled straight from the main crate's sources (it refers to
// itself as `crate::network`, so it sits at the crate root); its only other dependency, the
// metric names, comes from a stand-in.
#[allow(dead_code, unused_imports)]
#[path = "../../src/network/mod.rs"]
mod network;
#[allow(dead_code)]
#[path = "../shared/telemetry.rs"]
mod telemetry;
// The secrets contract the network module's interceptor reads.
#[allow(dead_code)]
#[path = "../../src/secrets/mod.rs"]
mod secrets;

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| network::fuzzing::dns_msg(data));
