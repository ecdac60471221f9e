//! `tryboxi pull ID PATH... [--force]`: copy selected paths from the sandbox, with a backup.

use crate::api;
use crate::error::TopError;

#[derive(Debug, clap::Args)]
pub struct Args {
    /// Sandbox id.
    id: String,
    /// Repo-relative paths (files or directories).
    #[arg(required = true)]
    paths: Vec<String>,
    /// Overwrite host files changed since the last sync.
    #[arg(long)]
    force: bool,
    /// Print the ApplyReport as JSON.
    #[arg(long)]
    json: bool,
}

pub async fn run(a: Args) -> Result<(), TopError> {
    let client = super::client()?;
    let req = api::ApplyRequest {
        paths: a.paths,
        force: a.force,
    };
    let r: api::ApplyReport = client
        .send(
            hyper::Method::POST,
            &format!("/v1/sandboxes/{}/pull", a.id),
            Some(&req),
        )
        .await?;
    super::apply::print_report(&r, a.json)
}
