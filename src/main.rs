//! `tryboxi`: one static binary with many faces (daemon, CLI, MCP server, guest agent).
//!
//! Dispatch only, in the library's [`tryboxi::run`]: by argv[0] (`sandboxd`, `sandboxctl`,
//! `sandbox-mcp`, `init`) or by subcommand.

fn main() -> std::process::ExitCode {
    tryboxi::run()
}
