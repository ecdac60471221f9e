//! `tryboxi pause ID` and `tryboxi resume ID`.

use crate::api;
use crate::error::TopError;

pub async fn run(id: String, pause: bool) -> Result<(), TopError> {
    let verb = if pause { "pause" } else { "resume" };
    let s: api::Sandbox = super::client()?
        .send(
            hyper::Method::POST,
            &format!("/v1/sandboxes/{id}/{verb}"),
            None::<&()>,
        )
        .await?;
    println!("{} {}", s.id, s.state);
    Ok(())
}
