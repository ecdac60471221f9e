//! A real local `CONNECT` proxy for tests: it records every `CONNECT` target and
//! `Proxy-Authorization` it sees, refuses the targets it is told to, and tunnels the others to
//! loopback servers by a `name:port -> address` table (so names are kept, never resolved).

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

#[derive(Default)]
pub struct Seen {
    /// TCP connections accepted.
    pub accepts: AtomicUsize,
    /// Every `CONNECT` target, in order.
    pub connects: Mutex<Vec<String>>,
    /// Every `Proxy-Authorization` value (None when absent), in order.
    pub auths: Mutex<Vec<Option<String>>>,
    /// The task of every connection (its tunnel, once open), for [`TestProxy::cut`].
    tunnels: Mutex<Vec<tokio::task::AbortHandle>>,
}

impl Seen {
    pub fn connects(&self) -> Vec<String> {
        self.connects.lock().unwrap().clone()
    }
}

pub struct TestProxy {
    pub addr: SocketAddr,
    pub seen: Arc<Seen>,
    _task: tokio::task::JoinHandle<()>,
}

impl TestProxy {
    /// Close every connection and tunnel open now (both ends see the TCP close), as a proxy
    /// that restarts or times tunnels out does.
    pub fn cut(&self) {
        for t in self.seen.tunnels.lock().unwrap().drain(..) {
            t.abort();
        }
    }
}

impl Drop for TestProxy {
    fn drop(&mut self) {
        self._task.abort();
    }
}

/// What the proxy does with a `CONNECT`.
#[derive(Default, Clone)]
pub struct Rules {
    /// `name:port` -> where the tunnel really goes.
    pub map: HashMap<String, SocketAddr>,
    /// `name:port` -> the status to refuse it with.
    pub refuse: HashMap<String, u16>,
    /// When set, a `CONNECT` without exactly this `Proxy-Authorization` gets a 407.
    pub require_auth: Option<String>,
}

pub async fn start(rules: Rules) -> TestProxy {
    let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap();
    let seen = Arc::new(Seen::default());
    let (s2, rules) = (seen.clone(), Arc::new(rules));
    let task = tokio::spawn(async move {
        while let Ok((c, _)) = l.accept().await {
            s2.accepts.fetch_add(1, Ordering::SeqCst);
            let t = tokio::spawn(serve(c, s2.clone(), rules.clone()));
            s2.tunnels.lock().unwrap().push(t.abort_handle());
        }
    });
    TestProxy {
        addr,
        seen,
        _task: task,
    }
}

async fn serve(mut c: TcpStream, seen: Arc<Seen>, rules: Arc<Rules>) {
    let mut head = Vec::new();
    while !head.ends_with(b"\r\n\r\n") {
        match c.read_u8().await {
            Ok(b) => head.push(b),
            Err(_) => return,
        }
    }
    let text = String::from_utf8_lossy(&head).into_owned();
    let mut lines = text.split("\r\n");
    let first = lines.next().unwrap_or("");
    let Some(target) = first
        .strip_prefix("CONNECT ")
        .and_then(|r| r.strip_suffix(" HTTP/1.1"))
    else {
        let _ = c.write_all(b"HTTP/1.1 405 Only CONNECT\r\n\r\n").await;
        return;
    };
    let auth = lines
        .filter_map(|l| l.split_once(':'))
        .find(|(k, _)| k.eq_ignore_ascii_case("proxy-authorization"))
        .map(|(_, v)| v.trim().to_owned());
    seen.connects.lock().unwrap().push(target.to_owned());
    seen.auths.lock().unwrap().push(auth.clone());
    if rules.require_auth.is_some() && auth != rules.require_auth {
        let _ = c
            .write_all(b"HTTP/1.1 407 Proxy Authentication Required\r\n\r\n")
            .await;
        return;
    }
    if let Some(code) = rules.refuse.get(target) {
        let _ = c
            .write_all(format!("HTTP/1.1 {code} Blocked by test proxy\r\n\r\n").as_bytes())
            .await;
        return;
    }
    let Some(to) = rules.map.get(target) else {
        let _ = c.write_all(b"HTTP/1.1 502 Unknown target\r\n\r\n").await;
        return;
    };
    let Ok(mut up) = TcpStream::connect(to).await else {
        let _ = c.write_all(b"HTTP/1.1 502 Upstream down\r\n\r\n").await;
        return;
    };
    if c.write_all(b"HTTP/1.1 200 Connection established\r\n\r\n")
        .await
        .is_err()
    {
        return;
    }
    let _ = tokio::io::copy_bidirectional(&mut c, &mut up).await;
}
