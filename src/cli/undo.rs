//! `tryboxi undo ART_ID`: restore what an apply or pull changed.

use crate::api;
use crate::error::TopError;

#[derive(Debug, clap::Args)]
pub struct Args {
    /// Backup id printed by apply/pull (`art_...`).
    art_id: String,
    /// Undo even though the host changed some of the paths since the apply (their current
    /// content is backed up first).
    #[arg(long)]
    force: bool,
}

pub async fn run(a: Args) -> Result<(), TopError> {
    let client = super::client()?;
    let r: api::UndoReport = client
        .send(
            hyper::Method::POST,
            &format!("/v1/artifacts/{}/undo", a.art_id),
            Some(&api::UndoRequest {
                force: a.force,
                within: Vec::new(),
            }),
        )
        .await?;
    for p in &r.overwritten {
        println!("overwrote host edit {p}");
    }
    if let Some(b) = &r.overwritten_backup {
        println!("host edits it overwrote are backed up in {b}");
    }
    for p in &r.restored {
        println!("restored {p}");
    }
    for p in &r.removed {
        println!("removed  {p}");
    }
    println!("{} undone", r.artifact_id);
    Ok(())
}
