//! Bench row (m), issue 17: `Sandbox.create()` + `commands.run("true")` + `kill()` through the
//! official E2B Python SDK against the daemon's E2B face, vs the same three steps through our
//! native API (create without a workspace, exec `true`, rm), interleaved in the same run on the
//! same daemon. The SDK's own overhead is included, as a user meets it (Python start and imports
//! are not: each rep is timed inside the interpreter). Target: ratio <= 1.5.

use std::fmt::Write as _;
use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};

use crate::bench::{fmt, median, progress};
use crate::daemon::Daemon;
use crate::http;

pub const HEADING: &str = "## E2B SDK (issue 17)";

pub struct E2bRows {
    pub native: Vec<Duration>,
    pub sdk: Vec<Duration>,
    pub accel: String,
    pub load_before: String,
    pub load_after: String,
}

/// The SDK side: reads a rep count on argv, prints one duration (seconds) per rep.
const SDK_SCRIPT: &str = r#"
import sys, time
from e2b import Sandbox
for _ in range(int(sys.argv[1])):
    t = time.monotonic()
    s = Sandbox.create(template="base", timeout=600)
    s.commands.run("true")
    s.kill()
    print(time.monotonic() - t, flush=True)
"#;

fn native_once(sock: &Path) -> Result<Duration> {
    let t = Instant::now();
    let (status, body) = http::request(sock, "POST", "/v1/sandboxes", Some("{}"))?;
    if status != 201 && status != 200 {
        bail!("create: HTTP {status}: {body}");
    }
    let id = http::json_str(&body, "id").context("no id in the create answer")?;
    let exit = http::exec(sock, &id, r#"{"argv":["true"]}"#)?;
    if !exit.contains("\"exit_code\":0") {
        bail!("exec true: {exit}");
    }
    let (status, body) = http::request(sock, "DELETE", &format!("/v1/sandboxes/{id}"), None)?;
    if status != 200 {
        bail!("rm: HTTP {status}: {body}");
    }
    Ok(t.elapsed())
}

fn sdk_run(python: &Path, port: u16, token: &str, reps: usize) -> Result<Vec<Duration>> {
    let url = format!("http://127.0.0.1:{port}");
    let out = Command::new(python)
        .args(["-c", SDK_SCRIPT, &reps.to_string()])
        .env("E2B_API_URL", &url)
        .env("E2B_SANDBOX_URL", &url)
        .env("E2B_API_KEY", token)
        .env("NO_PROXY", "localhost,127.0.0.1")
        .output()
        .context("run the E2B SDK")?;
    if !out.status.success() {
        bail!(
            "the E2B SDK rep failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(|l| {
            l.trim()
                .parse::<f64>()
                .map(Duration::from_secs_f64)
                .with_context(|| format!("bad duration line `{l}`"))
        })
        .collect()
}

pub fn run(
    bin: &Path,
    home: &Path,
    artifacts: &Path,
    base_config: &str,
    reps: usize,
) -> Result<E2bRows> {
    let python = crate::deps::e2b_venv().join("bin/python3");
    if !python.exists() {
        bail!(
            "no E2B SDK venv at {}: run `cargo xtask deps`",
            python.display()
        );
    }
    let load_before = crate::bench::loadavg();
    let port = std::net::TcpListener::bind("127.0.0.1:0")?
        .local_addr()?
        .port();
    let config = format!("e2b_listen = \"127.0.0.1:{port}\"\n{base_config}");
    let d = Daemon::start(bin, home, artifacts, &config)?;
    let sock = d.socket();
    let token = std::fs::read_to_string(home.join("token"))
        .context("read the daemon's token")?
        .trim()
        .to_owned();
    println!(
        "  (m) E2B SDK create+run+kill vs native create+exec+rm, {reps} reps each, interleaved"
    );
    // One warm-up of each (first boot after the daemon starts pays the KVM/TCG probe).
    native_once(&sock)?;
    sdk_run(&python, port, &token, 1)?;
    let (mut native, mut sdk) = (Vec::new(), Vec::new());
    for _ in 0..reps {
        native.push(native_once(&sock)?);
        sdk.extend(sdk_run(&python, port, &token, 1)?);
    }
    progress("(m) native", &native);
    progress("(m) E2B SDK", &sdk);
    let (_, health) = http::request(&sock, "GET", "/v1/health", None)?;
    let accel = http::json_str(&health, "accel").unwrap_or_else(|| "?".into());
    d.stop()?;
    Ok(E2bRows {
        native,
        sdk,
        accel,
        load_before,
        load_after: crate::bench::loadavg(),
    })
}

pub fn section(r: &E2bRows, date: &str) -> Result<String> {
    let mut md = String::new();
    writeln!(md, "{HEADING}\n")?;
    writeln!(
        md,
        "Measured on {date}, accel **{}**; host load average at the start {}, at the end {}. \
         Native: `POST /v1/sandboxes` (no workspace), exec `true`, `DELETE`, over the unix \
         socket. SDK: `e2b==2.63.0`, unmodified, `Sandbox.create()` + `commands.run(\"true\")` + \
         `kill()` against `serve --e2b` (timed inside Python, so interpreter start and imports \
         are not counted). Interleaved, same daemon, same run.\n",
        r.accel, r.load_before, r.load_after
    )?;
    writeln!(
        md,
        "| what | reps | E2B SDK | native API | ratio | target |"
    )?;
    writeln!(md, "|---|---|---|---|---|---|")?;
    let (s, n) = (median(&r.sdk), median(&r.native));
    writeln!(
        md,
        "| (m) create + run `true` + kill, median | {} | {} | {} | {:.2} | <= 1.5 |\n",
        r.sdk.len(),
        fmt(s),
        fmt(n),
        s.as_secs_f64() / n.as_secs_f64().max(1e-9)
    )?;
    Ok(md)
}
