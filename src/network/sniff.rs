//! First-bytes sniffers: the TLS ClientHello's SNI (port 443) and the HTTP/1 Host (port 80).
//!
//! Pure functions over the bytes the guest sent so far: each answers "need more bytes", a
//! host name, or a refusal with a reason. The SNI parser is written by hand (a ClientHello is
//! a small, fixed structure; the TLS parsing crates pull in large parser stacks) and fuzzed
//! with proptest below. The HTTP side uses `httparse`.
//!
//! Refused on 443: anything that is not a TLS handshake record, a ClientHello without SNI, an
//! SNI that is an IP literal or not a valid name, several SNI names, and Encrypted Client
//! Hello (the real name would be hidden from the policy). Refused on 80: CONNECT, HTTP/2 prior
//! knowledge, no or several Host headers, an absolute-form URI whose host differs from Host,
//! and a Host port other than the connection's port.

use super::policy::host;

/// What the bytes so far show.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Sniffed {
    NeedMore,
    /// The host name, normalised.
    Host(String),
    Refused(String),
}

/// Largest ClientHello accepted (the stack caps its buffer too).
pub const MAX_CLIENT_HELLO: usize = 16 * 1024;

fn refused(why: impl Into<String>) -> Sniffed {
    Sniffed::Refused(why.into())
}

/// A big-endian reader over a slice; every read is bounds-checked.
struct Reader<'a> {
    b: &'a [u8],
}

impl<'a> Reader<'a> {
    fn u8(&mut self) -> Option<u8> {
        let (x, rest) = self.b.split_first()?;
        self.b = rest;
        Some(*x)
    }
    fn u16(&mut self) -> Option<u16> {
        let s = self.take(2)?;
        Some(u16::from_be_bytes([s[0], s[1]]))
    }
    fn take(&mut self, n: usize) -> Option<&'a [u8]> {
        if self.b.len() < n {
            return None;
        }
        let (a, rest) = self.b.split_at(n);
        self.b = rest;
        Some(a)
    }
    fn vec8(&mut self) -> Option<&'a [u8]> {
        let n = self.u8()? as usize;
        self.take(n)
    }
    fn vec16(&mut self) -> Option<&'a [u8]> {
        let n = self.u16()? as usize;
        self.take(n)
    }
}

/// The SNI of a TLS ClientHello (possibly split over several records and segments).
pub fn tls_sni(bytes: &[u8]) -> Sniffed {
    // Reassemble the handshake message from consecutive handshake records.
    let mut hs = Vec::new();
    let mut rest = bytes;
    let need_len = loop {
        if rest.len() < 5 {
            if rest.first().is_some_and(|b| *b != 0x16) {
                return refused("not a TLS handshake record");
            }
            return Sniffed::NeedMore;
        }
        if rest[0] != 0x16 {
            return refused("not a TLS handshake record");
        }
        if rest[1] != 0x03 || rest[2] > 0x04 {
            return refused("not a TLS record version");
        }
        let len = u16::from_be_bytes([rest[3], rest[4]]) as usize;
        if len == 0 || len > 16384 + 256 {
            return refused("bad TLS record length");
        }
        if rest.len() < 5 + len {
            // Use what arrived of this record; the handshake header may already be complete.
            hs.extend_from_slice(&rest[5..]);
            if hs.len() >= 4 {
                let n = hs_len(&hs);
                if hs[0] != 0x01 {
                    return refused("first handshake message is not a ClientHello");
                }
                if n > MAX_CLIENT_HELLO {
                    return refused("ClientHello too large");
                }
            }
            return Sniffed::NeedMore;
        }
        hs.extend_from_slice(&rest[5..5 + len]);
        rest = &rest[5 + len..];
        if hs.len() >= 4 {
            if hs[0] != 0x01 {
                return refused("first handshake message is not a ClientHello");
            }
            let n = hs_len(&hs);
            if n > MAX_CLIENT_HELLO {
                return refused("ClientHello too large");
            }
            if hs.len() >= 4 + n {
                break n;
            }
        }
    };
    client_hello_sni(&hs[4..4 + need_len])
}

fn hs_len(hs: &[u8]) -> usize {
    (hs[1] as usize) << 16 | (hs[2] as usize) << 8 | hs[3] as usize
}

fn client_hello_sni(body: &[u8]) -> Sniffed {
    let malformed = || refused("malformed ClientHello");
    let mut r = Reader { b: body };
    let Some(_version) = r.u16() else {
        return malformed();
    };
    if r.take(32).is_none() {
        return malformed();
    }
    match r.vec8() {
        Some(s) if s.len() <= 32 => {}
        _ => return malformed(),
    }
    match r.vec16() {
        Some(c) if !c.is_empty() && c.len() % 2 == 0 => {}
        _ => return malformed(),
    }
    match r.vec8() {
        Some(c) if !c.is_empty() => {}
        _ => return malformed(),
    }
    if r.b.is_empty() {
        return refused("ClientHello has no extensions (no SNI)");
    }
    let Some(exts) = r.vec16() else {
        return malformed();
    };
    if !r.b.is_empty() {
        return malformed();
    }
    let mut e = Reader { b: exts };
    let mut sni: Option<String> = None;
    let mut seen = std::collections::HashSet::new();
    while !e.b.is_empty() {
        let (Some(kind), Some(data)) = (e.u16(), e.vec16()) else {
            return malformed();
        };
        if !seen.insert(kind) {
            return refused(format!("duplicate TLS extension {kind:#06x}"));
        }
        match kind {
            0x0000 => match server_name(data) {
                Ok(n) => sni = Some(n),
                Err(why) => return refused(why),
            },
            // Encrypted Client Hello (and its draft code points): the real name is hidden.
            0xfe0d | 0xfe08 | 0xfe09 | 0xfe0a => {
                return refused("Encrypted Client Hello hides the server name");
            }
            _ => {}
        }
    }
    match sni {
        Some(n) => Sniffed::Host(n),
        None => refused("ClientHello has no SNI"),
    }
}

fn server_name(data: &[u8]) -> Result<String, String> {
    let mut r = Reader { b: data };
    let list = r.vec16().ok_or("malformed server_name extension")?;
    if !r.b.is_empty() {
        return Err("malformed server_name extension".into());
    }
    let mut l = Reader { b: list };
    let mut name = None;
    while !l.b.is_empty() {
        let kind = l.u8().ok_or("malformed server_name list")?;
        let n = l.vec16().ok_or("malformed server_name list")?;
        if kind != 0 {
            continue;
        }
        if name.is_some() {
            return Err("several SNI host names".into());
        }
        let s = std::str::from_utf8(n).map_err(|_| "SNI is not ASCII".to_owned())?;
        if !s.is_ascii() {
            return Err("SNI is not ASCII".into());
        }
        name = Some(s.to_owned());
    }
    let s = name.ok_or("server_name extension without a host name")?;
    match host::normalize(&s) {
        Ok(host::Host::Name(n)) => Ok(n),
        Ok(host::Host::Ip(ip)) => Err(format!("SNI is an IP literal ({ip})")),
        Err(e) => Err(format!("invalid SNI: {e}")),
    }
}

/// The Host of the first HTTP/1 request, checked against the connection's port.
pub fn http_host(bytes: &[u8], port: u16) -> Sniffed {
    if bytes.starts_with(b"PRI * HTTP/2") {
        return refused("HTTP/2 prior knowledge is not inspected");
    }
    let mut headers = [httparse::EMPTY_HEADER; 96];
    let mut req = httparse::Request::new(&mut headers);
    match req.parse(bytes) {
        Ok(httparse::Status::Partial) => {
            if bytes.len() > MAX_CLIENT_HELLO {
                return refused("HTTP request head too large");
            }
            return Sniffed::NeedMore;
        }
        Ok(httparse::Status::Complete(_)) => {}
        Err(e) => return refused(format!("not an HTTP/1 request: {e}")),
    }
    let method = req.method.unwrap_or("");
    if method.eq_ignore_ascii_case("CONNECT") {
        return refused("CONNECT is refused");
    }
    let hosts: Vec<&[u8]> = req
        .headers
        .iter()
        .filter(|h| h.name.eq_ignore_ascii_case("host"))
        .map(|h| h.value)
        .collect();
    let raw = match hosts.as_slice() {
        [one] => *one,
        [] => return refused("HTTP request without Host"),
        _ => return refused("several Host headers"),
    };
    let Ok(raw) = std::str::from_utf8(raw) else {
        return refused("Host is not text");
    };
    let name = match host_with_port(raw.trim(), port) {
        Ok(n) => n,
        Err(why) => return refused(format!("Host: {why}")),
    };
    // Absolute-form target (`GET http://x/ HTTP/1.1`): its authority must be the same host.
    let path = req.path.unwrap_or("");
    if let Some(after) = path
        .get(..7)
        .filter(|s| s.eq_ignore_ascii_case("http://"))
        .map(|_| &path[7..])
        .or_else(|| {
            path.get(..8)
                .filter(|s| s.eq_ignore_ascii_case("https://"))
                .map(|_| &path[8..])
        })
    {
        let authority = after.split(['/', '?', '#']).next().unwrap_or("");
        match host_with_port(authority, port) {
            Ok(n) if n == name => {}
            Ok(n) => return refused(format!("request target host {n} differs from Host {name}")),
            Err(why) => return refused(format!("request target: {why}")),
        }
    } else if !path.starts_with('/') && path != "*" {
        return refused("unexpected request target form");
    }
    Sniffed::Host(name)
}

fn host_with_port(s: &str, port: u16) -> Result<String, String> {
    let (h, p) = host::split_host_port(s).map_err(|e| e.to_string())?;
    if let Some(p) = p
        && p != port
    {
        return Err(format!(
            "port {p} differs from the connection's port {port}"
        ));
    }
    match host::normalize(h).map_err(|e| e.to_string())? {
        host::Host::Name(n) => Ok(n),
        host::Host::Ip(ip) => Err(format!("{ip} is an IP literal")),
    }
}

/// Test helpers: build ClientHellos.
#[cfg(test)]
pub mod testing {
    /// A minimal TLS 1.2-style ClientHello record with these extensions `(type, data)`.
    pub fn client_hello_with(exts: &[(u16, Vec<u8>)]) -> Vec<u8> {
        let mut body = vec![0x03, 0x03];
        body.extend([7u8; 32]);
        body.push(0);
        body.extend([0, 2, 0x13, 0x01]);
        body.extend([1, 0]);
        let mut e = Vec::new();
        for (t, d) in exts {
            e.extend(t.to_be_bytes());
            e.extend((d.len() as u16).to_be_bytes());
            e.extend(d);
        }
        body.extend((e.len() as u16).to_be_bytes());
        body.extend(e);
        let mut hs = vec![0x01];
        hs.extend(&(body.len() as u32).to_be_bytes()[1..]);
        hs.extend(body);
        let mut rec = vec![0x16, 0x03, 0x01];
        rec.extend((hs.len() as u16).to_be_bytes());
        rec.extend(hs);
        rec
    }

    pub fn sni_ext(names: &[&str]) -> (u16, Vec<u8>) {
        let mut list = Vec::new();
        for n in names {
            list.push(0);
            list.extend((n.len() as u16).to_be_bytes());
            list.extend(n.as_bytes());
        }
        let mut d = (list.len() as u16).to_be_bytes().to_vec();
        d.extend(list);
        (0, d)
    }

    pub fn client_hello(sni: &str) -> Vec<u8> {
        client_hello_with(&[(0x000a, vec![0, 2, 0, 0x1d]), sni_ext(&[sni])])
    }
}

#[cfg(test)]
mod tests {
    use super::testing::*;
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn sni_is_found_and_normalised() {
        assert_eq!(
            tls_sni(&client_hello("Allowed.Test")),
            Sniffed::Host("allowed.test".into())
        );
        assert_eq!(
            tls_sni(&client_hello("allowed.test.")),
            Sniffed::Host("allowed.test".into())
        );
    }

    #[test]
    fn split_client_hello_needs_more_at_every_cut() {
        let ch = client_hello("allowed.test");
        for cut in 0..ch.len() {
            assert_eq!(tls_sni(&ch[..cut]), Sniffed::NeedMore, "cut at {cut}");
        }
    }

    #[test]
    fn client_hello_over_several_records_is_reassembled() {
        let ch = client_hello("allowed.test");
        let hs = &ch[5..];
        let (a, b) = hs.split_at(20);
        let mut two = Vec::new();
        for part in [a, b] {
            two.extend([0x16, 0x03, 0x01]);
            two.extend((part.len() as u16).to_be_bytes());
            two.extend(part);
        }
        assert_eq!(tls_sni(&two), Sniffed::Host("allowed.test".into()));
    }

    fn is_refused(s: Sniffed) -> bool {
        matches!(s, Sniffed::Refused(_))
    }

    #[test]
    fn hostile_client_hellos_are_refused() {
        assert!(is_refused(tls_sni(&client_hello_with(&[(
            0x000a,
            vec![0, 2, 0, 0x1d]
        )]))));
        assert!(is_refused(tls_sni(&client_hello("203.0.113.10"))));
        assert!(is_refused(tls_sni(&client_hello("::1"))));
        assert!(is_refused(tls_sni(&client_hello("a.com@b.com"))));
        assert!(is_refused(tls_sni(&client_hello("127.1"))));
        assert!(is_refused(tls_sni(&client_hello_with(&[sni_ext(&[
            "a.com", "b.com"
        ])]))));
        assert!(is_refused(tls_sni(&client_hello_with(&[
            sni_ext(&["a.com"]),
            sni_ext(&["b.com"])
        ]))));
        assert!(is_refused(tls_sni(&client_hello_with(&[
            sni_ext(&["a.com"]),
            (0xfe0d, vec![0; 8])
        ]))));
        assert!(is_refused(tls_sni(
            b"GET / HTTP/1.1\r\nHost: a.com\r\n\r\n"
        )));
        assert!(is_refused(tls_sni(b"SSH-2.0-OpenSSH_9.0\r\n")));
        // A record that says "application data".
        let mut ch = client_hello("a.com");
        ch[0] = 0x17;
        assert!(is_refused(tls_sni(&ch)));
        // Not a ClientHello handshake type.
        let mut ch = client_hello("a.com");
        ch[5] = 0x02;
        assert!(is_refused(tls_sni(&ch)));
    }

    proptest! {
        #[test]
        fn sni_parser_never_panics(bytes in proptest::collection::vec(any::<u8>(), 0..600)) {
            let _ = tls_sni(&bytes);
        }

        #[test]
        fn corrupted_client_hellos_never_panic(idx in 0usize..120, val in any::<u8>()) {
            let mut ch = client_hello("allowed.test");
            let i = idx % ch.len();
            ch[i] = val;
            // Either the same name, need more, or refused: never another allowed name by
            // accident of a flipped length byte reading past the name.
            match tls_sni(&ch) {
                Sniffed::Host(h) => prop_assert!(h.len() <= "allowed.test".len() + 1, "{}", h),
                Sniffed::NeedMore | Sniffed::Refused(_) => {}
            }
        }

        #[test]
        fn http_parser_never_panics(bytes in proptest::collection::vec(any::<u8>(), 0..400)) {
            let _ = http_host(&bytes, 80);
        }
    }

    #[test]
    fn http_host_is_found_with_or_without_port() {
        assert_eq!(
            http_host(b"GET / HTTP/1.1\r\nHost: Allowed.Test\r\n\r\n", 80),
            Sniffed::Host("allowed.test".into())
        );
        assert_eq!(
            http_host(b"GET / HTTP/1.1\r\nhost: allowed.test:80\r\n\r\n", 80),
            Sniffed::Host("allowed.test".into())
        );
        assert_eq!(
            http_host(
                b"GET http://allowed.test/x HTTP/1.1\r\nHost: allowed.test\r\n\r\n",
                80
            ),
            Sniffed::Host("allowed.test".into())
        );
    }

    #[test]
    fn partial_http_needs_more() {
        let full = b"GET / HTTP/1.1\r\nHost: allowed.test\r\nUser-Agent: x\r\n\r\n";
        for cut in 0..full.len() {
            assert_eq!(http_host(&full[..cut], 80), Sniffed::NeedMore, "cut {cut}");
        }
    }

    #[test]
    fn hostile_http_is_refused() {
        for req in [
            &b"CONNECT evil.com:443 HTTP/1.1\r\nHost: allowed.test\r\n\r\n"[..],
            b"GET / HTTP/1.1\r\n\r\n",
            b"GET / HTTP/1.1\r\nHost: allowed.test\r\nHost: evil.com\r\n\r\n",
            b"GET http://evil.com/ HTTP/1.1\r\nHost: allowed.test\r\n\r\n",
            b"GET http://allowed.test@evil.com/ HTTP/1.1\r\nHost: allowed.test\r\n\r\n",
            b"GET / HTTP/1.1\r\nHost: allowed.test:8080\r\n\r\n",
            b"GET / HTTP/1.1\r\nHost: allowed.test@evil.com\r\n\r\n",
            b"GET / HTTP/1.1\r\nHost: 203.0.113.10\r\n\r\n",
            b"GET / HTTP/1.1\r\nHost: [::ffff:127.0.0.1]\r\n\r\n",
            b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n",
            b"\x16\x03\x01\x00\x05hello",
        ] {
            assert!(
                is_refused(http_host(req, 80)),
                "{:?} accepted",
                String::from_utf8_lossy(req)
            );
        }
    }
}
