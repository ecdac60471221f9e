//! `cargo xtask bench`, network rows: one TCP stream guest -> local server through the sandbox's
//! userspace stack vs the same transfer host-local, and connections per second both ways.
//!
//! The guest reaches a server on 127.0.0.1 through the test override `[network]
//! test_upstream_map` (the guest connects to 203.0.113.10, a documentation address, allowed by
//! an IP rule; the daemon connects to the local server instead). Both transfers are the same
//! `head -c N /dev/zero > /dev/tcp/...` in bash; the server measures from accept to EOF.

use std::io::Read;
use std::net::TcpListener;
use std::path::Path;
use std::process::Command;
use std::sync::mpsc;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};

use crate::daemon::Daemon;
use crate::http;

/// Bytes of one stream transfer.
const STREAM_BYTES: u64 = 64 << 20;
/// Connections of one connections-per-second run.
const CONNECTS: u32 = 200;
const GUEST_IP: &str = "203.0.113.10";

pub struct NetRows {
    /// MB/s through the stack, host-local.
    pub stream_vm: f64,
    pub stream_host: f64,
    /// Connections per second through the stack, host-local.
    pub cps_vm: f64,
    pub cps_host: f64,
}

/// A server that reads each connection to EOF and reports (bytes, accept -> EOF).
pub(crate) fn sink() -> Result<(u16, mpsc::Receiver<(u64, Duration)>)> {
    let l = TcpListener::bind("127.0.0.1:0")?;
    let port = l.local_addr()?.port();
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        for s in l.incoming() {
            let Ok(mut s) = s else { return };
            let t = Instant::now();
            let mut buf = vec![0u8; 256 * 1024];
            let mut n = 0u64;
            while let Ok(k) = s.read(&mut buf) {
                if k == 0 {
                    break;
                }
                n += k as u64;
            }
            if tx.send((n, t.elapsed())).is_err() {
                return;
            }
        }
    });
    Ok((port, rx))
}

/// A server that accepts and closes, reporting the time of each accept.
pub(crate) fn acceptor() -> Result<(u16, mpsc::Receiver<Instant>)> {
    let l = TcpListener::bind("127.0.0.1:0")?;
    let port = l.local_addr()?.port();
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        for s in l.incoming() {
            drop(s);
            if tx.send(Instant::now()).is_err() {
                return;
            }
        }
    });
    Ok((port, rx))
}

fn stream_script(host: &str, port: u16) -> String {
    format!("head -c {STREAM_BYTES} /dev/zero > /dev/tcp/{host}/{port}")
}

fn connect_script(host: &str, port: u16) -> String {
    format!(
        "for i in $(seq {CONNECTS}); do exec 3<>/dev/tcp/{host}/{port} || exit 1; exec 3>&-; done"
    )
}

fn mbps(r: (u64, Duration)) -> Result<f64> {
    if r.0 != STREAM_BYTES {
        bail!("the server got {} of {STREAM_BYTES} bytes", r.0);
    }
    Ok(r.0 as f64 / 1e6 / r.1.as_secs_f64())
}

/// Connections per second from the median gap between accepts: one connection that waits out a
/// SYN retransmission (1 s; seen host-local when a client port met a server-side TIME_WAIT)
/// would otherwise decide the whole row (measured: 197/s instead of ~100,000/s).
fn cps(rx: &mpsc::Receiver<Instant>) -> Result<f64> {
    cps_of(rx, CONNECTS as usize)
}

/// [`cps`] of `n` connections.
pub(crate) fn cps_of(rx: &mpsc::Receiver<Instant>, n: usize) -> Result<f64> {
    let mut times = Vec::new();
    for _ in 0..n {
        times.push(rx.recv_timeout(Duration::from_secs(60))?);
    }
    let mut gaps: Vec<Duration> = times.windows(2).map(|w| w[1] - w[0]).collect();
    gaps.sort();
    let median = gaps[gaps.len() / 2].max(Duration::from_nanos(1));
    Ok(1.0 / median.as_secs_f64())
}

fn host_bash(script: &str) -> Result<()> {
    let st = Command::new("bash").args(["-c", script]).status()?;
    if !st.success() {
        bail!("host `{script}` failed");
    }
    Ok(())
}

fn guest_bash(sock: &Path, id: &str, script: &str) -> Result<()> {
    let body = serde_json::json!({ "argv": ["bash", "-c", script] }).to_string();
    let exit = http::exec(sock, id, &body)?;
    if !exit.contains("\"exit_code\":0") {
        bail!("guest `{script}` failed: {exit}");
    }
    Ok(())
}

pub fn run(bin: &Path, home: &Path, artifacts: &Path, base_config: &str) -> Result<NetRows> {
    let (stream_port, stream_rx) = sink()?;
    let (conn_port, conn_rx) = acceptor()?;
    let config = format!(
        "{base_config}\n[network]\ndefault_policy = [\"{GUEST_IP}:9000-9001\"]\n\
         [network.test_upstream_map]\n\"{GUEST_IP}:9000\" = \"127.0.0.1:{stream_port}\"\n\
         \"{GUEST_IP}:9001\" = \"127.0.0.1:{conn_port}\"\n"
    );
    let d = Daemon::start(bin, home, artifacts, &config)?;
    let sock = d.socket();
    let ws = crate::util::beside(home, "ws-net")?;
    let body = format!(r#"{{"workspace":{{"host_path":"{}"}}}}"#, ws.display());
    let (st, created) = http::request(&sock, "POST", "/v1/sandboxes", Some(&body))?;
    if st != 201 {
        bail!("create failed: HTTP {st}: {created}");
    }
    let id = http::json_str(&created, "id").context("no id")?;

    println!(
        "==> (g) one TCP stream of {} MiB: guest -> stack -> local server, and host-local",
        STREAM_BYTES >> 20
    );
    guest_bash(&sock, &id, &stream_script(GUEST_IP, 9000))?;
    let stream_vm = mbps(stream_rx.recv_timeout(Duration::from_secs(600))?)?;
    host_bash(&stream_script("127.0.0.1", stream_port))?;
    let stream_host = mbps(stream_rx.recv_timeout(Duration::from_secs(600))?)?;

    println!(
        "==> (g) {CONNECTS} connections one after another: guest through the stack, and host-local"
    );
    guest_bash(&sock, &id, &connect_script(GUEST_IP, 9001))?;
    let cps_vm = cps(&conn_rx)?;
    host_bash(&connect_script("127.0.0.1", conn_port))?;
    let cps_host = cps(&conn_rx)?;

    http::request(&sock, "DELETE", &format!("/v1/sandboxes/{id}"), None)?;
    d.stop()?;
    Ok(NetRows {
        stream_vm,
        stream_host,
        cps_vm,
        cps_host,
    })
}
