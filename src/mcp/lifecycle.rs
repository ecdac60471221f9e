//! Checkpoints and the sandbox lifecycle for the model: `checkpoint`, `list_checkpoints`,
//! `restore`, `fork`, `pause`, on the daemon's snapshot, restore, fork and pause routes. Each
//! acts on a sandbox this server may use (see [`super::scope`]); the fork's copies work on the
//! same workspace, so they are in scope too.

use rmcp::model::CallToolResult;

use super::ToolError;
use super::server::{SandboxServer, json_result};
use super::tools::{CheckpointArgs, ForkArgs, MAX_FORKS, RestoreArgs, SandboxArgs};
use crate::api;

/// A checkpoint as the model sees it (the API calls it a snapshot).
fn checkpoint_view(s: &api::Snapshot) -> serde_json::Value {
    serde_json::json!({
        "checkpoint_id": s.id,
        "name": s.name,
        "sandbox_id": s.sandbox_id,
        "created_at": s.created_at,
    })
}

impl SandboxServer {
    /// `checkpoint`: snapshot the sandbox (created first if this workspace has none).
    pub(super) async fn checkpoint(&self, a: CheckpointArgs) -> Result<CallToolResult, ToolError> {
        let id = self.target_or_create(a.sandbox_id).await?;
        let req = api::SnapshotRequest {
            name: a.name,
            ..Default::default()
        };
        let s = (self.inner.client.snapshot(&id, &req).await).map_err(|e| {
            ToolError::from_client(
                e,
                "checkpoint",
                "POST /v1/sandboxes/{id}/snapshots",
                Some(&id),
            )
        })?;
        let mut v = checkpoint_view(&s);
        v["paused_ms"] = s.duration_ms.into();
        v["message"] = format!(
            "Checkpoint saved. Go back to it with restore(checkpoint=\"{}\").",
            s.name.as_deref().unwrap_or(&s.id)
        )
        .into();
        Ok(json_result(&v))
    }

    /// `list_checkpoints`.
    pub(super) async fn list_checkpoints(
        &self,
        a: SandboxArgs,
    ) -> Result<CallToolResult, ToolError> {
        let id = self.target(a.sandbox_id).await?;
        let l = (self.inner.client.snapshots(&id).await).map_err(|e| {
            ToolError::from_client(
                e,
                "list_checkpoints",
                "GET /v1/sandboxes/{id}/snapshots",
                Some(&id),
            )
        })?;
        let rows: Vec<_> = l.snapshots.iter().map(checkpoint_view).collect();
        Ok(json_result(
            &serde_json::json!({ "sandbox_id": id, "checkpoints": rows }),
        ))
    }

    /// `restore`.
    pub(super) async fn restore(&self, a: RestoreArgs) -> Result<CallToolResult, ToolError> {
        if a.checkpoint.trim().is_empty() {
            return Err(ToolError::InvalidArgs {
                tool: "restore".into(),
                message: "`checkpoint` is empty: give a name or id from `list_checkpoints`".into(),
            });
        }
        let id = self.target(a.sandbox_id).await?;
        let s = (self.inner.client.restore(&id, &a.checkpoint).await).map_err(|e| {
            ToolError::from_client(e, "restore", "POST /v1/sandboxes/{id}/restore", Some(&id))
        })?;
        Ok(json_result(&serde_json::json!({
            "sandbox_id": s.id,
            "state": s.state,
            "restored": a.checkpoint,
            "message": "The sandbox is as it was at the checkpoint (files, memory, processes). \
                        Commands that were running are gone. The next `exec` syncs the host \
                        repo's current files in again.",
        })))
    }

    /// `fork`.
    pub(super) async fn fork(&self, a: ForkArgs) -> Result<CallToolResult, ToolError> {
        let count = a.count.unwrap_or(1);
        if !(1..=MAX_FORKS).contains(&count) {
            return Err(ToolError::InvalidArgs {
                tool: "fork".into(),
                message: format!("`count` must be 1 to {MAX_FORKS}, got {count}"),
            });
        }
        let id = self.target(a.sandbox_id).await?;
        let req = api::ForkRequest {
            count: Some(count),
            snapshot: None,
        };
        let r = (self.inner.client.fork(&id, &req).await).map_err(|e| {
            ToolError::from_client(e, "fork", "POST /v1/sandboxes/{id}/fork", Some(&id))
        })?;
        let copies: Vec<_> = r
            .sandboxes
            .iter()
            .map(|s| serde_json::json!({ "sandbox_id": s.id, "state": s.state }))
            .collect();
        Ok(json_result(&serde_json::json!({
            "parent": r.parent,
            "sandboxes": copies,
            "failed": r.failed,
            "duration_ms": r.duration_ms,
            "message": "Pass a copy's `sandbox_id` to `exec` and the other tools; without it \
                        they keep using the original. `rm` the copies when done.",
        })))
    }

    /// `pause`.
    pub(super) async fn pause(&self, a: SandboxArgs) -> Result<CallToolResult, ToolError> {
        let id = self.target(a.sandbox_id).await?;
        let s = (self.inner.client.pause(&id).await).map_err(|e| {
            ToolError::from_client(e, "pause", "POST /v1/sandboxes/{id}/pause", Some(&id))
        })?;
        Ok(json_result(&serde_json::json!({
            "sandbox_id": s.id,
            "state": s.state,
            "message": "Paused to disk. The next tool that uses it resumes it (files and \
                        running processes as they were).",
        })))
    }
}
