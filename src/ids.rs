//! Resource identifiers: `sbx_` (sandboxes), `exe_` (execs), `art_` (backup artifacts).

/// Random, URL-safe, lower-case id with the given prefix (e.g. `sbx_3f9a0c1d2e4b`).
pub fn new_id(prefix: &str) -> String {
    let mut buf = [0u8; 8];
    getrandom::fill(&mut buf).expect("the kernel's random source is unavailable");
    format!("{prefix}{}", hex::encode(buf))
}

/// True when `id` has the prefix and a well-formed random part (guards paths built from ids).
pub fn is_valid(prefix: &str, id: &str) -> bool {
    id.strip_prefix(prefix).is_some_and(|rest| {
        rest.len() == 16
            && rest
                .bytes()
                .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
    })
}

pub const SANDBOX: &str = "sbx_";
pub const EXEC: &str = "exe_";
pub const ARTIFACT: &str = "art_";
pub const SNAPSHOT: &str = "snap_";
/// Network access requests.
pub const REQUEST: &str = "req_";

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_are_prefixed_and_validated() {
        let id = new_id(SANDBOX);
        assert!(is_valid(SANDBOX, &id), "{id}");
        assert!(!is_valid(EXEC, &id));
        assert!(!is_valid(SANDBOX, "sbx_../../etc"));
        assert!(!is_valid(SANDBOX, "sbx_"));
        assert_ne!(new_id(SANDBOX), new_id(SANDBOX));
    }
}
