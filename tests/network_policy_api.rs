//! The network policy API and CLI without VMs: routes, the MCP face refused on approve/reject,
//! the `[network]` config keys, and the `net` commands' usage. (The policy engine itself is
//! unit-tested in src/network/policy and src/service/netpolicy_tests.rs; with a VM, see
//! tests/network_policy_e2e.rs.)

mod common;

use std::os::unix::net::UnixStream;

use common::{Daemon, raw_http};

const NO_SANDBOX: &str = "sbx_0123456789abcdef";
const NO_REQUEST: &str = "req_0123456789abcdef";

#[test]
fn the_mcp_face_cannot_approve_or_reject_and_the_user_reaches_the_service() {
    let d = Daemon::start(None, &[]);
    for verb in ["approve", "reject"] {
        let path = format!("/v1/sandboxes/{NO_SANDBOX}/network/requests/{NO_REQUEST}/{verb}");
        let mut s = UnixStream::connect(d.socket()).unwrap();
        let r = raw_http(
            &mut s,
            "POST",
            &path,
            None,
            &[("Host", "localhost"), ("x-tryboxi-face", "mcp")],
        )
        .unwrap();
        assert_eq!(r.status, 403, "{verb}: {}", r.text());
        assert_eq!(r.error_code(), "forbidden");
        // Without the face header the request reaches the service: no such sandbox.
        let r = d.request("POST", &path, None);
        assert_eq!(r.status, 404, "{verb}: {}", r.text());
    }
}

#[test]
fn network_routes_answer_404_for_unknown_sandboxes_and_400_for_bad_bodies() {
    let d = Daemon::start(None, &[]);
    let base = format!("/v1/sandboxes/{NO_SANDBOX}/network");
    assert_eq!(d.request("GET", &base, None).status, 404);
    assert_eq!(
        d.request("GET", &format!("{base}/requests"), None).status,
        404
    );
    let r = d.request(
        "POST",
        &format!("{base}/rules"),
        Some(r#"{"verdict":"allow","target":"example.com"}"#),
    );
    assert_eq!(r.status, 404, "{}", r.text());
    let r = d.request("POST", &format!("{base}/rules"), Some(r#"{"target":"x"}"#));
    assert_eq!(r.status, 400, "{}", r.text());
    assert_eq!(d.request("DELETE", &base, None).status, 405);
    // A create with an unknown preset is refused before anything boots. (Not `/tmp`: it holds
    // the test daemon's data root, never a workspace.)
    let ws = tempfile::tempdir().unwrap();
    let body = serde_json::json!({"workspace": {"host_path": ws.path()},
        "network": {"policy": ["registeries"]}});
    let r = d.request("POST", "/v1/sandboxes", Some(&body.to_string()));
    assert_eq!(r.status, 400, "{}", r.text());
    assert!(r.text().contains("registeries"), "{}", r.text());
}

#[test]
fn network_test_overrides_are_accepted_and_logged() {
    let d = Daemon::start(
        Some(
            "[network]\nupstream_dns = \"127.0.0.1:9\"\n\
             [network.test_hosts]\n\"allowed.test\" = [\"203.0.113.10\"]\n\
             [network.test_upstream_map]\n\"203.0.113.10:80\" = \"127.0.0.1:8080\"\n",
        ),
        &[],
    );
    assert_eq!(d.request("GET", "/v1/health", None).status, 200);
    assert!(
        d.log_text().contains("test overrides are in force"),
        "{}",
        d.log_text()
    );
}

#[test]
fn net_cli_lists_its_commands_and_reports_unknown_sandboxes() {
    let d = Daemon::start(None, &[]);
    let o = d.cli(&["net", "--help"]);
    let help = String::from_utf8_lossy(&o.stdout);
    for c in [
        "policy", "allow", "deny", "requests", "approve", "reject", "setup",
    ] {
        assert!(help.contains(c), "{c} missing: {help}");
    }
    let o = d.cli(&["net", "policy", NO_SANDBOX]);
    assert!(!o.status.success());
    assert!(
        String::from_utf8_lossy(&o.stderr).contains("not_found"),
        "{}",
        String::from_utf8_lossy(&o.stderr)
    );
    let o = d.cli(&["net", "allow", NO_SANDBOX]);
    assert_eq!(o.status.code(), Some(2), "missing TARGET is a usage error");
}
