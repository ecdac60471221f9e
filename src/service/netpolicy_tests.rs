//! The network use cases against an in-memory store (no VM): policy at create, user rules,
//! live gate updates, access requests and who may decide them.

use std::sync::Arc;

use super::*;
use crate::api::{AccessRequestCreate, AccessRequestState, NetworkRuleChange};
use crate::config::Config;
use crate::network::gate::{ConnectVerdict, Flow, Gate, Proto};

fn service() -> (Arc<Service>, String, tempfile::TempDir) {
    let dir = tempfile::tempdir().unwrap();
    let mut config = Config::default();
    config
        .network
        .test_hosts
        .insert("allowed.test".into(), vec!["203.0.113.10".parse().unwrap()]);
    config
        .network
        .test_hosts
        .insert("rebind.test".into(), vec!["127.0.0.1".parse().unwrap()]);
    // Never ask a real resolver from unit tests.
    config.network.upstream_dns = Some("127.0.0.1:9".parse().unwrap());
    let svc = crate::service::test_service(dir.path(), config);
    let id = crate::service::test_sandbox(&svc, dir.path());
    let policy = svc
        .validate_network(Some(&api::NetworkSpec {
            policy: vec!["github".into()],
        }))
        .unwrap();
    svc.init_network(&id, policy).unwrap();
    (svc, id, dir)
}

fn flow(dst: &str) -> Flow {
    Flow {
        proto: Proto::Tcp,
        src: "10.0.2.15:40000".parse().unwrap(),
        dst: dst.parse().unwrap(),
    }
}

#[tokio::test]
async fn create_policy_is_stored_and_user_rules_reach_the_live_gate() {
    let (svc, id, _d) = service();
    let p = svc.get_network(&id).unwrap();
    assert_eq!(p.presets, ["github"]);
    assert!(p.rules.is_empty());
    let gate = svc.network_gate(&id).unwrap();
    assert!(matches!(
        gate.connect(&flow("203.0.113.20:22")),
        ConnectVerdict::Deny { .. }
    ));
    let p = svc
        .change_network(
            &id,
            NetworkRuleChange {
                verdict: "allow".into(),
                target: "203.0.113.0/24:22".into(),
            },
        )
        .await
        .unwrap();
    assert_eq!(p.rules, ["allow 203.0.113.0/24:22"]);
    assert!(matches!(
        gate.connect(&flow("203.0.113.20:22")),
        ConnectVerdict::Allow { .. }
    ));
    // Stored: a new gate (e.g. after a restart) sees it too.
    svc.networks.gates.lock().unwrap().clear();
    assert!(matches!(
        svc.network_gate(&id)
            .unwrap()
            .connect(&flow("203.0.113.20:22")),
        ConnectVerdict::Allow { .. }
    ));
    for bad in [("allow", "*"), ("maybe", "a.com"), ("allow", "a.com:22")] {
        assert!(
            svc.change_network(
                &id,
                NetworkRuleChange {
                    verdict: bad.0.into(),
                    target: bad.1.into()
                }
            )
            .await
            .is_err(),
            "{bad:?}"
        );
    }
    assert!(
        svc.validate_network(Some(&api::NetworkSpec {
            policy: vec!["nope".into()]
        }))
        .is_err()
    );
}

#[tokio::test]
async fn access_requests_wait_for_the_user_and_the_mcp_face_cannot_decide() {
    let (svc, id, _d) = service();
    let ask = |host: &str| AccessRequestCreate {
        host: host.into(),
        reason: Some("tests need it".into()),
    };
    for refused in [
        "*",
        "com",
        "*.co.uk",
        "127.0.0.1",
        "rebind.test",
        "10.0.0.0/8",
    ] {
        assert!(
            svc.request_access(&id, ask(refused)).await.is_err(),
            "{refused} accepted"
        );
    }
    let r = svc.request_access(&id, ask("allowed.test")).await.unwrap();
    assert_eq!(r.state, AccessRequestState::Pending);
    assert_eq!(r.rule, "allow allowed.test");
    // Asking again gives the same request.
    assert_eq!(
        svc.request_access(&id, ask("Allowed.Test."))
            .await
            .unwrap()
            .id,
        r.id
    );
    assert_eq!(svc.get_network(&id).unwrap().pending_requests, 1);
    // Nothing is allowed yet: DNS for the name is refused.
    let gate = svc.network_gate(&id).unwrap();
    let q =
        crate::network::dns::testing::query(1, "allowed.test.", hickory_proto::rr::RecordType::A);
    let (code, _) = crate::network::dns::testing::read(&gate.dns(q.clone()).await.unwrap());
    assert_eq!(code, hickory_proto::op::ResponseCode::NXDomain);
    // The MCP face may not approve.
    let e = svc
        .decide_access(&id, &r.id, true, Some("mcp"))
        .await
        .unwrap_err();
    assert!(matches!(e, ServiceError::Forbidden(_)), "{e}");
    assert_eq!(svc.get_network(&id).unwrap().pending_requests, 1);
    // The user approves: the rule is in force at once.
    let done = svc.decide_access(&id, &r.id, true, None).await.unwrap();
    assert_eq!(done.state, AccessRequestState::Approved);
    assert!(
        svc.get_network(&id)
            .unwrap()
            .rules
            .contains(&"allow allowed.test".to_owned())
    );
    let (code, ips) = crate::network::dns::testing::read(&gate.dns(q).await.unwrap());
    assert_eq!(
        (code, ips.len()),
        (hickory_proto::op::ResponseCode::NoError, 1)
    );
    // Decided once only.
    assert!(matches!(
        svc.decide_access(&id, &r.id, false, None).await,
        Err(ServiceError::Conflict(_))
    ));
    let r2 = svc
        .request_access(&id, ask("other.example.com"))
        .await
        .unwrap();
    let rej = svc.decide_access(&id, &r2.id, false, None).await.unwrap();
    assert_eq!(rej.state, AccessRequestState::Rejected);
    assert!(
        !svc.get_network(&id)
            .unwrap()
            .rules
            .iter()
            .any(|r| r.contains("other"))
    );
    assert_eq!(svc.list_access_requests(&id).unwrap().requests.len(), 2);
}

#[tokio::test]
async fn pending_requests_are_bounded() {
    let (svc, id, _d) = service();
    for i in 0..MAX_PENDING {
        svc.request_access(
            &id,
            AccessRequestCreate {
                host: format!("h{i}.example.com"),
                reason: None,
            },
        )
        .await
        .unwrap();
    }
    assert!(matches!(
        svc.request_access(
            &id,
            AccessRequestCreate {
                host: "one-more.example.com".into(),
                reason: None
            }
        )
        .await,
        Err(ServiceError::Conflict(_))
    ));
}

#[test]
fn removing_a_sandbox_forgets_its_network() {
    let (svc, id, _d) = service();
    svc.network_gate(&id).unwrap();
    svc.forget_network(&id);
    assert!(svc.networks.gate(&id).is_none());
    assert!(
        svc.store
            .get::<NetworkRecord>(NETWORK, &id)
            .unwrap()
            .is_none()
    );
}
