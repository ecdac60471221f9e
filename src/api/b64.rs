//! Standard base64 (RFC 4648, padded), used for binary payloads in JSON.

use base64::Engine as _;
use base64::engine::general_purpose::STANDARD;

pub fn encode(bytes: &[u8]) -> String {
    STANDARD.encode(bytes)
}

pub fn decode(s: &str) -> Result<Vec<u8>, String> {
    STANDARD
        .decode(s)
        .map_err(|e| format!("invalid base64: {e}"))
}
