//! `tryboxi logs EXE_ID [--grep PATTERN] [--stream stdout|stderr] [-f]`: an exec's kept output
//! (from `GET /v1/execs/{id}/output`), whole or only the lines matching a regex.

use std::io::Write as _;

use crate::api::ExecOutput;
use crate::error::TopError;

#[derive(Debug, clap::Args)]
pub struct Args {
    /// The exec id (`exe_…`, printed in `tryboxi events`).
    id: String,
    /// Only lines matching this regular expression (ANSI escapes are stripped first).
    #[arg(long, value_name = "PATTERN")]
    grep: Option<String>,
    /// `stdout`, `stderr`, or `output` (both, interleaved as they came; the default).
    #[arg(long, default_value = "output")]
    stream: String,
    /// Keep following a running exec until it ends.
    #[arg(short, long)]
    follow: bool,
    /// Remove ANSI escape sequences (colors).
    #[arg(long)]
    strip_ansi: bool,
}

pub async fn run(a: Args) -> Result<(), TopError> {
    let re = a
        .grep
        .as_deref()
        .map(regex::Regex::new)
        .transpose()
        .map_err(|e| TopError::Usage(format!("--grep: {e}")))?;
    let strip = a.strip_ansi || re.is_some();
    let client = super::client()?;
    let mut offset = 0u64;
    let mut pending = String::new();
    let mut out = std::io::stdout().lock();
    let mut truncated = false;
    loop {
        let wait = if a.follow { 10_000 } else { 0 };
        let chunk: ExecOutput = client
            .get(&format!(
                "/v1/execs/{}/output?offset={offset}&stream={}&strip_ansi={strip}&wait_ms={wait}",
                a.id, a.stream
            ))
            .await?;
        truncated |= chunk.truncated;
        let bytes = match (&chunk.data, &chunk.data_b64) {
            (Some(s), _) => s.as_bytes().to_vec(),
            (None, Some(b)) => crate::api::b64::decode(b)
                .map_err(|m| TopError::Other(anyhow::anyhow!("bad output from the daemon: {m}")))?,
            (None, None) => Vec::new(),
        };
        let got = !bytes.is_empty();
        offset = chunk.next_offset;
        let end = chunk.eof || (!a.follow && !got);
        match &re {
            None => out.write_all(&bytes),
            Some(re) => {
                pending.push_str(&String::from_utf8_lossy(&bytes));
                let upto = if end {
                    pending.len()
                } else {
                    pending.rfind('\n').map_or(0, |i| i + 1)
                };
                let done: String = pending.drain(..upto).collect();
                let mut r = Ok(());
                for line in done.lines().filter(|l| re.is_match(l)) {
                    r = r.and_then(|_| writeln!(out, "{line}"));
                }
                r
            }
        }
        .and_then(|_| out.flush())
        .map_err(|e| TopError::Other(e.into()))?;
        if end {
            break;
        }
    }
    if truncated {
        eprintln!("tryboxi: the output was longer than exec_log_max_bytes; the rest was not kept");
    }
    Ok(())
}
