//! `tryboxi attach EXEC_ID`, `tryboxi execs ID`, `tryboxi kill EXEC_ID [-s SIGNAL]`: running
//! (e.g. detached) execs.

use std::io::IsTerminal as _;

use hyper::Method;

use crate::api;
use crate::error::TopError;

/// Replay the exec's output so far, then follow it; exit with its exit code. A pty exec from
/// a terminal (or with `-i`) is an interactive session again.
pub async fn attach(exec_id: String, no_replay: bool, interactive: bool) -> Result<(), TopError> {
    let client = super::client()?;
    let info: api::ExecInfo = client.get(&format!("/v1/execs/{exec_id}")).await?;
    let interactive = info.running && (interactive || (info.pty && std::io::stdin().is_terminal()));
    let events = client.attach(&exec_id, !no_replay).await?;
    if interactive {
        return super::interactive::session(client, exec_id, info.pty, events).await;
    }
    super::exec::follow(events).await
}

/// One line per running exec: id, pid, flags, tag, command.
pub async fn list(id: String) -> Result<(), TopError> {
    let list: api::ExecList = super::client()?
        .get(&format!("/v1/sandboxes/{id}/execs"))
        .await?;
    for e in list.execs {
        let mut flags = Vec::new();
        if e.detached {
            flags.push("detached".to_string());
        }
        if e.pty {
            flags.push("pty".into());
        }
        if let Some(u) = &e.user {
            flags.push(format!("user={u}"));
        }
        println!(
            "{}\t{}\t{}\t{}\t{}\t{}",
            e.id,
            e.pid.map_or("-".into(), |p| p.to_string()),
            e.started_at,
            if flags.is_empty() {
                "-".into()
            } else {
                flags.join(",")
            },
            e.tag.as_deref().unwrap_or("-"),
            e.command.join(" ")
        );
    }
    Ok(())
}

/// Send a signal (a number or a name such as `TERM`) to the exec's process group.
pub async fn kill(exec_id: String, signal: String) -> Result<(), TopError> {
    let signal = match signal.parse::<i32>() {
        Ok(n) => api::SignalSpec::Number(n),
        Err(_) => api::SignalSpec::Name(signal),
    };
    let _: api::ExecInfo = super::client()?
        .send(
            Method::POST,
            &format!("/v1/execs/{exec_id}/signal"),
            Some(&api::ExecSignalRequest { signal }),
        )
        .await?;
    Ok(())
}
