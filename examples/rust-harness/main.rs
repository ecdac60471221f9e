//! An agent harness on the tryboxi Rust SDK (`tryboxi::client`): create a sandbox from a repo,
//! run the tests in the VM (output streamed as it comes), show what changed, and bring it back
//! with `--apply` (backed up first; the printed `art_...` id undoes it).
//!
//! ```sh
//! cargo run --example rust-harness -- --repo ~/code/app --test 'cargo test' [--apply]
//! ```
//!
//! Exit status: the test command's (so a CI step can use it), 2 for a usage error, 1 when
//! the daemon refused something.

use std::io::Write as _;
use std::process::ExitCode;

use futures_util::StreamExt as _;
use tryboxi::api;
use tryboxi::client::{Client, ClientError};

struct Args {
    repo: String,
    test: String,
    apply: bool,
    template: Option<String>,
}

const USAGE: &str = "usage: rust-harness --repo DIR --test 'CMD' [--apply] [--template NAME]";

fn parse_args() -> Result<Args, String> {
    let mut repo = None;
    let mut test = None;
    let mut apply = false;
    let mut template = None;
    let mut it = std::env::args().skip(1);
    while let Some(a) = it.next() {
        match a.as_str() {
            "--repo" => repo = it.next(),
            "--test" => test = it.next(),
            "--template" => template = it.next(),
            "--apply" => apply = true,
            "-h" | "--help" => return Err(USAGE.into()),
            other => return Err(format!("unknown argument `{other}`\n{USAGE}")),
        }
    }
    let repo = repo.ok_or_else(|| format!("--repo is required\n{USAGE}"))?;
    let repo = std::fs::canonicalize(&repo)
        .map_err(|e| format!("{repo}: {e}"))?
        .to_string_lossy()
        .into_owned();
    Ok(Args {
        repo,
        test: test.ok_or_else(|| format!("--test is required\n{USAGE}"))?,
        apply,
        template,
    })
}

/// Run the test command in the sandbox, streaming its output; its exit code.
async fn run_tests(client: &Client, id: &str, cmd: &str) -> Result<i32, ClientError> {
    let req = api::ExecRequest {
        cmd: Some(cmd.to_owned()),
        ..Default::default()
    };
    let mut events = client.exec(id, &req).await?.into_stream();
    let mut code = 1;
    while let Some(ev) = events.next().await {
        match ev? {
            api::ExecEvent::Stdout { data, data_b64 } => {
                let b = api::ExecEvent::output_bytes(&data, &data_b64).unwrap_or_default();
                let _ = std::io::stdout().write_all(&b);
            }
            api::ExecEvent::Stderr { data, data_b64 } => {
                let b = api::ExecEvent::output_bytes(&data, &data_b64).unwrap_or_default();
                let _ = std::io::stderr().write_all(&b);
            }
            api::ExecEvent::Exit {
                exit_code, signal, ..
            } => code = exit_code.unwrap_or(128 + signal.unwrap_or(0)),
            api::ExecEvent::Error { code, message } => {
                eprintln!("harness: exec failed: {code}: {message}");
            }
            api::ExecEvent::Started { .. } => {}
        }
    }
    Ok(code)
}

async fn harness(args: Args) -> Result<i32, ClientError> {
    let client = Client::discover()?;
    let create = api::CreateSandboxRequest {
        workspace: Some(api::WorkspaceSpec {
            host_path: args.repo.clone(),
            ..Default::default()
        }),
        template: args.template,
        ..Default::default()
    };
    let sbx = client.create(&create).await?;
    println!("harness: sandbox {} from {}", sbx.id, args.repo);
    let result = async {
        let code = run_tests(&client, &sbx.id, &args.test).await?;
        println!("harness: tests exited with {code}");
        let diff = client.diff(&sbx.id, true, &[]).await?;
        for f in &diff.files {
            println!(
                "harness: changed {} {:?} +{} -{}",
                f.path, f.kind, f.additions, f.deletions
            );
        }
        for r in &diff.refused {
            println!("harness: refused {r}");
        }
        if args.apply && !diff.files.is_empty() {
            let report = client.apply(&sbx.id, &api::ApplyRequest::default()).await?;
            println!(
                "harness: applied {} file(s), {} conflict(s); undo with artifact {}",
                report.applied.len(),
                report.conflicts.len(),
                report.artifact_id.as_deref().unwrap_or("-")
            );
        }
        Ok::<i32, ClientError>(code)
    }
    .await;
    // The sandbox is thrown away whatever happened.
    if let Err(e) = client.remove(&sbx.id).await {
        eprintln!("harness: removing {}: {e}", sbx.id);
    }
    result
}

fn main() -> ExitCode {
    let args = match parse_args() {
        Ok(a) => a,
        Err(m) => {
            eprintln!("{m}");
            return ExitCode::from(2);
        }
    };
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("a tokio runtime");
    match rt.block_on(harness(args)) {
        Ok(code) => ExitCode::from(code.clamp(0, 255) as u8),
        Err(e) => {
            eprintln!("harness: {e}");
            ExitCode::from(1)
        }
    }
}
