//! Fuzzes what a local client sends the daemon's HTTP API: method, target, `Accept` and body
//! through the router that turns them into one action. The check is
//! `tryboxi::fuzzing::http_router` (`src/daemon/router_fuzzing.rs`), which `cargo test` also runs
//! on the saved corpus (`fuzz/corpus/http_router/`) and on 5,000 mutated seeds.
//! Run: `cargo xtask fuzz --target http_router` (or `cargo +nightly fuzz run http_router`).
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| tryboxi::fuzzing::http_router(data));
