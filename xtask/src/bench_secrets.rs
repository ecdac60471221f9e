//! `cargo xtask bench`, secrets rows (issue 16), on their own daemon:
//!
//! (k) one HTTPS GET from inside the VM to a host with a secret (intercepted: TLS terminated in
//!     the daemon, the placeholder in `Authorization` swapped for the value, the response
//!     scrubbed) vs the same GET to a host without one (passed through untouched), interleaved
//!     in ONE exec and timed by curl itself (`-w %{time_total}`: connect, both TLS handshakes,
//!     request, answer); medians and their ratio;
//! (k) a 64 MiB download the same two ways (MB/s from curl's `size_download / time_total`; the
//!     intercepted request carries the placeholder, so the whole body goes through the
//!     scrubber);
//! (l) first sync of the workspace bench's 10,000-file tree into a fresh VM with one secret
//!     stored (every synced file is scanned for its value and encodings) vs none stored.
//!
//! The upstream is a local rustls server (HTTP/1.1) whose certificate comes from a test CA
//! made here: the daemon trusts it through `[network] intercept_extra_ca`, the guest because
//! the bench appends it to the guest's bundle (which holds the sandbox's interception CA and
//! which `CURL_CA_BUNDLE` names; both curls load that same file). `api.test` (the secret's
//! host) and `plain.test` (no secret) are pinned to documentation addresses the stack relays to
//! that one server (`test_hosts`, `test_upstream_map`), so the two requests differ only in the
//! interception. Both use `--http1.1` (the upstream offers only HTTP/1.1).

use std::fmt::Write as _;
use std::io::{BufRead as _, BufReader, Write as _};
use std::net::{SocketAddr, TcpListener};
use std::path::Path;
use std::sync::{Arc, mpsc};
use std::time::Duration;

use anyhow::{Context, Result, bail};

use crate::bench::{fmt, median};
use crate::daemon::Daemon;
use crate::http;

/// Requests of each kind in the latency loop (after [`WARMUP`] of each, not counted).
const LATENCY_REQS: usize = 30;
const WARMUP: usize = 2;
/// Bytes of one download, and downloads of each kind.
const DL_BYTES: usize = 64 << 20;
const DL_REPS: usize = 3;
/// First syncs of each kind (with one secret stored, with none).
const SYNC_REPS: usize = 3;

const SECRET: &str = "BENCH_KEY";
/// The bench's own made-up value (nothing real).
const VALUE: &str = "sk-bench-7Hq2Lm9Xv4Tz8Wc1Rb6Nd3";
const HOST_SECRET: &str = "api.test";
const HOST_PLAIN: &str = "plain.test";
const IP_SECRET: &str = "203.0.113.20";
const IP_PLAIN: &str = "203.0.113.21";

pub struct SecretRows {
    pub accel: String,
    /// (k) latency of one GET, intercepted with a swap / passed through.
    pub get_swap: Vec<Duration>,
    pub get_pass: Vec<Duration>,
    /// (k) MB/s of a 64 MiB download, intercepted (placeholder swapped, body scrubbed) /
    /// passed through.
    pub dl_swap: Vec<f64>,
    pub dl_pass: Vec<f64>,
    /// (l) first sync of the 10,000-file tree, one secret stored / none.
    pub sync_secret: Vec<Duration>,
    pub sync_none: Vec<Duration>,
    pub load_before: String,
    pub load_after: String,
}

/// What the upstream saw of one request: (SNI, path, `Authorization`).
type Seen = (String, String, String);

/// Pseudo-random bytes (xorshift): nothing in the path can compress them.
fn noise(len: usize) -> Vec<u8> {
    let mut x: u64 = 0x2545_F491_4F6C_DD1D;
    let mut v = Vec::with_capacity(len + 8);
    while v.len() < len {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        v.extend_from_slice(&x.to_le_bytes());
    }
    v.truncate(len);
    v
}

/// Reads a request head (at most 64 KiB): (path, `Authorization` or "").
fn read_head<R: std::io::Read>(r: R) -> (String, String) {
    let mut r = BufReader::new(r.take(64 << 10));
    let (mut path, mut auth) = (String::new(), String::new());
    let mut line = String::new();
    let mut first = true;
    while r.read_line(&mut line).unwrap_or(0) > 0 && line != "\r\n" {
        if first {
            path = line.split_whitespace().nth(1).unwrap_or("").to_owned();
            first = false;
        } else if let Some((k, v)) = line.split_once(':')
            && k.eq_ignore_ascii_case("authorization")
        {
            auth = v.trim().to_owned();
        }
        line.clear();
    }
    (path, auth)
}

/// The local HTTPS upstream for both hosts: `/small` answers `ok\n`, `/big` [`DL_BYTES`] of
/// noise. Returns its address, the test CA (PEM) and what it saw of each request.
fn upstream() -> Result<(SocketAddr, String, mpsc::Receiver<Seen>)> {
    use rcgen::{BasicConstraints, CertificateParams, IsCa, Issuer, KeyPair};
    let ca_key = KeyPair::generate()?;
    let mut p = CertificateParams::default();
    p.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    // Distinct names: rcgen's default subject for both would make OpenSSL in the guest (which
    // checks the passed-through leaf itself) take the leaf for a self-signed certificate.
    p.distinguished_name
        .push(rcgen::DnType::CommonName, "tryboxi bench upstream CA");
    let ca_pem = p.self_signed(&ca_key)?.pem();
    let issuer = Issuer::new(p, ca_key);
    let key = KeyPair::generate()?;
    let mut leaf = CertificateParams::new(vec![HOST_SECRET.to_string(), HOST_PLAIN.to_string()])?;
    leaf.distinguished_name
        .push(rcgen::DnType::CommonName, HOST_SECRET);
    let cert = leaf.signed_by(&key, &issuer)?;
    let mut cfg = rustls::ServerConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()?
    .with_no_client_auth()
    .with_single_cert(
        vec![cert.der().clone()],
        rustls::pki_types::PrivateKeyDer::Pkcs8(key.serialize_der().into()),
    )?;
    cfg.alpn_protocols = vec![b"http/1.1".to_vec()];
    let cfg = Arc::new(cfg);
    let big: Arc<Vec<u8>> = Arc::new(noise(DL_BYTES));
    let l = TcpListener::bind("127.0.0.1:0")?;
    let addr = l.local_addr()?;
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        for conn in l.incoming() {
            let Ok(tcp) = conn else { return };
            let (cfg, tx, big) = (cfg.clone(), tx.clone(), big.clone());
            std::thread::spawn(move || {
                let _ = tcp.set_read_timeout(Some(Duration::from_secs(120)));
                let _ = tcp.set_write_timeout(Some(Duration::from_secs(120)));
                let Ok(conn) = rustls::ServerConnection::new(cfg) else {
                    return;
                };
                let mut s = rustls::StreamOwned::new(conn, tcp);
                let (path, auth) = read_head(&mut s);
                let sni = s.conn.server_name().unwrap_or("").to_owned();
                let body: &[u8] = if path == "/big" { &big } else { b"ok\n" };
                let head = format!(
                    "HTTP/1.1 200 OK\r\nContent-Type: application/octet-stream\r\n\
                     Content-Length: {}\r\nConnection: close\r\n\r\n",
                    body.len()
                );
                let sent = s.write_all(head.as_bytes()).is_ok()
                    && body.chunks(256 << 10).all(|c| s.write_all(c).is_ok())
                    && s.flush().is_ok();
                if sent {
                    s.conn.send_close_notify();
                    let _ = s.flush();
                }
                let _ = tx.send((sni, path, auth));
            });
        }
    });
    Ok((addr, ca_pem, rx))
}

/// Runs `script` with bash in the sandbox (env `env`); its stdout, or an error with stderr.
fn guest(sock: &Path, id: &str, script: &str, env: &[(&str, &str)]) -> Result<String> {
    let env: serde_json::Map<String, serde_json::Value> = env
        .iter()
        .map(|(k, v)| ((*k).to_owned(), serde_json::Value::from(*v)))
        .collect();
    let body = serde_json::json!({
        "argv": ["bash", "-c", script],
        "env": env,
        "timeout_s": 1800,
    })
    .to_string();
    let (exit, out, err) = http::exec_output(sock, id, &body)?;
    if !exit.contains("\"exit_code\":0") {
        bail!("guest script failed: {exit}\nstdout: {out}\nstderr: {err}");
    }
    Ok(out)
}

/// The curl both kinds of request use: `$1` label, `$2` token, `$3` host, `$4` path.
const CURL_FN: &str = "c() { curl -sS -m 600 --http1.1 -o /dev/null \
    -H \"Authorization: Bearer $2\" -w \"$1 %{http_code} %{size_download} %{time_total}\\n\" \
    \"https://$3$4\"; }; \
    DUMMY=$(printf '%s' \"$BENCH_KEY\" | tr 'a-z0-9_' 'x'); ";

/// Parses the `label code size seconds` lines of [`CURL_FN`]: (label, size, seconds) of each.
fn parse_curl(out: &str) -> Result<Vec<(String, u64, f64)>> {
    out.lines()
        .filter(|l| !l.trim().is_empty())
        .map(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            let [label, code, size, secs] = f[..] else {
                bail!("unexpected curl line: {l}");
            };
            if code != "200" {
                bail!("HTTP {code} from the upstream: {l}");
            }
            Ok((label.to_owned(), size.parse()?, secs.parse()?))
        })
        .collect()
}

/// Every request the upstream saw: those for the secret's host carried the value (swapped in
/// by the daemon), the others did not; `want` of each.
fn check_seen(seen: &mpsc::Receiver<Seen>, path: &str, want: usize) -> Result<()> {
    let (mut swapped, mut plain) = (0, 0);
    while swapped + plain < 2 * want {
        let (sni, p, auth) = seen
            .recv_timeout(Duration::from_secs(60))
            .with_context(|| format!("the upstream saw {swapped} + {plain} of 2 x {want}"))?;
        if p != path {
            bail!("the upstream saw {p}, expected {path}");
        }
        match sni.as_str() {
            HOST_SECRET if auth == format!("Bearer {VALUE}") => swapped += 1,
            HOST_PLAIN if !auth.contains(VALUE) && auth.starts_with("Bearer ") => plain += 1,
            _ => bail!("{sni}{p}: unexpected Authorization ({} bytes)", auth.len()),
        }
    }
    Ok(())
}

fn put_secret(sock: &Path) -> Result<()> {
    let body = serde_json::json!({ "value": VALUE, "hosts": [HOST_SECRET] }).to_string();
    let (st, out) = http::request(sock, "PUT", &format!("/v1/secrets/{SECRET}"), Some(&body))?;
    if !(200..300).contains(&st) {
        bail!("secret set failed: HTTP {st}: {out}");
    }
    Ok(())
}

fn rm_secret(sock: &Path) -> Result<()> {
    let (st, out) = http::request(sock, "DELETE", &format!("/v1/secrets/{SECRET}"), None)?;
    if !(200..300).contains(&st) {
        bail!("secret rm failed: HTTP {st}: {out}");
    }
    Ok(())
}

pub fn run(bin: &Path, home: &Path, artifacts: &Path, base_config: &str) -> Result<SecretRows> {
    let load_before = crate::bench::loadavg();
    std::fs::create_dir_all(home)?;
    let (addr, ca_pem, seen) = upstream()?;
    let ca_path = home.join("upstream-ca.pem");
    std::fs::write(&ca_path, &ca_pem)?;
    let config = format!(
        "{base_config}\n[network]\ndefault_policy = [\"{HOST_SECRET}:443\", \"{HOST_PLAIN}:443\"]\n\
         upstream_dns = \"127.0.0.1:9\"\nintercept_extra_ca = \"{}\"\n\
         [network.test_hosts]\n\"{HOST_SECRET}\" = [\"{IP_SECRET}\"]\n\
         \"{HOST_PLAIN}\" = [\"{IP_PLAIN}\"]\n\
         [network.test_upstream_map]\n\"{IP_SECRET}:443\" = \"{addr}\"\n\
         \"{IP_PLAIN}:443\" = \"{addr}\"\n",
        ca_path.display()
    );
    let d = Daemon::start(bin, home, artifacts, &config)?;
    let sock = d.socket();
    put_secret(&sock)?;
    // Workspaces may not lie inside the daemon's data root.
    let scratch = home.with_file_name("secrets-ws");
    let ws = scratch.join("ws-secrets");
    std::fs::create_dir_all(&ws)?;
    let body = serde_json::json!({
        "workspace": { "host_path": ws },
        "secrets": [SECRET],
    })
    .to_string();
    let (st, created) = http::request(&sock, "POST", "/v1/sandboxes", Some(&body))?;
    if st != 201 {
        bail!("create failed: HTTP {st}: {created}");
    }
    let id = http::json_str(&created, "id").context("no id")?;
    let accel = http::json_str(&created, "accel").unwrap_or_else(|| "?".into());
    guest(
        &sock,
        &id,
        "printf '%s\\n' \"$UPSTREAM_CA\" >> /etc/ssl/certs/ca-certificates.crt && \
         grep -c 'BEGIN CERT' /etc/ssl/certs/ca-certificates.crt >&2",
        &[("UPSTREAM_CA", &ca_pem)],
    )?;

    println!(
        "==> (k) one HTTPS GET, intercepted with a swap vs passed through ({LATENCY_REQS}x each, \
         interleaved, one exec)"
    );
    let script = format!(
        "{CURL_FN} for i in $(seq {WARMUP}); do \
         c warm \"$BENCH_KEY\" {HOST_SECRET} /small || exit 1; \
         c warm \"$DUMMY\" {HOST_PLAIN} /small || exit 1; done; \
         for i in $(seq {LATENCY_REQS}); do \
         c swap \"$BENCH_KEY\" {HOST_SECRET} /small || exit 1; \
         c pass \"$DUMMY\" {HOST_PLAIN} /small || exit 1; done"
    );
    let lines = parse_curl(&guest(&sock, &id, &script, &[])?)?;
    check_seen(&seen, "/small", WARMUP + LATENCY_REQS)?;
    let pick = |label: &str| -> Vec<Duration> {
        lines
            .iter()
            .filter(|l| l.0 == label)
            .map(|l| Duration::from_secs_f64(l.2))
            .collect()
    };
    let (get_swap, get_pass) = (pick("swap"), pick("pass"));
    if get_swap.len() != LATENCY_REQS || get_pass.len() != LATENCY_REQS {
        bail!("expected {LATENCY_REQS} timings of each kind: {lines:?}");
    }
    crate::bench::progress("(k) GET intercepted + swap", &get_swap);
    crate::bench::progress("(k) GET passed through", &get_pass);

    println!(
        "==> (k) {} MiB download, intercepted (swap + scrub) vs passed through ({DL_REPS}x each)",
        DL_BYTES >> 20
    );
    let script = format!(
        "{CURL_FN} for i in $(seq {DL_REPS}); do \
         c swap \"$BENCH_KEY\" {HOST_SECRET} /big || exit 1; \
         c pass \"$DUMMY\" {HOST_PLAIN} /big || exit 1; done"
    );
    let lines = parse_curl(&guest(&sock, &id, &script, &[])?)?;
    check_seen(&seen, "/big", DL_REPS)?;
    let mbps = |label: &str| -> Result<Vec<f64>> {
        lines
            .iter()
            .filter(|l| l.0 == label)
            .map(|l| {
                if l.1 != DL_BYTES as u64 {
                    bail!("{label}: downloaded {} of {DL_BYTES} bytes", l.1);
                }
                Ok(l.1 as f64 / 1e6 / l.2)
            })
            .collect()
    };
    let (dl_swap, dl_pass) = (mbps("swap")?, mbps("pass")?);
    if dl_swap.len() != DL_REPS || dl_pass.len() != DL_REPS {
        bail!("expected {DL_REPS} downloads of each kind: {lines:?}");
    }
    println!("    (k) download MB/s: intercepted {dl_swap:.1?}, passed through {dl_pass:.1?}");
    http::request(&sock, "DELETE", &format!("/v1/sandboxes/{id}"), None)?;
    rm_secret(&sock)?;

    println!(
        "==> (l) first sync of the 10,000-file tree: one secret stored vs none ({SYNC_REPS}x each)"
    );
    let (sync_secret, sync_none) = sync_rows(&sock, &scratch)?;
    crate::bench::progress("(l) first sync, one secret stored", &sync_secret);
    crate::bench::progress("(l) first sync, no secret", &sync_none);
    d.stop()?;
    Ok(SecretRows {
        accel,
        get_swap,
        get_pass,
        dl_swap,
        dl_pass,
        sync_secret,
        sync_none,
        load_before,
        load_after: crate::bench::loadavg(),
    })
}

/// (l): each first sync into a fresh sandbox (created on an empty directory, then the tree moved
/// in, as the workspace rows do); with the secret stored and without, alternating which goes
/// first.
fn sync_rows(sock: &Path, scratch: &Path) -> Result<(Vec<Duration>, Vec<Duration>)> {
    let gen_dir = scratch.join("ws-gen");
    crate::bench_ws::ws_generate(&gen_dir)?;
    let st = std::process::Command::new("sync")
        .status()
        .context("sync")?;
    if !st.success() {
        bail!("sync failed");
    }
    let ws = scratch.join("ws-big");
    let (mut with, mut without) = (Vec::new(), Vec::new());
    for rep in 0..SYNC_REPS {
        let order = if rep % 2 == 0 {
            [false, true]
        } else {
            [true, false]
        };
        for stored in order {
            if stored {
                put_secret(sock)?;
            }
            std::fs::create_dir_all(&ws)?;
            let body = serde_json::json!({ "workspace": { "host_path": ws } }).to_string();
            let (st, created) = http::request(sock, "POST", "/v1/sandboxes", Some(&body))?;
            if st != 201 {
                bail!("create failed: HTTP {st}: {created}");
            }
            let id = http::json_str(&created, "id").context("no id")?;
            std::fs::remove_dir(&ws)?;
            std::fs::rename(&gen_dir, &ws)?;
            let (el, report) = crate::bench_ws::ws_sync(sock, &id)?;
            let files = crate::bench_ws::WS_DIRS * crate::bench_ws::WS_FILES_PER_DIR;
            if !report.contains(&format!("\"files_sent\":{files}")) {
                bail!("first sync did not send every file: {report}");
            }
            if stored { &mut with } else { &mut without }.push(el);
            http::request(sock, "DELETE", &format!("/v1/sandboxes/{id}"), None)?;
            std::fs::rename(&ws, &gen_dir)?;
            if stored {
                rm_secret(sock)?;
            }
        }
    }
    Ok((with, without))
}

fn median_f(v: &[f64]) -> f64 {
    let mut s = v.to_vec();
    s.sort_by(f64::total_cmp);
    s[s.len() / 2]
}

/// Heading of the secrets section of BENCHMARKS.md.
pub const HEADING: &str = "## Secrets (issue 16)";

/// The secrets section of BENCHMARKS.md.
pub fn section(r: &SecretRows, date: &str) -> Result<String> {
    let mut md = String::new();
    writeln!(md, "{HEADING}\n")?;
    writeln!(
        md,
        "Measured on {date}, accel **{}**; host load average (1/5/15 min) at the start of these \
         rows {}, at their end {}. Each pair is measured in the same run, interleaved, against \
         the same local HTTPS upstream (HTTP/1.1, certificate from a test CA): `api.test` has a \
         secret (intercepted: TLS terminated in the daemon, placeholder swapped for the value, \
         response scrubbed), `plain.test` has none (passed through). Timings are curl's own \
         inside the VM.\n",
        r.accel, r.load_before, r.load_after
    )?;
    writeln!(
        md,
        "| what | reps | intercepted, with a secret | passed through / no secret | ratio | target |"
    )?;
    writeln!(md, "|---|---|---|---|---|---|")?;
    let (gs, gp) = (median(&r.get_swap), median(&r.get_pass));
    writeln!(
        md,
        "| (k) one HTTPS GET, median `time_total` (connect, TLS, request, 3-byte answer) | {} | \
         {} | {} | {:.2} | |",
        r.get_swap.len(),
        fmt(gs),
        fmt(gp),
        gs.as_secs_f64() / gp.as_secs_f64()
    )?;
    let (ds, dp) = (median_f(&r.dl_swap), median_f(&r.dl_pass));
    writeln!(
        md,
        "| (k) 64 MiB download, median MB/s (the request carries the placeholder, so the body \
         is scrubbed) | {} | {ds:.1} MB/s | {dp:.1} MB/s | {:.2} | |",
        r.dl_swap.len(),
        ds / dp
    )?;
    let (ss, sn) = (median(&r.sync_secret), median(&r.sync_none));
    writeln!(
        md,
        "| (l) first sync of the 10,000-file / 100 MB tree into a VM, one secret stored vs none \
         | {} | {} | {} | **{:.2}** | <= 1.1 |",
        r.sync_secret.len(),
        fmt(ss),
        fmt(sn),
        ss.as_secs_f64() / sn.as_secs_f64()
    )?;
    writeln!(
        md,
        "\nUnder **{}** the guest's curl (TLS, TCP) is emulated: both sides of each ratio pay \
         that alike; the daemon's work (a second TLS handshake and re-encryption for the \
         intercepted host) runs natively.\n",
        r.accel
    )?;
    Ok(md)
}
