//! envd's `process.Process` service over Connect (JSON): Start and Connect (server streams),
//! StreamInput (client stream), List, SendSignal, SendInput, CloseStdin, Update (unary), on the
//! service's detached execs.
//!
//! Owns: E2B's command semantics (as the user `user` unless the request names another, env =
//! the sandbox's `envVars` under the command's own, cwd default the user's home, the process
//! outliving the stream that started it; `Connect` replays its output so far, then follows),
//! pid/tag selectors, stream keepalives (`Keepalive-Ping-Interval`), the stream deadline
//! (`Connect-Timeout-Ms` ends the stream, not the process), and Go-style end statuses
//! (`exit status 1`, `signal: killed`).

use std::time::Duration;

use base64::Engine as _;
use bytes::Bytes;
use futures_util::StreamExt as _;
use http_body_util::BodyExt as _;
use hyper::body::Incoming;
use hyper::header::HeaderMap;
use hyper::{Request, Response, StatusCode};
use serde_json::{Value, json};
use tokio::sync::mpsc;

use super::connect::{self, Code, ConnectError, Decoder, Frame, decode};
use super::proto::{
    ProcessEvent, SelectRequest, SendInputRequest, SendSignalRequest, StartRequest,
    StreamInputRequest, UpdateRequest, signal_number,
};
use super::{Face, read_body};
use crate::api;
use crate::daemon::response::Body;
use crate::service::e2b::E2bSandbox;

/// Longest a stream waits between keepalives when the client asks for them.
const MAX_KEEPALIVE: Duration = Duration::from_secs(300);

pub async fn handle(
    req: Request<Incoming>,
    face: &Face,
    rec: &E2bSandbox,
    method: &str,
) -> Response<Body> {
    let r = match method {
        "Start" => start(req, face, rec).await,
        "Connect" => attach(req, face, rec).await,
        "StreamInput" => stream_input(req, face, rec).await,
        _ => unary(req, face, rec, method)
            .await
            .map(|v| super::json(StatusCode::OK, &v)),
    };
    r.unwrap_or_else(|e| super::connect_unary_error(&e))
}

/// The single message of a server-stream request (one envelope) or of a unary one (plain JSON).
async fn one_message(req: Request<Incoming>, enveloped: bool) -> Result<Bytes, ConnectError> {
    let body = read_body(req.into_body(), connect::MAX_MESSAGE + 5)
        .await
        .map_err(|e| ConnectError::new(Code::ResourceExhausted, e.message))?;
    if !enveloped {
        return Ok(body);
    }
    let mut d = Decoder::default();
    d.push(&body);
    match d.next()? {
        Some(Frame::Message(m)) => Ok(m),
        _ => Err(ConnectError::new(
            Code::InvalidArgument,
            "a streaming request must hold one whole message envelope",
        )),
    }
}

fn is_streaming(h: &HeaderMap) -> bool {
    h.get(hyper::header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|c| c.starts_with("application/connect+json"))
}

/// `Keepalive-Ping-Interval` (seconds) and `Connect-Timeout-Ms` of a streaming request.
fn stream_timing(h: &HeaderMap) -> (Option<Duration>, Option<Duration>) {
    let num = |name: &str| {
        h.get(name)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.trim().parse::<u64>().ok())
    };
    let keepalive = num("keepalive-ping-interval")
        .filter(|s| *s > 0)
        .map(|s| Duration::from_secs(s).min(MAX_KEEPALIVE));
    let deadline = num("connect-timeout-ms")
        .filter(|ms| *ms > 0)
        .map(Duration::from_millis);
    (keepalive, deadline)
}

/// The exec a selector names (by pid, or by tag), among the sandbox's live execs.
fn select(
    face: &Face,
    rec: &E2bSandbox,
    sel: Option<&super::proto::ProcessSelector>,
) -> Result<String, ConnectError> {
    let sel =
        sel.ok_or_else(|| ConnectError::new(Code::InvalidArgument, "`process` is required"))?;
    let found = match (sel.pid, &sel.tag) {
        (Some(pid), _) => face.svc.exec_by_pid(&rec.sandbox_id, pid),
        (None, Some(tag)) => face
            .svc
            .list_execs(&rec.sandbox_id)?
            .into_iter()
            .find(|e| e.running && e.tag.as_deref() == Some(tag.as_str()))
            .map(|e| e.id),
        (None, None) => {
            return Err(ConnectError::new(
                Code::InvalidArgument,
                "the process selector needs `pid` or `tag`",
            ));
        }
    };
    found.ok_or_else(|| {
        ConnectError::new(
            Code::NotFound,
            match (sel.pid, &sel.tag) {
                (Some(pid), _) => format!("process with pid {pid} not found"),
                (_, tag) => format!(
                    "process with tag {} not found",
                    tag.clone().unwrap_or_default()
                ),
            },
        )
    })
}

async fn start(
    req: Request<Incoming>,
    face: &Face,
    rec: &E2bSandbox,
) -> Result<Response<Body>, ConnectError> {
    let user = super::request_user(req.headers())?;
    let timing = stream_timing(req.headers());
    let streaming = is_streaming(req.headers());
    let msg = one_message(req, streaming).await?;
    let r: StartRequest = decode(&msg)?;
    let p = r
        .process
        .ok_or_else(|| ConnectError::new(Code::InvalidArgument, "`process` is required"))?;
    if p.cmd.is_empty() || p.cmd.len() > super::proto::MAX_FIELD {
        return Err(ConnectError::new(
            Code::InvalidArgument,
            "`process.cmd` is empty or too long",
        ));
    }
    let acc = face.svc.vm_accounts(&rec.sandbox_id).await?;
    let home = acc.user(&user).map(|u| u.home.clone()).ok_or_else(|| {
        ConnectError::new(
            Code::InvalidArgument,
            format!("the sandbox has no user `{user}`"),
        )
    })?;
    let cwd = match p.cwd.as_deref() {
        None | Some("") => home.clone(),
        Some(c) => super::guest_path(c, &home)?,
    };
    let mut env = rec.env_vars.clone();
    env.extend(p.envs.clone());
    let mut argv = vec![p.cmd.clone()];
    argv.extend(p.args.iter().cloned());
    let pty = r.pty.and_then(|p| p.size).map(|s| api::PtySize {
        rows: s.rows.unwrap_or(24).clamp(1, 1000) as u16,
        cols: s.cols.unwrap_or(80).clamp(1, 1000) as u16,
    });
    let is_pty = pty.is_some();
    let exec = api::ExecRequest {
        argv: Some(argv),
        env,
        cwd: Some(cwd),
        user: Some(user),
        detach: true,
        stdin_open: r.stdin.unwrap_or(false) || is_pty,
        pty,
        tag: r.tag.filter(|t| !t.is_empty()),
        ..Default::default()
    };
    let events = face.svc.start_exec(&rec.sandbox_id, exec).await?;
    Ok(stream_events(events, is_pty, timing))
}

async fn attach(
    req: Request<Incoming>,
    face: &Face,
    rec: &E2bSandbox,
) -> Result<Response<Body>, ConnectError> {
    let timing = stream_timing(req.headers());
    let streaming = is_streaming(req.headers());
    let msg = one_message(req, streaming).await?;
    let r: SelectRequest = decode(&msg)?;
    let id = select(face, rec, r.process.as_ref())?;
    let pty = face
        .svc
        .list_execs(&rec.sandbox_id)?
        .into_iter()
        .find(|e| e.id == id)
        .is_some_and(|e| e.pty);
    // The output so far first (from the capped exec log: all stdout, then all stderr), so a
    // client that went away and comes back misses nothing; then the live events.
    let events = face.svc.attach_exec(&id, true).await?;
    Ok(stream_events(events, pty, timing))
}

/// Go's `ProcessState.String()` for an exit.
fn status_text(code: Option<i32>, signal: Option<i32>) -> String {
    match (code, signal) {
        (Some(c), _) => format!("exit status {c}"),
        (None, Some(9)) => "signal: killed".into(),
        (None, Some(15)) => "signal: terminated".into(),
        (None, Some(2)) => "signal: interrupt".into(),
        (None, Some(s)) => format!("signal: {s}"),
        (None, None) => "unknown".into(),
    }
}

/// Our exec events as a Connect server stream of `ProcessEvent`s.
fn stream_events(
    mut events: mpsc::Receiver<api::ExecEvent>,
    pty: bool,
    (keepalive, deadline): (Option<Duration>, Option<Duration>),
) -> Response<Body> {
    let (tx, rx) = mpsc::channel::<Bytes>(32);
    tokio::spawn(async move {
        let mut ping = tokio::time::interval(keepalive.unwrap_or(MAX_KEEPALIVE));
        ping.tick().await;
        let until = deadline.map(|d| tokio::time::Instant::now() + d);
        let end_err = loop {
            let ev = tokio::select! {
                ev = events.recv() => ev,
                _ = ping.tick(), if keepalive.is_some() => {
                    if tx.send(connect::message(&ProcessEvent::Keepalive.to_json())).await.is_err() {
                        return;
                    }
                    continue;
                }
                _ = async { match until { Some(t) => tokio::time::sleep_until(t).await, None => std::future::pending().await } } => {
                    break Some(ConnectError::new(Code::DeadlineExceeded, "the stream's deadline passed (the process goes on)"));
                }
                _ = tx.closed() => return,
            };
            let Some(ev) = ev else {
                break Some(ConnectError::new(
                    Code::Unavailable,
                    "the command's event stream ended early",
                ));
            };
            let out = match ev {
                api::ExecEvent::Started { pid, .. } => ProcessEvent::Start {
                    pid: pid.unwrap_or(0),
                }
                .to_json(),
                api::ExecEvent::Stdout { data, data_b64 } => {
                    let b = bytes_of(data, data_b64);
                    if pty {
                        ProcessEvent::Pty(&b).to_json()
                    } else {
                        ProcessEvent::Stdout(&b).to_json()
                    }
                }
                api::ExecEvent::Stderr { data, data_b64 } => {
                    ProcessEvent::Stderr(&bytes_of(data, data_b64)).to_json()
                }
                api::ExecEvent::Exit {
                    exit_code,
                    signal,
                    timed_out,
                    ..
                } => {
                    let ev = ProcessEvent::End {
                        exit_code: exit_code.unwrap_or(-1),
                        exited: exit_code.is_some(),
                        status: status_text(exit_code, signal),
                        error: timed_out.then(|| "the command timed out".to_owned()),
                    };
                    if tx.send(connect::message(&ev.to_json())).await.is_err() {
                        return;
                    }
                    break None;
                }
                api::ExecEvent::Error { code, message } => {
                    break Some(ConnectError::new(
                        Code::Unavailable,
                        format!("{code}: {message}"),
                    ));
                }
            };
            if tx.send(connect::message(&out)).await.is_err() {
                return;
            }
        };
        let _ = tx.send(connect::end(end_err.as_ref())).await;
    });
    super::connect_stream(rx)
}

fn bytes_of(data: Option<String>, data_b64: Option<String>) -> Vec<u8> {
    api::ExecEvent::output_bytes(&data, &data_b64).unwrap_or_default()
}

fn input_bytes(input: Option<&super::proto::ProcessInput>) -> Result<Vec<u8>, ConnectError> {
    let Some(i) = input else {
        return Err(ConnectError::new(
            Code::InvalidArgument,
            "`input` is required",
        ));
    };
    let b64 = i.stdin.as_deref().or(i.pty.as_deref()).unwrap_or("");
    base64::engine::general_purpose::STANDARD
        .decode(b64)
        .map_err(|e| ConnectError::new(Code::InvalidArgument, format!("input is not base64: {e}")))
}

async fn unary(
    req: Request<Incoming>,
    face: &Face,
    rec: &E2bSandbox,
    method: &str,
) -> Result<Value, ConnectError> {
    let body = one_message(req, false).await?;
    let svc = &face.svc;
    match method {
        "List" => {
            let procs: Vec<Value> = svc
                .list_execs(&rec.sandbox_id)?
                .into_iter()
                .filter(|e| e.running)
                .map(|e| {
                    let mut cmd = e.command.clone();
                    let first = if cmd.is_empty() {
                        String::new()
                    } else {
                        cmd.remove(0)
                    };
                    let mut config = json!({ "cmd": first, "args": cmd, "envs": e.env });
                    if let Some(cwd) = e.cwd {
                        config["cwd"] = json!(cwd);
                    }
                    let mut p = json!({ "config": config, "pid": e.pid.unwrap_or(0) });
                    if let Some(t) = e.tag {
                        p["tag"] = json!(t);
                    }
                    p
                })
                .collect();
            Ok(json!({ "processes": procs }))
        }
        "SendSignal" => {
            let r: SendSignalRequest = decode(&body)?;
            let id = select(face, rec, r.process.as_ref())?;
            let sig = r.signal.as_ref().and_then(signal_number).ok_or_else(|| {
                ConnectError::new(
                    Code::InvalidArgument,
                    "`signal` must be SIGNAL_SIGTERM or SIGNAL_SIGKILL",
                )
            })?;
            svc.signal_exec(&id, sig).await?;
            Ok(json!({}))
        }
        "SendInput" => {
            let r: SendInputRequest = decode(&body)?;
            let id = select(face, rec, r.process.as_ref())?;
            let data = input_bytes(r.input.as_ref())?;
            svc.exec_input(&id, &data, false).await?;
            Ok(json!({}))
        }
        "CloseStdin" => {
            let r: SelectRequest = decode(&body)?;
            let id = select(face, rec, r.process.as_ref())?;
            svc.exec_input(&id, &[], true).await?;
            Ok(json!({}))
        }
        "Update" => {
            let r: UpdateRequest = decode(&body)?;
            let id = select(face, rec, r.process.as_ref())?;
            if let Some(size) = r.pty.and_then(|p| p.size) {
                let rows = size.rows.unwrap_or(24).clamp(1, 1000) as u16;
                let cols = size.cols.unwrap_or(80).clamp(1, 1000) as u16;
                svc.resize_exec(&id, rows, cols).await?;
            }
            Ok(json!({}))
        }
        other => Err(ConnectError::new(
            Code::Unimplemented,
            format!("no method process.Process/{other}"),
        )),
    }
}

/// `StreamInput`: a client stream of `start`, then `data` and `keepalive` messages.
async fn stream_input(
    req: Request<Incoming>,
    face: &Face,
    rec: &E2bSandbox,
) -> Result<Response<Body>, ConnectError> {
    let mut body = req.into_body().into_data_stream();
    let mut d = Decoder::default();
    let mut target: Option<String> = None;
    let result: Result<(), ConnectError> = async {
        while let Some(chunk) = body.next().await {
            let chunk = chunk.map_err(|e| ConnectError::new(Code::Canceled, e.to_string()))?;
            d.push(&chunk);
            while let Some(f) = d.next()? {
                let Frame::Message(m) = f else { continue };
                let r: StreamInputRequest = decode(&m)?;
                if let Some(s) = r.start {
                    target = Some(select(face, rec, s.process.as_ref())?);
                } else if let Some(data) = r.data {
                    let id = target.as_ref().ok_or_else(|| {
                        ConnectError::new(Code::FailedPrecondition, "`data` before `start`")
                    })?;
                    face.svc
                        .exec_input(id, &input_bytes(data.input.as_ref())?, false)
                        .await?;
                }
            }
        }
        Ok(())
    }
    .await;
    let (tx, rx) = mpsc::channel::<Bytes>(2);
    match result {
        Ok(()) => {
            let _ = tx.try_send(connect::message(&json!({})));
            let _ = tx.try_send(connect::end(None));
        }
        Err(e) => {
            let _ = tx.try_send(connect::end(Some(&e)));
        }
    }
    Ok(super::connect_stream(rx))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn end_statuses_read_like_go() {
        assert_eq!(status_text(Some(0), None), "exit status 0");
        assert_eq!(status_text(Some(2), None), "exit status 2");
        assert_eq!(status_text(None, Some(9)), "signal: killed");
        assert_eq!(status_text(None, Some(15)), "signal: terminated");
    }

    #[test]
    fn stream_timing_reads_the_headers_bounded() {
        let mut h = HeaderMap::new();
        h.insert("keepalive-ping-interval", "50".parse().unwrap());
        h.insert("connect-timeout-ms", "1500".parse().unwrap());
        assert_eq!(
            stream_timing(&h),
            (
                Some(Duration::from_secs(50)),
                Some(Duration::from_millis(1500))
            )
        );
        h.insert("keepalive-ping-interval", "999999".parse().unwrap());
        assert_eq!(stream_timing(&h).0, Some(MAX_KEEPALIVE));
        assert_eq!(stream_timing(&HeaderMap::new()), (None, None));
    }

    #[test]
    fn input_is_base64_of_stdin_or_pty() {
        let i = super::super::proto::ProcessInput {
            stdin: Some("aGk=".into()),
            pty: None,
        };
        assert_eq!(input_bytes(Some(&i)).unwrap(), b"hi");
        let bad = super::super::proto::ProcessInput {
            stdin: Some("!!".into()),
            pty: None,
        };
        assert!(input_bytes(Some(&bad)).is_err());
        assert!(input_bytes(None).is_err());
    }
}
