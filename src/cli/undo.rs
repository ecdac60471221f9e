//! `tryboxi undo ART_ID`: restore what an apply or pull changed.

use crate::api;
use crate::error::TopError;

#[derive(Debug, clap::Args)]
pub struct Args {
    /// Backup id printed by apply/pull (`art_...`).
    art_id: String,
}

pub async fn run(a: Args) -> Result<(), TopError> {
    let client = super::client()?;
    let r: api::UndoReport = client
        .send::<(), _>(
            hyper::Method::POST,
            &format!("/v1/artifacts/{}/undo", a.art_id),
            None,
        )
        .await?;
    for p in &r.restored {
        println!("restored {p}");
    }
    for p in &r.removed {
        println!("removed  {p}");
    }
    println!("{} undone", r.artifact_id);
    Ok(())
}
