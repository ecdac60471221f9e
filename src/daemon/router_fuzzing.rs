//! The check of the `http_router` fuzz target: one HTTP request as a local client (another
//! user allowed on the socket, a TCP client with the token, or the MCP model through the
//! server) may send it, through [`super::router::parse_request`]. Shared by the fuzz crate
//! (which links the library with `--cfg fuzzing` and reaches it through `tryboxi::fuzzing`) and
//! the unit tests that replay the saved corpus (`fuzz/corpus/http_router/`) and a bounded
//! random run in every `cargo test`.
//!
//! Input: the first byte picks the method, then the request target up to the first `\n`, the
//! `Accept` header value up to the next `\n`, and the rest is the body. A target hyper would not
//! parse, or a header value it would refuse, never reaches the router and is skipped.
//!
//! Asserted beyond "no panic": a refusal is a 4xx with a message (never a 5xx: the router has
//! no business logic that may fail); an accepted request names a documented route (its method
//! and path match one of [`super::router::ROUTES`], the table tested against
//! `api/openapi.yaml`); parsing is deterministic.

use hyper::{HeaderMap, Method, Uri, header};

use super::router::{ROUTES, parse_request};

const METHODS: [&str; 8] = [
    "GET", "POST", "PUT", "DELETE", "PATCH", "HEAD", "OPTIONS", "TRACE",
];

/// Whether `path` (no query) is `template`'s shape: the same literal segments, and one
/// non-empty segment for each `{param}`. The router's own trimming of trailing slashes applies.
fn matches(template: &str, path: &str) -> bool {
    let t: Vec<&str> = template.split('/').skip(1).collect();
    let p: Vec<&str> = path.trim_end_matches('/').split('/').skip(1).collect();
    t.len() == p.len()
        && t.iter().zip(&p).all(|(t, p)| {
            if t.starts_with('{') && t.ends_with('}') {
                !p.is_empty()
            } else {
                t == p
            }
        })
}

/// The fuzz check (see the module docs).
pub fn http_router(data: &[u8]) {
    let Some((&m, rest)) = data.split_first() else {
        return;
    };
    let method = Method::from_bytes(METHODS[m as usize % METHODS.len()].as_bytes())
        .expect("a standard method");
    let (target, rest) = split_line(rest);
    let (accept, body) = split_line(rest);
    let Ok(uri) = Uri::try_from(target) else {
        return;
    };
    let mut headers = HeaderMap::new();
    if !accept.is_empty() {
        let Ok(v) = header::HeaderValue::from_bytes(accept) else {
            return;
        };
        headers.insert(header::ACCEPT, v);
    }
    let first = parse_request(&method, &uri, &headers, body);
    let again = parse_request(&method, &uri, &headers, body);
    assert_eq!(
        format!("{first:?}"),
        format!("{again:?}"),
        "the same request parsed twice differs"
    );
    match first {
        Ok(action) => {
            let path = uri.path();
            assert!(
                ROUTES
                    .iter()
                    .any(|(m, t)| *m == method.as_str() && matches(t, path)),
                "{method} {path} was accepted ({action:?}) but is no documented route"
            );
        }
        Err(e) => {
            assert!(
                e.status.is_client_error(),
                "{method} {uri}: a refusal must be 4xx, got {} ({})",
                e.status,
                e.message
            );
            assert!(!e.message.is_empty(), "{method} {uri}: an empty message");
        }
    }
}

fn split_line(b: &[u8]) -> (&[u8], &[u8]) {
    match b.iter().position(|&c| c == b'\n') {
        Some(i) => (&b[..i], &b[i + 1..]),
        None => (b, &[]),
    }
}

/// One seed per documented route (ids of the right shape, a small JSON body), and a few that
/// reach the refusals: the corpus `cargo xtask fuzz` starts from.
#[cfg(test)]
pub fn seeds() -> Vec<(String, Vec<u8>)> {
    let mut out = Vec::new();
    for (i, (m, t)) in ROUTES.iter().enumerate() {
        let path = t
            .replace("/execs/{id}", "/execs/exe_0123456789abcdef")
            .replace("{id}", "sbx_0123456789abcdef")
            .replace("{art_id}", "art_0123456789abcdef")
            .replace("{req_id}", "req_0123456789abcdef")
            .replace("{name}", "GITHUB_TOKEN")
            .replace("{port}", "3000");
        let query = match *t {
            "/v1/events" => "?since=0",
            "/v1/sandboxes/{id}/diff" => "?stat=true&path=src",
            "/v1/execs/{id}/output" => "?offset=0&limit=10",
            "/v1/sandboxes/{id}/files" => "?path=/workspace/a.txt",
            _ => "",
        };
        let body = if *m == "GET" || *m == "DELETE" {
            ""
        } else {
            "{}"
        };
        let mi = METHODS.iter().position(|x| x == m).expect("a known method") as u8;
        let mut b = vec![mi];
        b.extend_from_slice(format!("{path}{query}\n\n{body}").as_bytes());
        out.push((format!("route-{i:02}"), b));
    }
    let extra: [(&str, u8, &str); 6] = [
        ("bad-json", 1, "/v1/sandboxes\n\n{not json"),
        ("bad-id", 0, "/v1/sandboxes/sbx_../etc\n\n"),
        (
            "unknown-query",
            0,
            "/v1/sandboxes/sbx_0123456789abcdef/diff?bogus=1\n\n",
        ),
        ("wrong-method", 2, "/v1/sandboxes\n\n{}"),
        (
            "sse",
            1,
            "/v1/sandboxes/sbx_0123456789abcdef/exec\ntext/event-stream\n{\"cmd\":\"true\"}",
        ),
        (
            "deep",
            0,
            "/v1/sandboxes/sbx_0123456789abcdef/network/requests/x/y/z\n\n",
        ),
    ];
    for (name, m, text) in extra {
        let mut b = vec![m];
        b.extend_from_slice(text.as_bytes());
        out.push((name.to_owned(), b));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn corpus() -> std::path::PathBuf {
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("fuzz/corpus/http_router")
    }

    #[test]
    fn route_shapes_match_like_the_router() {
        assert!(matches("/v1/sandboxes/{id}", "/v1/sandboxes/sbx_1/"));
        assert!(!matches("/v1/sandboxes/{id}", "/v1/sandboxes/"));
        assert!(!matches("/v1/sandboxes/{id}", "/v1/sandboxes/a/b"));
        assert!(!matches("/v1/health", "/v1/healthz"));
    }

    #[test]
    fn the_route_table_has_no_undocumented_path_and_the_seeds_reach_each_action() {
        // An accepted path outside the table is what the check refuses.
        assert!(
            !ROUTES
                .iter()
                .any(|(m, t)| *m == "GET" && matches(t, "/v1/undocumented"))
        );
        // And every seed of a documented route is accepted by the router, so the corpus
        // reaches past the route match into each action's own parsing.
        let accepted = seeds()
            .iter()
            .filter(|(n, _)| n.starts_with("route-"))
            .filter(|(_, b)| {
                let (t, rest) = split_line(&b[1..]);
                let (_, body) = split_line(rest);
                let m = Method::from_bytes(METHODS[b[0] as usize].as_bytes()).unwrap();
                parse_request(&m, &Uri::try_from(t).unwrap(), &HeaderMap::new(), body).is_ok()
            })
            .count();
        assert!(
            accepted * 10 >= ROUTES.len() * 7,
            "{accepted} of {}",
            ROUTES.len()
        );
    }

    /// `cargo test --lib write_http_router_seed_corpus -- --ignored`
    #[test]
    #[ignore]
    fn write_http_router_seed_corpus() {
        std::fs::create_dir_all(corpus()).unwrap();
        for (name, b) in seeds() {
            std::fs::write(corpus().join(format!("seed-{name}")), b).unwrap();
        }
    }

    #[test]
    fn saved_http_router_seeds_are_current_and_replay_cleanly() {
        for (name, bytes) in seeds() {
            let p = corpus().join(format!("seed-{name}"));
            let saved = std::fs::read(&p).unwrap_or_else(|e| {
                panic!("{}: {e}; run write_http_router_seed_corpus", p.display())
            });
            assert_eq!(saved, bytes, "{} is stale", p.display());
        }
        let mut n = 0;
        for e in std::fs::read_dir(corpus()).unwrap() {
            http_router(&std::fs::read(e.unwrap().path()).unwrap());
            n += 1;
        }
        assert!(n >= seeds().len());
    }

    /// A bounded random run in every `cargo test`: seeds mutated by a fixed-seed xorshift.
    #[test]
    fn random_requests_hold_the_router_checks() {
        let mut x: u64 = 0x2545_f491_4f6c_dd1d;
        let mut next = move || {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x
        };
        let seeds = seeds();
        let pieces: [&[u8]; 8] = [
            b"/",
            b"..",
            b"%2e",
            b"?",
            b"&a=",
            b"{",
            b"\"",
            b"sbx_0123456789abcdef",
        ];
        for _ in 0..5000 {
            let mut b = seeds[(next() % seeds.len() as u64) as usize].1.clone();
            for _ in 0..(next() % 4) {
                if b.len() < 2 {
                    break;
                }
                let i = 1 + (next() % (b.len() as u64 - 1)) as usize;
                match next() % 5 {
                    0 => b[i] = next() as u8,
                    1 => b.truncate(i),
                    2 => {
                        let p = pieces[(next() % pieces.len() as u64) as usize];
                        b.splice(i..i, p.iter().copied());
                    }
                    3 => b[0] = next() as u8,
                    _ => {
                        b.remove(i);
                    }
                }
            }
            http_router(&b);
        }
    }
}
