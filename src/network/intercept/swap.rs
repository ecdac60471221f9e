//! Request rewriting: the placeholder -> value swap in authorization positions (headers and URL
//! query) for the bindings that serve the request's host, and the block check: a placeholder,
//! in any of its encodings, in an authorization position of a request to a host its secret
//! does not serve.
//!
//! Authorization positions: `authorization` (Bearer or anything else as raw text; Basic is
//! decoded, swapped and re-encoded), `proxy-authorization`, `x-api-key`, `api-key`,
//! `x-goog-api-key`, the binding's extra headers, and the URL query. Bodies are swapped by the
//! proxy with a streaming [`Replacer`](super::scrub::Replacer) when the binding allows it.

use base64::Engine as _;
use base64::engine::general_purpose::{STANDARD, STANDARD_NO_PAD, URL_SAFE_NO_PAD};
use hyper::header::{HeaderName, HeaderValue};

use super::scrub::QUERY_VALUE;
use crate::secrets::{Binding, Snapshot};

/// Headers that carry credentials for every secret.
pub const AUTH_HEADERS: [&str; 5] = [
    "authorization",
    "proxy-authorization",
    "x-api-key",
    "api-key",
    "x-goog-api-key",
];

#[derive(Debug, thiserror::Error)]
pub enum SwapError {
    #[error("the value of secret {0} cannot be put into header {1}")]
    BadHeaderValue(String, String),
    #[error("the request URL with secret {0} swapped in is invalid")]
    BadUri(String),
}

/// A placeholder found in an authorization position of a request to a host its secret does
/// not serve. Names the secret and where; never holds a value.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Blocked {
    pub secret: String,
    /// `header <name>`, `query`, `dns name`, or `body`.
    pub position: String,
    /// `false`: seen in a position that is allowed and only audited (a request body).
    pub refused: bool,
}

/// What a swap did (for the response scrubber).
#[derive(Debug, Default)]
pub struct Swapped {
    /// Indexes into the snapshot's bindings whose value went into the request head.
    pub used: Vec<usize>,
    /// `(user:value, user:placeholder)` of swapped Basic credentials.
    pub basic: Vec<(Vec<u8>, Vec<u8>)>,
}

fn positions(b: &Binding) -> impl Iterator<Item = &str> + '_ {
    AUTH_HEADERS
        .iter()
        .copied()
        .chain(b.headers.iter().map(String::as_str))
}

fn find(hay: &[u8], needle: &[u8]) -> bool {
    !needle.is_empty()
        && hay
            .windows(needle.len())
            .any(|w| w.eq_ignore_ascii_case(needle))
}

/// `hay` holds `placeholder` raw, percent-encoded, JSON-escaped or inside a base64 token.
pub fn contains_placeholder(hay: &[u8], placeholder: &str) -> bool {
    let p = placeholder.as_bytes();
    if find(hay, p) {
        return true;
    }
    let pct: Vec<u8> = percent_encoding::percent_decode(hay).collect();
    if find(&pct, p) {
        return true;
    }
    for decoded in [&pct[..], hay] {
        if let Some(j) = json_unescape(decoded)
            && find(&j, p)
        {
            return true;
        }
        for token in decoded.split(|c| !(c.is_ascii_alphanumeric() || b"+/_-".contains(c))) {
            if token.len() < 8 {
                continue;
            }
            let t = trim_padding(token);
            for e in [&STANDARD_NO_PAD, &URL_SAFE_NO_PAD] {
                if let Ok(d) = e.decode(t)
                    && find(&d, p)
                {
                    return true;
                }
            }
        }
    }
    false
}

fn trim_padding(t: &[u8]) -> &[u8] {
    let mut end = t.len();
    while end > 0 && t[end - 1] == b'=' {
        end -= 1;
    }
    // Base64 without padding cannot have a length of 1 mod 4.
    if end % 4 == 1 {
        end -= 1;
    }
    &t[..end]
}

/// Undo JSON string escapes (`\uXXXX`, `\/`, `\\`...); `None` when there are none.
fn json_unescape(b: &[u8]) -> Option<Vec<u8>> {
    if !b.contains(&b'\\') {
        return None;
    }
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'\\' && i + 1 < b.len() {
            match b[i + 1] {
                b'u' if i + 6 <= b.len() => {
                    let hex = std::str::from_utf8(&b[i + 2..i + 6]).ok();
                    match hex.and_then(|h| u32::from_str_radix(h, 16).ok()) {
                        Some(c) if c < 0x80 => {
                            out.push(c as u8);
                            i += 6;
                            continue;
                        }
                        _ => out.push(b'\\'),
                    }
                }
                c @ (b'/' | b'\\' | b'"') => {
                    out.push(c);
                    i += 2;
                    continue;
                }
                _ => out.push(b'\\'),
            }
            i += 1;
        } else {
            out.push(b[i]);
            i += 1;
        }
    }
    Some(out)
}

/// The first placeholder of a secret that does not serve `host` found in an authorization
/// position: `headers` are `(lowercase name, value)` pairs, `query` the URL query.
pub fn find_blocked<'a, I>(
    snap: &Snapshot,
    host: &str,
    headers: I,
    query: Option<&str>,
) -> Option<Blocked>
where
    I: Iterator<Item = (&'a str, &'a [u8])> + Clone,
{
    for b in snap.bindings.iter().filter(|b| !b.serves(host)) {
        for (name, value) in headers.clone() {
            if positions(b).any(|p| p.eq_ignore_ascii_case(name))
                && contains_placeholder(value, &b.placeholder)
            {
                return Some(Blocked {
                    secret: b.name.clone(),
                    position: format!("header {}", name.to_ascii_lowercase()),
                    refused: true,
                });
            }
        }
        if let Some(q) = query
            && contains_placeholder(q.as_bytes(), &b.placeholder)
        {
            return Some(Blocked {
                secret: b.name.clone(),
                position: "query".into(),
                refused: true,
            });
        }
    }
    None
}

/// The names of the secrets whose placeholders (any encoding) a request carries in an
/// authorization position, whichever hosts they serve (the git proxy's input).
pub fn carried<'a, I>(snap: &Snapshot, headers: I, query: Option<&str>) -> Vec<String>
where
    I: Iterator<Item = (&'a str, &'a [u8])> + Clone,
{
    snap.bindings
        .iter()
        .filter(|b| {
            headers.clone().any(|(name, value)| {
                positions(b).any(|p| p.eq_ignore_ascii_case(name))
                    && contains_placeholder(value, &b.placeholder)
            }) || query.is_some_and(|q| contains_placeholder(q.as_bytes(), &b.placeholder))
        })
        .map(|b| b.name.clone())
        .collect()
}

/// [`find_blocked`] over the head of a plaintext HTTP/1 request (`None` if it does not parse:
/// the sniffer has refused such a flow already).
pub fn find_blocked_in_http1(bytes: &[u8], snap: &Snapshot, host: &str) -> Option<Blocked> {
    if snap.bindings.is_empty() {
        return None;
    }
    let mut headers = [httparse::EMPTY_HEADER; 96];
    let mut req = httparse::Request::new(&mut headers);
    req.parse(bytes).ok()?;
    let query = req.path.and_then(|p| p.split_once('?')).map(|(_, q)| q);
    let hs = req.headers.iter().map(|h| (h.name, h.value));
    find_blocked(snap, host, hs, query)
}

/// The first secret placeholder in a DNS name asked for (labels, any case).
pub fn find_in_dns_name(snap: &Snapshot, name: &str) -> Option<Blocked> {
    snap.bindings
        .iter()
        .find(|b| contains_placeholder(name.as_bytes(), &b.placeholder))
        .map(|b| Blocked {
            secret: b.name.clone(),
            position: "dns name".into(),
            refused: true,
        })
}

fn replace(hay: &[u8], needle: &[u8], with: &[u8]) -> Option<Vec<u8>> {
    if needle.is_empty() || !hay.windows(needle.len()).any(|w| w == needle) {
        return None;
    }
    let mut out = Vec::with_capacity(hay.len() + with.len());
    let mut i = 0;
    while i < hay.len() {
        if hay[i..].starts_with(needle) {
            out.extend_from_slice(with);
            i += needle.len();
        } else {
            out.push(hay[i]);
            i += 1;
        }
    }
    Some(out)
}

fn swap_header_value(name: &str, raw: &[u8], b: &Binding, sw: &mut Swapped) -> Option<Vec<u8>> {
    let ph = b.placeholder.as_bytes();
    let is_auth = name == "authorization" || name == "proxy-authorization";
    if is_auth && raw.len() > 6 && raw[..6].eq_ignore_ascii_case(b"basic ") {
        let token = raw[6..].trim_ascii();
        if let Ok(decoded) = STANDARD
            .decode(token)
            .or_else(|_| STANDARD_NO_PAD.decode(token))
            && let Some(swapped) = replace(&decoded, ph, b.value.bytes())
        {
            let mut out = raw[..6].to_vec();
            out.extend_from_slice(STANDARD.encode(&swapped).as_bytes());
            sw.basic.push((swapped, decoded));
            return Some(out);
        }
    }
    replace(raw, ph, b.value.bytes())
}

/// Swap the placeholders of the bindings serving `host` in the request head.
pub fn swap_head(
    parts: &mut hyper::http::request::Parts,
    snap: &Snapshot,
    host: &str,
) -> Result<Swapped, SwapError> {
    let mut sw = Swapped::default();
    for (i, b) in snap.bindings.iter().enumerate() {
        if !b.serves(host) {
            continue;
        }
        let mut used = false;
        let names: Vec<String> = positions(b).map(str::to_ascii_lowercase).collect();
        for name in names {
            let Ok(hn) = HeaderName::from_bytes(name.as_bytes()) else {
                continue;
            };
            let values: Vec<HeaderValue> = parts.headers.get_all(&hn).iter().cloned().collect();
            if values.is_empty() {
                continue;
            }
            let mut changed = false;
            let mut new_values = Vec::with_capacity(values.len());
            for v in values {
                match swap_header_value(&name, v.as_bytes(), b, &mut sw) {
                    Some(n) => {
                        let mut hv = HeaderValue::from_bytes(&n)
                            .map_err(|_| SwapError::BadHeaderValue(b.name.clone(), name.clone()))?;
                        hv.set_sensitive(true);
                        new_values.push(hv);
                        changed = true;
                    }
                    None => new_values.push(v),
                }
            }
            if changed {
                used = true;
                parts.headers.remove(&hn);
                for v in new_values {
                    parts.headers.append(hn.clone(), v);
                }
            }
        }
        if let Some(q) = parts.uri.query() {
            let enc = percent_encoding::percent_encode(b.value.bytes(), QUERY_VALUE).to_string();
            if let Some(nq) = replace(q.as_bytes(), b.placeholder.as_bytes(), enc.as_bytes()) {
                let path = parts.uri.path();
                let pq = format!("{path}?{}", String::from_utf8_lossy(&nq));
                let mut up = parts.uri.clone().into_parts();
                up.path_and_query =
                    Some(pq.parse().map_err(|_| SwapError::BadUri(b.name.clone()))?);
                parts.uri =
                    hyper::Uri::from_parts(up).map_err(|_| SwapError::BadUri(b.name.clone()))?;
                used = true;
            }
        }
        if used {
            sw.used.push(i);
        }
    }
    Ok(sw)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::secrets::Value;

    pub(crate) fn binding(name: &str, host: &str, ph: &str, value: &str) -> Binding {
        Binding {
            name: name.into(),
            hosts: vec![host.into()],
            headers: vec!["x-custom".into()],
            in_body: false,
            placeholder: ph.into(),
            value: Value::new(value.as_bytes().to_vec()),
        }
    }

    const PH: &str = "tbx_abcdefghijklmnopqrstuvwxyz234567";

    fn snap() -> Snapshot {
        Snapshot {
            bindings: vec![binding("KEY", "api.test", PH, "sk-real/+&=")],
            git: vec![],
        }
    }

    #[test]
    fn placeholders_are_found_in_every_encoding() {
        let b64 = STANDARD.encode(format!("user:{PH}"));
        let b64b = STANDARD.encode(format!("us:{PH}"));
        let url_all: String = PH.bytes().map(|c| format!("%{c:02X}")).collect();
        let json: String = PH.bytes().map(|c| format!("\\u{:04x}", c)).collect();
        for hay in [
            format!("Bearer {PH}"),
            format!("Basic {b64}"),
            format!("Basic {b64b}"),
            url_all,
            json,
            format!("k={}", URL_SAFE_NO_PAD.encode(PH)),
            PH.to_ascii_uppercase(),
        ] {
            assert!(contains_placeholder(hay.as_bytes(), PH), "{hay}");
        }
        assert!(!contains_placeholder(b"Bearer tbx_other", PH));
    }

    #[test]
    fn headers_and_query_are_swapped_for_the_secret_host_only() {
        let s = snap();
        let basic = STANDARD.encode(format!("me:{PH}"));
        let req = hyper::Request::builder()
            .uri(format!("/v1?key={PH}&x=1"))
            .header("authorization", format!("Basic {basic}"))
            .header("x-api-key", PH)
            .header("x-custom", format!("pre-{PH}"))
            .header("x-other", PH)
            .body(())
            .unwrap();
        let (mut parts, ()) = req.into_parts();
        let sw = swap_head(&mut parts, &s, "API.test").unwrap();
        assert_eq!(sw.used, [0]);
        let auth = parts.headers["authorization"].as_bytes();
        let dec = STANDARD.decode(&auth[6..]).unwrap();
        assert_eq!(dec, b"me:sk-real/+&=");
        assert_eq!(parts.headers["x-api-key"], "sk-real/+&=");
        assert_eq!(parts.headers["x-custom"], "pre-sk-real/+&=");
        // Not an authorization position: left alone.
        assert_eq!(parts.headers["x-other"], PH);
        assert_eq!(parts.uri.query(), Some("key=sk-real%2F%2B%26%3D&x=1"));
        assert_eq!(sw.basic.len(), 1);

        // Another host: nothing swapped, and the placeholder is blocked.
        let req = hyper::Request::builder()
            .uri("/")
            .header("authorization", format!("Bearer {PH}"))
            .body(())
            .unwrap();
        let (mut parts, ()) = req.into_parts();
        assert!(
            swap_head(&mut parts, &s, "evil.test")
                .unwrap()
                .used
                .is_empty()
        );
        let hs: Vec<(&str, &[u8])> = parts
            .headers
            .iter()
            .map(|(k, v)| (k.as_str(), v.as_bytes()))
            .collect();
        let b = find_blocked(&s, "evil.test", hs.iter().copied(), None).unwrap();
        assert_eq!(b.secret, "KEY");
        assert!(find_blocked(&s, "api.test", hs.iter().copied(), None).is_none());
        assert!(
            find_blocked(
                &s,
                "evil.test",
                std::iter::empty(),
                Some(&format!("a={PH}"))
            )
            .is_some()
        );
        // In a non-authorization header to another host: allowed.
        let body_like = [("x-note", PH.as_bytes())];
        assert!(find_blocked(&s, "evil.test", body_like.iter().copied(), None).is_none());
        assert!(find_in_dns_name(&s, &format!("{PH}.evil.test")).is_some());
        assert!(find_in_dns_name(&s, "evil.test").is_none());
        let head = format!("GET /?k={PH} HTTP/1.1\r\nHost: evil.test\r\n\r\n");
        let b = find_blocked_in_http1(head.as_bytes(), &s, "evil.test").unwrap();
        assert_eq!(b.position, "query");
        let head = format!("GET / HTTP/1.1\r\nHost: x\r\nX-Api-Key: {PH}\r\n\r\n");
        assert!(find_blocked_in_http1(head.as_bytes(), &s, "evil.test").is_some());
        assert!(find_blocked_in_http1(head.as_bytes(), &s, "api.test").is_none());
    }

    #[test]
    fn every_authorization_position_is_swapped_for_its_host_and_blocked_elsewhere() {
        let s = snap();
        let basic = STANDARD.encode(format!("u:{PH}"));
        let cases = [
            (
                "authorization",
                format!("Bearer {PH}"),
                "Bearer sk-real/+&=".to_owned(),
            ),
            (
                "proxy-authorization",
                format!("Basic {basic}"),
                format!("Basic {}", STANDARD.encode("u:sk-real/+&=")),
            ),
            (
                "proxy-authorization",
                format!("Bearer {PH}"),
                "Bearer sk-real/+&=".into(),
            ),
            ("x-api-key", PH.into(), "sk-real/+&=".into()),
            ("api-key", PH.into(), "sk-real/+&=".into()),
            ("x-goog-api-key", PH.into(), "sk-real/+&=".into()),
            // The binding's own `--header` (stored lowercase; sent in any case).
            ("X-Custom", format!("tok={PH}"), "tok=sk-real/+&=".into()),
        ];
        for (name, sent, want) in &cases {
            let req = hyper::Request::builder()
                .uri("/")
                .header(*name, sent.as_str())
                .body(())
                .unwrap();
            let (mut parts, ()) = req.into_parts();
            let sw = swap_head(&mut parts, &s, "api.test").unwrap();
            assert_eq!(sw.used, [0], "{name}");
            assert_eq!(parts.headers[*name], want.as_str(), "{name}");
            assert!(parts.headers[*name].is_sensitive(), "{name}");
            // The same header to another host: nothing swapped, refused naming the position.
            let req = hyper::Request::builder()
                .uri("/")
                .header(*name, sent.as_str())
                .body(())
                .unwrap();
            let (mut parts, ()) = req.into_parts();
            assert!(
                swap_head(&mut parts, &s, "evil.test")
                    .unwrap()
                    .used
                    .is_empty()
            );
            assert_eq!(parts.headers[*name], sent.as_str(), "{name}");
            let hs: Vec<(&str, &[u8])> = parts
                .headers
                .iter()
                .map(|(k, v)| (k.as_str(), v.as_bytes()))
                .collect();
            let b = find_blocked(&s, "evil.test", hs.iter().copied(), None)
                .unwrap_or_else(|| panic!("{name} to another host is not blocked"));
            assert_eq!(b.secret, "KEY");
            assert_eq!(b.position, format!("header {}", name.to_ascii_lowercase()));
            let head = format!("GET / HTTP/1.1\r\nHost: evil.test\r\n{name}: {sent}\r\n\r\n");
            assert!(
                find_blocked_in_http1(head.as_bytes(), &s, "evil.test").is_some(),
                "{name} in a plaintext head"
            );
        }
    }
}
