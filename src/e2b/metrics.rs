//! `GET /sandboxes/{id}/metrics?start=&end=` (the SDKs' `get_metrics(start, end)`): the samples
//! [`super::history`] took of the sandbox every 5 s (measured from the host; see there what
//! each figure means), from `start` to `end` (unix seconds, both optional). A running sandbox
//! whose history has nothing yet (created less than 5 s ago) is read once on the spot, so the
//! answer for a running sandbox is never empty; a paused one that was never sampled gives an
//! empty list.
//!
//! Owns: E2B's `SandboxMetric` JSON and the query. Never: taking samples on a schedule.

use serde_json::{Value, json};

use super::{E2bError, Face};
use crate::api;
use crate::service::e2b::E2bSandbox;

/// One sample of a sandbox.
#[derive(Debug, Clone, PartialEq)]
pub struct Sample {
    pub cpu_count: u64,
    pub cpu_used_pct: f64,
    pub mem_used: u64,
    pub mem_total: u64,
    pub mem_cache: u64,
    pub disk_used: u64,
    pub disk_total: u64,
}

/// E2B's JSON of one sample taken at `unix` seconds.
pub fn to_json(s: &Sample, unix: u64) -> Value {
    let ts = crate::service::rfc3339(i64::try_from(unix).unwrap_or(i64::MAX));
    json!({
        "timestamp": ts,
        "timestampUnix": unix,
        "cpuCount": s.cpu_count,
        "cpuUsedPct": (s.cpu_used_pct * 100.0).round() / 100.0,
        "memUsed": s.mem_used,
        "memTotal": s.mem_total,
        "memCache": s.mem_cache,
        "diskUsed": s.disk_used,
        "diskTotal": s.disk_total,
    })
}

/// The metrics list of `rec` for `query` (`start`, `end`: unix seconds).
pub async fn list(
    face: &Face,
    rec: &E2bSandbox,
    sbx: &api::Sandbox,
    query: &str,
) -> Result<Value, E2bError> {
    let (mut start, mut end) = (None, None);
    for (k, v) in form_urlencoded::parse(query.as_bytes()) {
        let slot = match k.as_ref() {
            "start" => &mut start,
            "end" => &mut end,
            _ => continue,
        };
        let t: i64 = v.parse().map_err(|_| {
            E2bError::new(
                hyper::StatusCode::BAD_REQUEST,
                format!("`{k}` must be unix seconds, not `{v}`"),
            )
        })?;
        *slot = Some(u64::try_from(t).unwrap_or(0));
    }
    if let (Some(s), Some(e)) = (start, end)
        && s > e
    {
        return Err(E2bError::new(
            hyper::StatusCode::BAD_REQUEST,
            "`start` is after `end`",
        ));
    }
    let id = &rec.sandbox_id;
    let mut got = face.history.range(id, start, end);
    if got.is_empty()
        && sbx.state == api::SandboxState::Ready
        && face.history.range(id, None, None).is_empty()
        && let Some(vm) = face.svc.e2b_vm(sbx)
    {
        let f = face.history.clone();
        let id2 = id.clone();
        let now = crate::service::e2b::unix_now();
        let read = tokio::task::spawn_blocking(move || {
            let s = f.read(&id2, &vm)?;
            f.record(&id2, now, s.clone());
            Some(s)
        })
        .await
        .ok()
        .flatten();
        if let Some(s) = read
            && start.is_none_or(|t| t <= now)
            && end.is_none_or(|t| now <= t)
        {
            got.push((now, s));
        }
    }
    Ok(Value::Array(
        got.iter().map(|(at, s)| to_json(s, *at)).collect(),
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_sample_is_e2bs_json() {
        let s = Sample {
            cpu_count: 2,
            cpu_used_pct: 54.5454,
            mem_used: 285_000 * 1024,
            mem_total: 985_000 * 1024,
            mem_cache: 0,
            disk_used: 402_653_184,
            disk_total: 1_610_612_736,
        };
        let j = to_json(&s, 1_700_000_000);
        assert_eq!(j["timestampUnix"], 1_700_000_000u64);
        assert_eq!(j["cpuCount"], 2);
        assert_eq!(j["cpuUsedPct"], 54.55);
        assert_eq!(j["memUsed"], 285_000 * 1024);
        assert_eq!(j["diskTotal"], 1_610_612_736u64);
        assert!(
            j["timestamp"]
                .as_str()
                .unwrap()
                .starts_with("2023-11-14T22:13:20")
        );
    }
}
