//! Fuzzes the git proxy's `git-receive-pack` screener (`secrets::git::pktline`): the first byte
//! picks the grant's push patterns and how the body is cut into chunks, the rest is a push's
//! request body (pkt-line commands, shallow lines, push certificates, a pack). The decision must
//! not depend on the cuts, an allowed push's refs must pass the patterns, and a refusal's
//! report-status must parse back (side-band demultiplexed). The check is
//! `secrets::git::fuzzing::receive_pack`, which `cargo test` also runs on the saved corpus
//! (`fuzz/corpus/receive_pack/`) and on a bounded number of random inputs.
//! Run: `cargo xtask fuzz --target receive_pack` (or `cargo +nightly fuzz run receive_pack`).
#![no_main]

// The screener, the push patterns and the check, compiled straight from the main crate's
// sources; they use only each other (`super::`), `thiserror` and `tracing`.
#[allow(dead_code)]
#[path = "../../src/secrets/git"]
mod git {
    pub mod fuzzing;
    pub mod pktline;
    pub mod refs;
}

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| git::fuzzing::receive_pack(data));
