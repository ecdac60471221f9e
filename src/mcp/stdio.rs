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
