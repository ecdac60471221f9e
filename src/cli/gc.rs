//! `tryboxi gc [--dry-run] [--json]`: delete what nothing needs any more (see `service/gc.rs`).

use crate::api;
use crate::error::TopError;

#[derive(Debug, clap::Args)]
pub struct Args {
    /// List what would be deleted, with sizes; delete nothing.
    #[arg(long)]
    dry_run: bool,
    /// Print the report as JSON.
    #[arg(long)]
    json: bool,
}

pub async fn run(a: Args) -> Result<(), TopError> {
    let r: api::GcReport = super::client()?
        .send(
            hyper::Method::POST,
            "/v1/gc",
            Some(&api::GcRequest { dry_run: a.dry_run }),
        )
        .await?;
    if a.json {
        println!(
            "{}",
            serde_json::to_string_pretty(&r).expect("serializable")
        );
    } else {
        for i in &r.items {
            let status = match (&i.error, r.dry_run) {
                (Some(e), _) => format!("FAILED: {e}"),
                (None, true) => "would delete".into(),
                (None, false) => "deleted".into(),
            };
            println!(
                "{:<13} {:>10}  {}  ({}) {status}",
                i.kind,
                human(i.bytes),
                i.path,
                i.reason
            );
        }
        let verb = if r.dry_run { "would free" } else { "freed" };
        println!("{} items, {verb} {}", r.items.len(), human(r.bytes));
    }
    if r.items.iter().any(|i| i.error.is_some()) {
        return Err(TopError::Other(anyhow::anyhow!("some deletions failed")));
    }
    Ok(())
}

fn human(b: u64) -> String {
    match b {
        b if b >= 1 << 30 => format!("{:.1} GiB", b as f64 / (1u64 << 30) as f64),
        b if b >= 1 << 20 => format!("{:.1} MiB", b as f64 / (1u64 << 20) as f64),
        b if b >= 1 << 10 => format!("{:.1} KiB", b as f64 / 1024.0),
        b => format!("{b} B"),
    }
}
