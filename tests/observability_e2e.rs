//! Observability end to end: the real daemon, real CLI, and (for the lifecycle test) a real VM.
//! `/metrics` is parsed by the reference Prometheus text parser (`tests/prom_parse.py`, Python
//! `prometheus_client`, installed by `cargo xtask deps`); an SSE client follows a sandbox's whole
//! life; the exec's trace, output log and metrics are checked against what really happened.
//!
//! VM test: `TRYBOXI_ARTIFACTS=/work/main/_out cargo test --test observability_e2e`.

mod common;

use std::io::{BufRead, BufReader, Write};
use std::process::{Command, Stdio};
use std::sync::mpsc;
use std::time::Duration;

use common::{Daemon, SMALL_VMS, artifacts, bash, create_with, follow_events};
use serde_json::Value;

/// Samples of a `/metrics` body, as parsed by prometheus_client's parser.
fn parse_metrics(text: &str) -> Vec<Value> {
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/prom_parse.py");
    // Debian's python3 (where `cargo xtask deps` installs python3-prometheus-client), not
    // whatever python3 comes first on PATH.
    let python = ["/usr/bin/python3", "python3"]
        .into_iter()
        .find(|p| std::path::Path::new(p).exists())
        .unwrap_or("python3");
    let mut child = Command::new(python)
        .arg(script)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("python3 (run `cargo xtask deps`)");
    child
        .stdin
        .take()
        .unwrap()
        .write_all(text.as_bytes())
        .unwrap();
    let out = child.wait_with_output().unwrap();
    assert!(
        out.status.success(),
        "the Prometheus parser refused /metrics ({}):\n{text}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice::<Value>(&out.stdout)
        .unwrap()
        .as_array()
        .unwrap()
        .clone()
}

fn sample(samples: &[Value], name: &str, labels: &[(&str, &str)]) -> Option<f64> {
    samples
        .iter()
        .find(|s| {
            s["name"] == name
                && labels
                    .iter()
                    .all(|(k, v)| s["labels"][*k].as_str() == Some(*v))
        })
        .and_then(|s| s["value"].as_f64())
}

#[test]
fn metrics_parse_with_the_prometheus_text_parser() {
    let d = Daemon::start(None, &[]);
    let r = d.request("GET", "/metrics", None);
    assert_eq!(r.status, 200);
    assert!(
        r.headers.contains("text/plain; version=0.0.4"),
        "{}",
        r.headers
    );
    let samples = parse_metrics(&r.text());
    assert_eq!(
        sample(&samples, "tryboxi_sandboxes", &[("state", "ready")]),
        Some(0.0)
    );
    assert!(sample(&samples, "tryboxi_daemon_resident_memory_bytes", &[]).unwrap() > 0.0);
}

#[test]
fn unknown_traces_and_exec_outputs_are_404() {
    let d = Daemon::start(None, &[]);
    let r = d.request("GET", "/v1/traces/exe_0123456789abcdef", None);
    assert_eq!((r.status, r.error_code().as_str()), (404, "not_found"));
    let r = d.request("GET", "/v1/execs/exe_0123456789abcdef/output", None);
    assert_eq!((r.status, r.error_code().as_str()), (404, "not_found"));
    let out = d.cli(&["trace", "sbx_0123456789abcdef"]);
    assert_eq!(out.status.code(), Some(1));
}

fn next_event(rx: &mpsc::Receiver<Value>, d: &Daemon) -> Value {
    rx.recv_timeout(Duration::from_secs(240))
        .unwrap_or_else(|e| panic!("no event ({e}); daemon log:\n{}", d.log_text()))
}

/// A minimal OTLP/HTTP collector: answers every POST with 200 and hands over (path, body).
fn fake_collector() -> (String, mpsc::Receiver<(String, Vec<u8>)>) {
    use std::io::Read;
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let url = format!("http://{}", l.local_addr().unwrap());
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        for conn in l.incoming() {
            let Ok(mut c) = conn else { return };
            let tx = tx.clone();
            std::thread::spawn(move || {
                let mut r = BufReader::new(c.try_clone().unwrap());
                loop {
                    let mut head = Vec::new();
                    let mut line = String::new();
                    while r.read_line(&mut line).unwrap_or(0) > 0 && line != "\r\n" {
                        head.push(std::mem::take(&mut line));
                    }
                    if head.is_empty() {
                        return;
                    }
                    let path = head[0].split_whitespace().nth(1).unwrap_or("").to_owned();
                    let len: usize = head
                        .iter()
                        .find_map(|h| {
                            let (k, v) = h.split_once(':')?;
                            k.eq_ignore_ascii_case("content-length")
                                .then(|| v.trim().parse().ok())?
                        })
                        .unwrap_or(0);
                    let mut body = vec![0; len];
                    if r.read_exact(&mut body).is_err() {
                        return;
                    }
                    let _ = c.write_all(
                        b"HTTP/1.1 200 OK\r\ncontent-type: application/x-protobuf\r\ncontent-length: 0\r\n\r\n",
                    );
                    if tx.send((path, body)).is_err() {
                        return;
                    }
                }
            });
        }
    });
    (url, rx)
}

/// The names of a trace's spans, in order.
fn span_names(trace: &Value) -> Vec<&str> {
    trace["spans"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| s["name"].as_str().unwrap())
        .collect()
}

/// A plain HTTP server on the host loopback answering every request with `hello\n`: the
/// upstream the guest's allowed name is mapped to.
fn hello_server() -> std::net::SocketAddr {
    use std::io::Read;
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap();
    std::thread::spawn(move || {
        for mut c in l.incoming().flatten() {
            let mut buf = [0u8; 4096];
            let _ = c.read(&mut buf);
            let _ = c.write_all(
                b"HTTP/1.1 200 OK\r\ncontent-length: 6\r\nconnection: close\r\n\r\nhello\n",
            );
        }
    });
    addr
}

/// The metric names the Grafana dashboard's panels query (histograms by their base name).
fn dashboard_metrics() -> Vec<String> {
    let dash: Value = serde_json::from_str(include_str!("../deploy/grafana/tryboxi.json")).unwrap();
    let re = regex::Regex::new(r"tryboxi_[a-z_]+").unwrap();
    let mut names: Vec<String> = Vec::new();
    for p in dash["panels"].as_array().unwrap() {
        for t in p["targets"].as_array().into_iter().flatten() {
            for m in re.find_iter(t["expr"].as_str().unwrap()) {
                let n = m.as_str().strip_suffix("_bucket").unwrap_or(m.as_str());
                if !names.iter().any(|x| x == n) {
                    names.push(n.to_owned());
                }
            }
        }
    }
    assert!(names.len() >= 10, "{names:?}");
    names
}

#[test]
fn a_sandbox_whole_life_is_observable() {
    let Some(art) = artifacts() else { return };
    let (collector, exported) = fake_collector();
    // The guest may reach `allowed.test` (a loopback server here) and nothing else.
    let web = hello_server();
    let cfg = format!(
        "{SMALL_VMS}[network]\ndefault_policy = []\n\
         [network.test_hosts]\n\"allowed.test\" = [\"203.0.113.10\"]\n\
         [network.test_upstream_map]\n\"203.0.113.10:80\" = \"{web}\"\n"
    );
    let d = Daemon::start(
        Some(&cfg),
        &[
            "--artifacts",
            art.to_str().unwrap(),
            "--otlp-endpoint",
            &collector,
        ],
    );
    let events = follow_events(&d, "?since=now");
    // The follower is subscribed once the daemon answered its headers; a short request
    // round trip after connecting makes that certain without sleeping.
    assert_eq!(d.request("GET", "/v1/health", None).status, 200);
    let ws = tempfile::tempdir().unwrap();
    std::fs::write(ws.path().join("synced.txt"), "in the first sync\n").unwrap();

    let id = create_with(&d, ws.path(), &["--network", "allowed.test"]);
    let script = "echo hello; echo world; printf '\\033[31mred\\033[0m\\n' >&2; exit 3";
    let out = d.cli(&["exec", &id, "--", "sh", "-c", script]);
    assert_eq!(
        out.status.code(),
        Some(3),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );

    // Events: created, ready, exec started, exec finished (exit 3), in order.
    let mut seen = Vec::new();
    for _ in 0..4 {
        seen.push(next_event(&events, &d));
    }
    let kinds: Vec<&str> = seen.iter().map(|e| e["type"].as_str().unwrap()).collect();
    assert_eq!(
        kinds,
        [
            "sandbox.created",
            "sandbox.ready",
            "exec.started",
            "exec.finished"
        ]
    );
    assert!(seen.iter().all(|e| e["sandbox_id"] == id.as_str()));
    assert!(
        seen.windows(2)
            .all(|w| w[0]["id"].as_u64() < w[1]["id"].as_u64())
    );
    assert_eq!(seen[3]["data"]["exit_code"], 3);
    let exe = seen[2]["exec_id"].as_str().unwrap().to_owned();
    assert_eq!(seen[3]["exec_id"], exe.as_str());

    // The CLI sees the same history (resuming from an id) as JSON lines.
    let first = seen[0]["id"].as_u64().unwrap();
    let out = d.cli(&[
        "events",
        "--since",
        &(first - 1).to_string(),
        "--sandbox",
        &id,
        "--json",
        "--count",
        "4",
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let lines: Vec<Value> = String::from_utf8(out.stdout)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(lines, seen);

    // Trace of the exec: its phases in order (the sync before it first), each with a
    // non-zero duration.
    let t = d.request("GET", &format!("/v1/traces/{exe}"), None).json();
    assert_eq!(
        span_names(&t),
        ["workspace.sync", "exec.spawn", "exec", "output.flush"],
        "{t}"
    );
    assert_eq!(t["spans"][0]["attrs"]["files"], "0", "nothing changed: {t}");
    assert!(t["finished"].as_bool().unwrap());
    let spans = t["spans"].as_array().unwrap();
    for w in spans.windows(2) {
        assert!(
            w[0]["start_unix_ns"].as_u64() <= w[1]["start_unix_ns"].as_u64(),
            "{t}"
        );
    }
    assert!(
        spans.iter().all(|s| s["duration_ns"].as_u64().unwrap() > 0),
        "{t}"
    );
    assert_eq!(spans[2]["attrs"]["exit_code"], "3");
    let t = d.request("GET", &format!("/v1/traces/{id}"), None).json();
    assert_eq!(
        span_names(&t),
        [
            "scheduler.reserve",
            "vm.boot",
            "guest.connect",
            "workspace.sync"
        ],
        "{t}"
    );
    assert_eq!(t["spans"][3]["attrs"]["files"], "1", "{t}");
    assert_eq!(t["spans"][3]["attrs"]["bytes"], "18", "{t}");
    let out = d.cli(&["trace", &id]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success() && text.contains("vm.boot") && text.contains('█'),
        "{text}"
    );

    // Output log: both streams kept; grep and ANSI stripping.
    let out = d.cli(&["logs", &exe, "--stream", "stdout"]);
    assert_eq!(String::from_utf8_lossy(&out.stdout), "hello\nworld\n");
    let out = d.cli(&["logs", &exe, "--grep", "^wor"]);
    assert_eq!(String::from_utf8_lossy(&out.stdout), "world\n");
    let r = d
        .request(
            "GET",
            &format!("/v1/execs/{exe}/output?stream=stderr&strip_ansi=true"),
            None,
        )
        .json();
    assert_eq!(
        (r["data"].as_str(), r["eof"].as_bool()),
        (Some("red\n"), Some(true)),
        "{r}"
    );
    let r = d
        .request(
            "GET",
            &format!("/v1/execs/{exe}/output?stream=stderr&offset=2"),
            None,
        )
        .json();
    assert!(r["data"].as_str().unwrap().starts_with("31mred"), "{r}");

    // Metrics: what happened, through the reference parser.
    let samples = parse_metrics(&d.request("GET", "/metrics", None).text());
    let get = |n: &str, l: &[(&str, &str)]| {
        sample(&samples, n, l).unwrap_or_else(|| panic!("no {n} {l:?} in {samples:?}"))
    };
    assert_eq!(get("tryboxi_sandboxes", &[("state", "ready")]), 1.0);
    assert_eq!(
        get("tryboxi_sandbox_creates_total", &[("outcome", "ok")]),
        1.0
    );
    assert_eq!(get("tryboxi_execs_total", &[("outcome", "nonzero")]), 1.0);
    assert_eq!(get("tryboxi_boot_duration_seconds_count", &[]), 1.0);
    assert!(get("tryboxi_boot_duration_seconds_sum", &[]) > 0.0);
    assert_eq!(get("tryboxi_exec_duration_seconds_count", &[]), 1.0);
    assert_eq!(
        get("tryboxi_vm_memory_bytes", &[("kind", "configured")]),
        512.0 * 1048576.0
    );
    assert!(get("tryboxi_vm_memory_bytes", &[("kind", "resident")]) > 0.0);
    assert_eq!(
        get("tryboxi_exec_output_bytes_total", &[("stream", "stdout")]),
        12.0
    );
    // Two syncs (the create's, the exec's); the first sent the one file.
    assert_eq!(get("tryboxi_syncs_total", &[]), 2.0);
    assert_eq!(get("tryboxi_sync_files_total", &[]), 1.0);
    assert_eq!(get("tryboxi_sync_bytes_total", &[]), 18.0);
    assert_eq!(get("tryboxi_errors_total", &[("kind", "sync_failed")]), 0.0);

    // The network: an allowed name over HTTP, a denied address, a denied name.
    let out = bash(
        &d,
        &id,
        "curl -sS --max-time 30 http://allowed.test/; \
         curl -sS --max-time 10 http://203.0.113.99/ || echo denied-fast; \
         getent hosts denied.test || echo no-such-name",
    );
    assert!(
        out.contains("hello\n") && out.contains("denied-fast") && out.contains("no-such-name"),
        "{out}"
    );
    // Every metric a dashboard panel queries is in /metrics after this life (the relayed bytes
    // are counted when the flow closes, a moment after curl is done).
    let panels = dashboard_metrics();
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    let samples = loop {
        let samples = parse_metrics(&d.request("GET", "/metrics", None).text());
        let down = sample(
            &samples,
            "tryboxi_network_bytes_total",
            &[("direction", "down")],
        );
        if down.is_some_and(|b| b > 0.0) || std::time::Instant::now() > deadline {
            break samples;
        }
        std::thread::sleep(Duration::from_millis(200));
    };
    let missing: Vec<&String> = panels
        .iter()
        .filter(|m| {
            !samples.iter().any(|s| {
                let n = s["name"].as_str().unwrap_or_default();
                n == m.as_str() || n.strip_prefix(m.as_str()).is_some_and(|r| r == "_bucket")
            })
        })
        .collect();
    assert!(
        missing.is_empty(),
        "dashboard panels query metrics never emitted: {missing:?}"
    );
    let get = |n: &str, l: &[(&str, &str)]| {
        sample(&samples, n, l).unwrap_or_else(|| panic!("no {n} {l:?} in {samples:?}"))
    };
    for verdict in ["allowed", "denied"] {
        assert!(
            get(
                "tryboxi_network_flows_total",
                &[("verdict", verdict), ("proto", "tcp")]
            ) >= 1.0,
            "{verdict}"
        );
    }
    assert!(
        get(
            "tryboxi_network_dns_queries_total",
            &[("outcome", "answered")]
        ) >= 1.0
    );
    assert!(
        get(
            "tryboxi_network_dns_queries_total",
            &[("outcome", "denied")]
        ) >= 1.0
    );
    assert!(get("tryboxi_network_bytes_total", &[("direction", "down")]) >= 6.0);
    assert!(get("tryboxi_network_bytes_total", &[("direction", "up")]) > 0.0);

    // OTLP: both traces (the sandbox's create, the exec) reached the collector as protobuf.
    let mut seen_names = String::new();
    while !(seen_names.contains("vm.boot") && seen_names.contains("output.flush")) {
        let (path, body) = exported
            .recv_timeout(Duration::from_secs(30))
            .unwrap_or_else(|_| panic!("no OTLP export; got {seen_names:?}\n{}", d.log_text()));
        assert_eq!(path, "/v1/traces");
        seen_names.push_str(&String::from_utf8_lossy(&body));
    }
    assert!(seen_names.contains(&id) && seen_names.contains("tryboxi"));

    // Remove: the last event of its life.
    let out = d.cli(&["rm", &id]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    // Before it: the network exec's events (its flows and the denied name among them).
    let mut kinds = Vec::new();
    let e = loop {
        let e = next_event(&events, &d);
        assert_eq!(e["sandbox_id"], id.as_str(), "{e}");
        if e["type"] == "sandbox.removed" {
            break e;
        }
        kinds.push(e["type"].as_str().unwrap().to_owned());
        assert!(kinds.len() < 64, "no sandbox.removed after {kinds:?}");
    };
    for k in [
        "exec.started",
        "network.allowed",
        "network.denied",
        "network.dns_denied",
        "exec.finished",
    ] {
        assert!(kinds.iter().any(|x| x == k), "no {k} in {kinds:?}");
    }
    assert_eq!(e["type"], "sandbox.removed");
    let r = d.request("GET", &format!("/v1/execs/{exe}/output"), None);
    assert_eq!(r.status, 404, "the log goes with its sandbox");
}
