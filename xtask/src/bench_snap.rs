//! Bench rows of issue 7, run by `cargo xtask bench` after the cold-boot rows, on a second
//! daemon with golden snapshots on (the first daemon keeps them off, so its create row stays a
//! cold boot):
//!
//! (g) create to exec-ready (`POST /v1/sandboxes` + one exec `true`) two ways: taking a VM of a
//!     warm pool of one (restored from the golden snapshot ahead of time, on a third daemon;
//!     refilled, untimed, before each create), and restoring the golden snapshot on demand
//!     (pool size 0);
//! (h) fork of 10 children: the API answering with 10 ready children (agents connected), and
//!     to one exec `true` done in each (the execs side by side);
//! (i) memory of the 10 idle forks: sum of PSS (shared pages counted once, split between
//!     sharers; `/proc/PID/smaps_rollup`) next to the sum of RSS.

use std::path::Path;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};

use crate::daemon::{Daemon, rss_kib};
use crate::http;

pub struct SnapRows {
    /// (g) create taking a warm-pool VM (restored from the golden snapshot ahead of time).
    pub pool_create: Vec<Duration>,
    /// (g) create restoring the golden snapshot on demand (pool empty).
    pub golden_create: Vec<Duration>,
    /// (h) `POST /fork {count:10}` answered: 10 children ready (agents connected).
    pub fork10_api: Vec<Duration>,
    /// (h) the same, then one exec `true` in every child (run side by side) done.
    pub fork10: Vec<Duration>,
    pub forks_pss_kib: u64,
    pub forks_rss_kib: u64,
    pub forks: usize,
}

const FORKS: usize = 10;

fn pss_kib(pid: u32) -> Option<u64> {
    let s = std::fs::read_to_string(format!("/proc/{pid}/smaps_rollup")).ok()?;
    s.lines()
        .find(|l| l.starts_with("Pss:"))?
        .split_whitespace()
        .nth(1)?
        .parse()
        .ok()
}

fn qemu_pid(home: &Path, id: &str) -> Result<u32> {
    let vm: serde_json::Value = serde_json::from_slice(&std::fs::read(
        home.join("sandboxes").join(id).join("vm.json"),
    )?)?;
    Ok(vm["pid"].as_u64().context("vm.json pid")? as u32)
}

/// `POST /v1/sandboxes`; the new sandbox's id.
fn create(sock: &Path, body: &str) -> Result<String> {
    let (st, out) = http::request(sock, "POST", "/v1/sandboxes", Some(body))?;
    if st != 201 {
        bail!("create failed: HTTP {st}: {out}");
    }
    http::json_str(&out, "id").context("no id")
}

fn exec_true(sock: &Path, id: &str) -> Result<()> {
    let line = http::exec(sock, id, r#"{"argv":["true"]}"#)?;
    if !line.contains("\"exit_code\":0") {
        bail!("`true` failed in {id}: {line}");
    }
    Ok(())
}

pub fn run(
    bin: &Path,
    home: &Path,
    artifacts: &Path,
    mem_mib: u32,
    vcpus: u32,
    reps: usize,
) -> Result<SnapRows> {
    let config = format!(
        "default_memory_mib = {mem_mib}\ndefault_vcpus = {vcpus}\n[pool]\ngolden = true\nsize = 0\n\
         [limits]\nmax_vcpus = {}\n",
        vcpus * (FORKS as u32 + 4)
    );
    println!(
        "==> (g) golden snapshot: first create boots, the snapshot is built in the background"
    );
    let (d, create_body, keep) = start_golden(bin, home, artifacts, &config)?;
    let sock = d.socket();
    println!("==> (g) create restoring the golden snapshot on demand, to exec-ready ({reps}x)");
    let mut golden_create = Vec::new();
    for _ in 0..reps {
        let t = Instant::now();
        let id = create(&sock, &create_body)?;
        exec_true(&sock, &id)?;
        golden_create.push(t.elapsed());
        http::request(&sock, "DELETE", &format!("/v1/sandboxes/{id}"), None)?;
    }

    crate::bench::progress("(g) golden create, on demand", &golden_create);
    let fork_reps = reps.min(3);
    println!("==> (h) fork {FORKS} children to all exec-ready ({fork_reps}x)");
    exec_true(&sock, &keep)?;
    let mut fork10 = Vec::new();
    let mut fork10_api = Vec::new();
    let mut last: Vec<String> = Vec::new();
    for i in 0..fork_reps {
        let t = Instant::now();
        let (st, body) = http::request(
            &sock,
            "POST",
            &format!("/v1/sandboxes/{keep}/fork"),
            Some(&format!(r#"{{"count":{FORKS}}}"#)),
        )?;
        if st != 201 {
            bail!("fork failed: HTTP {st}: {body}");
        }
        let v: serde_json::Value = serde_json::from_str(&body)?;
        let kids: Vec<String> = v["sandboxes"]
            .as_array()
            .context("no children")?
            .iter()
            .filter_map(|s| s["id"].as_str().map(str::to_owned))
            .collect();
        fork10_api.push(t.elapsed());
        if kids.len() != FORKS {
            bail!("fork gave {} children: {body}", kids.len());
        }
        // The children are independent machines: an agent uses them side by side.
        std::thread::scope(|s| {
            let runs: Vec<_> = kids
                .iter()
                .map(|k| s.spawn(|| exec_true(&sock, k)))
                .collect();
            runs.into_iter()
                .try_for_each(|r| r.join().expect("exec thread panicked"))
        })?;
        fork10.push(t.elapsed());
        if i + 1 < fork_reps {
            for k in &kids {
                http::request(&sock, "DELETE", &format!("/v1/sandboxes/{k}"), None)?;
            }
        } else {
            last = kids;
        }
    }

    crate::bench::progress("(h) fork 10, API", &fork10_api);
    crate::bench::progress("(h) fork 10 + exec in each", &fork10);
    println!("==> (i) memory of {FORKS} idle forks");
    std::thread::sleep(Duration::from_secs(2));
    let (mut pss, mut rss) = (0u64, 0u64);
    for k in &last {
        let pid = qemu_pid(home, k)?;
        pss += pss_kib(pid).context("PSS")?;
        rss += rss_kib(pid).context("RSS")?;
    }
    for k in &last {
        http::request(&sock, "DELETE", &format!("/v1/sandboxes/{k}"), None)?;
    }
    http::request(&sock, "DELETE", &format!("/v1/sandboxes/{keep}"), None)?;
    d.stop()?;
    let pool_create = pool_rows(bin, &home.join("pool"), artifacts, mem_mib, vcpus, reps)?;
    Ok(SnapRows {
        pool_create,
        golden_create,
        fork10_api,
        fork10,
        forks_pss_kib: pss,
        forks_rss_kib: rss,
        forks: last.len(),
    })
    .inspect(|r| {
        println!(
            "    (i) {} forks: PSS {} KiB, RSS {} KiB",
            r.forks, r.forks_pss_kib, r.forks_rss_kib
        )
    })
}

/// A daemon on `home` with `config`, its first sandbox (a cold boot on an empty workspace) and
/// the golden snapshot that boot leads to, complete. Returns the create body for more of them.
fn start_golden(
    bin: &Path,
    home: &Path,
    artifacts: &Path,
    config: &str,
) -> Result<(Daemon, String, String)> {
    let d = Daemon::start(bin, home, artifacts, config)?;
    let ws = crate::util::beside(home, "ws-snap")?;
    let body = format!(r#"{{"workspace":{{"host_path":"{}"}}}}"#, ws.display());
    let first = create(&d.socket(), &body)?;
    wait_golden(home)?;
    Ok((d, body, first))
}

/// Wait until a golden snapshot of `home` is complete (`golden.json` written).
fn wait_golden(home: &Path) -> Result<()> {
    let deadline = Instant::now() + Duration::from_secs(300);
    let golden = home.join("golden");
    while !std::fs::read_dir(&golden)
        .map(|mut r| r.any(|e| e.is_ok_and(|e| e.path().join("golden.json").exists())))
        .unwrap_or(false)
    {
        if Instant::now() > deadline {
            bail!("no golden snapshot after 300 s");
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    Ok(())
}

/// `tryboxi_pool_ready` from `GET /metrics`.
fn pool_ready(sock: &Path) -> Result<u64> {
    let v = http::metrics(sock, &["tryboxi_pool_ready"])?;
    Ok(v[0].unwrap_or(0.0) as u64)
}

/// (g) with a warm pool of one: every create takes the pool VM (restored from the golden
/// snapshot in the background, agent connected, identity set); the pool is refilled (untimed)
/// before the next one.
fn pool_rows(
    bin: &Path,
    home: &Path,
    artifacts: &Path,
    mem_mib: u32,
    vcpus: u32,
    reps: usize,
) -> Result<Vec<Duration>> {
    let config = format!(
        "default_memory_mib = {mem_mib}\ndefault_vcpus = {vcpus}\n[pool]\ngolden = true\nsize = 1\n"
    );
    println!(
        "==> (g) warm pool of 1: first create boots, then the golden snapshot and the pool VM"
    );
    let (d, create_body, first) = start_golden(bin, home, artifacts, &config)?;
    let sock = d.socket();
    println!("==> (g) create taking the warm-pool VM, to exec-ready ({reps}x)");
    let mut out = Vec::new();
    for _ in 0..reps {
        let deadline = Instant::now() + Duration::from_secs(300);
        while pool_ready(&sock)? < 1 {
            if Instant::now() > deadline {
                bail!("the warm pool was not refilled within 300 s");
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        let t = Instant::now();
        let id = create(&sock, &create_body)?;
        exec_true(&sock, &id)?;
        out.push(t.elapsed());
        http::request(&sock, "DELETE", &format!("/v1/sandboxes/{id}"), None)?;
    }
    crate::bench::progress("(g) create from the warm pool", &out);
    http::request(&sock, "DELETE", &format!("/v1/sandboxes/{first}"), None)?;
    d.stop()?;
    Ok(out)
}
