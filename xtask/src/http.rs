//! A tiny HTTP/1.1 client over the daemon's unix socket, for `demo` and `bench` (the xtask
//! crate does not link the tryboxi crate).

use std::io::{BufRead, BufReader, Read, Write};
use std::os::unix::net::UnixStream;
use std::path::Path;

use anyhow::{Context, Result, bail};

/// Send one request (Connection: close); returns (status, body). Chunked bodies are decoded.
pub fn request(sock: &Path, method: &str, path: &str, body: Option<&str>) -> Result<(u16, String)> {
    let mut s = UnixStream::connect(sock).with_context(|| format!("connect {}", sock.display()))?;
    send(&mut s, method, path, body)?;
    let mut r = BufReader::new(s);
    let (status, chunked) = read_head(&mut r)?;
    let mut raw = Vec::new();
    r.read_to_end(&mut raw)?;
    let body = if chunked { dechunk(&raw) } else { raw };
    Ok((status, String::from_utf8_lossy(&body).into_owned()))
}

/// [`request`] that gives up after `timeout` without an answer: `Ok(None)` then (the daemon
/// may still be working on it).
pub fn request_within(
    sock: &Path,
    method: &str,
    path: &str,
    body: Option<&str>,
    timeout: std::time::Duration,
) -> Result<Option<(u16, String)>> {
    let mut s = UnixStream::connect(sock).with_context(|| format!("connect {}", sock.display()))?;
    // A zero timeout would mean "none".
    s.set_read_timeout(Some(timeout.max(std::time::Duration::from_millis(1))))?;
    send(&mut s, method, path, body)?;
    let mut r = BufReader::new(s);
    let timed_out = |e: &anyhow::Error| {
        e.downcast_ref::<std::io::Error>().is_some_and(|e| {
            matches!(
                e.kind(),
                std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
            )
        })
    };
    let (status, chunked) = match read_head(&mut r) {
        Ok(h) => h,
        Err(e) if timed_out(&e) => return Ok(None),
        Err(e) => return Err(e),
    };
    let mut raw = Vec::new();
    match r.read_to_end(&mut raw) {
        Ok(_) => {}
        Err(e)
            if matches!(
                e.kind(),
                std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
            ) =>
        {
            return Ok(None);
        }
        Err(e) => return Err(e.into()),
    }
    let body = if chunked { dechunk(&raw) } else { raw };
    Ok(Some((status, String::from_utf8_lossy(&body).into_owned())))
}

/// POST an exec and read its whole NDJSON answer (fails on an HTTP error).
fn exec_ndjson(sock: &Path, id: &str, body: &str) -> Result<String> {
    let mut s = UnixStream::connect(sock)?;
    send(
        &mut s,
        "POST",
        &format!("/v1/sandboxes/{id}/exec"),
        Some(body),
    )?;
    let mut r = BufReader::new(s);
    let (status, _) = read_head(&mut r)?;
    let mut all = Vec::new();
    r.read_to_end(&mut all)?;
    let text = String::from_utf8_lossy(&dechunk(&all)).into_owned();
    if status != 200 {
        bail!("exec: HTTP {status}: {text}");
    }
    Ok(text)
}

/// POST an exec and read NDJSON lines until the `exit` line; returns that line.
pub fn exec(sock: &Path, id: &str, body: &str) -> Result<String> {
    let text = exec_ndjson(sock, id, body)?;
    text.lines()
        .find(|l| l.contains("\"type\":\"exit\""))
        .map(str::to_owned)
        .with_context(|| format!("no exit line in: {text}"))
}

/// POST an exec and collect its output: (the `exit` line, stdout, stderr). Fails on an HTTP
/// error, an `error` line or a missing `exit` line.
pub fn exec_output(sock: &Path, id: &str, body: &str) -> Result<(String, String, String)> {
    let text = exec_ndjson(sock, id, body)?;
    let (mut exit, mut out, mut err) = (None, String::new(), String::new());
    for line in text.lines() {
        let Ok(v) = serde_json::from_str::<serde_json::Value>(line) else {
            continue;
        };
        match v["type"].as_str() {
            Some("stdout") => out.push_str(v["data"].as_str().unwrap_or("")),
            Some("stderr") => err.push_str(v["data"].as_str().unwrap_or("")),
            Some("exit") => exit = Some(line.to_owned()),
            Some("error") => bail!("exec failed: {line}"),
            _ => {}
        }
    }
    let exit = exit.with_context(|| format!("no exit line in: {text}"))?;
    Ok((exit, out, err))
}

fn send(s: &mut UnixStream, method: &str, path: &str, body: Option<&str>) -> Result<()> {
    let body = body.unwrap_or("");
    write!(
        s,
        "{method} {path} HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    )?;
    Ok(())
}

fn read_head<R: BufRead>(r: &mut R) -> Result<(u16, bool)> {
    let mut line = String::new();
    r.read_line(&mut line)?;
    let status: u16 = line
        .split_whitespace()
        .nth(1)
        .context("no status line")?
        .parse()?;
    let mut chunked = false;
    loop {
        line.clear();
        r.read_line(&mut line)?;
        if line.trim().is_empty() {
            break;
        }
        if line
            .to_ascii_lowercase()
            .starts_with("transfer-encoding: chunked")
        {
            chunked = true;
        }
    }
    Ok((status, chunked))
}

fn dechunk(mut b: &[u8]) -> Vec<u8> {
    let mut out = Vec::new();
    while let Some(nl) = b.windows(2).position(|w| w == b"\r\n") {
        let Ok(size) = usize::from_str_radix(String::from_utf8_lossy(&b[..nl]).trim(), 16) else {
            break;
        };
        if size == 0 || b.len() < nl + 2 + size {
            break;
        }
        out.extend_from_slice(&b[nl + 2..nl + 2 + size]);
        b = &b[(nl + 4 + size).min(b.len())..];
    }
    out
}

/// A JSON string field of a flat JSON text (enough for ids and states).
pub fn json_str(text: &str, key: &str) -> Option<String> {
    let v: serde_json::Value = serde_json::from_str(text).ok()?;
    v.get(key)?.as_str().map(str::to_owned)
}

/// The value of each of `series` (a metric name with its labels exactly as the exposition
/// writes them, e.g. `tryboxi_daemon_heap_bytes{kind="free"}`) in one `GET /metrics`; `None`
/// for a series not exported.
pub fn metrics(sock: &Path, series: &[&str]) -> Result<Vec<Option<f64>>> {
    let (st, text) = request(sock, "GET", "/metrics", None)?;
    if st != 200 {
        bail!("GET /metrics: HTTP {st}");
    }
    Ok(series
        .iter()
        .map(|s| {
            text.lines().find_map(|l| {
                let v = l.strip_prefix(s)?.strip_prefix(' ')?;
                v.trim().parse::<f64>().ok()
            })
        })
        .collect())
}
