//! `tryboxi pause [--filesystem] ID` and `tryboxi resume [--reboot] ID`.

use crate::api;
use crate::error::TopError;

pub async fn pause(id: String, keep_memory: bool) -> Result<(), TopError> {
    let s: api::Sandbox = super::client()?
        .send(
            hyper::Method::POST,
            &format!("/v1/sandboxes/{id}/pause"),
            Some(&api::PauseRequest { keep_memory }),
        )
        .await?;
    println!("{} {}", s.id, s.state);
    Ok(())
}

pub async fn resume(id: String, reboot: bool) -> Result<(), TopError> {
    let s: api::Sandbox = super::client()?
        .send(
            hyper::Method::POST,
            &format!("/v1/sandboxes/{id}/resume"),
            Some(&api::ResumeRequest { reboot }),
        )
        .await?;
    println!("{} {}", s.id, s.state);
    Ok(())
}
