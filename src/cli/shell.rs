//! `tryboxi shell ID`: an interactive login shell in the sandbox (`/bin/bash -l`, else
//! `/bin/sh -l`) on a pseudo-terminal of the local terminal's size; the session itself is
//! `cli/interactive.rs`.

use crate::api;
use crate::error::TopError;

#[derive(Debug, clap::Args)]
pub struct Args {
    /// Run as this guest user (e.g. `user`; default root).
    #[arg(short = 'u', long)]
    user: Option<String>,
    /// Working directory inside the VM (default /workspace).
    #[arg(long)]
    cwd: Option<String>,
    /// Extra environment variables.
    #[arg(short = 'e', long = "env", value_name = "KEY=VALUE")]
    env: Vec<String>,
    /// Sandbox id.
    id: String,
}

/// The shell: bash when the image has it, else sh; a login shell either way.
const SHELL: &str = "if [ -x /bin/bash ]; then exec /bin/bash -l; fi; exec /bin/sh -l";

pub async fn run(a: Args) -> Result<(), TopError> {
    let mut env = super::exec::terminal_env(true);
    for kv in a.env {
        let (k, v) = kv
            .split_once('=')
            .ok_or_else(|| TopError::Usage(format!("--env wants KEY=VALUE, got `{kv}`")))?;
        env.insert(k.to_owned(), v.to_owned());
    }
    let req = api::ExecRequest {
        argv: Some(vec!["/bin/sh".into(), "-c".into(), SHELL.into()]),
        cwd: a.cwd,
        env,
        user: a.user,
        tag: Some("shell".into()),
        pty: Some(super::interactive::local_size().unwrap_or(api::PtySize { rows: 24, cols: 80 })),
        ..Default::default()
    };
    super::interactive::run(&a.id, req).await
}
