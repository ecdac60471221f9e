//! The forge API side door: a git grant's token must not write refs through the forge's REST
//! or GraphQL API (that would skip the push patterns). GitHub's API only: `api.<host>` (REST at
//! `/`, GraphQL at `/graphql`) and GitHub Enterprise's `<host>/api/v3/` and `<host>/api/graphql`.
//!
//! - [`rest_ref_write`]: a REST request that writes refs, repository settings that guard them,
//!   or commits onto a branch (`git/refs`, `contents`, `merges`, `merge-upstream`,
//!   `pulls/N/merge`, `pulls/N/update-branch`, `branches/...`, `releases`, `rulesets`,
//!   `tags/protection`, `transfer`, and `PATCH`/`DELETE` of the repository itself). Objects
//!   (`git/blobs`, `git/trees`, `git/commits`, `git/tags`), issues, comments, reviews and
//!   opening a pull request stay allowed.
//! - [`check_graphql`]: a GraphQL request body whose document holds a mutation and, anywhere
//!   outside strings and comments, the name of a ref-writing mutation (any case, so aliases and
//!   fragments cannot hide it; conservative: an unrelated mutation that merely selects a field
//!   of that name is refused too). Every `query` of the body is checked (batches, duplicate
//!   keys); a body that cannot be read is refused.
//!
//! Not covered (documented gap): GitLab's and other forges' APIs, and indirect writes such as
//! dispatching a workflow that pushes with its own token.

use serde::de::{self, Deserializer, IgnoredAny, MapAccess, SeqAccess, Visitor};

use super::Refusal;

/// GraphQL mutations that create, move or delete refs, merge, or weaken branch protection.
pub const REF_MUTATIONS: &[&str] = &[
    "createRef",
    "updateRef",
    "updateRefs",
    "deleteRef",
    "createCommitOnBranch",
    "mergeBranch",
    "mergePullRequest",
    "enablePullRequestAutoMerge",
    "enqueuePullRequest",
    "updatePullRequestBranch",
    "revertPullRequest",
    "createLinkedBranch",
    "createBranchProtectionRule",
    "updateBranchProtectionRule",
    "deleteBranchProtectionRule",
    "createRepositoryRuleset",
    "updateRepositoryRuleset",
    "deleteRepositoryRuleset",
];

/// A GraphQL body larger than this is refused unread.
pub const MAX_GRAPHQL_BODY: usize = 1 << 20;

/// Where a forge host's API lives.
pub enum ApiPath<'a> {
    /// A REST path (`/repos/...`), prefix removed.
    Rest(&'a str),
    GraphQl,
}

/// The API request `host`+`path` stands for, if `host` is the API of the git host `git_host`.
pub fn api_path<'a>(git_host: &str, host: &str, path: &'a str) -> Option<ApiPath<'a>> {
    let (rest_prefix, graphql) = if host.strip_prefix("api.") == Some(git_host) {
        ("", "/graphql")
    } else if host == git_host {
        ("/api/v3", "/api/graphql")
    } else {
        return None;
    };
    let trimmed = path.trim_end_matches('/');
    if trimmed.eq_ignore_ascii_case(graphql) {
        return Some(ApiPath::GraphQl);
    }
    let rest = path.get(rest_prefix.len()..)?;
    (path[..rest_prefix.len()].eq_ignore_ascii_case(rest_prefix) && rest.starts_with('/'))
        .then_some(ApiPath::Rest(rest))
}

fn refused(message: String) -> Refusal {
    Refusal {
        status: 403,
        message: format!("tryboxi: {message}; push with git to an allowed branch instead"),
    }
}

/// Refuses a REST request (path without the API prefix) that writes refs (module docs).
pub fn rest_ref_write(method: &str, path: &str) -> Result<(), Refusal> {
    if !["POST", "PUT", "PATCH", "DELETE"]
        .iter()
        .any(|m| m.eq_ignore_ascii_case(method))
    {
        return Ok(());
    }
    let lower = path.to_ascii_lowercase();
    let segs: Vec<&str> = lower.trim_start_matches('/').split('/').collect();
    if segs.first() != Some(&"repos") {
        return Ok(());
    }
    // Encoded or dot segments could mean another path upstream: refuse writes with them.
    if lower.contains('%')
        || lower.contains('\\')
        || segs
            .iter()
            .enumerate()
            .any(|(i, s)| (s.is_empty() && i + 1 != segs.len()) || *s == "." || *s == "..")
    {
        return Err(refused(format!(
            "{method} {path}: an unusual API path with the git token"
        )));
    }
    let tail: Vec<&str> = segs.get(3..).unwrap_or_default().to_vec();
    let tail: Vec<&str> = match tail.last() {
        Some(&"") => tail[..tail.len() - 1].to_vec(),
        _ => tail,
    };
    let m = method.to_ascii_uppercase();
    let write = match tail.as_slice() {
        [] => m == "PATCH" || m == "DELETE",
        ["git", "refs", ..] | ["contents", ..] | ["branches", ..] | ["releases", ..] => true,
        ["rulesets", ..] | ["tags", "protection", ..] => true,
        ["merges"] | ["merge-upstream"] | ["transfer"] => true,
        ["pulls", _, "merge"] | ["pulls", _, "update-branch"] => true,
        _ => false,
    };
    if write {
        return Err(refused(format!(
            "{m} /repos/{}/{}/{} writes refs with the git token",
            segs.get(1).unwrap_or(&""),
            segs.get(2).unwrap_or(&""),
            tail.join("/")
        )));
    }
    Ok(())
}

/// The `query` strings of a GraphQL POST body (one object or a batch; every duplicate key).
struct Queries(Vec<String>);

impl<'de> serde::Deserialize<'de> for Queries {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Queries, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = Queries;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("a GraphQL request object or a batch of them")
            }
            fn visit_map<A: MapAccess<'de>>(self, mut m: A) -> Result<Queries, A::Error> {
                let mut out = Vec::new();
                while let Some(k) = m.next_key::<String>()? {
                    if k == "query" {
                        out.push(m.next_value::<String>()?);
                    } else {
                        m.next_value::<IgnoredAny>()?;
                    }
                }
                if out.is_empty() {
                    return Err(de::Error::custom("a GraphQL request without a query"));
                }
                Ok(Queries(out))
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut s: A) -> Result<Queries, A::Error> {
                let mut out = Vec::new();
                while let Some(Queries(q)) = s.next_element::<Queries>()? {
                    out.extend(q);
                }
                Ok(Queries(out))
            }
        }
        d.deserialize_any(V)
    }
}

/// Refuses a GraphQL request body that runs a ref-writing mutation (module docs).
pub fn check_graphql(body: &[u8]) -> Result<(), Refusal> {
    if body.len() > MAX_GRAPHQL_BODY {
        return Err(refused("a GraphQL request too large to check".into()));
    }
    let Queries(docs) = serde_json::from_slice::<Queries>(body)
        .map_err(|_| refused("a GraphQL request that could not be read".into()))?;
    docs.iter().try_for_each(|d| check_document(d))
}

/// Refuses one GraphQL document that holds a mutation and a ref-writing mutation's name.
pub fn check_document(doc: &str) -> Result<(), Refusal> {
    let names =
        names(doc).ok_or_else(|| refused("a GraphQL document that could not be read".into()))?;
    if !names.iter().any(|n| n.eq_ignore_ascii_case("mutation")) {
        return Ok(());
    }
    if let Some(m) = names
        .iter()
        .find_map(|n| REF_MUTATIONS.iter().find(|m| m.eq_ignore_ascii_case(n)))
    {
        return Err(refused(format!(
            "the GraphQL mutation {m} writes refs with the git token"
        )));
    }
    Ok(())
}

/// The name tokens of a GraphQL document outside strings and comments; `None` if a string is
/// not closed.
fn names(doc: &str) -> Option<Vec<&str>> {
    let b = doc.as_bytes();
    let mut out = Vec::new();
    let mut i = 0;
    while i < b.len() {
        match b[i] {
            b'#' => {
                while i < b.len() && b[i] != b'\n' && b[i] != b'\r' {
                    i += 1;
                }
            }
            b'"' if b[i..].starts_with(b"\"\"\"") => {
                i += 3;
                loop {
                    if i >= b.len() {
                        return None;
                    }
                    if b[i..].starts_with(b"\\\"\"\"") {
                        i += 4;
                    } else if b[i..].starts_with(b"\"\"\"") {
                        i += 3;
                        break;
                    } else {
                        i += 1;
                    }
                }
            }
            b'"' => {
                i += 1;
                loop {
                    match b.get(i) {
                        None | Some(b'\n') | Some(b'\r') => return None,
                        Some(b'\\') => i += 2,
                        Some(b'"') => {
                            i += 1;
                            break;
                        }
                        Some(_) => i += 1,
                    }
                }
            }
            c if c == b'_' || c.is_ascii_alphabetic() => {
                let start = i;
                while i < b.len() && (b[i] == b'_' || b[i].is_ascii_alphanumeric()) {
                    i += 1;
                }
                out.push(&doc[start..i]);
            }
            _ => i += 1,
        }
    }
    Some(out)
}
