//! The git proxy through the interceptor, from a native peer: a rustls guest talks through
//! [`Interceptor::serve`] to the local echo upstream (see `tests.rs`), whose host `api.test`
//! holds a repository grant `api.test/o/r` (push `agent/*`) with the token of secret `KEY`.

use base64::Engine as _;
use base64::engine::general_purpose::STANDARD;
use bytes::Bytes;
use http_body_util::StreamBody;
use hyper::body::Frame;
use hyper::{Request, StatusCode};

use super::body::{boxed, full};
use super::tests::{HOST, Harness, PH, VAL, assert_no_value, binding, client, harness_with};
use crate::secrets::git::pktline::pkt;
use crate::secrets::{GitGrant, Snapshot};

const ZERO: &str = "0000000000000000000000000000000000000000";
const NEW: &str = "1111111111111111111111111111111111111111";

/// `(host, status, reason)` of every `git.refused`.
type Refused = std::sync::Arc<std::sync::Mutex<Vec<(String, u16, String)>>>;

async fn git_harness() -> (Harness, Refused) {
    let h = harness_with(false, true).await;
    let refused: Refused = Default::default();
    let r2 = refused.clone();
    h.icpt.set_git_sink(std::sync::Arc::new(
        move |host: &str, status: u16, reason: &str| {
            r2.lock()
                .unwrap()
                .push((host.to_owned(), status, reason.to_owned()))
        },
    ));
    h.icpt.secrets().publish(Snapshot {
        bindings: vec![binding("KEY", HOST, PH, VAL, false)],
        git: vec![GitGrant {
            repo: format!("{HOST}/o/r"),
            push: vec!["agent/*".into()],
            token_secret: "KEY".into(),
        }],
    });
    (h, refused)
}

fn token_auth(token: &str) -> String {
    format!(
        "Basic {}",
        STANDARD.encode(format!("x-access-token:{token}"))
    )
}

fn last_seen(h: &Harness) -> String {
    h.seen.lock().unwrap().last().cloned().unwrap_or_default()
}

/// A receive-pack body updating `refs/heads/<branch>`, cut into frames of `cut` bytes.
fn push_request(h2: bool, branch: &str, cut: usize) -> Request<super::body::ProxyBody> {
    let mut body = pkt(format!(
        "{ZERO} {NEW} refs/heads/{branch}\0report-status side-band-64k agent=git/2\n"
    )
    .as_bytes());
    body.extend_from_slice(b"0000PACK\x00\x00\x00\x02\x00\x00\x00\x00pack-bytes-follow");
    let frames: Vec<Result<Frame<Bytes>, super::BoxError>> = body
        .chunks(cut)
        .map(|c| Ok(Frame::data(Bytes::copy_from_slice(c))))
        .collect();
    let path = "/o/r.git/git-receive-pack";
    let b = if h2 {
        Request::builder().uri(format!("https://{HOST}{path}"))
    } else {
        Request::builder().uri(path).header("host", HOST)
    };
    b.method("POST")
        .header("content-type", "application/x-git-receive-pack-request")
        .body(boxed(StreamBody::new(futures_util::stream::iter(frames))))
        .unwrap()
}

#[tokio::test]
async fn a_granted_repository_gets_the_token_and_no_other_does() {
    let (h, refused) = git_harness().await;
    for h2 in [false, true] {
        let mut c = client(&h, h2).await;
        // git's first request carries no credentials: it gets the token anyway.
        let g = c
            .get("/o/r.git/info/refs?service=git-upload-pack", &[])
            .await;
        assert_eq!(g.status, 200, "{}", g.body);
        let seen = last_seen(&h);
        assert!(
            seen.contains(&format!("auth={}", token_auth(VAL))),
            "{seen}"
        );
        assert!(seen.contains("ae=identity"), "{seen}");
        // The echoed token comes back as the placeholder's Basic form, never the value.
        assert_no_value(&g);
        assert!(g.body.contains(&token_auth(PH)), "{}", g.body);
        assert!(
            !g.body.contains(&token_auth(VAL)),
            "token leaked: {}",
            g.body
        );
        // Whatever the client sends is replaced (any case of the repository).
        let g = c
            .get(
                "/O/R/info/refs?service=git-upload-pack",
                &[("authorization", &token_auth("guessed-by-the-agent"))],
            )
            .await;
        assert_eq!(g.status, 200);
        assert!(last_seen(&h).contains(&format!("auth={}", token_auth(VAL))));
        // Another repository on the same host: no token.
        let g = c
            .get("/o/other.git/info/refs?service=git-upload-pack", &[])
            .await;
        assert_eq!(g.status, 200);
        let seen = last_seen(&h);
        assert!(seen.contains("auth= "), "{seen}");
        // ... and the token's placeholder sent there by hand is refused, not forwarded.
        let before = h.seen.lock().unwrap().len();
        let g = c
            .get(
                "/o/other.git/info/refs?service=git-upload-pack",
                &[("authorization", &token_auth(PH))],
            )
            .await;
        assert_eq!(g.status, StatusCode::FORBIDDEN, "{}", g.body);
        assert!(g.body.contains("api.test/o/r"), "{}", g.body);
        assert_eq!(h.seen.lock().unwrap().len(), before);
    }
    // Each refusal is reported (`git.refused`), without the value.
    let r = refused.lock().unwrap();
    assert_eq!(r.len(), 2, "{r:?}");
    assert!(
        r.iter()
            .all(|(host, st, why)| host == HOST && *st == 403 && !why.contains(VAL))
    );
}

#[tokio::test]
async fn a_push_outside_the_patterns_is_refused_with_a_report_and_never_forwarded() {
    let (h, refused) = git_harness().await;
    for h2 in [false, true] {
        let mut c = client(&h, h2).await;
        let before = h.seen.lock().unwrap().len();
        for cut in [3, 4096] {
            let g = c.send(push_request(h2, "main", cut)).await;
            assert_eq!(g.status, 200, "{}", g.body);
            assert_eq!(
                g.headers["content-type"],
                "application/x-git-receive-pack-result"
            );
            assert!(g.body.contains("ng refs/heads/main"), "{}", g.body);
            assert!(g.body.contains("unpack ok"), "{}", g.body);
        }
        assert_eq!(
            h.seen.lock().unwrap().len(),
            before,
            "a refused push reached upstream"
        );
        {
            let r = refused.lock().unwrap();
            let last = r.last().cloned().unwrap_or_default();
            assert_eq!(last.1, 200, "{r:?}");
            assert!(last.2.contains("push to main is not allowed"), "{r:?}");
        }

        // agent/x: the held preamble and the rest of the body reach upstream with the token.
        for cut in [3, 4096] {
            let g = c.send(push_request(h2, "agent/x", cut)).await;
            assert_eq!(g.status, 200, "{}", g.body);
            let seen = last_seen(&h);
            assert!(
                seen.contains(&format!("auth={}", token_auth(VAL))),
                "{seen}"
            );
            assert!(seen.contains("refs/heads/agent/x"), "{seen}");
            assert!(seen.contains("pack-bytes-follow"), "{seen}");
            assert!(seen.contains("/o/r.git/git-receive-pack auth="), "{seen}");
            assert_no_value(&g);
        }
        assert_eq!(h.seen.lock().unwrap().len(), before + 2);
    }
    // A compressed push body cannot be screened: refused before anything is forwarded.
    let mut c = client(&h, false).await;
    let before = h.seen.lock().unwrap().len();
    let mut req = push_request(false, "agent/x", 4096);
    req.headers_mut()
        .insert("content-encoding", "gzip".parse().unwrap());
    let g = c.send(req).await;
    assert_eq!(g.status, 415, "{}", g.body);
    assert_eq!(h.seen.lock().unwrap().len(), before);
}

#[tokio::test]
async fn graphql_ref_mutations_with_the_token_are_refused() {
    let (h, _) = git_harness().await;
    let mut c = client(&h, false).await;
    let post = |body: &str| {
        Request::builder()
            .method("POST")
            .uri("/api/graphql")
            .header("host", HOST)
            .header("content-type", "application/json")
            .header("authorization", format!("Bearer {PH}"))
            .body(full(body.to_owned()))
            .unwrap()
    };
    let before = h.seen.lock().unwrap().len();
    let g = c
        .send(post(
            r#"{"query":"mutation { createRef(input:{repositoryId:\"x\",name:\"refs/heads/main\",oid:\"1\"}) { clientMutationId } }"}"#,
        ))
        .await;
    assert_eq!(g.status, StatusCode::FORBIDDEN, "{}", g.body);
    assert!(g.body.contains("createRef"), "{}", g.body);
    assert_eq!(h.seen.lock().unwrap().len(), before);
    // A read passes, with the placeholder swapped as usual.
    let g = c.send(post(r#"{"query":"{ viewer { login } }"}"#)).await;
    assert_eq!(g.status, 200, "{}", g.body);
    let seen = last_seen(&h);
    assert!(seen.contains(&format!("auth=Bearer {VAL}")), "{seen}");
    assert!(seen.contains("viewer"), "{seen}");
    assert_no_value(&g);
    // A body past the bound is refused unread.
    let big = format!(
        r#"{{"query":"{{ viewer {{ login }} }}","pad":"{}"}}"#,
        "x".repeat(1 << 20)
    );
    let g = c.send(post(&big)).await;
    assert_eq!(g.status, 413, "{}", g.body);
    // A REST ref write with the token: refused.
    let req = Request::builder()
        .method("POST")
        .uri("/api/v3/repos/o/r/git/refs")
        .header("host", HOST)
        .header("authorization", format!("Bearer {PH}"))
        .body(full("{}"))
        .unwrap();
    let g = c.send(req).await;
    assert_eq!(g.status, StatusCode::FORBIDDEN, "{}", g.body);
}
