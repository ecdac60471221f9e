//! `cargo xtask fuzz`: runs the cargo-fuzz targets in `fuzz/` on demand (never in CI: CI only
//! replays the saved corpora through `cargo test`).
//!
//! Owns: installing cargo-fuzz (once, with the nightly toolchain), building the targets, running
//! each for a budget of CPU time with libFuzzer's time, RSS and allocation limits, merging what
//! a run found into a scratch folder (into `fuzz/corpus/<target>/` only with `--save`), and the
//! summary table. Never runs two targets at once (the machines it runs on are small and shared).

use anyhow::{Context, Result, bail};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use crate::util::{self, Step, fmt_dur};

/// What `cargo xtask fuzz` was asked.
pub struct Options {
    /// Only these targets (default: every target `cargo fuzz list` names).
    pub targets: Vec<String>,
    /// CPU-minutes per target.
    pub minutes: f64,
    /// Wall-clock minutes per target at most (default: 4x `minutes`); on a loaded machine the
    /// CPU budget may take much longer than its wall-clock equivalent.
    pub wall_minutes: Option<f64>,
    /// Merge new interesting inputs into `fuzz/corpus/<target>/` (default: only the scratch dir).
    pub save: bool,
    /// libFuzzer's `-rss_limit_mb`.
    pub rss_limit_mb: u64,
    /// libFuzzer's `-malloc_limit_mb`: one allocation above it is reported as a crash.
    pub malloc_limit_mb: u64,
}

/// One target's figures.
#[derive(Default, Debug)]
struct Report {
    target: String,
    cpu: Duration,
    wall: Duration,
    execs: u64,
    execs_per_sec: u64,
    cov: u64,
    ft: u64,
    corpus: u64,
    peak_rss_mb: u64,
    new_inputs: usize,
    crashes: Vec<PathBuf>,
}

pub fn run(opts: Options) -> Result<()> {
    let root = util::repo_root();
    ensure_cargo_fuzz()?;
    let all = list_targets(&root)?;
    let targets = if opts.targets.is_empty() {
        all.clone()
    } else {
        for t in &opts.targets {
            if !all.contains(t) {
                bail!("no fuzz target `{t}` (known: {})", all.join(", "));
            }
        }
        opts.targets.clone()
    };
    let step = Step::start(format!("build fuzz targets ({})", targets.join(", ")));
    let mut build = Command::new("cargo");
    build
        .current_dir(&root)
        .args(["+nightly", "fuzz", "build", "-O"]);
    if targets.len() == 1 {
        build.arg(&targets[0]);
    }
    util::run_inherit(&mut build, "cargo fuzz build")?;
    step.done("");
    let scratch = root.join("target").join("fuzz-scratch");
    let mut reports = Vec::new();
    for t in &targets {
        reports.push(run_target(&root, &scratch, t, &opts)?);
    }
    print_table(&reports);
    println!(
        "    new inputs and crash files: {}{}",
        scratch.display(),
        if opts.save {
            " (new inputs also merged into fuzz/corpus/<target>/)"
        } else {
            " (rerun with --save to merge them into fuzz/corpus/<target>/)"
        }
    );
    let crashed: Vec<_> = reports.iter().filter(|r| !r.crashes.is_empty()).collect();
    if !crashed.is_empty() {
        for r in &crashed {
            for c in &r.crashes {
                println!(
                    "    {}: {} (reproduce: cargo +nightly fuzz run {} {})",
                    r.target,
                    c.display(),
                    r.target,
                    c.display()
                );
            }
        }
        bail!("{} target(s) crashed", crashed.len());
    }
    Ok(())
}

/// `cargo +nightly fuzz` must work; install it once if it does not.
fn ensure_cargo_fuzz() -> Result<()> {
    let ok = Command::new("cargo")
        .args(["+nightly", "fuzz", "--version"])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success());
    if ok {
        return Ok(());
    }
    let step = Step::start("install cargo-fuzz (cargo +nightly install cargo-fuzz --locked)");
    util::run_inherit(
        Command::new("cargo").args(["+nightly", "install", "cargo-fuzz", "--locked"]),
        "cargo install cargo-fuzz (needs the nightly toolchain: rustup toolchain install nightly)",
    )?;
    step.done("");
    Ok(())
}

fn list_targets(root: &Path) -> Result<Vec<String>> {
    let out = util::output(
        Command::new("cargo")
            .current_dir(root)
            .args(["+nightly", "fuzz", "list"]),
        "cargo fuzz list",
    )?;
    Ok(out.lines().map(|l| l.trim().to_owned()).collect())
}

fn binary(root: &Path, target: &str) -> PathBuf {
    root.join("fuzz/target/x86_64-unknown-linux-gnu/release")
        .join(target)
}

/// Fuzz one target for its CPU budget, then merge what it found.
fn run_target(root: &Path, scratch: &Path, target: &str, opts: &Options) -> Result<Report> {
    let step = Step::start(format!("fuzz {target} for {} CPU-minute(s)", opts.minutes));
    let dir = scratch.join(target);
    let (work, artifacts, merged) = (dir.join("work"), dir.join("artifacts"), dir.join("new"));
    for d in [&work, &artifacts, &merged] {
        let _ = std::fs::remove_dir_all(d);
        std::fs::create_dir_all(d).with_context(|| format!("creating {}", d.display()))?;
    }
    let corpus = root.join("fuzz/corpus").join(target);
    std::fs::create_dir_all(&corpus)?;
    let log = dir.join("fuzz.log");
    let bin = binary(root, target);
    let budget = Duration::from_secs_f64(opts.minutes * 60.0);
    // New inputs go to the first folder (scratch); the saved corpus is read, never written.
    let mut cmd = Command::new("nice");
    cmd.arg(&bin)
        .arg(&work)
        .arg(&corpus)
        .arg(format!(
            "-max_total_time={}",
            // A wall-clock backstop; the CPU budget below normally ends the run first.
            opts.wall_minutes
                .map_or((budget.as_secs() * 4).max(60), |w| (w * 60.0).max(1.0)
                    as u64)
        ))
        .arg(format!("-rss_limit_mb={}", opts.rss_limit_mb))
        .arg(format!("-malloc_limit_mb={}", opts.malloc_limit_mb))
        .arg("-timeout=10")
        .arg("-print_final_stats=1")
        .arg(format!("-artifact_prefix={}/", artifacts.display()));
    let file = std::fs::File::create(&log)?;
    let mut child = cmd
        .stdin(Stdio::null())
        .stdout(Stdio::from(file.try_clone()?))
        .stderr(Stdio::from(file))
        .spawn()
        .with_context(|| format!("starting {}", bin.display()))?;
    let pid = child.id();
    let start = Instant::now();
    let mut next_report = start + Duration::from_secs(30);
    let mut cpu = Duration::ZERO;
    let mut interrupted = false;
    loop {
        if child.try_wait()?.is_some() {
            break;
        }
        // `nice` execs the fuzzer, so the pid is the fuzzer's.
        if let Some(c) = cpu_time(pid) {
            cpu = c;
        }
        if cpu >= budget && !interrupted {
            // libFuzzer prints its final stats on SIGINT and exits.
            // SAFETY: kill(2) on our own child's pid, which has not been reaped yet.
            unsafe { libc::kill(pid as i32, libc::SIGINT) };
            interrupted = true;
        }
        if Instant::now() >= next_report {
            let status = last_status(&log).unwrap_or_default();
            println!(
                "    [{target} cpu {} / wall {}] {status}",
                fmt_dur(cpu),
                fmt_dur(start.elapsed())
            );
            util::flush();
            next_report = Instant::now() + Duration::from_secs(30);
        }
        std::thread::sleep(Duration::from_millis(200));
    }
    let wall = start.elapsed();
    let text = std::fs::read_to_string(&log).unwrap_or_default();
    let mut r = parse_log(&text);
    r.target = target.to_owned();
    r.cpu = cpu;
    r.wall = wall;
    r.crashes = std::fs::read_dir(&artifacts)?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .collect();
    // Keep only what adds coverage over the saved corpus: merge the run's inputs into a copy of
    // it, and call new whatever the merge added.
    for e in std::fs::read_dir(&corpus)? {
        let p = e?.path();
        std::fs::copy(&p, merged.join(p.file_name().unwrap_or_default()))?;
    }
    let status = Command::new("nice")
        .arg(&bin)
        .arg("-merge=1")
        .arg(&merged)
        .arg(&work)
        .arg(format!("-rss_limit_mb={}", opts.rss_limit_mb))
        .arg(format!("-malloc_limit_mb={}", opts.malloc_limit_mb))
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()?;
    if !status.success() {
        println!(
            "    merge of {target}'s inputs failed ({status}); the run's inputs stay in {}",
            work.display()
        );
    }
    let mut added = Vec::new();
    for e in std::fs::read_dir(&merged)? {
        let p = e?.path();
        let name = p.file_name().unwrap_or_default();
        if corpus.join(name).exists() {
            std::fs::remove_file(&p)?;
        } else {
            added.push(p);
        }
    }
    r.new_inputs = added.len();
    if opts.save {
        for p in &added {
            std::fs::copy(p, corpus.join(p.file_name().unwrap_or_default()))?;
        }
    }
    step.done(&format!(
        "{} execs, cov {}, {} new input(s), {} crash file(s); log {}",
        r.execs,
        r.cov,
        r.new_inputs,
        r.crashes.len(),
        log.display()
    ));
    Ok(r)
}

/// User + system CPU time of a process, from `/proc/<pid>/stat`.
fn cpu_time(pid: u32) -> Option<Duration> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // Fields after the `(comm)`, which may contain spaces: utime and stime are fields 14 and 15.
    let rest = stat.rsplit_once(')')?.1;
    let f: Vec<&str> = rest.split_whitespace().collect();
    let ticks: u64 = f.get(11)?.parse::<u64>().ok()? + f.get(12)?.parse::<u64>().ok()?;
    // SAFETY: sysconf has no preconditions.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) }.max(1) as u64;
    Some(Duration::from_millis(ticks * 1000 / hz))
}

/// The latest libFuzzer status line (`#N ... cov: ... ft: ... exec/s: ...`).
fn last_status(log: &Path) -> Option<String> {
    let t = util::tail(log, 20).ok()?;
    t.lines()
        .rev()
        .find(|l| l.starts_with('#') && l.contains("cov:"))
        .map(str::to_owned)
}

fn field(line: &str, key: &str) -> Option<u64> {
    let mut it = line.split_whitespace();
    while let Some(w) = it.next() {
        if w == key {
            return it.next()?.trim_end_matches(['b', 'M', 'k']).parse().ok();
        }
    }
    None
}

/// Figures from libFuzzer's output: the last status line and `-print_final_stats`.
fn parse_log(text: &str) -> Report {
    let mut r = Report::default();
    if let Some(l) = text
        .lines()
        .rev()
        .find(|l| l.starts_with('#') && l.contains("cov:"))
    {
        r.cov = field(l, "cov:").unwrap_or(0);
        r.ft = field(l, "ft:").unwrap_or(0);
        r.corpus = l
            .split_whitespace()
            .skip_while(|w| *w != "corp:")
            .nth(1)
            .and_then(|c| c.split('/').next()?.parse().ok())
            .unwrap_or(0);
    }
    for l in text.lines() {
        let stat = |k: &str| l.strip_prefix(k).and_then(|v| v.trim().parse::<u64>().ok());
        if let Some(v) = stat("stat::number_of_executed_units:") {
            r.execs = v;
        }
        if let Some(v) = stat("stat::average_exec_per_sec:") {
            r.execs_per_sec = v;
        }
        if let Some(v) = stat("stat::peak_rss_mb:") {
            r.peak_rss_mb = v;
        }
    }
    r
}

fn print_table(reports: &[Report]) {
    println!();
    println!(
        "{:<14} {:>8} {:>8} {:>11} {:>8} {:>7} {:>7} {:>6} {:>5} {:>9} {:>7}",
        "target",
        "cpu",
        "wall",
        "execs",
        "execs/s",
        "cov",
        "ft",
        "corpus",
        "new",
        "peak RSS",
        "crashes"
    );
    for r in reports {
        println!(
            "{:<14} {:>8} {:>8} {:>11} {:>8} {:>7} {:>7} {:>6} {:>5} {:>6} MB {:>7}",
            r.target,
            fmt_dur(r.cpu),
            fmt_dur(r.wall),
            r.execs,
            r.execs_per_sec,
            r.cov,
            r.ft,
            r.corpus,
            r.new_inputs,
            r.peak_rss_mb,
            r.crashes.len()
        );
    }
    println!();
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_libfuzzer_figures() {
        let log = "INFO: Seed: 1\n#2\tINITED cov: 10 ft: 11 corp: 1/1b exec/s: 0 rss: 30Mb\n\
                   #4096\tpulse  cov: 120 ft: 300 corp: 40/2048b lim: 43 exec/s: 2048 rss: 61Mb\n\
                   ==1== libFuzzer: run interrupted; exiting\n\
                   stat::number_of_executed_units: 123456\n\
                   stat::average_exec_per_sec:     2057\n\
                   stat::new_units_added:          39\n\
                   stat::slowest_unit_time_sec:    0\n\
                   stat::peak_rss_mb:              62\n";
        let r = parse_log(log);
        assert_eq!(
            (
                r.execs,
                r.execs_per_sec,
                r.cov,
                r.ft,
                r.corpus,
                r.peak_rss_mb
            ),
            (123456, 2057, 120, 300, 40, 62)
        );
    }

    #[test]
    fn reads_its_own_cpu_time() {
        let t0 = cpu_time(std::process::id()).expect("/proc/self/stat");
        let mut x = 0u64;
        let start = Instant::now();
        while start.elapsed() < Duration::from_millis(300) {
            x = x.wrapping_add(std::hint::black_box(1));
        }
        assert!(x > 0);
        assert!(cpu_time(std::process::id()).unwrap() > t0);
    }
}
