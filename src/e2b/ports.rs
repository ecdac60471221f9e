//! Requests for a sandbox port other than envd's (`E2b-Sandbox-Port: N`, with the sandbox's
//! `E2B-Traffic-Access-Token`): proxied as HTTP/1.1 to the guest's port N through the
//! sandbox's userspace network stack (`Service::connect_guest_port`, the ingress `tryboxi port`
//! uses). This is how the code interpreter's `/execute` on port 49999 reaches a server in the
//! VM, and how E2B code reaches any server it started there. A code-interpreter sandbox's
//! port 49999 is waited for (bounded) while its server starts its kernel.
//!
//! Owns: dropping the E2B routing and token headers before the request enters the VM, and the
//! error shapes the SDK understands (a 502 whose body says "port is not open").

use hyper::body::Incoming;
use hyper::{Request, Response, StatusCode};
use hyper_util::rt::TokioIo;

use super::Face;
use crate::daemon::response::Body;
use crate::service::e2b::E2bSandbox;

/// The code interpreter's port (the SDK's `JUPYTER_PORT`).
pub const INTERPRETER_PORT: u16 = 49999;
/// How long a request to the interpreter's port waits for the server to open it.
const INTERPRETER_START_WAIT: std::time::Duration = std::time::Duration::from_secs(180);

/// Headers that steer or authenticate the E2B face and never go into the VM.
const STRIPPED: [&str; 4] = [
    "e2b-sandbox-id",
    "e2b-sandbox-port",
    "e2b-traffic-access-token",
    "x-access-token",
];

fn closed(id: &str, port: u16, why: &str) -> Response<Body> {
    super::json(
        StatusCode::BAD_GATEWAY,
        &serde_json::json!({
            "code": 502,
            "message": format!("The sandbox {id} is running but port {port} is not open: {why}"),
            "sandboxId": id,
            "port": port,
        }),
    )
}

pub async fn proxy(
    mut req: Request<Incoming>,
    face: &Face,
    rec: &E2bSandbox,
    port: u16,
) -> Response<Body> {
    let id = rec.sandbox_id.as_str();
    // The code interpreter's server opens its port once its kernel is up (seconds, or a
    // minute and more under TCG): a request before that waits for it, bounded.
    let wait = port == INTERPRETER_PORT && super::control::is_interpreter(&rec.template_id);
    let deadline = tokio::time::Instant::now() + INTERPRETER_START_WAIT;
    let io = loop {
        match face.svc.connect_guest_port(id, port).await {
            Ok(io) => break io,
            Err(crate::service::ServiceError::NotFound(_)) => return super::not_running(id),
            Err(e) if !wait || tokio::time::Instant::now() >= deadline => {
                return closed(id, port, &e.to_string());
            }
            Err(e) => {
                tracing::debug!(sandbox = %id, error = %e, "waiting for the code interpreter");
                tokio::time::sleep(std::time::Duration::from_millis(250)).await;
            }
        }
    };
    for h in STRIPPED {
        req.headers_mut().remove(h);
    }
    let (mut sender, conn) = match hyper::client::conn::http1::handshake(TokioIo::new(io)).await {
        Ok(x) => x,
        Err(e) => return closed(id, port, &e.to_string()),
    };
    tokio::spawn(async move {
        if let Err(e) = conn.await {
            tracing::debug!(error = %e, "E2B port proxy connection ended");
        }
    });
    match sender.send_request(req).await {
        Ok(resp) => resp.map(guest_body),
        Err(e) => closed(id, port, &e.to_string()),
    }
}

/// A guest's response body as the daemon's body type (`BoxBody<Bytes, Infallible>`): a body
/// error from the guest ends the body early.
fn guest_body(b: Incoming) -> Body {
    use futures_util::StreamExt as _;
    use http_body_util::BodyExt as _;

    let stream = b
        .into_data_stream()
        .take_while(|r| std::future::ready(r.is_ok()))
        .filter_map(|r| {
            std::future::ready(
                r.ok()
                    .map(|b| Ok::<_, std::convert::Infallible>(hyper::body::Frame::data(b))),
            )
        });
    http_body_util::BodyExt::boxed(http_body_util::StreamBody::new(stream))
}
