//! Observability: the event log ([`events`]), per-phase traces ([`traces`], exported over
//! OTLP by [`otlp`] when configured), Prometheus metrics ([`metrics`]) and exec output logs
//! ([`logs`]).
//!
//! Owns: what is recorded and how it is kept (bounded). The service calls the small hooks on
//! [`Telemetry`] at each state change; the daemon serves what is kept.
//! Never: fails or slows the operation it observes (errors are logged, not returned), or
//! decides anything about sandboxes.

pub mod events;
pub mod logs;
pub mod metrics;
pub mod otlp;
pub mod traces;

use std::path::Path;
use std::sync::Arc;
use std::time::Instant;

use serde_json::json;

use crate::api;
use crate::store::Store;
use events::{EventBus, kind};
use logs::{ExecLog, ExecLogs};
use traces::Traces;

pub struct Telemetry {
    pub events: EventBus,
    pub traces: Traces,
    pub logs: ExecLogs,
    /// Cap per exec log file (`exec_log_max_bytes` in config.toml).
    pub exec_log_max_bytes: u64,
}

impl Telemetry {
    pub fn new(
        store: Arc<Store>,
        exec_log_max_bytes: u64,
        retention: &crate::config::TelemetryConfig,
        exporter: Option<Box<dyn traces::Exporter>>,
    ) -> Telemetry {
        metrics::install();
        let secs = std::time::Duration::from_secs;
        let events = events::Retention {
            max_count: retention.event_max_count,
            max_age: (retention.event_max_age_days > 0)
                .then(|| secs(retention.event_max_age_days.saturating_mul(86_400))),
        };
        Telemetry {
            events: EventBus::with_retention(store, events),
            traces: Traces::with_retention(
                exporter,
                retention.trace_max_count,
                (retention.trace_max_age_s > 0).then(|| secs(retention.trace_max_age_s)),
            ),
            logs: ExecLogs::default(),
            exec_log_max_bytes,
        }
    }

    /// A create was accepted: its record exists. `t0` is when the request arrived (the
    /// `scheduler.reserve` phase: validation, images, acceleration, directory).
    pub fn sandbox_created(&self, sb: &api::Sandbox, t0: Instant) {
        self.traces.record(&sb.id, "scheduler.reserve", t0, &[]);
        self.events.publish(
            kind::SANDBOX_CREATED,
            &sb.id,
            None,
            json!({"vcpus": sb.vcpus, "memory_mib": sb.memory_mib, "accel": sb.accel,
                   "workspace": sb.workspace.as_ref().map(|w| &w.host_path)}),
        );
    }

    /// The VM booted and its agent answered; `boot_start` is when the boot began.
    pub fn sandbox_ready(&self, sb: &api::Sandbox, boot_start: Instant) {
        let secs = boot_start.elapsed().as_secs_f64();
        let accel = sb.accel.clone().unwrap_or_else(|| "unknown".into());
        ::metrics::counter!(metrics::CREATES, "outcome" => "ok").increment(1);
        ::metrics::histogram!(metrics::BOOT_SECONDS, "accel" => accel).record(secs);
        self.events.publish(
            kind::SANDBOX_READY,
            &sb.id,
            None,
            json!({"boot_ms": (secs * 1000.0) as u64}),
        );
        self.traces.finish(&sb.id);
    }

    /// A create failed (its VM and directory are discarded next).
    pub fn sandbox_create_failed(&self, id: &str, error: &str) {
        ::metrics::counter!(metrics::CREATES, "outcome" => "error").increment(1);
        metrics::error(metrics::ErrorKind::BootFailed);
        self.events
            .publish(kind::SANDBOX_FAILED, id, None, json!({"error": error}));
        self.traces.finish(id);
    }

    /// A ready sandbox failed (its VM died, its agent link broke, or it was lost over a restart).
    pub fn sandbox_failed(&self, id: &str, reason: &str) {
        metrics::error(metrics::ErrorKind::SandboxFailed);
        self.events
            .publish(kind::SANDBOX_FAILED, id, None, json!({"error": reason}));
    }

    /// A sandbox's VM, directory and record are gone.
    pub fn sandbox_removed(&self, id: &str) {
        self.events
            .publish(kind::SANDBOX_REMOVED, id, None, serde_json::Value::Null);
    }

    /// An exec's command runs. `requested` is when the request arrived (the `exec.spawn` phase
    /// ends now); its output log goes to `<sandbox_dir>/execs/<exec_id>/`.
    pub fn exec_started(
        self: &Arc<Self>,
        sandbox_id: &str,
        exec_id: &str,
        command: &[String],
        sandbox_dir: &Path,
        requested: Instant,
    ) -> ExecObserver {
        self.traces.record(exec_id, "exec.spawn", requested, &[]);
        self.events.publish(
            kind::EXEC_STARTED,
            sandbox_id,
            Some(exec_id),
            json!({"command": command}),
        );
        let dir = sandbox_dir.join("execs").join(exec_id);
        ExecObserver {
            tel: self.clone(),
            sandbox_id: sandbox_id.to_owned(),
            exec_id: exec_id.to_owned(),
            log: self.logs.start(exec_id, &dir, self.exec_log_max_bytes),
            running_since: Instant::now(),
        }
    }
}

/// Follows one exec: its output into the log, its end into events, metrics and its trace.
pub struct ExecObserver {
    tel: Arc<Telemetry>,
    sandbox_id: String,
    exec_id: String,
    log: Arc<ExecLog>,
    running_since: Instant,
}

/// How an exec ended, for [`ExecObserver::finished`].
#[derive(Debug, Default, Clone)]
pub struct ExecEnd<'a> {
    pub exit_code: Option<i32>,
    pub signal: Option<i32>,
    pub timed_out: bool,
    pub error: Option<&'a str>,
}

impl ExecObserver {
    /// The exec's output log (readable after the end too).
    pub fn log(&self) -> Arc<ExecLog> {
        self.log.clone()
    }

    pub fn output(&self, stderr: bool, bytes: &[u8]) {
        let stream = if stderr { "stderr" } else { "stdout" };
        ::metrics::counter!(metrics::EXEC_OUTPUT_BYTES, "stream" => stream)
            .increment(bytes.len() as u64);
        self.log.write(stderr, bytes);
    }

    pub fn finished(self, end: ExecEnd<'_>) {
        let run = self.running_since.elapsed();
        let outcome = match (&end.error, end.timed_out, end.signal, end.exit_code) {
            (Some(_), ..) => "error",
            (None, true, ..) => "timeout",
            (None, false, Some(_), _) => "signal",
            (None, false, None, Some(0)) => "ok",
            _ => "nonzero",
        };
        let mut attrs = vec![("outcome", outcome.to_owned())];
        if let Some(c) = end.exit_code {
            attrs.push(("exit_code", c.to_string()));
        }
        self.tel
            .traces
            .record(&self.exec_id, "exec", self.running_since, &attrs);
        {
            let _flush = self.tel.traces.span(&self.exec_id, "output.flush");
            self.tel.logs.end(&self.exec_id);
        }
        ::metrics::counter!(metrics::EXECS, "outcome" => outcome).increment(1);
        ::metrics::histogram!(metrics::EXEC_SECONDS).record(run.as_secs_f64());
        if end.error.is_some() {
            metrics::error(metrics::ErrorKind::ExecLost);
        }
        self.tel.events.publish(
            kind::EXEC_FINISHED,
            &self.sandbox_id,
            Some(&self.exec_id),
            json!({"exit_code": end.exit_code, "signal": end.signal, "timed_out": end.timed_out,
                   "error": end.error, "outcome": outcome, "duration_ms": run.as_millis() as u64}),
        );
        self.tel.traces.finish(&self.exec_id);
    }
}
