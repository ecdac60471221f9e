//! Fuzzes what an E2B SDK (or anyone holding a sandbox's envd token) sends `POST /files` as
//! `multipart/form-data`: boundary, `path`, limit and a body cut into two chunks anywhere,
//! through the parser the daemon uses. The check is `tryboxi::fuzzing::e2b_multipart`
//! (`src/e2b/upload.rs`), which `cargo test` also runs on the saved corpus
//! (`fuzz/corpus/e2b_multipart/`) and on 1,500 mutated seeds.
//! Run: `cargo xtask fuzz --target e2b_multipart` (or `cargo +nightly fuzz run e2b_multipart`).
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| tryboxi::fuzzing::e2b_multipart(data));
