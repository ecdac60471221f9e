//! `tryboxi fork ID [--count N] [--from SNAPSHOT]`: prints one child id per line.

use crate::api;
use crate::error::TopError;

pub async fn run(id: String, count: u32, snapshot: Option<String>) -> Result<(), TopError> {
    let r: api::ForkResult = super::client()?
        .send(
            hyper::Method::POST,
            &format!("/v1/sandboxes/{id}/fork"),
            Some(&api::ForkRequest {
                count: Some(count),
                snapshot,
            }),
        )
        .await?;
    for s in &r.sandboxes {
        println!("{}", s.id);
    }
    eprintln!(
        "forked {} child(ren) of {} in {} ms",
        r.sandboxes.len(),
        r.parent,
        r.duration_ms
    );
    for e in &r.failed {
        eprintln!("error: a child could not be started: {e}");
    }
    if !r.failed.is_empty() {
        return Err(TopError::Other(anyhow::anyhow!(
            "{} of {count} children could not be started",
            r.failed.len()
        )));
    }
    Ok(())
}
