//! Placeholders: what a sandbox sees in place of a secret's value. `tbx_` + 32 characters of
//! `[a-z2-7]` (base32 of 20 bytes from the OS random source: 160 bits), minted per sandbox and
//! secret, never derived from the name or the value. Made of `[a-z0-9_]` so they survive
//! shells, URLs, JSON and base64 alphabets unchanged.

/// Every placeholder starts with this.
pub const PREFIX: &str = "tbx_";
/// The random part's length.
pub const RANDOM_LEN: usize = 32;
const ALPHABET: &[u8; 32] = b"abcdefghijklmnopqrstuvwxyz234567";

#[derive(Debug, thiserror::Error)]
#[error("the kernel's random source is unavailable: {0}")]
pub struct NoRandom(String);

/// A fresh placeholder.
pub fn mint() -> Result<String, NoRandom> {
    let mut raw = [0u8; 20];
    getrandom::fill(&mut raw).map_err(|e| NoRandom(e.to_string()))?;
    let mut out = String::with_capacity(PREFIX.len() + RANDOM_LEN);
    out.push_str(PREFIX);
    // 20 bytes = 160 bits = 32 groups of 5 bits.
    let mut acc: u64 = 0;
    let mut bits = 0;
    for b in raw {
        acc = (acc << 8) | u64::from(b);
        bits += 8;
        while bits >= 5 {
            bits -= 5;
            out.push(ALPHABET[((acc >> bits) & 31) as usize] as char);
        }
    }
    Ok(out)
}

/// `p` has a placeholder's shape.
#[cfg(test)]
pub fn is_placeholder(p: &str) -> bool {
    p.strip_prefix(PREFIX)
        .is_some_and(|r| r.len() == RANDOM_LEN && r.bytes().all(|c| ALPHABET.contains(&c)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn placeholders_have_the_alphabet_and_length_and_differ() {
        let mut seen = std::collections::HashSet::new();
        let mut chars = std::collections::HashSet::new();
        for _ in 0..2000 {
            let p = mint().unwrap();
            assert_eq!(p.len(), 36, "{p}");
            assert!(is_placeholder(&p), "{p}");
            assert!(
                p.bytes()
                    .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == b'_')
            );
            chars.extend(p[4..].bytes());
            assert!(seen.insert(p), "a placeholder repeated");
        }
        // All 32 symbols show up: the bits are spread over the whole alphabet.
        assert_eq!(chars.len(), 32);
        assert!(!is_placeholder("tbx_short"));
        assert!(!is_placeholder(&format!("tbx_{}", "A".repeat(32))));
        assert!(!is_placeholder(&format!("tbx_{}", "1".repeat(32))));
    }
}
