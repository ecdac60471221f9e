//! `tryboxi sync ID`: send the host repo's changes into the sandbox now (exec does it too).

use crate::api;
use crate::error::TopError;

#[derive(Debug, clap::Args)]
pub struct Args {
    /// Sandbox id.
    id: String,
    /// Leave paths matching this `sync.exclude` pattern alone this time (not sent, not
    /// deleted in the VM). Repeatable.
    #[arg(long = "exclude", value_name = "PATTERN")]
    exclude: Vec<String>,
    /// Print the SyncReport as JSON.
    #[arg(long)]
    json: bool,
}

pub async fn run(a: Args) -> Result<(), TopError> {
    let client = super::client()?;
    let r: api::SyncReport = client
        .send(
            hyper::Method::POST,
            &format!("/v1/sandboxes/{}/sync", a.id),
            Some(&api::SyncRequest { exclude: a.exclude }),
        )
        .await?;
    if a.json {
        println!(
            "{}",
            serde_json::to_string_pretty(&r).map_err(|e| TopError::Other(e.into()))?
        );
        return Ok(());
    }
    println!(
        "sent {} file(s), {} bytes; deleted {}; unchanged {}; {} ms",
        r.files_sent, r.bytes_sent, r.deleted, r.unchanged, r.duration_ms
    );
    for s in &r.secrets_skipped {
        eprintln!("secret not synced: {s} (allow it with sync.allow_secrets)");
    }
    for s in &r.secret_values_skipped {
        eprintln!(
            "not synced: {} holds the value of the stored secret {}",
            s.path, s.secret
        );
    }
    Ok(())
}
