//! The git proxy inside an intercepted flow: per request, [`crate::secrets::git::classify`]
//! decides (before the ordinary swap) whether the request goes to a granted repository (the
//! grant's token is put into `Authorization`, replacing the client's), whether a push's
//! command list is screened against the grant's branch patterns, whether a GraphQL body is
//! checked for ref-writing mutations, or whether the request is refused.
//!
//! Owns: building the [`RequestHead`] from a hyper request (including which secrets'
//! placeholders it carries in authorization positions), reading a push's preamble through the
//! [`Screener`] (holding at most [`crate::secrets::git::pktline::MAX_PREAMBLE`] bytes) and answering a refused push with the
//! report-status git prints, buffering a GraphQL body (at most [`MAX_GRAPHQL_BODY`] bytes).
//! Never: forwards a refused push's bytes upstream, or lets the token reach the guest (the
//! response to an injected request is scrubbed by the proxy like any swapped one).

use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use bytes::Bytes;
use http_body_util::BodyExt as _;
use hyper::body::{Body, Frame, SizeHint};
use hyper::header::{self, HeaderValue};
use hyper::{Response, StatusCode};

use super::body::{BoxError, ProxyBody, boxed, full};
use super::{Interceptor, swap};
use crate::secrets::Snapshot;
use crate::secrets::git::forge::MAX_GRAPHQL_BODY;
use crate::secrets::git::{Refusal, RequestHead, Screen, Screener, check_graphql};

/// The git proxy's view of a request head to `host` (the SNI the Host header matched).
pub fn request_head(
    snap: &Snapshot,
    host: &str,
    parts: &hyper::http::request::Parts,
) -> RequestHead {
    let text = |n: header::HeaderName| {
        parts
            .headers
            .get(n)
            .and_then(|v| v.to_str().ok())
            .map(str::to_owned)
    };
    let hs: Vec<(&str, &[u8])> = parts
        .headers
        .iter()
        .map(|(k, v)| (k.as_str(), v.as_bytes()))
        .collect();
    RequestHead {
        method: parts.method.as_str().to_ascii_uppercase(),
        host: host.to_ascii_lowercase(),
        path: parts.uri.path().to_owned(),
        query: parts.uri.query().map(str::to_owned),
        content_type: text(header::CONTENT_TYPE),
        content_encoding: text(header::CONTENT_ENCODING),
        secrets: swap::carried(snap, hs.into_iter(), parts.uri.query()),
    }
}

/// The answer to a refused request: `refusal.status`, its message as plain text (git prints
/// it as `remote: ...`).
pub fn refused(r: &Refusal, host: &str) -> Response<ProxyBody> {
    tracing::debug!(host, status = r.status, "git proxy answers a refusal");
    let mut resp = Response::new(full(format!("{}\n", r.message)));
    *resp.status_mut() = StatusCode::from_u16(r.status).unwrap_or(StatusCode::FORBIDDEN);
    resp.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("text/plain; charset=utf-8"),
    );
    resp
}

/// Reads a `git-receive-pack` body until the screener decides. Allowed: the body to forward
/// (the held preamble, then the rest streamed unread). Refused: the report-status answer
/// (HTTP 200, as git expects), and nothing is forwarded.
pub async fn screen_push(
    icpt: Arc<Interceptor>,
    mut body: ProxyBody,
    mut screener: Box<Screener>,
    repo: String,
) -> Result<ProxyBody, Response<ProxyBody>> {
    let repo = repo.as_str();
    let host = repo.split('/').next().unwrap_or(repo);
    let mut held: Vec<u8> = Vec::new();
    let mut ended = false;
    let decision = loop {
        match body.frame().await {
            None => {
                ended = true;
                break screener.finish();
            }
            Some(Err(e)) => {
                tracing::debug!(repo, error = %e, "push body failed while screening");
                return Err(refused(
                    &Refusal {
                        status: 400,
                        message: "tryboxi: the push body could not be read".into(),
                    },
                    host,
                ));
            }
            Some(Ok(frame)) => match frame.into_data() {
                Ok(d) => {
                    // The screener decides within MAX_PREAMBLE bytes, so `held` stays below
                    // that plus one frame.
                    held.extend_from_slice(&d);
                    match screener.feed(&d) {
                        Screen::NeedMore => {}
                        s => break s,
                    }
                }
                // Trailers end the data.
                Err(_) => {
                    ended = true;
                    break screener.finish();
                }
            },
        }
    };
    match decision {
        Screen::Allow { commands } => {
            tracing::info!(repo, refs = commands.len(), "git push allowed");
            let rest = if ended { None } else { Some(body) };
            Ok(boxed(Prefixed {
                head: (!held.is_empty()).then(|| Bytes::from(held)),
                rest,
            }))
        }
        Screen::Refuse(rej) => {
            icpt.git_refused(
                host,
                200,
                &format!("push to {repo} refused: {}", rej.message),
            );
            if !ended {
                // git sends the whole pack before it reads the answer: take it (and drop it) so
                // the client sees the report, not a broken pipe.
                drain(body).await;
            }
            let mut resp = Response::new(full(rej.report()));
            resp.headers_mut().insert(
                header::CONTENT_TYPE,
                HeaderValue::from_static("application/x-git-receive-pack-result"),
            );
            resp.headers_mut()
                .insert(header::CACHE_CONTROL, HeaderValue::from_static("no-cache"));
            Err(resp)
        }
        // Cannot follow `finish`; refuse rather than forward unscreened bytes.
        Screen::NeedMore => Err(refused(
            &Refusal {
                status: 400,
                message: "tryboxi: the push's command list could not be read".into(),
            },
            host,
        )),
    }
}

/// What a refused push's body may still send before the answer goes out anyway.
pub const MAX_DRAIN: u64 = 4 << 30;
/// How long a refused push's body may take to arrive.
pub const DRAIN_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(120);

/// Reads and drops the rest of a body, up to [`MAX_DRAIN`] bytes and [`DRAIN_TIMEOUT`].
async fn drain(mut body: ProxyBody) {
    let mut n: u64 = 0;
    let read = async {
        while let Some(Ok(f)) = body.frame().await {
            if let Ok(d) = f.into_data() {
                n += d.len() as u64;
                if n > MAX_DRAIN {
                    break;
                }
            }
        }
    };
    let _ = tokio::time::timeout(DRAIN_TIMEOUT, read).await;
}

/// Reads a GraphQL body (at most [`MAX_GRAPHQL_BODY`] bytes) and checks it: the body to
/// forward, or the refusal.
pub async fn check_graphql_body(
    icpt: Arc<Interceptor>,
    body: ProxyBody,
    host: String,
) -> Result<ProxyBody, Response<ProxyBody>> {
    let host = host.as_str();
    let mut body = body;
    let mut bytes: Vec<u8> = Vec::new();
    while let Some(frame) = body.frame().await {
        let too_large = || {
            refused(
                &Refusal {
                    status: 413,
                    message: format!(
                        "tryboxi: a GraphQL request with the git token is limited to {MAX_GRAPHQL_BODY} bytes"
                    ),
                },
                host,
            )
        };
        match frame {
            Err(e) => {
                tracing::debug!(host, error = %e, "GraphQL body failed");
                return Err(refused(
                    &Refusal {
                        status: 400,
                        message: "tryboxi: the GraphQL request body could not be read".into(),
                    },
                    host,
                ));
            }
            Ok(f) => {
                if let Ok(d) = f.into_data() {
                    if bytes.len() + d.len() > MAX_GRAPHQL_BODY {
                        return Err(too_large());
                    }
                    bytes.extend_from_slice(&d);
                }
            }
        }
    }
    check_graphql(&bytes).map_err(|r| {
        icpt.git_refused(host, r.status, &r.message);
        refused(&r, host)
    })?;
    Ok(full(bytes))
}

/// Held bytes, then the rest of a body.
struct Prefixed {
    head: Option<Bytes>,
    rest: Option<ProxyBody>,
}

impl Body for Prefixed {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        let this = self.get_mut();
        if let Some(h) = this.head.take() {
            return Poll::Ready(Some(Ok(Frame::data(h))));
        }
        match &mut this.rest {
            Some(r) => Pin::new(r).poll_frame(cx),
            None => Poll::Ready(None),
        }
    }

    fn is_end_stream(&self) -> bool {
        self.head.is_none() && self.rest.as_ref().is_none_or(|r| r.is_end_stream())
    }

    fn size_hint(&self) -> SizeHint {
        let head = self.head.as_ref().map_or(0, |h| h.len() as u64);
        match &self.rest {
            None => SizeHint::with_exact(head),
            Some(r) => {
                let h = r.size_hint();
                let mut out = SizeHint::new();
                out.set_lower(h.lower() + head);
                if let Some(u) = h.upper() {
                    out.set_upper(u + head);
                }
                out
            }
        }
    }
}

/// What the response to a request injected for `repo` is scrubbed of: the token and its
/// rendered forms (the `x-access-token:<token>` Basic pair included), each replaced by the
/// same form of the token secret's placeholder.
pub fn token_forms(snap: &Snapshot, repo: &str) -> Vec<(Vec<u8>, Vec<u8>)> {
    let Some(b) = snap
        .git
        .iter()
        .find(|g| g.repo == repo)
        .and_then(|g| snap.bindings.iter().find(|b| b.name == g.token_secret))
    else {
        return Vec::new();
    };
    let basic = (
        [b"x-access-token:".as_slice(), b.value.bytes()].concat(),
        [b"x-access-token:".as_slice(), b.placeholder.as_bytes()].concat(),
    );
    super::scrub::rendered_forms(b.value.bytes(), b.placeholder.as_bytes(), &[basic])
}
