//! `GET /sandboxes/{id}/metrics` (the SDKs' `get_metrics()`): one sample of the guest's CPU,
//! memory and root disk use, read inside the guest as E2B's envd does.
//!
//! Owns: the probe command run in the guest (two `/proc/stat` readings 200 ms apart, the CPU
//! count, `/proc/meminfo`, `df` of `/`) and parsing its output into E2B's `SandboxMetric`. A
//! paused sandbox gives an empty list (sampling would resume it). Bounded: the probe's output
//! is cut at [`MAX_OUTPUT`] bytes, and it runs with a 10 s timeout.

use serde_json::{Value, json};

use super::{E2bError, Face};
use crate::api;
use crate::service::e2b::E2bSandbox;

/// The probe run in the guest.
pub const PROBE: &str = "head -n1 /proc/stat; sleep 0.2; head -n1 /proc/stat; nproc; \
     grep -E '^(MemTotal|MemAvailable|Cached):' /proc/meminfo; df -P -B1 / | tail -n1";
/// Most probe output read.
pub const MAX_OUTPUT: usize = 4096;

/// What the probe read.
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

/// (busy, total) jiffies of a `/proc/stat` `cpu` line.
fn jiffies(line: &str) -> Option<(u64, u64)> {
    let mut f = line.split_whitespace();
    if f.next()? != "cpu" {
        return None;
    }
    let v: Vec<u64> = f.map(|x| x.parse().ok()).collect::<Option<_>>()?;
    if v.len() < 4 {
        return None;
    }
    let total: u64 = v.iter().take(8).sum();
    // idle + iowait are not busy.
    let idle = v[3] + v.get(4).copied().unwrap_or(0);
    Some((total.saturating_sub(idle), total))
}

/// Parse the probe's output; `None` when it is not what [`PROBE`] prints.
pub fn parse(out: &str) -> Option<Sample> {
    let lines: Vec<&str> = out.lines().collect();
    let (b1, t1) = jiffies(lines.first()?)?;
    let (b2, t2) = jiffies(lines.get(1)?)?;
    let cpu_count: u64 = lines.get(2)?.trim().parse().ok()?;
    let dt = t2.saturating_sub(t1);
    let cpu_used_pct = if dt == 0 {
        0.0
    } else {
        (b2.saturating_sub(b1) as f64 * 100.0 / dt as f64).clamp(0.0, 100.0)
    };
    let mut mem = [None; 3];
    let mut disk = None;
    for l in &lines[3..] {
        let f: Vec<&str> = l.split_whitespace().collect();
        let kib = || {
            f.get(1)
                .and_then(|v| v.parse::<u64>().ok())
                .map(|k| k * 1024)
        };
        match f.first().copied() {
            Some("MemTotal:") => mem[0] = kib(),
            Some("MemAvailable:") => mem[1] = kib(),
            Some("Cached:") => mem[2] = kib(),
            // df -P -B1: filesystem, size, used, available, capacity, mount point.
            _ if f.len() >= 6 => {
                disk = Some((f[2].parse::<u64>().ok()?, f[1].parse::<u64>().ok()?));
            }
            _ => {}
        }
    }
    let (mem_total, mem_avail, mem_cache) = (mem[0]?, mem[1]?, mem[2].unwrap_or(0));
    let (disk_used, disk_total) = disk?;
    Some(Sample {
        cpu_count,
        cpu_used_pct,
        mem_used: mem_total.saturating_sub(mem_avail),
        mem_total,
        mem_cache,
        disk_used,
        disk_total,
    })
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

/// The metrics list of `rec`: one sample now, or none while it is paused.
pub async fn sample(face: &Face, rec: &E2bSandbox, sbx: &api::Sandbox) -> Result<Value, E2bError> {
    if sbx.state != api::SandboxState::Ready {
        return Ok(json!([]));
    }
    let exec = api::ExecRequest {
        cmd: Some(PROBE.into()),
        timeout_s: Some(10.0),
        ..Default::default()
    };
    let mut rx = face.svc.start_exec(&rec.sandbox_id, exec).await?;
    let mut out = Vec::new();
    while let Some(ev) = rx.recv().await {
        if let api::ExecEvent::Stdout { data, data_b64 } = ev {
            let b = api::ExecEvent::output_bytes(&data, &data_b64).unwrap_or_default();
            let room = MAX_OUTPUT.saturating_sub(out.len());
            out.extend_from_slice(&b[..b.len().min(room)]);
        }
    }
    let text = String::from_utf8_lossy(&out);
    let s = parse(&text).ok_or_else(|| {
        E2bError::new(
            hyper::StatusCode::INTERNAL_SERVER_ERROR,
            "the guest's metrics could not be read",
        )
    })?;
    Ok(json!([to_json(&s, crate::service::e2b::unix_now())]))
}

#[cfg(test)]
mod tests {
    use super::*;

    const OUT: &str = "cpu  100 0 100 800 0 0 0 0 0 0\n\
cpu  150 0 110 840 10 0 0 0 0 0\n\
2\n\
MemTotal:         985000 kB\n\
MemAvailable:     700000 kB\n\
Cached:           120000 kB\n\
overlay 1610612736 402653184 1207959552 25% /\n";

    #[test]
    fn the_probe_output_becomes_one_e2b_sample() {
        let s = parse(OUT).unwrap();
        // busy 260 -> 200... : (150+110) - (100+100) = 60 of 110 jiffies.
        assert!(
            (s.cpu_used_pct - 60.0 * 100.0 / 110.0).abs() < 1e-9,
            "{s:?}"
        );
        assert_eq!(s.cpu_count, 2);
        assert_eq!(s.mem_total, 985_000 * 1024);
        assert_eq!(s.mem_used, 285_000 * 1024);
        assert_eq!(s.mem_cache, 120_000 * 1024);
        assert_eq!((s.disk_used, s.disk_total), (402_653_184, 1_610_612_736));
        let j = to_json(&s, 1_700_000_000);
        assert_eq!(j["timestampUnix"], 1_700_000_000u64);
        assert_eq!(j["cpuCount"], 2);
        assert_eq!(j["cpuUsedPct"], 54.55);
        assert!(
            j["timestamp"]
                .as_str()
                .unwrap()
                .starts_with("2023-11-14T22:13:20")
        );
    }

    #[test]
    fn other_output_is_refused() {
        assert_eq!(parse(""), None);
        assert_eq!(parse("cpu 1 2 3\ncpu 1 2 3 4\n2\n"), None);
        assert_eq!(parse(&OUT.replace("MemAvailable", "MemFree")), None);
        assert_eq!(parse(&OUT.replace("2\n", "two\n")), None);
        // No df line.
        let no_df: String = OUT.lines().take(6).map(|l| format!("{l}\n")).collect();
        assert_eq!(parse(&no_df), None);
    }
}
