//! Fuzzes the userspace network stack with the byte stream QEMU's `-netdev stream` socket
//! delivers (4-byte length, Ethernet frame, repeated): the frame reader, the classifier,
//! smoltcp, TCP flows (connect, inspect, relay) and DNS over UDP and TCP, against a fake gate.
//! The engine's randomness is fixed, so saved inputs that complete a handshake replay. No
//! panic, and queues and tables within their limits (libFuzzer's memory limits catch the rest).
//! The check is `network::stack::fuzzing::stack_frames`, which `cargo test` also runs on the
//! saved corpus (`fuzz/corpus/stack_frames/`).
//! Run: `cargo xtask fuzz --target stack_frames` (or `cargo +nightly fuzz run stack_frames` in the repository root).
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

fuzz_target!(|data: &[u8]| network::fuzzing::stack_frames(data));
