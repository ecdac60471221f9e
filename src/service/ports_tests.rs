//! Exposed ports' bookkeeping without a VM: the record, the listeners, the bounds, and the
//! re-bind after a daemon restart (a taken host port is reported, the others listen again).

use std::sync::Arc;
use std::time::{Duration, Instant};

use super::*;
use crate::config::Config;
use crate::service::{Service, test_sandbox, test_service};

fn svc() -> (Arc<Service>, String, tempfile::TempDir) {
    let dir = tempfile::tempdir().unwrap();
    let svc = test_service(dir.path(), Config::default());
    let id = test_sandbox(&svc, dir.path());
    (svc, id, dir)
}

fn req(port: u16) -> api::ExposePortRequest {
    api::ExposePortRequest {
        port,
        host_port: None,
    }
}

/// A connection to the host port is accepted and then closed without a byte (no VM behind).
async fn accepted_then_closed(host_port: u16) -> bool {
    use tokio::io::AsyncReadExt;
    let Ok(mut s) = tokio::net::TcpStream::connect(("127.0.0.1", host_port)).await else {
        return false;
    };
    let mut b = [0u8; 1];
    matches!(
        tokio::time::timeout(Duration::from_secs(10), s.read(&mut b)).await,
        Ok(Ok(0)) | Ok(Err(_))
    )
}

async fn refused(host_port: u16) -> bool {
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        if tokio::net::TcpStream::connect(("127.0.0.1", host_port))
            .await
            .is_err()
        {
            return true;
        }
        if Instant::now() > deadline {
            return false;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test]
async fn expose_records_listens_and_unexpose_stops() {
    let (svc, id, _d) = svc();
    let p = svc.expose_port(&id, req(3000)).await.unwrap();
    assert!(p.host_port >= 1024, "{p:?}");
    assert_eq!(p.url, format!("http://127.0.0.1:{}", p.host_port));
    assert_eq!(svc.get_sandbox(&id).unwrap().ports, vec![p.clone()]);
    assert_eq!(svc.list_ports(&id).unwrap().ports, vec![p.clone()]);
    // No VM: the connection is closed at once (and the listener survives it).
    assert!(accepted_then_closed(p.host_port).await);
    assert!(accepted_then_closed(p.host_port).await);
    let e = svc.expose_port(&id, req(3000)).await.unwrap_err();
    assert!(matches!(e, ServiceError::Conflict(_)), "{e:?}");
    // A taken host port is a conflict, not a silent other port.
    let e = svc
        .expose_port(
            &id,
            api::ExposePortRequest {
                port: 3001,
                host_port: Some(p.host_port),
            },
        )
        .await
        .unwrap_err();
    assert!(e.to_string().contains("in use"), "{e}");
    let gone = svc.unexpose_port(&id, 3000).await.unwrap();
    assert_eq!(gone, p);
    assert!(svc.get_sandbox(&id).unwrap().ports.is_empty());
    assert!(refused(p.host_port).await, "still listening");
    let e = svc.unexpose_port(&id, 3000).await.unwrap_err();
    assert!(matches!(e, ServiceError::NotFound(_)), "{e:?}");
}

#[tokio::test]
async fn at_most_sixteen_ports_and_all_go_with_the_sandbox() {
    let (svc, id, _d) = svc();
    let mut host_ports = Vec::new();
    for port in 1..=MAX_PORTS as u16 {
        host_ports.push(svc.expose_port(&id, req(port)).await.unwrap().host_port);
    }
    let e = svc.expose_port(&id, req(9999)).await.unwrap_err();
    assert!(matches!(e, ServiceError::Conflict(_)), "{e:?}");
    assert!(e.to_string().contains("16"), "{e}");
    svc.close_ports(&id);
    for h in host_ports {
        assert!(refused(h).await, "{h} still listening");
    }
    assert!(
        svc.expose_port("sbx_0000000000000000", req(1))
            .await
            .is_err()
    );
}

#[tokio::test]
async fn a_restart_binds_again_and_reports_a_taken_port() {
    let (svc, id, _d) = svc();
    let a = svc.expose_port(&id, req(3000)).await.unwrap();
    let b = svc.expose_port(&id, req(3001)).await.unwrap();
    // "Restart": the listeners are gone, someone else takes b's host port meanwhile.
    svc.close_ports(&id);
    assert!(refused(a.host_port).await);
    let squatter = std::net::TcpListener::bind(("127.0.0.1", b.host_port)).unwrap();
    svc.rebind_ports().await;
    assert!(accepted_then_closed(a.host_port).await, "not bound again");
    let ports = svc.list_ports(&id).unwrap().ports;
    assert_eq!(ports[0].error, None);
    let why = ports[1].error.clone().expect("the taken port is reported");
    assert!(why.contains("in use"), "{why}");
    assert_eq!(ports[1].host_port, b.host_port, "the recorded port is kept");
    // Freed and bound again at the next start.
    drop(squatter);
    svc.close_ports(&id);
    svc.rebind_ports().await;
    assert_eq!(svc.list_ports(&id).unwrap().ports[1].error, None);
    assert!(accepted_then_closed(b.host_port).await);
}
