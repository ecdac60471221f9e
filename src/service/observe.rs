//! Observability use cases: follow events, render metrics, read a trace, read an exec's output.
//! The recording itself happens through `Service::telemetry` hooks at each state change.

use std::time::Duration;

use super::{SandboxRecord, Service, ServiceError};
use crate::api::SandboxState;
use crate::store::{EXECS, SANDBOXES};
use crate::telemetry::events::Subscription;
use crate::telemetry::logs::{self, Stream};
use crate::telemetry::metrics;
use crate::telemetry::traces::Trace;

/// Longest a reader may wait for new output in one request.
const MAX_WAIT: Duration = Duration::from_secs(30);

/// `GET /v1/execs/{id}/output` parameters.
#[derive(Debug, Clone, PartialEq)]
pub struct OutputQuery {
    pub offset: u64,
    pub stream: Stream,
    pub strip_ansi: bool,
    /// When the reader is at the end of a running exec, wait this long for more.
    pub wait: Duration,
    pub max_bytes: usize,
}

impl Default for OutputQuery {
    fn default() -> Self {
        OutputQuery {
            offset: 0,
            stream: Stream::Output,
            strip_ansi: false,
            wait: Duration::ZERO,
            max_bytes: logs::MAX_READ,
        }
    }
}

use crate::api::ExecOutput;

impl Service {
    /// Events after `since` (`None`: from now on), live, optionally for one sandbox.
    pub fn follow_events(
        &self,
        since: Option<u64>,
        sandbox: Option<String>,
    ) -> Result<Subscription, ServiceError> {
        Ok(self.telemetry.events.subscribe(since, sandbox)?)
    }

    /// The Prometheus text exposition.
    pub fn metrics_text(&self) -> Result<String, ServiceError> {
        let recs: Vec<SandboxRecord> = self.store.list(SANDBOXES)?;
        let states = [
            SandboxState::Creating,
            SandboxState::Ready,
            SandboxState::Paused,
            SandboxState::Failed,
            SandboxState::Removing,
            SandboxState::Retired,
        ];
        let mut snap = metrics::Snapshot {
            sandboxes_by_state: states
                .iter()
                .map(|s| {
                    let label = match s {
                        SandboxState::Creating => "creating",
                        SandboxState::Ready => "ready",
                        SandboxState::Failed => "failed",
                        SandboxState::Removing => "removing",
                        SandboxState::Paused => "paused",
                        SandboxState::Retired => "retired",
                    };
                    (label, recs.iter().filter(|r| r.api.state == *s).count())
                })
                .collect(),
            ledger: {
                let v = self.ledger.view();
                let p = v.policy;
                // Memory capacity: the strict cap, else what VMs could ever count for.
                let mem_cap = p
                    .memory_cap
                    .or_else(|| v.host.total_mib.map(|t| p.mem.usable(t)))
                    .unwrap_or(0);
                Some((v.used.vcpus, p.vcpus, v.used.memory_mib, mem_cap, v.queued))
            },
            pool_ready: self.pool_ready(),
            store_cache_bytes: self.store.cache_bytes(),
            ..Default::default()
        };
        for r in recs.iter().filter(|r| r.api.state == SandboxState::Ready) {
            if let Some(vm) = self.vms.get(&r.api.id) {
                snap.vm_configured_bytes += u64::from(r.api.memory_mib) << 20;
                snap.vm_pids.push(vm.info.pid);
            }
        }
        metrics::render(&snap).ok_or_else(|| {
            ServiceError::Unavailable("metrics are not recorded in this process".into())
        })
    }

    /// The per-phase trace of a sandbox or an exec.
    pub fn trace(&self, id: &str) -> Result<Trace, ServiceError> {
        self.telemetry.traces.get(id).ok_or_else(|| {
            ServiceError::NotFound(format!(
                "no trace for `{id}` (traces are kept in memory: the newest {} since the daemon started)",
                crate::telemetry::traces::MAX_TRACES
            ))
        })
    }

    /// A piece of an exec's output log; waits up to `q.wait` for more when at the end of a
    /// running exec.
    pub async fn exec_output(
        &self,
        exec_id: &str,
        q: OutputQuery,
    ) -> Result<ExecOutput, ServiceError> {
        let max = q.max_bytes.clamp(1, logs::MAX_READ);
        let chunk = match self.telemetry.logs.live(exec_id) {
            Some(log) => {
                let mut watch = log.watch();
                let mut c = log.read(q.stream, q.offset, max);
                if c.data.is_empty() && c.running && !q.wait.is_zero() {
                    let deadline = tokio::time::Instant::now() + q.wait.min(MAX_WAIT);
                    while c.data.is_empty() && c.running {
                        if tokio::time::timeout_at(deadline, watch.changed())
                            .await
                            .is_err()
                        {
                            break;
                        }
                        c = log.read(q.stream, q.offset, max);
                    }
                }
                c
            }
            None => {
                let rec: super::exec::ExecRecord = self
                    .store
                    .get(EXECS, exec_id)?
                    .ok_or_else(|| ServiceError::NotFound(format!("no exec `{exec_id}`")))?;
                let dir = self
                    .paths
                    .sandbox_dir(&rec.sandbox_id)
                    .join("execs")
                    .join(exec_id);
                logs::read_finished(&dir, q.stream, q.offset, max).ok_or_else(|| {
                    ServiceError::NotFound(format!(
                        "the output of `{exec_id}` is gone (its sandbox `{}` was removed)",
                        rec.sandbox_id
                    ))
                })?
            }
        };
        let bytes = if q.strip_ansi {
            logs::strip_ansi(&chunk.data)
        } else {
            chunk.data
        };
        let (data, data_b64) = match String::from_utf8(bytes) {
            Ok(s) => (Some(s), None),
            Err(e) => (None, Some(crate::api::b64::encode(e.as_bytes()))),
        };
        Ok(ExecOutput {
            exec_id: exec_id.to_owned(),
            stream: q.stream,
            offset: chunk.offset,
            next_offset: chunk.next_offset,
            data,
            data_b64,
            running: chunk.running,
            truncated: chunk.truncated,
            eof: chunk.eof,
        })
    }
}
