//! Inbound scanning: finds a stored secret's value, or one of its encodings, in bytes going
//! into a VM (exec argv/cmd, env values, stdin, files written through the API, synced files).
//!
//! Owns: the encodings looked for — raw, standard and URL-safe base64 at each of the 3 byte
//! alignments (the characters that depend only on the value), hex in lower and upper case, and
//! percent-encoding (upper and lower case hex) — and the search (one aho-corasick automaton
//! over every pattern). Values shorter than [`MIN_VALUE`] bytes are not looked for (they would
//! match ordinary text). A match reports the secret's NAME, never the value.
//!
//! [`StreamScan`] scans a stream chunk by chunk, keeping the last `longest pattern - 1` bytes,
//! so a value split across chunks is found too.

use std::sync::Arc;

use aho_corasick::{AhoCorasick, AhoCorasickKind, MatchKind};
use zeroize::Zeroizing;

use super::Value;

/// Values shorter than this are not scanned for.
pub const MIN_VALUE: usize = 8;

/// The automaton over every stored value's encodings. Cheap to share (`Arc`).
#[derive(Default)]
pub struct Scanner {
    ac: Option<AhoCorasick>,
    /// Pattern index -> secret name.
    owner: Vec<Arc<str>>,
    longest: usize,
}

impl std::fmt::Debug for Scanner {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Scanner({} patterns)", self.owner.len())
    }
}

impl Scanner {
    /// A scanner for these (name, value) pairs.
    pub fn new(values: &[(String, Value)]) -> Scanner {
        let mut pats: Vec<Zeroizing<Vec<u8>>> = Vec::new();
        let mut owner: Vec<Arc<str>> = Vec::new();
        for (name, v) in values {
            if v.bytes().len() < MIN_VALUE {
                continue;
            }
            let name: Arc<str> = Arc::from(name.as_str());
            for p in encodings(v.bytes()) {
                if p.len() >= MIN_VALUE && !pats.iter().any(|q| **q == *p) {
                    pats.push(p);
                    owner.push(name.clone());
                }
            }
        }
        if pats.is_empty() {
            return Scanner::default();
        }
        let longest = pats.iter().map(|p| p.len()).max().unwrap_or(0);
        let ac = AhoCorasick::builder()
            .kind(Some(AhoCorasickKind::ContiguousNFA))
            .match_kind(MatchKind::Standard)
            .build(pats.iter().map(|p| p.as_slice()));
        match ac {
            Ok(ac) => Scanner {
                ac: Some(ac),
                owner,
                longest,
            },
            Err(e) => {
                // Only possible past aho-corasick's pattern-size limits, far above our bounds.
                tracing::error!(error = %e, "cannot build the secret scanner");
                Scanner::default()
            }
        }
    }

    /// No value to look for.
    pub fn is_empty(&self) -> bool {
        self.ac.is_none()
    }

    /// The name of a secret whose value (or an encoding of it) is in `hay`.
    pub fn find(&self, hay: &[u8]) -> Option<&str> {
        let ac = self.ac.as_ref()?;
        let m = ac.find(hay)?;
        self.owner.get(m.pattern().as_usize()).map(|n| &**n)
    }

    /// Scan `chunk` after `carry` (the end of what came before, kept by the caller across
    /// calls, perhaps across scanners): the name of a secret found, ending in this chunk or
    /// split between `carry` and it. `carry` becomes the end of the two.
    pub fn feed_carry(&self, carry: &mut Zeroizing<Vec<u8>>, chunk: &[u8]) -> Option<String> {
        if self.is_empty() {
            return None;
        }
        let mut buf = Zeroizing::new(Vec::with_capacity(carry.len() + chunk.len()));
        buf.extend_from_slice(carry);
        buf.extend_from_slice(chunk);
        let found = self.find(&buf).map(str::to_owned);
        let keep = self.longest.saturating_sub(1).min(buf.len());
        *carry = Zeroizing::new(buf[buf.len() - keep..].to_vec());
        found
    }

    /// A stream scan over this scanner.
    pub fn stream(&self) -> StreamScan<'_> {
        StreamScan {
            scanner: self,
            carry: Zeroizing::new(Vec::new()),
        }
    }
}

/// Scans a stream in chunks; a value split across chunks is found.
pub struct StreamScan<'a> {
    scanner: &'a Scanner,
    carry: Zeroizing<Vec<u8>>,
}

impl StreamScan<'_> {
    /// Scan the next chunk: the name of a secret found in the stream so far, ending in it.
    pub fn feed(&mut self, chunk: &[u8]) -> Option<String> {
        self.scanner.feed_carry(&mut self.carry, chunk)
    }
}

/// Every form of `v` looked for.
fn encodings(v: &[u8]) -> Vec<Zeroizing<Vec<u8>>> {
    let mut out = vec![Zeroizing::new(v.to_vec())];
    for engine in [
        &base64::engine::general_purpose::STANDARD_NO_PAD,
        &base64::engine::general_purpose::URL_SAFE_NO_PAD,
    ] {
        for align in 0..3 {
            out.push(base64_at(engine, v, align));
        }
    }
    out.push(Zeroizing::new(hex::encode(v).into_bytes()));
    out.push(Zeroizing::new(hex::encode_upper(v).into_bytes()));
    for upper in [true, false] {
        let p = percent(v, upper);
        if *p != *v {
            out.push(p);
        }
    }
    out
}

/// The base64 characters that depend on `v` alone when `v` starts at byte `align` (0..3) of
/// a 3-byte group: the characters that mix in a byte before or after it are left out.
fn base64_at(engine: &impl base64::Engine, v: &[u8], align: usize) -> Zeroizing<Vec<u8>> {
    let mut buf = Zeroizing::new(vec![0u8; align]);
    buf.extend_from_slice(v);
    let s = Zeroizing::new(engine.encode(&*buf).into_bytes());
    let start = [0, 2, 3][align];
    let end = if buf.len().is_multiple_of(3) {
        s.len()
    } else {
        s.len() - 1
    };
    Zeroizing::new(s[start.min(end)..end].to_vec())
}

/// Every byte but the RFC 3986 unreserved ones as `%XX`.
fn percent(v: &[u8], upper: bool) -> Zeroizing<Vec<u8>> {
    let digits: &[u8; 16] = if upper {
        b"0123456789ABCDEF"
    } else {
        b"0123456789abcdef"
    };
    let mut out = Zeroizing::new(Vec::with_capacity(v.len() * 3));
    for &b in v {
        if b.is_ascii_alphanumeric() || b"-._~".contains(&b) {
            out.push(b);
        } else {
            out.extend_from_slice(&[b'%', digits[(b >> 4) as usize], digits[(b & 15) as usize]]);
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use base64::Engine as _;
    use base64::engine::general_purpose::{STANDARD, URL_SAFE};

    const V: &[u8] = b"sk/live+0123?456789~ab\xffcd";

    fn scanner() -> Scanner {
        Scanner::new(&[
            ("OTHER".into(), Value::new(b"completely-different".to_vec())),
            ("API_KEY".into(), Value::new(V.to_vec())),
            ("SHORT".into(), Value::new(b"1234567".to_vec())),
        ])
    }

    #[test]
    fn every_encoding_is_found_at_every_alignment_with_text_around() {
        let s = scanner();
        let mut forms: Vec<Vec<u8>> = vec![
            V.to_vec(),
            hex::encode(V).into_bytes(),
            hex::encode_upper(V).into_bytes(),
            percent(V, true).to_vec(),
            percent(V, false).to_vec(),
        ];
        // base64 of the value behind 0..=5 other bytes, as in `Basic base64(user:value)`.
        for lead in 0..6 {
            let mut b = b"user:"[..lead.min(5)].to_vec();
            b.resize(lead, b'x');
            b.extend_from_slice(V);
            b.extend_from_slice(b"\n");
            forms.push(STANDARD.encode(&b).into_bytes());
            forms.push(URL_SAFE.encode(&b).into_bytes());
        }
        for f in forms {
            let mut hay = b"Authorization: Basic ".to_vec();
            hay.extend_from_slice(&f);
            hay.extend_from_slice(b" trailing");
            assert_eq!(
                s.find(&hay),
                Some("API_KEY"),
                "{}",
                String::from_utf8_lossy(&f)
            );
        }
        // A cut value, another secret's value, and a value shorter than 8 bytes.
        assert_eq!(s.find(&V[..V.len() - 1]), None);
        assert_eq!(s.find(b"x completely-different y"), Some("OTHER"));
        assert_eq!(s.find(b"1234567 and 1234567"), None);
        assert!(Scanner::new(&[]).find(V).is_none());
    }

    #[test]
    fn a_value_split_at_every_offset_across_two_chunks_is_found() {
        let s = scanner();
        let b64 = STANDARD.encode(V).into_bytes();
        for form in [V.to_vec(), b64, hex::encode(V).into_bytes()] {
            let mut hay = b"some text before the value ".to_vec();
            hay.extend_from_slice(&form);
            hay.extend_from_slice(b" and after");
            for cut in 0..=hay.len() {
                let mut st = s.stream();
                let a = st.feed(&hay[..cut]);
                let b = st.feed(&hay[cut..]);
                assert_eq!(a.or(b).as_deref(), Some("API_KEY"), "cut at {cut}");
            }
            // Byte by byte too.
            let mut st = s.stream();
            let found = hay.iter().filter_map(|c| st.feed(&[*c])).next();
            assert_eq!(found.as_deref(), Some("API_KEY"));
        }
        // A stream without the value finds nothing, however cut.
        let mut st = s.stream();
        for c in V[..V.len() - 1].chunks(3) {
            assert_eq!(st.feed(c), None);
        }
    }

    #[test]
    fn the_scanner_never_prints_a_value() {
        let s = format!("{:?}", scanner());
        assert!(!s.contains("live"), "{s}");
    }
}
