//! Fuzzes the secrets interceptor's request-side parsers: an HTTP/1 request head through the
//! block check (a placeholder in an authorization position to a host that is not its secret's)
//! and the placeholder finder (raw, percent, JSON, base64), and the streaming scrubber against
//! the one-shot one. The check is `network::fuzzing::placeholders`, which `cargo test` also runs
//! on the saved corpus (`fuzz/corpus/placeholders/`).
//! Run: `cargo xtask fuzz --target placeholders`.
#![no_main]

#[allow(dead_code, unused_imports)]
#[path = "../../src/network/mod.rs"]
mod network;
#[allow(dead_code)]
#[path = "../shared/telemetry.rs"]
mod telemetry;
#[allow(dead_code)]
#[path = "../../src/secrets/mod.rs"]
mod secrets;

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| network::fuzzing::placeholders(data));
