//! Git smart-HTTP paths: which repository and service a request path names.
//!
//! Recognised (case-insensitively, as forges route them): `/<repo>/info/refs?service=...`,
//! `/<repo>/git-upload-pack` and `/<repo>/git-receive-pack`, where `<repo>` is two or more
//! segments (`owner/repo`, or GitLab-style groups) with an optional `.git` on the last one.
//! The repository comes back lowercase without `.git`, as [`crate::secrets::GitGrant::repo`]
//! stores it (after the host).
//!
//! A path that looks like a git endpoint once percent-decoded but is not plainly one (`%`
//! escapes, `.`/`..` or empty segments, backslashes, `;`, control characters, a trailing `/`)
//! is refused rather than guessed at: the upstream might resolve it to another repository.

use super::Refusal;

/// The two smart-HTTP services.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Service {
    UploadPack,
    ReceivePack,
}

/// Which request of the protocol.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Endpoint {
    /// `GET .../info/refs?service=git-...` (ref advertisement).
    InfoRefs,
    /// `POST .../git-upload-pack` or `.../git-receive-pack`.
    Rpc,
}

/// A smart-HTTP request to a repository.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GitPath {
    /// Lowercase `owner/repo`, no `.git`.
    pub repo: String,
    pub endpoint: Endpoint,
    /// `None`: `info/refs` without a smart `service` (dumb HTTP or an unknown service).
    pub service: Option<Service>,
}

fn bad(path: &str) -> Refusal {
    Refusal {
        status: 400,
        message: format!(
            "tryboxi: unusual git path {:?} refused",
            path.chars().take(200).collect::<String>()
        ),
    }
}

/// Parses a request's path and query: `Ok(None)` for a path that is no git endpoint.
pub fn parse(path: &str, query: Option<&str>) -> Result<Option<GitPath>, Refusal> {
    let lower = path.to_ascii_lowercase();
    let decoded = percent_encoding::percent_decode_str(&lower).decode_utf8_lossy();
    let gitish = ["info/refs", "git-upload-pack", "git-receive-pack"]
        .iter()
        .any(|s| decoded.contains(s));
    if !gitish {
        return Ok(None);
    }
    let tricky = lower
        .bytes()
        .any(|b| b < 0x20 || b == 0x7f || b == b'%' || b == b'\\' || b == b';');
    let Some(body) = lower.strip_prefix('/') else {
        return Err(bad(path));
    };
    let segs: Vec<&str> = body.split('/').collect();
    if tricky || segs.iter().any(|s| s.is_empty() || *s == "." || *s == "..") {
        return Err(bad(path));
    }
    let (repo_segs, endpoint, service) = match segs.as_slice() {
        [r @ .., "info", "refs"] => (r, Endpoint::InfoRefs, service(query)?),
        [r @ .., "git-upload-pack"] => (r, Endpoint::Rpc, Some(Service::UploadPack)),
        [r @ .., "git-receive-pack"] => (r, Endpoint::Rpc, Some(Service::ReceivePack)),
        // The endpoint names appear elsewhere in the path (a file called `info/refs` in a
        // web view, say): not a git request.
        _ => return Ok(None),
    };
    let mut parts: Vec<&str> = repo_segs.to_vec();
    if let Some(last) = parts.last_mut() {
        *last = last.strip_suffix(".git").unwrap_or(last);
    }
    if parts.len() < 2 || parts.iter().any(|s| s.is_empty()) {
        return Err(bad(path));
    }
    Ok(Some(GitPath {
        repo: parts.join("/"),
        endpoint,
        service,
    }))
}

/// Normalises a grant's repository as the user writes it (`HOST/OWNER/REPO`, any case, an
/// optional `https://`, `.git` and trailing `/`) to [`crate::secrets::GitGrant::repo`]'s form:
/// lowercase `host/owner/repo`, exactly the name [`parse`] gives requests to it.
pub fn normalize_grant(input: &str) -> Result<String, String> {
    let shown: String = input.chars().take(120).collect();
    let bad = |why: &str| format!("`{shown}` is not HOST/OWNER/REPO: {why}");
    let s = input.trim();
    let s = s
        .strip_prefix("https://")
        .or_else(|| s.strip_prefix("HTTPS://"))
        .unwrap_or(s);
    let s = s.strip_suffix('/').unwrap_or(s);
    let Some((host, path)) = s.split_once('/') else {
        return Err(bad("no repository path"));
    };
    let host = host.to_ascii_lowercase();
    if !crate::secrets::store::is_dns_name(&host) {
        return Err(bad(
            "the host is not a DNS name (no port, user or IP address)",
        ));
    }
    match parse(
        &format!("/{path}/info/refs"),
        Some("service=git-upload-pack"),
    ) {
        Ok(Some(p)) => Ok(format!("{host}/{}", p.repo)),
        Ok(None) | Err(_) => Err(bad(
            "give OWNER/REPO without `%`, `.`/`..` or empty segments",
        )),
    }
}

/// The `service` of an `info/refs` query: exactly one, or none.
fn service(query: Option<&str>) -> Result<Option<Service>, Refusal> {
    let values: Vec<String> = form_urlencoded::parse(query.unwrap_or("").as_bytes())
        .filter(|(k, _)| k.eq_ignore_ascii_case("service"))
        .map(|(_, v)| v.into_owned())
        .collect();
    match values.as_slice() {
        [] => Ok(None),
        [v] if v == "git-upload-pack" => Ok(Some(Service::UploadPack)),
        [v] if v == "git-receive-pack" => Ok(Some(Service::ReceivePack)),
        [_] => Ok(None),
        _ => Err(Refusal {
            status: 400,
            message: "tryboxi: more than one git service in the query refused".into(),
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ok(path: &str, query: Option<&str>) -> GitPath {
        parse(path, query).unwrap().unwrap()
    }

    #[test]
    fn the_three_endpoints_and_their_repository() {
        let g = ok("/Owner/Repo.git/info/refs", Some("service=git-upload-pack"));
        assert_eq!(
            g,
            GitPath {
                repo: "owner/repo".into(),
                endpoint: Endpoint::InfoRefs,
                service: Some(Service::UploadPack)
            }
        );
        let g = ok("/o/r/info/refs", Some("service=git-receive-pack"));
        assert_eq!(g.service, Some(Service::ReceivePack));
        let g = ok("/o/r.GIT/git-receive-pack", None);
        assert_eq!((g.repo.as_str(), g.endpoint), ("o/r", Endpoint::Rpc));
        assert_eq!(g.service, Some(Service::ReceivePack));
        let g = ok("/o/r/git-upload-pack", Some("ignored=1"));
        assert_eq!(g.service, Some(Service::UploadPack));
        // Nested groups.
        assert_eq!(ok("/g/sub/r.git/git-upload-pack", None).repo, "g/sub/r");
        // Endpoints match in any case, as forges route them.
        assert_eq!(ok("/o/r/INFO/Refs", None).endpoint, Endpoint::InfoRefs);
        assert_eq!(
            ok("/o/r/Git-Receive-Pack", None).service,
            Some(Service::ReceivePack)
        );
        // Only one `.git` comes off.
        assert_eq!(ok("/o/r.git.git/git-upload-pack", None).repo, "o/r.git");
    }

    #[test]
    fn info_refs_without_a_smart_service_names_none() {
        assert_eq!(ok("/o/r/info/refs", None).service, None);
        assert_eq!(ok("/o/r/info/refs", Some("service=git-foo")).service, None);
        assert!(
            parse(
                "/o/r/info/refs",
                Some("service=git-upload-pack&service=git-receive-pack")
            )
            .is_err()
        );
        assert!(
            parse(
                "/o/r/info/refs",
                Some("service=git-receive-pack&SERVICE=git-receive-pack")
            )
            .is_err()
        );
        // Percent-encoded query values are decoded.
        assert_eq!(
            ok("/o/r/info/refs", Some("service=git%2Dreceive%2Dpack")).service,
            Some(Service::ReceivePack)
        );
    }

    #[test]
    fn other_paths_are_not_git() {
        for p in [
            "/",
            "/o/r",
            "/o/r/pulls",
            "/o/r/blob/main/info/refs.md",
            "/info",
        ] {
            assert_eq!(parse(p, None), Ok(None), "{p}");
        }
        // The endpoint name inside a longer path is not an endpoint.
        assert_eq!(parse("/o/r/blob/main/git-upload-pack/x", None), Ok(None));
    }

    #[test]
    fn path_tricks_are_refused() {
        for p in [
            "/o/granted/../other/info/refs",
            "/o/granted/%2e%2e/other/git-receive-pack",
            "/o/r/%2E%2E/x/git-receive-pack",
            "/o/r/info%2frefs",
            "/o/r%2Egit/git-receive-pack",
            "/o//r/git-receive-pack",
            "//o/r/git-receive-pack",
            "/o/r/./git-receive-pack",
            "/o/r/git-receive-pack/",
            "/o/r\\x/git-receive-pack",
            "/o/r;x=1/git-receive-pack",
            "/o/r\t/git-receive-pack",
            "o/r/git-receive-pack",
            "/r/git-receive-pack",
            "/o/.git/git-receive-pack",
            "/git-receive-pack",
        ] {
            let r = parse(p, None);
            assert!(r.is_err(), "{p}: {r:?}");
        }
    }

    #[test]
    fn grants_normalise_to_the_name_requests_get() {
        for (input, want) in [
            ("github.com/Owner/Repo", "github.com/owner/repo"),
            ("https://GitHub.com/o/r.git/", "github.com/o/r"),
            ("gitlab.example/group/sub/r", "gitlab.example/group/sub/r"),
        ] {
            assert_eq!(normalize_grant(input).unwrap(), want, "{input}");
        }
        for bad in [
            "github.com",
            "github.com/o",
            "github.com:22/o/r",
            "1.2.3.4/o/r",
            "github.com/o/../r",
            "github.com/o/%72",
            "github.com//r",
            "user@github.com/o/r",
        ] {
            assert!(normalize_grant(bad).is_err(), "{bad}");
        }
    }
}
