//! The git proxy's decisions (`tryboxi git allow ID HOST/OWNER/REPO [--push PAT] --token-secret
//! NAME`): pure functions the egress interceptor calls per intercepted HTTP request. No I/O.
//!
//! # Interface (for the interceptor)
//! - [`classify`]`(snapshot, &RequestHead) -> Verdict`, once per request, before forwarding:
//!   - [`Verdict::NotGit`]: nothing for the git proxy; swap/scrub/block as usual.
//!   - [`Verdict::Inject`]: a smart-HTTP request to a granted repository. Set `Authorization`
//!     to `authorization` (replacing any the client sent; `Basic x-access-token:<token>`, on
//!     every request, as git first asks without credentials). If `push` is `Some`, it is a
//!     `git-receive-pack` POST: feed the body to the [`Screener`] as it streams, holding the
//!     bytes back, until it answers [`Screen::Allow`] (forward the held bytes, then stream the
//!     rest unscreened) or [`Screen::Refuse`] (forward nothing; answer HTTP 200,
//!     `Content-Type: application/x-git-receive-pack-result`, body [`pktline::Rejection::report`]); at
//!     the body's end call [`Screener::finish`]. At most [`pktline::MAX_PREAMBLE`] bytes are
//!     held.
//!   - [`Verdict::CheckGraphql`]: a GraphQL request to the forge's API carrying a grant's token:
//!     read the body (refuse it past [`forge::MAX_GRAPHQL_BODY`]) and pass it to
//!     [`check_graphql`] before forwarding.
//!   - [`Verdict::Refuse`]: answer `refusal.status` with `Content-Type: text/plain` and
//!     `refusal.message` + `\n` as the body (git prints it as `remote: ...`); emit an event.
//! - [`RequestHead::secrets`] is the interceptor's input about credentials: the names of the
//!   secrets whose placeholders the request carries in authorization positions.
//! - An injected request carried the token: its response is scrubbed like any other (a
//!   pack would break only if it held the token uncompressed, which is the safe failure).
//!
//! # Rules
//! - Only the granted repositories get the token; on a grant's host the token's placeholder is
//!   honoured for nothing but [`Verdict::Inject`] (a request carrying it elsewhere on that host
//!   is refused, so it cannot be sent by hand to another repository).
//! - Pushes: all-or-nothing against the grant's patterns ([`refs`]); none without patterns;
//!   compressed or non-pkt-line receive-pack bodies are refused.
//! - The forge API with the token: ref writes refused ([`forge`]).
//!
//! Module layout: [`repo`] (path normalisation), [`refs`] (patterns), [`pktline`] (screener,
//! report), [`forge`] (REST/GraphQL side door), [`fuzzing`] (the fuzz target's check).

pub mod forge;
#[cfg(any(test, fuzzing))]
pub mod fuzzing;
pub mod pktline;
pub mod refs;
pub mod repo;

#[cfg(test)]
pub(crate) mod http_backend_tests;
#[cfg(test)]
mod pktline_tests;
#[cfg(test)]
mod tests;

use base64::Engine as _;
use zeroize::Zeroizing;

use super::{GitGrant, Snapshot, Value};
// The interceptor's interface (`network::intercept::git`).
pub use forge::check_graphql;
pub use pktline::{Screen, Screener};
use repo::{Endpoint, Service};

/// What the git proxy needs of a request's head.
#[derive(Debug, Clone, Default)]
pub struct RequestHead {
    /// Upper case (`GET`, `POST`).
    pub method: String,
    /// Lowercase, no port, no trailing dot.
    pub host: String,
    /// The path as sent (still percent-encoded), without the query.
    pub path: String,
    pub query: Option<String>,
    pub content_type: Option<String>,
    pub content_encoding: Option<String>,
    /// Names of the secrets whose placeholders this request carries in authorization
    /// positions (headers or query), as the interceptor's swap found them.
    pub secrets: Vec<String>,
}

/// A refused request: the HTTP status and a one-line message for git or the client (names
/// repositories and refs, never a value).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{message}")]
pub struct Refusal {
    pub status: u16,
    pub message: String,
}

/// What the interceptor does with a request (see the module docs).
#[derive(Debug)]
pub enum Verdict {
    NotGit,
    Inject {
        /// The whole `Authorization` header value.
        authorization: Value,
        /// The screener for a `git-receive-pack` POST body.
        push: Option<Box<Screener>>,
        /// The granted repository (`host/owner/repo`).
        repo: String,
    },
    CheckGraphql,
    Refuse(Refusal),
}

fn refuse(status: u16, message: String) -> Verdict {
    tracing::info!(status, reason = %message, "git proxy refused a request");
    Verdict::Refuse(Refusal { status, message })
}

/// The grant's token as an `Authorization` value: `Basic base64(x-access-token:<token>)`.
pub fn authorization(token: &Value) -> Value {
    let mut plain = Zeroizing::new(b"x-access-token:".to_vec());
    plain.extend_from_slice(token.bytes());
    let mut out = Zeroizing::new(vec![0u8; 6 + plain.len().div_ceil(3) * 4]);
    out[..6].copy_from_slice(b"Basic ");
    let n = base64::engine::general_purpose::STANDARD
        .encode_slice(&plain[..], &mut out[6..])
        .unwrap_or(0);
    out.truncate(6 + n);
    Value(out)
}

/// The grant-token secrets `req` carries (by name, or another name for the same value).
fn carries_token(snap: &Snapshot, req: &RequestHead, grants: &[&GitGrant]) -> bool {
    let tokens: Vec<&Value> = grants
        .iter()
        .filter_map(|g| snap.bindings.iter().find(|b| b.name == g.token_secret))
        .map(|b| &b.value)
        .collect();
    req.secrets.iter().any(|name| {
        grants.iter().any(|g| &g.token_secret == name)
            || snap
                .bindings
                .iter()
                .filter(|b| &b.name == name)
                .any(|b| tokens.iter().any(|t| t.ct_eq(b.value.bytes())))
    })
}

fn grant_host(g: &GitGrant) -> &str {
    g.repo.split('/').next().unwrap_or("")
}

/// Decides what the interceptor does with one request (see the module docs).
pub fn classify(snap: &Snapshot, req: &RequestHead) -> Verdict {
    let host = req.host.trim_end_matches('.').to_ascii_lowercase();
    let on_host: Vec<&GitGrant> = snap.git.iter().filter(|g| grant_host(g) == host).collect();
    if !on_host.is_empty() {
        match repo::parse(&req.path, req.query.as_deref()) {
            Err(r) => return refuse(r.status, r.message),
            Ok(Some(p)) => {
                let full = format!("{host}/{}", p.repo);
                if let Some(g) = on_host.iter().find(|g| g.repo == full)
                    && p.service.is_some()
                {
                    return git_request(snap, req, g, p.endpoint, p.service);
                }
            }
            Ok(None) => {}
        }
    }
    // The forge API (api.<host>, or <host>/api/...) of every grant host.
    for gh in snap.git.iter().map(grant_host) {
        let Some(api) = forge::api_path(gh, &host, &req.path) else {
            continue;
        };
        let grants: Vec<&GitGrant> = snap.git.iter().filter(|g| grant_host(g) == gh).collect();
        if !carries_token(snap, req, &grants) {
            break;
        }
        return match api {
            forge::ApiPath::Rest(path) => match forge::rest_ref_write(&req.method, path) {
                Ok(()) => Verdict::NotGit,
                Err(r) => refuse(r.status, r.message),
            },
            forge::ApiPath::GraphQl if req.method == "POST" => {
                if req
                    .content_encoding
                    .as_deref()
                    .is_some_and(|e| !e.eq_ignore_ascii_case("identity"))
                {
                    return refuse(415, "tryboxi: compressed GraphQL request refused".into());
                }
                Verdict::CheckGraphql
            }
            forge::ApiPath::GraphQl => {
                let docs = form_urlencoded::parse(req.query.as_deref().unwrap_or("").as_bytes())
                    .filter(|(k, _)| k == "query")
                    .map(|(_, v)| forge::check_document(&v))
                    .collect::<Result<Vec<()>, _>>();
                match docs {
                    Ok(_) => Verdict::NotGit,
                    Err(r) => refuse(r.status, r.message),
                }
            }
        };
    }
    if !on_host.is_empty() && carries_token(snap, req, &on_host) {
        return refuse(
            403,
            format!(
                "tryboxi: the git token is only sent to the granted repositories ({})",
                on_host
                    .iter()
                    .map(|g| g.repo.as_str())
                    .collect::<Vec<_>>()
                    .join(", ")
            ),
        );
    }
    Verdict::NotGit
}

/// A smart-HTTP request to the granted repository `g`.
fn git_request(
    snap: &Snapshot,
    req: &RequestHead,
    g: &GitGrant,
    endpoint: Endpoint,
    service: Option<Service>,
) -> Verdict {
    let method_ok = match endpoint {
        Endpoint::InfoRefs => req.method == "GET" || req.method == "HEAD",
        Endpoint::Rpc => req.method == "POST",
    };
    if !method_ok {
        return refuse(
            405,
            format!("tryboxi: {} is not a git request method", req.method),
        );
    }
    let Some(token) = snap.bindings.iter().find(|b| b.name == g.token_secret) else {
        return refuse(
            403,
            format!(
                "tryboxi: the token secret {} of {} is not given to this sandbox",
                g.token_secret, g.repo
            ),
        );
    };
    let push = service == Some(Service::ReceivePack);
    if push && g.push.is_empty() {
        return refuse(
            403,
            format!(
                "tryboxi: pushes to {} are not allowed (no --push patterns)",
                g.repo
            ),
        );
    }
    let screener = if push && endpoint == Endpoint::Rpc {
        if req
            .content_encoding
            .as_deref()
            .is_some_and(|e| !e.eq_ignore_ascii_case("identity"))
        {
            return refuse(
                415,
                "tryboxi: a compressed push body cannot be checked; refused".into(),
            );
        }
        if req
            .content_type
            .as_deref()
            .map(|c| c.trim().to_ascii_lowercase())
            != Some("application/x-git-receive-pack-request".into())
        {
            return refuse(415, "tryboxi: a push body that is not a git request".into());
        }
        Some(Box::new(Screener::new(g.push.clone())))
    } else {
        None
    };
    tracing::debug!(repo = %g.repo, push, "git proxy injects the token");
    Verdict::Inject {
        authorization: authorization(&token.value),
        push: screener,
        repo: g.repo.clone(),
    }
}
