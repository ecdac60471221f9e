//! Fuzzes the agent channel's frame decoder with arbitrary bytes: it must return a frame, ask
//! for more bytes, or fail cleanly, never panic and never allocate more than one frame.
//! Run: `cargo +nightly fuzz run frame_decode` from the repository root.
#![no_main]

// The codec and message types are compiled straight from the main crate's sources
// (`frame` refers to `super::msg`, so both sit side by side at the crate root).
#[allow(dead_code)]
#[path = "../../src/rpc/frame.rs"]
mod frame;
#[allow(dead_code)]
#[path = "../../src/rpc/msg.rs"]
mod msg;

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    // Whole buffer as a stream of frames.
    let mut rest = data;
    while let Ok(Some((frame, used))) = frame::decode_frame(rest) {
        // Whatever decodes must encode again and decode to the same frame.
        let bytes = frame::encode(&frame).expect("a decoded frame re-encodes");
        let (again, _) = frame::decode_frame(&bytes).expect("re-decodes").expect("complete");
        assert_eq!(again, frame);
        rest = &rest[used..];
    }
    // And as a bare payload.
    let _ = frame::decode_payload(data);
});
