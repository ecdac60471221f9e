//! Fuzzes the agent channel's frame decoder with arbitrary bytes: it must return a frame, ask
//! for more bytes, or fail cleanly, never panic and never allocate more than one frame; whatever
//! decodes must re-encode to the same frame. The check is `rpc::fuzzing::frame_decode`, which
//! `cargo test` also runs on the saved corpus (`fuzz/corpus/frame_decode/`).
//! Run: `cargo +nightly fuzz run frame_decode` from the repository root.
#![no_main]

// The codec, the message types and the checks are compiled straight from the main crate's
// sources (they refer to each other as `super::`, so all sit side by side at the crate root).
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

fuzz_target!(|data: &[u8]| fuzzing::frame_decode(data));
