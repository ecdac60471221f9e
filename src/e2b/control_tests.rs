//! Tests of `control`: request bodies, bounds, the network mapping, list paging, deadlines.

use super::*;
use crate::service::parse_rfc3339;

#[test]
fn create_bodies_parse_as_the_sdk_sends_them() {
    let n: NewSandbox = serde_json::from_str(
        r#"{"templateID":"base","timeout":60,"metadata":{"k":"v"},"envVars":{"A":"1"},
            "autoPause":true,"autoPauseMemory":false,"allow_internet_access":false,"network":{"allowOut":["pypi.org"]},
            "secure":true,"mcp":null,"volumeMounts":[]}"#,
    )
    .unwrap();
    assert_eq!(n.template_id.as_deref(), Some("base"));
    assert_eq!(n.timeout, Some(60));
    assert_eq!(n.env_vars.unwrap()["A"], "1");
    assert_eq!(n.auto_pause, Some(true));
    assert_eq!(n.auto_pause_memory, Some(false));
    assert_eq!(n.allow_internet_access, Some(false));
    assert_eq!(n.network.unwrap().allow_out.unwrap(), vec!["pypi.org"]);
    // An empty body is the all-defaults request.
    let e: NewSandbox = parse(b"").unwrap();
    assert!(e.template_id.is_none());
    assert!(parse::<NewSandbox>(b"{").is_err());
}

#[test]
fn pause_and_connect_bodies_parse_as_the_sdk_sends_them() {
    // pause(mode="filesystem", strict=True); pause() sends no memory field.
    let p: PauseBody = parse(br#"{"memory":false,"requireHealthyGuest":true}"#).unwrap();
    assert_eq!(
        (p.memory, p.require_healthy_guest),
        (Some(false), Some(true))
    );
    let p: PauseBody = parse(b"{}").unwrap();
    assert_eq!((p.memory, p.require_healthy_guest), (None, None));
    // connect(on_resume="reboot") sends memory: false; restore (the default) leaves it out.
    let c: ConnectBody = parse(br#"{"timeout":300,"memory":false}"#).unwrap();
    assert_eq!((c.timeout, c.memory), (Some(300), Some(false)));
    let c: ConnectBody = parse(br#"{"timeout":300}"#).unwrap();
    assert_eq!(c.memory, None);
}

#[test]
fn bounds_are_checked() {
    assert!(check_timeout(0).is_err());
    assert!(check_timeout(MAX_TIMEOUT_S + 1).is_err());
    assert_eq!(check_timeout(300).unwrap(), 300);
    let mut m = BTreeMap::new();
    m.insert("k".into(), "x".repeat(MAX_META_VALUE + 1));
    assert!(check_map("metadata", &m, MAX_METADATA, MAX_META_VALUE).is_err());
    let many: BTreeMap<String, String> = (0..=MAX_METADATA)
        .map(|i| (format!("k{i}"), "v".into()))
        .collect();
    assert!(check_map("metadata", &many, MAX_METADATA, MAX_META_VALUE).is_err());
    let mut empty_key = BTreeMap::new();
    empty_key.insert(String::new(), "v".into());
    assert!(check_map("envVars", &empty_key, MAX_ENV_VARS, MAX_ENV_VALUE).is_err());
}

fn policy(body: &str) -> Result<Option<Vec<String>>, StatusCode> {
    let n: NewSandbox = serde_json::from_str(body).unwrap();
    let default = vec!["registries".to_owned(), "github".to_owned()];
    policy_for(&default, &n)
        .map(|p| p.map(|p| p.policy))
        .map_err(|e| e.status)
}

#[test]
fn network_options_map_onto_our_allowlist() {
    let v = |xs: &[&str]| Some(xs.iter().map(|x| x.to_string()).collect::<Vec<_>>());
    // Nothing said: the daemon's default allowlist (never the open internet).
    assert_eq!(policy(r#"{}"#), Ok(None));
    assert_eq!(policy(r#"{"allow_internet_access":true}"#), Ok(None));
    // allowOut alone adds names to the default.
    assert_eq!(
        policy(r#"{"network":{"allowOut":["api.example.com"]}}"#),
        Ok(v(&["registries", "github", "api.example.com"]))
    );
    // No internet: no egress at all, or only what allowOut names.
    assert_eq!(
        policy(r#"{"allow_internet_access":false}"#),
        Ok(v(&["none"]))
    );
    assert_eq!(
        policy(r#"{"allow_internet_access":false,"network":{"allowOut":["pypi.org"]}}"#),
        Ok(v(&["pypi.org"]))
    );
    // The SDKs' idiom for "only these hosts": denyOut ALL_TRAFFIC + allowOut.
    assert_eq!(
        policy(r#"{"network":{"allowOut":["api.example.com"],"denyOut":["0.0.0.0/0"]}}"#),
        Ok(v(&["api.example.com"]))
    );
    assert_eq!(
        policy(r#"{"network":{"denyOut":["0.0.0.0/0"]}}"#),
        Ok(v(&["none"]))
    );
    // Ingress and DNS options need nothing.
    assert_eq!(
        policy(r#"{"network":{"allowPublicTraffic":false,"maskRequestHost":"x","dnsServers":[]}}"#),
        Ok(None)
    );
    // What we cannot honour is refused, never silently widened or dropped.
    let refused = Err(StatusCode::BAD_REQUEST);
    assert_eq!(policy(r#"{"network":{"denyOut":["10.0.0.0/8"]}}"#), refused);
    assert_eq!(
        policy(r#"{"network":{"rules":{"api.example.com":[{"transform":{}}]}}}"#),
        refused
    );
    assert_eq!(
        policy(r#"{"network":{"egressProxy":{"url":"http://p:3128"}}}"#),
        refused
    );
    let many: Vec<String> = (0..257).map(|i| format!("h{i}.example")).collect();
    let body = json!({ "network": { "allowOut": many } }).to_string();
    assert_eq!(policy(&body), refused);
    // Empty rules / a null proxy are what some clients send for "none".
    assert_eq!(
        policy(r#"{"network":{"rules":{},"egressProxy":null}}"#),
        Ok(None)
    );
}

fn rec(id: &str, started: &str, meta: &[(&str, &str)]) -> E2bSandbox {
    E2bSandbox {
        sandbox_id: id.into(),
        template_id: "base".into(),
        envd_token: String::new(),
        traffic_token: String::new(),
        metadata: meta
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect(),
        env_vars: BTreeMap::new(),
        started_at: started.into(),
        end_at: 0,
        auto_pause: false,
        auto_pause_memory: true,
    }
}

#[test]
fn lists_filter_by_metadata_and_state_and_page_with_the_next_token() {
    let all = || {
        vec![
            (
                rec("sbx_c", "2026-01-01T00:00:03Z", &[("job", "1")]),
                "running",
            ),
            (
                rec("sbx_a", "2026-01-01T00:00:01Z", &[("job", "1")]),
                "paused",
            ),
            (
                rec("sbx_b", "2026-01-01T00:00:02Z", &[("job", "2")]),
                "running",
            ),
            (
                rec("sbx_d", "2026-01-01T00:00:03Z", &[("job", "1"), ("x", "y")]),
                "running",
            ),
        ]
    };
    let q = |meta: &[(&str, &str)], states: &[&str], limit, after: Option<String>| ListQuery {
        metadata: meta
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect(),
        states: states.iter().map(|s| s.to_string()).collect(),
        limit,
        after,
        template: None,
        newest_first: false,
        started_after: None,
    };
    let ids = |v: &[(E2bSandbox, &str)]| -> Vec<String> {
        v.iter().map(|(r, _)| r.sandbox_id.clone()).collect()
    };
    let state = |s: &&'static str| *s;
    // Oldest first, ties by id; everything fits: no token.
    let (page, next) = select(all(), state, &q(&[], &[], MAX_PAGE, None));
    assert_eq!(ids(&page), ["sbx_a", "sbx_b", "sbx_c", "sbx_d"]);
    assert_eq!(next, None);
    // Metadata: every pair must match.
    let (page, _) = select(all(), state, &q(&[("job", "1")], &[], MAX_PAGE, None));
    assert_eq!(ids(&page), ["sbx_a", "sbx_c", "sbx_d"]);
    let (page, _) = select(all(), state, &q(&[("job", "1"), ("x", "y")], &[], 9, None));
    assert_eq!(ids(&page), ["sbx_d"]);
    // State.
    let (page, _) = select(all(), state, &q(&[], &["paused"], 9, None));
    assert_eq!(ids(&page), ["sbx_a"]);
    let (page, _) = select(all(), state, &q(&[], &["running", "paused"], 9, None));
    assert_eq!(page.len(), 4);
    // Pages of two, following the token, see each sandbox exactly once.
    let mut seen = Vec::new();
    let mut after = None;
    for _ in 0..4 {
        let (page, next) = select(all(), state, &q(&[], &[], 2, after.clone()));
        seen.extend(ids(&page));
        match next {
            Some(t) => after = Some(t),
            None => break,
        }
    }
    assert_eq!(seen, ["sbx_a", "sbx_b", "sbx_c", "sbx_d"]);
    // Filters and paging together.
    let (page, next) = select(all(), state, &q(&[("job", "1")], &["running"], 1, None));
    assert_eq!(ids(&page), ["sbx_c"]);
    let (page, next) = select(all(), state, &q(&[("job", "1")], &["running"], 1, next));
    assert_eq!(ids(&page), ["sbx_d"]);
    assert_eq!(next, None);
    // Newest first, paged the other way.
    let mut desc = q(&[], &[], 3, None);
    desc.newest_first = true;
    let (page, next) = select(all(), state, &desc);
    assert_eq!(ids(&page), ["sbx_d", "sbx_c", "sbx_b"]);
    desc.after = next;
    let (page, next) = select(all(), state, &desc);
    assert_eq!(ids(&page), ["sbx_a"]);
    assert_eq!(next, None);
    // Template: as created; the interpreter's two names are one.
    let mut more = all();
    let mut ci = rec("sbx_e", "2026-01-01T00:00:04Z", &[]);
    ci.template_id = "code-interpreter-v1".into();
    more.push((ci, "running"));
    let mut t = q(&[], &[], 9, None);
    t.template = Some("code-interpreter".into());
    let (page, _) = select(more.clone(), state, &t);
    assert_eq!(ids(&page), ["sbx_e"]);
    t.template = Some("base".into());
    let (page, _) = select(more, state, &t);
    assert_eq!(page.len(), 4);
    // Started at or after an instant (as the SDKs send it, with a zone).
    let mut after = q(&[], &[], 9, None);
    after.started_after = parse_instant("2026-01-01T01:00:02.999+01:00");
    let (page, _) = select(all(), state, &after);
    assert_eq!(ids(&page), ["sbx_b", "sbx_c", "sbx_d"]);
}

#[test]
fn started_after_is_read_with_its_zone() {
    let utc = parse_rfc3339("2026-12-06T07:00:00Z").unwrap();
    assert_eq!(parse_instant("2026-12-06T07:00:00Z"), Some(utc));
    assert_eq!(parse_instant("2026-12-06T07:00:00.123456+00:00"), Some(utc));
    assert_eq!(parse_instant("2026-12-06T08:30:00+01:30"), Some(utc));
    assert_eq!(parse_instant("2026-12-06T05:00:00-02:00"), Some(utc));
    // No zone (a naive local time), or garbage: refused.
    assert_eq!(parse_instant("2026-12-06T07:00:00"), None);
    assert_eq!(parse_instant("2026-12-06T07:00:00+0100"), None);
    assert_eq!(parse_instant("yesterday"), None);
}

#[test]
fn connect_extends_deadlines_and_a_resume_gets_a_fresh_one() {
    let now = 1_000_000;
    // Resumed after its deadline (auto-pause): a fresh one, never the past one.
    assert_eq!(
        end_after_connect(now - 10, now, true, None),
        now + DEFAULT_TIMEOUT_S
    );
    assert_eq!(end_after_connect(now - 10, now, true, Some(60)), now + 60);
    // Paused by hand with time left: kept.
    assert_eq!(end_after_connect(now + 900, now, true, None), now + 900);
    // Running: only ever later.
    assert_eq!(
        end_after_connect(now + 900, now, false, Some(60)),
        now + 900
    );
    assert_eq!(end_after_connect(now + 30, now, false, Some(60)), now + 60);
    assert_eq!(end_after_connect(now + 30, now, false, None), now + 30);
}

#[test]
fn references_are_read_without_their_namespace_and_tag() {
    use super::{bare_name, is_interpreter};
    for (r, name) in [
        ("base", "base"),
        ("base:latest", "base"),
        ("e2b/base", "base"),
        ("my-team/snap_1:default", "snap_1"),
        ("a/b/c:d:e", "c"),
        ("", ""),
        ("team/", ""),
    ] {
        assert_eq!(bare_name(r), name, "{r}");
    }
    assert!(is_interpreter("e2b/code-interpreter-v1:latest"));
    assert!(is_interpreter("code-interpreter"));
    assert!(!is_interpreter("e2b/base"));
}
