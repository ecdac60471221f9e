//! Fuzzes the decoding of every wire message type (`rpc::msg`), not only whole frames: the first
//! byte picks the type (`rpc::fuzzing::MSG_TYPES`), the rest is decoded the way the host decodes
//! guest data (the answer codec, its byte limit), and whatever decodes must round-trip. A
//! declared length past the input must fail before it is allocated (libFuzzer's memory limit
//! catches a regression). The check is `rpc::fuzzing::msg_decode`, which `cargo test` also runs
//! on the saved corpus (`fuzz/corpus/msg_decode/`, seeded with one input per type).
//! Run: `cargo +nightly fuzz run msg_decode` from the repository root.
#![no_main]

#[allow(dead_code)]
#[path = "../../src/rpc/frame.rs"]
mod frame;
#[allow(dead_code)]
#[path = "../../src/rpc/fuzzing.rs"]
mod fuzzing;
#[allow(dead_code)]
#[path = "../../src/rpc/msg.rs"]
mod msg;

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| fuzzing::msg_decode(data));
