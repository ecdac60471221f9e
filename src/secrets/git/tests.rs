//! `classify` (injection, refusals, the forge API side door) and `check_graphql`.

use super::*;
use crate::secrets::{Binding, GitGrant, Snapshot, Value};

const TOKEN: &[u8] = b"ghp_realtoken1234567890";

fn binding(name: &str, hosts: &[&str], value: &[u8]) -> Binding {
    Binding {
        name: name.into(),
        hosts: hosts.iter().map(|h| h.to_string()).collect(),
        headers: vec![],
        in_body: false,
        placeholder: format!("tbx_{}", name.to_ascii_lowercase()),
        value: Value::new(value.to_vec()),
    }
}

fn grant(repo: &str, push: &[&str], token: &str) -> GitGrant {
    GitGrant {
        repo: repo.into(),
        push: push.iter().map(|s| s.to_string()).collect(),
        token_secret: token.into(),
    }
}

fn snap() -> Snapshot {
    Snapshot {
        bindings: vec![
            binding("GH", &["github.com", "api.github.com"], TOKEN),
            binding("SAME", &["api.github.com"], TOKEN),
            binding("OTHER", &["api.github.com"], b"ghp_another_token_entirely"),
            binding("GHE", &["ghe.example.com"], b"ghe_token_value_123"),
        ],
        git: vec![
            grant("github.com/o/r", &["agent/*"], "GH"),
            grant("github.com/o/readonly", &[], "GH"),
            grant("github.com/o/lost", &["agent/*"], "MISSING"),
            grant("ghe.example.com/team/app", &["agent/*"], "GHE"),
        ],
    }
}

fn req(method: &str, host: &str, target: &str, secrets: &[&str]) -> RequestHead {
    let (path, query) = match target.split_once('?') {
        Some((p, q)) => (p.to_owned(), Some(q.to_owned())),
        None => (target.to_owned(), None),
    };
    RequestHead {
        method: method.into(),
        host: host.into(),
        path,
        query,
        content_type: (method == "POST" && target.contains("receive-pack"))
            .then(|| "application/x-git-receive-pack-request".into()),
        content_encoding: None,
        secrets: secrets.iter().map(|s| s.to_string()).collect(),
    }
}

fn status(v: &Verdict) -> Option<u16> {
    match v {
        Verdict::Refuse(r) => Some(r.status),
        _ => None,
    }
}

#[test]
fn the_token_is_basic_x_access_token() {
    let a = authorization(&Value::new(TOKEN.to_vec()));
    // base64("x-access-token:ghp_realtoken1234567890")
    assert_eq!(
        a.bytes(),
        b"Basic eC1hY2Nlc3MtdG9rZW46Z2hwX3JlYWx0b2tlbjEyMzQ1Njc4OTA="
    );
    for len in 0..8 {
        let a = authorization(&Value::new(vec![b'k'; len]));
        let b64 = std::str::from_utf8(&a.bytes()[6..]).unwrap();
        use base64::Engine as _;
        let plain = base64::engine::general_purpose::STANDARD
            .decode(b64)
            .unwrap();
        assert_eq!(
            plain,
            [b"x-access-token:".as_slice(), &vec![b'k'; len]].concat()
        );
    }
}

#[test]
fn a_granted_repository_gets_the_token_on_every_smart_request() {
    let s = snap();
    for (m, t, push) in [
        ("GET", "/o/r.git/info/refs?service=git-upload-pack", false),
        ("GET", "/O/R/info/refs?service=git-upload-pack", false),
        ("POST", "/o/r/git-upload-pack", false),
        ("GET", "/o/r.git/info/refs?service=git-receive-pack", false),
        ("POST", "/o/R.git/git-receive-pack", true),
    ] {
        match classify(&s, &req(m, "GitHub.com", t, &[])) {
            Verdict::Inject {
                authorization,
                push: p,
                repo,
            } => {
                assert!(authorization.ct_eq(authorization_for(TOKEN).bytes()), "{t}");
                assert_eq!(p.is_some(), push, "{t}");
                assert_eq!(repo, "github.com/o/r");
            }
            v => panic!("{m} {t}: {v:?}"),
        }
    }
    // The verdict never prints the token.
    let v = classify(&s, &req("POST", "github.com", "/o/r/git-upload-pack", &[]));
    assert!(!format!("{v:?}").contains("ghp_"), "{v:?}");
}

fn authorization_for(t: &[u8]) -> Value {
    authorization(&Value::new(t.to_vec()))
}

#[test]
fn pushes_are_refused_without_patterns_compressed_or_mistyped() {
    let s = snap();
    let v = classify(
        &s,
        &req(
            "GET",
            "github.com",
            "/o/readonly/info/refs?service=git-receive-pack",
            &[],
        ),
    );
    assert_eq!(status(&v), Some(403));
    assert!(format!("{v:?}").contains("no --push patterns"));
    assert!(matches!(
        classify(
            &s,
            &req("POST", "github.com", "/o/readonly/git-upload-pack", &[])
        ),
        Verdict::Inject { push: None, .. }
    ));
    let mut r = req("POST", "github.com", "/o/r/git-receive-pack", &[]);
    r.content_encoding = Some("gzip".into());
    assert_eq!(status(&classify(&s, &r)), Some(415));
    r.content_encoding = Some("identity".into());
    assert!(matches!(
        classify(&s, &r),
        Verdict::Inject { push: Some(_), .. }
    ));
    r.content_type = Some("application/octet-stream".into());
    assert_eq!(status(&classify(&s, &r)), Some(415));
    // Wrong methods for the endpoints.
    assert_eq!(
        status(&classify(
            &s,
            &req("GET", "github.com", "/o/r/git-receive-pack", &[])
        )),
        Some(405)
    );
    assert_eq!(
        status(&classify(
            &s,
            &req(
                "POST",
                "github.com",
                "/o/r/info/refs?service=git-upload-pack",
                &[]
            )
        )),
        Some(405)
    );
    // The grant's token secret is not among the sandbox's secrets.
    let v = classify(
        &s,
        &req("POST", "github.com", "/o/lost/git-upload-pack", &[]),
    );
    assert_eq!(status(&v), Some(403));
}

#[test]
fn other_repositories_and_hosts_get_no_token() {
    let s = snap();
    for (h, t) in [
        ("github.com", "/o/other/info/refs?service=git-upload-pack"),
        ("github.com", "/other/r/git-upload-pack"),
        ("github.com", "/o/r/info/refs"), // dumb HTTP: no token
        ("github.com", "/o/r/pulls"),
        ("gitlab.com", "/o/r/git-upload-pack"),
        ("api.github.com", "/repos/o/r/git/refs"),
    ] {
        assert!(
            matches!(classify(&s, &req("GET", h, t, &[])), Verdict::NotGit),
            "{h}{t}"
        );
    }
    // The token sent by hand to another repository (or any other path of the git host) is
    // refused: only the git proxy's injection uses it there.
    for t in [
        "/o/other/info/refs?service=git-receive-pack",
        "/o/r/info/refs",
        "/o/r/pulls",
    ] {
        for secret in ["GH", "SAME"] {
            let v = classify(&s, &req("GET", "github.com", t, &[secret]));
            assert_eq!(status(&v), Some(403), "{t} with {secret}");
        }
    }
    // Another secret to the git host is not the git proxy's business.
    assert!(matches!(
        classify(
            &s,
            &req("GET", "github.com", "/o/other/info/refs", &["OTHER"])
        ),
        Verdict::NotGit
    ));
    // Path tricks towards a git endpoint are refused before any repository is matched.
    for t in [
        "/o/r/../other/git-receive-pack",
        "/o/r/%2e%2e/other/git-receive-pack",
        "/o//r/git-receive-pack",
    ] {
        assert_eq!(
            status(&classify(&s, &req("POST", "github.com", t, &[]))),
            Some(400),
            "{t}"
        );
    }
}

#[test]
fn rest_ref_writes_with_the_token_are_refused() {
    let s = snap();
    for (m, t) in [
        ("POST", "/repos/o/r/git/refs"),
        ("PATCH", "/repos/o/r/git/refs/heads/main"),
        ("DELETE", "/repos/o/r/git/refs/heads/main"),
        ("PATCH", "/Repos/O/R/Git/Refs/heads/main"),
        ("POST", "/repos/o/r/git/refs/"),
        ("PUT", "/repos/o/r/contents/src/main.rs"),
        ("DELETE", "/repos/o/r/contents/README.md"),
        ("POST", "/repos/o/r/merges"),
        ("POST", "/repos/o/r/merge-upstream"),
        ("PUT", "/repos/o/r/pulls/7/merge"),
        ("PUT", "/repos/o/r/pulls/7/update-branch"),
        ("POST", "/repos/o/r/branches/main/rename"),
        ("DELETE", "/repos/o/r/branches/main/protection"),
        ("POST", "/repos/o/r/releases"),
        ("PATCH", "/repos/o/r"),
        ("DELETE", "/repos/o/r/"),
        ("POST", "/repos/o/r/transfer"),
        ("POST", "/repos/o/r/rulesets"),
        // Any repository: the token may reach more than the granted one.
        ("POST", "/repos/someone/else/git/refs"),
        // Unusual paths that an upstream could resolve to a ref write.
        ("POST", "/repos/o/%72/git/refs"),
        ("POST", "/repos/o/r/x/../git/refs"),
        ("POST", "/repos/o//r/git/refs"),
    ] {
        for secret in ["GH", "SAME"] {
            let v = classify(&s, &req(m, "api.github.com", t, &[secret]));
            assert_eq!(status(&v), Some(403), "{m} {t} with {secret}: {v:?}");
        }
        // Without the token (another credential or none) the API is not the proxy's business.
        for secrets in [&["OTHER"][..], &[]] {
            let v = classify(&s, &req(m, "api.github.com", t, secrets));
            assert!(matches!(v, Verdict::NotGit), "{m} {t} {secrets:?}: {v:?}");
        }
    }
    for (m, t) in [
        ("GET", "/repos/o/r/git/refs/heads/main"),
        ("GET", "/repos/o/r/contents/README.md"),
        ("POST", "/repos/o/r/pulls"),
        ("POST", "/repos/o/r/issues/3/comments"),
        ("POST", "/repos/o/r/git/blobs"),
        ("POST", "/repos/o/r/git/commits"),
        ("PATCH", "/repos/o/r/pulls/7"),
        ("GET", "/user"),
    ] {
        let v = classify(&s, &req(m, "api.github.com", t, &["GH"]));
        assert!(matches!(v, Verdict::NotGit), "{m} {t}: {v:?}");
    }
    // GitHub Enterprise: the API lives on the git host under /api/v3 and /api/graphql.
    let v = classify(
        &s,
        &req(
            "POST",
            "ghe.example.com",
            "/api/v3/repos/team/app/git/refs",
            &["GHE"],
        ),
    );
    assert_eq!(status(&v), Some(403), "{v:?}");
    let v = classify(
        &s,
        &req("POST", "ghe.example.com", "/api/graphql", &["GHE"]),
    );
    assert!(matches!(v, Verdict::CheckGraphql), "{v:?}");
}

#[test]
fn graphql_with_the_token_is_inspected() {
    let s = snap();
    let v = classify(&s, &req("POST", "api.github.com", "/graphql", &["GH"]));
    assert!(matches!(v, Verdict::CheckGraphql), "{v:?}");
    let v = classify(&s, &req("POST", "api.github.com", "/graphql", &["OTHER"]));
    assert!(matches!(v, Verdict::NotGit), "{v:?}");
    let mut r = req("POST", "api.github.com", "/graphql", &["GH"]);
    r.content_encoding = Some("br".into());
    assert_eq!(status(&classify(&s, &r)), Some(415));
    // GraphQL over GET: the query parameter is checked right here.
    let t = "/graphql?query=mutation%7BcreateRef(input%3A%7B%7D)%7Bref%7Bid%7D%7D%7D";
    assert_eq!(
        status(&classify(&s, &req("GET", "api.github.com", t, &["GH"]))),
        Some(403)
    );
    let t = "/graphql?query=%7Bviewer%7Blogin%7D%7D";
    assert!(matches!(
        classify(&s, &req("GET", "api.github.com", t, &["GH"])),
        Verdict::NotGit
    ));
}

fn gql(query: &str) -> Vec<u8> {
    serde_json::to_vec(&serde_json::json!({ "query": query, "variables": {} })).unwrap()
}

#[test]
fn graphql_ref_mutations_are_refused_however_written() {
    for q in [
        "mutation { createRef(input: {repositoryId: \"R\", name: \"refs/heads/main\", oid: \"a\"}) { ref { id } } }",
        "mutation M($i: UpdateRefInput!) { updateRef(input: $i) { clientMutationId } }",
        "mutation { x: deleteRef(input: {refId: \"1\"}) { clientMutationId } }",
        "mutation { a: addComment(input: {}) { clientMutationId } b: mergePullRequest(input: {}) { clientMutationId } }",
        "mutation { ...W } fragment W on Mutation { updateRefs(input: {}) { clientMutationId } }",
        "mutation { ... on Mutation { createCommitOnBranch(input: {}) { commit { oid } } } }",
        "mutation{mergeBranch(input:{}){clientMutationId}}",
        "mutation { CREATEREF(input: {}) { clientMutationId } }",
        "# a comment\nmutation\n{\n  # createRef\n  enablePullRequestAutoMerge(input: {}) { clientMutationId }\n}",
        "query Q { viewer { login } }\nmutation W { updateBranchProtectionRule(input: {}) { clientMutationId } }",
        // Not a valid string: cannot be read, refused.
        "mutation { addComment(input: {body: \"unterminated}) { x } }",
    ] {
        let r = check_graphql(&gql(q));
        assert!(r.is_err(), "{q}");
        assert_eq!(r.unwrap_err().status, 403);
    }
}

#[test]
fn graphql_without_ref_writes_passes() {
    for q in [
        "query { repository(owner: \"o\", name: \"r\") { ref(qualifiedName: \"main\") { target { oid } } } }",
        "{ viewer { login } }",
        // The name of a ref mutation outside a mutation (here: as a field alias in a query).
        "query { createRef: viewer { login } }",
        // Inside strings and comments.
        "mutation { addComment(input: {subjectId: \"x\", body: \"please createRef and mergeBranch\"}) { clientMutationId } }",
        "mutation { addComment(input: {subjectId: \"x\", body: \"\"\"createRef\n\\\"\"\" deleteRef\"\"\"}) { clientMutationId } }",
        "mutation { addComment(input: {subjectId: \"x\", body: \"say \\\" createRef\"}) { clientMutationId } }",
        "mutation {\n  # we do not createRef here\n  createPullRequest(input: {}) { clientMutationId }\n}",
    ] {
        assert_eq!(check_graphql(&gql(q)), Ok(()), "{q}");
    }
    // Variables are data, never run.
    let body = serde_json::to_vec(&serde_json::json!({
        "query": "mutation($b: String!) { addComment(input: {subjectId: \"x\", body: $b}) { clientMutationId } }",
        "variables": { "b": "mutation { createRef }" }
    }))
    .unwrap();
    assert_eq!(check_graphql(&body), Ok(()));
}

#[test]
fn graphql_bodies_are_read_whole_or_refused() {
    // Batches: every query is checked.
    let batch = br#"[{"query":"{ viewer { login } }"},{"query":"mutation { mergeBranch(input:{}) { clientMutationId } }"}]"#;
    assert!(check_graphql(batch).is_err());
    assert_eq!(
        check_graphql(br#"[{"query":"{ viewer { login } }"}]"#),
        Ok(())
    );
    // A duplicate key cannot hide a mutation behind a harmless query.
    let dup = br#"{"query":"{ viewer { login } }","query":"mutation { createRef(input:{}) { clientMutationId } }"}"#;
    assert!(check_graphql(dup).is_err());
    let dup = br#"{"query":"mutation { createRef(input:{}) { clientMutationId } }","query":"{ viewer { login } }"}"#;
    assert!(check_graphql(dup).is_err());
    // Escaped key and body.
    let esc = br#"{"\u0071uery":"mutation { \u0063reateRef(input:{}) { clientMutationId } }"}"#;
    assert!(check_graphql(esc).is_err());
    for bad in [
        &b"mutation { createRef }"[..],
        b"{}",
        br#"{"query": null}"#,
        br#"{"extensions":{"persistedQuery":{"sha256Hash":"abc"}}}"#,
        b"[1]",
        b"",
    ] {
        assert!(
            check_graphql(bad).is_err(),
            "{}",
            String::from_utf8_lossy(bad)
        );
    }
    let huge = gql(&format!(
        "{{ viewer {{ login }} }} #{}",
        "x".repeat(forge::MAX_GRAPHQL_BODY)
    ));
    assert!(check_graphql(&huge).is_err());
}

#[test]
fn the_injected_screener_holds_the_grants_patterns() {
    let s = snap();
    let Verdict::Inject {
        push: Some(mut screener),
        ..
    } = classify(&s, &req("POST", "github.com", "/o/r/git-receive-pack", &[]))
    else {
        panic!("no screener");
    };
    let z = "0".repeat(40);
    let a = "a".repeat(40);
    let mut body = pktline::pkt(format!("{z} {a} refs/heads/main\0 report-status").as_bytes());
    body.extend(b"0000");
    match screener.feed(&body) {
        Screen::Refuse(r) => assert_eq!(
            r.message,
            "tryboxi: push to main is not allowed; allowed: agent/*"
        ),
        other => panic!("{other:?}"),
    }
    // HEAD of the ref advertisement is a git request too.
    let v = classify(
        &s,
        &req(
            "HEAD",
            "github.com",
            "/o/r/info/refs?service=git-upload-pack",
            &[],
        ),
    );
    assert!(matches!(v, Verdict::Inject { push: None, .. }), "{v:?}");
}
