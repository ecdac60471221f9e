//! JSON-RPC over stdio: newline-delimited messages, served by `rmcp`.
//!
//! `rmcp` silently drops lines that are not JSON (as the other official SDKs do). JSON-RPC 2.0
//! says such input gets a `-32700 Parse error` response with `id: null`, and a client author
//! debugging a broken frame is better served by an answer than by silence, so a thin shim sits
//! between the real stdin/stdout and `rmcp`: it answers unparsable lines itself and passes every
//! other line through unchanged. It never writes half a line: `rmcp`'s output and its own
//! answers are interleaved only at line boundaries.

use rmcp::ServiceExt as _;
use tokio::io::{
    AsyncBufReadExt as _, AsyncRead, AsyncReadExt as _, AsyncWrite, AsyncWriteExt as _, BufReader,
};
use tokio::sync::mpsc;

/// Longest accepted input line (a `write_file` of a large file arrives as one line).
const MAX_LINE: usize = 64 << 20;
/// Buffer of each in-process pipe between the shim and `rmcp`.
const PIPE: usize = 1 << 20;

#[derive(Debug, thiserror::Error)]
pub enum ServeError {
    #[error("MCP session could not start: {0}")]
    Start(String),
    #[error("MCP session ended with an error: {0}")]
    Run(String),
    #[error("stdio broke: {0}")]
    Io(#[from] std::io::Error),
}

/// The `-32700` answer for a line that is not JSON.
pub fn parse_error_line(err: &serde_json::Error) -> String {
    let v = serde_json::json!({
        "jsonrpc": "2.0",
        "id": null,
        "error": {"code": -32700, "message": format!("Parse error: {err}")},
    });
    format!("{v}\n")
}

/// Serve `handler` over a pair of byte streams until `input` ends (or `output` breaks).
pub async fn serve<H, R, W>(handler: H, input: R, output: W) -> Result<(), ServeError>
where
    H: rmcp::ServerHandler,
    R: AsyncRead + Unpin + Send + 'static,
    W: AsyncWrite + Unpin + Send + 'static,
{
    let (to_rmcp, rmcp_in) = tokio::io::duplex(PIPE);
    let (rmcp_out, from_rmcp) = tokio::io::duplex(PIPE);
    let (answers_tx, answers_rx) = mpsc::unbounded_channel::<String>();

    let reader = tokio::spawn(pump_input(input, to_rmcp, answers_tx));
    let writer = tokio::spawn(pump_output(from_rmcp, answers_rx, output));

    let result = match handler.serve((rmcp_in, rmcp_out)).await {
        Ok(running) => running
            .waiting()
            .await
            .map(|_| ())
            .map_err(|e| ServeError::Run(e.to_string())),
        Err(e) => Err(ServeError::Start(e.to_string())),
    };
    // `rmcp` has dropped its pipe ends: the writer drains what is left and ends.
    reader.abort();
    match writer.await {
        Ok(Ok(())) => {}
        Ok(Err(e)) => tracing::debug!(error = %e, "stdout closed"),
        Err(e) => tracing::warn!(error = %e, "stdout writer task failed"),
    }
    result
}

/// stdin -> `rmcp`, answering lines that are not JSON with `-32700`.
async fn pump_input<R: AsyncRead + Unpin>(
    input: R,
    mut to_rmcp: tokio::io::DuplexStream,
    answers: mpsc::UnboundedSender<String>,
) -> std::io::Result<()> {
    let mut input = BufReader::new(input);
    let mut line = Vec::new();
    loop {
        line.clear();
        let n = (&mut input)
            .take(MAX_LINE as u64 + 1)
            .read_until(b'\n', &mut line)
            .await?;
        if n == 0 {
            return Ok(()); // EOF: dropping `to_rmcp` ends the session
        }
        if line.len() > MAX_LINE && line.last() != Some(&b'\n') {
            // Skip the rest of the oversized line, then answer it.
            let mut rest = Vec::new();
            input.read_until(b'\n', &mut rest).await?;
            let e = serde_json::Error::io(std::io::Error::other(format!(
                "message longer than {MAX_LINE} bytes"
            )));
            let _ = answers.send(parse_error_line(&e));
            continue;
        }
        let body = line.trim_ascii();
        if body.is_empty() {
            continue;
        }
        if let Err(e) = serde_json::from_slice::<serde::de::IgnoredAny>(body)
            && matches!(
                e.classify(),
                serde_json::error::Category::Syntax | serde_json::error::Category::Eof
            )
        {
            tracing::debug!(error = %e, "unparsable JSON-RPC line");
            let _ = answers.send(parse_error_line(&e));
            continue;
        }
        to_rmcp.write_all(body).await?;
        to_rmcp.write_all(b"\n").await?;
    }
}

/// `rmcp`'s output and the shim's own answers -> stdout, whole lines only.
async fn pump_output<W: AsyncWrite + Unpin>(
    from_rmcp: tokio::io::DuplexStream,
    mut answers: mpsc::UnboundedReceiver<String>,
    mut output: W,
) -> std::io::Result<()> {
    let mut from_rmcp = BufReader::new(from_rmcp);
    let mut line = Vec::new();
    let mut rmcp_open = true;
    let mut answers_open = true;
    while rmcp_open || answers_open {
        tokio::select! {
            n = from_rmcp.read_until(b'\n', &mut line), if rmcp_open => {
                if n? == 0 {
                    rmcp_open = false;
                    // The session is over: answers for lines still in flight are moot.
                    answers_open = false;
                } else {
                    output.write_all(&line).await?;
                    output.flush().await?;
                    line.clear();
                }
            }
            a = answers.recv(), if answers_open => match a {
                Some(a) => {
                    output.write_all(a.as_bytes()).await?;
                    output.flush().await?;
                }
                None => answers_open = false,
            },
        }
    }
    if !line.is_empty() {
        output.write_all(&line).await?;
    }
    output.flush().await
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use serde_json::{Value, json};
    use tokio::io::{AsyncBufReadExt as _, AsyncWriteExt as _, BufReader, DuplexStream, Lines};

    use super::*;
    use crate::mcp::{Options, SandboxServer};

    /// A client on the other end of an in-process pipe; the daemon socket does not exist.
    struct Peer {
        tx: DuplexStream,
        rx: Lines<BufReader<DuplexStream>>,
        _dir: tempfile::TempDir,
    }

    impl Peer {
        fn start(allow_apply: bool) -> Peer {
            let dir = tempfile::tempdir().unwrap();
            let mut opts = Options::new(dir.path().join("no-daemon.sock"), dir.path().into());
            opts.allow_apply = allow_apply;
            let (tx, server_in) = tokio::io::duplex(1 << 16);
            let (server_out, rx) = tokio::io::duplex(1 << 16);
            tokio::spawn(serve(SandboxServer::new(opts), server_in, server_out));
            Peer {
                tx,
                rx: BufReader::new(rx).lines(),
                _dir: dir,
            }
        }

        async fn send_raw(&mut self, line: &str) {
            self.tx.write_all(line.as_bytes()).await.unwrap();
            self.tx.write_all(b"\n").await.unwrap();
        }

        async fn send(&mut self, v: Value) {
            self.send_raw(&v.to_string()).await;
        }

        /// The next message (bounded wait).
        async fn recv(&mut self) -> Value {
            let line = tokio::time::timeout(Duration::from_secs(10), self.rx.next_line())
                .await
                .expect("server answered within 10 s")
                .unwrap()
                .expect("server still open");
            serde_json::from_str(&line).unwrap()
        }

        async fn request(&mut self, id: u64, method: &str, params: Value) -> Value {
            self.send(json!({"jsonrpc": "2.0", "id": id, "method": method, "params": params}))
                .await;
            loop {
                let m = self.recv().await;
                if m["id"] == json!(id) {
                    return m;
                }
            }
        }

        async fn initialize(&mut self, version: &str) -> Value {
            let r = self
                .request(
                    0,
                    "initialize",
                    json!({"protocolVersion": version, "capabilities": {},
                           "clientInfo": {"name": "unit", "version": "0"}}),
                )
                .await;
            self.send(json!({"jsonrpc": "2.0", "method": "notifications/initialized"}))
                .await;
            r
        }
    }

    #[tokio::test]
    async fn initialize_negotiates_each_supported_version() {
        for v in ["2025-03-26", "2025-06-18", "2025-11-25"] {
            let mut p = Peer::start(true);
            let r = p.initialize(v).await;
            assert_eq!(r["result"]["protocolVersion"], v, "{r}");
            assert_eq!(r["result"]["serverInfo"]["name"], "tryboxi");
            assert!(r["result"]["capabilities"]["tools"].is_object(), "{r}");
            assert!(
                r["result"]["instructions"]
                    .as_str()
                    .unwrap()
                    .contains("exec")
            );
        }
    }

    #[tokio::test]
    async fn unknown_version_gets_the_newest_handshake_version() {
        let mut p = Peer::start(true);
        let r = p.initialize("1999-01-01").await;
        assert_eq!(r["result"]["protocolVersion"], "2025-11-25", "{r}");
    }

    #[tokio::test]
    async fn discover_offers_the_stateless_2026_version() {
        let mut p = Peer::start(true);
        let meta = json!({
            "io.modelcontextprotocol/protocolVersion": "2026-07-28",
            "io.modelcontextprotocol/clientInfo": {"name": "unit", "version": "0"},
            "io.modelcontextprotocol/clientCapabilities": {},
        });
        let r = p
            .request(1, "server/discover", json!({"_meta": meta}))
            .await;
        let versions = r["result"]["supportedVersions"]
            .as_array()
            .expect("versions");
        for v in ["2026-07-28", "2025-11-25", "2025-06-18", "2025-03-26"] {
            assert!(versions.iter().any(|x| x == v), "{v} not offered: {r}");
        }
        // A request of that era, without any initialize: the tools are there.
        let r = p.request(2, "tools/list", json!({"_meta": meta})).await;
        assert!(
            r["result"]["tools"]
                .as_array()
                .is_some_and(|t| t.len() >= 8),
            "{r}"
        );
    }

    #[tokio::test]
    async fn unknown_method_is_method_not_found() {
        let mut p = Peer::start(true);
        p.initialize("2025-06-18").await;
        let r = p.request(7, "sandbox/teleport", json!({})).await;
        assert_eq!(r["error"]["code"], -32601, "{r}");
    }

    #[tokio::test]
    async fn malformed_json_is_a_parse_error_and_the_session_goes_on() {
        let mut p = Peer::start(true);
        p.initialize("2025-06-18").await;
        p.send_raw(r#"{"jsonrpc":"2.0","id":5,"method":"ping""#)
            .await;
        let r = p.recv().await;
        assert_eq!(r["error"]["code"], -32700, "{r}");
        assert_eq!(r["id"], Value::Null, "{r}");
        let pong = p.request(6, "ping", json!({})).await;
        assert_eq!(pong["result"], json!({}), "{pong}");
    }

    #[tokio::test]
    async fn tools_list_has_object_schemas_and_no_apply_hides_apply() {
        let mut p = Peer::start(true);
        p.initialize("2025-06-18").await;
        let r = p.request(1, "tools/list", json!({})).await;
        let tools = r["result"]["tools"].as_array().unwrap();
        let names: Vec<&str> = tools.iter().map(|t| t["name"].as_str().unwrap()).collect();
        for n in [
            "create",
            "exec",
            "read_output",
            "diff",
            "apply",
            "pull",
            "undo",
            "read_file",
            "write_file",
            "list",
            "rm",
        ] {
            assert!(names.contains(&n), "{n} missing from {names:?}");
        }
        for t in tools {
            assert_eq!(t["inputSchema"]["type"], "object", "{t}");
            assert!(
                t["description"].as_str().is_some_and(|d| !d.is_empty()),
                "{t}"
            );
        }
        let exec = tools.iter().find(|t| t["name"] == "exec").unwrap();
        assert_eq!(exec["inputSchema"]["required"], json!(["cmd"]));
        assert_eq!(
            exec["inputSchema"]["properties"]["timeout_s"]["type"],
            json!(["number", "null"])
        );

        let mut p = Peer::start(false);
        p.initialize("2025-06-18").await;
        let r = p.request(1, "tools/list", json!({})).await;
        let names: Vec<String> = r["result"]["tools"]
            .as_array()
            .unwrap()
            .iter()
            .map(|t| t["name"].as_str().unwrap().to_owned())
            .collect();
        assert!(
            !names.iter().any(|n| n == "apply" || n == "pull"),
            "{names:?}"
        );
        let refused = p
            .request(2, "tools/call", json!({"name": "apply", "arguments": {}}))
            .await;
        assert_eq!(refused["result"]["isError"], true, "{refused}");
        assert!(
            refused["result"]["content"][0]["text"]
                .as_str()
                .unwrap()
                .contains("--no-apply")
        );
    }

    #[tokio::test]
    async fn tool_call_without_a_daemon_is_a_tool_error_saying_how_to_start_it() {
        let mut p = Peer::start(true);
        p.initialize("2025-06-18").await;
        let r = p
            .request(
                3,
                "tools/call",
                json!({"name": "exec", "arguments": {"cmd": "echo hi"}}),
            )
            .await;
        assert_eq!(r["result"]["isError"], true, "{r}");
        let text = r["result"]["content"][0]["text"].as_str().unwrap();
        assert!(text.contains("tryboxi serve"), "{text}");
        let bad = p
            .request(
                4,
                "tools/call",
                json!({"name": "exec", "arguments": {"command": "ls"}}),
            )
            .await;
        assert_eq!(bad["result"]["isError"], true, "{bad}");
        let unknown = p
            .request(
                5,
                "tools/call",
                json!({"name": "teleport", "arguments": {}}),
            )
            .await;
        assert_eq!(unknown["error"]["code"], -32602, "{unknown}");
    }

    /// A stand-in daemon on the server's socket: every request gets `sandbox` (a sandbox whose
    /// workspace is `/`); the request lines it saw are returned by the handle.
    fn fake_daemon(socket: &std::path::Path) -> std::sync::Arc<std::sync::Mutex<Vec<String>>> {
        fake_daemon_listing(socket, None)
    }

    fn fake_daemon_listing(
        socket: &std::path::Path,
        listed_ws: Option<String>,
    ) -> std::sync::Arc<std::sync::Mutex<Vec<String>>> {
        let seen = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
        let l = tokio::net::UnixListener::bind(socket).unwrap();
        let s2 = seen.clone();
        tokio::spawn(async move {
            while let Ok((mut c, _)) = l.accept().await {
                let seen = s2.clone();
                let listed_ws = listed_ws.clone();
                tokio::spawn(async move {
                    let mut buf = vec![0u8; 8192];
                    let n = tokio::io::AsyncReadExt::read(&mut c, &mut buf)
                        .await
                        .unwrap_or(0);
                    let head = String::from_utf8_lossy(&buf[..n]);
                    let line = head.lines().next().unwrap_or("").to_owned();
                    seen.lock().unwrap().push(line.clone());
                    let sandbox = |id: &str, ws: &str| {
                        json!({"id": id, "state": "ready",
                        "workspace": {"host_path": ws}, "template": "base", "vcpus": 1,
                        "memory_mib": 512, "accel": null, "created_at": "2026-01-01T00:00:00Z"})
                    };
                    // The list holds a sandbox on `/` (another client's) and one on
                    // `listed_ws`, if any.
                    let body = if line.starts_with("GET /v1/execs/") {
                        // An exec of the sandbox on `/`.
                        json!({"id": "exe_0000000000000001", "sandbox_id": "sbx_0000000000000001",
                        "pid": 7, "command": ["sh"], "cwd": null, "tag": null,
                        "started_at": "2026-01-01T00:00:00Z", "running": true})
                    } else if line.starts_with("GET /v1/sandboxes ") {
                        let mut all = vec![sandbox("sbx_0000000000000001", "/")];
                        if let Some(ws) = &listed_ws {
                            all.push(sandbox("sbx_0000000000000002", ws));
                        }
                        json!({ "sandboxes": all })
                    } else {
                        sandbox("sbx_0000000000000001", "/")
                    }
                    .to_string();
                    let resp = format!(
                        "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n\
                         content-length: {}\r\nconnection: close\r\n\r\n{body}",
                        body.len()
                    );
                    let _ = c.write_all(resp.as_bytes()).await;
                });
            }
        });
        seen
    }

    /// The model may only use the default workspace, folders below it and those the user
    /// allowed; a sandbox it names must work on one of those. Refused before the daemon acts.
    #[tokio::test]
    async fn the_model_cannot_pick_a_workspace_outside_the_allowed_folders() {
        let dir = tempfile::tempdir().unwrap();
        let ws = dir.path().join("repo");
        std::fs::create_dir_all(ws.join("sub")).unwrap();
        std::os::unix::fs::symlink("/", ws.join("escape")).unwrap();
        let sock = dir.path().join("d.sock");
        let seen = fake_daemon(&sock);
        let opts = Options::new(sock, ws.clone());
        let (tx, server_in) = tokio::io::duplex(1 << 16);
        let (server_out, rx) = tokio::io::duplex(1 << 16);
        tokio::spawn(serve(SandboxServer::new(opts), server_in, server_out));
        let mut p = Peer {
            tx,
            rx: BufReader::new(rx).lines(),
            _dir: tempfile::tempdir().unwrap(),
        };
        p.initialize("2025-06-18").await;
        let home = std::env::var("HOME").unwrap_or_else(|_| "/root".into());
        let escape = ws.join("escape").display().to_string();
        let parent = ws.join("..").display().to_string();
        for (i, w) in [
            "/",
            home.as_str(),
            "/etc",
            escape.as_str(),
            parent.as_str(),
            "../",
        ]
        .into_iter()
        .enumerate()
        {
            let r = p
                .request(
                    10 + i as u64,
                    "tools/call",
                    json!({"name": "create", "arguments": {"workspace": w}}),
                )
                .await;
            assert_eq!(r["result"]["isError"], true, "{w}: {r}");
            let text = r["result"]["content"][0]["text"].as_str().unwrap();
            assert!(text.contains("--allow-workspace"), "{w}: {text}");
        }
        assert!(
            seen.lock().unwrap().is_empty(),
            "no create reached the daemon: {:?}",
            seen.lock().unwrap()
        );
        let tools = [
            "apply",
            "exec",
            "diff",
            "rm",
            "checkpoint",
            "list_checkpoints",
            "restore",
            "fork",
            "pause",
            "expose_port",
        ];
        for (i, tool) in tools.into_iter().enumerate() {
            let mut args = json!({"sandbox_id": "sbx_0000000000000001"});
            match tool {
                "exec" => args["cmd"] = "true".into(),
                "restore" => args["checkpoint"] = "x".into(),
                "expose_port" => args["port"] = 3000.into(),
                _ => {}
            }
            let r = p
                .request(
                    20 + i as u64,
                    "tools/call",
                    json!({"name": tool, "arguments": args}),
                )
                .await;
            assert_eq!(r["result"]["isError"], true, "{tool}: {r}");
            let text = r["result"]["content"][0]["text"].as_str().unwrap();
            assert!(text.contains("--allow-workspace"), "{tool}: {text}");
        }
        // A background exec (its output, stopping it) of a sandbox out of scope is refused too,
        // after the exec's sandbox was looked up.
        for (i, tool) in ["exec_output", "stop_exec"].into_iter().enumerate() {
            let r = p
                .request(
                    40 + i as u64,
                    "tools/call",
                    json!({"name": tool, "arguments": {"exec_id": "exe_0000000000000001"}}),
                )
                .await;
            assert_eq!(r["result"]["isError"], true, "{tool}: {r}");
            let text = r["result"]["content"][0]["text"].as_str().unwrap();
            assert!(text.contains("--allow-workspace"), "{tool}: {text}");
        }
        let seen = seen.lock().unwrap().clone();
        assert!(
            seen.iter().all(|l| {
                l.starts_with("GET /v1/sandboxes/sbx_0000000000000001 ")
                    || l.starts_with("GET /v1/execs/exe_0000000000000001 ")
            }),
            "only the sandbox and the exec were looked up: {seen:?}"
        );
    }

    /// `list` shows only the sandboxes whose workspace this server may use: not another
    /// client's sandbox on `/` (or the user's home).
    #[tokio::test]
    async fn list_shows_only_sandboxes_of_the_allowed_folders() {
        let dir = tempfile::tempdir().unwrap();
        let ws = dir.path().join("repo");
        std::fs::create_dir_all(ws.join("sub")).unwrap();
        let sock = dir.path().join("d.sock");
        let _seen = fake_daemon_listing(&sock, Some(ws.join("sub").display().to_string()));
        let opts = Options::new(sock, ws.clone());
        let (tx, server_in) = tokio::io::duplex(1 << 16);
        let (server_out, rx) = tokio::io::duplex(1 << 16);
        tokio::spawn(serve(SandboxServer::new(opts), server_in, server_out));
        let mut p = Peer {
            tx,
            rx: BufReader::new(rx).lines(),
            _dir: tempfile::tempdir().unwrap(),
        };
        p.initialize("2025-06-18").await;
        let r = p
            .request(2, "tools/call", json!({"name": "list", "arguments": {}}))
            .await;
        let text = r["result"]["content"][0]["text"].as_str().unwrap();
        let v: Value = serde_json::from_str(text).unwrap();
        let ids: Vec<&str> = v["sandboxes"]
            .as_array()
            .unwrap()
            .iter()
            .map(|s| s["id"].as_str().unwrap())
            .collect();
        assert_eq!(ids, ["sbx_0000000000000002"], "{text}");
    }
}
