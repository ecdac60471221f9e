//! Fuzzes the first-bytes sniffers the egress policy decides inspected flows with: the TLS
//! ClientHello SNI parser (port 443) and the HTTP/1 Host reader (port 80). The first byte picks
//! the sniffer and the port, the rest are the flow's first bytes; every prefix is sniffed too, as
//! the stack does while bytes arrive. The check is `network::fuzzing::sniff`, which `cargo
//! test` also runs on the saved corpus (`fuzz/corpus/sniff/`).
//! Run: `cargo xtask fuzz --target sniff` (or `cargo +nightly fuzz run sniff` in the repository root).
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

fuzz_target!(|data: &[u8]| network::fuzzing::sniff(data));
