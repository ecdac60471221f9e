//! Exec use case: run a command in a sandbox's VM and stream its events.
//!
//! The command runs in its own process group in the guest. Unless it was started detached,
//! the whole group is killed when the caller goes away (the HTTP client disconnects): no
//! attached command outlives its caller unseen. A detached one runs on, listed and attachable
//! (`execs.rs`), until it ends or its sandbox goes.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};
use tokio::sync::mpsc;

use super::execs::{self, LiveExec};
use super::{Service, ServiceError};
use crate::api;
use crate::ids;
use crate::rpc::{self, RpcError};
use crate::store::EXECS;

/// Longest exec tag.
pub const MAX_TAG: usize = 256;

/// What the store keeps per exec.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ExecRecord {
    pub id: String,
    pub sandbox_id: String,
    pub command: Vec<String>,
    pub started_at: String,
    #[serde(default)]
    pub exit_code: Option<i32>,
    #[serde(default)]
    pub signal: Option<i32>,
    #[serde(default)]
    pub timed_out: bool,
    #[serde(default)]
    pub duration_ms: Option<u64>,
    #[serde(default)]
    pub error: Option<String>,
    #[serde(default)]
    pub pid: Option<u32>,
    #[serde(default)]
    pub cwd: Option<String>,
    /// The request's own environment.
    #[serde(default)]
    pub env: BTreeMap<String, String>,
    #[serde(default)]
    pub tag: Option<String>,
    #[serde(default)]
    pub pty: bool,
    #[serde(default)]
    pub detached: bool,
    #[serde(default)]
    pub user: Option<String>,
}

impl ExecRecord {
    /// As listed; `running` until the end is recorded.
    pub fn info(&self) -> api::ExecInfo {
        api::ExecInfo {
            id: self.id.clone(),
            sandbox_id: self.sandbox_id.clone(),
            pid: self.pid,
            command: self.command.clone(),
            cwd: self.cwd.clone(),
            env: self.env.clone(),
            tag: self.tag.clone(),
            pty: self.pty,
            detached: self.detached,
            user: self.user.clone(),
            started_at: self.started_at.clone(),
            running: self.duration_ms.is_none() && self.error.is_none(),
            exit_code: self.exit_code,
            signal: self.signal,
            timed_out: self.timed_out,
            error: self.error.clone(),
        }
    }

    /// The last event of an ended exec.
    pub fn end_event(&self) -> api::ExecEvent {
        match (&self.error, self.duration_ms) {
            (None, Some(duration_ms)) => api::ExecEvent::Exit {
                exit_code: self.exit_code,
                signal: self.signal,
                timed_out: self.timed_out,
                duration_ms,
            },
            (Some(e), _) => api::ExecEvent::Error {
                code: "exec_ended".into(),
                message: e.clone(),
            },
            (None, None) => api::ExecEvent::Error {
                code: "exec_lost".into(),
                message: "the exec's end was never recorded (the daemon stopped while it ran)"
                    .into(),
            },
        }
    }
}

impl Service {
    /// Start a command; events (`started`, output, then `exit` or `error`) arrive on the receiver.
    /// Honours `detach` (the command outlives the receiver), `pty`, `user`, `stdin_open`, `tag`.
    pub async fn start_exec(
        &self,
        id: &str,
        req: api::ExecRequest,
    ) -> Result<mpsc::Receiver<api::ExecEvent>, ServiceError> {
        // The lifecycle lock is held until the command has started (resume on use, sync);
        // the command's output stream then holds only the VM (a remove ends it with `vm_lost`).
        let mut wire = to_wire(&req, self.config.exec_timeout_s)?;
        // No stored value enters a VM: not in the command, the env or stdin.
        self.refuse_exec_values(id, &wire)?;
        let slot = self.execs.reserve(id, execs::MAX_LIVE_PER_SANDBOX)?;
        let (life, rec, vm) = self.ready_vm(id).await?;
        // Every exec sees the sandbox's secrets as `NAME=<placeholder>` (read now: a secret
        // added to the running sandbox shows up in the next exec). The caller's own env comes
        // after and wins.
        let mut env = self.secret_env(id);
        // The guest trusts the host's local CAs and, with secrets, the sandbox's interception
        // CA (written again when the VM or the CAs changed); every TLS client is told where
        // the bundle is. A sandbox with nothing to add is left alone.
        env.extend(self.guest_trust_env(id, &vm, !env.is_empty()).await);
        env.append(&mut wire.env);
        wire.env = env;
        // The exec's id comes first: the sync is the first span of its trace.
        let exec_id = ids::new_id(ids::EXEC);
        // The VM sees the host repo as it is now (one-way delta sync).
        if let Err(e) = (self.sync_before_exec(&rec, &vm, &req.sync_exclude, &exec_id)).await {
            // The exec never starts: its trace ends with the failed sync.
            self.telemetry.traces.finish(&exec_id);
            return Err(e);
        }
        let started = Instant::now();
        let stdin_so_far = wire.stdin.clone().unwrap_or_default();
        let mut stream = match vm.agent.exec(wire).await {
            Ok(s) => s,
            Err(RpcError::Remote(e)) => {
                return Err(ServiceError::BadRequest(format!(
                    "cannot start the command: {e}"
                )));
            }
            Err(e) => {
                return Err(ServiceError::Unavailable(format!(
                    "cannot reach the sandbox's agent: {e}"
                )));
            }
        };
        let mut exec_rec = ExecRecord {
            id: exec_id.clone(),
            sandbox_id: id.to_owned(),
            command: req.argv.clone().unwrap_or_else(|| {
                vec![
                    "/bin/sh".into(),
                    "-c".into(),
                    req.cmd.clone().unwrap_or_default(),
                ]
            }),
            started_at: super::now_rfc3339(),
            exit_code: None,
            signal: None,
            timed_out: false,
            duration_ms: None,
            error: None,
            pid: stream.pid(),
            cwd: req.cwd.clone(),
            env: req.env.clone(),
            tag: req.tag.clone(),
            pty: req.pty.is_some(),
            detached: req.detach,
            user: req.user.clone(),
        };
        drop(life);
        self.store.put(EXECS, &exec_id, &exec_rec)?;
        let obs = self
            .telemetry
            .exec_started(id, &exec_id, &exec_rec.command, &rec.dir, started);
        tracing::info!(sandbox = %id, exec = %exec_id, pid = ?exec_rec.pid, detached = req.detach,
            pty = req.pty.is_some(), user = ?req.user, "exec started");
        let live = LiveExec::new(
            exec_rec.info(),
            Some(stream.control()),
            req.stdin_open,
            &stdin_so_far,
            Some(obs.log()),
        );
        slot.fill(live.clone());
        // A sandbox running a command is never "idle" for the memory pressure ranking.
        self.ledger.busy(id, 1);
        let ledger = self.ledger.clone();
        let sandbox_id = id.to_owned();
        // A detached exec's caller is one more follower; an attached one's caller owns it.
        let (primary, rx) = if req.detach {
            (None, execs::follow(&live, false))
        } else {
            let (tx, rx) = mpsc::channel(64);
            let _ = tx.try_send(api::ExecEvent::Started {
                exec_id: exec_id.clone(),
                sandbox_id: id.to_owned(),
                pid: exec_rec.pid,
            });
            (Some(tx), rx)
        };
        let store = self.store.clone();
        // Held while the command runs: a VM in use is never idle-paused (`service/pause.rs`).
        let mut in_use = Some(vm.clone());
        let registry = self.execs.clone();
        let weak_svc = self.life.weak();
        tokio::spawn(async move {
            let watch = primary.clone();
            let primary_gone = async {
                match &watch {
                    Some(tx) => tx.closed().await,
                    None => std::future::pending().await,
                }
            };
            tokio::pin!(primary_gone);
            let last = loop {
                let ev = tokio::select! {
                    ev = stream.next() => ev,
                    _ = &mut primary_gone => {
                        tracing::info!(exec = %exec_rec.id, "caller went away; killing the command");
                        let _ = stream.kill(libc::SIGKILL).await;
                        break gone();
                    }
                };
                let (stderr, b) = match ev {
                    Some(Ok(rpc::ExecEvent::Started { .. })) => continue,
                    Some(Ok(rpc::ExecEvent::Stdout(b))) => (false, b),
                    Some(Ok(rpc::ExecEvent::Stderr(b))) => (true, b),
                    Some(Ok(rpc::ExecEvent::Exit {
                        code,
                        signal,
                        timed_out,
                    })) => {
                        let duration_ms = started.elapsed().as_millis() as u64;
                        exec_rec.exit_code = code;
                        exec_rec.signal = signal;
                        exec_rec.timed_out = timed_out;
                        exec_rec.duration_ms = Some(duration_ms);
                        break api::ExecEvent::Exit {
                            exit_code: code,
                            signal,
                            timed_out,
                            duration_ms,
                        };
                    }
                    other => {
                        let e = match other {
                            Some(Err(e)) => e,
                            _ => RpcError::Disconnected,
                        };
                        // A pause breaks the link; the command may run on after the resume.
                        // Only a detached exec waits for that: an attached one's caller is
                        // not left waiting for a resume that may never come.
                        let old = in_use
                            .take()
                            .map(|v| Arc::downgrade(&v))
                            .unwrap_or_default();
                        let back = match &weak_svc {
                            Some(svc) if exec_rec.detached => {
                                execs::reattach_exec(
                                    svc,
                                    &sandbox_id,
                                    &old,
                                    stream.exec_id(),
                                    stream.next_seq(),
                                )
                                .await
                            }
                            _ => None,
                        };
                        match back {
                            Some((s, vm)) => {
                                tracing::info!(exec = %exec_rec.id, "re-attached to the command after its sandbox resumed");
                                stream = s;
                                live.set_control(stream.control());
                                in_use = Some(vm);
                                continue;
                            }
                            None => break lost(&e),
                        }
                    }
                };
                let out = api::ExecEvent::output(stderr, &b);
                live.publish(out.clone(), || obs.output(stderr, &b));
                if let Some(tx) = &primary
                    && tx.send(out).await.is_err()
                {
                    let _ = stream.kill(libc::SIGKILL).await;
                    break gone();
                }
            };
            if let api::ExecEvent::Error { message, .. } = &last {
                exec_rec.error = Some(message.clone());
            }
            tracing::info!(exec = %exec_rec.id, exit_code = ?exec_rec.exit_code, signal = ?exec_rec.signal,
                timed_out = exec_rec.timed_out, error = ?exec_rec.error, "exec finished");
            if let Err(e) = store.put(EXECS, &exec_rec.id, &exec_rec) {
                tracing::warn!(error = %e, "cannot record the exec's end");
            }
            ledger.busy(&sandbox_id, -1);
            obs.finished(crate::telemetry::ExecEnd {
                exit_code: exec_rec.exit_code,
                signal: exec_rec.signal,
                timed_out: exec_rec.timed_out,
                error: exec_rec.error.as_deref(),
            });
            live.finish(last.clone());
            registry.remove(&exec_rec.id);
            if let Some(tx) = primary {
                let _ = tx.send(last).await;
            }
        });
        Ok(rx)
    }
}

/// The caller of an attached exec went away.
fn gone() -> api::ExecEvent {
    api::ExecEvent::Error {
        code: "caller_gone".into(),
        message: "the caller disconnected; the command was killed".into(),
    }
}

fn lost(e: &RpcError) -> api::ExecEvent {
    api::ExecEvent::Error {
        code: "vm_lost".into(),
        message: format!("the command's VM or agent was lost before it finished: {e}"),
    }
}

/// Validate an API exec request and turn it into the agent's request.
pub(super) fn to_wire(
    req: &api::ExecRequest,
    default_timeout_s: u64,
) -> Result<rpc::ExecRequest, ServiceError> {
    let bad = |m: String| Err(ServiceError::BadRequest(m));
    let mut w = rpc::ExecRequest::default();
    match (&req.cmd, &req.argv) {
        (Some(_), Some(_)) => return bad("give either `cmd` or `argv`, not both".into()),
        (None, None) => return bad("give `cmd` (a shell string) or `argv`".into()),
        (None, Some(a)) if a.is_empty() => return bad("`argv` is empty".into()),
        (Some(c), None) if c.trim().is_empty() => return bad("`cmd` is empty".into()),
        (Some(c), None) => w.shell = Some(c.clone()),
        (None, Some(a)) => w.argv = a.clone(),
    }
    let timeout = match req.timeout_s {
        Some(t) if !(t > 0.0 && t.is_finite() && t < 1e9) => {
            return bad(format!(
                "timeout_s must be a positive number of seconds, got {t}"
            ));
        }
        Some(t) => Some(Duration::from_secs_f64(t)),
        None if default_timeout_s > 0 => Some(Duration::from_secs(default_timeout_s)),
        None => None,
    };
    w.timeout = timeout;
    if let Some(cwd) = &req.cwd {
        if !cwd.starts_with('/') {
            return bad(format!(
                "cwd must be an absolute path inside the VM, got `{cwd}`"
            ));
        }
        w.cwd = Some(cwd.clone());
    }
    for (k, v) in &req.env {
        if k.is_empty() || k.contains('=') || k.contains('\0') || v.contains('\0') {
            return bad(format!("invalid environment variable name or value: `{k}`"));
        }
        w.env.push((k.clone(), v.clone()));
    }
    if let Some(p) = &req.pty {
        p.check().map_err(ServiceError::BadRequest)?;
        w.pty = Some(rpc::msg::PtySize {
            rows: p.rows,
            cols: p.cols,
        });
    }
    if let Some(u) = &req.user {
        if !rpc::msg::valid_user_name(u) {
            return bad(format!(
                "invalid user name `{u}` (at most {} bytes of [a-z_][a-z0-9_-]*)",
                rpc::msg::MAX_USER_NAME
            ));
        }
        w.user = Some(u.clone());
    }
    if let Some(t) = &req.tag
        && t.len() > MAX_TAG
    {
        return bad(format!("tag is {} bytes; at most {MAX_TAG}", t.len()));
    }
    w.keep_stdin_open = req.stdin_open;
    w.stdin = match (&req.stdin_b64, &req.stdin) {
        (Some(b), _) => Some(
            api::b64::decode(b).map_err(|e| ServiceError::BadRequest(format!("stdin_b64: {e}")))?,
        ),
        (None, Some(s)) => Some(s.as_bytes().to_vec()),
        (None, None) => None,
    };
    Ok(w)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exec_request_needs_exactly_one_command_form() {
        let both = api::ExecRequest {
            cmd: Some("x".into()),
            argv: Some(vec!["x".into()]),
            ..Default::default()
        };
        assert!(to_wire(&both, 0).is_err());
        assert!(to_wire(&api::ExecRequest::default(), 0).is_err());
        let empty = api::ExecRequest {
            argv: Some(vec![]),
            ..Default::default()
        };
        assert!(to_wire(&empty, 0).is_err());
        let shell = to_wire(
            &api::ExecRequest {
                cmd: Some("echo hi".into()),
                ..Default::default()
            },
            0,
        )
        .unwrap();
        assert_eq!(shell.shell.as_deref(), Some("echo hi"));
    }

    #[test]
    fn bad_timeouts_cwd_and_env_are_refused() {
        let base = api::ExecRequest {
            argv: Some(vec!["true".into()]),
            ..Default::default()
        };
        for t in [0.0, -1.0, f64::NAN, f64::INFINITY] {
            assert!(
                to_wire(
                    &api::ExecRequest {
                        timeout_s: Some(t),
                        ..base.clone()
                    },
                    0
                )
                .is_err(),
                "{t}"
            );
        }
        assert!(
            to_wire(
                &api::ExecRequest {
                    cwd: Some("rel".into()),
                    ..base.clone()
                },
                0
            )
            .is_err()
        );
        let mut env = base.clone();
        env.env.insert("A=B".into(), "x".into());
        assert!(to_wire(&env, 0).is_err());
        assert_eq!(
            to_wire(&base, 30).unwrap().timeout,
            Some(Duration::from_secs(30))
        );
        assert_eq!(to_wire(&base, 0).unwrap().timeout, None);
    }

    #[test]
    fn pty_user_tag_and_stdin_open_are_checked_and_passed_on() {
        let base = api::ExecRequest {
            argv: Some(vec!["true".into()]),
            ..Default::default()
        };
        let ok = to_wire(
            &api::ExecRequest {
                pty: Some(api::PtySize {
                    rows: 30,
                    cols: 100,
                }),
                user: Some("user".into()),
                stdin_open: true,
                tag: Some("t".repeat(MAX_TAG)),
                ..base.clone()
            },
            0,
        )
        .unwrap();
        assert_eq!(
            ok.pty,
            Some(rpc::msg::PtySize {
                rows: 30,
                cols: 100
            })
        );
        assert_eq!(ok.user.as_deref(), Some("user"));
        assert!(ok.keep_stdin_open);
        assert!(!to_wire(&base, 0).unwrap().keep_stdin_open);
        let bad = [
            api::ExecRequest {
                pty: Some(api::PtySize { rows: 0, cols: 80 }),
                ..base.clone()
            },
            api::ExecRequest {
                pty: Some(api::PtySize {
                    rows: 24,
                    cols: 1001,
                }),
                ..base.clone()
            },
            api::ExecRequest {
                user: Some("root;rm".into()),
                ..base.clone()
            },
            api::ExecRequest {
                user: Some("u".repeat(33)),
                ..base.clone()
            },
            api::ExecRequest {
                tag: Some("t".repeat(MAX_TAG + 1)),
                ..base.clone()
            },
        ];
        for b in bad {
            assert!(
                matches!(to_wire(&b, 0), Err(ServiceError::BadRequest(_))),
                "{b:?}"
            );
        }
        // Old clients' requests (no new fields) still parse; unknown fields do not.
        let old: api::ExecRequest = serde_json::from_str(r#"{"cmd":"ls"}"#).unwrap();
        assert!(!old.detach && old.pty.is_none() && old.user.is_none());
        assert!(serde_json::from_str::<api::ExecRequest>(r#"{"cmd":"ls","tty":true}"#).is_err());
    }
}
