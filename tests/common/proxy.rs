//! A real local `CONNECT` proxy for the upstream-proxy tests (`[network] upstream_proxy`): it
//! requires Basic credentials ([`USER`]:[`PASS`]), tunnels the `name:port` targets it maps to
//! local servers (so those names are reachable only through it), refuses others with a status,
//! and records every target it was asked for and whether the credentials were right.

use std::collections::HashMap;
use std::io::{Read as _, Write as _};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::{Arc, Mutex};

pub const USER: &str = "alice";
pub const PASS: &str = "pr0xy-pa55-Zq8";

/// `(target, credentials right)` of every `CONNECT` the proxy was asked for.
type Seen = Arc<Mutex<Vec<(String, bool)>>>;

pub struct Proxy {
    pub addr: SocketAddr,
    seen: Seen,
}

impl Proxy {
    /// Tunnels the targets of `map` (`"name:port"` to a local address), answers those of
    /// `refuse` with their status, anything else with 502.
    pub fn start(map: HashMap<String, SocketAddr>, refuse: HashMap<String, u16>) -> Proxy {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = l.local_addr().unwrap();
        let seen = Seen::default();
        let want = format!(
            "Basic {}",
            base64::Engine::encode(
                &base64::engine::general_purpose::STANDARD,
                format!("{USER}:{PASS}")
            )
        );
        let (map, refuse, s2) = (Arc::new(map), Arc::new(refuse), seen.clone());
        std::thread::spawn(move || {
            for conn in l.incoming() {
                let Ok(c) = conn else { return };
                let (map, refuse, seen, want) =
                    (map.clone(), refuse.clone(), s2.clone(), want.clone());
                std::thread::spawn(move || Proxy::serve(c, &map, &refuse, &seen, &want));
            }
        });
        Proxy { addr, seen }
    }

    /// The daemon's `upstream_proxy` value for this proxy, with its credentials.
    pub fn url(&self) -> String {
        format!("http://{USER}:{PASS}@{}", self.addr)
    }

    fn serve(
        mut c: TcpStream,
        map: &HashMap<String, SocketAddr>,
        refuse: &HashMap<String, u16>,
        seen: &Mutex<Vec<(String, bool)>>,
        want: &str,
    ) {
        // Byte by byte (bounded): what follows the head belongs to the tunnel.
        let mut head = Vec::new();
        let mut b = [0u8; 1];
        while !head.ends_with(b"\r\n\r\n") {
            if head.len() > 8192 || c.read_exact(&mut b).is_err() {
                return;
            }
            head.push(b[0]);
        }
        let text = String::from_utf8_lossy(&head).into_owned();
        let mut lines = text.split("\r\n");
        let Some(target) = lines
            .next()
            .and_then(|l| l.strip_prefix("CONNECT "))
            .and_then(|r| r.strip_suffix(" HTTP/1.1"))
            .map(str::to_owned)
        else {
            let _ = c.write_all(b"HTTP/1.1 405 CONNECT only\r\n\r\n");
            return;
        };
        let authed = lines
            .filter_map(|l| l.split_once(':'))
            .any(|(k, v)| k.eq_ignore_ascii_case("proxy-authorization") && v.trim() == want);
        seen.lock().unwrap().push((target.clone(), authed));
        if !authed {
            let _ = c.write_all(b"HTTP/1.1 407 Proxy Authentication Required\r\n\r\n");
            return;
        }
        if let Some(code) = refuse.get(&target) {
            let _ = write!(c, "HTTP/1.1 {code} Blocked by policy\r\n\r\n");
            return;
        }
        let Some(up) = map.get(&target).and_then(|a| TcpStream::connect(a).ok()) else {
            let _ = c.write_all(b"HTTP/1.1 502 Unknown target\r\n\r\n");
            return;
        };
        let _ = c.write_all(b"HTTP/1.1 200 Connection established\r\n\r\n");
        let (mut c2, mut up2) = (c.try_clone().unwrap(), up.try_clone().unwrap());
        let t = std::thread::spawn(move || {
            let _ = std::io::copy(&mut up2, &mut c2);
            let _ = c2.shutdown(std::net::Shutdown::Write);
        });
        let mut up = up;
        let _ = std::io::copy(&mut c, &mut up);
        let _ = up.shutdown(std::net::Shutdown::Write);
        let _ = t.join();
    }

    /// Every target asked for, in order.
    pub fn targets(&self) -> Vec<String> {
        self.seen
            .lock()
            .unwrap()
            .iter()
            .map(|(t, _)| t.clone())
            .collect()
    }

    /// Whether every `CONNECT` carried the right credentials (true when there was none).
    pub fn all_authed(&self) -> bool {
        self.seen.lock().unwrap().iter().all(|(_, a)| *a)
    }
}
