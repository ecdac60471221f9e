//! Test double of the guest side of the RPC, played by an attacker (tests only): it answers the
//! handshake like the agent, then does whatever the test says on the raw socket. The real agent
//! stays as it is; these check that the host survives one that was replaced.

use super::AgentClient;
use super::frame::{encode, read_frame};
use super::msg::{Body, Frame, PROTOCOL_VERSION, Request};
use tokio::io::AsyncWriteExt;
use tokio::net::UnixStream;

/// A client connected to a fake guest over a socket pair; the returned stream is the guest's end,
/// past the handshake.
pub async fn fake_guest() -> (AgentClient, UnixStream) {
    let (host, guest) = UnixStream::pair().expect("socket pair");
    let handshake = tokio::spawn(answer_hello(guest));
    let client = AgentClient::connect(host).await.expect("handshake");
    (client, handshake.await.unwrap())
}

/// The guest's side of the handshake on `guest`; returns it past the handshake.
pub async fn answer_hello(mut guest: UnixStream) -> UnixStream {
    let hello = read_frame(&mut guest).await.unwrap().expect("a Hello");
    let Body::Hello { nonce, .. } = hello.body else {
        panic!("expected Hello, got {:?}", hello.body);
    };
    let ack = Body::HelloAck {
        protocol: PROTOCOL_VERSION,
        version: "hostile".into(),
        nonce,
    };
    send(&mut guest, 0, ack).await;
    guest
}

/// Writes one frame (errors ignored: the host may have hung up on the attacker).
pub async fn send(g: &mut UnixStream, stream: u32, body: Body) {
    let _ = g.write_all(&encode(&Frame { stream, body }).unwrap()).await;
}

/// Reads frames until the host's next request; `None` when the host hung up.
pub async fn next_request(g: &mut UnixStream) -> Option<(u32, Request)> {
    loop {
        match read_frame(g).await {
            Ok(Some(Frame {
                stream,
                body: Body::Request(r),
            })) => return Some((stream, r)),
            Ok(Some(_)) => {}
            _ => return None,
        }
    }
}

/// Reads and discards everything the host sends until it hangs up.
pub async fn ignore_all(g: &mut UnixStream) {
    while let Ok(Some(_)) = read_frame(g).await {}
}
