//! Tests of `router`: paths, methods and bodies parsed into actions.

use super::*;

fn parse_nd(m: &Method, p: &str, b: &[u8]) -> Result<Action, ApiError> {
    parse(m, p, StreamFormat::Ndjson, b)
}

#[test]
fn accept_header_picks_sse() {
    assert_eq!(
        StreamFormat::from_accept(Some("text/event-stream")),
        StreamFormat::Sse
    );
    assert_eq!(
        StreamFormat::from_accept(Some("application/x-ndjson")),
        StreamFormat::Ndjson
    );
    assert_eq!(StreamFormat::from_accept(None), StreamFormat::Ndjson);
}

#[test]
fn malformed_json_is_a_bad_request() {
    let e = parse_nd(&Method::POST, "/v1/sandboxes", b"{not json").unwrap_err();
    assert_eq!(e.status, hyper::StatusCode::BAD_REQUEST);
    assert_eq!(e.code, "bad_request");
}

#[test]
fn unknown_route_is_404_and_wrong_method_405() {
    assert_eq!(
        parse_nd(&Method::GET, "/v2/x", b"").unwrap_err().status,
        404
    );
    assert_eq!(
        parse_nd(&Method::PUT, "/v1/sandboxes", b"")
            .unwrap_err()
            .status,
        405
    );
}

#[test]
fn path_traversal_ids_never_reach_the_service() {
    let e = parse_nd(&Method::DELETE, "/v1/sandboxes/..", b"").unwrap_err();
    assert_eq!(e.status, 404);
    let e = parse_nd(&Method::GET, "/v1/sandboxes/sbx_%2e%2e", b"").unwrap_err();
    assert_eq!(e.status, 404);
}

/// (method, path template) pairs documented in `api/openapi.yaml`.
fn documented_routes() -> Vec<(String, String)> {
    let docs = yaml_rust2::YamlLoader::load_from_str(crate::daemon::OPENAPI_YAML).unwrap();
    let paths = docs[0]["paths"].as_hash().expect("paths");
    let mut out = Vec::new();
    for (p, ops) in paths {
        for (m, _) in ops.as_hash().unwrap() {
            let m = m.as_str().unwrap();
            if m != "parameters" {
                out.push((m.to_uppercase(), p.as_str().unwrap().to_owned()));
            }
        }
    }
    out
}

#[test]
fn openapi_documents_exactly_the_routes_the_router_serves() {
    let mut documented = documented_routes();
    documented.sort();
    let mut served: Vec<(String, String)> = ROUTES
        .iter()
        .map(|(m, p)| (m.to_string(), p.to_string()))
        .collect();
    served.sort();
    assert_eq!(documented, served);
    // And each documented route really parses (not 404/405) with a sample id and body.
    let id = crate::ids::new_id(crate::ids::SANDBOX);
    for (m, p) in &documented {
        let art = crate::ids::new_id(crate::ids::ARTIFACT);
        let mut path = if p.starts_with("/v1/execs/") {
            p.replace("{id}", &crate::ids::new_id(crate::ids::EXEC))
        } else {
            p.replace("{id}", &id)
                .replace("{art_id}", &art)
                .replace("{req_id}", &crate::ids::new_id(crate::ids::REQUEST))
                .replace("{name}", "API_KEY")
                .replace("{port}", "3000")
        };
        if p.ends_with("/files") {
            path.push_str("?path=/workspace/a");
        }
        if m == "DELETE" && p.ends_with("/git") {
            path.push_str("?repo=github.com/o/r");
        }
        let method: Method = m.parse().unwrap();
        let body: &[u8] = match (m.as_str(), p.as_str()) {
            ("POST", "/v1/sandboxes") => br#"{"workspace":{"host_path":"/tmp"}}"#,
            ("POST", p) if p.ends_with("/exec") => br#"{"cmd":"true"}"#,
            ("POST", p) if p.ends_with("/resize") => br#"{"rows":24,"cols":80}"#,
            ("POST", p) if p.ends_with("/signal") => br#"{"signal":"SIGTERM"}"#,
            ("POST", p) if p.ends_with("/stdin") => br#"{"data":"x","close":true}"#,
            ("POST", p) if p.ends_with("/pull") => br#"{"paths":["a"],"force":true}"#,
            ("POST", p) if p.ends_with("/restore") => br#"{"snapshot":"base"}"#,
            ("POST", p) if p.ends_with("/network/rules") => {
                br#"{"verdict":"allow","target":"example.com"}"#
            }
            ("POST", p) if p.ends_with("/network/setup") => {
                br#"{"cmd":"npm ci","policy":["registries"]}"#
            }
            ("POST", p) if p.ends_with("/network/requests") => br#"{"host":"example.com"}"#,
            ("POST", p) if p.ends_with("/secrets") => br#"{"name":"API_KEY"}"#,
            ("POST", p) if p.ends_with("/ports") => br#"{"port":3000}"#,
            ("POST", p) if p.ends_with("/git") => {
                br#"{"repo":"github.com/o/r","push":["agent/*"],"token_secret":"GH"}"#
            }
            ("PUT", "/v1/secrets/{name}") => br#"{"value":"v","hosts":["a.io"]}"#,
            ("PUT", _) => br#"{"path":"/workspace/a","content":"x"}"#,
            _ => b"",
        };
        let uri: hyper::Uri = path.parse().unwrap();
        parse_request(&method, &uri, &hyper::HeaderMap::new(), body)
            .unwrap_or_else(|e| panic!("{m} {p}: {e:?}"));
    }
}

#[test]
fn diff_query_parses_stat_and_repeated_paths() {
    let id = crate::ids::new_id(crate::ids::SANDBOX);
    let a = parse_nd(
        &Method::GET,
        &format!("/v1/sandboxes/{id}/diff?stat=true&path=src%2Fa.rs&path=b+c"),
        b"",
    )
    .unwrap();
    match a {
        Action::Diff { stat, paths, .. } => {
            assert!(stat);
            assert_eq!(paths, ["src/a.rs", "b c"]);
        }
        other => panic!("{other:?}"),
    }
    let e = parse_nd(
        &Method::GET,
        &format!("/v1/sandboxes/{id}/diff?stat=maybe"),
        b"",
    )
    .unwrap_err();
    assert_eq!(e.status, 400);
}

#[test]
fn files_need_exactly_one_path_and_undo_a_valid_artifact_id() {
    let id = crate::ids::new_id(crate::ids::SANDBOX);
    let e = parse_nd(&Method::GET, &format!("/v1/sandboxes/{id}/files"), b"").unwrap_err();
    assert_eq!(e.status, 400);
    let e = parse_nd(&Method::POST, "/v1/artifacts/../undo", b"").unwrap_err();
    assert_eq!(e.status, 404);
    let e = parse_nd(&Method::GET, "/v1/artifacts/art_0000000000000000/undo", b"").unwrap_err();
    assert_eq!(e.status, 405);
}

#[test]
fn sync_and_undo_take_an_optional_body() {
    let id = crate::ids::new_id(crate::ids::SANDBOX);
    let a = parse_nd(&Method::POST, &format!("/v1/sandboxes/{id}/sync"), b"").unwrap();
    assert!(matches!(a, Action::Sync(_, r) if r.exclude.is_empty()));
    let a = parse_nd(
        &Method::POST,
        &format!("/v1/sandboxes/{id}/sync"),
        br#"{"exclude":["big/"]}"#,
    )
    .unwrap();
    assert!(matches!(a, Action::Sync(_, r) if r.exclude == ["big/"]));
    let art = "/v1/artifacts/art_0000000000000000/undo";
    assert!(matches!(
        parse_nd(&Method::POST, art, b"").unwrap(),
        Action::Undo(_, r) if !r.force
    ));
    assert!(matches!(
        parse_nd(&Method::POST, art, br#"{"force":true}"#).unwrap(),
        Action::Undo(_, r) if r.force
    ));
    let e = parse_nd(&Method::POST, art, br#"{"forse":true}"#).unwrap_err();
    assert_eq!(e.status, 400);
}

#[test]
fn a_secret_body_error_never_quotes_the_body() {
    let e = parse_nd(
        &Method::PUT,
        "/v1/secrets/API_KEY",
        br#"{"value": 123456789987654321, "hosts": ["a.io"]}"#,
    )
    .unwrap_err();
    assert_eq!(e.status, 400);
    assert!(!e.message.contains("123456789987654321"), "{}", e.message);
    let e = parse_nd(
        &Method::PUT,
        "/v1/secrets/API_KEY",
        br#"{"value": "sk-abcdefgh", "hosts": "sk-abcdefgh"}"#,
    )
    .unwrap_err();
    assert!(!e.message.contains("sk-abc"), "{}", e.message);
    let e = parse_nd(
        &Method::PUT,
        "/v1/secrets/lower",
        br#"{"value":"x","hosts":[]}"#,
    )
    .unwrap_err();
    assert_eq!(e.status, 400);
    assert_eq!(
        parse_nd(&Method::POST, "/v1/secrets", b"")
            .unwrap_err()
            .status,
        405
    );
    let a = parse_nd(&Method::DELETE, "/v1/secrets/API_KEY", b"").unwrap();
    assert!(matches!(a, Action::RemoveSecret(ref n) if n == "API_KEY"));
}

#[test]
fn exec_parses() {
    let id = crate::ids::new_id(crate::ids::SANDBOX);
    let a = parse_nd(
        &Method::POST,
        &format!("/v1/sandboxes/{id}/exec"),
        br#"{"cmd":"true"}"#,
    )
    .unwrap();
    assert!(
        matches!(a, Action::Exec(ref i, ref r, StreamFormat::Ndjson) if *i == id && r.cmd.as_deref() == Some("true"))
    );
}

fn req(m: Method, uri: &str, headers: &[(&str, &str)]) -> Result<Action, ApiError> {
    let mut h = hyper::HeaderMap::new();
    for (k, v) in headers {
        h.insert(
            hyper::header::HeaderName::from_bytes(k.as_bytes()).unwrap(),
            v.parse().unwrap(),
        );
    }
    parse_request(&m, &uri.parse().unwrap(), &h, b"")
}

#[test]
fn events_resume_from_last_event_id_or_since_and_filter_by_sandbox() {
    let id = crate::ids::new_id(crate::ids::SANDBOX);
    let a = req(
        Method::GET,
        &format!("/v1/events?sandbox={id}&since=5"),
        &[],
    )
    .unwrap();
    assert!(matches!(a, Action::Events { since: Some(5), sandbox: Some(ref s) } if *s == id));
    let a = req(Method::GET, "/v1/events?since=5", &[("last-event-id", "9")]).unwrap();
    assert!(matches!(
        a,
        Action::Events {
            since: Some(9),
            sandbox: None
        }
    ));
    let a = req(Method::GET, "/v1/events?since=now", &[]).unwrap();
    assert!(matches!(a, Action::Events { since: None, .. }));
    assert!(matches!(
        req(Method::GET, "/v1/events", &[]).unwrap(),
        Action::Events { since: Some(0), .. }
    ));
    assert_eq!(
        req(Method::GET, "/v1/events?since=x", &[])
            .unwrap_err()
            .status,
        400
    );
    assert_eq!(
        req(Method::GET, "/v1/events?bogus=1", &[])
            .unwrap_err()
            .status,
        400
    );
    assert_eq!(
        req(Method::GET, "/v1/events?sandbox=sbx_..", &[])
            .unwrap_err()
            .status,
        404
    );
    assert_eq!(
        req(Method::POST, "/v1/events", &[]).unwrap_err().status,
        405
    );
}

#[test]
fn output_query_parses_and_rejects_bad_values() {
    let id = crate::ids::new_id(crate::ids::EXEC);
    let a = req(
        Method::GET,
        &format!("/v1/execs/{id}/output?offset=12&stream=stderr&strip_ansi=true&wait_ms=50"),
        &[],
    )
    .unwrap();
    let Action::ExecOutput(got, q) = a else {
        panic!("{a:?}")
    };
    assert_eq!(got, id);
    assert_eq!(
        (q.offset, q.stream, q.strip_ansi),
        (12, crate::telemetry::logs::Stream::Stderr, true)
    );
    assert_eq!(q.wait, std::time::Duration::from_millis(50));
    let bad = format!("/v1/execs/{id}/output?stream=both%20ways");
    assert_eq!(req(Method::GET, &bad, &[]).unwrap_err().status, 400);
    assert_eq!(
        req(Method::GET, "/v1/execs/sbx_0/output", &[])
            .unwrap_err()
            .status,
        404
    );
    let sbx = crate::ids::new_id(crate::ids::SANDBOX);
    assert!(matches!(
        req(Method::GET, &format!("/v1/traces/{sbx}"), &[]).unwrap(),
        Action::Trace(_)
    ));
    assert!(matches!(
        req(Method::GET, "/metrics", &[]).unwrap(),
        Action::Metrics
    ));
}

#[test]
fn exec_routes_parse_their_bodies_and_ids() {
    let e = crate::ids::new_id(crate::ids::EXEC);
    let p = |m: Method, path: &str, b: &[u8]| parse_nd(&m, path, b);
    assert!(matches!(
        p(Method::POST, &format!("/v1/execs/{e}/attach"), b""),
        Ok(Action::AttachExec(
            _,
            api::AttachRequest { replay: false },
            _
        ))
    ));
    assert!(matches!(
        p(
            Method::POST,
            &format!("/v1/execs/{e}/signal"),
            br#"{"signal":9}"#
        ),
        Ok(Action::SignalExec(_, _))
    ));
    let bad = p(
        Method::POST,
        &format!("/v1/execs/{e}/resize"),
        br#"{"rows":-1,"cols":2}"#,
    );
    assert_eq!(bad.unwrap_err().status, 400);
    let unknown = p(Method::POST, "/v1/execs/sbx_1/stdin", br#"{"data":"x"}"#);
    assert_eq!(unknown.unwrap_err().status, 404);
    let wrong = p(Method::DELETE, &format!("/v1/execs/{e}"), b"");
    assert_eq!(wrong.unwrap_err().status, 405);
}
