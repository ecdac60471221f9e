//! End to end for the network policy (issue 8), in one real VM behind one daemon: HTTPS to an
//! allowed name, SNI/Host tricks, DNS rebinding, the gateway and the host's loopback, and the
//! ask-to-allow round trip through the MCP face and the CLI.
//!
//! Everything the daemon connects to is on 127.0.0.1: `[network] test_hosts` answers the
//! allowed names with TEST-NET addresses, `test_upstream_map` sends those flows to servers in
//! this process (a rustls server with a test CA made by rcgen, plain HTTP servers), and
//! `upstream_dns` is a fake resolver here that answers names with addresses in the
//! always-blocked ranges. Every address a bug could make the daemon connect to is mapped to a
//! local listener too, so "the upstream never saw it" is a count that could be non-zero.
//!
//! One sandbox for the whole file (a boot costs seconds under TCG); the steps run in order in
//! one test and each says what failed.

mod common;
#[path = "network_policy/upstreams.rs"]
mod upstreams;

use std::collections::HashMap;
use std::io::{BufRead as _, BufReader, Write};
use std::os::unix::net::UnixStream;
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::mpsc::{self, Receiver};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::{
    BIN, Daemon, SMALL_VMS, artifacts, bash, create_with, follow_events, raw_http, wait_bounded,
};
use serde_json::{Value, json};
use upstreams::{BLOCKED_V4, Seen, fake_dns, host_listener, http_server, test_pki, tls_server};

// ---------------------------------------------------------------------------------------------
// The guest, events and the MCP face.

#[derive(Debug)]
struct Attempt {
    rc: i32,
    ms: u64,
    out: String,
}

/// Run each `(label, command)` in the guest (one exec), with its exit code and duration.
fn attempts(d: &Daemon, id: &str, cmds: &[(&str, &str)]) -> HashMap<String, Attempt> {
    let mut script = String::from(
        r#"t() { s=$(date +%s%N); "$@"; rc=$?; e=$(date +%s%N); echo; echo "@rc=$rc ms=$(( (e-s)/1000000 ))"; }; "#,
    );
    for (label, cmd) in cmds {
        script.push_str(&format!("echo '@@{label}'; t {cmd} 2>&1; "));
    }
    let out = bash(d, id, &script);
    let mut res = HashMap::new();
    for part in out.split("@@").skip(1) {
        let (label, rest) = part.split_once('\n').unwrap_or((part, ""));
        let (body, tail) = rest
            .rsplit_once("@rc=")
            .unwrap_or_else(|| panic!("{label}: no exit code in {out}"));
        let mut it = tail.split_whitespace();
        let rc = it.next().unwrap().parse().unwrap();
        let ms = it
            .next()
            .unwrap()
            .trim_start_matches("ms=")
            .parse()
            .unwrap();
        res.insert(
            label.to_owned(),
            Attempt {
                rc,
                ms,
                out: body.trim().to_owned(),
            },
        );
    }
    for (label, _) in cmds {
        assert!(res.contains_key(*label), "{label} did not run: {out}");
    }
    res
}

/// Failed (non-zero) and fast (< 3 s: a RST, never a timeout).
fn assert_fails_fast(a: &HashMap<String, Attempt>, label: &str) {
    let x = &a[label];
    assert!(x.rc != 0, "{label} succeeded: {x:?}");
    assert!(x.ms < 3000, "{label} took {} ms: {x:?}", x.ms);
}

/// The sandbox's events (backlog first), kept so that waiting for one never drops another.
struct Events {
    rx: Receiver<Value>,
    seen: Vec<Value>,
}

impl Events {
    fn wait(&mut self, what: &str, pred: impl Fn(&Value) -> bool) -> Value {
        if let Some(e) = self.seen.iter().find(|e| pred(e)) {
            return e.clone();
        }
        let deadline = Instant::now() + Duration::from_secs(15);
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            let e = self
                .rx
                .recv_timeout(left)
                .unwrap_or_else(|_| panic!("no event: {what}; seen:\n{}", pretty(&self.seen)));
            self.seen.push(e.clone());
            if pred(&e) {
                return e;
            }
        }
    }
}

fn pretty(v: &[Value]) -> String {
    v.iter().map(|e| format!("{e}\n")).collect()
}

/// A denied flow's event: type, ip, port.
fn denied(e: &Value, ip: &str, port: u16) -> bool {
    e["type"] == "network.denied" && e["data"]["ip"] == ip && e["data"]["port"] == port
}

/// An event's `data.reason`.
fn reason(e: Value) -> String {
    e["data"]["reason"].as_str().unwrap_or_default().to_owned()
}

/// `tryboxi mcp` over stdio, as a harness runs it.
struct Mcp {
    child: Child,
    stdin: ChildStdin,
    rx: Receiver<Value>,
    next_id: u64,
}

impl Mcp {
    fn start(d: &Daemon, workspace: &std::path::Path) -> Mcp {
        let log = std::fs::File::create(d.root().join("mcp.log")).unwrap();
        let mut child = Command::new(BIN)
            .arg("mcp")
            .env("TRYBOXI_HOME", d.root())
            .env("SANDBOX_WORKSPACE", workspace)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(log)
            .spawn()
            .expect("spawn tryboxi mcp");
        let stdin = child.stdin.take().unwrap();
        let stdout = child.stdout.take().unwrap();
        let (tx, rx) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines() {
                let Ok(line) = line else { return };
                let v: Value = serde_json::from_str(&line).expect("JSON-RPC line");
                if tx.send(v).is_err() {
                    return;
                }
            }
        });
        let mut m = Mcp {
            child,
            stdin,
            rx,
            next_id: 1,
        };
        let init = m.request(
            "initialize",
            json!({"protocolVersion": "2025-06-18", "capabilities": {},
                   "clientInfo": {"name": "network-policy-e2e", "version": "0"}}),
        );
        assert!(init["result"]["serverInfo"].is_object(), "{init}");
        m.send(json!({"jsonrpc": "2.0", "method": "notifications/initialized"}));
        m
    }

    fn send(&mut self, v: Value) {
        writeln!(self.stdin, "{v}").unwrap();
        self.stdin.flush().unwrap();
    }

    fn request(&mut self, method: &str, params: Value) -> Value {
        let id = self.next_id;
        self.next_id += 1;
        self.send(json!({"jsonrpc": "2.0", "id": id, "method": method, "params": params}));
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            let m = self
                .rx
                .recv_timeout(left)
                .unwrap_or_else(|e| panic!("no answer to {method} ({e})"));
            if m["id"] == json!(id) {
                return m;
            }
        }
    }

    /// `tools/call`: (is an error, text, structured content).
    fn call(&mut self, tool: &str, args: Value) -> (bool, String, Value) {
        let r = self.request("tools/call", json!({"name": tool, "arguments": args}));
        let res = &r["result"];
        assert!(res.is_object(), "{tool}: {r}");
        let text = res["content"][0]["text"].as_str().unwrap_or("").to_owned();
        (
            res["isError"] == true,
            text,
            res["structuredContent"].clone(),
        )
    }

    fn stop(mut self) {
        drop(self.stdin);
        let st = wait_bounded(&mut self.child, Duration::from_secs(20));
        assert!(st.success(), "tryboxi mcp exited with {st}");
    }
}

/// Parse `dnsq.py` lines: `DNS name TYPE rcode=N ips=a,b`.
fn dns_lines(out: &str) -> HashMap<String, (u8, Vec<String>)> {
    out.lines()
        .filter_map(|l| l.strip_prefix("DNS "))
        .map(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            let rcode = f[2].trim_start_matches("rcode=").parse().unwrap();
            let ips = f[3].trim_start_matches("ips=");
            let ips = if ips == "-" {
                Vec::new()
            } else {
                ips.split(',').map(str::to_owned).collect()
            };
            (format!("{}/{}", f[0], f[1]), (rcode, ips))
        })
        .collect()
}

/// Raw DNS from the guest to its resolver (10.0.2.2:53): A and AAAA alike, whatever the
/// guest's own address families (IPv6 is off, so glibc would not ask AAAA).
const DNSQ: &str = r#"import random, socket, struct, sys
def ask(name, qtype):
    q = struct.pack('>HHHHHH', random.randint(0, 65535), 0x0100, 1, 0, 0, 0)
    q += b''.join(bytes([len(l)]) + l.encode() for l in name.split('.')) + b'\0'
    q += struct.pack('>HH', qtype, 1)
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.settimeout(10)
    s.sendto(q, ('10.0.2.2', 53))
    r, _ = s.recvfrom(4096)
    i, ips = len(q), []
    for _ in range(struct.unpack('>H', r[6:8])[0]):
        if r[i] & 0xc0 == 0xc0:
            i += 2
        else:
            while r[i]:
                i += r[i] + 1
            i += 1
        t, _, _, n = struct.unpack('>HHIH', r[i:i + 10])
        i += 10
        if t in (1, 28):
            ips.append(socket.inet_ntop(socket.AF_INET if t == 1 else socket.AF_INET6, r[i:i + n]))
        i += n
    return r[3] & 15, ips
for arg in sys.argv[1:]:
    name, t = arg.split('/')
    rcode, ips = ask(name, {'A': 1, 'AAAA': 28}[t])
    print('DNS %s %s rcode=%d ips=%s' % (name, t, rcode, ','.join(ips) or '-'))
"#;

// ---------------------------------------------------------------------------------------------

/// The daemon, the sandbox and the local upstreams the steps share.
struct Env {
    d: Daemon,
    ws: tempfile::TempDir,
    id: String,
    ev: Events,
    tls: Arc<Seen>,
    web: Arc<Seen>,
    web2: Arc<Seen>,
    /// The counting listener on 0.0.0.0: its port, and what reached it.
    port: u16,
    host: Arc<Seen>,
    dns_log: Arc<Mutex<Vec<String>>>,
}

#[test]
fn network_policy_holds_against_a_real_guest() {
    let Some(art) = artifacts() else { return };
    let mut env = setup(&art);
    allowed_name_over_https_and_http(&mut env);
    sni_and_host_tricks_fail_fast_and_never_reach_the_upstream(&mut env);
    dns_rebinding_answers_never_reach_the_guest(&mut env);
    gateway_host_loopback_and_blocked_ranges_are_unreachable(&mut env);
    ask_to_allow_round_trip(&mut env);
    assert!(env.d.cli(&["rm", &env.id]).status.success());
}

fn setup(art: &std::path::Path) -> Env {
    let (ca_pem, tls_cfg) = test_pki();
    let (tls_addr, tls) = tls_server(tls_cfg, "hello-over-tls\n");
    let (web_addr, web) = http_server("hello-over-http\n");
    let (web2_addr, web2) = http_server("hello-from-allowed2\n");
    let (port, host) = host_listener();
    let (dns_addr, dns_log) = fake_dns();
    let local = format!("127.0.0.1:{port}");
    let cfg = format!(
        "{SMALL_VMS}[network]\ndefault_policy = []\nupstream_dns = \"{dns_addr}\"\n\
         [network.test_hosts]\n\"allowed.test\" = [\"203.0.113.10\"]\n\
         \"other.test\" = [\"203.0.113.11\"]\n\"allowed2.test\" = [\"203.0.113.12\"]\n\
         [network.test_upstream_map]\n\
         \"203.0.113.10:443\" = \"{tls_addr}\"\n\"203.0.113.11:443\" = \"{tls_addr}\"\n\
         \"203.0.113.13:443\" = \"{tls_addr}\"\n\"203.0.113.10:80\" = \"{web_addr}\"\n\
         \"203.0.113.11:80\" = \"{web_addr}\"\n\"203.0.113.12:80\" = \"{web2_addr}\"\n\
         \"10.0.2.2:{port}\" = \"{local}\"\n\"169.254.169.254:80\" = \"{local}\"\n\
         \"10.1.2.3:443\" = \"{local}\"\n\"192.168.1.1:{port}\" = \"{local}\"\n"
    );
    let d = Daemon::start(Some(&cfg), &["--artifacts", art.to_str().unwrap()]);
    let ws = tempfile::tempdir().unwrap();
    // `*.pem` is a secret the sync never sends; `.crt` is an ordinary file.
    std::fs::write(ws.path().join("ca.crt"), &ca_pem).unwrap();
    std::fs::write(ws.path().join("dnsq.py"), DNSQ).unwrap();
    let id = create_with(
        &d,
        ws.path(),
        &["--network", "allowed.test,other.test,*.rebind.test"],
    );
    let ev = Events {
        rx: follow_events(&d, &format!("?sandbox={id}")),
        seen: Vec::new(),
    };
    Env {
        d,
        ws,
        id,
        ev,
        tls,
        web,
        web2,
        port,
        host,
        dns_log,
    }
}

fn allowed_name_over_https_and_http(env: &mut Env) {
    let Env {
        d,
        id,
        ev,
        tls,
        web,
        ..
    } = env;
    // 1. An allowed name over HTTPS (the guest checks the test CA) and over HTTP; other.test
    //    is resolved too, which pins 203.0.113.11 for it (used in step 2).
    let out = bash(
        d,
        id,
        "curl -sS --max-time 30 --cacert /workspace/ca.crt https://allowed.test/tls; \
         curl -sS --max-time 30 http://allowed.test/plain; getent hosts other.test",
    );
    assert!(out.contains("hello-over-tls"), "HTTPS: {out}");
    assert!(out.contains("hello-over-http"), "HTTP: {out}");
    assert!(out.contains("203.0.113.11"), "other.test: {out}");
    let c = tls.since(0);
    assert!(
        c.iter().any(|c| c.sni.as_deref() == Some("allowed.test")
            && c.host.as_deref() == Some("allowed.test")),
        "the TLS server saw {c:?}"
    );
    let c = web.since(0);
    assert!(
        c.iter().any(|c| c.host.as_deref() == Some("allowed.test")),
        "{c:?}"
    );
    let e = ev.wait("network.allowed for allowed.test:443", |e| {
        e["type"] == "network.allowed"
            && e["data"]["ip"] == "203.0.113.10"
            && e["data"]["port"] == 443
    });
    assert_eq!(e["data"]["host"], "allowed.test", "{e}");
}

fn sni_and_host_tricks_fail_fast_and_never_reach_the_upstream(env: &mut Env) {
    let Env {
        d,
        id,
        ev,
        tls,
        web,
        ..
    } = env;
    // 2. An allowed SNI sent to another IP fails fast, and the upstream never sees a byte:
    //    to an address the resolver never answered (refused at SYN, no upstream connect at
    //    all), and to one it answered for another allowed name (refused on the ClientHello).
    let (t0, w0) = (tls.mark(), web.mark());
    let ca = "--cacert /workspace/ca.crt";
    let a = attempts(
        d,
        id,
        &[
            (
                "sni-unpinned",
                &format!(
                    "curl -sS --max-time 20 {ca} --resolve allowed.test:443:203.0.113.13 \
                     https://allowed.test/"
                ),
            ),
            (
                "sni-other-pin",
                &format!(
                    "curl -sS --max-time 20 {ca} --resolve allowed.test:443:203.0.113.11 \
                     https://allowed.test/"
                ),
            ),
            // 3. Host/SNI mismatches: a denied Host to an allowed name's IP (80), an allowed
            //    Host to another allowed name's IP (80), a denied SNI to an allowed name's IP.
            (
                "host-denied",
                "curl -sS --max-time 20 -H 'Host: denied.test' http://allowed.test/",
            ),
            (
                "host-other-pin",
                "curl -sS --max-time 20 -H 'Host: allowed.test' http://other.test/",
            ),
            (
                "sni-denied",
                &format!(
                    "curl -sS --max-time 20 {ca} --resolve denied.test:443:203.0.113.10 \
                     https://denied.test/"
                ),
            ),
        ],
    );
    for l in [
        "sni-unpinned",
        "sni-other-pin",
        "host-denied",
        "host-other-pin",
        "sni-denied",
    ] {
        assert_fails_fast(&a, l);
    }
    let c = tls.since(t0);
    assert!(
        c.iter().all(|c| c.bytes_in == 0),
        "a denied TLS flow reached the upstream: {c:?}"
    );
    // The two inspected flows connected upstream (connect-before-accept) and sent nothing;
    // the unpinned one never connected.
    assert_eq!(c.len(), 2, "{c:?}");
    let c = web.since(w0);
    assert!(
        c.iter().all(|c| c.bytes_in == 0 && c.host.is_none()),
        "a denied HTTP flow reached the upstream: {c:?}"
    );
    // Each denial is an event whose `host` is the name the guest sent (the one to ask for),
    // not whatever else the resolver pinned to that address.
    for (what, ip, port, host, why) in [
        (
            "unpinned 203.0.113.13",
            "203.0.113.13",
            443,
            None,
            "not answered by the sandbox resolver",
        ),
        (
            "allowed SNI to other.test's IP",
            "203.0.113.11",
            443,
            Some("allowed.test"),
            "allowed.test is allowed but",
        ),
        (
            "allowed Host to other.test's IP",
            "203.0.113.11",
            80,
            Some("allowed.test"),
            "allowed.test is allowed but",
        ),
        (
            "Host denied.test",
            "203.0.113.10",
            80,
            Some("denied.test"),
            "no rule allows denied.test:80",
        ),
        (
            "SNI denied.test",
            "203.0.113.10",
            443,
            Some("denied.test"),
            "no rule allows denied.test:443",
        ),
    ] {
        let e = ev.wait(&format!("deny: {what}"), |e| denied(e, ip, port));
        assert_eq!(e["data"]["host"].as_str(), host, "{what}: {e}");
        assert!(reason(e.clone()).contains(why), "{what}: {e}");
    }
}

fn dns_rebinding_answers_never_reach_the_guest(env: &mut Env) {
    let Env {
        d, id, ev, dns_log, ..
    } = env;
    // 4. DNS rebinding: upstream answers in every blocked range never reach the guest; a mixed
    //    answer keeps only its public address; denied names never leave the sandbox.
    let out = bash(
        d,
        id,
        "python3 /workspace/dnsq.py all.rebind.test/A all.rebind.test/AAAA \
         mixed.rebind.test/A mixed.rebind.test/AAAA exfil.denied.test/A exfil.denied.test/AAAA; \
         echo GETENT-ALL; getent ahostsv4 all.rebind.test; echo rc=$?; \
         echo GETENT-MIXED; getent ahostsv4 mixed.rebind.test; echo rc=$?",
    );
    let dns = dns_lines(&out);
    let nx = (3u8, Vec::<String>::new());
    assert_eq!(dns.get("all.rebind.test/A"), Some(&nx), "{out}");
    assert_eq!(dns.get("all.rebind.test/AAAA"), Some(&nx), "{out}");
    assert_eq!(dns.get("exfil.denied.test/A"), Some(&nx), "{out}");
    assert_eq!(dns.get("exfil.denied.test/AAAA"), Some(&nx), "{out}");
    assert_eq!(
        dns.get("mixed.rebind.test/A"),
        Some(&(0, vec!["203.0.113.20".to_owned()])),
        "{out}"
    );
    assert_eq!(
        dns.get("mixed.rebind.test/AAAA"),
        Some(&(0, vec!["2001:db8::20".to_owned()])),
        "{out}"
    );
    let getent_all = &out[out.find("GETENT-ALL").unwrap()..out.find("GETENT-MIXED").unwrap()];
    assert!(getent_all.contains("rc=2"), "{out}");
    let getent_mixed = &out[out.find("GETENT-MIXED").unwrap()..];
    assert!(getent_mixed.contains("203.0.113.20"), "{out}");
    for ip in BLOCKED_V4 {
        assert!(!out.contains(ip), "{ip} reached the guest: {out}");
    }
    for qtype in ["A", "AAAA"] {
        let e = ev.wait(
            &format!("rebinding event for all.rebind.test {qtype}"),
            |e| {
                e["type"] == "network.dns_denied"
                    && e["data"]["host"] == "all.rebind.test"
                    && e["data"]["qtype"] == qtype
            },
        );
        let r = reason(e);
        assert!(r.contains("rebinding"), "{r}");
        let (_, list) = r.split_once("(rebinding): ").expect("a list of addresses");
        let dropped: Vec<&str> = list.split("; ").collect();
        let expected: Vec<&str> = if qtype == "A" {
            BLOCKED_V4.to_vec()
        } else {
            // The IPv4-mapped address is judged (and reported) as its IPv4 address.
            vec!["::1", "fc00::1", "fe80::1", "127.0.0.1"]
        };
        assert_eq!(dropped.len(), expected.len(), "{r}");
        for (d, ip) in dropped.iter().zip(&expected) {
            assert!(
                d.starts_with(&format!("{ip} is ")),
                "{d} (expected {ip}): {r}"
            );
        }
    }
    ev.wait("network.dns_denied for exfil.denied.test", |e| {
        e["type"] == "network.dns_denied" && e["data"]["host"] == "exfil.denied.test"
    });
    let asked = dns_log.lock().unwrap().clone();
    assert!(
        asked.iter().any(|q| q == "all.rebind.test/AAAA"),
        "the fake resolver was never asked: {asked:?}"
    );
    assert!(
        !asked.iter().any(|q| q.contains("denied.test")),
        "a denied name left the sandbox as a DNS query: {asked:?}"
    );
}

fn gateway_host_loopback_and_blocked_ranges_are_unreachable(env: &mut Env) {
    let Env {
        d,
        id,
        ev,
        port,
        host,
        ..
    } = env;
    let port = *port;
    // 5. The gateway and the host's loopback are unreachable, and no rule opens the blocked
    //    ranges: even with explicit allow rules for them, every connect is refused at once.
    for target in ["169.254.169.254:80", "10.0.0.0/8", "192.168.1.1"] {
        let o = d.cli(&["net", "allow", id, target]);
        assert!(
            o.status.success(),
            "net allow {target}: {}",
            String::from_utf8_lossy(&o.stderr)
        );
    }
    let tcp = |ip: &str, p: u16| format!("timeout 20 bash -c 'exec 3<>/dev/tcp/{ip}/{p}'");
    let a = attempts(
        d,
        id,
        &[
            ("gateway", &tcp("10.0.2.2", port)),
            ("guest-lo", &tcp("127.0.0.1", port)),
            ("metadata", &tcp("169.254.169.254", 80)),
            ("private", &tcp("10.1.2.3", 443)),
            ("lan", &tcp("192.168.1.1", port)),
        ],
    );
    for l in ["gateway", "guest-lo", "metadata", "private", "lan"] {
        assert_fails_fast(&a, l);
        assert!(a[l].out.contains("Connection refused"), "{l}: {:?}", a[l]);
    }
    assert_eq!(
        host.mark(),
        0,
        "the host listener was reached from the guest"
    );
    let r = reason(ev.wait("deny: gateway port", |e| denied(e, "10.0.2.2", port)));
    assert!(r.contains("only answers DNS"), "{r}");
    for (ip, p) in [
        ("169.254.169.254", 80),
        ("10.1.2.3", 443),
        ("192.168.1.1", port),
    ] {
        let r = reason(ev.wait(&format!("deny: {ip}:{p}"), |e| denied(e, ip, p)));
        assert!(r.contains("always blocked"), "{ip}: {r}");
    }
}

fn ask_to_allow_round_trip(env: &mut Env) {
    let Env {
        d,
        ws,
        id,
        ev,
        web2,
        ..
    } = env;
    // 6. Ask to allow. allowed2.test is blocked: its name does not resolve and a hard-coded
    //    connect is refused; both leave an event.
    let a = attempts(
        d,
        id,
        &[
            ("lookup", "getent hosts allowed2.test"),
            (
                "direct",
                "curl -sS --max-time 20 --resolve allowed2.test:80:203.0.113.12 \
                 http://allowed2.test/",
            ),
        ],
    );
    assert_eq!(a["lookup"].rc, 2, "{:?}", a["lookup"]);
    assert_fails_fast(&a, "direct");
    ev.wait("network.dns_denied for allowed2.test", |e| {
        e["type"] == "network.dns_denied" && e["data"]["host"] == "allowed2.test"
    });
    let e = ev.wait("deny: allowed2.test hard-coded", |e| {
        denied(e, "203.0.113.12", 80)
    });
    assert!(
        e["data"]["hint"]
            .as_str()
            .is_some_and(|h| h.contains("request_network_access")),
        "{e}"
    );
    assert_eq!(
        web2.mark(),
        0,
        "a blocked flow reached allowed2.test's server"
    );

    // The agent asks through the MCP face. It has no tool to decide.
    let mut mcp = Mcp::start(d, ws.path());
    let tools = mcp.request("tools/list", json!({}));
    let names: Vec<&str> = tools["result"]["tools"]
        .as_array()
        .expect("tools")
        .iter()
        .filter_map(|t| t["name"].as_str())
        .collect();
    assert!(names.contains(&"request_network_access"), "{names:?}");
    assert!(
        !names
            .iter()
            .any(|n| n.contains("approve") || n.contains("reject") || n.contains("allow")),
        "{names:?}"
    );
    let ask = json!({"host": "allowed2.test", "reason": "e2e: fetch a fixture", "sandbox_id": id});
    let (err, text, asked) = mcp.call("request_network_access", ask.clone());
    assert!(!err, "request_network_access failed: {text}");
    let req = asked["request_id"].as_str().expect("request_id").to_owned();
    assert!(req.starts_with("req_"), "{asked}");
    assert_eq!(asked["state"], "pending", "{asked}");
    let (_, _, again) = mcp.call("request_network_access", ask);
    assert_eq!(again["request_id"], req.as_str(), "asking twice: {again}");
    // Refused outright: everything, a bare TLD, a public suffix, a blocked IP, and a name that
    // resolves into a blocked range (the fake resolver answers 127.0.0.1 for it).
    for host in [
        "*",
        "test",
        "*.test",
        "com",
        "169.254.169.254",
        "metadata.evil.test",
    ] {
        let (err, text, _) = mcp.call(
            "request_network_access",
            json!({"host": host, "reason": "e2e", "sandbox_id": id}),
        );
        assert!(err, "{host} was accepted: {text}");
        if host == "metadata.evil.test" {
            assert!(text.contains("always-blocked"), "{host}: {text}");
        }
    }
    mcp.stop();
    ev.wait("network.access_requested", |e| {
        e["type"] == "network.access_requested" && e["data"]["request_id"] == req.as_str()
    });
    let list = d.request("GET", &format!("/v1/sandboxes/{id}/network/requests"), None);
    let list = list.json();
    let reqs = list["requests"].as_array().expect("requests");
    assert_eq!(reqs.len(), 1, "refused requests were recorded: {list}");

    // The approve route refuses the MCP face; the request stays pending and the host blocked.
    let approve = format!("/v1/sandboxes/{id}/network/requests/{req}/approve");
    let mut s = UnixStream::connect(d.socket()).unwrap();
    let r = raw_http(
        &mut s,
        "POST",
        &approve,
        None,
        &[("Host", "localhost"), ("x-tryboxi-face", "mcp")],
    )
    .unwrap();
    assert_eq!(r.status, 403, "{}", r.text());
    assert_eq!(r.error_code(), "forbidden");
    let o = d.cli(&["net", "requests", id, "--json"]);
    let l: Value = serde_json::from_slice(&o.stdout).expect("requests JSON");
    assert_eq!(l["requests"][0]["state"], "pending", "{l}");
    let out = bash(d, id, "getent hosts allowed2.test; echo rc=$?");
    assert!(
        out.contains("rc=2"),
        "allowed2.test resolves before approval: {out}"
    );

    // The user approves from the CLI; the guest reaches allowed2.test's server.
    let o = d.cli(&["net", "approve", id, &req]);
    let said = String::from_utf8_lossy(&o.stdout);
    assert!(
        o.status.success() && said.contains("approved"),
        "net approve: {said}{}",
        String::from_utf8_lossy(&o.stderr)
    );
    ev.wait("network.access_decided", |e| {
        e["type"] == "network.access_decided" && e["data"]["state"] == "approved"
    });
    let out = bash(d, id, "curl -sS --max-time 30 http://allowed2.test/after");
    assert!(out.contains("hello-from-allowed2"), "after approval: {out}");
    let c = web2.since(0);
    assert!(
        c.len() == 1 && c[0].host.as_deref() == Some("allowed2.test"),
        "{c:?}"
    );
}
