//! Bench row (n), issue 19 item 3: sustained load. 5 sandboxes x 4 concurrent execs for a fixed
//! time (60 s by default), alternating a short CPU-bound command and one that prints 1 MB:
//! execs per second, p50/p99 latency per kind, errors (target 0), and the daemon's RSS before,
//! at its peak and after (target: no growth beyond 10 %). The baseline of the same run is each
//! command's latency on an idle sandbox, one at a time, so the table shows what the load adds.

use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};

use crate::bench::fmt;
use crate::daemon::{Daemon, rss_kib};
use crate::http;

pub const HEADING: &str = "## Sustained load (issue 19)";

/// Sandboxes, and concurrent execs on each.
const SANDBOXES: usize = 5;
const PER_SANDBOX: usize = 4;
/// Bytes the output command prints.
const OUT_BYTES: usize = 1 << 20;
/// Idle (baseline) execs of each kind.
const BASELINE_REPS: usize = 10;

/// The two commands, alternated by every worker.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Kind {
    /// A short CPU-bound loop in the guest's shell.
    Cpu,
    /// 1 MiB on stdout.
    Output,
}

impl Kind {
    fn body(self) -> String {
        match self {
            Kind::Cpu => {
                r#"{"argv":["sh","-c","i=0; while [ $i -lt 2000 ]; do i=$((i+1)); done; echo $i"]}"#
                    .to_owned()
            }
            Kind::Output => {
                format!(r#"{{"argv":["sh","-c","head -c {OUT_BYTES} /dev/zero | tr '\\000' x"]}}"#)
            }
        }
    }

    /// Run once on `id`; the latency, or what was wrong with the answer.
    fn run(self, sock: &Path, id: &str) -> Result<Duration> {
        let t = Instant::now();
        let (exit, out, _) = http::exec_output(sock, id, &self.body())?;
        let took = t.elapsed();
        if !exit.contains("\"exit_code\":0") {
            bail!("{self:?}: {exit}");
        }
        let ok = match self {
            Kind::Cpu => out == "2000\n",
            Kind::Output => out.len() == OUT_BYTES && out.bytes().all(|b| b == b'x'),
        };
        if !ok {
            bail!("{self:?}: wrong output ({} bytes)", out.len());
        }
        Ok(took)
    }
}

pub struct LoadRows {
    pub secs: u64,
    pub elapsed: Duration,
    pub idle_cpu: Vec<Duration>,
    pub idle_out: Vec<Duration>,
    pub cpu: Vec<Duration>,
    pub out: Vec<Duration>,
    pub errors: Vec<String>,
    /// Before any concurrent load (after the sequential warm-up and baseline).
    pub rss_cold_kib: u64,
    /// After [`WARM_UP`] of the same concurrent load: the base of the growth target.
    pub rss_before_kib: u64,
    pub rss_peak_kib: u64,
    pub rss_after_kib: u64,
    /// [`MEMORY_SERIES`] at "RSS before" and at the end.
    pub mem_before: Vec<Option<f64>>,
    pub mem_after: Vec<Option<f64>>,
    pub accel: String,
    pub load_before: String,
    pub load_after: String,
}

/// The `p`-quantile (0..=1) of `v` by the nearest-rank method; zero for no samples.
pub fn quantile(v: &[Duration], p: f64) -> Duration {
    if v.is_empty() {
        return Duration::ZERO;
    }
    let mut s = v.to_vec();
    s.sort();
    let rank = (p * s.len() as f64).ceil() as usize;
    s[rank.clamp(1, s.len()) - 1]
}

/// What the daemon says of its memory (`GET /metrics`), read beside its RSS: the heap in use,
/// the heap the allocator holds free, the store's page cache.
pub const MEMORY_SERIES: [&str; 3] = [
    "tryboxi_daemon_heap_bytes{kind=\"in_use\"}",
    "tryboxi_daemon_heap_bytes{kind=\"free\"}",
    "tryboxi_store_cache_bytes",
];

/// The concurrent warm-up before "RSS before" is read.
const WARM_UP: Duration = Duration::from_secs(10);

/// Execs, CPU-loop times, output times and errors of `PER_SANDBOX` workers per sandbox, each
/// alternating the two kinds, until `secs` have passed.
type Driven = (Vec<Duration>, Vec<Duration>, Vec<String>);

fn drive(sock: &Path, ids: &[String], secs: Duration) -> Result<Driven> {
    let deadline = Instant::now() + secs;
    let workers: Vec<_> = (0..ids.len() * PER_SANDBOX)
        .map(|w| {
            let (sock, id): (PathBuf, String) = (sock.to_owned(), ids[w / PER_SANDBOX].clone());
            std::thread::spawn(move || {
                let mut done: Vec<(Kind, Result<Duration, String>)> = Vec::new();
                // Half the workers start with the other kind, so both run all the time.
                let mut kind = if w % 2 == 0 { Kind::Cpu } else { Kind::Output };
                while Instant::now() < deadline {
                    done.push((kind, kind.run(&sock, &id).map_err(|e| format!("{e:#}"))));
                    kind = if kind == Kind::Cpu {
                        Kind::Output
                    } else {
                        Kind::Cpu
                    };
                }
                done
            })
        })
        .collect();
    let (mut cpu, mut out, mut errors) = (Vec::new(), Vec::new(), Vec::new());
    for w in workers {
        for (kind, r) in w
            .join()
            .map_err(|_| anyhow::anyhow!("a load worker panicked"))?
        {
            match (kind, r) {
                (Kind::Cpu, Ok(t)) => cpu.push(t),
                (Kind::Output, Ok(t)) => out.push(t),
                (_, Err(e)) => errors.push(e),
            }
        }
    }
    Ok((cpu, out, errors))
}

pub fn run(bin: &Path, home: &Path, artifacts: &Path, config: &str, secs: u64) -> Result<LoadRows> {
    let load_before = crate::bench::loadavg();
    let d = Daemon::start(bin, home, artifacts, config)?;
    let sock = d.socket();
    println!(
        "  (n) {SANDBOXES} sandboxes x {PER_SANDBOX} concurrent execs for {secs} s (CPU loop / 1 MiB output)"
    );
    let mut ids = Vec::new();
    for _ in 0..SANDBOXES {
        let (status, body) = http::request(&sock, "POST", "/v1/sandboxes", Some("{}"))?;
        if status != 201 && status != 200 {
            bail!("create: HTTP {status}: {body}");
        }
        ids.push(http::json_str(&body, "id").context("no id in the create answer")?);
    }
    // One warm-up of each kind in each sandbox (TCG translates the commands' code once).
    for id in &ids {
        Kind::Cpu.run(&sock, id)?;
        Kind::Output.run(&sock, id)?;
    }
    let (mut idle_cpu, mut idle_out) = (Vec::new(), Vec::new());
    for _ in 0..BASELINE_REPS {
        idle_cpu.push(Kind::Cpu.run(&sock, &ids[0])?);
        idle_out.push(Kind::Output.run(&sock, &ids[0])?);
    }
    let pid = d.pid();
    // RSS from cold, then after a short spell of the same concurrent load: that spell sets
    // the allocator's per-thread arenas and the buffers of 20 streams in flight (a high-water
    // mark reached once); growth past it over the long run is what a leak would show.
    let rss_cold_kib = rss_kib(pid).context("the daemon's RSS")?;
    let (_, _, warm_errors) = drive(&sock, &ids, WARM_UP)?;
    if let Some(e) = warm_errors.first() {
        bail!("the concurrent warm-up failed: {e}");
    }
    std::thread::sleep(Duration::from_secs(2));
    let rss_before_kib = rss_kib(pid).context("the daemon's RSS")?;
    let mem_before = http::metrics(&sock, &MEMORY_SERIES)?;

    let stop = Arc::new(AtomicBool::new(false));
    let peak = Arc::new(AtomicU64::new(rss_before_kib));
    let sampler = {
        let (stop, peak) = (stop.clone(), peak.clone());
        std::thread::spawn(move || {
            while !stop.load(Ordering::Relaxed) {
                if let Some(r) = rss_kib(pid) {
                    peak.fetch_max(r, Ordering::Relaxed);
                }
                std::thread::sleep(Duration::from_millis(200));
            }
        })
    };
    let t0 = Instant::now();
    let (cpu, out, errors) = drive(&sock, &ids, Duration::from_secs(secs))?;
    let elapsed = t0.elapsed();
    stop.store(true, Ordering::Relaxed);
    let _ = sampler.join();
    // What the daemon holds once the load is over (its runtime's threads parked again).
    std::thread::sleep(Duration::from_secs(2));
    let rss_after_kib = rss_kib(pid).context("the daemon's RSS")?;
    let mem_after = http::metrics(&sock, &MEMORY_SERIES)?;
    let (_, health) = http::request(&sock, "GET", "/v1/health", None)?;
    let accel = http::json_str(&health, "accel").unwrap_or_else(|| "?".into());
    for id in &ids {
        let _ = http::request(&sock, "DELETE", &format!("/v1/sandboxes/{id}"), None);
    }
    d.stop()?;
    println!(
        "  (n) {} execs in {:.1} s, {} errors; daemon RSS {} -> {} KiB (peak {})",
        cpu.len() + out.len(),
        elapsed.as_secs_f64(),
        errors.len(),
        rss_before_kib,
        rss_after_kib,
        peak.load(Ordering::Relaxed)
    );
    Ok(LoadRows {
        secs,
        elapsed,
        idle_cpu,
        idle_out,
        cpu,
        out,
        errors,
        rss_cold_kib,
        rss_before_kib,
        rss_peak_kib: peak.load(Ordering::Relaxed),
        rss_after_kib,
        mem_before,
        mem_after,
        accel,
        load_before,
        load_after: crate::bench::loadavg(),
    })
}

pub fn section(r: &LoadRows, date: &str) -> Result<String> {
    let mut md = String::new();
    writeln!(md, "{HEADING}\n")?;
    writeln!(
        md,
        "Measured on {date}, accel **{}**; host load average at the start {}, at the end {}. \
         {SANDBOXES} sandboxes (no workspace) x {PER_SANDBOX} workers each, every worker \
         alternating a CPU loop (`sh` counting to 2000) and 1 MiB of output (`head -c | tr`), \
         each checked, over the unix socket for {} s (the last execs ended at {:.1} s). The \
         baseline is the same command on an idle sandbox, one at a time ({BASELINE_REPS} each), \
         in the same run. The daemon's RSS growth is measured from after {} s of the same \
         concurrent load (that spell sets the allocator's per-thread arenas and the buffers of \
         the streams in flight, once); its RSS before any concurrent load is shown too.\n",
        r.accel,
        r.load_before,
        r.load_after,
        r.secs,
        r.elapsed.as_secs_f64(),
        WARM_UP.as_secs()
    )?;
    let total = r.cpu.len() + r.out.len();
    writeln!(
        md,
        "| what | execs | p50 | p99 | idle p50 | p50 / idle |\n|---|---|---|---|---|---|"
    )?;
    for (what, v, idle) in [
        ("(n) CPU loop under load", &r.cpu, &r.idle_cpu),
        ("(n) 1 MiB output under load", &r.out, &r.idle_out),
    ] {
        let (p50, i50) = (quantile(v, 0.5), quantile(idle, 0.5));
        writeln!(
            md,
            "| {what} | {} | {} | {} | {} | {:.2} |",
            v.len(),
            fmt(p50),
            fmt(quantile(v, 0.99)),
            fmt(i50),
            p50.as_secs_f64() / i50.as_secs_f64().max(1e-9)
        )?;
    }
    let growth = r.rss_after_kib as f64 / r.rss_before_kib.max(1) as f64 - 1.0;
    writeln!(md, "\n| what | value | target |\n|---|---|---|")?;
    writeln!(
        md,
        "| (n) execs per second, all sandboxes | {:.1}/s | |",
        total as f64 / r.elapsed.as_secs_f64().max(1e-9)
    )?;
    writeln!(md, "| (n) errors | {} | 0 |", r.errors.len())?;
    writeln!(
        md,
        "| (n) daemon RSS before any concurrent load | {:.1} MiB | |",
        r.rss_cold_kib as f64 / 1024.0
    )?;
    writeln!(
        md,
        "| (n) daemon RSS after {} s of the same load -> after the run (peak) | {:.1} -> {:.1} MiB ({:.1} MiB); growth {:+.1} % | <= +10 % |",
        WARM_UP.as_secs(),
        r.rss_before_kib as f64 / 1024.0,
        r.rss_after_kib as f64 / 1024.0,
        r.rss_peak_kib as f64 / 1024.0,
        growth * 100.0
    )?;
    for (i, what) in [
        "(n) of which heap in use",
        "(n) heap free but held by the allocator",
        "(n) store page cache (bounded by its size)",
    ]
    .iter()
    .enumerate()
    {
        let mib = |v: Option<f64>| match v {
            Some(b) => format!("{:.1} MiB", b / 1048576.0),
            None => "?".into(),
        };
        let (b, a) = (r.mem_before[i], r.mem_after[i]);
        writeln!(
            md,
            "| {what}: before -> after | {} -> {} | |",
            mib(b),
            mib(a)
        )?;
    }
    if let Some(e) = r.errors.first() {
        writeln!(md, "\nFirst error: `{}`", e.replace('`', "'"))?;
    }
    md.push('\n');
    Ok(md)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ms(v: &[u64]) -> Vec<Duration> {
        v.iter().map(|&m| Duration::from_millis(m)).collect()
    }

    #[test]
    fn quantiles_are_nearest_rank() {
        let v = ms(&[5, 1, 4, 2, 3]);
        assert_eq!(quantile(&v, 0.5), Duration::from_millis(3));
        assert_eq!(quantile(&v, 0.99), Duration::from_millis(5));
        assert_eq!(quantile(&v, 0.0), Duration::from_millis(1));
        let hundred: Vec<u64> = (1..=100).collect();
        assert_eq!(quantile(&ms(&hundred), 0.99), Duration::from_millis(99));
        assert_eq!(quantile(&[], 0.5), Duration::ZERO);
    }

    #[test]
    fn the_output_command_asks_for_one_mebibyte() {
        let b = Kind::Output.body();
        let v: serde_json::Value = serde_json::from_str(&b).expect("valid JSON");
        assert_eq!(
            v["argv"][2].as_str().unwrap(),
            "head -c 1048576 /dev/zero | tr '\\000' x"
        );
        let c: serde_json::Value = serde_json::from_str(&Kind::Cpu.body()).expect("valid JSON");
        assert_eq!(c["argv"][0], "sh");
    }
}
