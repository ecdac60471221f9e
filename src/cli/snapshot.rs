//! `tryboxi snapshot create|ls|rm` and `tryboxi restore`.

use crate::api;
use crate::error::TopError;

#[derive(Debug, clap::Subcommand)]
pub enum Cmd {
    /// Checkpoint a sandbox (memory, processes and disk); prints the snapshot id.
    Create {
        /// Sandbox id.
        id: String,
        #[arg(long)]
        name: Option<String>,
        /// The disk alone (E2B's mode "filesystem"): a restore or fork from it boots afresh
        /// on that disk, without the processes.
        #[arg(long)]
        filesystem: bool,
    },
    /// List a sandbox's snapshots.
    Ls {
        /// Sandbox id.
        id: String,
    },
    /// Delete a snapshot (sandboxes started from it keep running).
    Rm {
        /// Sandbox id.
        id: String,
        /// Snapshot id or name.
        snapshot: String,
    },
}

pub async fn run(cmd: Cmd) -> Result<(), TopError> {
    let client = super::client()?;
    match cmd {
        Cmd::Create {
            id,
            name,
            filesystem,
        } => {
            let s: api::Snapshot = client
                .send(
                    hyper::Method::POST,
                    &format!("/v1/sandboxes/{id}/snapshots"),
                    Some(&api::SnapshotRequest {
                        name,
                        keep_memory: !filesystem,
                    }),
                )
                .await?;
            if s.memory {
                println!(
                    "{} {} ({} ms, {} bytes of state)",
                    s.id,
                    s.name.as_deref().unwrap_or("-"),
                    s.duration_ms,
                    s.state_bytes
                );
            } else {
                println!(
                    "{} {} ({} ms, the disk alone)",
                    s.id,
                    s.name.as_deref().unwrap_or("-"),
                    s.duration_ms
                );
            }
        }
        Cmd::Rm { id, snapshot } => {
            let s = client.delete_snapshot(&id, &snapshot).await?;
            println!("{} deleted", s.id);
        }
        Cmd::Ls { id } => {
            let l: api::SnapshotList = client.get(&format!("/v1/sandboxes/{id}/snapshots")).await?;
            println!(
                "{:<22} {:<16} {:<20} {:>12}",
                "ID", "NAME", "CREATED", "STATE_BYTES"
            );
            for s in l.snapshots {
                println!(
                    "{:<22} {:<16} {:<20} {:>12}",
                    s.id,
                    s.name.as_deref().unwrap_or("-"),
                    s.created_at,
                    s.state_bytes
                );
            }
        }
    }
    Ok(())
}

/// `tryboxi restore ID SNAPSHOT`.
pub async fn restore(id: String, snapshot: String, reboot: bool) -> Result<(), TopError> {
    let s: api::Sandbox = super::client()?
        .send(
            hyper::Method::POST,
            &format!("/v1/sandboxes/{id}/restore"),
            Some(&api::RestoreRequest { snapshot, reboot }),
        )
        .await?;
    println!("{} {}", s.id, s.state);
    Ok(())
}
