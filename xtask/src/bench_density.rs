//! Bench row (p), issue 19 item 1: density. With the daemon's default config, `forks` forks of
//! one sandbox (default 100) and, separately, `creates` independent creates (default 20) are
//! alive at once; then: total PSS of every QEMU of the run, the daemon's RSS, the host CPU all
//! those idle QEMUs use together over a window (utime + stime from `/proc`, as % of one core),
//! and `true` exec latency p50/p99 on random sandboxes after one warm-up exec in each (execs on
//! a sandbox that was paused to disk counted apart). The baseline of the same run is `true` on
//! one sandbox alone, before the others exist. A wall-clock budget stops the row early
//! (it then says how far it got).

use std::fmt::Write as _;
use std::path::Path;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};

use crate::bench::fmt;
use crate::bench_load::quantile;
use crate::daemon::{Daemon, rss_kib};
use crate::http;

pub const HEADING: &str = "## Density (issue 19)";

/// Execs of `true` on the lone sandbox (the baseline), and on random sandboxes.
const BASELINE_REPS: usize = 20;
const RANDOM_EXECS: usize = 100;
/// The most children one fork request may ask for (the API's cap).
const FORK_BATCH: usize = 32;
/// Quiet time after the last start before measuring idle CPU (boot work settles).
const SETTLE: Duration = Duration::from_secs(15);

/// What `cargo xtask bench` passes for row (p).
#[derive(Clone, Copy, Debug)]
pub struct DensityArgs {
    pub forks: usize,
    pub creates: usize,
    pub idle_secs: u64,
    pub budget_secs: u64,
}

pub struct DensityRows {
    pub args: DensityArgs,
    /// How many forks and creates were alive when measured (short of the ask only when the
    /// budget ran out or a start failed; see `errors`).
    pub forks: usize,
    pub creates: usize,
    pub fork_time: Duration,
    pub create_time: Duration,
    pub qemus: usize,
    pub pss_kib: u64,
    /// The discard keepers of those QEMUs (one per daemon run) and their PSS.
    pub keepers: usize,
    pub keepers_pss_kib: u64,
    pub daemon_rss_kib: u64,
    /// CPU seconds all QEMUs used over `idle_window`.
    pub idle_cpu: Duration,
    pub idle_window: Duration,
    pub baseline: Vec<Duration>,
    pub random: Vec<Duration>,
    pub resumed: Vec<Duration>,
    pub errors: Vec<String>,
    pub accel: String,
    pub load_before: String,
    pub load_after: String,
    pub elapsed: Duration,
}

/// A tiny xorshift generator: the random sandbox picks need no crate, only spread.
struct Rng(u64);

impl Rng {
    fn next(&mut self, n: usize) -> usize {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        (self.0 % n as u64) as usize
    }
}

fn exec_true(sock: &Path, id: &str) -> Result<Duration> {
    let t = Instant::now();
    let (exit, _, _) = http::exec_output(sock, id, r#"{"argv":["true"]}"#)?;
    let took = t.elapsed();
    if !exit.contains("\"exit_code\":0") {
        bail!("true on {id}: {exit}");
    }
    Ok(took)
}

fn state(sock: &Path, id: &str) -> String {
    http::request(sock, "GET", &format!("/v1/sandboxes/{id}"), None)
        .ok()
        .and_then(|(_, b)| http::json_str(&b, "state"))
        .unwrap_or_default()
}

/// Pids of the processes whose command line names `home` and passes `is`.
fn procs_under(home: &Path, is: impl Fn(&[u8]) -> bool) -> Vec<u32> {
    let needle = home.as_os_str().as_encoded_bytes();
    let Ok(rd) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    rd.flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<u32>().ok())
        .filter(|pid| {
            std::fs::read(format!("/proc/{pid}/cmdline"))
                .is_ok_and(|c| is(&c) && c.windows(needle.len()).any(|w| w == needle))
        })
        .collect()
}

/// Pids of every QEMU whose command line names `home` (sandboxes and warm-pool VMs).
fn qemus_under(home: &Path) -> Vec<u32> {
    procs_under(home, |c| {
        c.starts_with(b"qemu-system") || c.windows(12).any(|w| w == b"qemu-system-")
    })
}

/// The discard keepers (`tryboxi-discard-keeper DATA_ROOT`: one per daemon run, serving every
/// QEMU it started that owns its RAM file) of the daemon whose data root is `home`.
fn keepers_under(home: &Path) -> Vec<u32> {
    procs_under(home, |c| c.starts_with(b"tryboxi-discard-keeper\0"))
}

fn pss_kib(pid: u32) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/smaps_rollup"))
        .ok()
        .and_then(|t| {
            t.lines()
                .find_map(|l| l.strip_prefix("Pss:"))
                .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        })
        .unwrap_or(0)
}

/// utime + stime of `pid` in clock ticks.
fn cpu_ticks(pid: u32) -> u64 {
    let Ok(s) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
        return 0;
    };
    // Fields after the command name (which may hold spaces) start at ") ".
    let rest = s.rsplit_once(") ").map_or("", |(_, r)| r);
    let f: Vec<&str> = rest.split_whitespace().collect();
    let num = |i: usize| f.get(i).and_then(|v| v.parse::<u64>().ok()).unwrap_or(0);
    // utime and stime are fields 14 and 15 of the line: 11 and 12 after the name.
    num(11) + num(12)
}

fn clock_ticks_per_sec() -> u64 {
    // SAFETY: sysconf reads a constant of the system; no memory is passed.
    let t = unsafe { libc::sysconf(libc::_SC_CLK_TCK) };
    if t > 0 { t as u64 } else { 100 }
}

pub fn run(bin: &Path, home: &Path, artifacts: &Path, a: DensityArgs) -> Result<DensityRows> {
    let t_start = Instant::now();
    let budget = t_start + Duration::from_secs(a.budget_secs);
    let over = || Instant::now() >= budget;
    let load_before = crate::bench::loadavg();
    // The daemon's default config: nothing in config.toml.
    let d = Daemon::start(bin, home, artifacts, "")?;
    let sock = d.socket();
    println!(
        "  (p) density: {} forks of one sandbox + {} creates, budget {} s",
        a.forks, a.creates, a.budget_secs
    );
    let mut errors = Vec::new();
    let create = |errors: &mut Vec<String>| -> Option<String> {
        match http::request(&sock, "POST", "/v1/sandboxes", Some("{}")) {
            Ok((200 | 201, body)) => http::json_str(&body, "id"),
            Ok((status, body)) => {
                errors.push(format!("create: HTTP {status}: {body}"));
                None
            }
            Err(e) => {
                errors.push(format!("create: {e:#}"));
                None
            }
        }
    };
    let parent = create(&mut errors).context("the parent sandbox")?;
    exec_true(&sock, &parent)?;
    let mut baseline = Vec::new();
    for _ in 0..BASELINE_REPS {
        baseline.push(exec_true(&sock, &parent)?);
    }

    let mut kids: Vec<String> = Vec::new();
    let t = Instant::now();
    while kids.len() < a.forks && !over() {
        let n = (a.forks - kids.len()).min(FORK_BATCH);
        let body = format!(r#"{{"count":{n}}}"#);
        match http::request(
            &sock,
            "POST",
            &format!("/v1/sandboxes/{parent}/fork"),
            Some(&body),
        ) {
            Ok((200 | 201, text)) => {
                let v: serde_json::Value = serde_json::from_str(&text).context("fork answer")?;
                let got: Vec<String> = v["sandboxes"]
                    .as_array()
                    .map(|s| {
                        s.iter()
                            .filter_map(|x| x["id"].as_str().map(str::to_owned))
                            .collect()
                    })
                    .unwrap_or_default();
                if let Some(f) = v["failed"].as_array().filter(|f| !f.is_empty()) {
                    errors.push(format!("fork: {} children failed: {}", f.len(), f[0]));
                }
                if got.is_empty() {
                    break;
                }
                kids.extend(got);
            }
            Ok((status, text)) => {
                errors.push(format!("fork: HTTP {status}: {text}"));
                break;
            }
            Err(e) => {
                errors.push(format!("fork: {e:#}"));
                break;
            }
        }
    }
    let fork_time = t.elapsed();
    let t = Instant::now();
    let mut made: Vec<String> = Vec::new();
    while made.len() < a.creates && !over() {
        match create(&mut errors) {
            Some(id) => made.push(id),
            None => break,
        }
    }
    let create_time = t.elapsed();
    println!(
        "  (p) {} forks in {:.1} s, {} creates in {:.1} s",
        kids.len(),
        fork_time.as_secs_f64(),
        made.len(),
        create_time.as_secs_f64()
    );

    // Idle: nothing runs; the QEMUs' CPU over the window.
    std::thread::sleep(SETTLE);
    let pids = qemus_under(home);
    let before: Vec<u64> = pids.iter().map(|p| cpu_ticks(*p)).collect();
    let t = Instant::now();
    std::thread::sleep(Duration::from_secs(a.idle_secs));
    let idle_window = t.elapsed();
    let ticks: u64 = pids
        .iter()
        .zip(&before)
        .map(|(p, b)| cpu_ticks(*p).saturating_sub(*b))
        .sum();
    let idle_cpu = Duration::from_secs_f64(ticks as f64 / clock_ticks_per_sec() as f64);
    let pss: u64 = pids.iter().map(|p| pss_kib(*p)).sum();
    let keepers = keepers_under(home);
    let keepers_pss_kib: u64 = keepers.iter().map(|p| pss_kib(*p)).sum();
    let daemon_rss_kib = rss_kib(d.pid()).unwrap_or(0);
    println!(
        "  (p) {} QEMUs: PSS {} MiB, idle CPU {:.1} % of a core, daemon RSS {} MiB",
        pids.len(),
        pss >> 10,
        100.0 * idle_cpu.as_secs_f64() / idle_window.as_secs_f64(),
        daemon_rss_kib >> 10
    );

    // One warm-up exec in each, then `true` on random ones.
    let all: Vec<String> = std::iter::once(parent.clone())
        .chain(kids.iter().cloned())
        .chain(made.iter().cloned())
        .collect();
    for id in &all {
        if over() {
            break;
        }
        if let Err(e) = exec_true(&sock, id) {
            errors.push(format!("warm-up: {e:#}"));
        }
    }
    let mut rng = Rng(0x9e37_79b9_7f4a_7c15 ^ t_start.elapsed().as_nanos() as u64);
    let (mut random, mut resumed) = (Vec::new(), Vec::new());
    for _ in 0..RANDOM_EXECS {
        if over() {
            break;
        }
        let id = &all[rng.next(all.len())];
        let paused = state(&sock, id) == "paused";
        match exec_true(&sock, id) {
            Ok(t) if paused => resumed.push(t),
            Ok(t) => random.push(t),
            Err(e) => errors.push(format!("random exec: {e:#}")),
        }
    }
    let (_, health) = http::request(&sock, "GET", "/v1/health", None)?;
    let accel = http::json_str(&health, "accel").unwrap_or_else(|| "?".into());
    for id in all.iter().rev() {
        let _ = http::request(&sock, "DELETE", &format!("/v1/sandboxes/{id}"), None);
    }
    d.stop()?;
    if over() {
        errors.push(format!("the {} s budget ran out", a.budget_secs));
    }
    Ok(DensityRows {
        args: a,
        forks: kids.len(),
        creates: made.len(),
        fork_time,
        create_time,
        qemus: pids.len(),
        pss_kib: pss,
        keepers: keepers.len(),
        keepers_pss_kib,
        daemon_rss_kib,
        idle_cpu,
        idle_window,
        baseline,
        random,
        resumed,
        errors,
        accel,
        load_before,
        load_after: crate::bench::loadavg(),
        elapsed: t_start.elapsed(),
    })
}

pub fn section(r: &DensityRows, date: &str) -> Result<String> {
    let mut md = String::new();
    writeln!(md, "{HEADING}\n")?;
    writeln!(
        md,
        "Measured on {date}, accel **{}**, the daemon's default config (1024 MiB, 2 vCPUs, \
         warm pool of 1); host load average at the start {}, at the end {} (the end's \
         includes the run's own VMs). Asked for {} forks of one sandbox and \
         {} independent creates; alive when measured: {} forks + {} creates + the parent, \
         {} QEMUs in all (the warm pool's included). Idle window {:.0} s after {} s of quiet; \
         then one warm-up `true` in each sandbox and {RANDOM_EXECS} `true` on random ones. \
         Baseline: `true` on the parent alone before the others existed ({BASELINE_REPS} \
         execs). The whole row took {:.0} s of a {} s budget.\n",
        r.accel,
        r.load_before,
        r.load_after,
        r.args.forks,
        r.args.creates,
        r.forks,
        r.creates,
        r.qemus,
        r.idle_window.as_secs_f64(),
        SETTLE.as_secs(),
        r.elapsed.as_secs_f64(),
        r.args.budget_secs
    )?;
    let per = |n: usize, d: Duration| {
        if n == 0 {
            "-".to_owned()
        } else {
            fmt(d / n as u32)
        }
    };
    let b50 = quantile(&r.baseline, 0.5);
    writeln!(md, "| what | value | target |\n|---|---|---|")?;
    writeln!(
        md,
        "| (p) {} forks started (per fork) | {:.1} s ({}) | |",
        r.forks,
        r.fork_time.as_secs_f64(),
        per(r.forks, r.fork_time)
    )?;
    writeln!(
        md,
        "| (p) {} creates (per create) | {:.1} s ({}) | |",
        r.creates,
        r.create_time.as_secs_f64(),
        per(r.creates, r.create_time)
    )?;
    writeln!(
        md,
        "| (p) total PSS of {} QEMUs (per QEMU) | {:.0} MiB ({:.1} MiB) | |",
        r.qemus,
        r.pss_kib as f64 / 1024.0,
        r.pss_kib as f64 / 1024.0 / r.qemus.max(1) as f64
    )?;
    writeln!(
        md,
        "| (p) total PSS of their {} discard keepers (per keeper) | {:.1} MiB ({:.2} MiB) | |",
        r.keepers,
        r.keepers_pss_kib as f64 / 1024.0,
        r.keepers_pss_kib as f64 / 1024.0 / r.keepers.max(1) as f64
    )?;
    writeln!(
        md,
        "| (p) daemon RSS | {:.1} MiB | |",
        r.daemon_rss_kib as f64 / 1024.0
    )?;
    writeln!(
        md,
        "| (p) host CPU of all idle QEMUs together | {:.1} % of one core | <= 10 % |",
        100.0 * r.idle_cpu.as_secs_f64() / r.idle_window.as_secs_f64().max(1e-9)
    )?;
    writeln!(
        md,
        "| (p) `true` alone (baseline) p50 / p99 | {} / {} | |",
        fmt(b50),
        fmt(quantile(&r.baseline, 0.99))
    )?;
    let r50 = quantile(&r.random, 0.5);
    writeln!(
        md,
        "| (p) `true` on a random sandbox, {} execs, p50 / p99 (p50 / baseline) | {} / {} ({:.2}) | p99 <= 50 ms |",
        r.random.len(),
        fmt(r50),
        fmt(quantile(&r.random, 0.99)),
        r50.as_secs_f64() / b50.as_secs_f64().max(1e-9)
    )?;
    writeln!(
        md,
        "| (p) of those, resumed from disk first | {} (p50 {}) | reported apart |",
        r.resumed.len(),
        fmt(quantile(&r.resumed, 0.5))
    )?;
    writeln!(md, "| (p) errors | {} | 0 |", r.errors.len())?;
    if let Some(e) = r.errors.first() {
        writeln!(md, "\nFirst error: `{}`", e.replace('`', "'"))?;
    }
    md.push('\n');
    Ok(md)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stat_fields_after_a_name_with_spaces() {
        // cpu_ticks reads our own process: utime + stime is some count, and parsing a name
        // with ") " inside keeps the fields where they are.
        let me = std::process::id();
        let _ = cpu_ticks(me);
        let line = "42 (a) b) S 1 2 3 4 5 6 7 8 9 10 111 222 0 0";
        let rest = line.rsplit_once(") ").map_or("", |(_, r)| r);
        let f: Vec<&str> = rest.split_whitespace().collect();
        assert_eq!((f[11], f[12]), ("111", "222"));
    }

    #[test]
    fn random_picks_cover_the_range() {
        let mut r = Rng(12345);
        let mut seen = [false; 7];
        for _ in 0..200 {
            seen[r.next(7)] = true;
        }
        assert!(seen.iter().all(|s| *s));
    }
}
