//! `tryboxi rm ID...`: remove sandboxes.

use crate::api;
use crate::error::TopError;

#[derive(Debug, clap::Args)]
pub struct Args {
    /// Sandbox ids.
    #[arg(required = true)]
    ids: Vec<String>,
}

pub async fn run(a: Args) -> Result<(), TopError> {
    let client = super::client()?;
    for id in a.ids {
        let s: api::Sandbox = client
            .send::<(), _>(hyper::Method::DELETE, &format!("/v1/sandboxes/{id}"), None)
            .await?;
        println!("{} removed", s.id);
    }
    Ok(())
}
