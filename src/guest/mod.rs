//! The guest agent: PID 1 inside every VM.

use std::process::ExitCode;

pub fn run() -> ExitCode {
    eprintln!("tryboxi: the guest agent is not built into this binary yet");
    ExitCode::from(64)
}
