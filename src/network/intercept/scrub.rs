//! Streaming byte replacement (aho-corasick with a carry of the chunk's tail that could start a
//! pattern, at most longest-pattern-minus-one bytes, so a pattern split across chunks is still
//! found and a streamed response is not delayed otherwise), the rendered forms of a secret
//! value that responses are scrubbed of, and the response content decoders (gzip, deflate, br;
//! anything else fails closed; each input chunk's output is capped, so a decompression bomb is
//! cut off).
//!
//! Used both ways: requests swap placeholder -> value in bodies (`--in-body`), responses scrub
//! value (and its base64, URL-encoded, JSON-escaped and Basic renderings) -> placeholder.

use std::io::Write as _;
use std::sync::Arc;

use aho_corasick::{AhoCorasick, MatchKind};
use base64::Engine as _;

#[derive(Debug, thiserror::Error)]
pub enum ScrubError {
    #[error("response content encoding {0:?} cannot be decoded for scrubbing")]
    UnknownEncoding(String),
    #[error("response body does not decode as {0}")]
    Decode(&'static str),
    #[error("decoded response chunk larger than {0} bytes")]
    TooLarge(usize),
}

/// Largest output one input chunk may decode to (a deflate bomb is cut off, not buffered).
pub const MAX_DECODED_CHUNK: usize = 32 * 1024 * 1024;

/// A fixed set of `pattern -> replacement` pairs.
pub struct Replacer {
    ac: AhoCorasick,
    pats: Vec<Vec<u8>>,
    repl: Vec<Vec<u8>>,
    max_len: usize,
}

impl std::fmt::Debug for Replacer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Replacer({} patterns)", self.repl.len())
    }
}

impl Replacer {
    /// `None` when there is nothing to replace. Empty patterns are ignored; the longest
    /// pattern wins where several match at one place.
    pub fn new(pairs: Vec<(Vec<u8>, Vec<u8>)>) -> Option<Arc<Replacer>> {
        let mut pairs: Vec<_> = pairs.into_iter().filter(|(p, _)| !p.is_empty()).collect();
        pairs.sort();
        pairs.dedup_by(|a, b| a.0 == b.0);
        if pairs.is_empty() {
            return None;
        }
        let max_len = pairs.iter().map(|(p, _)| p.len()).max().unwrap_or(0);
        let ac = AhoCorasick::builder()
            .match_kind(MatchKind::LeftmostLongest)
            .build(pairs.iter().map(|(p, _)| p))
            .ok()?;
        let (pats, repl) = pairs.into_iter().unzip();
        Some(Arc::new(Replacer {
            ac,
            pats,
            repl,
            max_len,
        }))
    }

    /// The same patterns, each replaced by its replacement cut or repeated to the pattern's
    /// length: for bytes inside length-framed data (protobuf fields, WebSocket frames) whose
    /// lengths cannot change.
    pub fn same_length(&self) -> Option<Arc<Replacer>> {
        Replacer::new(
            self.pats
                .iter()
                .zip(&self.repl)
                .map(|(p, r)| {
                    let mask: Vec<u8> = if r.is_empty() {
                        vec![b'*'; p.len()]
                    } else {
                        r.iter().copied().cycle().take(p.len()).collect()
                    };
                    (p.clone(), mask)
                })
                .collect(),
        )
    }

    /// The length of the longest tail of `b` that is a proper prefix of a pattern.
    pub fn prefix_tail(&self, b: &[u8]) -> usize {
        let most = b.len().min(self.max_len.saturating_sub(1));
        (1..=most)
            .rev()
            .find(|&k| {
                let tail = &b[b.len() - k..];
                self.pats.iter().any(|p| p.len() > k && p.starts_with(tail))
            })
            .unwrap_or(0)
    }

    /// The longest pattern's length.
    pub fn max_len(&self) -> usize {
        self.max_len
    }

    /// Whether `b` holds a pattern that starts before `start` and ends after it (a value split
    /// across two frames that are forwarded one at a time).
    pub fn straddles(&self, b: &[u8], start: usize) -> bool {
        self.ac
            .find_iter(b)
            .any(|m| m.start() < start && m.end() > start)
    }

    pub fn replace_all(&self, b: &[u8]) -> Vec<u8> {
        let mut out = Vec::with_capacity(b.len());
        self.ac.replace_all_with_bytes(b, &mut out, |m, _, dst| {
            dst.extend_from_slice(&self.repl[m.pattern().as_usize()]);
            true
        });
        out
    }

    pub fn contains(&self, b: &[u8]) -> bool {
        self.ac.is_match(b)
    }
}

/// A [`Replacer`] applied to a stream of chunks.
#[derive(Debug)]
pub struct StreamReplace {
    r: Arc<Replacer>,
    carry: Vec<u8>,
    /// Replacements made so far.
    pub hits: usize,
}

impl StreamReplace {
    pub fn new(r: Arc<Replacer>) -> StreamReplace {
        StreamReplace {
            r,
            carry: Vec::new(),
            hits: 0,
        }
    }

    pub fn replacer(&self) -> &Replacer {
        &self.r
    }

    /// Replace in `chunk`; returns what can be emitted now. Only a tail of `buf` that is the
    /// start of some pattern (at most `max_len - 1` bytes) is held back, so a streamed response
    /// (server-sent events, a model's tokens) is not delayed unless a chunk ends inside what
    /// might be a value.
    pub fn push(&mut self, chunk: &[u8]) -> Vec<u8> {
        let mut buf = std::mem::take(&mut self.carry);
        buf.extend_from_slice(chunk);
        // Any pattern starting before `safe` lies wholly inside `buf` (otherwise `buf` would end
        // with a proper prefix of it, held back), so it is found now.
        let safe = buf.len() - self.r.prefix_tail(&buf);
        let mut out = Vec::with_capacity(buf.len());
        let mut pos = 0;
        for m in self.r.ac.find_iter(&buf) {
            if m.start() >= safe {
                break;
            }
            out.extend_from_slice(&buf[pos..m.start()]);
            out.extend_from_slice(&self.r.repl[m.pattern().as_usize()]);
            pos = m.end();
            self.hits += 1;
        }
        let cut = pos.max(safe);
        out.extend_from_slice(&buf[pos..cut]);
        self.carry = buf.split_off(cut);
        out
    }

    /// The held-back tail, replaced.
    pub fn finish(&mut self) -> Vec<u8> {
        let tail = std::mem::take(&mut self.carry);
        let out = self.r.replace_all(&tail);
        if out != tail {
            self.hits += 1;
        }
        out
    }
}

/// The renderings of `value` a response might carry, each paired with the same rendering of
/// `placeholder`: raw, base64 (standard and URL-safe, padded or not), URL-encoded, JSON-escaped,
/// and `basic` (the `user:value` strings of swapped Basic credentials) base64-encoded.
pub fn rendered_forms(
    value: &[u8],
    placeholder: &[u8],
    basic: &[(Vec<u8>, Vec<u8>)],
) -> Vec<(Vec<u8>, Vec<u8>)> {
    use base64::engine::general_purpose::{STANDARD, STANDARD_NO_PAD, URL_SAFE, URL_SAFE_NO_PAD};
    let mut v = vec![(value.to_vec(), placeholder.to_vec())];
    for e in [&STANDARD, &STANDARD_NO_PAD, &URL_SAFE, &URL_SAFE_NO_PAD] {
        v.push((
            e.encode(value).into_bytes(),
            e.encode(placeholder).into_bytes(),
        ));
    }
    for (with_value, with_placeholder) in basic {
        v.push((
            STANDARD.encode(with_value).into_bytes(),
            STANDARD.encode(with_placeholder).into_bytes(),
        ));
        v.push((with_value.clone(), with_placeholder.clone()));
    }
    let url = percent_encoding::percent_encode(value, percent_encoding::NON_ALPHANUMERIC)
        .to_string()
        .into_bytes();
    v.push((url, placeholder.to_vec()));
    let url_min = percent_encoding::percent_encode(value, QUERY_VALUE)
        .to_string()
        .into_bytes();
    v.push((url_min, placeholder.to_vec()));
    if let Ok(s) = std::str::from_utf8(value)
        && let Ok(j) = serde_json::to_string(s)
    {
        let inner = j.as_bytes()[1..j.len() - 1].to_vec();
        v.push((inner.clone(), placeholder.to_vec()));
        // Also with `/` escaped, as some encoders do.
        v.push((
            String::from_utf8_lossy(&inner)
                .replace('/', "\\/")
                .into_bytes(),
            placeholder.to_vec(),
        ));
    }
    v
}

/// Bytes percent-encoded when a value is put into a URL query.
pub const QUERY_VALUE: &percent_encoding::AsciiSet = &percent_encoding::NON_ALPHANUMERIC
    .remove(b'-')
    .remove(b'_')
    .remove(b'.')
    .remove(b'~');

/// A streaming decoder for a response's `content-encoding`.
pub enum Decoder {
    Gzip(flate2::write::GzDecoder<Vec<u8>>),
    Deflate(flate2::write::ZlibDecoder<Vec<u8>>),
    /// Boxed: the decoder's state is large.
    Brotli(Box<brotli_decompressor::DecompressorWriter<Capped>>),
}

/// The brotli decoder's output: a brotli stream can expand far more per input byte than
/// deflate (a few KiB to gigabytes), so the cap is enforced while decoding, not after: a write
/// past [`MAX_DECODED_CHUNK`] fails, which fails the decode.
pub struct Capped {
    buf: Vec<u8>,
    /// Room left for this input chunk's output.
    limit: usize,
    over: bool,
}

impl std::io::Write for Capped {
    fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
        if self.buf.len() + b.len() > self.limit {
            self.over = true;
            return Err(std::io::Error::other("decoded response chunk too large"));
        }
        self.buf.extend_from_slice(b);
        Ok(b.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl std::fmt::Debug for Decoder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Decoder::Gzip(_) => "Decoder::Gzip",
            Decoder::Deflate(_) => "Decoder::Deflate",
            Decoder::Brotli(_) => "Decoder::Brotli",
        })
    }
}

impl Decoder {
    /// `Ok(None)`: identity. Unknown or stacked encodings fail closed.
    pub fn for_encoding(enc: Option<&str>) -> Result<Option<Decoder>, ScrubError> {
        let Some(enc) = enc.map(|e| e.trim().to_ascii_lowercase()) else {
            return Ok(None);
        };
        match enc.as_str() {
            "" | "identity" => Ok(None),
            "gzip" | "x-gzip" => Ok(Some(Decoder::Gzip(flate2::write::GzDecoder::new(
                Vec::new(),
            )))),
            "deflate" => Ok(Some(Decoder::Deflate(flate2::write::ZlibDecoder::new(
                Vec::new(),
            )))),
            "br" => Ok(Some(Decoder::Brotli(Box::new(
                brotli_decompressor::DecompressorWriter::new(
                    Capped {
                        buf: Vec::new(),
                        limit: MAX_DECODED_CHUNK,
                        over: false,
                    },
                    4096,
                ),
            )))),
            other => Err(ScrubError::UnknownEncoding(other.to_owned())),
        }
    }

    fn name(&self) -> &'static str {
        match self {
            Decoder::Gzip(_) => "gzip",
            Decoder::Deflate(_) => "deflate",
            Decoder::Brotli(_) => "br",
        }
    }

    fn take(&mut self) -> Vec<u8> {
        match self {
            Decoder::Gzip(d) => std::mem::take(d.get_mut()),
            Decoder::Deflate(d) => std::mem::take(d.get_mut()),
            Decoder::Brotli(d) => std::mem::take(&mut d.get_mut().buf),
        }
    }

    pub fn push(&mut self, chunk: &[u8]) -> Result<Vec<u8>, ScrubError> {
        let name = self.name();
        let mut out = Vec::new();
        // Feed in slices so one chunk's output stays bounded.
        for piece in chunk.chunks(4096) {
            if let Decoder::Brotli(d) = self {
                d.get_mut().limit = MAX_DECODED_CHUNK.saturating_sub(out.len());
            }
            let r = match self {
                Decoder::Gzip(d) => d.write_all(piece),
                Decoder::Deflate(d) => d.write_all(piece),
                Decoder::Brotli(d) => d.write_all(piece),
            };
            if let Decoder::Brotli(d) = self
                && d.get_ref().over
            {
                return Err(ScrubError::TooLarge(MAX_DECODED_CHUNK));
            }
            r.map_err(|_| ScrubError::Decode(name))?;
            out.extend(self.take());
            if out.len() > MAX_DECODED_CHUNK {
                return Err(ScrubError::TooLarge(MAX_DECODED_CHUNK));
            }
        }
        Ok(out)
    }

    pub fn finish(&mut self) -> Result<Vec<u8>, ScrubError> {
        let name = self.name();
        let r = match self {
            Decoder::Gzip(d) => d.try_finish(),
            Decoder::Deflate(d) => d.try_finish(),
            Decoder::Brotli(d) => d.close(),
        };
        if let Decoder::Brotli(d) = self
            && d.get_ref().over
        {
            return Err(ScrubError::TooLarge(MAX_DECODED_CHUNK));
        }
        r.map_err(|_| ScrubError::Decode(name))?;
        Ok(self.take())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn brotli(data: &[u8]) -> Vec<u8> {
        let mut out = Vec::new();
        {
            let mut w = brotli::CompressorWriter::new(&mut out, 4096, 9, 22);
            w.write_all(data).unwrap();
        }
        out
    }

    #[test]
    fn brotli_is_decoded_split_anywhere_and_a_bomb_is_cut_off() {
        let mut text = b"{\"echo\":\"".to_vec();
        text.extend_from_slice(V);
        text.extend_from_slice(b"\"} ");
        text.extend(b"filler ".repeat(2000));
        let br = brotli(&text);
        let r = scrubber();
        for step in [1, 3, 7, 100, br.len()] {
            let mut d = Decoder::for_encoding(Some("br")).unwrap().unwrap();
            let mut s = StreamReplace::new(r.clone());
            let mut out = Vec::new();
            for c in br.chunks(step) {
                out.extend(s.push(&d.push(c).unwrap()));
            }
            out.extend(s.push(&d.finish().unwrap()));
            out.extend(s.finish());
            assert_eq!(out, r.replace_all(&text), "step {step}");
            assert!(!out.windows(V.len()).any(|w| w == V));
        }
        // 64 MiB of zeros compresses to a few KiB (one input chunk): decoding stops at the
        // 32 MiB cap, with an error, instead of growing a buffer.
        let mut bomb = Vec::new();
        {
            let mut w = brotli::CompressorWriter::new(&mut bomb, 1 << 16, 5, 22);
            let zeros = vec![0u8; 1 << 20];
            for _ in 0..64 {
                w.write_all(&zeros).unwrap();
            }
        }
        assert!(bomb.len() < 16 * 1024, "{}", bomb.len());
        let mut d = Decoder::for_encoding(Some("br")).unwrap().unwrap();
        let r = d.push(&bomb);
        assert!(matches!(r, Err(ScrubError::TooLarge(_))), "{r:?}");
        // Not brotli at all.
        let mut d = Decoder::for_encoding(Some("br")).unwrap().unwrap();
        assert!(d.push(b"\xff\xff\xff\xff not brotli").is_err() || d.finish().is_err());
    }

    const V: &[u8] = b"sk-live-0123456789abcdef";
    const P: &[u8] = b"tbx_aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa";

    fn scrubber() -> Arc<Replacer> {
        Replacer::new(rendered_forms(
            V,
            P,
            &[(b"me:sk".to_vec(), b"me:tbx".to_vec())],
        ))
        .unwrap()
    }

    #[test]
    fn a_value_split_at_every_offset_is_replaced() {
        let r = scrubber();
        let mut text = b"head ".to_vec();
        text.extend_from_slice(V);
        text.extend_from_slice(b" mid ");
        text.extend_from_slice(V);
        text.extend_from_slice(b" tail");
        let want = r.replace_all(&text);
        assert!(!want.windows(V.len()).any(|w| w == V));
        for a in 0..=text.len() {
            for b in a..=text.len() {
                let mut s = StreamReplace::new(r.clone());
                let mut out = s.push(&text[..a]);
                out.extend(s.push(&text[a..b]));
                out.extend(s.push(&text[b..]));
                out.extend(s.finish());
                assert_eq!(out, want, "split at {a},{b}");
                assert_eq!(s.hits, 2, "split at {a},{b}");
            }
        }
        // Byte by byte.
        let mut s = StreamReplace::new(r.clone());
        let mut out = Vec::new();
        for b in &text {
            out.extend(s.push(std::slice::from_ref(b)));
        }
        out.extend(s.finish());
        assert_eq!(out, want);
    }

    #[test]
    fn only_a_possible_start_of_a_value_is_held_back() {
        let r = scrubber();
        let mut s = StreamReplace::new(r.clone());
        // Nothing here can start a value: all of it is emitted at once.
        assert_eq!(
            s.push(b"data: {\"t\":\"hi\"}\n\n"),
            b"data: {\"t\":\"hi\"}\n\n"
        );
        // A chunk ending in the first bytes of the value: those wait for the next chunk.
        assert_eq!(s.push(b"x sk-li"), b"x ");
        let mut out = s.push(&V[5..]);
        out.extend(s.finish());
        assert_eq!(out, P);
        // Ending in a byte that only looks like a start: held, then released.
        let mut s = StreamReplace::new(r);
        assert_eq!(s.push(b"ask"), b"a");
        assert_eq!(s.push(b"ed\n"), b"sked\n");
    }

    #[test]
    fn every_rendered_form_is_scrubbed() {
        use base64::engine::general_purpose::{STANDARD, URL_SAFE_NO_PAD};
        let r = scrubber();
        let forms: Vec<Vec<u8>> = vec![
            V.to_vec(),
            STANDARD.encode(V).into_bytes(),
            URL_SAFE_NO_PAD.encode(V).into_bytes(),
            STANDARD.encode(b"me:sk").into_bytes(),
        ];
        for f in forms {
            let out = r.replace_all(&f);
            assert_ne!(out, f);
        }
        // JSON and URL renderings of a value with special characters.
        let v2 = b"a/b\"c+d e";
        let r2 = Replacer::new(rendered_forms(v2, P, &[])).unwrap();
        for f in [
            &b"a/b\\\"c+d e"[..],
            b"a\\/b\\\"c+d e",
            b"a%2Fb%22c%2Bd%20e",
        ] {
            assert_eq!(r2.replace_all(f), P, "{}", String::from_utf8_lossy(f));
        }
    }

    #[test]
    fn gzip_is_decoded_and_unknown_encodings_fail_closed() {
        let mut e = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::default());
        e.write_all(b"hello ").unwrap();
        e.write_all(V).unwrap();
        let gz = e.finish().unwrap();
        let mut d = Decoder::for_encoding(Some("gzip")).unwrap().unwrap();
        let mut out = Vec::new();
        for c in gz.chunks(3) {
            out.extend(d.push(c).unwrap());
        }
        out.extend(d.finish().unwrap());
        assert_eq!(&out[..6], b"hello ");
        assert!(matches!(
            Decoder::for_encoding(Some("zstd")),
            Err(ScrubError::UnknownEncoding(_))
        ));
        assert!(Decoder::for_encoding(Some("gzip, br")).is_err());
        assert!(Decoder::for_encoding(Some("identity")).unwrap().is_none());
        let mut d = Decoder::for_encoding(Some("gzip")).unwrap().unwrap();
        assert!(d.push(b"not gzip at all").is_err() || d.finish().is_err());
    }
}
