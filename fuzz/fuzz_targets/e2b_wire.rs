//! Fuzzes what an E2B SDK (or anyone on the E2B listener) sends envd: Connect envelopes split
//! anywhere, and every envd request message's proto3-JSON decoding. The check is
//! `e2b::fuzzing::wire`, which `cargo test` also runs on the saved corpus
//! (`fuzz/corpus/e2b_wire/`).
//! Run: `cargo xtask fuzz --target e2b_wire` (or `cargo +nightly fuzz run e2b_wire`).
#![no_main]

// The Connect framing and the envd messages depend on nothing else in the crate: compiled by
// path, at the root (the check names them as `super::connect` and `super::proto`).
#[allow(dead_code)]
#[path = "../../src/e2b/connect.rs"]
mod connect;
#[allow(dead_code)]
#[path = "../../src/e2b/proto.rs"]
mod proto;
#[path = "../../src/e2b/fuzzing.rs"]
mod fuzzing;

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| fuzzing::wire(data));
